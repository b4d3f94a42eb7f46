"""Estimates before a step starts (layerscope/steps/forecast.py): time and disk from a stated rule of the target's size,
replaced by the pace a run of the same kind measured here; said once, before the step, by the CLI and the app."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from layerscope import eta, fmt
from layerscope.capture.run import CaptureOptions
from layerscope.commands.cli import main
from layerscope.decoding import bench, costmodel
from layerscope.decoding.bench import BenchOptions
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.training import responses
from layerscope.draft.training.fit import TrainingCancelled, TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.draft.training.progress import ResponsesProgress, TrainProgress
from layerscope.quietness import MachineOptions
from layerscope.steps import forecast, workflow
from layerscope.study.run import StudyOptions
from layerscope.target.config import param_count
from layerscope.target.shape import target, target_shape
from tests.helpers import untrained_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def loader(tiny):
    return lambda spec, store: tiny


def test_a_capture_is_estimated_by_the_rule_then_at_the_pace_it_measured(tiny, store):
    heard, plans = [], []
    done = workflow.capture("tiny-llama", "builtin", CaptureOptions(limit=4, max_new_tokens=8, batch_size=2), store,
                            load=loader(tiny), estimate=heard.append,
                            progress=lambda p: plans.append(p.estimate) if p.estimate is not None else None)
    (before,), (plan,) = heard, plans
    P = param_count(tiny.model.config)
    assert target(store, "tiny-llama").params == P                  # from the config, without the weights
    steps = 2 * 8 * (1 + forecast.BATCH_ROW)                                # 2 batches of 2 rows x 8 new tokens
    rule = steps * P * forecast.DECODE_S + (plan.prompt_tokens + plan.response_tokens) * P * forecast.FORWARD_S
    load, capturing = before.parts                                          # the load counts too (issue 51)
    assert load.what == "loading the model" and load.seconds == pytest.approx(P * forecast.LOAD_S)
    assert capturing.seconds == pytest.approx(rule) and before.bytes == plan.total
    assert before.seconds == pytest.approx(load.seconds + rule)
    line = before.line()
    assert line.startswith("Estimate before the capture starts: under a second") and f"up to {fmt.size(plan.total)} stored" in line
    assert "4 conversations, up to 8 answer tokens each" in line and "rule of thumb for" in line
    assert "M parameters" in line
    again = forecast.capture(store, "tiny-llama", plan, 2)                  # the same capture: the time it took
    assert again.parts[-1].seconds == pytest.approx(done.result.seconds)
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
    t = target(store, "tiny-llama")
    answers = 3 * 10 * (1 + 3 * forecast.BATCH_ROW) * t.params * forecast.DECODE_S     # 3 batches of 4, 10 steps
    training = 600 * forecast.row_rule(t, [[1, 2], [0, 3]], o, online=True)
    load = t.params * forecast.LOAD_S
    assert [p.seconds for p in before.parts] == pytest.approx([load, answers, training])
    assert before.seconds == pytest.approx(load + answers + training)
    line = before.line()
    assert "the target's answers to 12 conversations, up to 10 tokens each" in line
    assert "training 2 drafts on 600 tokens" in line and "stored" in line
    a = [p for p in seen if isinstance(p, ResponsesProgress)][-1]
    trained = [p for p in seen if isinstance(p, TrainProgress)][-1]
    after = forecast.online(store, "tiny-llama", [[1, 2], [0, 3]], o)
    # 10 of the 12 prompts fit max_prompt_tokens, and every answer is stored now: none to write
    assert a.prompts == 10 and after.parts[1].seconds == 0
    assert "the target's answers to 0 conversations" in after.line() and "10 stored" in after.line()
    assert after.parts[2].seconds == pytest.approx(600 / trained.tokens_per_s)
    assert "online training of tiny-llama measured here" in after.line()
    # a larger draw of the same settings: the 10 stored are not written again; 14 more (4 batches of 4, where the
    # run wrote 3) at the pace the run measured
    more = forecast.online(store, "tiny-llama", [[1, 2], [0, 3]], dataclasses.replace(o, limit=24))
    assert "the target's answers to 14 conversations" in more.line() and "10 stored" in more.line()
    assert more.parts[1].seconds == pytest.approx(a.elapsed_s * 4 / 3)
    assert "answer writing of tiny-llama measured here" in more.line()
    other = forecast.online(store, "tiny-llama", [[1, 2], [0, 3]], dataclasses.replace(o, max_new_tokens=11))
    assert "the target's answers to 12 conversations" in other.line() and "stored" not in other.parts[1].what


def test_a_stopped_online_training_still_leaves_its_pace(tiny, store):
    """The 1.5B study's training runs for hours over several sessions and is stopped each time: its measured pace
    (60-80 tokens/s) never reached the next estimate, which kept its rule of thumb (33 h for 4 h of work)."""
    o = OnlineOptions(prompts="builtin", limit=12, max_new_tokens=10, batch_size=3, seq_len=64, gen_batch_size=4,
                      val_conversations=2, eval_points=2, draft_vocab=64, tokens=6000)
    seen = []
    with pytest.raises(TrainingCancelled):
        workflow.train_online(store, "tiny-llama", [[1, 2]], o, load=loader(tiny), progress=seen.append,
                              should_stop=lambda: sum(isinstance(p, TrainProgress) for p in seen) >= 3)
    trained = [p for p in seen if isinstance(p, TrainProgress)][-1]
    after = forecast.online(store, "tiny-llama", [[1, 2]], o)
    assert "online training of tiny-llama measured here" in after.line()
    assert after.parts[-1].seconds == pytest.approx(6000 / trained.tokens_per_s)

def test_a_study_is_its_drafts_training_and_its_benchmark(store):
    """The study's estimate adds up what its parts' estimates say: one model load, each draft's training from the
    capture and one benchmark of its drafts against plain decoding (its cost curve included)."""
    o = StudyOptions(train=TrainOptions(steps=5, batch_size=2, seq_len=32), limit=3, max_new_tokens=8, k=2)
    study = forecast.study(store, "tiny-llama", o, sets=3)
    draft = forecast.training(store, "tiny-llama", [0, 1], o.train)
    bench = forecast.bench(store, "tiny-llama", 3, o.bench_options())
    load = draft.parts[0].seconds
    assert [p.what for p in bench.parts][:2] == ["loading the model", "measuring the cost curve (once per machine and model)"]
    assert study.seconds == pytest.approx(3 * (draft.seconds - load) + bench.seconds)
    assert bench.bytes == 0 and "up to 96 tokens decoded (3 prompts x 8 tokens x each decoder)" in bench.line()
    assert study.bytes >= 3 * draft.bytes and "training 3 drafts" in study.line()
    # once the plan is known: what is left, and what the outcomes folder gave back without training
    # (the model is loaded by then)
    assert forecast.study(store, "tiny-llama", o, left=(3, 1, 0)).seconds == pytest.approx(study.seconds - load)
    left = forecast.study(store, "tiny-llama", o, left=(1, 1, 2))
    one = forecast.bench(store, "tiny-llama", 1, o.bench_options(), held=True)
    assert left.seconds == pytest.approx(draft.seconds - load + one.seconds)
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


ALWAYS_BUSY = MachineOptions(max_others_cpu=0.0, before_s=0.1, interval_s=0.2)     # the machine beside a training job


def test_a_benchmark_estimate_counts_every_phase_and_measures_the_cost_curve_once(tiny, store, tmp_path, monkeypatch):
    """Issue 51: a benchmark estimated at 'about 69 s' took 9 min 25 s: the cost curve (4 min, no time left shown),
    the calibration for K = auto (3 min) and the load were left out, and a second run measured the cost curve again
    (only a quiet curve was read back; the machine was busy). Here each phase is planted slow; the estimate names
    every one, the cost curve shows its time left, and the next estimate goes at the pace each phase measured."""
    monkeypatch.setattr(eta, "MIN_SECONDS", 0.0)
    path = save_draft(tmp_path / "low", untrained_draft(tiny.model, layers=(1, 2)),
                      {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec})
    curves, real_target, real_calibrate = [], costmodel.measure_target, costmodel.calibrate

    def slow_curve(*a, **kw):
        curves.append(1)
        time.sleep(0.4)
        return real_target(*a, **kw)

    def slow_calibration(*a, **kw):
        time.sleep(0.3)
        return real_calibrate(*a, **kw)

    def slow_load(spec, store):
        time.sleep(0.3)
        return tiny
    monkeypatch.setattr(costmodel, "measure_target", slow_curve)
    monkeypatch.setattr(costmodel, "calibrate", slow_calibration)
    o = BenchOptions(model="tiny-llama", prompts="builtin", limit=2, max_new_tokens=4, ks=(), auto_k=True,
                     auto_even_if_slower=True, peers=False, machine=ALWAYS_BUSY)
    before = forecast.bench(store, "tiny-llama", 1, o)
    whats = [p.what for p in before.parts]
    assert len(whats) == 4 and whats[0] == "loading the model" and whats[1].startswith("measuring the cost curve")
    assert whats[2].startswith("the calibration for K = auto (8 prompts") and "tokens decoded" in whats[3]
    assert before.seconds == pytest.approx(sum(p.seconds for p in before.parts))
    seen = []
    first = workflow.bench([("low", path)], o, store, load=slow_load, progress=seen.append)
    assert any(p.phase == "cost curve" and p.eta_s is not None for p in seen)          # its time left, shown
    assert first.report.cost_curve_machine["quiet"] is False
    after = forecast.bench(store, "tiny-llama", 1, o)
    load, curve, calibration, decoding = after.parts
    assert load.seconds >= 0.3 and "the last load of tiny-llama measured here" in load.source
    assert curve.seconds >= 0.4 and "measured on a busy machine before" in curve.what
    assert calibration.seconds >= 0.3 and "the last calibration of tiny-llama measured here" in calibration.source
    assert "the last benchmark of tiny-llama measured here" in decoding.source
    assert after.seconds >= 1.0 and after.seconds == pytest.approx(sum(p.seconds for p in after.parts))
    again = workflow.bench([("low", path)], o, store, load=slow_load)                   # still busy: read back
    assert len(curves) == 1 and again.report.cost_curve_machine["quiet"] is False
    assert "cost curve: busy" in bench.format_table(again.report)


def test_an_estimate_under_a_second_never_reads_about_0_0_s(store):
    """tiny-llama's estimate read 'about 0.0 s'."""
    f = forecast.Forecast("capture", 0.02, 100, [forecast.Part("4 conversations", 0.02, "by a rule")])
    assert "under a second" in f.line() and "0.0 s" not in f.line()
    rule = forecast.bench(store, "tiny-llama", 0, BenchOptions(limit=1, peers=False)).line()
    assert "rule of thumb" in rule and "layerscope/steps/forecast.py" not in rule       # a user reads no source paths
    assert forecast.about(0.4) == "under a second" and forecast.about(72) == "about 72 s"
    assert eta.text(0.04) == "under a second left" and eta.text(72) == "about 72 s left"


def small_gguf(path, tied=True):
    """A GGUF file with a llama header and two small tensors (no output.weight: tied embeddings)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in [("block_count", 3), ("embedding_length", 64), ("feed_forward_length", 128),
                        ("attention.head_count", 4), ("attention.head_count_kv", 2), ("context_length", 512)]:
        (w.add_uint32 if name != "context_length" else w.add_uint64)(f"llama.{name}", value)
    w.add_token_list([f"t{i}" for i in range(300)])
    w.add_chat_template("<|user|>{{ messages[0]['content'] }}<|assistant|>")
    w.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((300, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_first_capture_of_a_gguf_is_estimated_from_its_header(store, tmp_path):
    """Issue 51: the first capture of each model showed no estimate ('The estimate needs the model's config…'): a
    GGUF not de-quantized yet had no config to read. Its header has it, read without the tensors, also from the parts
    an alias ships in."""
    from layerscope.prompts.sets import load_prompts
    from layerscope.steps import preflight
    from layerscope.target import ggufhead

    path = small_gguf(tmp_path / "m.gguf")
    shape = target_shape(str(path), store)
    assert shape is not None and (shape.num_hidden_layers, shape.hidden_size, shape.vocab_size) == (3, 64, 300)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.tie_word_embeddings) == (4, 2, True)
    untied = small_gguf(tmp_path / "untied.gguf", tied=False)
    assert ggufhead.config([untied]).tie_word_embeddings is False
    data = path.read_bytes()                                    # the same file shipped in three parts
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(data[i * 200:(i + 1) * 200] if i < 2 else data[400:])
    assert vars(ggufhead.config(parts)) == vars(shape)
    assert forecast.first_load(store, str(path))
    prompts = load_prompts("builtin", limit=4, seed=0).prompts
    plan = preflight.capture_estimate(store, str(path), prompts, CaptureOptions(limit=4, max_new_tokens=8))
    f = forecast.capture(store, str(path), plan, 8)
    assert f.seconds is not None and f.parts[0].what.startswith("loading the model, its GGUF file de-quantized")


def test_a_capture_estimate_before_the_model_loads_is_an_upper_bound(tiny, store):
    """Issue 51: 'at most 732 stored' became 902 tokens (SmolLM2's chat template) and 2,365 (tiny-llama's byte
    tokenizer): the prompts were counted as characters / 4 without their template. The bound before tokenizing holds."""
    from layerscope.capture import size
    from layerscope.prompts.sets import chat_ids, load_prompts
    from layerscope.steps import preflight

    o = CaptureOptions(limit=6, max_new_tokens=8, batch_size=2)
    prompts = load_prompts("builtin", limit=6, seed=0).prompts
    before = preflight.capture_estimate(store, "tiny-llama", prompts, o)
    exact = size.estimate([len(chat_ids(tiny.tokenizer, p)) for p in prompts], 8, tiny.num_layers, tiny.hidden_size,
                          batch_size=2)
    assert exact.tokens <= before.tokens and exact.total <= before.total and not before.prompts_exact
    assert f"at most {fmt.count(before.prompt_tokens)} prompt (at most: the bytes of the text" in before.lines()[1]


def test_stored_answers_are_read_from_the_store_only_and_bounded(store, tmp_path):
    """What the estimate reads of responses/ is input: a link leaving the store is not followed, an about.json that
    is damaged, too large or holds a malformed count reads as none, and only the part files' names count."""
    o = OnlineOptions(prompts="builtin", limit=12, max_new_tokens=10, gen_batch_size=4)
    about = {"model": "tiny-llama", "target": "t", **responses.draw_settings(o)}

    def draw(root, parts, **extra):
        root.mkdir(parents=True)
        (root / "about.json").write_text(json.dumps({**about, **extra}))
        for start, end in parts:
            (root / responses.part_name(start, end)).write_text("{}")

    base = store.root / "responses"
    draw(base / "a", [(0, 4), (4, 8)], fitting={"12": 10})
    assert responses.stored_draw(store, "tiny-llama", o, 12) == (2, 8)       # 10 of the 12 fit, 8 answered
    outside = tmp_path / "elsewhere"
    draw(outside, [(0, 4), (4, 8), (8, 12)])
    (base / "b").symlink_to(outside)
    assert responses.stored_draw(store, "tiny-llama", o, 12) == (2, 8)       # the link is not read
    draw(base / "c", [(0, 4), (4, 8), (8, 12)], fitting={"12": "ten"})
    assert responses.stored_draw(store, "tiny-llama", o, 12) == (0, 12)      # a malformed count: the draw's size
    (base / "c" / "about.json").write_text(" " * (responses.ABOUT_MAX_BYTES + 1) + "{}")
    (base / "a" / "about.json").write_text("{not json")
    assert responses.stored_draw(store, "tiny-llama", o, 12) == (12, 0)      # nothing readable: everything to write
