"""The shape of a session document: a small schema language, the limits, and the schemas themselves.

A spec is a type name ("int", "num", "bool", "str", "name", "key", "id", "json"), ("opt", spec) for a value
that may be null, ("req", spec) for an object field that must be present, ("text", max) a string of at most
max characters, ("range", lo, hi) an integer in lo..hi, ("enum", a, b, ...) one of those strings,
("either", spec, spec), ("list", spec, max), ("map", spec) (string keys), or ("obj", {field: spec}, strict):
known fields typed, other fields refused (strict) or only bounded as JSON (records written by newer code).

`problem(value, spec, where)` says what is wrong with a value, naming the field, or None when it fits.
SCHEMA is the whole `session` object of session.json (every field a page reads); the archive's list of
drafts has its own (archive.py). Where a schema would only restate a dataclass's fields (AnalysisOptions, a
study's StudyRow), it is derived from the dataclass.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import fields

from layerscope.stats.analysis import AnalysisOptions
from layerscope.store import KEY_RE
from layerscope.study.run import StudyRow

ID_RE = re.compile(r"[0-9a-f]{12}")           # matched in full (re.fullmatch): no trailing newline
NAME_MAX = 120
TEXT_MAX = 4096                               # any other string field
NOTES_MAX = 100_000
LIST_MAX = 1000                               # layer sets, drafts, benchmark runs, rows of one result
STUDY_MAX = 100
MAX_LAYERS = 10_000
JSON_DEPTH_MAX = 12
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def valid_id(sid) -> bool:
    return isinstance(sid, str) and bool(ID_RE.fullmatch(sid))


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------------------- the language

def opt(spec):
    return ("opt", spec)


def req(spec):
    return ("req", spec)


def json_ok(v, depth: int = 0) -> bool:
    """Plain bounded JSON: finite numbers, strings up to NOTES_MAX, keys up to TEXT_MAX, at most 12 levels deep."""
    if depth > JSON_DEPTH_MAX:
        return False
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return math.isfinite(v)
    if isinstance(v, str):
        return len(v) <= NOTES_MAX
    if isinstance(v, list):
        return all(json_ok(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and len(k) <= TEXT_MAX and json_ok(x, depth + 1) for k, x in v.items())
    return False


TYPES = {       # type name -> (test, what a value must be)
    "int": (lambda v: is_int(v) and abs(v) <= 2**53, "must be an integer"),
    "num": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "must be a finite number"),
    "bool": (lambda v: isinstance(v, bool), "must be true or false"),
    "str": (lambda v: isinstance(v, str) and len(v) <= TEXT_MAX, f"must be a string of at most {TEXT_MAX} characters"),
    "name": (lambda v: isinstance(v, str) and 0 < len(v.strip()) <= NAME_MAX and not CONTROL.search(v),
             f"must be 1..{NAME_MAX} characters on one line"),
    "key": (lambda v: isinstance(v, str) and KEY_RE.fullmatch(v) is not None,
            "must be a capture key (24 lowercase hex characters)"),
    "id": (valid_id, "must be 12 lowercase hex characters"),
    "json": (json_ok, "holds a value that is not plain JSON"),
}


def problem(v, spec, where: str) -> str | None:
    """None when `v` fits `spec`, else what is wrong (naming the field)."""
    if isinstance(spec, str):
        test, must = TYPES[spec]
        return None if test(v) else f"{where} {must}"
    kind = spec[0]
    if kind == "opt":
        return None if v is None else problem(v, spec[1], where)
    if kind == "req":
        return problem(v, spec[1], where)
    if kind == "text":
        return None if isinstance(v, str) and len(v) <= spec[1] else f"{where} must be a string of at most {spec[1]} characters"
    if kind == "range":
        return None if is_int(v) and spec[1] <= v <= spec[2] else f"{where} must be an integer in {spec[1]}..{spec[2]}"
    if kind == "enum":
        return None if isinstance(v, str) and v in spec[1:] else f"{where} must be one of {list(spec[1:])}"
    if kind == "either":
        first = problem(v, spec[1], where)
        return first if first is None else problem(v, spec[2], where)
    if kind == "list":
        if not isinstance(v, list) or len(v) > spec[2]:
            return f"{where} must be a list of at most {spec[2]} items"
        for i, x in enumerate(v):
            found = problem(x, spec[1], f"{where}[{i}]")
            if found:
                return found
        return None
    if kind == "map":
        if not isinstance(v, dict) or len(v) > LIST_MAX:
            return f"{where} must be an object of at most {LIST_MAX} fields"
        for k, x in v.items():
            found = problem(x, spec[1], f"{where}.{k}"[:200])
            if found:
                return found
        return None
    if kind == "obj":
        known, strict = spec[1], spec[2]
        if not isinstance(v, dict):
            return f"{where} must be an object"
        for k, s in known.items():
            if k not in v:
                if isinstance(s, tuple) and s[0] == "req":
                    return f"{where}.{k} is missing"
                continue
            found = problem(v[k], s, f"{where}.{k}")
            if found:
                return found
        extra = sorted(set(v) - set(known))
        if extra and strict:
            return f"{where} has unknown fields {[e[:40] for e in extra[:5]]}"
        for k in extra:
            if not (len(k) <= TEXT_MAX and json_ok(v[k])):
                return f"{where}.{k[:40]} holds a value that is not plain JSON"
        return None
    raise AssertionError(f"unknown schema spec {spec!r}")


SCALARS = {float: "num", int: "int", bool: "bool", str: "str"}


def dataclass_fields(cls, *, nan_null: bool = False, required: tuple[str, ...] = (), shapes: dict | None = None) -> dict:
    """{field: spec} of a dataclass, from its fields' types: `float` is "num" (("opt", "num") with `nan_null`: a
    record whose NaN is written as null), `int` "int", `bool` "bool", `str` "str", `X | None` ("opt", X);
    `list[int]` a layer list (MAX_LAYERS), `list[float]` NUMS (a field named *_ci: an interval, CI), any other
    `list[X]` LIST_MAX of X, `dict` ("map", "json"). `shapes`: the spec of a field whose type says less than the
    schema needs; `required` fields must be present."""
    hints = typing.get_type_hints(cls)
    out = {f.name: _spec(hints[f.name], f.name, nan_null) for f in fields(cls)}
    for name, spec in (shapes or {}).items():
        assert name in out, f"{cls.__name__} has no field {name!r}"
        out[name] = spec
    for name in required:
        assert name in out, f"{cls.__name__} has no field {name!r}"
        out[name] = req(out[name])
    return out


def _spec(t, name: str, nan_null: bool):
    args = typing.get_args(t)
    if type(None) in args:
        (t,) = [a for a in args if a is not type(None)]
        spec = _spec(t, name, nan_null)
        return spec if isinstance(spec, tuple) and spec[0] == "opt" else opt(spec)
    if typing.get_origin(t) is list:
        (item,) = args
        if item is int:
            return ("list", "int", MAX_LAYERS)
        if item is float:
            return CI if name.endswith("_ci") else NUMS
        return ("list", _spec(item, name, nan_null), LIST_MAX)
    if t is dict or typing.get_origin(t) is dict:
        return ("map", "json")
    if t is float and nan_null:
        return opt("num")
    return SCALARS[t]


# ---------------------------------------------------------------------------- the schemas

NUMS = ("list", opt("num"), 100_000)        # null where a value is undefined (NaN is written as null)
PAIRS = ("list", ("list", "int", 2), 64)
CI = ("list", opt("num"), 2)                # an interval [lo, hi]
CAPTURE_SCHEMA = ("obj", {
    "key": opt("key"), "model": opt("str"), "num_layers": opt(("range", 1, MAX_LAYERS)),
    "hidden_size": opt(("range", 1, 10**6)), "tokens": opt(("range", 0, 10**13)),
    "conversations": opt(("range", 0, 10**9)), "prompt_set": opt("str"), "created": opt("str"),
    "seconds": opt("num"), "fingerprint": opt("str"), "size_bytes": opt("int"), "problem": opt("str"),
}, False)
ANALYSIS_SCHEMA = ("obj", dataclass_fields(AnalysisOptions), True)
STATS_SCHEMA = ("obj", {     # LayerStats.to_dict() less its arrays; every field optional (older snapshots lack some)
    "capture_key": opt("str"), "num_layers": opt(("range", 1, MAX_LAYERS)), "hidden_size": opt("int"),
    "alpha": opt("num"), "tokens_total": opt("int"), "tokens_kept": opt("int"), "outliers_dropped": opt("int"),
    "prompts_used": opt("int"), "threshold": opt("num"), "compartments": opt(PAIRS),
    "compartments_by_k": opt(("map", PAIRS)), "tokens": opt(("map", "json")), "options": opt(("map", "json")),
    "requested": opt(("map", "json")), "final_state": opt("str"), "model": opt("str"), "cka_route": opt("str"),
    "key": opt("str"), "seconds": opt("num"), "version": opt("int"), "sample_positions": opt("int"),
}, False)
LAYER_SET_SCHEMA = ("obj", {"name": req("name"), "layers": req("json"), "strategy": opt("str")}, True)
DRAFT_SCHEMA = ("obj", {
    "name": opt("str"), "path": req("str"), "layers": req("json"), "strategy": opt("str"),
    "val_accuracy": opt(("either", "num", NUMS)), "steps": opt("int"), "target_fingerprint": opt("str"),
    "capture_key": opt("str"), "seconds": opt("num"),
}, False)
BENCH_ROW_SCHEMA = ("obj", {
    "name": req("str"), "layers": opt(("list", "int", MAX_LAYERS)), "decoding": opt("str"), "tau": opt("num"),
    "acceptance_by_position": opt(NUMS), "tokens_per_s": opt("num"), "speedup": opt("num"),
    "lossless": opt("bool"),
    "by_category": opt(("map", ("obj", {"tau": opt("num"), "tokens_per_s": opt("num"), "speedup": opt("num")},
                                 False))),
    # bench.add_intervals: per-prompt totals and bootstrap intervals over the prompts (absent in older results)
    "per_prompt": opt(("map", ("list", "num", 100_000))), "tau_ci": opt(CI), "speedup_ci": opt(CI),
    "acceptance": opt("num"), "acceptance_ci": opt(CI),
    "spec_decode": opt(("obj", {"num_drafts": opt("int"), "num_draft_tokens": opt("int"),     # vLLM's names
                                "num_accepted_tokens": opt("int"), "num_accepted_tokens_per_pos": opt(("list", "int", 1000)),
                                "mean_acceptance_length": opt("num")}, False)),
    "paired": opt(("obj", {"vs": req("str"), **{m: opt(("obj", {"delta": opt("num"), "ci": opt(CI)}, False))
                                                  for m in ("tau", "speedup", "acceptance")}}, False)),
}, False)
BENCH_SCHEMA = ("obj", {
    "prompts": opt("int"), "prompt_set": opt("str"), "max_new_tokens": opt("int"), "device": opt("str"),
    "created": opt("str"), "results": opt(("list", BENCH_ROW_SCHEMA, LIST_MAX)), "warnings": opt(("list", "str", 100)),
    "intervals": opt(("obj", {"level": opt("num"), "draws": opt("int"), "over": opt("str"), "prompts": opt("int"),
                               "reference": opt("str")}, False)),
    # the older flat form: one contender per entry
    "name": opt("str"), "tau": opt("num"), "acceptance_by_position": opt(NUMS),
}, False)
STUDY_ROW_SCHEMA = ("obj", dataclass_fields(    # StudyRow.to_json(): every field typed as the dataclass declares it
    StudyRow, nan_null=True,
    required=("layers", "strategies", "draft", "mean_entropy", "mean_cka", "aggregate_entropy"),   # read without a default
    shapes={"val_accuracy": opt(("either", "num", NUMS))}), False)                               # older rows: one number
STUDY_SCHEMA = ("obj", {
    "rows": req(("list", STUDY_ROW_SCHEMA, LIST_MAX)), "prompts": req("int"), "device": opt("str"),
    "verdict": opt("str"),
    "options": opt(("obj", {"train": opt(("map", "json")), "prompts": opt("str"), "max_new_tokens": opt("int"),
                             "depth": opt("int")}, False)),
    "correlations": opt(("list", ("obj", {"proxy": req("str"), "version": req("str"), "rho": req(opt("num")),
                                           "ci": opt(CI)}, False), LIST_MAX)),
    "best_proxies": opt(("map", "json")), "spearman": opt(("map", opt("num"))),
}, False)
VIEW_SCHEMA = ("obj", {      # the app's widget choices: exactly the values its widgets accept
    "entropy_scale": ("enum", "raw (nats)", "normalized"), "entropy_levels": ("list", ("enum", "dataset", "prompt"), 2),
    "entropy_compare": "bool", "cka_estimator": ("enum", "biased", "debiased"),
    "cka_compartments": ("range", 1, 64), "bench_run": ("range", 0, LIST_MAX),
}, False)
SCHEMA = ("obj", {           # one spec per Session field (model.py checks that the two agree)
    "id": req("id"), "name": opt("name"), "model": opt("str"), "prompt_set": opt("str"), "capture_key": opt("key"),
    "capture": CAPTURE_SCHEMA, "analysis_options": ANALYSIS_SCHEMA, "stats": STATS_SCHEMA,
    "layer_sets": ("list", LAYER_SET_SCHEMA, LIST_MAX), "manual_picks": ("list", "int", MAX_LAYERS),
    "drafts": ("list", DRAFT_SCHEMA, LIST_MAX), "bench_results": ("list", BENCH_SCHEMA, LIST_MAX),
    "study": ("list", STUDY_SCHEMA, STUDY_MAX), "device": opt("str"), "notes": ("text", NOTES_MAX),
    "created": opt("str"), "updated": opt("str"), "view": VIEW_SCHEMA,
    "owner": opt("key"), "frozen": "bool", "origin": opt("id"),
}, True)
SESSION_FIELDS = tuple(SCHEMA[1])

