"""The one training loop's recipe options on tiny-llama: closed forms for the warm start and the feature loss,
a frozen lm_head that stays the target's, options that round-trip through layerscope.json, and resume with
the recipe equal to an uninterrupted run."""

from __future__ import annotations

import json
import math
import pickle
import time
from dataclasses import FrozenInstanceError, asdict, fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from layerscope.draft.model import build_draft_vocab
from layerscope.draft.training.checkpoints import complete_checkpoints
from layerscope.draft.training.fit import (
    FitState,
    TrainingCancelled,
    TrainOptions,
    WarmStart,
    build_drafters,
    final_norm,
    fit,
    history,
    lr_at,
    note_start,
)
from layerscope.draft.training.loss import LOSS_DECAY, ttt_loss
from layerscope.draft.training.online import OnlineOptions, train_online
from layerscope.draft.training.progress import EvalProgress, TrainProgress
from layerscope.draft.training.train import train_capture_draft
from layerscope.errors import DraftError
from layerscope.store import Store
from tests.helpers import SMALL_ONLINE as SMALL

RECIPE = dict(feature_loss=0.5, noise_std=0.05, warm_start=2, freeze_lm_head=True, warmup=3)


def drafters_for(tiny, layers, o):
    embed, lm_head = tiny.model.get_input_embeddings().weight, tiny.model.get_output_embeddings().weight
    d2t, t2d = build_draft_vocab(torch.arange(embed.shape[0]), 64, embed.shape[0])
    return build_drafters(tiny.model.config, embed, lm_head, final_norm(tiny.model), [layers], d2t, t2d, o, "cpu")


def synthetic_batch(tiny, k, B=2, T=200, J=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = tiny.hidden_size
    mask = torch.rand(B, T, generator=g) > 0.3
    ids = [torch.randint(0, 200, (B, T), generator=g) for _ in range(J)]
    aux = torch.randn(B, T, k * d, generator=g)
    return {"input_ids": ids, "aux": aux, "position_ids": torch.arange(T).expand(B, T),
            "masks": [mask] * J, "targets": [torch.randn(int(mask.sum()), d, generator=g) for _ in range(J)],
            "argmax": None, "rows": B * T}


def test_warm_start_sets_fc_to_the_ridge_solution(tiny):
    """When the target's final state is an exact linear map of the auxiliary states, the warm start recovers it."""
    o = TrainOptions(steps=1, init_lm_head=True, fc_norm=False)      # fc reads the states as they are
    [d] = drafters_for(tiny, [1, 3], o)
    batch = synthetic_batch(tiny, 2)
    w_true = torch.randn(2 * tiny.hidden_size, tiny.hidden_size, generator=torch.Generator().manual_seed(1))
    x = batch["aux"][batch["masks"][0]]
    batch["targets"][0] = x @ w_true                                  # draft norm weight is 1: y is used as it is
    warm = WarmStart([d])
    warm.add([d], [batch])
    warm.apply([d], lam=1e-9)
    assert torch.allclose(d.head.fc.weight.T, w_true, atol=1e-3)
    # with a real ridge the solution is the closed form (X^T X + r I)^-1 X^T Y, r = lam * mean diag
    y = torch.randn(x.shape[0], tiny.hidden_size, generator=torch.Generator().manual_seed(2)).double()
    batch["targets"][0] = y.float()
    warm = WarmStart([d])
    warm.add([d], [batch])
    warm.apply([d], lam=0.3)
    xd = x.double()
    g = xd.T @ xd
    want = torch.linalg.lstsq(torch.cat([xd, (0.3 * g.diagonal().mean()).sqrt() * torch.eye(xd.shape[1], dtype=xd.dtype)]),
                              torch.cat([y, torch.zeros(xd.shape[1], y.shape[1], dtype=y.dtype)])).solution
    assert torch.allclose(d.head.fc.weight.T.double(), want, atol=1e-4)


def test_feature_loss_adds_the_weighted_smooth_l1_term(tiny):
    o = TrainOptions(steps=1)
    [d] = drafters_for(tiny, [0, 2], o)
    batch = synthetic_batch(tiny, 2)
    plain, _ = ttt_loss(d.head, batch, d.teacher)
    with_feature, _ = ttt_loss(d.head, batch, d.teacher, feature_weight=0.7)
    outs = d.head.unroll(batch["input_ids"], d.head.fuse(batch["aux"]), batch["position_ids"], with_logits=False)
    extra = sum(LOSS_DECAY ** j * F.smooth_l1_loss(d.head.norm(h[m]).float(), t)
                for j, ((_, h), m, t) in enumerate(zip(outs, batch["masks"], batch["targets"])))
    assert float((with_feature - plain).detach()) == pytest.approx(0.7 * float(extra.detach()), rel=1e-5)


def test_frozen_lm_head_and_norm_stay_the_targets(tiny, tiny_capture):
    o = TrainOptions(steps=4, batch_size=2, seq_len=32, draft_vocab=100, freeze_lm_head=True, warmup=1)
    head, report = train_capture_draft(tiny_capture, [1, 3], tiny, options=o)
    rows = head.d2t + torch.arange(len(head.d2t))
    assert torch.equal(head.lm_head.weight, tiny.model.get_output_embeddings().weight[rows].float())
    assert torch.equal(head.norm.weight, final_norm(tiny.model).float())
    assert report.meta["options"]["freeze_lm_head"] is True
    with pytest.raises(DraftError, match="init_lm_head"):
        TrainOptions(steps=1, freeze_lm_head=True, init_lm_head=False).validate()


def test_recipe_options_round_trip_through_the_draft_metadata(tiny, tmp_path, one_thread):
    o = OnlineOptions(steps=3, **RECIPE, **SMALL)
    result = train_online(tiny, [[1, 2]], Store(tmp_path / "s"), options=o)
    meta = json.loads((Path(result.drafts[0].path) / "layerscope.json").read_text())
    assert OnlineOptions(**meta["options"]) == o
    assert set(meta["options"]) == {f.name for f in fields(OnlineOptions)}
    assert meta["train_format"] == 3 and len(meta["curve"]) == 2


def test_resume_with_the_recipe_equals_an_uninterrupted_run(tiny, tmp_path, one_thread):
    """Warm start, feature loss, noise (torch's RNG is in the checkpoint) and a frozen lm_head: a run stopped
    after step 5 and resumed ends with the same drafts, bit for bit, as one that never stopped."""
    sets = [[1, 3], [0, 2]]
    o = OnlineOptions(steps=8, **RECIPE, **SMALL)
    whole = train_online(tiny, sets, Store(tmp_path / "a"), options=o)
    store, calls = Store(tmp_path / "b"), []
    with pytest.raises(TrainingCancelled, match="saved"):
        train_online(tiny, sets, store, options=OnlineOptions(**{**asdict(o), "checkpoint_every_s": 1e-9}),
                     progress=calls.append,
                     should_stop=lambda: sum(1 for p in calls if p.phase == "train") >= 5)
    run_dir = next((store.root / "runs").iterdir())
    assert [p.name for p in complete_checkpoints(run_dir)] == ["ckpt-000000005"]
    resumed = train_online(tiny, sets, store, options=o)
    assert resumed.resumed
    for a, b in zip(resumed.drafts, whole.drafts):
        wa, wb = load_file(str(Path(a.path) / "model.safetensors")), load_file(str(Path(b.path) / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        assert a.curve == b.curve


def test_a_stop_inside_the_warm_start_saves_nothing_and_says_so(tiny, tmp_path, one_thread):
    o = OnlineOptions(steps=8, checkpoint_every_s=1e-9, **{**RECIPE, "warm_start": 4}, **SMALL)
    calls = []
    with pytest.raises(TrainingCancelled, match="Nothing was saved"):
        train_online(tiny, [[1, 3]], Store(tmp_path / "w"), options=o, progress=calls.append,
                     should_stop=lambda: sum(1 for p in calls if p.phase == "train") >= 2)
    assert not complete_checkpoints(next((tmp_path / "w" / "runs").iterdir()))


def test_a_resume_from_a_checkpoint_without_recorded_starts_counts_the_unknown_first_start():
    """A checkpoint written before starts were recorded (step 512, no starts) resumed once: two starts, one
    resume at step 512, the first start's time unknown (None, and no wall time), the recorded part's known."""
    old = FitState.from_json({**FitState(1, step=512, tokens=722_629).to_json(), "starts": []})
    note_start(old)
    old.starts[-1][0] -= 60                                   # the resume began a minute ago
    went = history(old)
    since_resume = time.time() - old.starts[-1][0]            # measured after history(): an upper bound
    assert (went["starts"], went["resumed"], went["resumed_at"]) == (2, 1, [{"step": 512, "tokens": 722_629}])
    assert went["first_start"] is None and went["wall_s"] is None
    assert 60 - 0.05 <= went["recorded_wall_s"] <= since_resume + 0.05     # from the resume, the one known start
    fresh = FitState(1)
    note_start(fresh)
    fresh.starts[0][0] -= 60                                  # the training began a minute ago
    went = history(fresh)
    since_start = time.time() - fresh.starts[0][0]
    assert (went["starts"], went["resumed"]) == (1, 0) and went["wall_s"] == went["recorded_wall_s"]
    assert 60 - 0.05 <= went["recorded_wall_s"] <= since_start + 0.05
    assert went["first_start"] <= went["finished"]


def test_the_schedule_warms_up_then_decays_over_the_budget():
    o = TrainOptions(steps=100, lr=1e-3, warmup=10, min_lr_ratio=0.1)
    assert lr_at(o, 0, 0.0) == pytest.approx(1e-4) and lr_at(o, 9, 0.09) == pytest.approx(1e-3)
    assert lr_at(o, 50, 0.5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(o, 100, 1.0) == pytest.approx(1e-4)
    for bad in ({"clock": "sundial"}, {"feature_loss": -1.0}, {"noise_std": float("nan")}, {"warm_start": -2}):
        with pytest.raises(DraftError):
            TrainOptions(steps=1, **bad).validate()


def test_a_deeply_nested_checkpoint_state_is_one_clear_line(tiny, tmp_path, one_thread):
    """A planted state.json nested far deeper than LayerScope writes is refused by name, never a RecursionError."""
    store, calls = Store(tmp_path / "d"), []
    o = OnlineOptions(steps=6, checkpoint_every_s=1e-9, **SMALL)
    with pytest.raises(TrainingCancelled):
        train_online(tiny, [[1, 3]], store, options=o, progress=calls.append,
                     should_stop=lambda: sum(1 for p in calls if p.phase == "train") >= 2)
    ckpt = complete_checkpoints(next((store.root / "runs").iterdir()))[-1]
    (ckpt / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DraftError, match="cannot be read.*nested"):
        train_online(tiny, [[1, 3]], store, options=o)


def test_the_loop_reports_typed_progress_that_pickles(tiny):
    """A TrainProgress per step (in the warm start: no loss, zero agreement) and an EvalProgress before each
    evaluation; frozen, and picklable as the app's worker needs."""
    o = TrainOptions(steps=3, ttt_steps=2, warm_start=1, warmup=1, eval_points=1)
    drafters = drafters_for(tiny, [1, 3], o)
    batch = synthetic_batch(tiny, 2)

    class Source:
        def next_batches(self, state):
            return [batch], batch["rows"]

    seen = []
    fit(drafters, Source(), o, evaluate=lambda: [([0.5, 0.25], 1.0, 10, 0.9)], progress=seen.append, planned_steps=3)
    assert [type(p) for p in seen] == [TrainProgress, TrainProgress, EvalProgress, TrainProgress]
    assert [p.phase for p in seen] == ["train", "train", "eval", "train"]
    warm, last = seen[0], seen[-1]
    assert warm.loss == [] and warm.acc == [[0.0, 0.0]] and math.isnan(warm.mean_loss) and warm.val == [None]
    assert seen[2] == EvalProgress(step=3, tokens=3 * batch["rows"])
    assert (last.step, last.steps, last.tokens, last.fraction, last.sets) == (3, 3, 3 * batch["rows"], 1.0, [[1, 3]])
    assert last.val == [[0.5, 0.25]] and len(last.acc[0]) == 2 and last.mean_loss == last.loss[0]
    assert pickle.loads(pickle.dumps(last)) == last
    with pytest.raises(FrozenInstanceError):
        last.step = 0
