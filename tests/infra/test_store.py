"""The store: keys, JSON index, atomic writes, eviction, partial reads."""

import ctypes
import hashlib
import json
import os
import pickle
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import layerscope.store as store_mod
from layerscope.capture.format import CaptureReader
from layerscope.capture.stored import list_captures, open_capture, verify_capture
from layerscope.commands import cli
from layerscope.errors import StoreError
from layerscope.stats.analysis import AnalysisOptions, analysis_key, analyze
from layerscope.store import (
    RUN_CACHE,
    Store,
    StoreWarning,
    _MemoryIndex,
    atomic_save_tensors,
    atomic_write_json,
    make_key,
)
from layerscope.ui.tasks import save_upload


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


def test_a_planted_pickle_value_is_never_unpickled(tmp_path):
    """A value whose row says diskcache's pickle mode (4) reads as missing: unpickling it would run its code."""
    class Planted:
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "ran"),))

    store = Store(tmp_path / "s")
    store.put_json("analysis", "abc", {"x": 1})
    store.close()
    db = sqlite3.connect(store.root / "index" / "cache.db")
    db.execute("UPDATE Cache SET mode = 4, value = ?", (pickle.dumps(Planted()),))
    db.commit()
    db.close()
    with pytest.warns(StoreWarning, match="damaged value"):
        assert Store(store.root).get_json("analysis", "abc") is None
    assert not (tmp_path / "ran").exists()


def test_an_index_read_in_place_refuses_a_layout_it_does_not_know(tmp_path):
    """The read-only index reads diskcache's table itself: a table without the columns it reads is not read
    (every value a miss), never read wrongly."""
    store = Store(tmp_path / "s")
    store.put_json("analysis", "abc", {"x": 1})
    store.close()
    index = _MemoryIndex(store.root / "index")
    assert index.problem is None and index.get("analysis/abc") == {"x": 1}
    index.close()
    db = sqlite3.connect(store.root / "index" / "cache.db")
    db.execute("ALTER TABLE Cache RENAME COLUMN expire_time TO expires")
    db.close()                       # checkpoints the write-ahead log, which an immutable reader does not read
    index = _MemoryIndex(store.root / "index")
    assert "expire_time" in index.problem and index.get("analysis/abc") is None


def test_interrupted_tensor_write_leaves_nothing(tmp_path, monkeypatch):
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
        open_capture(store, "deadbeef")


def test_env_variable_chooses_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERSCOPE_STORE", str(tmp_path / "elsewhere"))
    assert Store().root == tmp_path / "elsewhere"


# ---------------------------------------------------------------------------- integrity




@pytest.fixture
def copied(tiny_capture, store):
    """A private copy of the tiny capture in a fresh store, free to damage: (store, key, path)."""
    path = store.path("captures", tiny_capture.key)
    shutil.copytree(tiny_capture.path, path)
    return store, tiny_capture.key, path


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, m):
    (path / "manifest.json").write_text(json.dumps(m))


def test_manifest_records_size_and_checksum_of_every_chunk(tiny_capture):
    for c in tiny_capture.manifest["chunks"]:
        data = (tiny_capture.path / c["file"]).read_bytes()
        assert c["bytes"] == len(data) and c["sha256"] == hashlib.sha256(data).hexdigest()


def test_flipped_byte_is_never_used_nor_cached(copied):
    store, key, path = copied
    chunk = path / _manifest(path)["chunks"][-1]["file"]
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 0xFF                              # inside the tensor data: the header still parses
    chunk.write_bytes(bytes(data))
    cap = open_capture(store, key)                 # the cheap check cannot see it (same size, same header)
    options = AnalysisOptions(min_entropy=0.0, max_tokens=None)
    with pytest.raises(StoreError, match=f"Capture {key} is damaged: chunk .* does not match its checksum"):
        analyze(cap, store, options)
    assert store.get_json("analysis", analysis_key(key, options)) is None
    assert any("does not match its checksum" in p for p in verify_capture(store, key))
    assert cli.main(["verify", key[:8], "--store", str(store.root)]) == 1
    assert cli.main(["verify", "--delete", "--store", str(store.root)]) == 0
    assert not path.exists() and list_captures(store) == []


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.update(tokens=m["tokens"] + 1), "'tokens' is"),
    (lambda m: (m["chunks"][0].update(tokens=m["chunks"][0]["tokens"] - 1), m.update(tokens=m["tokens"] - 1)),
     "tensor hidden.0 is F16"),      # consistent counts that the chunk's own header contradicts
    (lambda m: m.pop("num_layers"), "'num_layers' must be an integer"),
    (lambda m: m["chunks"][0].update(file="../../../etc/passwd"), "file name '../../../etc/passwd' is not"),
    (lambda m: m["chunks"][0].update(sha256="zz"), "'sha256' must be 64 hex"),
    (lambda m: m.update(chunks=m["chunks"][1:]), "does not continue at conversation 0"),
    (lambda m: m.update(key="0" * 24), "is not the directory's name"),
    (lambda m: m.update(hidden_size=True), "'hidden_size' must be an integer"),
])
def test_edited_manifest_is_refused_with_key_and_fix(copied, edit, problem):
    store, key, path = copied
    m = _manifest(path)
    edit(m)
    _write_manifest(path, m)
    with pytest.raises(StoreError, match="layerscope verify") as e:
        open_capture(store, key)
    assert key in str(e.value) and problem in str(e.value)
    [row] = list_captures(store)                  # still listed, with its problem, and listing does not fail
    assert row["key"] == key and problem in row["problem"]


@pytest.mark.parametrize("damage, problem", [
    (lambda f: f.write_bytes(f.read_bytes()[:-100]), "bytes, the manifest says"),
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.write_bytes(b"not a safetensors file at all"), "bytes, the manifest says"),
])
def test_damaged_chunk_file_is_refused_on_open(copied, damage, problem):
    store, key, path = copied
    damage(path / _manifest(path)["chunks"][0]["file"])
    with pytest.raises(StoreError, match=problem):
        open_capture(store, key)
    assert cli.main(["verify", "--store", str(store.root)]) == 1


def test_chunk_replaced_by_a_symlink_is_refused(copied, tmp_path):
    store, key, path = copied
    chunk = path / _manifest(path)["chunks"][0]["file"]
    outside = tmp_path / "outside.safetensors"
    shutil.move(chunk, outside)
    chunk.symlink_to(outside)
    with pytest.raises(StoreError, match="is missing"):
        open_capture(store, key)


def test_keys_and_prefixes_are_checked(copied):
    store, key, path = copied
    for bad in ("../captures", "*", key + "/..", "", "x" * 30):
        with pytest.raises(StoreError, match="is not a capture key"):
            open_capture(store, bad)
    twin = store.path("captures", key[:4] + ("1" if key[4] == "0" else "0") * 20)   # shares 4 characters
    shutil.copytree(path, twin)
    with pytest.raises(StoreError, match=f"matches 2 captures: .*{key}"):
        open_capture(store, key[:4])
    assert open_capture(store, key[:5]).key == key


def test_temporary_and_partial_names_are_never_listed(copied):
    store, key, path = copied
    shutil.copytree(path, path.with_name(f"{key}.partial"))
    shutil.copytree(path, path.with_name(f".{key}.deleting-1"))
    assert [r["key"] for r in list_captures(store)] == [key]


def test_reader_refuses_a_directory_not_named_by_its_key(copied, tmp_path):
    store, key, path = copied
    other = tmp_path / "renamed"
    shutil.copytree(path, other)
    with pytest.raises(StoreError, match="not the directory's name"):
        CaptureReader(other)


# ---------------------------------------------------------------------------- index, read-only, full disk

def test_damaged_index_is_replaced_and_the_entries_stay(copied):
    store, key, path = copied
    store.put_json("analysis", "abc", {"x": 1})
    store.close()
    (store.root / "index" / "cache.db").write_bytes(b"this is not a sqlite database" * 100)
    fresh = Store(store.root)
    with pytest.warns(StoreWarning, match="started a new one .the entries on disk are intact"):
        rows = list_captures(fresh)
        assert fresh.get_json("analysis", "abc") is None        # the cache is gone, not wrong
    assert [r["key"] for r in rows] == [key] and len(list(store.root.glob(".index.damaged-*"))) == 1
    fresh.put_json("analysis", "abc", {"x": 2})
    assert fresh.get_json("analysis", "abc") == {"x": 2}
    assert cli.main(["captures", "--store", str(store.root)]) == 0
    fresh.close()


def _as_other_user(argv, **kw):
    """Run argv bound by permission bits: as root, without the capabilities that override them."""
    def drop():
        if os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            for cap in (1, 2, 3):    # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, out of the bounding set
                if libc.prctl(24, cap, 0, 0, 0) != 0:     # PR_CAPBSET_DROP
                    os._exit(99)
    env = dict(os.environ, HOME="/tmp", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(argv, preexec_fn=drop, env=env, capture_output=True, text=True, timeout=120, **kw)


def test_read_only_store_lists_and_reads(tiny_capture):
    top = Path(tempfile.mkdtemp(prefix="ls-readonly-"))     # outside pytest's private tmp: another user reads it
    os.chmod(top, 0o755)
    store = Store(top / "store")
    key = tiny_capture.key
    shutil.copytree(tiny_capture.path, store.path("captures", key))
    store.put_json("analysis", "abc", {"x": 1})
    store.close()
    for p in [store.root, *store.root.rglob("*")]:
        os.chmod(p, 0o555 if p.is_dir() else 0o444)
    try:
        code = ("import sys, warnings; from layerscope.store import Store; "
                "from layerscope.capture.stored import list_captures, open_capture; s = Store(sys.argv[1]); "
                "print([r['key'] for r in list_captures(s)], s.get_json('analysis', 'abc')); "
                "c = open_capture(s, sys.argv[2][:6]); print(c.num_tokens == int(c.tokens()['token_id'].numel()))")
        r = _as_other_user([sys.executable, "-c", code, str(store.root), key])
        if r.returncode == 99:
            pytest.skip("cannot drop root's file capabilities here")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:2] == [f"['{key}'] {{'x': 1}}", "True"]
        r = _as_other_user([sys.executable, "-m", "layerscope.commands.cli", "captures", "--store", str(store.root)])
        assert r.returncode == 0 and key in r.stdout, r.stderr
        r = _as_other_user([sys.executable, "-m", "layerscope.commands.cli", "capture", "--model", "tiny-llama", "--limit", "1",
                            "--max-new-tokens", "2", "--store", str(store.root)])
        assert r.returncode == 2 and "read-only" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        for p in [store.root, *store.root.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        shutil.rmtree(top)


def test_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path):
    """A real write failure: the child may write no file over 20 kB (RLIMIT_FSIZE, as a full quota would)."""
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1]))); "
            "from layerscope.commands import cli; sys.exit(cli.main(sys.argv[2:]))")
    args = ["capture", "--model", "tiny-llama", "--limit", "4", "--batch-size", "2", "--max-new-tokens", "3",
            "--store", str(tmp_path / "s"), "--json"]
    r = subprocess.run([sys.executable, "-c", code, "20000", *args], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "No space left" in lines[0] and "Traceback" not in r.stderr
    store = Store(tmp_path / "s")
    assert list_captures(store) == []
    assert not [p for p in store.root.rglob("*.tmp")]          # no temporary file left behind
    r = subprocess.run([sys.executable, "-c", code, str(2**30), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompts"] == 4 and verify_capture(store, json.loads(r.stdout)["key"]) == []


def test_store_files_are_readable_by_the_group_and_others(tmp_path):
    """A store may be shared: tensors (capture chunks, checkpoints) and JSON alike are written 0644, whatever
    the temporary file they went through was made with."""


    atomic_save_tensors(tmp_path / "chunk.safetensors", {"x": torch.zeros(3)})
    atomic_write_json(tmp_path / "a.json", {"a": 1})
    for f in ("chunk.safetensors", "a.json"):
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == 0o644, f


def test_uploads_count_in_the_size_limit_and_go_least_recently_used_first(tmp_path):
    store = Store(tmp_path)
    d = store.path("drafts", "mine")
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(b"x" * 1000)
    store.index.set("used/drafts/mine", time.time() + 60)          # the draft was used after the upload
    path = save_upload(store, "my prompts.jsonl", b'{"prompt": "hi"}\n' * 100)
    assert path.is_file() and path.parent.parent == store.root / "uploads"
    assert store.evict(limit_bytes=1500) == [f"uploads/{path.parent.name}"]        # over the limit with it: it goes
    assert not path.exists() and store.path("drafts", "mine").exists()


def test_a_stopped_runs_features_count_in_the_size_limit_and_a_running_ones_stay(tmp_path):
    """runs/<key>/features (draft/training/feature_cache.py) is a cache a resume computes again: a stopped run's goes
    like an entry, least recently written first; one whose run holds its lock, or a link, is never touched."""
    store = Store(tmp_path)
    for i, run in enumerate(["stopped", "running"]):
        cache = store.path("runs", run) / RUN_CACHE
        cache.mkdir(parents=True)
        (cache / "0000000.safetensors").write_bytes(b"x" * 1000)
        (store.path("runs", run) / "checkpoint.json").write_text("{}")
        os.utime(cache, (100.0 + i, 100.0 + i))
    d = store.path("drafts", "mine")
    d.mkdir(parents=True)
    (d / "w.bin").write_bytes(b"x" * 1000)
    store.index.set("used/drafts/mine", 50.0)                 # used before either run wrote
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x" * 5000)
    store.path("runs", "linked").mkdir(parents=True)
    (store.path("runs", "linked") / RUN_CACHE).symlink_to(outside, target_is_directory=True)
    with store.lock("runs", "running"):
        assert store.evict(limit_bytes=1500) == ["drafts/mine"]                 # 2000 counted: the oldest goes
        assert store.evict(limit_bytes=0) == [f"runs/stopped/{RUN_CACHE}"]
        assert (store.path("runs", "running") / RUN_CACHE / "0000000.safetensors").is_file()
    assert (store.path("runs", "stopped") / "checkpoint.json").is_file()          # the run itself stays resumable
    assert not (store.path("runs", "stopped") / RUN_CACHE).exists()
    assert (outside / "keep.bin").is_file()
    assert store.evict(limit_bytes=0) == [f"runs/running/{RUN_CACHE}"]          # its lock released: a stopped run now
