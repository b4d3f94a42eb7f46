"""Time left: from the measured rate of the current phase only (layerscope/eta.py), held to within 2x after the
first 10 % of a planted slow phase that follows a fast one: the rule alone, the benchmark as the app shows it,
and online training's answer writing."""

from __future__ import annotations

import pytest

from layerscope import eta
from layerscope.decoding import bench, costmodel
from layerscope.draft.training.online import OnlineOptions
from layerscope.draft.training.progress import ResponsesProgress
from layerscope.draft.training.responses import generate_parts
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.ui import tasks, widgets
from layerscope.ui.jobs import Job
from tests.helpers import untrained_draft

pytestmark = pytest.mark.usefixtures("one_thread")


class PlantedClock:
    """Seconds that pass only as the test plants them: every forward of the target costs `per_forward`, and
    `per_token` more for each token it reads beyond the first (a prefill, a verification of k + 1 tokens)."""

    def __init__(self):
        self.t, self.per_forward, self.per_token = 1000.0, 0.0, 0.0

    def __call__(self) -> float:
        return self.t

    def forward(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        self.t += self.per_forward + self.per_token * (ids.shape[-1] - 1)


@pytest.fixture
def planted(tiny):
    clock = PlantedClock()
    hook = tiny.model.register_forward_hook(clock.forward, with_kwargs=True)   # a real callback in every target step
    yield clock
    hook.remove()


def within_2x(shown: float | None, true: float) -> bool:
    return shown is not None and true / 2 <= shown <= 2 * true


def test_the_rule_uses_the_current_phase_only_and_waits_for_a_measure():
    """A fast phase (100 units at 0.1 s), then a slow one (200 units at 1 s, its first unit 5 s): after 10 % of the
    slow phase the estimate is within 2x of the truth, where the whole job's rate is 3.5x too optimistic."""
    clock = PlantedClock()
    job_start, fast = clock.t, eta.PhaseClock(100, clock=clock)
    for done in range(1, 101):
        clock.t += 0.1
        assert fast.left(done) == (None if done < 20 else pytest.approx((100 - done) * 0.1))   # 2 s measured first
    slow = eta.PhaseClock(200, clock=clock)
    assert slow.left(0) is None                                   # nothing measured yet: "estimating…"
    shown, at = {}, {}
    for done in range(1, 201):
        clock.t += 5.0 if done == 1 else 1.0
        shown[done], at[done] = slow.left(done), clock.t
    true = {d: clock.t - at[d] for d in shown}
    assert all(shown[d] is None for d in range(1, 10))            # under MIN_SHARE of the phase: still estimating
    assert all(within_2x(shown[d], true[d]) for d in range(20, 200))         # from 10 % of the phase on
    job_rate = (100 + 20) / (at[20] - job_start)                  # the rate over both phases at that moment
    assert true[20] / ((300 - 120) / job_rate) > 3
    assert shown[200] == 0.0 and eta.text(None) == eta.ESTIMATING and eta.text(72) == "about 72 s left"


@pytest.mark.parametrize("calibration_s", [0.05, 1.0])
def test_the_benchmark_shows_its_decoding_time_left_after_its_calibration(tiny, planted, calibration_s):
    """The benchmark as the app runs it (calibration for K = auto, then the decoding, through the job's live
    adapter): the decoding costs 1 s a target forward and 0.01 s a token read (prefills, verifications), the
    calibration 0.05 s a forward (a fast phase first) or 1 s (the finding: a calibration that moved the job's bar
    by 1 % in a minute made the app say "about 3 h 50 min left"). From the first 10 % of the decoding's work on,
    what the job status shows is within 2x of the decoding's true time left."""
    job = Job("bench-eta", "owner", "bench", "Benchmark", fn=lambda j: None, state="running")
    live = tasks._BenchLive(job)
    live.tokenizer = tiny.tokenizer
    draft = untrained_draft(tiny.model, layers=(1, 2, 3))
    prompts = bench.encode(tiny.tokenizer, load_prompts("builtin", limit=3, seed=2))
    options = bench.BenchOptions(ks=(2,), auto_k=True, auto_even_if_slower=True, max_new_tokens=12, peers=False)
    curve = costmodel.CostCurve("cpu", "float32", 1, tuple(0.1 + 0.002 * t for t in range(1, 33)), (0.01,) * 8)
    calibration = [p.input_ids for p in bench.encode(tiny.tokenizer, load_prompts("builtin", limit=4, seed=3))]

    planted.per_forward = calibration_s
    shown_calibrating = []

    def calibrating(p):
        live(p)
        shown_calibrating.append(widgets.time_left(job.view()))
    auto = bench.auto_contenders(tiny, [("d", draft)], options, curve, calibration, calibrating, clock=planted)
    assert shown_calibrating and shown_calibrating[-1] == "under a second left"

    planted.per_forward, planted.per_token = 1.0, 0.01
    contenders = bench.lineup(bench.contenders_for([("d", draft)], options), auto)
    budget = len(prompts) * len(contenders) * options.max_new_tokens
    seen, run_tokens = [], 0               # (seconds now, token budget done, what the job status says)
    for p in bench.run(tiny.model, prompts, contenders, max_new_tokens=options.max_new_tokens, eos_token_id=None,
                       warmup=False, clock=planted):
        if p.report is not None:
            break
        live(p)
        run_tokens = 0 if p.event is None else run_tokens + len(p.event.tokens)
        seen.append((planted.t, p.runs_done * options.max_new_tokens + min(run_tokens, options.max_new_tokens),
                     job.view().metrics["eta_s"], widgets.time_left(job.view())))
    end = planted.t
    assert [c.kind for c in contenders] == ["autoregressive", "draft", "draft"]      # plain, k = 2, the auto chain
    assert seen[0][3] == eta.ESTIMATING             # the calibration's pace is not carried into the decoding
    later = [x for x in seen if x[1] >= 0.1 * budget and x[0] < end]
    assert later and all(within_2x(shown, end - t) for t, _, shown, _ in later), \
        [(done, shown, end - t) for t, done, shown, _ in later if not within_2x(shown, end - t)][:3]
    assert all(text == eta.text(shown) for _, _, shown, text in seen)


def test_answer_writing_says_its_time_left_within_the_first_batch(tiny, planted, tmp_path):
    """Online training's answers (the phase that ran 4 minutes on "estimating time left…"): 3 batches of 4 prompts,
    16 decode steps each at 1 s a forward and 0.01 s a token read (the batch's prefill). The time left is known
    inside the first batch, after 10 % of the phase's steps, and within 2x of the truth from then on."""
    o = OnlineOptions(max_new_tokens=16, gen_batch_size=4)
    ps = load_prompts("builtin", limit=12, seed=4)
    prompts = [(p, chat_ids(tiny.tokenizer, p)) for p in ps.prompts]
    parts = [(s, prompts[s: s + 4]) for s in range(0, 12, 4)]
    seen: list[tuple[float, ResponsesProgress]] = []
    planted.per_forward, planted.per_token = 1.0, 0.01
    generate_parts(tiny, parts, o, tmp_path / "responses", progress=lambda p: seen.append((planted.t, p)),
                   clock=planted)
    end, steps = planted.t, 3 * o.max_new_tokens
    later = [(t, p) for t, p in seen if p.done * o.max_new_tokens + p.step >= 0.1 * steps and t < end]
    assert later[0][1].done == 0 and 0 < later[0][1].step < o.max_new_tokens        # inside the first batch
    assert all(within_2x(p.eta_s, end - t) for t, p in later), [(p.done, p.step, p.eta_s, end - t) for t, p in later]
    assert seen[-1][1].done == seen[-1][1].total == 3 and seen[-1][1].eta_s == 0.0


def test_a_long_phase_says_its_time_left_after_a_minute():
    """A 5-hour phase at one unit a second: 5 % of it is 15 min of "estimating…"; a minute of its own work is
    enough to say how long the rest takes."""
    clock = PlantedClock()
    phase = eta.PhaseClock(18_000, clock=clock)
    clock.t += 59.0
    assert phase.left(59) is None
    clock.t += 2.0
    assert phase.left(61) == pytest.approx(18_000 - 61)
