"""One rule for every numeric option: finite, of the right kind, in range; one error line in the CLI."""

import math

import pytest

from layerscope.capture.run import CaptureOptions
from layerscope.commands import cli
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.errors import CaptureError, DraftError, LayerScopeError, ModelSpecError
from layerscope.target.load import load_model
from layerscope.validate import check_number, parse_count, parse_duration, parse_size, read_number


@pytest.mark.parametrize("value, kw, ok", [
    (1, {"minimum": 1}, True), (0, {"minimum": 1}, False), (0, {"minimum": 0, "above": True}, False),
    (math.nan, {}, False), (math.inf, {}, False), (-math.inf, {"maximum": 0}, False), (True, {}, False),
    ("3", {}, False), (2.5, {"integer": True}, False), (2.0, {}, True), (None, {"optional": True}, True),
    (None, {}, False), (7, {"minimum": 1, "maximum": 5}, False), (5, {"minimum": 1, "maximum": 5}, True),
    (1, {"minimum": 0, "maximum": 1, "below": True}, False), (0.5, {"minimum": 0, "maximum": 1, "below": True}, True),
])
def test_check_number(value, kw, ok):
    if ok:
        assert check_number("x", value, **kw) is value
    else:
        with pytest.raises(LayerScopeError, match="x must be"):
            check_number("x", value, **kw)


def test_budgets_read_as_people_write_them():
    assert parse_count("2M") == 2_000_000 and parse_count("500k") == 500_000 and parse_count("1200") == 1200
    assert parse_duration("45m") == 2700 and parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    for bad in ("", "2X", "-5", "nan"):
        with pytest.raises(LayerScopeError, match="token count"):
            parse_count(bad)
    for bad in ("", "45x", "0", "m"):
        with pytest.raises(LayerScopeError, match="duration"):
            parse_duration(bad)
    assert parse_size("500M") == parse_size("500MB") == 500_000_000 and parse_size("2G") == 2_000_000_000
    assert parse_size("1.5GiB") == 1_610_612_736 and parse_size("64 kib") == 65_536 and parse_size("4096") == 4096
    for bad in ("", "2X", "-5M", "0", "GiB", "1.5 GiBs"):
        with pytest.raises(LayerScopeError, match="size"):
            parse_size(bad)


@pytest.mark.parametrize("typed, integer, problem, fix", [
    ("1e3", True, "'1e3' is not a whole number in digits", "Type 1000"),
    ("2.0", True, "'2.0' is not a whole number in digits", "Type 2"),
    ("1.5", True, "'1.5' is not a whole number", "Type 1 or 2"),
    ("12abc", True, "'12abc' is not a number", "Type a whole number from 1 to 4096"),
    ("", True, "Steps is empty", "Type a whole number from 1 to 4096"),
    ("nan", True, "'nan' is not a number", "Type a whole number from 1 to 4096"),
    ("9" * 5000, True, f"'{'9' * 40}…' is too long for a number", "Type a whole number from 1 to 4096"),
    ("0", True, "Steps must be in [1, 4096] (got 0)", "Type a whole number from 1 to 4096"),
    ("4097", True, "Steps must be in [1, 4096] (got 4097)", "Type a whole number from 1 to 4096"),
    ("1e4", False, "Steps must be in [1, 4096] (got 10000.0)", "Type a number from 1 to 4096"),
    ("inf", False, "'inf' is not a finite number", "Type a number from 1 to 4096"),
    ("two", False, "'two' is not a number", "Type a number from 1 to 4096"),
])
def test_a_typed_number_of_the_wrong_kind_is_refused_saying_what_to_type(typed, integer, problem, fix):
    with pytest.raises(LayerScopeError) as e:
        read_number(typed, "Steps", integer=integer, minimum=1, maximum=4096)
    assert (e.value.problem, e.value.fix) == (problem, fix)


def test_a_typed_number_is_read_as_typed():
    assert read_number("1000", "Steps", minimum=1) == 1000 and read_number(" -3 ", "x") == -3
    assert isinstance(read_number("7", "x"), int)
    assert read_number("1e3", "Rate", integer=False) == 1000.0 and read_number("0.25", "Rate", integer=False) == 0.25
    assert read_number("0", "Seed", minimum=0, maximum=2**31 - 1) == 0


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("limit", 0), ("limit", 2.5),
    ("limit", math.nan), ("max_new_tokens", 0), ("batch_size", -4), ("max_tokens", math.inf), ("seed", 1.5),
    ("max_prompt_tokens", 0), ("skip_long", "yes"), ("sample_positions", 0), ("sample_positions", 2.5),
    ("max_store_bytes", 0), ("max_store_bytes", math.nan),
])
def test_capture_options_refuse_non_finite_and_out_of_range(field, value):
    with pytest.raises(CaptureError, match=field):
        CaptureOptions(**{field: value}).validate()


@pytest.mark.parametrize("options, field, value", [
    (TrainOptions, "steps", math.nan), (TrainOptions, "ttt_steps", 8), (TrainOptions, "ttt_steps", 2.5),
    (TrainOptions, "batch_size", 0), (TrainOptions, "seq_len", 1), (TrainOptions, "draft_vocab", math.nan),
    (TrainOptions, "val_fraction", 1.0), (TrainOptions, "lr", 0.0), (TrainOptions, "lr", math.inf),
    (TrainOptions, "warmup", -1), (TrainOptions, "warm_start", 1.5), (TrainOptions, "eval_points", 0),
    (TrainOptions, "noise_std", math.nan), (TrainOptions, "weight_decay", -1.0),
    (OnlineOptions, "max_new_tokens", 0), (OnlineOptions, "gen_batch_size", 2.5), (OnlineOptions, "data_seed", "0"),
    (OnlineOptions, "checkpoint_every_s", 0.0), (OnlineOptions, "checkpoint_every_s", math.nan),
])
def test_training_options_refuse_non_finite_and_out_of_range(options, field, value):
    with pytest.raises(DraftError, match=field):
        options(**({"steps": 1} | {field: value})).validate()


@pytest.mark.parametrize("argv, match", [
    (["capture", "--limit", "nan"], "argument --limit: invalid int value: 'nan'"),
    (["capture", "--limit", "-3"], "limit must be at least 1"),
    (["capture", "--temperature", "nan"], "argument --temperature: 'nan' is not a finite number"),
    (["capture", "--temperature=-inf"], "argument --temperature: '-inf' is not a finite number"),
    (["capture", "--temperature", "-1"], "temperature must be in [0, 100]"),
    (["capture", "--batch-size", "0"], "batch_size must be in [1, 65536]"),
    (["analyze", "abc", "--min-entropy", "nan"], "argument --min-entropy: 'nan' is not a finite number"),
    (["select", "abc", "--lam", "inf"], "argument --lam: 'inf' is not a finite number"),
    (["capture", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_numeric_options_fail_with_one_line(argv, match, tmp_path, capsys):
    try:
        code = cli.main(argv + ["--store", str(tmp_path / "s")])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and match in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("spec", ["tiny-llama:layers=100000,hidden=100000", "tiny-llama:hidden=33", "tiny-llama:layers=0",
                                  "tiny-llama:layers=nan", "tiny-llama:seed=-1", "tiny-llama:depth=3"])
def test_tiny_model_options_are_checked_before_building(spec):
    with pytest.raises(ModelSpecError, match="tiny-llama"):
        load_model(spec)


def test_the_synthetic_model_reaches_80_and_128_layer_targets():
    for n in (80, 128):
        assert load_model(f"tiny-llama:layers={n},hidden=8").num_layers == n
    with pytest.raises(ModelSpecError, match=r"layers 1\.\.128"):
        load_model("tiny-llama:layers=129,hidden=8")
