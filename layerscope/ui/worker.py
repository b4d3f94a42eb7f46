"""The app's worker process: heavy jobs run there, not in the Streamlit server, so the server's interpreter
(busy drawing pages for every open tab) is never their bottleneck.

What runs where:

- server: `jobs.JobManager` keeps the `Job` records the pages read. A job whose function is a `Task` is
  sent to a `Worker`; the job's thread in the server pumps the worker's messages into the `Job`
  (progress, series, the outcome) and passes a cancel on.
- worker: a fresh interpreter (`python -c "...worker.main()"`), never a fork of the server (which holds
  torch's threads). It builds the job function from the task (`Task.build`, which imports the builder's
  module) and runs it with a `RemoteJob` that has the job side of the `Job` API (update, push, set_series,
  should_stop, check_cancel). It keeps its own model cache (`ui.model_cache`) between jobs: a model loads once
  per worker. Which modules it imports before the first job is the server's to say (`Worker(imports=...)`:
  jobs.WORKER_IMPORTS, the builders of ui.tasks); this module knows no job.

The worker is started with `subprocess`, not multiprocessing's spawn context: Streamlit replaces
`sys.modules["__main__"]` with a module whose `__file__` is app.py, and spawn re-runs the parent's main
file in the child, so a spawned worker would run the whole app. It talks over a private socket pair
with `multiprocessing.connection` (pickled messages):

    server -> worker   ("run", job_id, title, task)   ("cancel", job_id)   ("quit",)
    worker -> server   ("ready", info)   ("models", loaded)   ("progress", job_id, delta)
                       ("finish", job_id, Outcome)

If the worker dies (killed, out of memory), the server sees the socket close: the job fails with a
clear message and the next job starts a fresh worker. If the server dies, the worker sees the same
and exits.

`run_job` is the one place that turns a job function's return or exception into an outcome (done,
cancelled, a `LayerScopeError`'s problem and fix, or an unexpected error as one line plus its
traceback); threads and the worker both use it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from layerscope.errors import LayerScopeError
from layerscope.store import Store, as_write_error
from layerscope.ui import model_cache

DONE, FAILED, CANCELLED = "done", "failed", "cancelled"
FLUSH_S = 0.1          # the worker sends coalesced progress at most this often
IDLE_POLL_S = 1.0      # between jobs it wakes this often (to notice a server gone without closing the socket)
ENTRY = "import sys; from layerscope.ui.worker import main; main(sys.argv[1:])"


class JobCancelled(Exception):
    """Raised inside a job function (by `check_cancel`) when the user pressed cancel."""


# ---------------------------------------------------------------------------- a job as data

@dataclass
class Task:
    """A job described as picklable data, so it can cross to the worker: the builder `name` in `module`
    (made by `job_task`), its keyword arguments, and the store as its root path.

    Calling it runs the job here (`task(job)`, the thread mode); the worker builds it afresh (`build`).
    """

    module: str
    name: str
    kwargs: dict
    store_root: str | None = None
    fn: Callable | None = field(default=None, repr=False, compare=False)     # built in the server; never pickled

    def __getstate__(self):
        return {**self.__dict__, "fn": None}

    def build(self) -> Callable:
        """The job function `fn(job)`, built in this process (the Store at `store_root` opened here)."""
        builder = getattr(importlib.import_module(self.module), self.name).builder
        if self.store_root is None:
            return builder(**self.kwargs)
        return builder(store=_store(self.store_root), **self.kwargs)

    def __call__(self, job):
        return (self.fn or self.build())(job)


def job_task(builder: Callable) -> Callable[..., Task]:
    """Decorator for a job builder `builder(*, store, **kwargs) -> fn(job)`: calling it builds the function
    (so bad options fail at once, where the page starts the job) and returns it as a `Task`, which the
    JobManager runs in the worker (or, in thread mode, calls in a thread)."""

    @functools.wraps(builder)
    def make(**kwargs) -> Task:
        fn = builder(**kwargs)
        store = kwargs.pop("store", None)
        return Task(builder.__module__, builder.__name__, kwargs,
                    store_root=None if store is None else str(store.root), fn=fn)

    make.builder = builder
    return make


_stores: dict[str, Store] = {}


def _store(root: str) -> Store:
    """One Store per root in this process (the worker's)."""
    if root not in _stores:
        _stores[root] = Store(root)
    return _stores[root]


# ---------------------------------------------------------------------------- outcomes

@dataclass
class Outcome:
    """How a job ended: its state, result, the error line and fix shown to the user, and (for a bug)
    the traceback the server logs."""

    state: str
    result: Any = None
    error: str | None = None
    fix: str | None = None
    traceback: str | None = None


def run_job(fn: Callable, job, title: str) -> Outcome:
    """Run `fn(job)` and say how it ended. A cancel wins over a result of None or a LayerScopeError."""
    try:
        result = fn(job)
    except JobCancelled:
        return Outcome(CANCELLED)
    except LayerScopeError as e:
        return Outcome(CANCELLED if job.should_stop() else FAILED, error=e.problem, fix=e.fix)
    except Exception as e:  # a bug, not a user error: one line for the user, the traceback for the log
        full = as_write_error(e)      # ... unless it is a write that met a full or read-only disk
        if full is not None:
            return Outcome(FAILED, error=full.problem, fix=full.fix)
        return Outcome(FAILED, error=f"Unexpected error in {title}: {type(e).__name__}: {e}",
                       fix="This is a bug in LayerScope; the server log has the details",
                       traceback=traceback.format_exc())
    if job.should_stop() and result is None:
        return Outcome(CANCELLED)
    return Outcome(DONE, result=result)


# ---------------------------------------------------------------------------- server side

class WorkerDied(Exception):
    """The worker process ended while the server waited for it; `str(e)` says how ('was killed by SIGKILL')."""


class Worker:
    """The server's handle on one worker process: start it, send it tasks, read its messages."""

    def __init__(self, imports: tuple[str, ...] = ()):
        """Start the process; it imports the modules `imports` (the job builders: jobs.WORKER_IMPORTS) before it
        says it is ready, so the first job does not wait for them."""
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        preload = [arg for name in imports for arg in ("--import", name)]
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, "--fd", str(fd), *preload], pass_fds=(fd,),
                                     start_new_session=True)     # Ctrl-C on the server's terminal is the server's
        theirs.close()
        self.conn = Connection(ours.detach())
        self.models: dict[str, dict] = {}     # what it has loaded: spec -> {"device", "loads", "seconds"}
        self.info: dict = {}
        self._send_lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except OSError as e:
            raise WorkerDied(self._how()) from e

    def recv(self, timeout: float):
        """The next message, or None after `timeout` s. Worker bookkeeping ("ready", "models") is kept here."""
        try:
            if not self.conn.poll(timeout):
                return None
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerDied(self._how()) from e
        if msg[0] == "ready":
            self.info = msg[1]
        elif msg[0] == "models":
            self.models = msg[1]
        return msg

    def _how(self) -> str:
        """How the process ended, as a predicate: 'was killed by SIGKILL (...)', 'exited with code 1'."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "lost its connection to the server"
        if code < 0:
            name = signal.Signals(-code).name
            return f"was killed by {name}" + (" (perhaps the system ran out of memory)" if -code == signal.SIGKILL else "")
        return f"exited with code {code}"

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the worker to quit; kill it if it does not within `timeout` s."""
        try:
            with self._send_lock:
                self.conn.send(("quit",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.conn.close()


# ---------------------------------------------------------------------------- worker side

class RemoteJob:
    """The job side of `jobs.Job` inside the worker: progress is collected here and sent to the server
    (coalesced, every FLUSH_S) by the channel; cancel comes from the server."""

    def __init__(self, job_id: str):
        self.id = job_id
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._progress: float | None = None
        self._message: str | None = None
        self._metrics: dict = {}
        self._ops: list = []          # ("push", name, value, limit) / ("set", name, values), in order

    def update(self, progress: float | None = None, message: str | None = None, **metrics) -> None:
        with self._lock:
            if progress is not None:
                self._progress = progress
            if message is not None:
                self._message = message
            self._metrics.update(metrics)

    def push(self, name: str, value, limit: int = 20_000) -> None:
        with self._lock:
            self._ops.append(("push", name, value, limit))

    def set_series(self, name: str, values) -> None:
        with self._lock:
            self._ops.append(("set", name, list(values)))

    def should_stop(self) -> bool:
        return self._cancel.is_set()

    def check_cancel(self) -> None:
        if self._cancel.is_set():
            raise JobCancelled()

    def drain(self) -> dict | None:
        """What changed since the last drain, or None: {"progress", "message", "metrics", "ops"}."""
        with self._lock:
            if self._progress is None and self._message is None and not self._metrics and not self._ops:
                return None
            delta = {"progress": self._progress, "message": self._message, "metrics": self._metrics, "ops": self._ops}
            self._progress, self._message, self._metrics, self._ops = None, None, {}, []
        return delta


class _Channel:
    """The worker's end of the socket: a thread reads requests (run, cancel, quit) and sends progress."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.requests: queue.Queue = queue.Queue()
        self.job: RemoteJob | None = None
        self._run_sent = False           # a run arrived and has not finished: flush every FLUSH_S from its start
        self._send_lock = threading.RLock()
        self._models_sent: dict = {}
        self._parent = os.getppid()
        threading.Thread(target=self._loop, name="layerscope-worker-channel", daemon=True).start()

    def send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _loop(self) -> None:
        while True:
            try:
                # a job's first progress must not wait out an idle poll: a job shorter than IDLE_POLL_S showed none
                busy = self.job is not None or self._run_sent
                if self.conn.poll(FLUSH_S if busy else IDLE_POLL_S):
                    msg = self.conn.recv()
                    if msg[0] == "run":
                        self._run_sent = True
                    if msg[0] == "cancel":
                        job = self.job
                        if job is not None and job.id == msg[1]:
                            job._cancel.set()
                    else:
                        self.requests.put(msg)
                self.flush()
            except (EOFError, OSError):
                os._exit(0)            # the server is gone: nobody is waiting for this job
            if os.getppid() != self._parent:
                os._exit(0)

    def flush(self) -> None:
        """Send the current job's progress since the last flush and, if changed, the loaded models."""
        with self._send_lock:
            job = self.job
            delta = job.drain() if job is not None else None
            if delta is not None:
                self.conn.send(("progress", job.id, delta))
            loaded = model_cache.loaded_models()
            if loaded != self._models_sent:
                self.conn.send(("models", loaded))
                self._models_sent = loaded

    def finish(self, job: RemoteJob, outcome: Outcome) -> None:
        with self._send_lock:
            self.flush()
            self.job = None
            self._run_sent = False
            try:
                self.conn.send(("finish", job.id, outcome))
            except OSError:
                raise
            except Exception as e:  # pickle's errors: a result that is not plain data
                self.conn.send(("finish", job.id, Outcome(
                    FAILED, error=f"Unexpected error: the job's result cannot be sent to the server ({type(e).__name__}: {e})",
                    fix="This is a bug in LayerScope; the server log has the details", traceback=traceback.format_exc())))


def main(argv=None) -> None:
    """The worker process: run tasks one after the other until the server says quit or goes away."""
    ap = argparse.ArgumentParser(prog="layerscope-worker")
    ap.add_argument("--fd", type=int, required=True, help="this end of the socket pair to the server")
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                    help="a module to import before the first job (repeatable)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = _Channel(Connection(args.fd))
    for name in args.imports:                  # the job builders and what they import, before the first job
        importlib.import_module(name)
    channel.send(("ready", {"pid": os.getpid(), "device": model_cache.device_label(), "started": time.time()}))
    while True:
        msg = channel.requests.get()
        if msg[0] != "run":
            break
        _, job_id, title, task = msg
        job = RemoteJob(job_id)
        channel.job = job
        outcome = run_job(lambda j: task.build()(j), job, title)
        channel.finish(job, outcome)
    channel.conn.close()
