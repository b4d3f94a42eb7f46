"""Prompt sets: builtin, ShareGPT (and a cut-off ShareGPT-style file), user files, bad input, chat rendering."""

import json
import os
import re

import pytest

from layerscope.errors import PromptSetError
from layerscope.prompts import files, sharegpt
from layerscope.prompts import sets as P
from layerscope.prompts.record import Prompt
from layerscope.prompts.sets import chat_ids, content_hash, load_prompts, prompt_preview


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A private store: this module builds (and caches) its own ShareGPT index there."""
    root = tmp_path_factory.mktemp("store")
    old = os.environ.get("LAYERSCOPE_STORE")
    os.environ["LAYERSCOPE_STORE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("LAYERSCOPE_STORE")
    else:
        os.environ["LAYERSCOPE_STORE"] = old


def write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


# -----------------------------------------------------------------------------
# builtin

def test_builtin_size_categories_ids():
    s = load_prompts("builtin")
    assert s.name == "builtin" and s.warnings == []
    assert len(s) >= 96
    categories = {p.category for p in s}
    assert len(categories) >= 8
    assert {"writing", "coding", "math", "qa", "summarization", "translation", "roleplay", "extraction"} <= categories
    ids = [p.id for p in s]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"builtin/[a-z]+/\d{2}", i) for i in ids)
    assert all(len(p.turns) == 1 and len(p.text) > 30 for p in s)
    assert len({p.text for p in s}) == len(s)
    for p in s:   # passages travel inside the prompt
        if p.category in ("summarization", "extraction"):
            assert "\n\n" in p.text and len(p.text) > 150, p.id


def test_builtin_deterministic_and_stratified():
    assert load_prompts("builtin").content_hash == load_prompts("builtin").content_hash
    a = load_prompts("builtin", limit=16, seed=0)
    assert a.prompts == load_prompts("builtin", limit=16, seed=0).prompts
    assert len(a) == 16 and len({p.category for p in a}) >= 8
    assert [p.id for p in load_prompts("builtin", limit=16, seed=1)] != [p.id for p in a]
    assert load_prompts("builtin", limit=8, seed=0).prompts == a.prompts[:8]
    assert load_prompts("builtin", limit=10_000).prompts == load_prompts("builtin").prompts


# -----------------------------------------------------------------------------
# ShareGPT (the packaged file)

def test_sharegpt_index_of_cut_off_file(store):
    index = sharegpt.sharegpt_index(sharegpt.sharegpt_path())
    assert index["complete"] > 17_000            # measured: 17,671 complete records
    assert index["usable"] == len(index["records"]) > 17_000
    assert index["tail_bytes"] > 0               # the file is cut off mid-record
    assert list((store / "prompts").glob("sharegpt-index-*.json"))


def test_sharegpt_deterministic_by_seed(store):
    a = load_prompts("sharegpt", limit=20, seed=0)
    b = load_prompts("sharegpt", limit=20, seed=0)
    assert a.name == "sharegpt" and len(a) == 20
    assert a.prompts == b.prompts and a.content_hash == b.content_hash
    assert all(p.id.startswith("sharegpt/") and p.category == "sharegpt" and p.text.strip() for p in a)
    c = load_prompts("sharegpt", limit=20, seed=1)
    assert {p.id for p in c} != {p.id for p in a} and c.content_hash != a.content_hash
    assert load_prompts("sharegpt", limit=5, seed=0).prompts == a.prompts[:5]


def test_sharegpt_cached_load_reads_the_index_and_never_scans_the_file_again(store, monkeypatch):
    first = load_prompts("sharegpt", limit=20, seed=0)   # builds the index if this test runs alone

    def no_scan(*a, **k):
        raise AssertionError("the ShareGPT file was scanned again: its cached index was not used")
    monkeypatch.setattr(sharegpt, "JsonArrayScan", no_scan)
    assert load_prompts("sharegpt", limit=20, seed=0).prompts == first.prompts


def test_sharegpt_heldout_disjoint_from_train(store):
    train = load_prompts("sharegpt")
    held = load_prompts("sharegpt-heldout")
    assert held.name == "sharegpt-heldout"
    assert held.prompts == load_prompts("sharegpt", split="heldout").prompts
    train_ids, held_ids = {p.id for p in train}, {p.id for p in held}
    assert not train_ids & held_ids
    usable = sharegpt.sharegpt_index(sharegpt.sharegpt_path())["usable"]
    assert len(train_ids) + len(held_ids) == usable
    assert 0.03 < len(held_ids) / usable < 0.07
    sample = load_prompts("sharegpt-heldout", limit=10, seed=3)
    assert {p.id for p in sample} <= held_ids


def test_sharegpt_more_turns(store):
    one = load_prompts("sharegpt", limit=40, seed=0)
    three = load_prompts("sharegpt", limit=40, seed=0, turns=3)
    assert [p.id for p in one] == [p.id for p in three]
    assert all(len(p.turns) == 1 for p in one)
    assert any(len(p.turns) > 1 for p in three) and all(len(p.turns) <= 3 for p in three)
    assert all(q.turns[0] == p.turns[0] for p, q in zip(one, three))


# -----------------------------------------------------------------------------
# a ShareGPT-style .json file, cut off mid-record

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Café ☕ first question"},
                                  {"from": "gpt", "value": "an answer"},
                                  {"from": "human", "value": "a follow-up"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "greeting"}, {"from": "human", "value": "second"}]},
    {"id": "c", "conversations": []},
    {"id": "d", "conversations": [{"from": "human", "value": 123}, {"from": "human", "value": "   "}]},
    {"id": "e", "conversations": [{"from": "user", "value": "fifth, ünïcödé"}], "category": "mine"},
]


def cut_off_json(tmp_path):
    whole = json.dumps(RECORDS + [{"id": "f", "conversations": [{"from": "human", "value": "tail é"}]}],
                       indent=2, ensure_ascii=False).encode("utf-8")
    return write(tmp_path, "cut.json", whole[:whole.rindex("é".encode()) + 1])   # ends inside a character


def test_json_file_cut_off_mid_record(tmp_path):
    s = load_prompts(str(cut_off_json(tmp_path)))
    assert s.name == "cut.json"
    assert [p.turns for p in s] == [("Café ☕ first question",), ("second",), ("fifth, ünïcödé",)]
    assert [p.id for p in s] == ["file/1", "file/2", "file/5"]
    assert [p.category for p in s] == ["file", "file", "mine"]
    assert any("record 3" in w for w in s.warnings) and any("record 4" in w for w in s.warnings)
    assert "skipped the last" in s.warnings[-1]
    assert load_prompts(str(cut_off_json(tmp_path)), turns=2)[0].turns == ("Café ☕ first question", "a follow-up")


def test_json_scan_small_blocks_and_offsets(tmp_path, monkeypatch):
    path = cut_off_json(tmp_path)
    monkeypatch.setattr(sharegpt, "BLOCK", 7)   # refills inside records and inside multi-byte characters
    scan = sharegpt.JsonArrayScan(path)
    found = list(scan)
    assert [r["id"] for r, *_ in found] == [r["id"] for r in RECORDS]
    data = path.read_bytes()
    for record, offset, length, line in found:
        assert json.loads(data[offset:offset + length]) == record
        assert data[:offset].count(b"\n") + 1 == line
    assert scan.tail_bytes == len(data) - data.rindex(b'{\n    "id": "f"') and scan.count == 5


def test_json_whole_file_and_index(tmp_path, store):
    path = write(tmp_path, "whole.json", json.dumps(RECORDS))   # one line, complete
    s = load_prompts(str(path))
    assert len(s) == 3 and not any("skipped" in w for w in s.warnings)
    index = sharegpt.sharegpt_index(path)
    assert index["complete"] == 5 and index["tail_bytes"] == 0
    assert [r[0] for r in index["records"]] == ["a", "b", "e"]


# -----------------------------------------------------------------------------
# user files

def test_jsonl_formats_and_ids(tmp_path):
    lines = [
        json.dumps({"prompt": "plain prompt", "category": "coding"}),
        "",
        json.dumps({"turns": ["first turn", "", "second turn"]}),
        json.dumps({"conversations": [{"from": "human", "value": "sharegpt style"}]}),
        json.dumps({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "openai style"}]}),
    ]
    s = load_prompts(str(write(tmp_path, "p.jsonl", "\n".join(lines) + "\n")), turns=2)
    assert s.warnings == []
    assert [p.id for p in s] == ["file/1", "file/3", "file/4", "file/5"]
    assert [p.category for p in s] == ["coding", "file", "file", "file"]
    assert [p.turns for p in s] == [("plain prompt",), ("first turn", "second turn"), ("sharegpt style",),
                                    ("openai style",)]


def test_jsonl_malformed_line_reported(tmp_path):
    text = "\n".join([json.dumps({"prompt": "one"}), json.dumps({"prompt": "two"}), "{not json",
                      json.dumps({"text": "no prompt field"}), json.dumps(["a list"]), json.dumps({"prompt": ""}),
                      json.dumps({"prompt": "seven"})])
    s = load_prompts(str(write(tmp_path, "p.jsonl", text)))
    assert [p.text for p in s] == ["one", "two", "seven"]
    assert len(s.warnings) == 4
    assert s.warnings[0].startswith("line 3: not valid JSON")
    assert s.warnings[1].startswith("line 4: no 'prompt'")
    assert s.warnings[2].startswith("line 5: not a JSON object")
    assert s.warnings[3].startswith("line 6:")


def test_all_malformed_refused(tmp_path):
    with pytest.raises(PromptSetError, match=r"no valid prompt.*line 1: not valid JSON"):
        load_prompts(str(write(tmp_path, "bad.jsonl", "{oops\nnot json either\n")))
    with pytest.raises(PromptSetError, match="no valid prompt"):
        load_prompts(str(write(tmp_path, "bad.json", '[{"conversations": [{"from": "gpt", "value": "x"}]}]')))


def test_txt_lines_and_paragraphs(tmp_path):
    s = load_prompts(str(write(tmp_path, "lines.txt", "first prompt\r\n  second prompt  \nthird\n\n\n")))
    assert [p.text for p in s] == ["first prompt", "second prompt", "third"]
    assert [p.id for p in s] == ["file/1", "file/2", "file/3"]
    s = load_prompts(str(write(tmp_path, "paras.txt", "\nPara one,\nline two.\n\n  \nPara two.\n")))
    assert [p.text for p in s] == ["Para one,\nline two.", "Para two."]
    assert [p.id for p in s] == ["file/2", "file/6"] and {p.category for p in s} == {"file"}


def test_csv(tmp_path):
    text = 'category,Prompt\nmath,What is 2+2?\n,"A quoted prompt,\nover two lines"\nonly-one-field\nqa,\nqa,Last one\n'
    s = load_prompts(str(write(tmp_path, "p.csv", text)))
    assert [p.text for p in s] == ["What is 2+2?", "A quoted prompt,\nover two lines", "Last one"]
    assert [p.category for p in s] == ["math", "file", "qa"]
    assert [p.id for p in s] == ["file/2", "file/3", "file/7"]
    assert s.warnings == ["line 5: 1 fields where the header has 2", "line 6: the prompt cell is empty"]
    with pytest.raises(PromptSetError, match="no 'prompt' column"):
        load_prompts(str(write(tmp_path, "q.csv", "question\nwhy?\n")))


def test_user_file_limit_samples(tmp_path):
    path = write(tmp_path, "many.txt", "\n".join(f"prompt number {i}" for i in range(50)))
    a = load_prompts(str(path), limit=10, seed=0)
    assert len(a) == 10 and a.prompts == load_prompts(str(path), limit=10, seed=0).prompts
    assert a.prompts != load_prompts(str(path), limit=10, seed=1).prompts
    assert a.content_hash == content_hash(a.prompts) != load_prompts(str(path)).content_hash


# -----------------------------------------------------------------------------
# bad input: one clear error each

@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.csv", "p.json"])
def test_non_utf8_refused(tmp_path, name):
    with pytest.raises(PromptSetError, match="not UTF-8.*Re-save the file with UTF-8"):
        load_prompts(str(write(tmp_path, name, b'[{"prompt": "caf\xe9"}]\n')))


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.csv", "p.json"])
@pytest.mark.parametrize("content", ["", " \n\n \n"])
def test_empty_refused(tmp_path, name, content):
    with pytest.raises(PromptSetError, match="is empty. Add prompts"):
        load_prompts(str(write(tmp_path, name, content)))


def test_bad_specs_refused(tmp_path):
    with pytest.raises(PromptSetError, match="neither a known set nor an existing file"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(PromptSetError, match="unknown extension '.md'"):
        load_prompts(str(write(tmp_path, "p.md", "a prompt")))
    with pytest.raises(PromptSetError, match="is a directory"):
        load_prompts(str(tmp_path))
    with pytest.raises(PromptSetError, match="not a JSON array"):
        load_prompts(str(write(tmp_path, "obj.json", '{"prompt": "x"}')))
    with pytest.raises(PromptSetError, match="no held-out split"):
        load_prompts("builtin", split="heldout")
    with pytest.raises(PromptSetError, match="split 'test' is unknown"):
        load_prompts("sharegpt", split="test")


@pytest.mark.parametrize("limit", [0, -3, "5", 2.5])
def test_bad_limit_refused(limit):
    with pytest.raises(PromptSetError, match="limit") as e:
        load_prompts("builtin", limit=limit)
    assert "Pass a limit of 1 or more" in str(e.value)


# -----------------------------------------------------------------------------
# rendering

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer(chat_template=None, add_bos=False):
    """A byte-level BPE with no merges (one token per byte) plus four special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "<|user|>", "<|assistant|>", "<|end|>"])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>")
    fast.chat_template = chat_template
    return fast


def test_chat_ids_applies_template():
    tok = byte_tokenizer(TEMPLATE)
    prompt = Prompt("file/1", "file", ("Hi é", "and more"))
    ids = chat_ids(tok, prompt)
    assert all(isinstance(i, int) for i in ids)
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    assert ids[-2:] == tok.convert_tokens_to_ids(["<|end|>", "<|assistant|>"])
    assert len(ids) == 1 + len("Hi é".encode()) + 2
    assert tok.decode(ids) == "<|user|>Hi é<|end|><|assistant|>"
    assert tok.decode(chat_ids(tok, prompt, turns=2)) == "<|user|>Hi é<|end|><|user|>and more<|end|><|assistant|>"


def test_chat_ids_plain_text_without_template():
    prompt = Prompt("file/1", "file", ("Hi é",))
    plain = chat_ids(byte_tokenizer(), prompt)
    assert len(plain) == len("Hi é".encode()) and byte_tokenizer().decode(plain) == "Hi é"
    with_bos = chat_ids(byte_tokenizer(add_bos=True), prompt)
    assert with_bos == [256] + plain


def test_fitting_prompts_replace_long_ones_by_the_next_of_the_sample(tmp_path):
    lines = [("x" * 40 if i % 3 == 0 else f"short {i}") for i in range(30)]
    path = write(tmp_path, "mixed.txt", "\n".join(lines))
    tok = byte_tokenizer()
    sample = load_prompts(str(path), limit=30, seed=3).prompts           # the whole seeded order
    fit = P.load_fitting_prompts(str(path), tok, limit=12, max_tokens=20, seed=3)
    expected = [p for p in sample if len(p.text) <= 20][:12]
    assert fit.prompts == expected and len(fit) == 12
    assert fit.content_hash == content_hash(expected)
    dropped = sum(len(p.text) > 20 for p in sample[:sample.index(expected[-1]) + 1])
    assert dropped > 0 and fit.warnings == [f"left out {dropped} prompts longer than 20 tokens, "
                                            "taking the next ones of the sample instead"]
    assert load_prompts(str(path), limit=5, seed=3).prompts == sample[:5]   # prefix-stable up to the whole set
    short = P.load_fitting_prompts(str(path), tok, limit=25, max_tokens=20, seed=3)
    assert len(short) == 20 and short.warnings[-1] == "only 20 prompts of mixed.txt fit in 20 tokens"
    with pytest.raises(PromptSetError, match="no prompt of mixed.txt fits in 3 tokens"):
        P.load_fitting_prompts(str(path), tok, limit=5, max_tokens=3)


def test_prompt_preview():
    s = load_prompts("builtin")
    rows = prompt_preview(s, n=3)
    assert [r["id"] for r in rows] == [p.id for p in s.prompts[:3]]
    assert set(rows[0]) == {"id", "category", "text", "turns"}
    long = P.PromptSet("x", [Prompt("x/1", "x", ("y" * 500,))], "h")
    text = prompt_preview(long)[0]["text"]
    assert len(text) == 200 and text.endswith("…")


# -----------------------------------------------------------------------------
# hostile files: special files, size caps, streaming

def test_special_files_are_refused_without_reading(tmp_path):
    import os
    import threading

    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)                 # no writer: a blocking read would hang for ever
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(PromptSetError, load_prompts, str(fifo))))
    t.start()
    t.join(10)
    assert done and "not a regular file" in str(done[0].value)
    link = tmp_path / "zero.txt"
    link.symlink_to("/dev/zero")    # endless bytes behind a .txt name
    with pytest.raises(PromptSetError, match="not a regular file"):
        load_prompts(str(link))


def test_file_over_the_size_cap_is_refused_at_once(tmp_path, monkeypatch):
    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:      # sparse: no disk used
        f.truncate(files.MAX_FILE_BYTES + 1)
    with pytest.raises(PromptSetError, match="over the 1024 MiB limit"):
        load_prompts(str(path))


@pytest.mark.parametrize("name", ["p.jsonl", "p.txt", "p.csv"])
def test_a_huge_line_is_left_out_and_never_held_in_memory(tmp_path, name):
    import tracemalloc

    huge = "x" * (20 * 2**20)
    body = {"p.jsonl": '{"prompt": "one"}\n{"prompt": "%s"}\n{"prompt": "three"}\n' % huge,
            "p.txt": f"one\n{huge}\nthree\n", "p.csv": f"prompt\none\n{huge}\nthree\n"}[name]
    path = write(tmp_path, name, body)
    del huge, body
    tracemalloc.start()
    s = load_prompts(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [p.text for p in s] == ["one", "three"]
    assert any("longer than 1 MiB, left out" in w for w in s.warnings)
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB while reading a 20 MiB line"


def test_json_record_over_the_cap_is_refused(tmp_path):
    path = write(tmp_path, "p.json", '[{"prompt": "ok"}, {"prompt": "%s"}]' % ("y" * (3 * 2**20)))
    with pytest.raises(PromptSetError, match="record at line 1 is longer than 1 MiB"):
        load_prompts(str(path))


def test_a_paragraph_over_the_prompt_cap_is_left_out(tmp_path):
    line = "z" * (2**19)
    path = write(tmp_path, "p.txt", "short one\n\n" + "\n".join([line] * 3) + "\n\nshort two\n")
    s = load_prompts(str(path))
    assert [p.text for p in s] == ["short one", "short two"]
    assert s.warnings == [f"file/3: longer than {files.MAX_PROMPT_CHARS:,} characters, left out"]
