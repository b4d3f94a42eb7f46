"""A capture written by an earlier version still opens and reads the same (layerscope/capture/format.py).

tests/fixtures/capture-v1/<key>/ is a format-1 capture (tiny-llama:layers=2,hidden=16, 2 builtin prompts,
4 new tokens, 2 chunks) written before the store and the capture format were split into two modules;
expected.json holds what that version read from it (token table, sha256 of every layer's float32 bytes).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from layerscope.capture import format as capture_format
from layerscope.capture.stored import list_captures, open_capture, verify_capture
from layerscope.store import Store

FIXTURE = Path(__file__).parent / "fixtures" / "capture-v1"


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
