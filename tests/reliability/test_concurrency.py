"""Concurrent writers: identical captures started together by real processes end with one complete
capture; the others wait and are served it, and a writer killed mid-capture is resumed by the next. Two app
servers on one store share a capture and keep both tabs' changes to a session they both show."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from layerscope.capture.run import CaptureCancelled, CaptureOptions, capture, capture_key
from layerscope.capture.stored import list_captures, open_capture, partial_capture_dir, verify_capture
from layerscope.prompts.sets import load_prompts
from layerscope.session import storage
from layerscope.session.model import Session, owner_hash
from layerscope.store import Store
from layerscope.target.load import load_model


def options(batch_size):
    return CaptureOptions(limit=8, batch_size=batch_size, max_new_tokens=4)


def start(root, i, tmp_path, batch_size):
    args = ["--model", "tiny-llama", "--prompts", "builtin", "--limit", "8", "--batch-size", str(batch_size),
            "--max-new-tokens", "4"]
    err = open(tmp_path / f"err-{i}", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "layerscope.commands.cli", "capture", *args, "--store", str(root), "--json"],
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env)


def wait_for(cond, timeout=180.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def check_one_complete_capture(store, key, batch_size):
    assert [p.name for p in (store.root / "captures").iterdir()] == [key]
    assert verify_capture(store, key) == []
    cap = open_capture(store, key)
    assert cap.manifest["conversations"] == 8
    assert [c["start"] for c in cap.manifest["chunks"]] == list(range(0, 8, batch_size))
    return cap


def test_identical_captures_started_together_end_with_one_complete_capture(tmp_path, tiny):
    store = Store(tmp_path / "store")
    key = capture_key(tiny, load_prompts("builtin", limit=8), options(2))
    with store.lock("captures", key):   # hold the writer's lock until both processes are ready to write
        procs = [start(store.root, i, tmp_path, 2) for i in range(2)]
        wait_for(lambda: all("waiting" in (tmp_path / f"err-{i}").read_text() for i in range(2)))
    outs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert {o["key"] for o in outs} == {key}
    assert sorted(o["cached"] for o in outs) == [False, True]      # one wrote it, the other waited for it
    assert [o["prompts"] for o in outs] == [8, 8] and outs[0]["tokens"] == outs[1]["tokens"]
    check_one_complete_capture(store, key, 2)


def test_killed_writer_is_resumed_by_the_next_and_matches_an_uninterrupted_run(tmp_path, tiny, one_thread):
    store = Store(tmp_path / "store")
    key = capture_key(tiny, load_prompts("builtin", limit=8), options(1))
    first = start(store.root, 0, tmp_path, 1)
    partial = partial_capture_dir(store, key)
    wait_for(lambda: len(list(partial.glob("chunk-*.safetensors"))) >= 1 or first.poll() is not None)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL and list_captures(store) == []
    procs = [start(store.root, i, tmp_path, 1) for i in (1, 2)]
    outs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert sorted(o["cached"] for o in outs) == [False, True]
    cap = check_one_complete_capture(store, key, 1)
    ref = Store(tmp_path / "reference")
    expected = capture(tiny, load_prompts("builtin", limit=8), ref, **vars(options(1)))
    ref_cap = open_capture(ref, expected.key)
    assert expected.key == key and cap.num_tokens == ref_cap.num_tokens
    for name in ("token_id", "is_response", "conversation"):
        assert torch.equal(cap.tokens()[name], ref_cap.tokens()[name])
    assert torch.allclose(cap.layer(4), ref_cap.layer(4), atol=1e-2)


def test_a_waiting_capture_can_be_cancelled(tmp_path, tiny, one_thread):
    store = Store(tmp_path / "store")
    prompts = load_prompts("builtin", limit=2)
    key = capture_key(tiny, prompts, CaptureOptions(limit=2, max_new_tokens=2))
    phases = []
    with store.lock("captures", key):        # another writer holds the capture
        try:
            capture(tiny, prompts, store, limit=2, max_new_tokens=2, progress=lambda p: phases.append(p.phase),
                    should_stop=lambda: "waiting" in phases)
            raise AssertionError("not cancelled")
        except CaptureCancelled as e:
            assert "another process" in str(e)
    assert phases == ["estimate", "waiting"] and list_captures(store) == []      # the estimate comes first
    assert capture(tiny, prompts, store, limit=2, max_new_tokens=2).key == key     # the lock is free again


SERVER = Path(__file__).parents[1] / "two_servers_child.py"


def test_two_app_servers_on_one_store_share_the_capture_and_keep_both_tabs_changes(tmp_path):
    """Two servers (tests/two_servers_child.py, each a real process calling what the app calls) on one store, both
    showing session SID: the same capture started from both is written once (one waits and is served it); each
    saves a session of its own; server a's tab saves SID with the capture, then server b's tab, which read SID
    before that, saves a layer set into it. SID ends with both changes, and every session is listed whole."""
    store = Store(tmp_path / "store")
    token = "test-browser-two-servers".ljust(40, "x")
    shared = Session(owner=owner_hash(token), model="tiny-llama")
    storage.save(shared, store, name="open in both")
    sync = tmp_path / "sync"
    sync.mkdir()
    key = capture_key(load_model("tiny-llama"), load_prompts("builtin", limit=4),
                      CaptureOptions(limit=4, max_new_tokens=4, batch_size=2, seed=0))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with store.lock("captures", key):        # hold the writer's lock until both servers' captures wait for it
        procs = [subprocess.Popen([sys.executable, str(SERVER), str(store.root), role, shared.id, token, str(sync)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for role in ("a", "b")]
        wait_for(lambda: all((sync / f"{r}.waiting").exists() or p.poll() is not None for r, p in zip("ab", procs)))
    done = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in done]
    outs = [json.loads(out) for out, _ in done]
    assert {o["key"] for o in outs} == {key} and sorted(o["cached"] for o in outs) == [False, True]
    assert [p.name for p in (store.root / "captures").iterdir()] == [key] and verify_capture(store, key) == []

    both = storage.load(store, shared.id)
    assert both.capture_key == key and both.has_stats                     # server a's change
    assert [x["layers"] for x in both.layer_sets] == [[1, 2]]             # server b's change
    assert both.name == "open in both"
    rows = {r["id"]: r for r in storage.list_sessions(store)}
    assert set(rows) == {shared.id, outs[0]["own"], outs[1]["own"]} and not [r for r in rows.values() if r.get("error")]
    assert {rows[o["own"]]["name"] for o in outs} == {"from a", "from b"}
    assert all(rows[o["own"]]["capture_key"] == key for o in outs)
    store.close()
