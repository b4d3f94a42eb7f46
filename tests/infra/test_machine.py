"""The machine's state: other processes' CPU from /proc, busy/quiet, and where benchmarks carry and use it.

This machine is shared with other jobs, so no test assumes it is quiet: the quiet rule is checked on
snapshots built by hand (known tick deltas), and the real measurements on real spinning processes whose
CPU time is read independently (/proc/<pid>/schedstat: nanoseconds on a CPU, not the tick counters
quietness.py reads). Cost-curve caching is checked with thresholds that make any machine quiet (inf) or
busy (0): the real measurement, classified both ways.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from layerscope import fmt
from layerscope import quietness as m
from layerscope.commands.cli import main
from layerscope.decoding import bench
from layerscope.decoding import costmodel as cm
from layerscope.decoding.bench import BenchOptions, format_table
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.training.fit import TrainOptions
from layerscope.errors import LayerScopeError
from layerscope.quietness import MachineOptions, MachineState, Snapshot
from layerscope.steps import workflow
from layerscope.study.run import StudyOptions, format_study, run_study
from layerscope.ui import tasks
from layerscope.ui.jobs import Job
from layerscope.ui.model_cache import device_label
from tests.helpers import untrained_draft

pytestmark = pytest.mark.usefixtures("one_thread")

SPIN = "while True: pass"
ALWAYS_QUIET = MachineOptions(max_others_cpu=float("inf"), max_peak_cpu=float("inf"), before_s=0.1, interval_s=0.2)
ALWAYS_BUSY = MachineOptions(max_others_cpu=0.0, before_s=0.1, interval_s=0.2)


def spawn_detached(n: int) -> list[int]:
    """n spinning processes that are NOT descendants of this one (a shell starts them in the background and
    exits, so they are re-parented): to quietness.py they are "other processes"."""
    cmd = " ".join(f"{sys.executable} -S -c '{SPIN}' >/dev/null 2>&1 & echo $!;" for _ in range(n))
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def on_cpu_s(pid: int) -> float:
    """Seconds `pid` spent on a CPU, from the scheduler's own counter (field 1 of /proc/<pid>/schedstat, ns)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def started(pids, timeout=5.0) -> None:
    """Wait until every spinner has run a little (past the interpreter's start)."""
    t0 = time.monotonic()
    while any(on_cpu_s(p) < 0.02 for p in pids) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)


# ----------------------------------------------------------------------------- the quiet rule on known numbers


def snap(t, ticks, parents=None) -> Snapshot:
    return Snapshot(t, dict(ticks), dict(parents or {p: 1 for p in ticks}))


def test_others_cpu_closed_form_and_own_processes_excluded():
    """Two snapshots 2 s apart: pid 10 used 50 ticks (0.5 s at 100 Hz), a process born in between 30 ticks,
    a reused pid (ticks went down) its 20 ticks; this process (1000) and its child (1001, grandchild 1002)
    burn 400 ticks but are the run itself."""
    tick = m.TICK_S
    a = snap(0.0, {10: 1000, 11: 500, 1000: 0, 1001: 0, 1002: 0},
             {10: 1, 11: 1, 1000: 900, 1001: 1000, 1002: 1001})
    b = snap(2.0, {10: 1050, 11: 20, 12: 30, 1000: 200, 1001: 100, 1002: 100},
             {10: 1, 11: 1, 12: 1, 1000: 900, 1001: 1000, 1002: 1001})
    assert m.own_pids(b, root=1000) == {1000, 1001, 1002}
    used = m.others_cpu(a, b, exclude=m.own_pids(b, root=1000))
    assert used == pytest.approx((50 + 20 + 30) * tick / 2.0)
    assert m.others_cpu(a, b, exclude=()) == pytest.approx((50 + 20 + 30 + 400) * tick / 2.0)
    assert m.others_cpu(b, b, exclude=()) == 0.0                      # an empty window


def test_quiet_rule_thresholds():
    o = MachineOptions()                                     # quiet: others under 0.25 of a core, threads fit
    tick = m.TICK_S
    a = snap(0.0, {10: 0})
    quiet = m.from_snapshots(a, snap(1.0, {10: round(0.1 / tick)}), o, exclude=(), load=0.4, n_cores=2, threads=2)
    assert quiet.quiet and quiet.text == "quiet" and quiet.others_cpu == pytest.approx(0.1)
    assert quiet.to_json()["quiet"] is True and quiet.to_json()["free_cores"] == pytest.approx(1.9)
    busy = m.from_snapshots(a, snap(1.0, {10: round(1.3 / tick)}), o, exclude=(), load=3.0, n_cores=2, threads=2)
    assert not busy.quiet
    assert busy.text == "busy: other processes used 1.3 of 2 cores, leaving 0.70 for torch's 2 threads"
    edge = m.classify(o.max_others_cpu, 0.3, 0.0, 2, 1, 1.0, options=o)          # at the threshold: busy
    assert not edge.quiet and "0.25 of 2 cores" in edge.text
    over = m.classify(0.0, 0.0, 0.0, 2, 4, 1.0, options=o)                         # torch oversubscribes itself
    assert not over.quiet and over.reasons == ("torch uses 4 threads on 2 cores",)
    spike = m.classify(0.2, 1.5, 0.0, 2, 2, 10.0, samples=10, options=o)           # a quiet mean, one bad second
    assert not spike.quiet and "up to 1.5 of 2 cores in one interval" in spike.text
    assert m.classify(0.2, 0.9, 0.0, 2, 2, 10.0, samples=10, options=o).quiet
    again = MachineState.from_json(json.loads(json.dumps(busy.to_json())))
    assert again.to_json() == busy.to_json() and not again.quiet and again.reasons == busy.reasons
    assert m.line(busy).startswith("machine: busy — other processes used 1.3 of 2 cores")
    assert m.line(busy).endswith("speeds are not trustworthy") and m.line(quiet).startswith("machine: quiet (")
    assert m.caution(quiet) is None and "busy machine" in m.caution(busy)
    merged = m.merge([quiet.to_json(), busy, None])
    assert not merged.quiet and merged.others_cpu == pytest.approx(busy.others_cpu) and merged.samples == 2
    shared = m.merge([quiet.to_json(), quiet.to_json(), busy])    # two results of one run: that run counts once
    assert shared.samples == 2 and shared.window_s == pytest.approx(quiet.window_s + busy.window_s)
    with pytest.raises(LayerScopeError, match="--wait-quiet"):
        MachineOptions(wait_s=-1).validate()


# ----------------------------------------------------------------------------- real processes


def test_spinning_processes_make_the_machine_busy_and_count_as_others():
    """Two spinners (other processes, not our children) on this machine: while this test sleeps, the CPUs
    are never idle, so others' CPU + ours is every core; each spinner's share as quietness.py counts it
    equals the scheduler's own count of its time on a CPU."""
    pids = spawn_detached(2)
    try:
        started(pids)
        me = m.own_pids(m.snapshot())
        assert not set(pids) & me                                 # not descendants: "others"
        cpu0 = {p: on_cpu_s(p) for p in pids}
        a = m.snapshot()
        time.sleep(1.5)
        b = m.snapshot()
        cpu1 = {p: on_cpu_s(p) for p in pids}
        state = m.from_snapshots(a, b)
        dt = b.time - a.time
        assert not state.quiet and state.others_cpu >= 1.5, state
        ours = m.others_cpu(a, b, exclude=set(b.ticks) - me)      # this process alone
        assert state.others_cpu + ours >= 0.85 * state.cores      # work-conserving: no idle core
        for p in pids:                                            # attributed to "others", tick for tick
            counted = m.others_cpu(a, b, exclude=set(b.ticks) - {p})
            assert counted == pytest.approx((cpu1[p] - cpu0[p]) / dt, abs=3 * m.TICK_S / dt + 0.02)
            assert state.others_cpu - m.others_cpu(a, b, exclude=me | {p}) == pytest.approx(counted)
    finally:
        kill(pids)


def test_a_child_process_is_part_of_the_run_not_others():
    """A process this one started is the run's own: found by walking the real parent links, left out of
    "others" (what it used shows once it is not excluded, as the scheduler counted it)."""
    child = subprocess.Popen([sys.executable, "-S", "-c", SPIN])
    try:
        started([child.pid])
        cpu0, a = on_cpu_s(child.pid), m.snapshot()
        time.sleep(0.5)
        b, cpu1 = m.snapshot(), on_cpu_s(child.pid)
        own = m.own_pids(b)
        assert {os.getpid(), child.pid} <= own and os.getppid() not in own
        dt = b.time - a.time
        included = m.others_cpu(a, b, exclude=own - {child.pid}) - m.others_cpu(a, b)
        assert included == pytest.approx((cpu1 - cpu0) / dt, abs=3 * m.TICK_S / dt + 0.02)
    finally:
        child.kill()
        child.wait()


def test_monitor_during_a_run_and_wait_quiet_gives_up_busy():
    pids = spawn_detached(2)
    try:
        started(pids)
        o = MachineOptions(interval_s=0.3)
        before = m.sample(0.3, o)
        with m.Monitor(o, before) as mon:
            time.sleep(1.4)
        s = mon.state
        assert not s.quiet and s.samples >= 3 and s.window_s >= 1.4 and s.others_cpu >= 1.5
        assert s.others_cpu_max >= s.others_cpu - 1e-9 and s.before == before
        assert s.to_json()["before"]["window_s"] == pytest.approx(0.3, abs=0.05)
        seen = []
        t0 = time.monotonic()
        waited = m.wait_quiet(1.0, lambda st, left: seen.append((st.quiet, left)), MachineOptions(settle_s=0.3))
        assert time.monotonic() - t0 >= 1.0 and not waited.quiet and waited.waited_s >= 1.0   # timed anyway: busy
        assert seen and all(not q for q, _ in seen) and [x for _, x in seen] == sorted((x for _, x in seen), reverse=True)
        assert "left" in m.wait_message(waited, 61) and "1:01 left" in m.wait_message(waited, 61)
    finally:
        kill(pids)
    t0 = time.monotonic()                   # the same wait with a rule any machine passes: one sample, done
    assert m.wait_quiet(30, options=replace(ALWAYS_QUIET, settle_s=0.2)).quiet and time.monotonic() - t0 < 5


# ----------------------------------------------------------------------------- where benchmarks use it


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    meta = {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec}
    return save_draft(tmp_path_factory.mktemp("machine-drafts") / "low", untrained_draft(tiny.model, layers=(1, 2)), meta)


def test_a_busy_cost_curve_is_never_served_as_quiet(tiny, store):
    kw = dict(max_tokens=3, cache_lengths=(16,), repeats=1)
    busy = cm.cost_curve(tiny, store, **kw, machine_options=ALWAYS_BUSY)
    assert busy.machine is not None and not busy.machine.quiet and busy.machine.before is not None
    assert store.get_json("costcurve", cm.curve_key(tiny, cm.default_draft(tiny), quiet=True)) is None
    assert store.get_json("costcurve", cm.curve_key(tiny, cm.default_draft(tiny), quiet=False))["machine"]["quiet"] is False
    quiet = cm.cost_curve(tiny, store, **kw, machine_options=ALWAYS_QUIET)     # measured again, not the busy one
    assert quiet.machine.quiet
    served = cm.cost_curve(tiny, store, **kw, machine_options=ALWAYS_BUSY)     # a quiet one is read back
    assert served.to_json() == quiet.to_json()
    fresh_busy = cm.cost_curve(tiny, store, **kw, fresh=True, machine_options=ALWAYS_BUSY)
    assert not fresh_busy.machine.quiet
    assert cm.cost_curve(tiny, store, **kw).to_json() == quiet.to_json()    # a busy re-measure never replaced it
    assert cm.CostCurve.from_json(json.loads(json.dumps(quiet.to_json()))).to_json() == quiet.to_json()


def test_profile_and_bench_json_carry_the_machine(tmp_path, draft_dir, capsys):
    keys = {"quiet", "load", "others_cpu", "cores", "threads", "window_s", "text", "before"}
    store = str(tmp_path / "store")
    assert main(["profile", "--store", store, "--model", "tiny-llama", "--draft", str(draft_dir), "--max-tokens", "3",
                 "--repeats", "1", "--fresh", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert keys <= set(doc["machine"]) and doc["machine"]["threads"] == 1
    assert main(["profile", "--store", store, "--model", "tiny-llama", "--max-tokens", "3", "--repeats", "1"]) == 0
    assert "\nmachine: " in capsys.readouterr().out
    args = ["bench", "--store", store, "--model", "tiny-llama", "--draft", str(draft_dir), "--prompts", "builtin",
            "--limit", "2", "--max-new-tokens", "4", "--no-peers", "--k", "1"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert keys <= set(doc["machine"]) and doc["machine"]["window_s"] > 0
    assert {"quiet", "others_cpu"} <= set(doc["cost_curve_machine"])
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("machine: "))
    assert line.startswith("machine: quiet (") or line.endswith("speeds are not trustworthy")
    assert main(args + ["--wait-quiet", "nope"]) == 2 and "not a duration" in capsys.readouterr().err


def test_bench_wait_and_auto_k_calibration_progress(tiny, draft_dir, store):
    """workflow.bench with --wait-quiet (a rule this machine passes at once) and --k auto: the phases come in
    order (wait, cost curve, calibrate with counts 1..N, decode), and the auto contender says what it chose."""
    o = BenchOptions(model="tiny-llama", prompts="builtin", limit=2, max_new_tokens=4, ks=(), auto_k=True, peers=False,
                     auto_even_if_slower=True, machine=replace(ALWAYS_QUIET, wait_s=20, settle_s=0.2))
    seen = []
    done = workflow.bench([("low", draft_dir)], o, store, load=lambda spec, st: tiny, progress=seen.append)
    phases = [p.phase for p in seen]
    assert phases[0] != "decode" and phases[-1] == "decode"
    order = list(dict.fromkeys(phases))
    assert order == ["cost curve", "calibrate", "decode"], order            # quiet at once: no wait message
    cal = [p for p in seen if p.phase == "calibrate"]
    assert [p.runs_done for p in cal] == list(range(1, bench.CALIBRATION_PROMPTS + 1))
    assert all(p.runs_total == bench.CALIBRATION_PROMPTS and "calibration for --k auto: low" in p.message for p in cal)
    report = done.report.to_json()
    auto = report["results"][1]
    assert auto["name"].startswith("low auto chain k=") and auto["chosen"]["k"] in cm.AUTO_KS
    assert report["machine"]["quiet"] and report["cost_curve_machine"]["quiet"]
    text = format_table(done.report)
    assert f"chose K={auto['chosen']['k']}; the calibration predicted" in text and "machine: quiet (" in text


def test_app_benchmark_defaults_to_auto_and_shows_the_calibration(tiny, draft_dir, store):
    """The app's bench job (ui.tasks.bench_job, run as the worker runs it): K = auto unless told, the
    calibration's prompts as job progress before the decoding, the machine in the stored result."""
    assert inspect.signature(tasks.bench_job.builder).parameters["k"].default == "auto"
    updates = []

    class Recorded(Job):
        def update(self, progress=None, message=None, **metrics):
            updates.append((progress, message, metrics.get("phase")))
            super().update(progress, message, **metrics)

    task = tasks.bench_job(store=store, model="tiny-llama", drafts=[{"name": "low", "path": str(draft_dir),
                           "layers": [1, 2]}], prompts="builtin", limit=2, max_new_tokens=4, peers=False)
    out = task(Recorded("bench-1", "s", "bench", "t", task.fn))
    cal = [(f, msg) for f, msg, phase in updates if phase == "calibrate"]
    assert len(cal) == bench.CALIBRATION_PROMPTS and all("calibration for --k auto: low" in msg for _, msg in cal)
    assert [f for f, _ in cal] == sorted(f for f, _ in cal)
    first_decode = next(i for i, (_, _, phase) in enumerate(updates) if phase == "decode")
    assert max(i for i, (_, _, phase) in enumerate(updates) if phase == "calibrate") < first_decode
    auto = out["results"][1]       # an untrained draft: nothing pays, so the app's auto decodes plainly and says why
    assert out["k"] == "auto" and auto["chosen"] == {"plain": True} and auto["calibrated"]["speedup"] < 1.0
    assert {"quiet", "others_cpu", "load"} <= set(out["machine"])


def test_a_study_benchmarked_busy_says_so_in_its_verdict(tiny, tiny_capture, session_store):
    """The study's benchmark under a rule no machine passes (max_others_cpu 0): every stored benchmark entry
    carries the state, the report merges it, the verdict and the table say the speedups are not trustworthy."""
    o = StudyOptions(strategies=("default",), extra_sets=((0, 3),), k=2,
                     train=TrainOptions(steps=2, batch_size=2, seq_len=32), prompts="builtin", limit=2, max_new_tokens=5,
                     depth=1, seed=7, machine=ALWAYS_BUSY)
    report = run_study(tiny_capture, tiny, session_store, o)
    assert report.machine is not None and report.machine["quiet"] is False
    assert "busy machine" in report.verdict and "speedups and tokens/s are not trustworthy" in report.verdict
    assert "machine: busy — other processes used" in format_study(report)
    assert report.to_json()["machine"] == report.machine


def test_one_thread_and_one_core_read_in_the_singular(one_thread):
    assert device_label("cpu") == "cpu (1 thread)"
    assert fmt.plural(1, "thread") == "1 thread" and fmt.plural(2, "core") == "2 cores"
    one = m.classify(0.5, 0.5, 0.1, 1, 2, 1.0)
    assert "of 1 core," in one.text and "torch uses 2 threads on 1 core" in one.text
    assert "of 1 core," in m.details(one)
