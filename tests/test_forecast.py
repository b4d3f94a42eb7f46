"""Estimates before a step starts (layerscope/forecast.py): time and disk from a stated rule of the target's size,
replaced by the pace a run of the same kind measured here; said once, before the step, by the CLI and the app."""

from __future__ import annotations

import json

import pytest

from layerscope import fmt, forecast, models, workflow
from layerscope.capture.run import CaptureOptions
from layerscope.cli import main
from layerscope.draft.fit import TrainOptions
from layerscope.draft.online import OnlineOptions
from layerscope.draft.progress import ResponsesProgress, TrainProgress
from layerscope.study.run import StudyOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def loader(tiny):
    return lambda spec, store: tiny


def test_a_capture_is_estimated_by_the_rule_then_at_the_pace_it_measured(tiny, store):
    heard, plans = [], []
    done = workflow.capture("tiny-llama", "builtin", CaptureOptions(limit=4, max_new_tokens=8, batch_size=2), store,
                            load=loader(tiny), estimate=heard.append,
                            progress=lambda p: plans.append(p.estimate) if p.estimate is not None else None)
    (before,), (plan,) = heard, plans
    P = models.param_count(tiny.model.config)
    assert forecast.target(store, "tiny-llama").params == P                  # from the config, without the weights
    steps = 2 * 8 * (1 + forecast.BATCH_ROW)                                # 2 batches of 2 rows x 8 new tokens
    rule = steps * P * forecast.DECODE_S + (plan.prompt_tokens + plan.response_tokens) * P * forecast.FORWARD_S
    assert before.seconds == pytest.approx(rule) and before.bytes == plan.total
    line = before.line()
    assert line.startswith("Estimate before the capture starts: about ") and f"up to {fmt.size(plan.total)} stored" in line
    assert "4 conversations, up to 8 answer tokens each" in line and "rule of thumb for" in line
    assert "M parameters" in line
    again = forecast.capture(store, "tiny-llama", plan, 2)                  # the same capture: the time it took
    assert again.seconds == pytest.approx(done.result.seconds)
    assert "at the pace the last capture of tiny-llama measured here" in again.line()


def test_online_training_says_the_answers_it_will_write_and_the_training(tiny, store):
    """The finding: a 20k-token budget that spent 4 minutes writing the target's answers, with no cost said before
    the click. The estimate names both parts; after one run each part goes at the pace that run measured."""
    o = OnlineOptions(prompts="builtin", limit=12, max_new_tokens=10, batch_size=3, seq_len=64, gen_batch_size=4,
                      val_conversations=2, eval_points=2, draft_vocab=64, tokens=600)
    heard, seen = [], []
    workflow.train_online(store, "tiny-llama", [[1, 2], [0, 3]], o, load=loader(tiny), estimate=heard.append,
                          progress=seen.append)
    (before,) = heard
    t = forecast.target(store, "tiny-llama")
    answers = 3 * 10 * (1 + 3 * forecast.BATCH_ROW) * t.params * forecast.DECODE_S     # 3 batches of 4, 10 steps
    training = 600 * forecast.row_rule(t, [[1, 2], [0, 3]], o, online=True)
    assert [p.seconds for p in before.parts] == pytest.approx([answers, training])
    assert before.seconds == pytest.approx(answers + training)
    line = before.line()
    assert "the target's answers to 12 conversations, up to 10 tokens each" in line
    assert "training 2 drafts on 600 tokens" in line and "stored" in line
    a = [p for p in seen if isinstance(p, ResponsesProgress)][-1]
    trained = [p for p in seen if isinstance(p, TrainProgress)][-1]
    after = forecast.online(store, "tiny-llama", [[1, 2], [0, 3]], o)
    # 10 of the 12 prompts fit max_prompt_tokens (the estimate counts all 12: at most); 3 batches of 4 either way
    assert a.prompts == 10 and after.parts[0].seconds == pytest.approx(a.elapsed_s)   # as long as they took
    assert after.parts[1].seconds == pytest.approx(600 / trained.tokens_per_s)
    assert "answer writing of tiny-llama measured here" in after.line()
    assert "online training of tiny-llama measured here" in after.line()


def test_a_study_is_its_drafts_training_and_its_benchmark(store):
    """The study's estimate adds up what its parts' estimates say: each draft's training from the capture and one
    benchmark of its drafts against plain decoding."""
    o = StudyOptions(train=TrainOptions(steps=5, batch_size=2, seq_len=32), limit=3, max_new_tokens=8, k=2)
    study = forecast.study(store, "tiny-llama", o, sets=3)
    draft = forecast.training(store, "tiny-llama", [0, 1], o.train)
    bench = forecast.bench(store, "tiny-llama", 3, o.bench_options())
    assert study.seconds == pytest.approx(3 * draft.seconds + bench.seconds)
    assert bench.bytes == 0 and "up to 96 tokens decoded (3 prompts x 8 tokens x each decoder)" in bench.line()
    assert study.bytes >= 3 * draft.bytes and "training 3 drafts" in study.line()
    # once the plan is known: what is left, and what the outcomes folder gave back without training
    assert forecast.study(store, "tiny-llama", o, left=(3, 1, 0)).seconds == pytest.approx(study.seconds)
    left = forecast.study(store, "tiny-llama", o, left=(1, 1, 2))
    assert left.seconds == pytest.approx(draft.seconds + forecast.bench(store, "tiny-llama", 1, o.bench_options()).seconds)
    assert "Estimate before the study's training starts" in left.line() and "(2 read back from its outcomes folder)" in left.line()
    assert forecast.study(store, "tiny-llama", o, left=(0, 0, 3)).seconds == 0
    assert forecast.study(store, "no/such-model", o).seconds is None       # no config before a load: said so
    assert "no time estimate" in forecast.study(store, "no/such-model", o).line()


def test_the_cli_says_the_estimate_on_stderr_once_its_checks_pass(tiny, tmp_path, capsys):
    args = ["bench", "--store", str(tmp_path / "store"), "--model", "tiny-llama", "--prompts", "builtin",
            "--limit", "2", "--max-new-tokens", "4", "--no-peers"]
    assert main(args + ["--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["prompts"] == 2                                  # stdout stays the result
    said = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("Estimate before")]
    assert len(said) == 1 and "benchmark starts" in said[0] and "up to 8 tokens decoded" in said[0]
    assert "nothing stored" in said[0]
    assert main(args + ["--draft", str(tmp_path / "missing")]) == 2         # refused first: no estimate
    assert "Estimate before" not in capsys.readouterr().err
