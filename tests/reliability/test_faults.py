"""Crash safety: a process killed (SIGKILL) just before each rename of a capture or a session save leaves
a consistent store: nothing listed that is not complete, the previous state intact, and a rerun that
finishes with the same result as an uninterrupted run. tests/crash_child.py does the killing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from layerscope.capture.run import capture
from layerscope.capture.stored import has_capture, list_captures, open_capture, verify_capture
from layerscope.prompts.sets import load_prompts
from layerscope.session.storage import list_sessions, load
from layerscope.store import Store

CHILD = Path(__file__).parents[1] / "crash_child.py"
CAPTURE = dict(limit=4, batch_size=2, max_new_tokens=3)   # as in crash_child.py


def run_child(what: str, root: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(CHILD), what, str(root)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_capture_killed_at_each_rename_leaves_a_consistent_store(tmp_path, tiny, one_thread):
    runs = run_child("capture", tmp_path)
    # 2 chunks, the manifest, the rename of the whole capture into place; then a run that is not killed
    assert [r["killed"] for r in runs] == [True, True, True, True, False]
    reference = Store(tmp_path / f"kill-{len(runs)}")
    [ref] = list_captures(reference)
    ref_cap = open_capture(reference, ref["key"])
    assert verify_capture(reference, ref["key"]) == []
    for r in runs[:-1]:
        store = Store(tmp_path / f"kill-{r['n']}")
        assert list_captures(store) == [], f"killed before rename {r['n']}, something is listed"
        assert not has_capture(store, ref["key"])
        result = capture(tiny, load_prompts("builtin", limit=CAPTURE["limit"]), store, **CAPTURE)   # resumes
        assert not result.cached and result.key == ref["key"]
        assert verify_capture(store, result.key) == []
        cap = open_capture(store, result.key)
        assert cap.manifest["chunks"] == ref_cap.manifest["chunks"]          # same bytes as the uninterrupted run
        assert torch.equal(cap.tokens()["token_id"], ref_cap.tokens()["token_id"])
        files = sorted(p.name for p in cap.path.iterdir())
        assert files == sorted(["manifest.json"] + [c["file"] for c in ref_cap.manifest["chunks"]])
        assert [p.name for p in (store.root / "captures").iterdir()] == [result.key]   # no partial left
        store.close()
    reference.close()


def test_session_save_killed_at_its_rename_keeps_the_previous_version(tmp_path):
    runs = run_child("session", tmp_path)
    assert [r["killed"] for r in runs] == [True, False]
    killed, finished = Store(tmp_path / "kill-1"), Store(tmp_path / "kill-2")
    assert load(killed, "0123456789ab").name == "first"
    assert [(r["id"], r["name"], r.get("error")) for r in list_sessions(killed)] == [("0123456789ab", "first", None)]
    assert load(finished, "0123456789ab").name == "second version"
