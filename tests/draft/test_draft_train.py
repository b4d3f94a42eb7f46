"""Draft training on a tiny capture: the loss falls, budgets are exact, layer sets see the same data."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from layerscope.commands.cli import main
from layerscope.draft.checkpoint import load_draft, read_meta
from layerscope.draft.training.data import batch_plan, split_conversations
from layerscope.draft.training.fit import TrainingCancelled
from layerscope.draft.training.loss import simulated_acc_len
from layerscope.draft.training.train import draft_for, train_draft
from layerscope.errors import DraftError
from layerscope.target.weights import target_weights

SMALL = dict(batch_size=4, seq_len=64)


def train(tiny, cap, layers, **kw):
    seen = []
    config, embed, lm_head = target_weights(tiny)
    head, report = train_draft(cap, layers, config, embed, lm_head, progress=seen.append, **{**SMALL, **kw})
    return head, report, seen


def test_loss_falls_and_the_report_adds_up(tiny, tiny_capture):
    head, report, seen = train(tiny, tiny_capture, [1, 2, 3], steps=40)
    losses = [p.mean_loss for p in seen]
    assert len(seen) == report.steps == 40 and seen[-1].steps == 40
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    assert report.loss_first == losses[0] and report.loss_last == losses[-1]
    assert report.train_tokens + report.val_tokens == tiny_capture.num_tokens
    assert report.train_conversations + report.val_conversations == len(tiny_capture.manifest["prompts"])
    assert report.val_conversations >= 1 and report.val_positions > 0
    assert len(report.val_accuracy) == 3 and all(0 <= a <= 1 for a in report.val_accuracy)
    assert report.tokens_seen == seen[-1].tokens and len(seen[-1].acc[0]) == 3
    assert head.aux_layers == [1, 2, 3] and not head.training
    # the draft's argmax agrees with the target's on the training positions better than chance (1/V)
    assert max(p.acc[0][0] for p in seen[-5:]) > 0.2


def test_layer_sets_get_the_same_batches_and_the_seed_changes_them(tiny, tiny_capture):
    runs = {(tuple(layers), seed): train(tiny, tiny_capture, layers, steps=6, seed=seed)
            for layers, seed in (([1, 2, 3], 0), ([0, 3], 0), ([1, 2, 3], 1))}
    rows = {k: [p.tokens for p in seen] for k, (_, _, seen) in runs.items()}
    assert rows[((1, 2, 3), 0)] == rows[((0, 3), 0)]
    assert runs[((1, 2, 3), 0)][1].val_positions == runs[((0, 3), 0)][1].val_positions
    assert rows[((1, 2, 3), 0)] != rows[((1, 2, 3), 1)]


def test_a_token_budget_stops_at_the_first_step_reaching_it(tiny, tiny_capture):
    _, report, seen = train(tiny, tiny_capture, [2], tokens=700)
    tokens = [p.tokens for p in seen]
    assert tokens[-1] >= 700 > tokens[-2] and report.tokens_seen == tokens[-1]


def test_batch_plan_is_seeded_and_covers_every_window_each_epoch():
    windows = [(i * 10, 5 + i % 3) for i in range(10)]
    plan = batch_plan(windows, 3, seed=7, steps=8)
    assert plan == batch_plan(windows, 3, seed=7, steps=8) and plan != batch_plan(windows, 3, seed=8, steps=8)
    first_epoch = [w for b in plan[:4] for w in b]
    assert sorted(first_epoch) == sorted(windows)


def test_held_out_conversations_are_a_seeded_disjoint_choice():
    conversation = torch.arange(20).repeat_interleave(5)
    held = split_conversations(conversation, 0.2, seed=3)
    assert held.sum() == 4 * 5 and torch.equal(held, split_conversations(conversation, 0.2, seed=3))
    assert not torch.equal(held, split_conversations(conversation, 0.2, seed=4))
    val_convs, train_convs = set(conversation[held].tolist()), set(conversation[~held].tolist())
    assert not val_convs & train_convs and len(val_convs | train_convs) == 20
    assert split_conversations(torch.zeros(7, dtype=torch.long), 0.5, seed=0).sum() == 0   # one conversation: no split


def test_stop_request_cancels_training(tiny, tiny_capture):
    with pytest.raises(TrainingCancelled):
        train_draft(tiny_capture, [1], *target_weights(tiny), steps=5, should_stop=lambda: True, **SMALL)


def test_bad_budgets_are_refused(tiny, tiny_capture):
    for kw in ({}, {"steps": 5, "tokens": 5}, {"steps": 0}, {"steps": 5, "ttt_steps": 8}):
        with pytest.raises(DraftError):
            train_draft(tiny_capture, [1], *target_weights(tiny), **kw)


def test_draft_for_trains_once_per_key(tiny, tiny_capture, store):
    calls = []
    opts = dict(steps=3, batch_size=2, seq_len=32)
    path = draft_for(tiny_capture, [3, 1], tiny, store, progress=calls.append, **opts)
    assert len(calls) == 3 and path.parent == store.root / "drafts"
    meta = read_meta(path)
    assert meta["layers"] == [1, 3] and meta["capture_key"] == tiny_capture.key
    assert meta["target_fingerprint"] == tiny.fingerprint and meta["budget"]["resolved_steps"] == 3
    again = draft_for(tiny_capture, [1, 3], tiny, store, progress=calls.append, **opts)
    assert again == path and len(calls) == 3                         # served from the store, no training
    other = draft_for(tiny_capture, [1, 2], tiny, store, **opts)
    reseeded = draft_for(tiny_capture, [1, 3], tiny, store, seed=1, **opts)
    assert len({path, other, reseeded}) == 3
    assert load_draft(path, tiny).aux_layers == [1, 3]


def test_cli_trains_and_prints_json(tiny, tiny_capture, session_store, tmp_path, capsys):
    out = tmp_path / "drafts" / "d1"
    args = ["train-draft", tiny_capture.key, "--layers", "1,3", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
            "--out", str(out), "--json", "--store", str(session_store.root)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"out", "layers", "steps", "train_tokens", "seconds", "val_accuracy", "simulated_acc_len"}
    assert result["out"] == str(out) and result["layers"] == [1, 3] and result["steps"] == 3
    assert len(result["val_accuracy"]) == 3 and result["train_tokens"] > 0
    a1, a2, a3 = result["val_accuracy"]                 # SpecForge's Σ∏ of the agreement it reports, no bonus token
    assert result["simulated_acc_len"] == pytest.approx(a1 + a1 * a2 + a1 * a2 * a3, abs=1e-5)
    assert read_meta(out)["simulated_acc_len"] == result["simulated_acc_len"]
    assert read_meta(out)["val_accuracy"] == result["val_accuracy"]
    assert load_draft(out, tiny).aux_layers == [1, 3]
    args = ["train-draft", tiny_capture.key, "--strategy", "default", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
            "--out", str(tmp_path / "d2"), "--json", "--store", str(session_store.root)]
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["layers"] == [1, 2]    # [2, N//2, N-3], N=4
    assert read_meta(tmp_path / "d2")["strategy"] == "default"
    assert main(["train-draft", tiny_capture.key, "--steps", "3", "--store", str(session_store.root)]) == 2
    assert "--layers or --strategy" in capsys.readouterr().err
    assert main(["train-draft", tiny_capture.key, "--layers", "1,9", "--steps", "3", "--store", str(session_store.root)]) == 2


def test_simulated_acc_len_is_specforges_sum_of_running_products():
    assert simulated_acc_len([0.5, 0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.125)
    assert simulated_acc_len([1.0, 1.0, 1.0, 1.0]) == 4.0       # a perfect draft: every draft token, no bonus token
    assert simulated_acc_len([0.8, 0.0, 1.0]) == pytest.approx(0.8)   # nothing after a step that never agrees
    assert simulated_acc_len([]) == 0.0
    # steps that agree independently: it is the expected accepted prefix of a chain, by enumerating the outcomes
    acc = [0.9, 0.6, 0.3]
    expected = 0.0
    for outcome in itertools.product([True, False], repeat=3):
        p = math.prod(a if ok else 1 - a for a, ok in zip(acc, outcome))
        expected += p * next((i for i, ok in enumerate(outcome) if not ok), 3)
    assert simulated_acc_len(acc) == pytest.approx(expected) == pytest.approx(0.9 + 0.54 + 0.162)
