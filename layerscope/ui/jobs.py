"""Background jobs for the app: long work runs outside the script run, pages poll a thread-safe progress record.

A `JobManager` lives in `st.cache_resource` (one per server process), so a job outlives the script
run that started it, page switches and browser refreshes: a page finds the job again by its owner
(the analysis session id) and kind ("capture", "analysis", "train", "bench", ...). At most
`max_running` jobs compute at once (default 1: on a 2-core CPU two jobs only slow each other down);
the others wait in line and say so.

Where a job computes is one setting, LAYERSCOPE_WORKER:

- `process` (the default): a job described as a `worker.Task` (every builder in ui.tasks makes one:
  capture, analysis, training, online training, benchmark, study) runs in a worker process
  (`ui.worker`) that keeps its own model cache between jobs; the job's thread here only pumps the
  worker's progress into the `Job` and passes a cancel on. If the worker dies (killed, out of memory)
  the job fails with a message saying so and the next job starts a fresh worker.
- `thread`: every job runs in a thread of the server process (the old way; the server's own work
  for open tabs then competes with the job for the interpreter).

A plain function `fn(job)` (not a Task) always runs in a thread.

A job function receives its `Job` and reports through it: `job.update(progress, message, **metrics)`,
`job.push(series, value)` for live curves, `job.should_stop()` / `job.check_cancel()` for cancel.
A `LayerScopeError` becomes a readable error with its fix; any other exception is logged to the
server log with its traceback and shown as a short message, never as a traceback.

A job that runs a `Task` leaves a record in the store (`<store>/jobs/<owner>.<kind>.json`: its title, its state,
when it was submitted and started, the server's and the worker's process) from the moment it is submitted, queued
or running. A server that stops mid-job (a restart, a kill) cannot remove it, so after the restart
`latest(owner, kind)` finds the record, sees that none of its processes lives, and shows the job as INTERRUPTED
with one line on how to resume (a capture and online training resume from what they kept when started again with
the same options; a queued job never started). The record is marked interrupted and kept, so every later page view
and every later restart says so too, until the user dismisses it (`dismiss`) or starts that kind of job again.

A job may carry a typed `tag` saying what it computes (`StatsTag`: which capture, which options), so
a page can tell whether the latest job of a kind is the one it wants.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from layerscope import fmt
from layerscope.errors import LayerScopeError
from layerscope.store import atomic_write_json, default_root
from layerscope.ui.worker import CANCELLED, DONE, FAILED, JobCancelled, Outcome, Task, Worker, WorkerDied, run_job

log = logging.getLogger("layerscope.ui.jobs")     # the app's jobs: failures with their tracebacks, workers that died or hung

QUEUED, RUNNING = "queued", "running"
INTERRUPTED = "interrupted"         # the server stopped while the job ran (found after a restart)
FINISHED = (DONE, FAILED, CANCELLED, INTERRUPTED)
MODES = ("process", "thread")
__all__ = ["CANCELLED", "DONE", "FAILED", "FINISHED", "INTERRUPTED", "QUEUED", "RUNNING", "Job", "JobCancelled", "JobManager",
           "JobView", "StatsTag", "Task", "get_manager", "worker_mode"]


CANCEL_GRACE_S = 10.0    # a job in the worker that has not stopped this long after Cancel has its worker stopped
WORKER_IMPORTS = ("layerscope.ui.tasks",)   # what a worker imports before its first job: the job builders


RECORD_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
# how to resume, per job kind: the same action again (what each keeps while it runs)
RESUME = {
    "capture": "Start the capture again with the same options: it resumes from the chunks it finished",
    "train": "Start the training again with the same options: online training resumes from its last checkpoint "
             "(training from a capture starts over)",
    "study": "Start the study again with the same options: online training resumes from its last checkpoint",
}
QUEUED_RESUME = "It was waiting for another job and never started: start it again"


def process_stamp(pid: int) -> str | None:
    """A process's id and start time ("pid:ticks", from /proc): a pid reused by another process reads otherwise.
    None when the process does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except OSError:
            pass
        return f"{pid}:?"


def worker_mode(value: str | None = None) -> str:
    """Where Task jobs run: LAYERSCOPE_WORKER=process (default: a worker process) or thread (the server)."""
    mode = (value if value is not None else os.environ.get("LAYERSCOPE_WORKER", "process")).strip().lower() or "process"
    if mode not in MODES:
        raise LayerScopeError(f"LAYERSCOPE_WORKER={mode!r} is not a worker mode",
                              "Set it to process (jobs run in a worker process) or thread (in the server)")
    return mode


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
    on_drop: Callable[[], Any] | None = field(default=None, repr=False)    # called if it ends before it starts
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

    def _apply(self, delta: dict) -> None:
        """Progress sent by the worker (`worker.RemoteJob.drain`), applied in the order it was made."""
        with self._lock:
            self.update(delta["progress"], delta["message"], **delta["metrics"])
            for op in delta["ops"]:
                if op[0] == "push":
                    self.push(op[1], op[2], op[3])
                else:
                    self.set_series(op[1], op[2])

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
    """Runs jobs (in the worker process or in threads, `mode`), at most `max_running` at a time, and keeps the
    recent ones for polling."""

    def __init__(self, max_running: int | None = None, keep: int = 200, mode: str | None = None,
                 cancel_grace_s: float = CANCEL_GRACE_S, records: str | os.PathLike | Callable[[], Path] | None = None):
        """records: the directory of running jobs' records, or a function that says it at each use (the app's:
        `<store>/jobs` of the store in use, `default_root`); None keeps none."""
        if max_running is None:
            max_running = int(os.environ.get("LAYERSCOPE_JOBS", "1"))
        self.max_running = max(1, max_running)
        self.mode = worker_mode(mode)
        self._slots = threading.BoundedSemaphore(self.max_running)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.keep = keep
        self.cancel_grace_s = cancel_grace_s
        self._idle: list[Worker] = []        # started workers not running a job (at most max_running in all)
        self._busy: list[Worker] = []
        self.records = records

    def submit(self, owner: str, kind: str, fn: Callable[[Job], Any], *, title: str | None = None,
               tag: StatsTag | None = None, on_drop: Callable[[], Any] | None = None) -> Job:
        """Start `fn(job)` in the background (a `Task` in the worker, in process mode). A running job of the
        same owner and kind is refused. `on_drop()` runs when the job is cancelled before it starts (it then never
        runs `fn`, so what `fn` would release at its end is released there: an upload's hold)."""
        with self._lock:
            current = self._latest_locked(owner, kind)
            if current is not None and current.state in (QUEUED, RUNNING):
                raise LayerScopeError(f"A {kind} job is already running for this session ({current.title})",
                                      "Wait for it to finish or cancel it first")
            job = Job(id=f"{kind}-{next(self._ids)}-{int(time.time() * 1000) % 100000}", owner=owner, kind=kind,
                      title=title or kind, fn=fn, tag=tag, on_drop=on_drop)
            self._jobs[job.id] = job
            self._trim_locked()
            for j in [j for j in self._jobs.values() if j.owner == owner and j.kind == kind and j.state == INTERRUPTED]:
                self._jobs.pop(j.id)                 # superseded: this job's record replaces the interrupted one's
        self._write_record(job)
        job._thread = threading.Thread(target=self._run, args=(job,), name=f"layerscope-{job.id}", daemon=True)
        job._thread.start()
        return job

    def _run(self, job: Job) -> None:
        ahead = sum(1 for j in self.jobs() if j.state == RUNNING)
        if ahead >= self.max_running:
            job.update(message=f"waiting for {ahead} running job(s) to finish")
        while not self._slots.acquire(timeout=0.2):
            if job.should_stop():
                self._cancelled_unstarted(job)
                self._drop_record(job)
                return
        try:
            if job.should_stop():
                self._cancelled_unstarted(job)
                return
            with job._lock:
                job.state, job.started, job.message = RUNNING, time.time(), "starting"
            self._write_record(job)
            if self.mode == "process" and isinstance(job.fn, Task):
                self._run_in_worker(job)
            else:
                self._settle(job, run_job(job.fn, job, job.title))
        finally:
            self._slots.release()
            self._drop_record(job)

    def _cancelled_unstarted(self, job: Job) -> None:
        """`job` was cancelled while it waited: it ends cancelled, and its on_drop runs (its failure logged)."""
        if job.on_drop is not None:
            try:
                job.on_drop()
            except Exception:
                log.exception("releasing what the cancelled job %s held failed", job.title)
        job._finish(CANCELLED)

    # ------------------------------------------------------------------ records of running jobs (restarts)
    def _record_path(self, owner: str, kind: str) -> Path | None:
        if self.records is None or not RECORD_NAME_RE.fullmatch(owner) or not RECORD_NAME_RE.fullmatch(kind):
            return None
        return Path(self.records() if callable(self.records) else self.records) / f"{owner}.{kind}.json"

    def _write_record(self, job: Job, worker: Worker | None = None) -> None:
        """Say in the store that `job` runs here (Task jobs only: the others are the server's own)."""
        path = self._record_path(job.owner, job.kind)
        if path is None or not isinstance(job.fn, Task):
            return
        processes = [process_stamp(os.getpid())] + ([process_stamp(worker.pid)] if worker is not None else [])
        try:
            atomic_write_json(path, {"id": job.id, "owner": job.owner, "kind": job.kind, "title": job.title,
                                     "state": job.state, "created": job.created, "started": job.started,
                                     "processes": [p for p in processes if p]})
        except Exception as e:       # best effort: a read-only store keeps no records
            log.warning("could not write the record of job %s: %s", job.id, e)

    def _drop_record(self, job: Job) -> None:
        path = self._record_path(job.owner, job.kind)
        if path is None:
            return
        try:
            if json.loads(path.read_text()).get("id") == job.id:
                path.unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def _interrupted_locked(self, owner: str, kind: str) -> Job | None:
        """The job of a record whose processes are all gone (the server stopped while it was queued or ran), as an
        INTERRUPTED job with one line on how to resume. The record is kept, marked interrupted, so that later views
        and later restarts say it too (until `dismiss` or a new job of that kind). None when there is no record,
        or its job runs here or in a server that still lives."""
        path = self._record_path(owner, kind)
        if path is None or not path.is_file():
            return None
        try:
            rec = json.loads(path.read_text())
            if rec["id"] in self._jobs:
                return None                                  # this server's own job (or the interrupted one shown)
            if not rec.get("interrupted") and any(process_stamp(int(p.split(":")[0])) == p for p in rec["processes"]):
                return None                                  # running in a server that still lives
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            rec = {"id": f"{kind}-record", "title": kind}    # a damaged record: the job is as lost
        started = rec.get("started") if isinstance(rec.get("started"), (int, float)) else None
        created = rec.get("created") if isinstance(rec.get("created"), (int, float)) else started
        title = str(rec.get("title") or kind)
        queued = rec.get("state") == QUEUED
        stamp = started if started else created
        when = f" ({'submitted' if queued else 'started'} {fmt.when(datetime.fromtimestamp(stamp).astimezone().isoformat())})" \
            if stamp else ""
        what = "was waiting to start" if queued else "ran"
        job = Job(id=str(rec.get("id")), owner=owner, kind=kind, title=title, fn=None, state=INTERRUPTED,
                  message="interrupted", started=started, finished=started,
                  error=f"{title} was interrupted: the server stopped while it {what}{when}",
                  fix=QUEUED_RESUME if queued else RESUME.get(kind, f"Start the {kind} again"))
        if created:
            job.created = created
        self._jobs[job.id] = job
        if not rec.get("interrupted"):
            try:
                atomic_write_json(path, {**rec, "interrupted": True})
            except Exception as e:       # best effort: a read-only store says it once
                log.warning("could not mark the record of job %s interrupted: %s", job.id, e)
        return job

    def dismiss(self, owner: str, kind: str) -> None:
        """Forget an interrupted job of `owner` and `kind`: its record goes, and `latest` no longer shows it."""
        with self._lock:
            for j in [j for j in self._jobs.values() if j.owner == owner and j.kind == kind and j.state == INTERRUPTED]:
                self._jobs.pop(j.id)
            path = self._record_path(owner, kind)
            if path is not None and path.is_file():
                try:
                    if json.loads(path.read_text()).get("interrupted"):
                        path.unlink()
                except (OSError, ValueError, AttributeError):
                    path.unlink(missing_ok=True)

    def _settle(self, job: Job, outcome: Outcome, where: str = "") -> None:
        if outcome.traceback:        # a bug, not a user error: the traceback goes to the server log
            log.error("job %s (%s) failed%s:\n%s", job.id, job.title, where, outcome.traceback.rstrip())
        job._finish(outcome.state, result=outcome.result, error=outcome.error, fix=outcome.fix)

    # ------------------------------------------------------------------ the worker process
    def start_worker(self) -> None:
        """Start a worker now (process mode), so the first job does not wait for its imports."""
        if self.mode != "process":
            return
        with self._lock:
            if self._idle or self._busy:
                return
        worker = Worker(WORKER_IMPORTS)
        with self._lock:
            self._idle.append(worker)

    def _take_worker(self, job: Job) -> Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    break
                worker.kill()
            else:
                worker = None
        if worker is None:
            worker = Worker(WORKER_IMPORTS)
        if not worker.info:
            job.update(message="starting the worker process")
        with self._lock:
            self._busy.append(worker)
        return worker

    def _release_worker(self, worker: Worker, alive: bool) -> None:
        with self._lock:
            if worker in self._busy:
                self._busy.remove(worker)
            if alive:
                self._idle.append(worker)
        if not alive:
            worker.kill()

    def _run_in_worker(self, job: Job) -> None:
        """Send the job's Task to a worker, pump its messages into `job` until it finishes, pass a cancel on."""
        try:
            worker = self._take_worker(job)
            self._write_record(job, worker)
        except OSError as e:
            job._finish(FAILED, error=f"Could not start the worker process for {job.title} ({e})",
                        fix="Check the server's memory and process limits, or set LAYERSCOPE_WORKER=thread")
            return
        cancel_sent = None          # when the cancel went to the worker
        try:
            try:
                worker.send(("run", job.id, job.title, job.fn))
            except WorkerDied:
                raise
            except Exception as e:  # the task is not picklable: a bug in the page that built it
                self._release_worker(worker, alive=True)
                self._settle(job, Outcome(FAILED, error=f"Unexpected error in {job.title}: the job cannot be sent to "
                                                        f"the worker process ({type(e).__name__}: {e})",
                                          fix="This is a bug in LayerScope; the server log has the details",
                                          traceback=traceback.format_exc()))
                return
            while True:
                if cancel_sent is None and job.should_stop():
                    worker.send(("cancel", job.id))
                    cancel_sent = time.monotonic()
                elif cancel_sent is not None and time.monotonic() - cancel_sent > self.cancel_grace_s:
                    # the job does not check for a cancel where it is (a model load, one long forward):
                    # stop its worker, so Cancel always cancels; the next job starts a fresh worker
                    self._release_worker(worker, alive=False)
                    log.warning("job %s (%s) did not stop within %.0f s of its cancel: worker process %d stopped",
                                job.id, job.title, self.cancel_grace_s, worker.pid)
                    job._finish(CANCELLED)
                    job.update(message=f"cancelled (it did not stop within {self.cancel_grace_s:.0f} s, so its "
                                       "worker process was stopped; models it held load again on the next job)")
                    return
                msg = worker.recv(0.2)
                if msg is None or len(msg) < 3 or msg[1] != job.id:
                    continue
                if msg[0] == "progress":
                    job._apply(msg[2])
                elif msg[0] == "finish":
                    self._release_worker(worker, alive=True)
                    self._settle(job, msg[2], where=f" in worker process {worker.pid}")
                    return
        except WorkerDied as e:
            self._release_worker(worker, alive=False)
            log.error("the worker process %d died while running job %s (%s): %s", worker.pid, job.id, job.title, e)
            job._finish(FAILED, error=f"The worker process running {job.title} {e}; the job is lost",
                        fix="Start it again: the next job starts a fresh worker. If it happens again, use a smaller "
                            "model, fewer prompts or a smaller batch, or watch the server's memory")

    def worker_models(self) -> dict[str, dict]:
        """The models the live workers hold: spec -> {"device", "loads", "seconds", "pid"} (what a job will find)."""
        with self._lock:
            workers = [w for w in self._idle + self._busy if w.alive()]
        return {spec: {**info, "pid": w.pid} for w in workers for spec, info in w.models.items()}

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (idle or busy)."""
        with self._lock:
            return [w.pid for w in self._idle + self._busy if w.alive()]

    def close(self) -> None:
        """Stop the workers (a running job's worker too: its job fails as a stopped worker)."""
        with self._lock:
            workers, self._idle = self._idle + self._busy, []
        for w in workers:
            w.close()

    def _latest_locked(self, owner: str, kind: str) -> Job | None:
        found = [j for j in self._jobs.values() if j.owner == owner and j.kind == kind]
        return max(found, key=lambda j: j.created) if found else None

    def _trim_locked(self) -> None:
        done = sorted((j for j in self._jobs.values() if j.state in FINISHED), key=lambda j: j.created)
        for j in done[: max(0, len(self._jobs) - self.keep)]:
            self._jobs.pop(j.id, None)

    def latest(self, owner: str, kind: str) -> Job | None:
        """The newest job of `owner` and `kind`: one this server runs or ran, else one a stopped server left
        running (INTERRUPTED)."""
        with self._lock:
            return self._latest_locked(owner, kind) or self._interrupted_locked(owner, kind)

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
    """The process-wide JobManager, kept in st.cache_resource so it survives reruns and refreshes; in process
    mode its worker starts now, so it has finished its imports before the first job."""
    try:
        mode = worker_mode()
    except LayerScopeError as e:      # a deployment setting: said in the server log, the app keeps working
        log.error("%s. %s; jobs run in a worker process", e.problem, e.fix)
        mode = "process"
    manager = JobManager(mode=mode, records=lambda: default_root() / "jobs")
    manager.start_worker()
    return manager
