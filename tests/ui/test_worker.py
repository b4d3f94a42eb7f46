"""Jobs in the worker process (ui.worker, JobManager in process mode): real captures on the tiny model in a real
worker process, read back through the same Job API the pages use.

The tests share one JobManager (starting a worker imports torch and transformers: seconds on a busy machine);
the last one kills its worker and checks that the next job gets a fresh one.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from layerscope.capture.stored import has_capture, list_captures
from layerscope.errors import LayerScopeError
from layerscope.session import storage
from layerscope.session.model import Session, owner_hash
from layerscope.store import Store
from layerscope.target.load import load_model
from layerscope.ui import tasks
from layerscope.ui.access import OWNER_KEY
from layerscope.ui.jobs import INTERRUPTED, JobManager, process_stamp, worker_mode
from layerscope.ui.worker import CANCELLED, DONE, FAILED, Task, job_task

TIMEOUT = 300
APP = str(Path(__file__).resolve().parents[2] / "app.py")
SERVER = Path(__file__).parents[1] / "server_child.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(tmp_path_factory.mktemp("worker-store"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def manager():
    m = JobManager(max_running=1, mode="process")
    yield m
    m.close()


def capture(store, *, limit=3, new_tokens=6, batch=2, seed=0, model="tiny-llama") -> Task:
    return tasks.capture_job(model=model, prompts="builtin", limit=limit, max_new_tokens=new_tokens, batch_size=batch,
                             seed=seed, store=store)


def wait_until(cond, timeout=TIMEOUT):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def test_a_capture_runs_in_the_worker_with_live_progress_and_the_model_loads_once(manager, store):
    # 8 prompts one at a time: progress moves 8 times, more than the worker's 0.1 s coalescing can merge away
    job = manager.submit("s1", "capture", capture(store, limit=8, new_tokens=48, batch=1), title="Capture of tiny-llama")
    seen = []
    while not job.wait(0.05):
        v = job.view()
        if v.progress is not None and (not seen or seen[-1] != v.progress):
            seen.append(v.progress)
    v = job.view()
    assert v.state == DONE, (v.error, v.fix)
    midway = [p for p in seen if 0 < p < 1]
    assert midway and seen == sorted(seen), seen                   # progress came through while it ran, in order
    assert v.metrics["tokens"] == v.result["tokens"] > 0 and v.metrics["conversations_total"] == 8
    assert has_capture(store, v.result["key"]) and v.result["stats"]["num_layers"] == 4
    [pid] = manager.worker_pids()
    assert pid != os.getpid()
    assert manager.worker_models()["tiny-llama"]["pid"] == pid

    second = manager.submit("s1", "capture", capture(store, seed=1), title="Capture of tiny-llama, seed 1")
    assert second.wait(TIMEOUT) and second.view().state == DONE, (second.error, second.fix)
    assert second.result["key"] != v.result["key"]
    assert manager.worker_pids() == [pid]
    assert manager.worker_models()["tiny-llama"]["loads"] == 1     # the second job found the model loaded


def test_a_task_runs_the_same_in_a_thread(manager, store):
    key = next(c["key"] for c in list_captures(store) if c.get("conversations") == 3)
    task = tasks.stats_job(store=store, capture_key=key, options={})
    assert pickle.loads(pickle.dumps(task)).fn is None and task.store_root == str(store.root)   # the store as its root
    threaded = JobManager(mode="thread").submit("s2", "analysis", task)
    remote = manager.submit("s2", "analysis", tasks.stats_job(store=store, capture_key=key, options={}))
    assert threaded.wait(TIMEOUT) and remote.wait(TIMEOUT)
    assert threaded.view().state == remote.view().state == DONE
    assert threaded.result == remote.result and remote.result["capture_key"] == key


def test_the_worker_setting(monkeypatch):
    monkeypatch.setenv("LAYERSCOPE_WORKER", "thread")
    assert worker_mode() == "thread" and JobManager().mode == "thread"
    monkeypatch.delenv("LAYERSCOPE_WORKER")
    assert worker_mode() == "process"
    with pytest.raises(LayerScopeError, match="LAYERSCOPE_WORKER='fork' is not a worker mode"):
        worker_mode("fork")


def test_cancel_reaches_the_worker(manager, store):
    job = manager.submit("s3", "capture", capture(store, limit=60, new_tokens=64, batch=1, seed=2), title="Long capture")
    wait_until(lambda: job.view().metrics.get("conversations_total"))     # the model is loaded, decoding runs
    pid = manager.worker_pids()[0]
    manager.cancel(job.id)
    assert job.wait(120)
    v = job.view()
    assert v.state == CANCELLED and v.message == "cancelled" and v.result is None
    assert manager.worker_pids() == [pid]                              # the worker lives on for the next job


@job_task
def busy_job(*, seconds: float):
    """A job that never looks at its cancel flag for `seconds` (as a model load or one long forward does)."""
    def run(job):
        job.update(0.1, "busy")
        end = time.time() + seconds
        while time.time() < end:
            sum(range(10_000))
        return {"slept": seconds}

    return run


def test_cancel_stops_a_job_that_does_not_listen_by_stopping_its_worker(store):
    m = JobManager(max_running=1, mode="process", cancel_grace_s=2.0)
    try:
        job = m.submit("s6", "busy", busy_job(seconds=600), title="Busy job")
        wait_until(lambda: job.view().message == "busy")
        [pid] = m.worker_pids()
        t0 = time.monotonic()
        m.cancel(job.id)
        assert job.wait(60)
        v = job.view()
        assert v.state == CANCELLED and "did not stop within 2 s" in v.message and v.result is None
        assert time.monotonic() - t0 < 30
        wait_until(lambda: not _alive(pid), timeout=30)                    # that worker is gone ...
        again = m.submit("s6", "busy", busy_job(seconds=0.1), title="Short job")
        assert again.wait(TIMEOUT) and again.view().state == DONE and again.result == {"slept": 0.1}
        assert m.worker_pids() and m.worker_pids() != [pid]               # ... and the next job got a fresh one
    finally:
        m.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_uploaded_prompt_file_is_kept_only_while_its_capture_runs(manager, store):
    path = tasks.save_upload(store, "mine.jsonl", b'{"prompt": "Say hi."}\n{"prompt": "Count to three."}\n')
    job = manager.submit("s7", "capture", tasks.capture_job(model="tiny-llama", prompts=str(path), limit=2,
                                                            max_new_tokens=4, batch_size=2, seed=0, store=store))
    assert job.wait(TIMEOUT) and job.view().state == DONE, (job.error, job.fix)
    assert has_capture(store, job.result["key"]) and job.result["conversations"] == 2
    assert not path.parent.exists()                                # the capture read it; nothing else needs it


def test_two_queued_captures_of_one_uploaded_file_both_read_it(manager, store):
    """Two sessions upload the same file (one store entry: content-addressed) and start captures; the second waits
    for the first. The first, ending, leaves the file to the second, which holds it too; the last one removes it."""
    data = b'{"prompt": "Name a colour."}\n{"prompt": "Name a fruit."}\n'
    path = tasks.save_upload(store, "shared.jsonl", data)
    assert tasks.save_upload(store, "shared.jsonl", data) == path
    jobs = []
    for sid in ("s8", "s9"):
        hold = tasks.hold_upload(store, str(path))
        jobs.append(manager.submit(sid, "capture", tasks.capture_job(
            model="tiny-llama", prompts=str(path), limit=2, max_new_tokens=4, batch_size=2, seed=0, store=store,
            upload_hold=hold)))
    assert jobs[1].view().state != DONE
    for job in jobs:
        assert job.wait(TIMEOUT) and job.view().state == DONE, (job.error, job.fix)
    assert jobs[0].result["conversations"] == jobs[1].result["conversations"] == 2
    assert not path.parent.exists()                                # the last capture released it


def test_a_queued_capture_cancelled_before_it_starts_releases_its_upload(manager, store):
    """A capture of an upload waits behind another job and is cancelled before it starts: its hold goes with it
    (on_drop, as the Capture page submits it), and the upload with the hold; before, the file stayed for good."""
    path = tasks.save_upload(store, "queued.jsonl", b'{"prompt": "Name a river."}\n')
    release = threading.Event()
    blocker = manager.submit("s10", "other", lambda job: release.wait(TIMEOUT))   # holds the one slot
    hold = tasks.hold_upload(store, str(path))
    job = manager.submit("s11", "capture", tasks.capture_job(
        model="tiny-llama", prompts=str(path), limit=1, max_new_tokens=4, batch_size=1, seed=0, store=store,
        upload_hold=hold), on_drop=lambda: tasks.release_upload(store, str(path), hold))
    try:
        assert job.view().state == "queued" and path.parent.exists()
        manager.cancel(job.id)
        assert job.wait(TIMEOUT) and job.view().state == CANCELLED and job.view().started is None
        assert not path.parent.exists()
    finally:
        release.set()
        assert blocker.wait(TIMEOUT)


def test_a_layerscope_error_in_the_worker_is_its_problem_and_fix(manager, store, tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(LayerScopeError) as here:
        load_model(missing)
    job = manager.submit("s4", "capture", capture(store, model=missing), title="Capture of a missing file")
    assert job.wait(TIMEOUT)
    v = job.view()
    assert v.state == FAILED and (v.error, v.fix) == (here.value.problem, here.value.fix)


def test_an_unexpected_error_is_one_line_and_its_traceback_is_logged(manager, store, caplog):
    key = next(c["key"] for c in list_captures(store))
    task = tasks.train_job(store=store, capture_key=key, model="tiny-llama", layers=[1, 2], strategy=None,
                           name="mine", options={"no_such_option": 1})
    with caplog.at_level(logging.ERROR, logger="layerscope.ui.jobs"):
        job = manager.submit("s5", "train", task, title="Draft for mine")
        assert job.wait(TIMEOUT)
    v = job.view()
    assert v.state == FAILED and "\n" not in v.error
    assert v.error.startswith("Unexpected error in Draft for mine: TypeError:") and "no_such_option" in v.error
    assert "bug in LayerScope" in v.fix
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback (most recent call last)" in logged and "TrainOptions(**options)" in logged


def test_a_killed_worker_fails_its_job_and_the_next_job_gets_a_fresh_worker(manager, store):
    job = manager.submit("s6", "capture", capture(store, limit=60, new_tokens=64, batch=1, seed=3), title="Long capture")
    wait_until(lambda: job.view().metrics.get("conversations_total"))
    [pid] = manager.worker_pids()
    os.kill(pid, signal.SIGKILL)
    assert job.wait(60)
    v = job.view()
    assert v.state == FAILED
    assert v.error == ("The worker process running Long capture was killed by SIGKILL (perhaps the system ran out of "
                       "memory); the job is lost")
    assert v.fix.startswith("Start it again")
    assert manager.worker_pids() == [] and manager.worker_models() == {}

    again = manager.submit("s6", "capture", capture(store, seed=4), title="Capture after the kill")
    assert again.wait(TIMEOUT) and again.view().state == DONE, (again.error, again.fix)
    [fresh] = manager.worker_pids()
    assert fresh != pid and manager.worker_models()["tiny-llama"] == {**manager.worker_models()["tiny-llama"],
                                                                      "pid": fresh, "loads": 1}


def test_a_job_whose_server_was_killed_shows_as_interrupted_with_how_to_resume(tmp_path, monkeypatch):
    root = tmp_path / "store"
    owner, second = Session().id, Session().id
    token = "test-browser-restart".ljust(40, "x")             # the browser that started the job comes back
    storage.save(Session(id=owner, model="tiny-llama", owner=owner_hash(token)), Store(root))
    server = subprocess.Popen([sys.executable, str(SERVER), str(root), owner, second], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert server.stdout.readline().strip() == "running"               # the capture decodes in its worker
        record = json.loads((root / "jobs" / f"{owner}.capture.json").read_text())
        assert len(record["processes"]) == 2 and record["state"] == "running"   # the server and its worker
        waiting = json.loads((root / "jobs" / f"{second}.capture.json").read_text())
        assert waiting["state"] == "queued" and len(waiting["processes"]) == 1    # queued: recorded before it starts
    finally:
        server.kill()                                                       # the server stops mid-job
        server.wait()
    wait_until(lambda: not any(process_stamp(int(p.split(":")[0])) == p for p in record["processes"]), timeout=60)

    monkeypatch.setenv("LAYERSCOPE_STORE", str(root))                      # the restarted server, on the same store
    monkeypatch.setenv("LAYERSCOPE_WORKER", "thread")
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state[OWNER_KEY] = token
    at.query_params["session"] = owner
    at.run()
    at.switch_page("app_pages/capture.py").run()
    assert not at.exception, [e.value for e in at.exception]
    shown = [w.value.replace("\\", "") for w in at.warning if "interrupted" in w.value]    # Markdown escapes off
    assert len(shown) == 1 and "Capture of tiny-llama was interrupted: the server stopped while it ran" in shown[0]
    assert "Start the capture again with the same options: it resumes from the chunks it finished" in shown[0]
    # a later restart says it again (the record is kept, marked), until the user dismisses it on the page
    again = JobManager(mode="thread", records=root / "jobs")
    assert again.latest(owner, "capture").state == INTERRUPTED
    queued = again.latest(second, "capture")
    assert queued.state == INTERRUPTED and "the server stopped while it was waiting to start" in queued.error
    assert queued.fix.startswith("It was waiting for another job and never started")
    at.run()
    assert [w for w in at.warning if "interrupted" in w.value]                # not said only once
    [dismiss] = [b for b in at.button if b.label == "Dismiss"]
    dismiss.click().run()
    assert not [w for w in at.warning if "interrupted" in w.value], [w.value for w in at.warning]
    assert not (root / "jobs" / f"{owner}.capture.json").exists()
    assert JobManager(mode="thread", records=root / "jobs").latest(owner, "capture") is None
    # starting that kind of job again replaces the interrupted one
    fresh = again.submit(second, "capture", capture(Store(root), seed=11), title="Capture again")
    assert fresh.wait(TIMEOUT) and again.latest(second, "capture").state == DONE
    assert not (root / "jobs" / f"{second}.capture.json").exists()


def test_a_running_job_is_not_taken_for_interrupted(store, tmp_path):
    records = tmp_path / "jobs"
    m = JobManager(mode="thread", records=records)
    job = m.submit("s9", "capture", capture(store, seed=9), title="Capture")
    wait_until(lambda: (records / "s9.capture.json").exists() or job.view().state not in ("queued", "running"))
    assert JobManager(mode="thread", records=records).latest("s9", "capture") is None   # its server lives
    assert job.wait(TIMEOUT) and job.view().state == DONE and not (records / "s9.capture.json").exists()
    assert job.view().state != INTERRUPTED
