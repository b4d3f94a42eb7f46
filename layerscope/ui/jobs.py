"""Background jobs for the app: long work runs in a thread, pages poll a thread-safe progress record.

A `JobManager` lives in `st.cache_resource` (one per server process), so a job outlives the script
run that started it, page switches and browser refreshes: a page finds the job again by its owner
(the analysis session id) and kind ("capture", "analysis", "train", "bench", ...). At most
`max_running` jobs compute at once (default 1: on a 2-core CPU two jobs only slow each other down);
the others wait in line and say so.

A job function receives its `Job` and reports through it: `job.update(progress, message, **metrics)`,
`job.push(series, value)` for live curves, `job.should_stop()` / `job.check_cancel()` for cancel.
A `LayerScopeError` becomes a readable error with its fix; any other exception is logged to the
server log with its traceback and shown as a short message, never as a traceback.

A job may carry a typed `tag` saying what it computes (`StatsTag`: which capture, which options), so
a page can tell whether the latest job of a kind is the one it wants.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import streamlit as st

from layerscope.errors import LayerScopeError

log = logging.getLogger("layerscope.jobs")

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
FINISHED = (DONE, FAILED, CANCELLED)


class JobCancelled(Exception):
    """Raised inside a job function (by `check_cancel`) when the user pressed cancel."""


@dataclass(frozen=True)
class StatsTag:
    """What a statistics job computes: layer statistics of `capture_key` with these analysis options."""

    capture_key: str
    options: dict


@dataclass
class JobView:
    """A consistent copy of a job's state, safe to read in a page while the job runs."""

    id: str
    owner: str
    kind: str
    title: str
    state: str
    progress: float | None
    message: str
    metrics: dict
    series: dict
    result: Any
    error: str | None
    fix: str | None
    created: float
    started: float | None
    finished: float | None
    applied: bool
    cancel_requested: bool

    @property
    def running(self) -> bool:
        return self.state in (QUEUED, RUNNING)

    @property
    def finished_ok(self) -> bool:
        return self.state == DONE

    @property
    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.time()) - self.started


@dataclass
class Job:
    id: str
    owner: str
    kind: str
    title: str
    fn: Callable[["Job"], Any] = field(repr=False)
    tag: StatsTag | None = None
    state: str = QUEUED
    progress: float | None = None
    message: str = "waiting to start"
    metrics: dict = field(default_factory=dict)
    series: dict = field(default_factory=dict)
    result: Any = None
    error: str | None = None
    fix: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    applied: bool = False
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ called by the job function
    def update(self, progress: float | None = None, message: str | None = None, **metrics) -> None:
        with self._lock:
            if progress is not None:
                self.progress = min(max(float(progress), 0.0), 1.0)
            if message is not None:
                self.message = message
            self.metrics.update(metrics)

    def push(self, name: str, value, limit: int = 20_000) -> None:
        """Append to a live series (loss per step, τ per verification step, ...)."""
        with self._lock:
            s = self.series.setdefault(name, [])
            s.append(value)
            if len(s) > limit:
                del s[: len(s) - limit]

    def set_series(self, name: str, values) -> None:
        with self._lock:
            self.series[name] = list(values)

    def should_stop(self) -> bool:
        return self._cancel.is_set()

    def check_cancel(self) -> None:
        if self._cancel.is_set():
            raise JobCancelled()

    # ------------------------------------------------------------------ called by pages
    def cancel(self) -> None:
        self._cancel.set()
        with self._lock:
            if self.state == QUEUED:
                self.message = "cancelling"

    def mark_applied(self) -> None:
        with self._lock:
            self.applied = True

    def view(self) -> JobView:
        with self._lock:
            return JobView(
                id=self.id, owner=self.owner, kind=self.kind, title=self.title, state=self.state,
                progress=self.progress, message=self.message, metrics=dict(self.metrics),
                series={k: list(v) for k, v in self.series.items()}, result=self.result,
                error=self.error, fix=self.fix, created=self.created, started=self.started,
                finished=self.finished, applied=self.applied, cancel_requested=self._cancel.is_set(),
            )

    def wait(self, timeout: float | None = None) -> bool:
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self.state in FINISHED

    def _finish(self, state: str, result=None, error: str | None = None, fix: str | None = None) -> None:
        with self._lock:
            self.state, self.result, self.error, self.fix = state, result, error, fix
            self.finished = time.time()
            if state == DONE:
                self.progress = 1.0
                if self.message in ("", "waiting to start") or not self.message:
                    self.message = "done"
            elif state == CANCELLED:
                self.message = "cancelled"


class JobManager:
    """Runs jobs in threads, at most `max_running` at a time, and keeps the recent ones for polling."""

    def __init__(self, max_running: int | None = None, keep: int = 200):
        if max_running is None:
            max_running = int(os.environ.get("LAYERSCOPE_JOBS", "1"))
        self.max_running = max(1, max_running)
        self._slots = threading.BoundedSemaphore(self.max_running)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.keep = keep

    def submit(self, owner: str, kind: str, fn: Callable[[Job], Any], *, title: str | None = None,
               tag: StatsTag | None = None) -> Job:
        """Start `fn(job)` in the background. A running job of the same owner and kind is refused."""
        with self._lock:
            current = self._latest_locked(owner, kind)
            if current is not None and current.state in (QUEUED, RUNNING):
                raise LayerScopeError(f"A {kind} job is already running for this session ({current.title})",
                                      "Wait for it to finish or cancel it first")
            job = Job(id=f"{kind}-{next(self._ids)}-{int(time.time() * 1000) % 100000}", owner=owner, kind=kind,
                      title=title or kind, fn=fn, tag=tag)
            self._jobs[job.id] = job
            self._trim_locked()
        job._thread = threading.Thread(target=self._run, args=(job,), name=f"layerscope-{job.id}", daemon=True)
        job._thread.start()
        return job

    def _run(self, job: Job) -> None:
        ahead = sum(1 for j in self.jobs() if j.state == RUNNING)
        if ahead >= self.max_running:
            job.update(message=f"waiting for {ahead} running job(s) to finish")
        while not self._slots.acquire(timeout=0.2):
            if job.should_stop():
                job._finish(CANCELLED)
                return
        try:
            if job.should_stop():
                job._finish(CANCELLED)
                return
            with job._lock:
                job.state, job.started, job.message = RUNNING, time.time(), "starting"
            try:
                result = job.fn(job)
            except JobCancelled:
                job._finish(CANCELLED)
            except LayerScopeError as e:
                if job.should_stop():
                    job._finish(CANCELLED, error=e.problem, fix=e.fix)
                else:
                    job._finish(FAILED, error=e.problem, fix=e.fix)
            except Exception as e:  # a bug, not a user error: log it, show a short message
                log.exception("job %s (%s) failed", job.id, job.title)
                job._finish(FAILED, error=f"Unexpected error in {job.title}: {type(e).__name__}: {e}",
                            fix="This is a bug in LayerScope; the server log has the details")
            else:
                if job.should_stop() and result is None:
                    job._finish(CANCELLED)
                else:
                    job._finish(DONE, result=result)
        finally:
            self._slots.release()

    def _latest_locked(self, owner: str, kind: str) -> Job | None:
        found = [j for j in self._jobs.values() if j.owner == owner and j.kind == kind]
        return max(found, key=lambda j: j.created) if found else None

    def _trim_locked(self) -> None:
        done = sorted((j for j in self._jobs.values() if j.state in FINISHED), key=lambda j: j.created)
        for j in done[: max(0, len(self._jobs) - self.keep)]:
            self._jobs.pop(j.id, None)

    def latest(self, owner: str, kind: str) -> Job | None:
        with self._lock:
            return self._latest_locked(owner, kind)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def jobs(self, owner: str | None = None) -> list[Job]:
        with self._lock:
            found = [j for j in self._jobs.values() if owner is None or j.owner == owner]
        return sorted(found, key=lambda j: j.created)

    def active(self, owner: str | None = None) -> list[Job]:
        return [j for j in self.jobs(owner) if j.state in (QUEUED, RUNNING)]

    def cancel(self, job_id: str) -> None:
        job = self.get(job_id)
        if job is not None:
            job.cancel()


@st.cache_resource(show_spinner=False)
def get_manager() -> JobManager:
    """The process-wide JobManager, kept in st.cache_resource so it survives reruns and refreshes."""
    return JobManager()
