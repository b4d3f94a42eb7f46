"""The target's dtype, float32 or bfloat16, chosen by measurement (layerscope/target/precision.py), and printed with every
benchmark; the classic small-model peer (bench --assistant) and how a benchmark counts outputs that differ."""

from __future__ import annotations

import json

import pytest
import torch

from layerscope.decoding import bench
from layerscope.decoding.bench import BenchOptions
from layerscope.errors import LayerScopeError, ModelSpecError
from layerscope.prompts.sets import load_prompts
from layerscope.target import precision
from layerscope.target.load import load_model, tiny_model


def test_bfloat16_where_it_is_faster_at_many_rows_and_no_slower_at_one():
    assert precision.decide({1: 2.9, 16: 3.4, 256: 5.1}).dtype == torch.bfloat16
    slow_prefill = precision.decide({1: 1.13, 16: 1.11, 256: 0.63})           # measured on a Xeon without AMX
    assert slow_prefill.dtype == torch.float32
    assert slow_prefill.why == ("float32: bfloat16 measured 1.13x/1.11x/0.63x its speed here (1/16/256 rows; "
                                "bfloat16 needs 0.95x at one row and 1.10x at more)")
    amx = precision.decide({1: 1.09, 16: 2.86, 256: 2.94})                   # measured on an AMX Xeon (1.5B's MLP)
    assert amx.dtype == torch.bfloat16 and amx.why == ("bfloat16: measured 1.09x/2.86x/2.94x the speed of float32 "
                                                       "here (1/16/256 rows)")
    assert precision.decide({1: 0.94, 16: 2.0, 256: 2.0}).dtype == torch.float32     # slower at one row
    assert precision.decide({1: 1.5, 16: 1.09, 256: 2.0}).dtype == torch.float32     # just under WIN at 16


def test_the_environment_decides_first_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.setenv(precision.ENV, "bfloat16")
    assert precision.choose(torch.device("cpu"), 64, 128) == precision.Choice(torch.bfloat16, "bfloat16: LAYERSCOPE_DTYPE=bfloat16")
    monkeypatch.setenv(precision.ENV, "fp8")
    with pytest.raises(ModelSpecError, match="LAYERSCOPE_DTYPE='fp8' is not a dtype") as err:
        precision.choose(torch.device("cpu"), 64, 128)
    assert "auto, float32 or bfloat16" in err.value.fix
    monkeypatch.setenv(precision.ENV, "auto")
    assert precision.choose(torch.device("cuda"), 64, 128).dtype == torch.bfloat16       # no measurement on CUDA


def test_a_measurement_is_kept_in_the_store_per_machine_and_shape(monkeypatch, tmp_path):
    monkeypatch.setenv(precision.ENV, "auto")
    calls = []
    monkeypatch.setattr(precision, "measure", lambda d, ff: calls.append((d, ff)) or {1: 2.0, 16: 2.0, 256: 2.0})
    assert precision.choose(torch.device("cpu"), 64, 128, tmp_path).dtype == torch.bfloat16
    assert precision.choose(torch.device("cpu"), 64, 128, tmp_path).dtype == torch.bfloat16   # read back
    assert calls == [(64, 128)]
    precision.choose(torch.device("cpu"), 96, 128, tmp_path)                                  # another shape
    assert calls == [(64, 128), (96, 128)]
    (tmp_path / precision.MEMO).write_text("{not json")                                       # damaged: measured again
    precision.choose(torch.device("cpu"), 64, 128, tmp_path)
    assert len(calls) == 3 and set(json.loads((tmp_path / precision.MEMO).read_text())) == {precision.machine_id(64, 128)}


def test_measure_times_both_dtypes_at_each_row_count():
    ratios = precision.measure(32, 64, rows=(1, 4), repeats=1)
    assert set(ratios) == {1, 4} and all(r > 0 for r in ratios.values())


def test_a_slow_spell_of_the_machine_does_not_move_the_measured_ratio(monkeypatch):
    # a fake clock: float32 costs 3 units a product and bfloat16 1, but products 16..87 (the warm-up is 0..15) run
    # 4x slower, the length of all nine float32 timings timed back to back: rounds that time both dtypes together
    # see the spell on both sides, and their median ratio stays 3.0
    clock, calls = [0.0], [0]

    def linear(x, w):
        clock[0] += (3.0 if x.dtype == torch.float32 else 1.0) * (4.0 if 16 <= calls[0] < 88 else 1.0)
        calls[0] += 1

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(precision.time, "perf_counter", lambda: clock[0])
    assert precision.measure(32, 64, rows=(1,), repeats=9) == {1: 3.0}
    assert calls[0] == 8 * 2 * (1 + 9)                     # 8 matrices, both dtypes, a warm-up and nine rounds


def test_a_model_directory_loads_in_the_dtype_asked_and_says_why(tmp_path, monkeypatch):
    tiny = tiny_model()
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.setenv(precision.ENV, "bfloat16")
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.dtype == torch.bfloat16 and next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.dtype_why == "bfloat16: LAYERSCOPE_DTYPE=bfloat16"


# ----------------------------------------------------------------------------- the benchmark's side


def _report(target, assistant, limit=2, new=12):
    o = BenchOptions(model="tiny-llama", prompts="builtin", limit=limit, max_new_tokens=new, peers=False)
    _, prompts = bench.fitting_prompts(target.tokenizer, o)
    contenders = bench.contenders_for([], o, assistant)
    return bench.measure(target, prompts, contenders, new, warmup=False)


def test_hf_assisted_with_the_target_itself_as_assistant_is_lossless_and_accepts(one_thread):
    target, same = tiny_model(), tiny_model()
    report = _report(target, same)
    entry = {r["name"]: r for r in report.results}["hf-assisted"]
    assert entry["lossless"] and entry["mismatched"] == 0 and entry["tau"] > 1.0
    assert report.dtype == "float32"
    assert "target in float32" in bench.format_table(report)


def test_an_assistant_with_another_tokenizer_is_refused_in_one_line(smollm2):
    with pytest.raises(LayerScopeError, match="has another tokenizer than the target tiny-llama") as err:
        bench.check_assistant(tiny_model(), smollm2)
    assert "\n" not in str(err.value) and "qwen2.5-coder-0.5b" in err.value.fix


def test_a_benchmark_counts_the_prompts_whose_output_differs(one_thread, monkeypatch):
    """A planted peer that returns other tokens than plain decoding is counted prompt by prompt, and said so."""
    target, real = tiny_model(), bench._decode
    prompts = bench.encode(target.tokenizer, load_prompts("builtin", limit=3, seed=0))

    def wrong(model, c, ids, new, eos, pad):
        if c.kind == "hf-generate":
            yield [1] * new, new, 0.01
        else:
            yield from real(model, c, ids, new, eos, pad)
    monkeypatch.setattr(bench, "_decode", wrong)
    contenders = [bench.Contender("autoregressive", "autoregressive", "greedy"),
                  bench.Contender("hf-generate", "hf-generate", "greedy")]
    *_, last = bench.run(target.model, prompts, contenders, max_new_tokens=6, warmup=False)
    entry = last.report.results[1]
    assert not entry["lossless"] and entry["mismatched"] == 3
    assert bench.lossless_text(entry, 3) == "NO (3 of 3 prompts differ from autoregressive)"
    assert bench.lossless_text(last.report.results[0], 3) == "yes"


def test_transformers_speculative_peers_are_checked_against_transformers_plain_generate(one_thread, monkeypatch):
    """hf-prompt-lookup equals hf-generate (its own plain decoding) but both differ from LayerScope's: the peer is
    lossless, hf-generate is counted; a peer that differs from hf-generate is counted."""
    target, real = tiny_model(), bench._decode
    prompts = bench.encode(target.tokenizer, load_prompts("builtin", limit=2, seed=0))

    def hf_apart(model, c, ids, new, eos, pad):
        if c.kind == "hf-generate" or c.kind == "hf-prompt-lookup":
            yield [1] * new, new, 0.01
        elif c.kind == "hf-assisted":
            yield [2] * new, new, 0.01
        else:
            yield from real(model, c, ids, new, eos, pad)
    monkeypatch.setattr(bench, "_decode", hf_apart)
    contenders = [bench.Contender("autoregressive", "autoregressive", "greedy"),
                  bench.Contender("hf-generate", "hf-generate", "greedy"),
                  bench.Contender("hf-prompt-lookup", "hf-prompt-lookup", "prompt lookup n=4"),
                  bench.Contender("hf-assisted", "hf-assisted", "assistant x")]
    *_, last = bench.run(target.model, prompts, contenders, max_new_tokens=5, warmup=False)
    lossless = {r["name"]: r["lossless"] for r in last.report.results}
    assert lossless == {"autoregressive": True, "hf-generate": False, "hf-prompt-lookup": True, "hf-assisted": False}
