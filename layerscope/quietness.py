"""What else runs on this machine while LayerScope times something: other processes' CPU, load, threads.

A speedup is a ratio of two timings; on a machine shared with other jobs both timings measure the other
jobs too, and not alike. So every timing (the cost curve, a benchmark) measures the machine before and
during the run and carries the result. Linux only: everything is read from /proc.

    snapshot()          CPU time of every process (utime + stime, fields 14-15 of /proc/<pid>/stat, in
                        clock ticks; all of a process's threads) and each one's parent, at one moment
    own_pids(snap)      this process and its descendants: the run itself, never counted as "others"
    others_cpu(a, b)    cores' worth of CPU every other process used between two snapshots: the sum of
                        their tick deltas / CLK_TCK / seconds between the snapshots (a process born in
                        between counts from 0; one that ended in between is missed)
    sample(window_s)    two snapshots window_s apart -> MachineState
    Monitor             a background thread that snapshots every interval_s DURING a run; on exit, the
                        run's MachineState: the mean over the run and the worst interval
    wait_quiet(...)     samples until the machine is quiet or the time is up; then the state
    sync(device)        wait for the device's queued work before reading a clock (CUDA; a no-op on the CPU)

Quiet (MachineOptions): other processes used under `max_others_cpu` of a core on average and under
`max_peak_cpu` in every interval of a run, and torch's intra-op threads fit in the cores this process
may use (sched_getaffinity, capped by a cgroup v2 cpu.max quota). The 1-minute load average
(/proc/loadavg) is reported beside it but does not decide: it lags a minute and counts this process's
own threads. When the wait of `wait_quiet` runs out the machine is still busy: the run goes ahead and
is marked busy (a user who asked to wait wants the result; the mark says what it is worth).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from layerscope import blas, fmt
from layerscope.errors import LayerScopeError
from layerscope.validate import check_number

PROC = Path("/proc")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
WAIT_S = 600.0                       # `--wait-quiet` without a number: wait up to 10 minutes


@dataclass(frozen=True)
class MachineOptions:
    """When the machine counts as quiet, and how it is watched: the one source of those defaults."""

    max_others_cpu: float = 0.25     # cores' worth other processes may use on average on a quiet machine
    max_peak_cpu: float = 1.0        # ... and in any one interval of a run (a whole core for a second: busy)
    before_s: float = 0.5            # window of the sample taken just before a run
    interval_s: float = 1.0          # a Monitor's sampling interval
    wait_s: float | None = None      # --wait-quiet: wait up to this long for a quiet machine before timing
    settle_s: float = 2.0            # window of each sample while waiting

    def validate(self) -> None:
        """Every number by layerscope.validate's one rule, but the two thresholds, which may be infinite (no
        machine is ever busy: what the tests use); check_number wants a finite number."""
        for name in ("max_others_cpu", "max_peak_cpu"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and not math.isnan(value)):
                raise LayerScopeError(f"machine option {name} must be a number >= 0 (got {value!r})",
                                      f"Pass {name} as 0 or more")
        for name in ("before_s", "interval_s", "settle_s"):
            check_number(f"machine option {name}", getattr(self, name), minimum=0, fix=f"Pass {name} as 0 or more")
        check_number("--wait-quiet", self.wait_s, minimum=0, above=True, optional=True,
                     fix="Write it like --wait-quiet 300 or --wait-quiet 10m")


@dataclass(frozen=True)
class Snapshot:
    time: float                      # time.monotonic() when it was read
    ticks: dict[int, int]            # pid -> utime + stime of the whole process, clock ticks
    parents: dict[int, int]          # pid -> parent pid


@dataclass(frozen=True)
class MachineState:
    """The machine over one window. others_cpu: cores' worth of CPU other processes used, the mean over
    the window; others_cpu_max: the worst sampling interval (a single sample: the same)."""

    quiet: bool
    others_cpu: float
    others_cpu_max: float
    load: float                      # 1-minute load average at the end of the window
    cores: int                       # cores this process may run on
    threads: int                     # torch intra-op threads
    window_s: float
    samples: int = 1
    reasons: tuple[str, ...] = ()    # why it is not quiet, in words
    measured: bool = True            # False: no /proc here (not Linux), nothing was measured
    waited_s: float | None = None    # wait_quiet: how long it waited
    before: MachineState | None = None   # a run's state: the sample taken just before it
    blas: str = field(default_factory=blas.describe)   # the matrix library's code path (layerscope.blas)

    @property
    def free_cores(self) -> float:
        return max(self.cores - self.others_cpu, 0.0)

    @property
    def text(self) -> str:
        """'quiet' or 'busy: other processes used 1.3 of 2 cores' (every reason, ';'-separated)."""
        return "quiet" if self.quiet else "busy: " + "; ".join(self.reasons or ("not measured",))

    def to_json(self) -> dict:
        out = {"quiet": self.quiet, "load": round(self.load, 3), "others_cpu": round(self.others_cpu, 3),
               "others_cpu_max": round(self.others_cpu_max, 3), "cores": self.cores, "threads": self.threads,
               "free_cores": round(self.free_cores, 3), "window_s": round(self.window_s, 3),
               "samples": self.samples, "text": self.text, "reasons": list(self.reasons), "measured": self.measured}
        if self.waited_s is not None:
            out["waited_s"] = round(self.waited_s, 1)
        if self.before is not None:
            out["before"] = self.before.to_json()
        if self.blas:
            out["blas"] = self.blas
        return out

    @classmethod
    def from_json(cls, obj: dict) -> MachineState:
        for key in ("quiet", "load", "others_cpu", "cores", "threads", "window_s"):
            assert key in obj, f"a machine state needs {key!r}: {sorted(obj)}"
        return cls(bool(obj["quiet"]), float(obj["others_cpu"]), float(obj.get("others_cpu_max", obj["others_cpu"])),
                   float(obj["load"]), int(obj["cores"]), int(obj["threads"]), float(obj["window_s"]),
                   int(obj.get("samples", 1)), tuple(obj.get("reasons", ())), bool(obj.get("measured", True)),
                   obj.get("waited_s"), cls.from_json(obj["before"]) if obj.get("before") else None,
                   str(obj.get("blas", "")))


# ----------------------------------------------------------------------------- reading /proc


def available() -> bool:
    return (PROC / "self" / "stat").is_file()


def _read_stat(pid_dir: Path) -> tuple[int, int] | None:
    """(parent pid, utime + stime) of one process, None if it is gone. The command name (field 2) is in
    parentheses and may hold spaces or parentheses itself, so fields are counted after its last ')'."""
    try:
        text = (pid_dir / "stat").read_text()
        rest = text[text.rindex(")") + 2:].split()      # rest[0] = state (field 3), rest[1] = ppid (field 4)
        return int(rest[1]), int(rest[11]) + int(rest[12])  # fields 14 (utime) and 15 (stime)
    except (OSError, ValueError, IndexError):
        return None


def snapshot() -> Snapshot:
    """Every process's CPU ticks and parent, now."""
    ticks, parents = {}, {}
    t = time.monotonic()
    for entry in PROC.iterdir() if available() else ():
        if entry.name.isdigit():
            got = _read_stat(entry)
            if got is not None:
                parents[int(entry.name)], ticks[int(entry.name)] = got
    return Snapshot(t, ticks, parents)


def own_pids(snap: Snapshot, root: int | None = None) -> set[int]:
    """`root` (default: this process) and every descendant of it in `snap`."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, parent in snap.parents.items():
        children.setdefault(parent, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def others_cpu(a: Snapshot, b: Snapshot, exclude: Iterable[int] | None = None) -> float:
    """Cores' worth of CPU the processes not in `exclude` (default: this process and its descendants, in
    either snapshot) used from `a` to `b`. A pid whose ticks went down was reused: it counts from 0."""
    dt = b.time - a.time
    if dt <= 0:
        return 0.0
    skip = set(exclude) if exclude is not None else own_pids(a) | own_pids(b)
    used = 0
    for pid, ticks in b.ticks.items():
        if pid not in skip:
            before = a.ticks.get(pid, 0)
            used += ticks - before if ticks >= before else ticks
    return used * TICK_S / dt


def load_average() -> float:
    try:
        return float((PROC / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 quota (cpu.max)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


# ----------------------------------------------------------------------------- classification


def classify(others: float, peak: float, load: float, n_cores: int, threads: int, window_s: float, *,
             samples: int = 1, options: MachineOptions = MachineOptions(), measured: bool = True) -> MachineState:
    """The MachineState of measured numbers under `options`' thresholds (the one quiet rule)."""
    reasons = []
    if not measured:
        reasons.append("not measured (no /proc on this system)")
    free = max(n_cores - others, 0.0)
    if others >= options.max_others_cpu:
        reasons.append(f"other processes used {_cores(others)} of {fmt.plural(n_cores, 'core')}"
                       + (f", leaving {_cores(free)} for torch's {_threads(threads)}" if threads > free else ""))
    elif samples > 1 and peak >= options.max_peak_cpu:
        reasons.append(f"other processes used up to {_cores(peak)} of {fmt.plural(n_cores, 'core')} in one interval")
    if threads > n_cores:
        reasons.append(f"torch uses {_threads(threads)} on {fmt.plural(n_cores, 'core')}")
    return MachineState(not reasons, others, peak, load, n_cores, threads, window_s, samples, tuple(reasons), measured)


def from_snapshots(a: Snapshot, b: Snapshot, options: MachineOptions = MachineOptions(), *,
                   exclude: Iterable[int] | None = None, load: float | None = None, n_cores: int | None = None,
                   threads: int | None = None) -> MachineState:
    """The MachineState of the window between two snapshots (load, cores and threads: now, unless given)."""
    used = others_cpu(a, b, exclude)
    return classify(used, used, load_average() if load is None else load, cores() if n_cores is None else n_cores,
                    torch.get_num_threads() if threads is None else threads, b.time - a.time, options=options,
                    measured=bool(b.ticks))


def _cores(x: float) -> str:
    return f"{x:.2f}" if x < 1 else f"{x:.1f}"


def _threads(n: int) -> str:
    return fmt.plural(n, "thread")


def sample(window_s: float = 1.0, options: MachineOptions = MachineOptions()) -> MachineState:
    """The machine over the next `window_s` seconds (this call sleeps that long)."""
    a = snapshot()
    time.sleep(max(window_s, 0.0))
    return from_snapshots(a, snapshot(), options)


class Monitor:
    """`with Monitor(options) as m: <the run>`; then `m.state`: other processes' CPU during the run (mean
    and worst interval of `options.interval_s`; an interval under half of that, the last one, counts in
    the mean only), the load at its end, cores and threads. `before` is kept in the state as is."""

    def __init__(self, options: MachineOptions = MachineOptions(), before: MachineState | None = None):
        self.options, self.before = options, before
        self.state: MachineState | None = None
        self._intervals: list[tuple[float, float]] = []      # (seconds, cores' worth used by others)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="layerscope-machine-monitor", daemon=True)
        self._threads = torch.get_num_threads()

    def _step(self) -> None:
        snap = snapshot()
        self._intervals.append((snap.time - self._last.time, others_cpu(self._last, snap)))
        self._last = snap

    def _watch(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            self._step()

    def __enter__(self) -> Monitor:
        self._last = snapshot()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._step()
        total = sum(dt for dt, _ in self._intervals)
        mean = sum(dt * c for dt, c in self._intervals) / total if total > 0 else 0.0
        full = [c for dt, c in self._intervals if dt >= 0.5 * self.options.interval_s]
        peak = max(full, default=mean)
        state = classify(mean, max(peak, mean), load_average(), cores(), self._threads, total,
                         samples=max(len(full), 1), options=self.options, measured=available())
        self.state = replace(state, before=self.before)


def wait_quiet(timeout_s: float, progress: Callable[[MachineState, float], None] | None = None,
               options: MachineOptions = MachineOptions()) -> MachineState:
    """Sample (`options.settle_s` each) until the machine is quiet or `timeout_s` has passed; each busy
    sample goes to `progress(state, seconds_left)`. Returns the last sample with `waited_s`: quiet, or
    still busy when the time ran out (the caller times anyway; the state marks the run busy)."""
    t0 = time.monotonic()
    while True:
        state = sample(min(options.settle_s, max(timeout_s, 0.1)), options)
        waited = time.monotonic() - t0
        left = timeout_s - waited
        if state.quiet or left <= 0 or not state.measured:
            return replace(state, waited_s=waited)
        if progress is not None:
            progress(state, left)


def settle(options: MachineOptions = MachineOptions(),
           progress: Callable[[MachineState, float], None] | None = None) -> MachineState:
    """The state just before a run: wait_quiet when `options.wait_s` is set, else one short sample."""
    options.validate()
    if options.wait_s:
        return wait_quiet(options.wait_s, progress, options)
    return sample(options.before_s, options)


def watch(run: Callable[[], object], options: MachineOptions = MachineOptions(),
          progress: Callable[[MachineState, float], None] | None = None) -> tuple[object, MachineState]:
    """`run()` between `settle` and a Monitor: (its result, the MachineState during it, `before` inside)."""
    before = settle(options, progress)
    with Monitor(options, before) as m:
        result = run()
    return result, m.state


def sync(device) -> None:
    """Wait for `device`'s queued work (CUDA kernels run asynchronously), so a clock read after it times the
    work; a no-op on the CPU. Every timing of a forward (the cost curve, a benchmark's HF peers) syncs through here."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- words


def state_of(obj: MachineState | dict | None) -> MachineState | None:
    return MachineState.from_json(obj) if isinstance(obj, dict) else obj


def merge(states: Iterable[MachineState | dict | None]) -> MachineState | None:
    """Several runs as one (e.g. a study's benchmark, partly from the store): the worst of each number;
    quiet only if every run was; the reasons of every busy run. A run several results share (a study's pass
    benchmarks several drafts in one run) counts once, so the window is the time measured, not a multiple of it."""
    ss = list(dict.fromkeys(s for s in (state_of(x) for x in states) if s is not None))
    if not ss:
        return None
    if len(ss) == 1:
        return ss[0]
    reasons = tuple(dict.fromkeys(r for s in ss for r in s.reasons))
    return MachineState(all(s.quiet for s in ss), max(s.others_cpu for s in ss), max(s.others_cpu_max for s in ss),
                        max(s.load for s in ss), min(s.cores for s in ss), max(s.threads for s in ss),
                        sum(s.window_s for s in ss), sum(s.samples for s in ss), reasons, all(s.measured for s in ss),
                        blas=" / ".join(dict.fromkeys(s.blas for s in ss if s.blas)))


def details(s: MachineState) -> str:
    """'other processes used 0.04 of 2 cores (up to 0.10), load 1.9, 2 torch threads'."""
    peak = f" (up to {s.others_cpu_max:.2f})" if s.samples > 1 else ""
    return (f"other processes used {s.others_cpu:.2f} of {fmt.plural(s.cores, 'core')}{peak}, load {s.load:.1f}, "
            f"torch {_threads(s.threads)}" + (f", {s.blas}" if s.blas else ""))


def line(obj: MachineState | dict | None, what: str = "speeds") -> str:
    """The one line every table prints: 'machine: quiet (…)' or 'machine: busy — …; speeds are not
    trustworthy'; '' when nothing was recorded (a result saved before machine states)."""
    s = state_of(obj)
    if s is None:
        return ""
    if s.quiet:
        return f"machine: quiet ({details(s)})"
    if not s.measured:
        return f"machine: not measured (no /proc on this system); {what} are unchecked"
    return f"machine: busy — {'; '.join(s.reasons)} (load {s.load:.1f}); {what} are not trustworthy"


def caution(obj: MachineState | dict | None, what: str = "speeds") -> str | None:
    """A sentence for a verdict when `obj` was busy, else None."""
    s = state_of(obj)
    if s is None or s.quiet:
        return None
    return (f"The benchmark ran on a busy machine ({'; '.join(s.reasons)}), so its {what} are not trustworthy; "
            f"τ and acceptance do not depend on the machine. Rerun on a quiet machine (--wait-quiet) for speeds.")


def wait_message(state: MachineState, left_s: float) -> str:
    """What a wait shows: 'waiting for a quiet machine: busy: … · 4:32 left'."""
    m, s = divmod(int(round(left_s)), 60)
    return f"waiting for a quiet machine: {state.text} · {m}:{s:02d} left"
