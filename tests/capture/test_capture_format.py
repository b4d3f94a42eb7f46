"""A capture written by an earlier version still opens and reads the same (layerscope/capture/format.py).

tests/fixtures/capture-v1/<key>/ is a format-1 capture (tiny-llama:layers=2,hidden=16, 2 builtin prompts,
4 new tokens, 2 chunks) written before the store and the capture format were split into two modules;
expected.json holds what that version read from it (token table, sha256 of every layer's float32 bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from layerscope.capture import format as capture_format
from layerscope.capture.run import capture
from layerscope.capture.stored import list_captures, open_capture, verify_capture
from layerscope.draft.training.train import load_splits
from layerscope.prompts.sets import load_prompts
from layerscope.stats.analysis import AnalysisOptions, analyze
from layerscope.store import Store
from layerscope.target.load import tiny_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "capture-v1"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture
def old_capture(tmp_path):
    """(store, key, expected): the fixture copied into a fresh store."""
    expected = json.loads((FIXTURE / "expected.json").read_text())
    store = Store(tmp_path / "store")
    shutil.copytree(FIXTURE / expected["key"], store.path("captures", expected["key"]))
    yield store, expected["key"], expected
    store.close()


def test_an_old_capture_verifies_and_lists(old_capture):
    store, key, want = old_capture
    assert verify_capture(store, key) == []
    assert verify_capture(store, key[:8]) == []
    [summary] = list_captures(store)
    assert {k: summary[k] for k in want["summary"]} == want["summary"]


def test_an_old_capture_reads_the_same(old_capture):
    store, key, want = old_capture
    cap = open_capture(store, key)
    assert isinstance(cap, capture_format.CaptureReader)
    assert (cap.key, cap.num_tokens, cap.num_layers, cap.hidden_size) == (
        key, want["num_tokens"], want["num_layers"], want["hidden_size"])
    assert [f for f, _ in cap.chunks] == want["chunks"] and len(cap.chunks) == 2
    tokens = cap.tokens()
    for name in ("token_id", "position", "conversation", "is_response"):
        assert tokens[name].tolist() == want[name], name
    assert tokens["token_id"].dtype == torch.long and tokens["is_response"].dtype == torch.bool
    assert digest(tokens["entropy"]) == want["entropy_sha256"]
    for l in range(cap.num_layers + 1):
        x = cap.layer(l)
        assert x.shape == (cap.num_tokens, cap.hidden_size) and x.dtype == torch.float32
        assert digest(x) == want["layer_sha256"][l], f"layer {l}"
    assert digest(cap.prenorm_final()) == want["prenorm_final_sha256"]
    index = torch.tensor([5, 3, 0])
    assert torch.equal(cap.layer(1, index), torch.tensor(want["layer_1_at_5_3_0"], dtype=torch.float32))
    assert torch.equal(cap.layers([0, 2], index), torch.stack([cap.layer(0)[index], cap.layer(2)[index]]))


def test_the_stored_fixture_reads_through_the_format_module():
    path = FIXTURE / json.loads((FIXTURE / "expected.json").read_text())["key"]
    manifest = capture_format.read_manifest(path)
    capture_format.check_chunk_files(path, manifest)
    assert capture_format.verify_capture_files(path) == []
    assert [p.name for _, _, p in capture_format.list_chunks(path)] == [c["file"] for c in manifest["chunks"]]


def test_states_beyond_float16s_range_are_stored_in_bfloat16(tmp_path):
    """A model whose residual stream passes 65504 (Gemma 3's reaches 1e5) is captured in bfloat16, not float16's
    inf: the capture checks, reads back finite and close to the model's own states, analyses to finite statistics
    and trains from finite features. A model that fits keeps float16 (the format as it was)."""
    big = tiny_model(spec="tiny-llama:big")
    with torch.no_grad():
        big.model.get_input_embeddings().weight.mul_(3e6)           # hidden_states[0] alone overflows float16 (~2e5)
    store = Store(tmp_path / "store")
    prompts = load_prompts("builtin", limit=3, seed=0)
    cap = open_capture(store, capture(big, prompts, store, max_new_tokens=4, batch_size=2).key)
    chunk = next(cap.path.glob("chunk-*.safetensors"))
    header = capture_format.read_header(chunk)
    assert header["hidden.0"]["dtype"] == header["prenorm_final"]["dtype"] == "BF16"
    assert verify_capture(store, cap.key) == []
    ids = cap.tokens()["token_id"]
    conv = cap.tokens()["conversation"]
    first = ids[conv == 0].long()
    with torch.no_grad():
        want = big.model.model(input_ids=first[None], output_hidden_states=True).hidden_states[0][0]
    got = cap.layer(0)[conv == 0]
    assert float(want.abs().max()) > capture_format.FLOAT16_MAX and torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-2)
    stats = analyze(cap, store, AnalysisOptions())
    assert all(map(math.isfinite, stats.entropy))
    train, _ = load_splits(cap, torch.zeros(cap.num_tokens, dtype=torch.bool), [0, 2])
    assert train.aux.dtype == torch.bfloat16 and torch.isfinite(train.aux.float()).all()

    store.close()

    small, store = tiny_model(), Store(tmp_path / "small")     # its own store: the two share a fingerprint
    cap = open_capture(store, capture(small, prompts, store, max_new_tokens=4, batch_size=2).key)
    assert capture_format.read_header(next(cap.path.glob("chunk-*.safetensors")))["hidden.0"]["dtype"] == "F16"
    store.close()


def test_listings_agree_with_the_commands_on_damaged_and_incomplete_captures(tiny, tmp_path):
    """A chunk whose bytes changed (same size): `captures` says ok until a read or `captures --verify` checks the
    checksum, then DAMAGED everywhere, and `analyze` refuses it at once; an unfinished capture is named by
    `analyze` as `captures` lists it, with the same fix."""
    import subprocess
    import sys

    from layerscope.capture.run import capture
    from layerscope.capture.stored import list_captures, partial_capture_dir
    from layerscope.prompts.sets import load_prompts
    from layerscope.store import Store

    store = Store(tmp_path / "s")
    key = capture(tiny, load_prompts("builtin", limit=2, seed=0), store, max_new_tokens=4, batch_size=2).key
    chunk = next(store.path("captures", key).glob("chunk-*.safetensors"))
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0xFF                                             # one state byte: size and header unchanged
    chunk.write_bytes(bytes(raw))
    cli = lambda *a: subprocess.run([sys.executable, "-m", "layerscope", *a, "--store", str(store.root)],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    assert [r["state"] for r in list_captures(store)] == ["ok"]
    listed = cli("captures", "--verify")
    assert listed.returncode == 0 and "DAMAGED" in listed.stdout and "does not match its checksum" in listed.stdout
    assert [r["state"] for r in list_captures(store)] == ["damaged"]
    refused = cli("analyze", key)
    assert refused.returncode == 2 and f"Capture {key} is damaged: chunk" in refused.stderr
    partial_capture_dir(store, "ab" * 12).mkdir(parents=True)
    row = next(r for r in list_captures(store, incomplete=True) if r["state"] == "incomplete")
    unfinished = cli("analyze", "abab")
    assert unfinished.returncode == 2 and f"Capture {'ab' * 12} is incomplete: {row['problem']}. {row['fix']}" in unfinished.stderr
