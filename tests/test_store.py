"""The store: keys, JSON index, atomic writes, eviction, partial reads."""

import json

import pytest
import torch

from layerscope.errors import StoreError
from layerscope.store import Store, atomic_save_tensors, make_key


def test_make_key_is_canonical():
    assert make_key({"a": 1, "b": [1, 2]}) == make_key({"b": [1, 2], "a": 1})
    assert make_key({"a": 1}) != make_key({"a": 2})
    assert len(make_key("x")) == 24


def test_json_round_trip_and_no_pickle(store):
    value = {"entropy": [1.5, 2.0], "name": "x", "nested": {"k": None}}
    store.put_json("analysis", "abc", value)
    assert store.get_json("analysis", "abc") == value
    assert store.get_json("analysis", "missing") is None
    # every value in the index is stored as JSON bytes, never with diskcache's pickle mode (4)
    modes = {m for (m,) in store.index._sql("SELECT mode FROM Cache").fetchall()}
    assert modes and 4 not in modes


def test_interrupted_tensor_write_leaves_nothing(tmp_path, monkeypatch):
    import layerscope.store as store_mod

    def boom(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(store_mod, "save_file", boom)
    target = tmp_path / "chunk.safetensors"
    with pytest.raises(KeyboardInterrupt):
        atomic_save_tensors(target, {"x": torch.zeros(3)})
    assert list(tmp_path.iterdir()) == []


def test_eviction_removes_least_recently_used(tmp_path):
    store = Store(tmp_path)
    for i, name in enumerate(["old", "mid", "new"]):
        d = store.path("drafts", name)
        d.mkdir(parents=True)
        (d / "w.bin").write_bytes(b"x" * 1000)
        store.index.set(f"used/drafts/{name}", 100.0 + i)
    store.touch("drafts", "old")  # now the most recent
    removed = store.evict(limit_bytes=2000)
    assert removed == ["drafts/mid"]
    assert store.path("drafts", "old").exists() and store.path("drafts", "new").exists()
    assert store.evict(limit_bytes=0) == ["drafts/new", "drafts/old"]


def test_missing_capture_is_a_clear_error(store):
    with pytest.raises(StoreError, match="No capture with key"):
        store.open_capture("deadbeef")


def test_env_variable_chooses_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERSCOPE_STORE", str(tmp_path / "elsewhere"))
    assert Store().root == tmp_path / "elsewhere"
