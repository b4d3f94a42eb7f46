"""Hostile inputs: damaged drafts, model configs, archives and option values are each refused in one line
before anything large is allocated, through the real CLI (in this process) where a command reads them."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tracemalloc
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from layerscope.draft.checkpoint import save_draft
from layerscope.draft.model import DraftConfig, DraftHead
from layerscope.errors import DraftError, ModelSpecError, SessionError
from layerscope.session import share
from layerscope.store import Store
from layerscope.target import config as target_config
from tests.helpers import untrained_draft
from tests.reliability.test_reliability import cli_line
from tests.session.test_session import session_with_drafts  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def base_draft(tmp_path_factory, tiny):
    return save_draft(tmp_path_factory.mktemp("drafts") / "base", untrained_draft(tiny.model), {"aux_layers": [1, 2, 3]},
                      target=tiny)


def damaged(base, tmp_path, config=None, tensors=None, raw=None):
    """A copy of `base` with config.json fields replaced, tensors changed, or model.safetensors replaced by `raw`."""
    path = tmp_path / "draft"
    shutil.copytree(base, path)
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, path / "model.safetensors")
    if raw is not None:
        (path / "model.safetensors").write_bytes(raw)
    return path


def _negative_d2t(t):
    t["d2t"][5] = -1000


def _duplicate_d2t(t):
    t["d2t"][1] = t["d2t"][0] - 1        # draft ids 0 and 1 both map to the same target id


DRAFTS = {     # name: (damage, what the one line says)
    "huge intermediate_size": (dict(config={"intermediate_size": 10**9}), "intermediate_size must be in [1, "),
    "huge draft_vocab_size": (dict(config={"draft_vocab_size": 10**9}), "draft_vocab_size must be in [1, "),
    "negative heads": (dict(config={"num_attention_heads": -3}), "num_attention_heads must be in [1, "),
    "negative d2t": (dict(tensors=_negative_d2t), "outside the target vocabulary"),
    "d2t twice one id": (dict(tensors=_duplicate_d2t), "d2t and t2d disagree"),
    "not safetensors": (dict(raw=b"not a safetensors file at all " * 20), "is not a readable safetensors file"),
    "config and weights differ": (dict(config={"intermediate_size": 64}), "does not match its config.json"),
}


@pytest.mark.parametrize("name", list(DRAFTS))
@pytest.mark.parametrize("command", ["check-draft", "bench", "export"])
def test_damaged_draft_is_one_line_in_every_command(name, command, base_draft, tmp_path, capsys):
    damage, said = DRAFTS[name]
    path = damaged(base_draft, tmp_path, **damage)
    store = ["--store", str(tmp_path / "store")]
    argv = {"check-draft": ["check-draft", path, "--target", "tiny-llama"],
            "bench": ["bench", "--draft", path, "--model", "tiny-llama", "--limit", "1", "--max-new-tokens", "2",
                      "--no-peers", *store],
            "export": ["export", path, "--for", "vllm", "--out", tmp_path / "out", "--target", "tiny-llama", *store]}
    code, line = cli_line(capsys, *argv[command])
    assert code == 2 and said in line, line
    assert not (tmp_path / "out").exists()


def test_draft_beyond_the_memory_is_refused_before_it_is_built():
    config = DraftConfig(hidden_size=2**16, target_hidden_size=2**16, vocab_size=2**22, draft_vocab_size=2**22,
                         aux_layers=[1, 2, 3], num_attention_heads=64, num_key_value_heads=8, head_dim=1024,
                         intermediate_size=2**18)
    with pytest.raises(DraftError, match=r"The draft needs about \d+\.\d GiB .* of memory is available"):
        DraftHead(config)


def test_model_config_with_a_hundred_thousand_layers_is_refused(tmp_path):
    config = LlamaConfig(num_hidden_layers=100_000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=260)
    with pytest.raises(ModelSpecError, match=r"num_hidden_layers in the config of m must be at most 1024"):
        target_config.check_config(config, "m", 4)
    deep = LlamaConfig(num_hidden_layers=1000, hidden_size=8, intermediate_size=16, num_attention_heads=1,
                       num_key_value_heads=1, vocab_size=260)
    target_config.check_config(deep, "m", 4)        # the layers' own cost counts, and 1000 small ones fit


def test_vocab_maps_are_checked_wherever_a_head_is_built(tiny):
    head = untrained_draft(tiny.model)
    d2t, t2d = head.d2t.clone(), head.t2d.clone()
    d2t[-1] = 10**6
    with pytest.raises(DraftError, match="outside the target vocabulary"):
        DraftHead(head.config, d2t=d2t, t2d=t2d)
    with pytest.raises(DraftError, match="whole numbers/booleans"):
        DraftHead(head.config, d2t=head.d2t.float(), t2d=t2d)
    assert torch.equal(DraftHead(head.config, d2t=head.d2t, t2d=head.t2d).d2t, head.d2t)


# ---------------------------------------------------------------------------- session archives

def _archive_with(data: bytes, entry: str, payload: bytes, listed: int | None = None) -> bytes:
    """`data` with draft `entry`'s model.safetensors replaced by `payload` (deflated), session.json listing
    `listed` bytes for it (default: its true size) and its true sha256."""
    src = zipfile.ZipFile(io.BytesIO(data))
    doc = json.loads(src.read("session.json"))
    d = next(d for d in doc["drafts"] if d["entry"] == entry)
    d["files"]["model.safetensors"] = {"bytes": len(payload) if listed is None else listed,
                                       "sha256": hashlib.sha256(payload).hexdigest()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            name = info.filename
            z.writestr(name, json.dumps(doc).encode() if name == "session.json" else
                       payload if name == f"drafts/{entry}/model.safetensors" else src.read(name))
    return buf.getvalue()


@pytest.mark.parametrize("payload, listed, said", [
    (bytes(64 * 2**20), None, "would inflate"),                      # 64 MiB of zeros in a few hundred KiB
    (os.urandom(3 * 2**20), 1000, "session.json lists 1000"),         # a size other than the listed one
])
def test_session_archive_members_are_sized_before_they_inflate(tmp_path, store, session_with_drafts, payload, listed,
                                                                said):
    data = _archive_with(share.export_bytes(session_with_drafts, drafts=True), "b" * 24, payload, listed)
    other = Store(tmp_path / "other-store")
    try:
        tracemalloc.start()
        with pytest.raises(SessionError, match=said):
            share.import_archive(data, other, source="shared.zip")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 2 * 2**20, peak                # nothing was inflated
        assert not (tmp_path / "other-store" / "drafts").exists() or not list((tmp_path / "other-store" / "drafts").iterdir())
    finally:
        tracemalloc.stop()
        other.close()


# ---------------------------------------------------------------------------- numeric options, per command

@pytest.fixture(scope="module")
def a_capture(tiny_capture):
    return tiny_capture.key


OPTIONS = [    # (argv after the command, what the one line says)
    ("bench", ["--max-new-tokens", "1000000000"], "--max-new-tokens must be in [1, 1048576]"),
    ("bench", ["--max-new-tokens", "0"], "--max-new-tokens must be in [1, 1048576]"),
    ("bench", ["--max-new-tokens", "1024"], "is more than the 1024 tokens of tiny-llama's context"),
    ("bench", ["--max-prompt-tokens", "-1"], "--max-prompt-tokens must be in [1, 1048576]"),
    ("profile", ["--max-tokens", "1000000000"], "--max-tokens must be in [2, 512]"),
    ("profile", ["--max-tokens", "1"], "--max-tokens must be in [2, 512]"),
    ("profile", ["--repeats", "1000000000"], "--repeats must be in [1, 50]"),
    ("profile", ["--repeats", "0"], "--repeats must be in [1, 50]"),
    ("train-draft", ["--threads", "10000"], "--threads must be in [1, "),
    ("train-draft", ["--threads", "0"], "--threads must be in [1, "),
    ("train-draft", ["--model", "tiny-llama", "--prompts", "builtin", "--max-new-tokens", "1000", "--tokens", "1k"],
     "--max-prompt-tokens 256 plus --max-new-tokens 1000 is more than the 1024 tokens"),
    ("train-draft", ["--model", "tiny-llama", "--prompts", "builtin", "--max-new-tokens", "900", "--tokens", "1k"],
     "--max-prompt-tokens 256 plus --max-new-tokens 900 is more than the 1024 tokens"),
    ("study", ["--random-sets", "1000000"], "--random-sets must be in [0, 64]"),
    ("study", ["--random-sets", "-1"], "--random-sets must be in [0, 64]"),
    ("study", ["--k", "0"], "--k must be in [1, 64]"),
    ("study", ["--sets-per-pass", "0"], "--sets-per-pass must be at least 1"),
]


@pytest.mark.parametrize("command, argv, said", OPTIONS, ids=[f"{c} {' '.join(a)}" for c, a, _ in OPTIONS])
def test_numeric_option_extremes_are_one_line(command, argv, said, a_capture, session_store, tmp_path, capsys):
    store = ["--store", str(session_store.root)]
    base = {"bench": ["bench", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "1", "--no-peers"],
            "profile": ["profile", "--model", "tiny-llama"],
            "train-draft": ["train-draft", a_capture, "--layers", "1,2", "--steps", "1", "--out", tmp_path / "d"]
            if "--model" not in argv else ["train-draft", "--layers", "1,2", "--out", tmp_path / "d"],
            "study": ["study", a_capture, "--model", "tiny-llama", "--prompts", "builtin"]}[command]
    code, line = cli_line(capsys, *base, *argv, *store)
    assert code == 2 and said in line, line


def test_the_free_space_refusal_names_its_margin(tmp_path, monkeypatch):
    from layerscope import disk
    from layerscope.store import StoreWriteError

    monkeypatch.setattr(disk, "free_bytes", lambda directory: 27 * 2**20)      # 27 MiB free, 22.6 MiB needed
    with pytest.raises(StoreWriteError, match=r"keeps 5% more plus 8 MiB .*\(31\.7 MiB in all\).* 27\.0 MiB free"):
        disk.need_space(tmp_path, int(22.6 * 2**20), "the capture")
