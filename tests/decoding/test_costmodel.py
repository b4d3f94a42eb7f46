"""The cost model: measured curves, predicted step times and tau against real decoding, the automatic choice."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict

import pytest
import torch
from transformers import LlamaForCausalLM

from layerscope.commands.cli import main
from layerscope.decoding import costmodel as cm
from layerscope.decoding import specdec as sd
from layerscope.decoding.specdec import TreeSpec
from layerscope.draft.checkpoint import save_draft
from layerscope.target.load import tiny_model
from layerscope.ui import plots
from tests.decoding.test_specdec import PROMPTS, LookupDraft, greedy_reference, untrained_draft

pytestmark = pytest.mark.usefixtures("one_thread", "cpu_clock")

# The synthetic machine: a target forward over T tokens costs A + B*T more seconds, a draft forward over T rows
# DA + DB*T, spent computing. Times are this thread's CPU time (the machine running the tests is shared and
# busy: wall time would measure the other jobs), for the decoder's steps as for the cost curve.
A, B, DA, DB = 0.040, 0.004, 0.004, 0.001
CLOCK = time.thread_time


def burn(seconds: float) -> None:
    t0 = CLOCK()
    while CLOCK() - t0 < seconds:
        pass


@pytest.fixture(scope="module")
def cpu_clock():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sd, "clock", CLOCK)
        yield


class SleepyLookupDraft(LookupDraft):
    def forward(self, input_ids, *args, **kwargs):
        burn(DA + DB * input_ids.shape[1])
        return super().forward(input_ids, *args, **kwargs)


@pytest.fixture(scope="module")
def sleepy(tiny):
    """A copy of the tiny target whose every forward costs A + B*T seconds on top of its own (small) cost."""
    model = LlamaForCausalLM(tiny.model.config).eval()
    model.load_state_dict(tiny.model.state_dict())
    model.register_forward_pre_hook(lambda mod, args, kwargs: burn(A + B * kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    return model


@pytest.fixture(scope="module")
def ref(tiny):
    return greedy_reference(tiny.model, PROMPTS[0], 40)


def _every_third_wrong(ref, vocab):
    """A draft whose first choice is wrong at every third position (the right token ranks second)."""
    ids = PROMPTS[0]
    return SleepyLookupDraft(ids + ref, vocab, wrong=range(len(ids) + 3, len(ids) + 60, 3))


def _curve(model, draft, max_tokens=7):
    """Medians of 5 calls: CPU time still grows a little when the other core's job shares caches (one of 3 calls
    off by 6 ms once failed the 15 % check in a full suite); two outliers of 5 cannot move the median."""
    target = cm.measure_target(model, max_tokens=max_tokens, cache_lengths=(16,), repeats=5,
                               aux_layers=draft.aux_layers, clock=CLOCK)
    return cm.CostCurve("cpu", "float32", 1, tuple(target),
                        tuple(cm.measure_draft(model, draft, max_rows=4, cache_length=16, repeats=5, clock=CLOCK)))


@pytest.fixture(scope="module")
def curve(sleepy, ref):
    """The measured curve of the synthetic machine (T = 1..7, draft rows 1..4)."""
    return _curve(sleepy, _every_third_wrong(ref, sleepy.config.vocab_size))


def _steps(decoder):
    """(tokens, median seconds) of the decoding steps, the prefill and the last (shortened) step left out."""
    _, events = sd.collect(decoder)
    events = events[1:-1]
    return sum(len(e.tokens) for e in events) / len(events), statistics.median(e.elapsed_s for e in events)


# ----------------------------------------------------------------------------- curves


def test_time_calls_measures_the_cost_function():
    """With a clock the workload itself advances, the measured curve is the cost function exactly."""
    now = [0.0]
    cost = lambda T: 0.01 + 0.002 * T ** 1.5
    times = cm.time_calls(lambda T: now.__setitem__(0, now[0] + cost(T)), range(1, 33), repeats=3,
                          clock=lambda: now[0])
    assert times == pytest.approx([cost(T) for T in range(1, 33)], rel=1e-9)


def test_monotone_fit_closed_form():
    assert cm.monotone([1, 3, 2, 4]) == pytest.approx([1, 2.5, 2.5, 4])
    assert cm.monotone([5, 1, 1, 1, 6]) == pytest.approx([2, 2, 2, 2, 6])
    assert cm.monotone([1, 2, 3]) == [1, 2, 3]


def test_measured_curve_of_a_synthetic_target(tiny, curve, ref):
    """The curve of the slowed-down copy is the tiny model's own curve plus the added cost function."""
    own = _curve(tiny.model, LookupDraft(ref, tiny.model.config.vocab_size))
    for T in range(1, 8):
        assert curve.target_s(T) - own.target_s(T) == pytest.approx(A + B * T, abs=0.15 * A), T
    for T in range(1, 5):
        assert curve.draft_s(T) - own.draft_s(T) == pytest.approx(DA + DB * T, abs=0.5 * DA), T
    assert curve.target_s(9) == pytest.approx(curve.target_s(7) + 2 * (curve.target_s(7) - curve.target_s(6)))
    again = cm.CostCurve.from_json(curve.to_json())
    assert again == curve


def test_prediction_equals_measured_decoding_on_a_synthetic_cost(sleepy, curve, ref):
    """Step seconds and tokens/s predicted from the measured curve match real decoding of plain, chain and tree
    on a target and draft with a known cost function (the draft's acceptance given as measured)."""
    ids = PROMPTS[0]
    draft = _every_third_wrong(ref, sleepy.config.vocab_size)
    _, plain = _steps(sd.autoregressive(sleepy, ids, 10))
    assert plain == pytest.approx(cm.predict(curve, None).step_seconds, rel=0.1)
    for k in (1, 3):
        _, events = sd.collect(sd.speculative(sleepy, draft, ids, 18, k=k))
        steps = [e for e in events[1:] if e.drafted == k]
        acc = [sum(e.accepted_mask[i] for e in steps) / len(steps) for i in range(k)]
        pred = cm.predict(curve, cm.AcceptanceProfile.from_chain(acc), k=k)
        tau = sum(len(e.tokens) for e in steps) / len(steps)
        assert pred.tau == pytest.approx(tau, rel=1e-9)
        assert pred.step_seconds == pytest.approx(statistics.median(e.elapsed_s for e in steps), rel=0.1), k
        measured_speedup = tau / statistics.mean(e.elapsed_s for e in steps) * plain
        assert pred.speedup == pytest.approx(measured_speedup, rel=0.12), k
    tree = TreeSpec(6, 2, 4)
    tau, seconds = _steps(sd.speculative(sleepy, draft, ids, 18, tree=tree))   # tau: the feed's mean rows
    assert cm.step_seconds(curve, tree=tree, tau=tau) == pytest.approx(seconds, rel=0.1)


# ----------------------------------------------------------------------------- acceptance


def test_profile_from_ranks_closed_form():
    ranks = torch.tensor([[0, 0, 1], [0, 1, -1], [2, 0, 0], [0, 0, 0]])
    p = cm.profile_from_ranks(ranks, max_rank=3)
    assert p.chain == pytest.approx((3 / 4, 2 / 4, 1 / 3))
    assert p.rank[0] == pytest.approx((3 / 4, 0, 1 / 4))
    assert p.rank[1] == pytest.approx((3 / 4, 1 / 4, 0))
    assert p.rank[2] == pytest.approx((2 / 3, 1 / 3, 0))
    assert p.rows == 4


def test_expected_tree_acceptance_closed_form():
    p = cm.AcceptanceProfile((0.5, 0.25), ((0.5, 0.2), (0.5, 0.2)))
    # nodes: depth 1: .5, .2; depth 2: .25, .1, .1, .04 -> the best three: .5 + .25 + .2
    assert cm.expected_tree_accepted(p, TreeSpec(3, 2, 2)) == pytest.approx(0.95)
    assert cm.predict(_flat(), p, tree=TreeSpec(3, 2, 2)).tau == pytest.approx(1.95)
    # a one-child-per-node tree is a chain: the same tau as the chain from the same first choices
    chain = cm.AcceptanceProfile.from_chain([0.8, 0.5, 0.3, 0.1])
    for d in (1, 2, 4):
        assert cm.predict(_flat(), chain, tree=TreeSpec(d, 1, d)).tau == pytest.approx(cm.predict(_flat(), chain, k=d).tau)


def test_replayed_tau_walks_the_states_decoding_visits():
    """Two sequences of ranks [rows, depth]. A chain of depth 2 at row 0 of the first accepts 2 (emits 3) and
    jumps to row 3; there it accepts 0 (emits 1), row 4: accepts 1 (its depth 2 is past the end). The second
    sequence: 0 accepted twice. 3 + 1 + 2 + 1 + 1 = 8 tokens in 5 steps. The average over every state says more
    (easy states come in a run, and decoding skips some of them)."""
    seqs = (((0, 0), (0, 0), (0, 0), (3, 0), (0, -1)), ((1, 0), (2, -1)))
    prof = cm.profile_from_ranks(torch.tensor([list(r) for s in seqs for r in s]), max_rank=4)
    replayable = cm.replace(prof, sequences=seqs)
    assert cm.replayed_tau(replayable, k=2) == pytest.approx(8 / 5)
    assert cm.predict(_flat(), replayable, k=2).tau == pytest.approx(8 / 5)
    averaged = cm.predict(_flat(), prof, k=2).tau
    assert averaged == pytest.approx(1 + sum(prof.chain[:2])) and averaged > 8 / 5
    # k = 1: rows 0, 2, 4 of the first (each accepts 1), rows 0, 1 of the second (0 each): 6 + 2 tokens, 5 steps
    assert cm.replayed_tau(replayable, k=1) == pytest.approx(8 / 5)
    # a top-2 tree of depth 2 with budget 6 holds every rank path in {0, 1}^2: the second sequence's row 0
    # (ranks 1, 0) now accepts 2, which ends it; the first as with the chain: 3 + 1 + 2 + 3 = 9 tokens in 4 steps
    tree = TreeSpec(6, 2, 2)
    assert {p for p, _ in cm.tree_nodes(replayable, tree)} == {(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)}
    assert cm.replayed_tau(replayable, tree=tree) == pytest.approx(9 / 4)
    assert cm.predict(_flat(), replayable, tree=tree).tau == pytest.approx(9 / 4)


def test_calibration_replays_every_prompt(tiny):
    """calibrate keeps each prompt's ranks in order (7 states with a next token for 8 new tokens, then the
    last state, past the end); replaying a chain over them equals the hand walk and never exceeds k + 1."""
    draft = untrained_draft(tiny.model)
    prof = cm.calibrate(tiny.model, draft, PROMPTS[:2], max_new_tokens=8, depth=3)
    assert len(prof.sequences) == 2 and all(sum(r[0] >= 0 for r in s) == 7 for s in prof.sequences)
    assert sum(r[0] >= 0 for s in prof.sequences for r in s) == prof.rows
    for k in (1, 2, 3):
        tokens = steps = 0
        for rows in prof.sequences:
            t = 0
            while t < len(rows) and rows[t][0] >= 0:
                a = next((i for i, r in enumerate(rows[t][:k]) if r != 0), min(k, len(rows[t])))
                tokens, steps, t = tokens + a + 1, steps + 1, t + a + 1
        assert cm.replayed_tau(prof, k=k) == pytest.approx(tokens / steps) and tokens / steps <= k + 1


def _flat():
    return cm.CostCurve("cpu", "float32", 1, tuple(0.1 for _ in range(32)), (0.01,) * 8)


def test_break_even_and_speedup_closed_form():
    curve = cm.CostCurve("cpu", "float32", 1, tuple(0.05 + 0.01 * T for T in range(1, 33)), (0.005,) * 8)
    prof = cm.AcceptanceProfile.from_chain([0.6, 0.3])
    pred = cm.predict(curve, prof, k=2)
    seconds = 2 * 0.005 + 0.05 + 0.03
    assert pred.step_seconds == pytest.approx(seconds)
    assert pred.tau == pytest.approx(1.9)
    assert pred.speedup == pytest.approx(1.9 * 0.06 / seconds)
    assert pred.break_even_tau == pytest.approx(seconds / 0.06)
    # a draft row costs 0.002 s more per row: the feed of tau = 1.9 rows costs 0.005 + 0.9 * 0.002, and the
    # break-even tau solves tau * 0.06 = 0.005 + 0.002 (tau - 1) + 0.005 + 0.08
    rows = cm.CostCurve("cpu", "float32", 1, curve.target, tuple(0.005 + 0.002 * r for r in range(8)))
    pred = cm.predict(rows, prof, k=2)
    assert pred.step_seconds == pytest.approx(seconds + 0.9 * 0.002)
    assert pred.speedup == pytest.approx(1.9 * 0.06 / (seconds + 0.9 * 0.002))
    assert pred.break_even_tau == pytest.approx((seconds - 0.002) / (0.06 - 0.002))


def test_calibration_ranks_match_the_decoders_draft(target_and_ref):
    """draft_ranks (teacher-forced, all rows at once) gives, at each decoding state, the rank of the true next
    tokens in the distribution the decoder's draft computes there (depth 1 by feed, depth 2 by a step)."""
    model, ids, ref = target_and_ref
    draft = untrained_draft(model, seed=7)
    with torch.no_grad():
        draft.lm_head.weight.mul_(20)                          # clear rankings, no near-ties
    seq = ids + ref
    ranks = cm.draft_ranks(model, draft, seq, len(ids), depth=3)
    assert ranks.shape == (len(ref), 3) and (ranks[-1] == -1).all() and (ranks[-3, :2] >= 0).all()
    tids = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size))

    def rank(lg, tok):
        where = (tids == tok).nonzero()
        return int((lg > lg[where[0, 0]]).sum()) if len(where) else draft.config.draft_vocab_size

    for s in (len(ids), len(ids) + 3, len(ids) + 7):
        cache, d = sd.new_cache(model), sd._Draft(draft, model.device)
        with torch.inference_mode():
            _, aux = sd._target_forward(model, seq[:s], torch.arange(s), cache, draft.aux_layers)
            d.add_rows(seq[1:s + 1], aux)
            lg, hidden = d.feed()
            assert rank(lg, seq[s + 1]) == ranks[s - len(ids), 0], s
            lg2, _ = d.step([seq[s + 1]], hidden[None], torch.tensor([s]))
            assert rank(lg2[0], seq[s + 2]) == ranks[s - len(ids), 1], s


@pytest.fixture(scope="module")
def target_and_ref(tiny, ref):
    return tiny.model, PROMPTS[0], ref


def test_calibrate_runs_on_a_real_draft(tiny):
    draft = untrained_draft(tiny.model)
    prof = cm.calibrate(tiny.model, draft, PROMPTS[:2], max_new_tokens=12, depth=4)
    assert len(prof.chain) == 4 and len(prof.rank) == 4 and prof.rows == 2 * 11     # 12 new tokens: 11 states with a next token to predict
    assert all(0 <= a <= 1 for a in prof.chain) and list(prof.chain) == sorted(prof.chain, reverse=True)
    assert all(sum(r) <= 1 + 1e-9 for r in prof.rank)


# ----------------------------------------------------------------------------- the automatic choice


def test_auto_picks_the_best_contender(sleepy, curve, ref):
    """A draft whose first choice misses every third token (the right one is its second choice): a chain
    accepts at most 2 a step, a top-2 tree gets past the misses. With the constructed profile of that draft
    and the machine's measured curve, `auto` picks a contender whose measured speedup is the best within 5%."""
    ids = PROMPTS[0]
    draft = _every_third_wrong(ref, sleepy.config.vocab_size)
    profile = cm.AcceptanceProfile((1.0, 1.0, 0.0, 0.0, 0.0, 0.0),
                                   tuple((1.0, 0.0) if j % 3 else (0.0, 1.0) for j in range(1, 7)))
    ks, trees = [1, 2, 3], [TreeSpec(4, 2, 3), TreeSpec(6, 2, 4)]
    chosen = cm.choose(curve, profile, ks=ks, trees=trees)
    assert cm.best_chain(curve, profile, ks).k == 2                    # a chain never gets past a miss
    _, plain = _steps(sd.autoregressive(sleepy, ids, 8))
    measured = {}
    for kw in [{"k": k} for k in ks] + [{"tree": t} for t in trees]:
        out, events = sd.collect(sd.speculative(sleepy, draft, ids, 20, **kw))
        assert out == ref[:20]
        steps = events[1:]
        measured[cm.predict(curve, profile, **kw).decoding] = \
            sum(len(e.tokens) for e in steps) / sum(e.elapsed_s for e in steps) * plain
    best = max(measured.values())
    assert chosen.tree is not None
    assert measured[chosen.decoding] >= 0.95 * best, (chosen.decoding, measured)


# ----------------------------------------------------------------------------- prompt lookup


def _lookup_profile(prompt, out, rows):
    return cm.AcceptanceProfile((0.5,), ((0.5,),), sequences=(tuple(rows),), texts=((tuple(prompt), tuple(out)),))


def _replay_example():
    """Prompt 10..17, continuation 10..21, a draft right at every state but 9 (ranks as rows); a verify of T
    tokens costs 0.1 + 0.01 T, a draft forward over r rows 0.001 r."""
    prompt, out = list(range(10, 18)), list(range(10, 22))
    rows = [(1, 1)] * 9 + [(0, 1), (1, -1), (-1, -1)]
    curve = cm.CostCurve("cpu", "float32", 1, tuple(0.1 + 0.01 * T for T in range(1, 33)),
                         tuple(0.001 * r for r in range(1, 9)))
    return _lookup_profile(prompt, out, rows), curve


def test_lookup_replay_closed_form():
    """Prompt 10..17, continuation 10..21; a k=1 draft right only at state 9. A verify of T tokens costs
    0.1 + 0.01 T, a draft forward over r rows 0.001 r. Walked by hand:
    lookup 2:    t0 draft (0.001 + c2), t1 lookup [12 13] 2/2 (c3), t4 [15 16] 2/2 (c3), t7 [10 11] 0/2 (c3),
                 t8 draft fed the 8 rows that waited (0.008 + c2), t9 draft accepts 1 (0.001 + c2): 11 tokens, 6 steps
    lookup 2..6: t0 draft, t1 [12 13] 2/2 (c3; the span grows to 4), t4 [15 16 17 10] 3/4 (c5; shrinks to 3),
                 t8 draft fed 8 rows, t9 draft accepts 1: 11 tokens, 5 steps
    no lookup:   ten draft steps of 0.001 + c2, the last accepting 1: 11 tokens"""
    prof, curve = _replay_example()
    c = curve.target_s
    cases = {sd.LookupSpan.fixed(2): (6, 0.001 + c(2) + 3 * c(3) + 0.008 + c(2) + 0.001 + c(2), 3, 7 / 3),
             sd.LookupSpan(2, 6): (5, 0.001 + c(2) + c(3) + c(5) + 0.008 + c(2) + 0.001 + c(2), 2, 7 / 2),
             None: (10, 10 * (0.001 + c(2)), 0, None)}
    for lookup, (steps, seconds, looked, lookup_tau) in cases.items():
        p = cm.predict_lookup(curve, prof, 1, lookup)
        assert p.tau == pytest.approx(11 / steps) and p.step_seconds == pytest.approx(seconds / steps), lookup
        assert p.speedup == pytest.approx(11 * c(1) / seconds) and p.lookup_share == pytest.approx(looked / steps)
        assert p.lookup_tau == (pytest.approx(lookup_tau) if lookup_tau else None)
    assert cm.predict_lookup(curve, prof, 1, None).label == "no lookup"
    with pytest.raises(ValueError, match="texts"):
        cm.predict_lookup(curve, cm.AcceptanceProfile.from_chain([0.5]), 1, None)


def test_lookup_replay_of_a_tree_closed_form():
    """The example above with trees. A tree of one node per level (budget = depth = k, top_k 1) is the chain of
    depth k: the same steps, tokens and seconds with or without lookup. A tree of depth 1 with two children accepts
    the draft's second choice too (rank 1 at every state but 9), so without lookup it makes 2 tokens a step, each
    step fed the 2 rows the last made (the first: 1) and verified at c(3): t0, 2, 4, 6, 8 draft (a = 1), t10
    plain (nothing left to propose): 11 tokens in 6 steps."""
    prof, curve = _replay_example()
    c = curve.target_s
    for lookup in (None, sd.LookupSpan.fixed(2), sd.LookupSpan(2, 6)):
        chain, tree = cm.predict_lookup(curve, prof, 1, lookup), cm.predict_lookup(curve, prof, 1, lookup, sd.TreeSpec(1, 1, 1))
        assert (tree.tau, tree.step_seconds, tree.lookup_share) == pytest.approx((chain.tau, chain.step_seconds,
                                                                                  chain.lookup_share), rel=1e-12)
        assert tree.tree == sd.TreeSpec(1, 1, 1) and tree.to_json()["tree"] == {"budget": 1, "top_k": 1, "depth": 1}
    wide = cm.predict_lookup(curve, prof, 1, None, sd.TreeSpec(2, 2, 1))
    seconds = 0.001 + c(3) + 4 * (0.002 + c(3)) + c(1)
    assert wide.tau == pytest.approx(11 / 6) and wide.step_seconds == pytest.approx(seconds / 6)
    assert wide.speedup == pytest.approx(11 * c(1) / seconds) and wide.lookup_share == 0
    choice = cm.choose_lookup(curve, prof, 1, tree=sd.TreeSpec(2, 2, 1))
    assert choice.alone == wide and choice.to_json()["tree"] == {"budget": 2, "top_k": 2, "depth": 1}
    # a run's tree steps are priced as the tree's: no lookup steps, then the tree's own prediction
    run = cm.lookup_run_speedup(curve, 1, lookup_sizes={}, lookup_tokens=0, draft_steps=5, draft_tokens=10,
                                tree=sd.TreeSpec(2, 2, 1))
    assert run == pytest.approx(2 * c(1) / cm.step_seconds(curve, tree=sd.TreeSpec(2, 2, 1), tau=2), rel=1e-12)


def test_lookup_replay_walks_the_decoders_steps(tiny):
    """On prompts that hold the target's own continuation, the replay along a real calibration takes the steps the
    decoder takes: the same tokens per step, the same share of lookup steps, and seconds that are the curve's price
    of each of the decoder's steps (lookup: c(n+1); draft: its feed over the rows that waited, then c(k+1))."""
    draft = untrained_draft(tiny.model)
    prompts = [ids + greedy_reference(tiny.model, ids, 30)[:12] + ids for ids in PROMPTS]
    prof = cm.calibrate(tiny.model, draft, prompts, max_new_tokens=30, depth=4)
    curve = cm.CostCurve("cpu", "float32", 1, tuple(0.05 + 0.01 * T for T in range(1, 33)),
                         tuple(0.005 + 0.001 * r for r in range(8)))
    for lookup in (None, sd.LookupSpan.fixed(1), sd.LookupSpan.fixed(4), sd.LookupSpan(1, 9)):
        tokens, steps, looked, seconds = 0, 0, 0, 0.0
        for ids in prompts:
            _, events = sd.collect(sd.speculative(tiny.model, draft, ids, 30, k=2, lookup=lookup or 0))
            waiting = 1
            for e in events[1:]:
                tokens, steps, looked = tokens + len(e.tokens), steps + 1, looked + (e.proposer == "lookup")
                if e.proposer == "lookup":
                    seconds += curve.target_s(e.drafted + 1)
                    waiting += len(e.tokens)
                elif e.drafted:
                    seconds += curve.draft_s(waiting) + (e.drafted - 1) * curve.draft_s(1) + curve.target_s(e.drafted + 1)
                    waiting = len(e.tokens)
                else:
                    seconds += curve.target_s(1)
                    waiting += 1
        p = cm.predict_lookup(curve, prof, 2, lookup)
        assert p.tau == pytest.approx(tokens / steps, rel=1e-12), lookup
        assert p.lookup_share == pytest.approx(looked / steps, rel=1e-12) and (looked > 0) == (lookup is not None)
        assert p.step_seconds == pytest.approx(seconds / steps, rel=1e-9), lookup


def test_lookup_auto_chooses_from_a_planted_curve():
    """A continuation that copies 40 tokens of the prompt, then a stretch where the last two tokens recur but the
    text goes on differently (lookups there miss), and a draft that is always right (k = 1: 2 tokens a step).
    When a verify costs one forward whatever its length, the longest span pays most (lookup 16: it copies in the
    fewest steps). When a verify of T tokens costs T forwards, a lookup at best matches the draft's step and every
    miss loses: no lookup, and the choice says which span came closest."""
    S = tuple(range(100, 140))
    prompt = S + (1, 2, 3, 1, 2, 4)
    out = (5,) + S + tuple(t for x in range(9, 15) for t in (1, 2, x))
    rows = [(0,) * 8] * (len(out) - 1) + [(-1,) * 8]
    prof = _lookup_profile(prompt, out, rows)
    flat = cm.CostCurve("cpu", "float32", 1, (0.1,) * 32, (0.001,) * 8)
    choice = cm.choose_lookup(flat, prof, 1)
    assert choice.chosen == sd.LookupSpan.fixed(16) and max(s.start for s in cm.AUTO_LOOKUPS) == 16
    assert choice.best.lookup == choice.chosen and choice.best.speedup > 2 * choice.alone.speedup
    steep = cm.CostCurve("cpu", "float32", 1, tuple(0.1 * T for T in range(1, 33)), (0.001,) * 8)
    choice = cm.choose_lookup(steep, prof, 1)
    assert choice.chosen is None and choice.best.lookup in cm.AUTO_LOOKUPS
    assert choice.best.speedup < choice.alone.speedup
    assert choice.to_json()["chosen"] is None and choice.to_json()["best"]["label"] == choice.best.lookup.label


def test_a_measured_run_with_lookup_is_priced_step_by_step():
    """lookup_run_speedup on a flat curve (every verify 0.1 s, every draft forward 0.001 s): 10 lookup steps that
    verified 4 tokens each and made 50 tokens, and 20 chain steps (k = 1) that made 40, feeding 90 / 20 = 4.5
    rows each: 10 × 0.1 + 20 × (0.001 + 0.1) = 3.02 s against 90 × 0.1 = 9 s plainly. Without lookup steps it is
    the chain's own prediction, τ c(1) / step_seconds."""
    flat = cm.CostCurve("cpu", "float32", 1, (0.1,) * 32, (0.001,) * 8)
    got = cm.lookup_run_speedup(flat, 1, lookup_sizes={4: 10}, lookup_tokens=50, draft_steps=20, draft_tokens=40)
    assert got == pytest.approx(9 / 3.02, rel=1e-12)
    steep = cm.CostCurve("cpu", "float32", 1, tuple(0.1 * T for T in range(1, 33)), tuple(0.001 * T for T in range(1, 9)))
    alone = cm.lookup_run_speedup(steep, 2, lookup_sizes={}, lookup_tokens=0, draft_steps=30, draft_tokens=75)
    assert alone == pytest.approx(2.5 * steep.target_s(1) / cm.step_seconds(steep, k=2, tau=2.5), rel=1e-12)
    assert cm.lookup_run_speedup(flat, 1, lookup_sizes={}, lookup_tokens=0, draft_steps=0, draft_tokens=0) is None


# ----------------------------------------------------------------------------- commands


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    meta = {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec}
    return save_draft(tmp_path_factory.mktemp("cm-drafts") / "low", untrained_draft(tiny.model, layers=(1, 2)), meta)


def test_profile_command_json_and_cache(tmp_path, draft_dir, capsys):
    store = str(tmp_path / "store")
    args = ["profile", "--store", store, "--model", "tiny-llama", "--draft", str(draft_dir), "--max-tokens", "6",
            "--repeats", "1", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"device", "dtype", "threads", "cost_curve", "draft_step_seconds", "break_even_tau"} <= set(doc)
    assert (doc["device"], doc["dtype"], doc["threads"]) == ("cpu", "float32", torch.get_num_threads())
    assert [p["tokens"] for p in doc["cost_curve"]] == [1, 2, 3, 4, 5, 6]
    assert all(p["seconds"] > 0 for p in doc["cost_curve"]) and doc["draft_step_seconds"] > 0
    c = doc["cost_curve"]
    k = sd.DEFAULT_K
    d, tau = [p["seconds"] for p in doc["draft_curve"]], doc["break_even_tau"]   # feed: tau rows, interpolated
    feed = d[int(tau) - 1] + (tau - int(tau)) * (d[int(tau)] - d[int(tau) - 1])
    assert tau * c[0]["seconds"] == pytest.approx(feed + (k - 1) * d[0] + c[k]["seconds"])
    assert {"quiet", "load", "others_cpu", "cores", "threads", "window_s"} <= set(doc["machine"])
    assert main(args) == 0            # the second time: from the store if it was measured quiet, or busy while the
    again = json.loads(capsys.readouterr().out)      # machine is still busy; else measured again
    if again["machine"] == doc["machine"]:            # served from the store: the same curve (either case)
        assert again["cost_curve"] == c
    else:                             # measured again: the first was busy and the machine is quiet now
        assert not doc["machine"]["quiet"]
    assert main(args[:-1]) == 0
    assert "break-even tau" in capsys.readouterr().out


def test_bench_auto_contenders(tmp_path, draft_dir, capsys):
    """`bench --k 1,2 --tree auto --k auto`: the fixed chains, then the automatic chain and tree; every contender
    with a predicted speedup, the curve used, and the choice of the auto contenders; still lossless."""
    args = ["bench", "--store", str(tmp_path / "store"), "--model", "tiny-llama", "--draft", str(draft_dir),
            "--prompts", "builtin", "--limit", "2", "--max-new-tokens", "6", "--no-peers",
            "--k", "1,2", "--tree", "auto", "--k", "auto", "--auto-even-if-slower"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in doc["results"]]
    assert names[:3] == ["autoregressive", "low chain k=1", "low chain k=2"] and len(names) == 5
    assert names[3].startswith("low auto chain k=") and names[4].startswith("low auto tree budget=")
    assert [p["tokens"] for p in doc["cost_curve"]] == list(range(1, cm.MAX_TOKENS + 1))
    for r in doc["results"]:
        assert r["lossless"] and r["predicted_speedup"] > 0
    auto_chain, auto_tree = doc["results"][3], doc["results"][4]
    assert auto_chain["chosen"]["k"] in cm.AUTO_KS and f"chain k={auto_chain['chosen']['k']}" in auto_chain["name"]
    assert TreeSpec(**auto_tree["chosen"]["tree"]) in cm.AUTO_TREES
    assert {"tau", "speedup"} <= set(auto_tree["calibrated"])
    assert main(args) == 0
    assert "predicted" in capsys.readouterr().out
    assert main(args + ["--lookup", "3", "--json"]) == 0   # the chosen chain and tree also with prompt lookup first
    doc = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in doc["results"]]
    k, tree = doc["results"][3]["chosen"]["k"], TreeSpec(**doc["results"][4]["chosen"]["tree"])
    assert names[5:] == [f"low auto chain k={k} + lookup 3", f"low auto {cm.tree_label(tree)} + lookup 3"]
    for hybrid in doc["results"][5:]:
        assert hybrid["lossless"] and hybrid["predicted_speedup"] > 0      # from its own steps, as the chains' are
        assert set(hybrid["lookup"]) == {"steps", "draft_steps", "drafted", "accepted", "sizes"}
        sizes = {int(n): c for n, c in hybrid["lookup"]["sizes"].items()}
        assert sum(sizes.values()) == hybrid["lookup"]["steps"] and all(1 <= n <= 3 for n in sizes)
        assert sum(n * c for n, c in sizes.items()) == hybrid["lookup"]["drafted"]
    assert doc["results"][6]["decoding"] == f"auto: {cm.tree_label(tree)} + lookup 3"


def test_bench_lookup_auto_and_adaptive(tmp_path, draft_dir, capsys):
    """`bench --k 1 --lookup auto`: either the chain with the lookup span predicted best on this machine (a contender
    of its own) or, when none beats the chain alone, the chain carrying the refusal; one line says which and why.
    `--lookup 2..6` decodes with adaptive lookup, losslessly; a value that is no span is refused in one line."""
    args = ["bench", "--store", str(tmp_path / "store"), "--model", "tiny-llama", "--draft", str(draft_dir),
            "--prompts", "builtin", "--limit", "2", "--max-new-tokens", "12", "--no-peers", "--k", "1"]
    saved = tmp_path / "bench.json"
    assert main(args + ["--lookup", "auto", "--save-json", str(saved)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(saved.read_text())
    names = [r["name"] for r in doc["results"]]
    assert names[:2] == ["autoregressive", "low"] and len(names) in (2, 3)
    if len(names) == 3:                                   # a span was predicted to pay
        choice = doc["results"][2]["lookup_auto"]
        span = sd.LookupSpan(**choice["chosen"])
        assert span in cm.AUTO_LOOKUPS and names[2] == f"low auto chain k=1 + {span.label}"
        assert doc["results"][2]["lossless"] and "lookup" in doc["results"][2]
        assert choice["best"]["speedup"] > choice["alone"]["speedup"] and "lookup_auto" not in doc["results"][1]
        assert f"{names[2]}: --lookup auto chose {span.label}" in text
    else:
        choice = doc["results"][1]["lookup_auto"]
        assert choice["chosen"] is None and choice["best"]["speedup"] <= choice["alone"]["speedup"]
        assert "low: --lookup auto chose no lookup for chain k=1: the best span, " in text
    assert choice["k"] == 1 and choice["alone"]["label"] == "no lookup" and choice["tree"] is None
    # with --tree auto the automatic tree gets its own choice: a contender with the span, or the tree carrying the
    # refusal (its line names the tree)
    assert main(args + ["--tree", "auto", "--auto-even-if-slower", "--lookup", "auto", "--save-json", str(saved)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(saved.read_text())
    tree_rows = [r for r in doc["results"] if " tree " in r["name"]]
    tree = TreeSpec(**tree_rows[0]["chosen"]["tree"])
    assert all(r["lossless"] for r in doc["results"]) and tree_rows[0]["name"] == f"low auto {cm.tree_label(tree)}"
    choice = next(r["lookup_auto"] for r in tree_rows if "lookup_auto" in r)
    assert choice["tree"] == asdict(tree) and choice["alone"]["label"] == "no lookup"
    if choice["chosen"] is None:
        assert len(tree_rows) == 1 and f"--lookup auto chose no lookup for {cm.tree_label(tree)}" in text
    else:
        span = sd.LookupSpan(**choice["chosen"])
        assert [r["name"] for r in tree_rows][1:] == [f"low auto {cm.tree_label(tree)} + {span.label}"]
        assert f"--lookup auto chose {span.label}" in text and f"for {cm.tree_label(tree)}: predicted" in text
    assert main(args + ["--lookup", "2..6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["results"]] == ["autoregressive", "low chain k=1", "low chain k=1 + lookup 2..6"]
    assert all(r["lossless"] for r in doc["results"]) and doc["results"][2]["decoding"] == "chain k=1 + lookup 2..6"
    for bad in ("x", "4..", "4..2", "0..4", "-1", "auto,4", "2.5"):
        assert main(args + ["--lookup", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --lookup") and "--lookup 4..16" in err, (bad, err)


def test_bench_auto_says_no_when_nothing_pays(tmp_path, draft_dir, capsys):
    """An untrained draft accepts almost nothing, so no depth or tree reaches its break-even tau (> 1: a draft
    step costs time): `--k auto --tree auto` says so and decodes plainly; every draft row shows its break-even tau
    and a verdict in words."""
    args = ["bench", "--store", str(tmp_path / "store"), "--model", "tiny-llama", "--draft", str(draft_dir),
            "--prompts", "builtin", "--limit", "2", "--max-new-tokens", "6", "--no-peers", "--k", "1",
            "--k", "auto", "--tree", "auto"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in doc["results"]]
    assert names == ["autoregressive", "low", "low auto plain"]
    plain = doc["results"][2]
    assert plain["chosen"] == {"plain": True} and plain["lossless"] and plain["acceptance_by_position"] == []
    cal = plain["calibrated"]
    assert cal["speedup"] < 1.0 and cal["tau"] < cal["break_even_tau"]
    chain = doc["results"][1]
    assert chain["break_even_tau"] > 1.0
    assert chain["verdict"].startswith(f"tau {chain['tau']:.3f} is below the break-even tau {chain['break_even_tau']:.3f}")
    # the run's own step cost: tau / speedup, unless the run verified faster than the curve measured (a busy machine's
    # noise), where run_draft_step's draft forward is clamped at 0 s and the curve's verification alone sets it
    if chain["draft_step_seconds"] > 0:
        assert chain["break_even_tau"] == pytest.approx(chain["tau"] / chain["speedup"])
    else:                                   # closed form on the curve: c(verified_tokens) / c(1)
        c = {p["tokens"]: p["seconds"] for p in doc["cost_curve"]}
        assert chain["break_even_tau"] == pytest.approx(c[chain["verified_tokens"]] / c[1])
        assert chain["break_even_tau"] >= chain["tau"] / chain["speedup"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "break-even tau" in text and "no depth or tree pays on this machine" in text and "decoded plainly" in text


def test_cost_curve_figure():
    fig = plots.cost_curve([{"tokens": 1, "seconds": 0.05}, {"tokens": 2, "seconds": 0.06}, {"tokens": 3, "seconds": 0.08}],
                           draft_step_seconds=0.005)
    assert list(fig.data[0].x) == [1, 2, 3] and list(fig.data[0].y) == pytest.approx([1.0, 1.2, 1.6])
    assert fig.layout.shapes[0].y0 == pytest.approx(0.1)


def test_one_break_even_rule_with_the_draft_step_a_run_measured():
    """Issue 51 (5): planted step costs, closed-form break-even. The curve timed a draft step at almost nothing, so
    its break-even tau of chain k=4 is about 1.09, yet a run measured tau 1.54 at 0.85x: the break-even that run
    names is tau / speedup (its draft step, and the step's upkeep, as measured), the verdict says it does not pay,
    and Home and the cost chart show that same number."""
    from types import SimpleNamespace

    from layerscope.decoding import bench
    from layerscope.ui import progress
    target = tuple(0.06 + 0.0012 * (T - 1) for T in range(1, 33))   # c(1) = 0.06, c(5) = 0.0648: a flat curve
    curve = cm.CostCurve("cpu", "float32", 1, target, (0.0001,) * 8)
    assert cm.break_even_tau(curve, k=4) == pytest.approx((4 * 0.0001 + 0.0648) / 0.06)          # 1.087
    # with a planted draft step: K draft forwards and a verification of K + 1 tokens, over one plain step
    planted = cm.with_draft_step(curve, 0.006)
    for k in (1, 2, 4, 8):
        assert cm.break_even_tau(planted, k=k) == pytest.approx((k * 0.006 + target[k]) / 0.06)
    tree = TreeSpec(budget=6, top_k=2, depth=3)                        # depth draft forwards, budget + 1 tokens
    assert cm.break_even_tau(planted, tree=tree) == pytest.approx((3 * 0.006 + target[6]) / 0.06)
    # a run's draft step: what its steps cost beyond the curve's verification, per draft forward
    step = cm.run_draft_step(curve, k=4, tau=1.54, speedup=0.85)
    assert step == pytest.approx((1.54 * 0.06 / 0.85 - 0.0648) / 4)
    assert cm.break_even_tau(cm.with_draft_step(curve, step), k=4) == pytest.approx(1.54 / 0.85)
    assert cm.run_draft_step(curve, k=4, tau=3.0, speedup=3.0) == 0.0          # never below nothing
    entry = {"name": "builtin chain k=4", "tau": 1.54, "speedup": 0.85}
    entry |= bench.break_even_entry(curve, 4, None, entry)
    assert entry["break_even_tau"] == pytest.approx(1.54 / 0.85) and entry["verified_tokens"] == 5
    assert entry["curve_break_even_tau"] == pytest.approx(cm.break_even_tau(curve, k=4))
    line = bench.verdict(entry["tau"], entry["break_even_tau"], "chain k=4", entry["speedup"],
                         predicted=entry["curve_break_even_tau"], draft=entry["draft_step_share"])
    assert line.startswith("tau 1.540 is below the break-even tau 1.812 of chain k=4 measured in this run: "
                           "it does not pay here (0.85x")
    assert "the cost curve's break-even tau 1.087 said it pays" in line and "pays here" not in line.replace(
        "does not pay here", "")
    # a run that won: pays, and only then
    won = {"tau": 2.4, "speedup": 1.3} | bench.break_even_entry(curve, 4, None, {"tau": 2.4, "speedup": 1.3})
    assert "it pays here (1.30x)" in bench.verdict(2.4, won["break_even_tau"], "chain k=4", 1.3,
                                                   predicted=won["curve_break_even_tau"])
    # Home: the same rule on the same draft step gives the same K = 4 number
    session = SimpleNamespace(bench_results=[{
        "device": "cpu", "created": None, "draft_step_seconds": curve.draft_s(1),
        "cost_curve": [{"tokens": T, "seconds": c} for T, c in enumerate(target, start=1)],
        "results": [{"name": "autoregressive", "tau": 1.0}, entry]}])
    home = progress.break_even(session)
    assert home["tau"][3] == pytest.approx(entry["break_even_tau"]) and home["draft_from"] == "builtin chain k=4"
    assert home["tau"][0] == pytest.approx((step + target[1]) / 0.06)
    # the cost chart: the step as measured at T = 5, with the curve's price beside it, and the measured draft step
    fig = plots.cost_curve(session.bench_results[0]["cost_curve"], steps=[entry],
                           draft_step_seconds=entry["draft_step_seconds"])
    measured = next(t for t in fig.data if t.name == "step measured")
    assert list(measured.x) == [5] and list(measured.y) == pytest.approx([1.54 / 0.85])
    assert fig.layout.shapes[0].y0 == pytest.approx(step / 0.06)


def test_a_verdict_never_prints_two_numbers_alike():
    from layerscope.decoding import bench
    for tau, even in ((0.9996, 1.0004), (0.99999, 1.00001), (1.2349, 1.2351)):
        line = bench.verdict(tau, even, "chain k=1", 0.97)
        shown_tau, shown_even = line.split("tau ")[1].split(" ")[0], line.split("break-even tau ")[1].split(" ")[0]
        assert shown_tau != shown_even and "is below" in line, line
    assert "tau 1.000 is below the break-even tau 1.015 of chain k=1" in bench.verdict(1.0, 1.015, "chain k=1", 0.98)
    assert bench.verdict(1.5, 1.5, "chain k=1", 1.0).startswith("tau 1.500 is at the break-even tau 1.500")


def test_default_draft_has_a_consistent_vocabulary(tiny):
    for loaded in (tiny, tiny_model(num_layers=6, hidden_size=32, seed=1)):
        head = cm.default_draft(loaded)
        V = head.config.draft_vocab_size
        assert int(head.t2d.sum()) == V and head.to_target_ids(torch.arange(V)).tolist() == head.t2d.nonzero().flatten().tolist()
        prof = cm.calibrate(loaded.model, head, PROMPTS[:1], max_new_tokens=6, depth=2)
        assert prof.rows == 5
