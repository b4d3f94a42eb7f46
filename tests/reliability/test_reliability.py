"""Hostile-user faults, each with real files: a full disk (a small tmpfs), a read-only store (a read-only bind
mount: chmod does not stop root), symbolic links (outside the store, loops), drafts whose files disagree,
deeply nested JSON, arguments that only fail late, and listings of damaged or unfinished captures.

Every class ends in one line (exit 2 from the CLI, no traceback), loses nothing that was on disk, and leaves
nothing half-written that a listing shows as complete. Mounting needs root with CAP_SYS_ADMIN; the tests that
mount skip with the reason where that is not allowed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import diskcache
import pytest
from safetensors import safe_open

from layerscope import disk
from layerscope.capture.stored import list_captures, open_capture, partial_capture_dir, verify_capture
from layerscope.commands import cli
from layerscope.draft.checkpoint import load_draft, save_draft
from layerscope.draft.engines import target_facts
from layerscope.draft.export.check import check_draft
from layerscope.errors import DraftError, PromptSetError, SessionError, StoreError
from layerscope.prompts.sets import load_prompts
from layerscope.session.share import import_bytes
from layerscope.session.storage import list_sessions, load
from layerscope.store import Store, StoreWarning, StoreWriteError, atomic_write_json
from layerscope.ui.worker import FAILED, run_job
from tests.helpers import untrained_draft

DEEP = 5000                                     # far past what json (about 1000 levels) can parse


# ---------------------------------------------------------------------------- real mounts

@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (skips the test when mounting is not permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only(src: Path, dst: Path):
    """`src` also visible at `dst`, read-only for everyone, root included (a bind mount remounted ro)."""
    dst.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({r.stderr.strip() or r.returncode})")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({r.stderr.strip()})")
        yield dst
    finally:
        subprocess.run(["umount", "-l", str(dst)], capture_output=True)


def fill(directory: Path) -> Path:
    """Write one file in `directory` until its disk is full (ENOSPC); returns the file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for block in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    return filler


def cli_line(capsys, *argv) -> tuple[int, str]:
    """Run the CLI in this process: (exit code, the one stderr line starting 'error:'), no traceback."""
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0]


def tree(root: Path) -> dict[str, str]:
    """Every file under root (relative path -> sha256): what 'loses nothing' compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


# ---------------------------------------------------------------------------- a full disk

def test_full_disk_is_one_line_everywhere_and_the_index_is_never_quarantined(tmp_path, tiny):
    with tmpfs(tmp_path / "mount", "4m") as mount:
        store = Store(mount / "store")
        store.put_json("analysis", "kept", {"x": 1})
        old = save_draft(store.path("drafts", "old"), untrained_draft(tiny.model, (1, 2, 3)), target=tiny)
        store.close()
        before = tree(old)
        fill(mount)

        with pytest.raises(StoreWriteError, match="No space left") as e:
            atomic_write_json(mount / "store" / "result.json", {"rows": list(range(10000))})
        assert "run the same command again" in e.value.fix
        assert not list((mount / "store").glob(".*.tmp"))

        fresh = Store(mount / "store")                 # opening the index writes: it fails, and is not damage
        with pytest.warns(StoreWarning):
            assert fresh.get_json("analysis", "kept") == {"x": 1}
            fresh.put_json("analysis", "new", {"x": 2})        # not cached, not an error
        assert not list(fresh.root.glob(".index.damaged-*")) and (fresh.root / "index" / "cache.db").is_file()
        fresh.close()

        with pytest.raises(StoreWriteError, match="No space left") as e:
            save_draft(old, untrained_draft(tiny.model, (1, 2, 3), seed=7), target=tiny)
        assert tree(old) == before and load_draft(old).aux_layers == [1, 2, 3]     # the old draft stands whole
        assert not (old.parent / ".layerscope-staging").exists()
        kept = Path(re.search(r"written to (\S+) instead", e.value.fix)[1])       # the new one is not lost
        assert not kept.is_relative_to(mount) and f"--draft {kept}" in e.value.fix
        assert load_draft(kept).aux_layers == [1, 2, 3]
        shutil.rmtree(kept)

        with pytest.raises(StoreWriteError, match="Not enough free space"):
            disk.need_space(mount, 10 * 2**20, "a capture")

        # the app's worker: an OSError of a full disk is the same one line, not "a bug in LayerScope"
        out = run_job(lambda job: (mount / "more").write_bytes(b"x" * 2**20), SimpleNamespace(should_stop=lambda: False),
                      "a job")
        assert out.state == FAILED and "No space left" in out.error and out.traceback is None
        assert Store(mount / "store").get_json("analysis", "kept") == {"x": 1}


def test_train_draft_on_a_disk_that_fills_keeps_its_checkpoint_and_the_index(tmp_path):
    """A real process: online training checkpoints every 0.3 s; the disk fills while it runs; the next
    checkpoint meets ENOSPC. One line (exit 2) that says how to resume, the last checkpoint whole, the index
    intact and not moved aside, no draft listed."""
    with tmpfs(tmp_path / "disk", "64m") as disk:
        root = disk / "store"
        marker = Store(root)
        marker.put_json("analysis", "marker", {"kept": True})
        marker.close()
        argv = [sys.executable, "-m", "layerscope.commands.cli", "train-draft", "--model", "tiny-llama", "--prompts", "builtin",
                "--limit", "6", "--max-new-tokens", "4", "--val-conversations", "1", "--layers", "1,2,3",
                "--steps", "1000000", "--checkpoint-every", "0.3s", "--threads", "1", "--store", str(root)]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        with open(tmp_path / "stderr", "w") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
            try:
                deadline = time.monotonic() + 240
                while not list(root.glob("runs/*/ckpt-*/state.json")):
                    assert proc.poll() is None, (tmp_path / "stderr").read_text()
                    assert time.monotonic() < deadline, "no checkpoint within 4 minutes"
                    time.sleep(0.2)
                fill(disk)
                code = proc.wait(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        stderr = (tmp_path / "stderr").read_text()
        lines = [x for x in stderr.splitlines() if x.startswith("error:")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
        assert "No space left on the disk holding" in lines[0] and str(root) in lines[0]
        assert "run the same command again" in lines[0]
        assert "damaged" not in lines[0]
        [run] = list((root / "runs").iterdir())
        ckpts = sorted(run.glob("ckpt-*"))
        assert ckpts and not list(run.glob(".layerscope-staging/*"))   # the last one whole, no half-written one
        state = json.loads((ckpts[-1] / "state.json").read_text())
        with safe_open(str(ckpts[-1] / "tensors.safetensors"), framework="pt") as f:
            assert "rng" in f.keys() and any(k.startswith("head0.") for k in f.keys())
        assert state["step"] >= 1
        (disk / "filler").unlink()
        store = Store(root)
        assert store.get_json("analysis", "marker") == {"kept": True}
        assert not list(root.glob(".index.damaged-*"))
        assert not (root / "drafts").exists() or not [p for p in (root / "drafts").iterdir() if p.name[0] != "."]
        store.close()


def test_a_session_saved_on_a_full_disk_is_one_line_and_its_last_saved_version_stays(tmp_path, monkeypatch):
    """storage.save on a full tmpfs: one StoreWriteError line, the previous archive whole, no temporary file. In the
    app a change made by a widget (the save runs in its callback) shows that line, never Streamlit's exception
    page; the tab keeps the change, and once there is room the next change saves both."""
    from streamlit.testing.v1 import AppTest

    from layerscope.session.model import Session, owner_hash
    from layerscope.session.storage import save
    from layerscope.ui.access import OWNER_KEY
    from layerscope.ui.widgets import IMAGE_FORMAT_KEY

    token = "test-browser-full-disk".ljust(40, "x")
    with tmpfs(tmp_path / "disk", "2m") as mount:
        store = Store(mount / "store")
        first = Session(owner=owner_hash(token), model="tiny-llama", notes="first version")
        save(first, store, name="first")
        stored = store.path("sessions", first.id)
        before = tree(stored)
        filler = fill(mount)

        second = load(store, first.id)
        second.notes = "second version " * 100
        with pytest.raises(StoreWriteError) as e:
            save(second, store, name="second")
        line = str(e.value)
        assert "\n" not in line and "No space left" in line and f"Session {first.id} was not saved" in line
        assert "last saved version is intact" in line
        assert tree(stored) == before and load(store, first.id).notes == "first version"
        assert [(r["id"], r["name"], r.get("error")) for r in list_sessions(store)] == [(first.id, "first", None)]
        assert not [p for p in store.root.rglob("*") if p.name.endswith(".tmp")]

        monkeypatch.setenv("LAYERSCOPE_STORE", str(store.root))
        monkeypatch.setenv("LAYERSCOPE_WORKER", "thread")
        at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=120)
        at.session_state[OWNER_KEY] = token
        at.query_params["session"] = first.id
        at.run()
        assert not at.exception, [x.value for x in at.exception]
        at.sidebar.radio(key=IMAGE_FORMAT_KEY).set_value("svg").run()        # saved by the radio's callback
        assert not at.exception, [x.value[:300] for x in at.exception]
        shown = [x.value for x in at.error if "was not saved" in x.value]
        assert len(shown) == 1 and "No space left" in shown[0] and "last saved version is intact" in shown[0]
        assert tree(stored) == before
        filler.unlink()                                                     # room again: the next change saves
        at.sidebar.radio(key=IMAGE_FORMAT_KEY).set_value("png").run()
        at.sidebar.radio(key=IMAGE_FORMAT_KEY).set_value("svg").run()
        assert not at.exception and not [x for x in at.error if "was not saved" in x.value]
        assert load(store, first.id).view.get("image_format") == "svg" and load(store, first.id).name == "first"
        store.close()


def test_train_draft_that_cannot_fit_is_refused_before_the_model_loads(tmp_path, capsys):
    """A draft for a d=256 target: about a million parameters, two checkpoints of 12 MiB; the disk has 16 MiB."""
    with tmpfs(tmp_path / "disk", "16m") as disk:
        Store(disk / "store").close()
        code, line = cli_line(capsys, "train-draft", "--model", "tiny-llama:hidden=256", "--prompts", "builtin",
                              "--limit", "4", "--layers", "1,2,3", "--steps", "5", "--store", disk / "store")
        assert code == 2 and "Not enough free space for online training" in line and "nothing was written" in line
        assert not (disk / "store" / "runs").exists()


# ---------------------------------------------------------------------------- a read-only store

def test_read_only_store_reads_and_lists_and_every_write_is_one_line(tmp_path, tiny, tiny_capture, capsys):
    src = tmp_path / "src"
    store = Store(src)
    shutil.copytree(tiny_capture.path, store.path("captures", tiny_capture.key))
    store.put_json("analysis", "kept", {"x": 1})
    store.close()
    before = tree(src)
    with read_only(src, tmp_path / "ro") as ro:
        with pytest.warns(StoreWarning, match="read-only"):
            s = Store(ro)
            assert [r["key"] for r in list_captures(s)] == [tiny_capture.key]
            assert s.get_json("analysis", "kept") == {"x": 1}
            assert open_capture(s, tiny_capture.key[:8]).num_tokens == tiny_capture.num_tokens
        with pytest.raises(StoreWriteError, match="read-only"):
            disk.writable(s)
        with pytest.raises(StoreWriteError, match="read-only") as e:
            save_draft(s.path("drafts", "new"), untrained_draft(tiny.model, (1, 2, 3)), target=tiny)
        kept = Path(re.search(r"written to (\S+) instead", e.value.fix)[1])      # kept outside the store
        assert load_draft(kept).aux_layers == [1, 2, 3]
        shutil.rmtree(kept)
        s.close()
        code, line = cli_line(capsys, "train-draft", "--model", "tiny-llama", "--layers", "1,2,3", "--steps", "2",
                              "--store", ro)
        assert code == 2 and "read-only" in line
        code, line = cli_line(capsys, "train-draft", tiny_capture.key, "--layers", "1,2", "--steps", "1", "--store", ro)
        assert code == 2 and "read-only" in line
        assert cli.main(["captures", "--store", str(ro)]) == 0 and tiny_capture.key in capsys.readouterr().out
    assert tree(src) == before and not list(src.glob(".index.damaged-*"))



def test_a_gguf_model_opens_from_a_read_only_store_whose_hash_memo_it_cannot_write(tmp_path):
    """The GGUF fingerprint's memo (file-hashes.json) is a cache: a read-only store still gives the hash, every time."""
    from layerscope.capture.format import file_sha256
    from layerscope.target.files import _cached_file_hash

    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    src = tmp_path / "src"
    src.mkdir()
    with read_only(src, tmp_path / "ro") as ro:
        assert _cached_file_hash(weights, ro) == file_sha256(weights)[:24]
        assert _cached_file_hash(weights, ro) == file_sha256(weights)[:24]
        assert not (ro / "file-hashes.json").exists()
    assert _cached_file_hash(weights, src) == file_sha256(weights)[:24] and (src / "file-hashes.json").is_file()

def test_a_planted_deep_or_huge_hash_memo_reads_as_empty_and_is_rewritten(tmp_path):
    """file-hashes.json is read at every GGUF load: a planted one never gives a RecursionError."""
    from layerscope.capture.format import file_sha256
    from layerscope.target.files import MEMO_BYTES, _cached_file_hash

    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    memo = tmp_path / "file-hashes.json"
    for planted in ("[" * 100_000 + "]" * 100_000, '{"a": "' + "x" * MEMO_BYTES + '"}', "[1, 2]", "not json"):
        memo.write_text(planted)
        assert _cached_file_hash(weights, tmp_path) == file_sha256(weights)[:24]
        assert list(json.loads(memo.read_text()).values()) == [file_sha256(weights)[:24]]


def test_an_old_stored_model_config_is_completed_where_it_can_be_and_still_loads_where_it_cannot(tmp_path):
    """A copy de-quantized before complete_config (architectures null) is repaired on a writable store; on a
    read-only one it is left as it is and nothing fails. A planted deep config is one line."""
    from layerscope.errors import ModelSpecError
    from layerscope.target.gguf import _repair_config, complete_config

    old = {"model_type": "llama", "architectures": None, "hidden_size": 8}
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(old))
    with read_only(src, tmp_path / "ro") as ro:
        _repair_config(ro)
        assert json.loads((ro / "config.json").read_text()) == old
    _repair_config(src)
    assert json.loads((src / "config.json").read_text()) == complete_config(old)
    assert json.loads((src / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    (src / "config.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ModelSpecError, match="nested 5000 levels deep"):
        _repair_config(src)


def test_the_apps_capture_and_training_paths_check_the_store_before_the_model_loads(tmp_path, tiny_capture,
                                                                                   session_store):
    """workflow.capture, workflow.train and workflow.train_online (what the CLI and the app's jobs call) refuse
    a read-only store in one line before loading anything: nothing is computed to be lost at the save."""
    from layerscope.draft.training.fit import TrainOptions
    from layerscope.draft.training.online import OnlineOptions
    from layerscope.steps import workflow

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the store was checked")

    with read_only(session_store.root, tmp_path / "ro") as ro:
        store = Store(ro)
        with pytest.raises(StoreWriteError, match="read-only"):
            workflow.capture("tiny-llama", "builtin", workflow.CaptureOptions(limit=2), store, load=no_load)
        with pytest.raises(StoreWriteError, match="read-only"):
            workflow.train(store, tiny_capture.key, [1, 2], TrainOptions(steps=1), load=no_load)
        with pytest.raises(StoreWriteError, match="read-only"):
            workflow.train_online(store, "tiny-llama", [[1, 2]], OnlineOptions(prompts="builtin", steps=1),
                                  load=no_load)
        with pytest.raises(DraftError, match="out of range"):      # and the sets against the depth, first too
            workflow.train_online(Store(tmp_path / "rw"), "tiny-llama", [[1, 99]],
                                  OnlineOptions(prompts="builtin", steps=1), load=no_load)
        store.close()


# ---------------------------------------------------------------------------- symbolic links

def test_a_capture_linked_from_outside_is_listed_verified_and_refused_alike(tmp_path, tiny_capture, capsys):
    store = Store(tmp_path / "store")
    outside = tmp_path / "elsewhere" / tiny_capture.key
    shutil.copytree(tiny_capture.path, outside)
    (store.root / "captures").mkdir(parents=True)
    store.path("captures", tiny_capture.key).symlink_to(outside)
    loop = "ab" * 12
    store.path("captures", loop).symlink_to(store.path("captures", loop))
    rows = {r["key"]: r for r in list_captures(store)}
    assert rows[tiny_capture.key]["state"] == "damaged" and "outside the store" in rows[tiny_capture.key]["problem"]
    assert rows[loop]["state"] == "damaged" and "symbolic link loop" in rows[loop]["problem"]
    assert "outside the store" in verify_capture(store, tiny_capture.key)[0]
    with pytest.raises(StoreError, match="outside the store"):
        open_capture(store, tiny_capture.key)
    code, line = cli_line(capsys, "analyze", tiny_capture.key[:8], "--store", store.root)
    assert code == 2 and "outside the store" in line
    assert cli.main(["verify", "--store", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert f"{tiny_capture.key}  DAMAGED" in out and "outside the store" in out
    assert cli.main(["captures", "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "outside the store" in out and "symbolic link loop" in out
    assert outside.is_dir() and tree(outside) == tree(tiny_capture.path)          # nothing followed or removed
    # a link inside the kind directory is followed: listed, verified and opened like the directory itself
    store.path("captures", tiny_capture.key).unlink()
    inside = store.root / "captures" / ".moved" / tiny_capture.key
    shutil.copytree(outside, inside)
    store.path("captures", tiny_capture.key).symlink_to(inside)
    assert {r["key"]: r["state"] for r in list_captures(store)}[tiny_capture.key] == "ok"
    assert verify_capture(store, tiny_capture.key) == [] and open_capture(store, tiny_capture.key).num_tokens > 0
    store.close()


def test_a_draft_or_out_path_through_a_symlink_loop_is_one_line_before_any_work(tmp_path, tiny_capture,
                                                                                session_store, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    # the model spec is bogus: had the draft not been checked first, the error would be about the model
    code, line = cli_line(capsys, "bench", "--draft", loop, "--model", "no-such-model", "--store", tmp_path / "s")
    assert code == 2 and "symbolic link loop" in line
    code, line = cli_line(capsys, "bench", "--draft", tmp_path / "missing", "--model", "no-such-model",
                          "--store", tmp_path / "s")
    assert code == 2 and "does not exist" in line
    code, line = cli_line(capsys, "train-draft", tiny_capture.key, "--layers", "1,2", "--steps", "1",
                          "--out", loop / "draft", "--store", session_store.root)
    assert code == 2 and "symbolic link loop" in line


def test_stored_drafts_and_out_paths_follow_the_one_link_rule(tmp_path, tiny, tiny_capture, session_store, capsys):
    """A drafts/<key> link that leaves the store is refused by --draft KEY and listed as broken by the app
    (never silently used or hidden); an --out that is a link to a directory is written through, link kept."""
    from layerscope.draft import builtin
    from layerscope.draft.training.fit import TrainOptions
    from layerscope.steps import workflow
    from layerscope.ui.tasks import broken_drafts, stored_drafts

    store = Store(tmp_path / "store")
    good = save_draft(store.path("drafts", "good"), untrained_draft(tiny.model, (1, 2)), {"target_model": "tiny-llama"},
                      target=tiny)
    outside = save_draft(tmp_path / "elsewhere", untrained_draft(tiny.model, (1, 3)), {"target_model": "tiny-llama"},
                         target=tiny)
    store.path("drafts", "linked").symlink_to(outside)
    store.path("drafts", "half").mkdir()
    (store.path("drafts", "half") / "layerscope.json").write_text("{}")
    assert builtin.resolve("good", "tiny-llama", store) == good
    with pytest.raises(DraftError, match="outside the store"):
        builtin.resolve("linked", "tiny-llama", store)
    code, line = cli_line(capsys, "bench", "--draft", "linked", "--model", "tiny-llama", "--store", store.root)
    assert code == 2 and "outside the store" in line
    assert [d["path"] for d in stored_drafts(store)] == [str(good)]
    broken = {b["key"]: b for b in broken_drafts(store)}
    assert set(broken) == {"linked", "half"}
    assert "outside the store" in broken["linked"]["problem"] and "model.safetensors" in broken["half"]["problem"]
    assert all("Remove" in b["fix"] for b in broken.values())
    # --out through a link to a directory: the draft lands in the real directory, the link stays a link
    real_dir = tmp_path / "real-out"
    real_dir.mkdir()
    link = tmp_path / "out-link"
    link.symlink_to(real_dir)
    trained = workflow.train(session_store, tiny_capture.key, [1, 2], TrainOptions(steps=1), out=link)
    assert trained.path == real_dir.resolve() and link.is_symlink() and (real_dir / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".layerscope-staging/*"))
    store.close()


# ---------------------------------------------------------------------------- a draft's metadata

EDITS = {
    "config.json vLLM key": ("config.json", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4])),
    "config.json SGLang key": ("config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3])),
    "layers.json": ("layers.json", lambda c: c.update(hf_hidden_states=[2, 3, 4])),
    "layerscope.json": ("layerscope.json", lambda c: c.update(aux_layers=[0, 1, 2])),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_draft_whose_files_disagree_is_refused_naming_each(tmp_path, tiny, edit, capsys):
    path = save_draft(tmp_path / "draft", untrained_draft(tiny.model, (1, 2, 3)), {"target_model": "tiny-llama"},
                      target=tiny)
    assert load_draft(path).aux_layers == [1, 2, 3]            # as written, every file agrees
    name, change = EDITS[edit]
    doc = json.loads((path / name).read_text())
    change(doc)
    (path / name).write_text(json.dumps(doc))
    with pytest.raises(DraftError, match="disagree on the layers") as e:
        load_draft(path)
    assert name in e.value.problem and "says layers [1, 2, 3]" in e.value.problem
    assert "check-draft" in e.value.fix and "export" in e.value.fix
    code, line = cli_line(capsys, "bench", "--draft", path, "--model", "no-such-model", "--store", tmp_path / "s")
    assert code == 2 and "disagree on the layers" in line
    # check-draft sees it too, whichever file was edited: an engine reading other layers, or (layers.json,
    # which no engine reads) the files' disagreement
    report = check_draft(path, target_facts(tiny))
    assert not report["ok"]
    if name == "layers.json":
        assert any("disagree on the layers" in p and "layers.json" in p for p in report["problems"])
    code, line = cli_line(capsys, "check-draft", path, "--target", "tiny-llama", "--store", tmp_path / "s")
    assert code == 2 and "Engines would not read the trained layers" in line


def test_a_draft_without_a_known_target_agrees_with_itself(tmp_path, tiny):
    path = save_draft(tmp_path / "d", untrained_draft(tiny.model, (1, 3)))      # SGLang ids by the Llama rule
    assert load_draft(path).aux_layers == [1, 3]


# ---------------------------------------------------------------------------- deeply nested JSON

def deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def test_deep_json_in_a_session_is_one_line_on_import_list_and_load(store):
    doc = '{"layerscope_session": 1, "session": {"id": "0123456789ab", "notes": ' + deep() + "}}"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("session.json", doc)
    with pytest.raises(SessionError, match=r"nested \d+ levels deep"):
        import_bytes(buf.getvalue(), store)
    planted = store.path("sessions", "0123456789ab") / "session.zip"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(buf.getvalue())
    [row] = list_sessions(store)
    assert "levels deep, more than the 64" in row["error"]
    with pytest.raises(SessionError, match="nested"):
        load(store, "0123456789ab")


def test_deep_json_in_store_files_reads_as_damage_or_a_miss(tmp_path, tiny_capture, tiny, capsys):
    store = Store(tmp_path / "store")
    cap = store.path("captures", tiny_capture.key)
    shutil.copytree(tiny_capture.path, cap)
    (cap / "manifest.json").write_text(deep())
    [row] = list_captures(store)
    assert row["state"] == "damaged" and "nested" in row["problem"] and "verify" in row["fix"]
    # an index value planted under a key LayerScope reads: compressed as diskcache's JSON disk writes it
    store.put_json("analysis", "abc", {"ok": True})
    store.close()
    raw = diskcache.Cache(str(store.root / "index"), disk=diskcache.Disk)
    raw.set(zlib.compress(json.dumps("analysis/abc").encode(), 1), zlib.compress(deep().encode(), 1))
    raw.close()
    fresh = Store(store.root)
    with pytest.warns(StoreWarning, match="damaged value"):
        assert fresh.get_json("analysis", "abc") is None        # a miss: recomputed, never a RecursionError
    fresh.close()
    draft = save_draft(tmp_path / "draft", untrained_draft(tiny.model, (1, 2, 3)), target=tiny)
    (draft / "layers.json").write_text(deep())
    with pytest.raises(DraftError, match="nested"):
        load_draft(draft)


def test_deep_json_in_prompt_files_is_a_warning_or_one_line(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join([json.dumps({"prompt": "one"}), '{"prompt": ' + deep() + "}",
                                json.dumps({"prompt": "three"})]))
    s = load_prompts(str(jsonl))
    assert [p.text for p in s] == ["one", "three"] and s.warnings[0].startswith("line 2: nested")
    array = tmp_path / "p.json"
    array.write_text('[{"prompt": "one"}, {"prompt": ' + deep() + "}]")
    with pytest.raises(PromptSetError, match="nested more than 64 levels"):
        load_prompts(str(array))


# ---------------------------------------------------------------------------- arguments checked first

def test_arguments_are_checked_before_the_model_loads(tmp_path, tiny_capture, session_store, capsys):
    code, line = cli_line(capsys, "select", tiny_capture.key[:8], "--layers", "", "--store", session_store.root)
    assert code == 2 and "names no layer" in line
    code, line = cli_line(capsys, "select", tiny_capture.key[:8], "--layers", "1,99", "--store", session_store.root)
    assert code == 2 and "[99]" in line
    code, line = cli_line(capsys, "train-draft", "--model", "no-such-model", "--layers", "", "--steps", "1",
                          "--store", tmp_path / "s")
    assert code == 2 and "names no layer" in line
    code, line = cli_line(capsys, "train-draft", "--model", "no-such-model", "--layers", "1,2",
                          "--prompts", tmp_path / "missing.jsonl", "--steps", "1", "--store", tmp_path / "s")
    assert code == 2 and "missing.jsonl" in line
    code, line = cli_line(capsys, "train-draft", "--model", "tiny-llama", "--layers", "1,9", "--steps", "1",
                          "--store", tmp_path / "s")
    assert code == 2 and "[9] are out of range" in line and "outside 0..3" in line
    assert not (tmp_path / "s" / "runs").exists()


# ---------------------------------------------------------------------------- listings show state

def test_captures_marks_damaged_and_unfinished_captures_with_their_fix(tmp_path, tiny_capture, capsys):
    store = Store(tmp_path / "store")
    good = store.path("captures", tiny_capture.key)
    shutil.copytree(tiny_capture.path, good)
    bad_key = "cd" * 12
    bad = store.path("captures", bad_key)
    shutil.copytree(tiny_capture.path, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "key": bad_key, "tokens": 1}))
    partial = partial_capture_dir(store, "ef" * 12)
    partial.mkdir()
    first = tiny_capture.manifest["chunks"][0]["file"]
    shutil.copy(tiny_capture.path / first, partial / first)
    assert cli.main(["captures", "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(i for i, x in enumerate(lines) if x.startswith(bad_key))
    assert "DAMAGED" in lines[row] and "verify" in lines[row + 1] and "--delete" in lines[row + 1]
    assert lines[row].split()[4:6] == ["-", "-"]                 # no counts from a manifest that cannot be trusted
    row = next(i for i, x in enumerate(lines) if x.startswith("ef" * 12))
    assert "INCOMPLETE" in lines[row] and "resume" in lines[row + 1]
    assert "1 usable, 1 damaged, 1 incomplete" in out
    assert cli.main(["captures", "--json", "--store", str(store.root)]) == 0
    states = {r["key"]: r["state"] for r in json.loads(capsys.readouterr().out)}
    assert states == {tiny_capture.key: "ok", bad_key: "damaged", "ef" * 12: "incomplete"}
    assert [r["key"] for r in list_captures(store) if r["state"] == "ok"] == [tiny_capture.key]
    store.close()


def test_a_study_that_cannot_fit_is_refused_before_the_model_loads(tmp_path, tiny_capture, capsys):
    """Nine online drafts of the tiny target (each set's, the random controls'), two checkpoints of the pass and
    the generated answers do not fit in 4 MiB beside the capture: one line, nothing trained, no run started."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        store = Store(disk / "store")
        shutil.copytree(tiny_capture.path, store.path("captures", tiny_capture.key))
        store.close()
        code, line = cli_line(capsys, "study", tiny_capture.key, "--online", "--train-prompts", "builtin",
                              "--train-limit", "24", "--tokens", "2k", "--limit", "2", "--store", disk / "store")
        assert code == 2 and "Not enough free space for the study (up to" in line and "nothing was written" in line
        assert not (disk / "store" / "runs").exists() and not (disk / "store" / "drafts").exists()
