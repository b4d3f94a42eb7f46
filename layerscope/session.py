"""Analysis sessions: what a user looked at, saved on disk and shareable, never pickled.

A session names a capture (key and a summary of it), the model spec and prompt set, the analysis
options, the layer sets chosen for testing, the layers hand-picked on the heatmap, trained drafts
and benchmark results. It also carries a snapshot of the layer statistics (per-layer entropy, CKA
matrices) as tensors, so a session imported on another installation shows the same curves and
heatmap even when that installation does not hold the capture.

On disk a session is one archive, ``<store>/sessions/<id>/session.zip``, holding exactly:

    session.json          {"layerscope_session": FORMAT, "session": {...}}   (JSON, UTF-8)
    arrays.safetensors    named float tensors (optional)

An exported archive may also carry the session's drafts (`export_bytes(s, drafts=True)`, format 2):

    drafts/<entry>/config.json, model.safetensors, layers.json, layerscope.json
                          each draft folder's files; session.json lists them under "drafts" with
                          the path the session knew, each file's size and sha256

`import_archive` checks them (names from a fixed set, sizes, checksums, JSON, load_draft), writes each
into the importing store's drafts/ atomically (all or none) and points the session's drafts there.
Stored sessions never hold drafts; a format 1 archive (no drafts) reads as before.

The same archive is the downloadable/shareable file. Loading validates every field and tensor
against one schema (SCHEMA below: types, ranges, sizes, ids matched in full; every field a page
reads) and refuses anything else with a `SessionError`; JSON and safetensors cannot execute code.
Saving checks the archive it is about to write with the same validation, so a session that saves
always loads again, and an imported one always opens.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re
import os
import secrets
import stat
import time
import zipfile
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from layerscope import jsonsafe, layerset
from layerscope.analysis import ARRAY_FIELDS, join_arrays, split_arrays
from layerscope.analysis import AnalysisOptions
from layerscope.draft.export import FILES as DRAFT_FILES
from layerscope.draft.export import load_draft, staged
from layerscope.errors import LayerScopeError, SessionError
from layerscope.store import ENTRY_NAME_RE, KEY_RE, SHA256_RE, atomic_write_bytes, write_error

FORMAT = 2                                    # what this version reads; an archive is written as the lowest it needs
PLAIN_FORMAT = 1                              # no drafts inside (stored sessions, plain exports)
ARCHIVE_NAME = "session.zip"
JSON_MEMBER = "session.json"
ARRAYS_MEMBER = "arrays.safetensors"
MAX_JSON_BYTES = 16 * 2**20
MAX_ARRAYS_BYTES = 256 * 2**20
MAX_ARCHIVE_BYTES = MAX_JSON_BYTES + MAX_ARRAYS_BYTES   # the archive itself (compressed), on import and on save
MAX_DRAFTS_BYTES = 4 * 2**30                  # all draft files of one archive together (uncompressed)
MAX_DRAFT_JSON_BYTES = 4 * 2**20              # each JSON file of a draft
DRAFT_REQUIRED = ("config.json", "model.safetensors")
DRAFT_MEMBER_RE = re.compile(r"drafts/([A-Za-z0-9][A-Za-z0-9_-]{0,127})/(" +
                             "|".join(re.escape(f) for f in DRAFT_FILES) + ")")
ID_RE = re.compile(r"[0-9a-f]{12}")           # matched in full (re.fullmatch): no trailing newline
NAME_MAX = 120
TEXT_MAX = 4096                               # any other string field
NOTES_MAX = 100_000
LIST_MAX = 1000                               # layer sets, drafts, benchmark runs, rows of one result
STUDY_MAX = 100
MAX_LAYERS = 10_000
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Layer statistics that are stored as tensors rather than JSON lists: LayerStats decides which.
ARRAY_KEYS = ARRAY_FIELDS


def new_id() -> str:
    return secrets.token_hex(6)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def valid_id(sid) -> bool:
    return isinstance(sid, str) and bool(ID_RE.fullmatch(sid))


@dataclass
class Session:
    """Everything one analysis consists of. Plain JSON-able fields plus `arrays` (tensors)."""

    id: str = field(default_factory=new_id)
    name: str | None = None                 # set when the user saves it under a name
    model: str | None = None                # model spec, e.g. "smollm2-135m"
    prompt_set: str | None = None           # prompt set name
    capture_key: str | None = None
    capture: dict = field(default_factory=dict)        # manifest summary: tokens, num_layers, hidden_size, ...
    analysis_options: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)          # scalar part of the layer statistics (counts, threshold, ...)
    layer_sets: list[dict] = field(default_factory=list)   # [{"name", "layers", "strategy"}]: sets to test
    manual_picks: list[int] = field(default_factory=list)  # layers picked on the heatmap
    drafts: list[dict] = field(default_factory=list)       # [{"name", "path", "layers", "val_accuracy", ...}]
    bench_results: list[dict] = field(default_factory=list)
    study: list[dict] = field(default_factory=list)
    device: str | None = None
    notes: str = ""
    view: dict = field(default_factory=dict)    # the app's view choices (estimator, kernel, compartments, threshold, run)
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)

    # ------------------------------------------------------------------ convenience
    @property
    def num_layers(self) -> int | None:
        n = self.capture.get("num_layers") if self.capture else None
        return int(n) if n is not None else None

    @property
    def has_stats(self) -> bool:
        return "entropy" in self.arrays and "cka" in self.arrays

    def title(self) -> str:
        return self.name or f"unsaved session {self.id}"

    def set_stats(self, stats: dict) -> None:
        """Keep a snapshot of layer statistics (a LayerStats.to_dict()): arrays as tensors, the rest as JSON."""
        arrays, scalars = split_arrays(stats)
        arrays = {k: v.to(torch.float32) for k, v in arrays.items()}
        self.arrays = {k: v for k, v in self.arrays.items() if k not in ARRAY_KEYS} | arrays
        self.stats = json.loads(json.dumps(scalars, default=_json_default))

    def stats_dict(self) -> dict | None:
        """The statistics snapshot as one plain dict (tensors as lists), or None when there is none."""
        if not self.has_stats:
            return None
        out = join_arrays({k: v for k, v in self.arrays.items() if k in ARRAY_KEYS}, self.stats)
        if out.get("num_layers") is None:      # pages read it; the tensors say it exactly (checked on load)
            out["num_layers"] = int(self.arrays["entropy"].shape[0]) - 1
        return out

    def add_layer_set(self, name: str, layers, strategy: str = "manual") -> dict:
        """Add a set to test (or rename the existing entry with the same layers). Returns the entry."""
        layers = layerset.check(sorted({int(x) for x in layers}), self.num_layers, "Layer set", SessionError)  # repeats merged
        for s in self.layer_sets:
            if s["layers"] == layers:
                s["name"], s["strategy"] = name, strategy
                return s
        entry = {"name": name, "layers": layers, "strategy": strategy}
        self.layer_sets.append(entry)
        return entry

    def remove_layer_set(self, layers) -> None:
        layers = sorted(int(x) for x in layers)
        self.layer_sets = [s for s in self.layer_sets if s["layers"] != layers]

    # ------------------------------------------------------------------ (de)serialisation
    def to_json(self) -> dict:
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "arrays"}
        return _finite(json.loads(json.dumps(body, default=_json_default)))

    def to_bytes(self, drafts: list[dict] | None = None) -> bytes:
        """The session as a zip archive: session.json + arrays.safetensors (format 1); with `drafts`
        (from `draft_files`) also their files under drafts/<entry>/ and their list in session.json (format 2)."""
        doc = {"layerscope_session": FORMAT if drafts else PLAIN_FORMAT, "session": self.to_json()}
        if drafts:
            doc["drafts"] = [{"entry": d["entry"], "path": d["path"],
                              "files": {f: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                                        for f, b in d["files"].items()}} for d in drafts]
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(JSON_MEMBER, json.dumps(doc, indent=1, allow_nan=False))
            if self.arrays:
                tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in self.arrays.items()}
                z.writestr(ARRAYS_MEMBER, save_tensors(tensors, metadata={"layerscope_session": str(PLAIN_FORMAT)}))
            for d in drafts or []:
                for f, b in d["files"].items():
                    z.writestr(f"drafts/{d['entry']}/{f}", b,
                               compress_type=zipfile.ZIP_STORED if f.endswith(".safetensors") else zipfile.ZIP_DEFLATED)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "the file", *, arrays: bool = True) -> "Session":
        """Parse and validate an archive; any problem is a SessionError naming it.

        With arrays=False the tensors are not read (a quick look for listings); the rest is validated.
        """
        doc, tensors, _ = _read_archive(data, source, with_arrays=arrays)
        return _validate(doc, tensors, source)


def _finite(o):
    """JSON has no NaN/inf: they become null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


# ---------------------------------------------------------------------------- validation

def _refuse(source: str, problem: str, fix: str = "Export the session again from LayerScope and import that file"):
    raise SessionError(f"{source} is not a valid LayerScope session: {problem}", fix)


def _outside(name: str) -> bool:
    """A member name that would point outside a folder it were unpacked into."""
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":")


def _read_archive(data: bytes, source: str, with_arrays: bool = True,
                  with_drafts: bool = False) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict[str, bytes]]]:
    """(session.json, tensors, draft files {entry: {file: bytes}}). Draft members are checked by name always
    and read only `with_drafts` (an import); the archive may then be up to MAX_DRAFTS_BYTES larger."""
    if not isinstance(data, (bytes, bytearray)) or not data:
        _refuse(source, "it is empty")
    if len(data) > MAX_ARCHIVE_BYTES + (MAX_DRAFTS_BYTES if with_drafts else 0):
        _refuse(source, f"it is larger than {MAX_ARCHIVE_BYTES >> 20} MiB"
                + (f" plus {MAX_DRAFTS_BYTES >> 20} MiB of drafts" if with_drafts else ""))
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        if data[:1] in (b"{", b"["):
            _refuse(source, "it is a JSON file, not a session archive",
                    "Import the .zip archive that LayerScope's Sessions page downloads")
        _refuse(source, "it is not a zip archive (corrupted or another kind of file)",
                "Import the .zip archive that LayerScope's Sessions page downloads")
    with z:
        names = [i.filename for i in z.infolist()]
        infos = {i.filename: i for i in z.infolist()}
        escaping = [n for n in names if _outside(n)]
        if escaping:
            _refuse(source, f"the member {escaping[0][:200]!r} points outside the archive's folder; nothing was written",
                    "Import only archives LayerScope exported; this one may have been made to overwrite files")
        if len(infos) != len(names):
            _refuse(source, f"the archive holds {next(n for n in names if names.count(n) > 1)[:200]!r} twice")
        drafts = {n: DRAFT_MEMBER_RE.fullmatch(n) for n in names}
        unknown = sorted(n for n in set(infos) - {JSON_MEMBER, ARRAYS_MEMBER} if drafts[n] is None)
        if JSON_MEMBER not in infos:
            _refuse(source, f"the archive has no {JSON_MEMBER}" + (f" (it holds {', '.join(unknown[:5])})" if unknown else ""))
        if unknown:
            _refuse(source, f"the archive holds unexpected files: {', '.join(u[:200] for u in unknown[:5])}")
        if infos[JSON_MEMBER].file_size > MAX_JSON_BYTES:
            _refuse(source, f"{JSON_MEMBER} is larger than {MAX_JSON_BYTES >> 20} MiB")
        if ARRAYS_MEMBER in infos and infos[ARRAYS_MEMBER].file_size > MAX_ARRAYS_BYTES:
            _refuse(source, f"{ARRAYS_MEMBER} is larger than {MAX_ARRAYS_BYTES >> 20} MiB")
        members = {n: m for n, m in drafts.items() if m is not None}
        if not members and len(data) > MAX_ARCHIVE_BYTES:
            _refuse(source, f"it is larger than {MAX_ARCHIVE_BYTES >> 20} MiB")
        if with_drafts:
            if sum(infos[n].file_size for n in members) > MAX_DRAFTS_BYTES:
                _refuse(source, f"its drafts hold more than {MAX_DRAFTS_BYTES >> 20} MiB")
            big = [n for n, m in members.items() if m[2].endswith(".json") and infos[n].file_size > MAX_DRAFT_JSON_BYTES]
            if big:
                _refuse(source, f"{big[0]} is larger than {MAX_DRAFT_JSON_BYTES >> 20} MiB")
        files: dict[str, dict[str, bytes]] = {}
        try:
            raw = z.read(JSON_MEMBER)
            blob = z.read(ARRAYS_MEMBER) if with_arrays and ARRAYS_MEMBER in infos else None
            for n, m in (members.items() if with_drafts else ()):
                files.setdefault(m[1], {})[m[2]] = z.read(n)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
            _refuse(source, f"the archive is corrupted ({e})")
    try:
        doc = jsonsafe.loads(raw, what=JSON_MEMBER, error=SessionError, max_bytes=MAX_JSON_BYTES, allow_nan=False)
    except SessionError as e:
        _refuse(source, e.problem)
    arrays: dict[str, torch.Tensor] = {}
    if blob is not None:
        try:
            arrays = load_tensors(blob)
        except Exception as e:  # safetensors raises its own error types for malformed headers
            _refuse(source, f"{ARRAYS_MEMBER} is not a valid safetensors file ({e})")
    if members and not (isinstance(doc, dict) and _is_int(doc.get("layerscope_session"))
                        and doc["layerscope_session"] >= 2):
        _refuse(source, "it holds draft files but session.json is not format 2")
    return doc, arrays, files


def _check(cond: bool, source: str, problem: str) -> None:
    if not cond:
        _refuse(source, problem)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt_str(d: dict, key: str, source: str, max_len: int = 4096) -> None:
    v = d.get(key)
    _check(v is None or (isinstance(v, str) and len(v) <= max_len), source, f"field {key!r} must be a string")


def _layers_ok(layers, n: int | None) -> bool:
    """layerset.is_valid against a capture of n layers; a set may name up to the final state n (files written
    before sets were limited to 0..N-1 did), and at most index 10,000 when the capture is unknown."""
    return layerset.is_valid(layers, (n if n is not None else 10_000) + 1)


# The schema. A spec is a type name ("int", "num", "bool", "str", "name", "key", "json"), ("opt", spec) for a
# value that may be null, ("list", spec, max) , ("map", spec) (string keys), ("either", spec, spec), or
# ("obj", {field: spec}, strict): known fields typed, fields marked ("req", spec) must be present, and other
# fields refused (strict) or only bounded as JSON (records written by newer code).
def _opt(spec):
    return ("opt", spec)


def _req(spec):
    return ("req", spec)


NUMS = ("list", ("opt", "num"), 100_000)     # null where a value is undefined (NaN is written as null)
PAIRS = ("list", ("list", "int", 2), 64)
CI = ("list", _opt("num"), 2)                # an interval [lo, hi]
CAPTURE_SCHEMA = ("obj", {
    "key": _opt("key"), "model": _opt("str"), "num_layers": _opt(("range", 1, MAX_LAYERS)),
    "hidden_size": _opt(("range", 1, 10**6)), "tokens": _opt(("range", 0, 10**13)),
    "conversations": _opt(("range", 0, 10**9)), "prompt_set": _opt("str"), "created": _opt("str"),
    "seconds": _opt("num"), "fingerprint": _opt("str"), "size_bytes": _opt("int"), "problem": _opt("str"),
}, False)
ANALYSIS_SCHEMA = ("obj", {
    "alpha": "num", "min_entropy": _opt("num"), "quantile": _opt("num"), "response_only": "bool",
    "outlier_factor": _opt("num"), "max_tokens": _opt("int"), "seed": "int", "rank": _opt("int"), "debiased": "bool",
    "kernel": "str",
}, True)
STATS_SCHEMA = ("obj", {
    "capture_key": _opt("str"), "num_layers": _opt(("range", 1, MAX_LAYERS)), "hidden_size": _opt("int"),
    "alpha": _opt("num"), "tokens_total": _opt("int"), "tokens_kept": _opt("int"), "outliers_dropped": _opt("int"),
    "prompts_used": _opt("int"), "threshold": _opt("num"), "compartments": _opt(PAIRS),
    "compartments_by_k": _opt(("map", PAIRS)), "tokens": _opt(("map", "json")), "options": _opt(("map", "json")),
    "requested": _opt(("map", "json")), "final_state": _opt("str"), "model": _opt("str"), "cka_route": _opt("str"),
    "key": _opt("str"), "seconds": _opt("num"), "version": _opt("int"),
}, False)
LAYER_SET_SCHEMA = ("obj", {"name": _req("name"), "layers": _req("json"), "strategy": _opt("str")}, True)
DRAFT_SCHEMA = ("obj", {
    "name": _opt("str"), "path": _req("str"), "layers": _req("json"), "strategy": _opt("str"),
    "val_accuracy": _opt(("either", "num", NUMS)), "steps": _opt("int"), "target_fingerprint": _opt("str"),
    "capture_key": _opt("str"), "seconds": _opt("num"),
}, False)
BENCH_ROW_SCHEMA = ("obj", {
    "name": _req("str"), "layers": _opt(("list", "int", MAX_LAYERS)), "decoding": _opt("str"), "tau": _opt("num"),
    "acceptance_by_position": _opt(NUMS), "tokens_per_s": _opt("num"), "speedup": _opt("num"),
    "lossless": _opt("bool"),
    "by_category": _opt(("map", ("obj", {"tau": _opt("num"), "tokens_per_s": _opt("num"), "speedup": _opt("num")},
                                 False))),
    # bench.add_intervals: per-prompt totals and bootstrap intervals over the prompts (absent in older results)
    "per_prompt": _opt(("map", ("list", "num", 100_000))), "tau_ci": _opt(CI), "speedup_ci": _opt(CI),
    "acceptance": _opt("num"), "acceptance_ci": _opt(CI),
    "paired": _opt(("obj", {"vs": _req("str"), **{m: _opt(("obj", {"delta": _opt("num"), "ci": _opt(CI)}, False))
                                                  for m in ("tau", "speedup", "acceptance")}}, False)),
}, False)
BENCH_SCHEMA = ("obj", {
    "prompts": _opt("int"), "prompt_set": _opt("str"), "max_new_tokens": _opt("int"), "device": _opt("str"),
    "created": _opt("str"), "results": _opt(("list", BENCH_ROW_SCHEMA, LIST_MAX)), "warnings": _opt(("list", "str", 100)),
    "intervals": _opt(("obj", {"level": _opt("num"), "draws": _opt("int"), "over": _opt("str"), "prompts": _opt("int"),
                               "reference": _opt("str")}, False)),
    # the older flat form: one contender per entry
    "name": _opt("str"), "tau": _opt("num"), "acceptance_by_position": _opt(NUMS),
}, False)
STUDY_ROW_SCHEMA = ("obj", {
    "strategies": _req(("list", "str", 64)), "layers": _req(("list", "int", MAX_LAYERS)), "draft": _req("str"),
    "mean_entropy": _req(_opt("num")), "mean_cka": _req(_opt("num")), "aggregate_entropy": _req(_opt("num")),
    "val_accuracy": _opt(("either", "num", NUMS)), "tau": _opt("num"), "tau_ci": _opt(("list", _opt("num"), 2)),
    "delta_vs_default": _opt("num"), "delta_ci": _opt(("list", _opt("num"), 2)), "tau_seed_range": _opt("num"),
    "speedup": _opt("num"), "lossless": _opt("bool"), "proxies": _opt(("map", "json")),
}, False)
STUDY_SCHEMA = ("obj", {
    "rows": _req(("list", STUDY_ROW_SCHEMA, LIST_MAX)), "prompts": _req("int"), "device": _opt("str"),
    "verdict": _opt("str"),
    "options": _opt(("obj", {"train": _opt(("map", "json")), "prompts": _opt("str"), "max_new_tokens": _opt("int"),
                             "depth": _opt("int")}, False)),
    "correlations": _opt(("list", ("obj", {"proxy": _req("str"), "version": _req("str"), "rho": _req(_opt("num")),
                                           "ci": _opt(("list", _opt("num"), 2))}, False), LIST_MAX)),
    "best_proxies": _opt(("map", "json")), "spearman": _opt(("map", _opt("num"))),
}, False)
VIEW_SCHEMA = ("obj", {      # the app's widget choices: exactly the values its widgets accept
    "entropy_scale": ("enum", "raw (nats)", "normalized"), "entropy_levels": ("list", ("enum", "dataset", "prompt"), 2),
    "entropy_compare": "bool", "cka_estimator": ("enum", "biased", "debiased"),
    "cka_compartments": ("range", 1, 64), "bench_run": ("range", 0, LIST_MAX),
}, False)
SCHEMA = ("obj", {
    "id": _req("id"), "name": _opt("name"), "model": _opt("str"), "prompt_set": _opt("str"), "capture_key": _opt("key"),
    "capture": CAPTURE_SCHEMA, "analysis_options": ANALYSIS_SCHEMA, "stats": STATS_SCHEMA,
    "layer_sets": ("list", LAYER_SET_SCHEMA, LIST_MAX), "manual_picks": ("list", "int", MAX_LAYERS),
    "drafts": ("list", DRAFT_SCHEMA, LIST_MAX), "bench_results": ("list", BENCH_SCHEMA, LIST_MAX),
    "study": ("list", STUDY_SCHEMA, STUDY_MAX), "device": _opt("str"), "notes": ("text", NOTES_MAX),
    "created": _opt("str"), "updated": _opt("str"), "view": VIEW_SCHEMA,
}, True)


def _json_ok(v, depth: int = 0) -> bool:
    """Plain bounded JSON: finite numbers, strings up to TEXT_MAX, at most 12 levels deep."""
    if depth > 12:
        return False
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return math.isfinite(v)
    if isinstance(v, str):
        return len(v) <= NOTES_MAX
    if isinstance(v, list):
        return all(_json_ok(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and len(k) <= TEXT_MAX and _json_ok(x, depth + 1) for k, x in v.items())
    return False


def _schema_problem(v, spec, where: str) -> str | None:
    """None when `v` fits `spec`, else what is wrong (naming the field)."""
    if isinstance(spec, str):
        ok = {
            "int": lambda: _is_int(v) and abs(v) <= 2**53,
            "num": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "bool": lambda: isinstance(v, bool),
            "str": lambda: isinstance(v, str) and len(v) <= TEXT_MAX,
            "name": lambda: isinstance(v, str) and 0 < len(v.strip()) <= NAME_MAX and not CONTROL.search(v),
            "key": lambda: isinstance(v, str) and KEY_RE.fullmatch(v) is not None,
            "id": lambda: valid_id(v),
            "json": lambda: _json_ok(v),
        }[spec]()
        if ok:
            return None
        return {"int": "must be an integer", "num": "must be a finite number", "bool": "must be true or false",
                "str": f"must be a string of at most {TEXT_MAX} characters",
                "name": f"must be 1..{NAME_MAX} characters on one line",
                "key": "must be a capture key (24 lowercase hex characters)",
                "id": "must be 12 lowercase hex characters", "json": "holds a value that is not plain JSON"}[spec] \
            .join([f"{where} ", ""])
    kind = spec[0]
    if kind == "opt":
        return None if v is None else _schema_problem(v, spec[1], where)
    if kind == "req":
        return _schema_problem(v, spec[1], where)
    if kind == "text":
        return None if isinstance(v, str) and len(v) <= spec[1] else f"{where} must be a string of at most {spec[1]} characters"
    if kind == "range":
        return None if _is_int(v) and spec[1] <= v <= spec[2] else f"{where} must be an integer in {spec[1]}..{spec[2]}"
    if kind == "enum":
        return None if isinstance(v, str) and v in spec[1:] else f"{where} must be one of {list(spec[1:])}"
    if kind == "either":
        first = _schema_problem(v, spec[1], where)
        return first if first is None else _schema_problem(v, spec[2], where)
    if kind == "list":
        if not isinstance(v, list) or len(v) > spec[2]:
            return f"{where} must be a list of at most {spec[2]} items"
        for i, x in enumerate(v):
            problem = _schema_problem(x, spec[1], f"{where}[{i}]")
            if problem:
                return problem
        return None
    if kind == "map":
        if not isinstance(v, dict) or len(v) > LIST_MAX:
            return f"{where} must be an object of at most {LIST_MAX} fields"
        for k, x in v.items():
            problem = _schema_problem(x, spec[1], f"{where}.{k}"[:200])
            if problem:
                return problem
        return None
    if kind == "obj":
        fields_, strict = spec[1], spec[2]
        if not isinstance(v, dict):
            return f"{where} must be an object"
        for k, s in fields_.items():
            if k not in v:
                if isinstance(s, tuple) and s[0] == "req":
                    return f"{where}.{k} is missing"
                continue
            problem = _schema_problem(v[k], s, f"{where}.{k}")
            if problem:
                return problem
        extra = sorted(set(v) - set(fields_))
        if extra and strict:
            return f"{where} has unknown fields {[e[:40] for e in extra[:5]]}"
        for k in extra:
            if not (len(k) <= TEXT_MAX and _json_ok(v[k])):
                return f"{where}.{k[:40]} holds a value that is not plain JSON"
        return None
    raise AssertionError(f"unknown schema spec {spec!r}")


def _validate(doc, arrays: dict[str, torch.Tensor], source: str) -> Session:
    _check(isinstance(doc, dict) and "layerscope_session" in doc, source,
           "session.json has no 'layerscope_session' marker (it comes from another program)")
    version = doc["layerscope_session"]
    _check(_is_int(version), source, "the format marker is not a number")
    if version > FORMAT:
        raise SessionError(f"{source} was written by a newer LayerScope (session format {version}, this one reads {FORMAT})",
                           "Update LayerScope and import it again")
    body = doc.get("session")
    _check(isinstance(body, dict), source, "session.json has no 'session' object")
    known = {f.name for f in fields(Session)} - {"arrays"}
    extra = sorted(set(body) - known)
    _check(not extra, source, f"unknown fields {extra[:5]}")
    for key in ("capture", "analysis_options", "stats"):
        _check(isinstance(body.get(key, {}), dict), source, f"field {key!r} must be an object")
    for key in ("layer_sets", "drafts", "bench_results", "study"):
        v = body.get(key, [])
        _check(isinstance(v, list) and all(isinstance(x, dict) for x in v), source, f"field {key!r} must be a list of objects")
    _check(valid_id(body.get("id")), source, "the session id must be 12 lowercase hex characters")
    name = body.get("name")
    _check(name is None or (isinstance(name, str) and 0 < len(name.strip()) <= NAME_MAX), source,
           f"the name must be 1..{NAME_MAX} characters")
    problem = _schema_problem(body, SCHEMA, "session")
    _check(problem is None, source, (problem or "").removeprefix("session."))
    try:
        AnalysisOptions(**body.get("analysis_options", {})).validate()
    except LayerScopeError as e:
        _refuse(source, f"analysis_options: {e.problem}")

    _check(valid_id(body.get("id")), source, "the session id must be 12 lowercase hex characters")
    for key in ("model", "prompt_set", "device", "created", "updated"):
        _opt_str(body, key, source)
    _opt_str(body, "notes", source, 100_000)
    name = body.get("name")
    _check(name is None or (isinstance(name, str) and 0 < len(name.strip()) <= NAME_MAX), source,
           f"the name must be 1..{NAME_MAX} characters")
    ck = body.get("capture_key")
    _check(ck is None or (isinstance(ck, str) and re.fullmatch(r"[0-9a-f]{8,64}", ck) is not None), source,
           "the capture key must be hex characters")
    for key in ("capture", "analysis_options", "stats", "view"):
        _check(isinstance(body.get(key, {}), dict), source, f"field {key!r} must be an object")
    for key in ("layer_sets", "drafts", "bench_results", "study"):
        v = body.get(key, [])
        _check(isinstance(v, list) and all(isinstance(x, dict) for x in v), source, f"field {key!r} must be a list of objects")

    capture = body.get("capture", {})
    n = capture.get("num_layers")
    _check(n is None or (_is_int(n) and 0 < n <= 10_000), source, "capture.num_layers must be a positive integer")
    for i, s in enumerate(body.get("layer_sets", [])):
        _check(isinstance(s.get("name"), str) and len(s["name"]) <= NAME_MAX, source, f"layer set {i + 1} has no name")
        _check(_layers_ok(s.get("layers"), n), source,
               f"layer set {s.get('name')!r} must list distinct layers in 0..{n if n is not None else 'N'}")
    picks = body.get("manual_picks", [])
    _check(isinstance(picks, list) and all(_is_int(x) and 0 <= x <= (n if n is not None else 10_000) for x in picks),
           source, "manual_picks must be a list of layer indices")
    for i, d in enumerate(body.get("drafts", [])):
        _check(isinstance(d.get("path"), str) and _layers_ok(d.get("layers"), n), source,
               f"draft {i + 1} needs a path and its layers")

    # tensors: float, finite, shaped by the number of layers
    for k, t in arrays.items():
        _check(k in ARRAY_KEYS, source, f"unexpected tensor {k!r} in {ARRAYS_MEMBER}")
        _check(t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64), source,
               f"tensor {k!r} must be floating point, not {t.dtype}")
        _check(bool(torch.isfinite(t).all()), source, f"tensor {k!r} holds NaN or infinite values")
    if n is not None:
        for k in ("entropy", "entropy_normalized", "entropy2", "entropy_prompt", "entropy_prompt_normalized"):
            if k in arrays:
                _check(tuple(arrays[k].shape) == (n + 1,), source, f"tensor {k!r} must have {n + 1} values (layers 0..{n})")
        for k in ("cka", "cka_debiased", "cka_bound"):
            if k in arrays:
                _check(tuple(arrays[k].shape) == (n + 1, n + 1), source, f"tensor {k!r} must be {n + 1}×{n + 1}")
    if "token_entropy" in arrays:
        _check(arrays["token_entropy"].dim() == 1, source, "tensor 'token_entropy' must be 1-D")
    # without a capture summary the tensors must still agree with each other (and with stats.num_layers)
    lengths = {tuple(t.shape) for k, t in arrays.items() if k != "token_entropy"}
    sizes = {dim for shape in lengths for dim in shape}
    _check(len(sizes) <= 1 and all(len(shape) in (1, 2) for shape in lengths), source,
           "the statistics tensors disagree on the number of layers")
    stats = body.get("stats", {})
    if sizes:
        L = sizes.pop()
        _check(stats.get("num_layers") in (None, L - 1), source,
               f"stats.num_layers is {stats.get('num_layers')}, the tensors hold layers 0..{L - 1}")
        _check(n is None or n == L - 1, source, f"the tensors hold layers 0..{L - 1}, the capture 0..{n}")
    top = n if n is not None else stats.get("num_layers")
    blocks = [stats.get("compartments") or []] + list((stats.get("compartments_by_k") or {}).values())
    _check(all(0 <= a <= b <= (top if top is not None else MAX_LAYERS) for block in blocks for a, b in block), source,
           "stats compartments must be [first, last] layer ranges inside the capture")

    kwargs = {k: body[k] for k in known if k in body}
    kwargs["manual_picks"] = sorted(set(picks))
    s = Session(**kwargs)
    s.arrays = {k: v.to(torch.float32) for k, v in arrays.items()}
    for v in s.stats.values():
        if isinstance(v, float):
            _check(math.isfinite(v), source, "statistics hold NaN or infinite values")
    return s


# ---------------------------------------------------------------------------- the store

def _archive_path(store, sid: str) -> Path:
    return Path(store.path("sessions", sid)) / ARCHIVE_NAME


def _check_id(sid) -> str:
    if not valid_id(sid):
        raise SessionError(f"{sid!r} is not a session id",
                           "A session id is 12 lowercase hex characters, as in the share link ?session=0123456789ab")
    return sid


def save(session: Session, store, *, name: str | None = None, touch: bool = True) -> Path:
    """Write the session into the store (atomically: temp file + rename). Returns the archive path."""
    _check_id(session.id)
    if name is not None:
        name = name.strip()
        if not name or len(name) > NAME_MAX or CONTROL.search(name):
            raise SessionError(f"A session name must be 1..{NAME_MAX} characters on one line",
                               "Type a shorter, non-empty name")
        session.name = name
    if touch:
        session.updated = now_iso()
    data = session.to_bytes()
    if len(data) > MAX_ARCHIVE_BYTES:
        raise SessionError(f"This session's archive would be {len(data) >> 20} MiB, over the limit of "
                           f"{MAX_ARCHIVE_BYTES >> 20} MiB that import accepts", "Remove old benchmark runs or studies")
    Session.from_bytes(data, source="This session")     # the checks import makes: what saves, loads again
    path = _archive_path(store, session.id)
    atomic_write_bytes(path, data)
    _drop_stale_temps(path.parent)
    return path


def _drop_stale_temps(directory: Path, age_s: float = 3600.0) -> None:
    """Temporary archives of saves killed over an hour ago (a live save renames its own within seconds)."""
    now = time.time()
    for p in directory.glob(f".{ARCHIVE_NAME}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > age_s:
                p.unlink()


def _read_file(path: Path, source: str) -> bytes:
    """A stored archive's bytes: a regular file (not a link, pipe or device) under the size limit."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            _refuse(source, "its archive is not a regular file", "Delete it and save the session again")
        if st.st_size > MAX_ARCHIVE_BYTES:
            _refuse(source, f"its archive is larger than {MAX_ARCHIVE_BYTES >> 20} MiB", "Delete it")
        return path.read_bytes()
    except OSError as e:
        raise SessionError(f"{source} cannot be read ({e.strerror})", "Check the store directory") from None


def exists(store, sid: str) -> bool:
    return valid_id(sid) and _archive_path(store, sid).is_file()


def load(store, sid: str) -> Session:
    """The stored session `sid`; SessionError when it is missing or broken."""
    _check_id(sid)
    path = _archive_path(store, sid)
    if not path.is_file():
        raise SessionError(f"No saved session {sid} in {store.root}",
                           "Check the link, or open the Sessions page to list the saved sessions")
    session = Session.from_bytes(_read_file(path, f"Session {sid}"), source=f"Session {sid}")
    if session.id != sid:
        raise SessionError(f"Session {sid} holds another session's data ({session.id})", "Delete it and save again")
    if hasattr(store, "touch"):
        store.touch("sessions", sid)
    return session


def delete(store, sid: str) -> None:
    _check_id(sid)
    if hasattr(store, "remove"):
        store.remove("sessions", sid)
    else:
        _archive_path(store, sid).unlink(missing_ok=True)


def list_sessions(store, *, include_unnamed: bool = True) -> list[dict]:
    """Summaries of stored sessions, most recently updated first. A broken entry is listed with `error`."""
    root = Path(store.path("sessions", "0" * 12)).parent
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        path = d / ARCHIVE_NAME
        if not (d.is_dir() and valid_id(d.name) and path.is_file()):
            continue
        try:
            s = Session.from_bytes(_read_file(path, f"Session {d.name}"), source=f"Session {d.name}", arrays=False)
        except SessionError as e:
            out.append({"id": d.name, "name": None, "error": str(e), "updated": ""})
            continue
        if s.name is None and not include_unnamed:
            continue
        out.append({
            "id": s.id, "name": s.name, "model": s.model, "prompt_set": s.prompt_set,
            "capture_key": s.capture_key, "tokens": s.capture.get("tokens"),
            "num_layers": s.num_layers, "layer_sets": [x["layers"] for x in s.layer_sets],
            "drafts": len(s.drafts), "benchmarks": len(s.bench_results), "updated": s.updated,
        })
    return sorted(out, key=lambda r: r.get("updated") or "", reverse=True)


def export_bytes(session: Session, *, drafts: bool = False) -> bytes:
    """The shareable archive: the same bytes the store keeps, or with `drafts` also the files of every
    session draft this server holds (`draft_files`; those it does not hold stay references by path)."""
    return session.to_bytes(draft_files(session)[0] if drafts else None)


def draft_files(session: Session) -> tuple[list[dict], list[str]]:
    """The session's drafts as archive entries [{"entry", "path", "files": {name: bytes}}] (each folder once,
    each loading with load_draft), and the paths of those not on this server. A draft folder that is here
    but does not load is a SessionError naming it."""
    included, missing, seen = [], [], set()
    for d in session.drafts:
        path = Path(d["path"])
        if d["path"] in seen:
            continue
        seen.add(d["path"])
        if not _held(path):
            missing.append(d["path"])
            continue
        try:
            load_draft(path)
        except LayerScopeError as e:
            raise SessionError(f"Draft {d['name'] if d.get('name') else path} does not load ({e.problem})",
                               "Export without drafts, or train the draft again") from None
        entry = path.name if ENTRY_NAME_RE.fullmatch(path.name) else f"draft-{len(included) + 1}"
        if entry in {x["entry"] for x in included}:
            entry = f"{entry[:100]}-{len(included) + 1}"
        included.append({"entry": entry, "path": d["path"],
                         "files": {f: (path / f).read_bytes() for f in DRAFT_FILES if (path / f).is_file()}})
    total = sum(len(b) for d in included for b in d["files"].values())
    if total > MAX_DRAFTS_BYTES:
        raise SessionError(f"This session's drafts hold {total >> 20} MiB, over the {MAX_DRAFTS_BYTES >> 20} MiB "
                           "an archive may carry", "Export without drafts, or remove drafts from the session")
    return included, missing


def _held(path) -> bool:
    """Whether this server holds the draft folder `path` (its required files are there)."""
    return all((Path(path) / f).is_file() for f in DRAFT_REQUIRED)


def missing_drafts(session: Session) -> list[str]:
    """Paths of the session's drafts that this server does not hold (an export cannot include them)."""
    return [d["path"] for d in session.drafts if not _held(d["path"])]


@dataclass
class Imported:
    session: Session
    drafts: list[str] = field(default_factory=list)     # the draft folders the archive brought, in this store


def import_bytes(data: bytes, store, *, source: str = "the uploaded file") -> Session:
    """Validate an archive and save it into the store (with its drafts, if it carries any); the session."""
    return import_archive(data, store, source=source).session


def import_archive(data: bytes, store, *, source: str = "the uploaded file") -> Imported:
    """Validate an archive and save it into the store. Keeps its id unless a different session owns it.
    Drafts inside are checked and written to the store's drafts/ (all or none) before the session, whose
    draft paths then point at them."""
    doc, tensors, files = _read_archive(data, source, with_drafts=True)
    session = _validate(doc, tensors, source)
    placed = _install_drafts(_archived_drafts(doc, files, source), store, source)
    for d in session.drafts:
        d["path"] = placed.get(d["path"], d["path"])
    if exists(store, session.id):
        try:
            same = load(store, session.id).to_json() == session.to_json()
        except SessionError:
            same = False
        if not same:
            session.id = new_id()
    save(session, store, touch=False)
    return Imported(session, sorted(set(placed.values())))


FILE_SCHEMA = ("obj", {"bytes": _req(("range", 0, MAX_DRAFTS_BYTES)), "sha256": _req("str")}, True)
DRAFT_ENTRY_SCHEMA = ("obj", {"entry": _req("str"), "path": _req("str"), "files": _req(("map", FILE_SCHEMA))}, True)


def _archived_drafts(doc: dict, files: dict[str, dict[str, bytes]], source: str) -> list[dict]:
    """The drafts session.json lists, each checked against the archive's files: names, sizes, sha256, JSON."""
    listed = doc.get("drafts", [])
    problem = _schema_problem(listed, ("list", DRAFT_ENTRY_SCHEMA, LIST_MAX), "drafts")
    _check(problem is None, source, problem or "")
    entries = [d["entry"] for d in listed]
    _check(len(set(entries)) == len(entries), source, "session.json lists a draft folder twice")
    _check(set(entries) == set(files), source, "the draft folders in the archive and in session.json differ")
    out = []
    for d in listed:
        entry, got = d["entry"], files[d["entry"]]
        where = f"draft {entry[:40]!r}"
        _check(set(d["files"]) == set(got), source, f"{where}: its files and those listed in session.json differ")
        _check(all(f in got for f in DRAFT_REQUIRED), source, f"{where} lacks {' or '.join(DRAFT_REQUIRED)}")
        for name, blob in got.items():
            want = d["files"][name]
            _check(len(blob) == want["bytes"] and SHA256_RE.fullmatch(want["sha256"]) is not None
                   and hashlib.sha256(blob).hexdigest() == want["sha256"], source,
                   f"{where}: {name} does not match its size and checksum (damaged in transfer?)")
            if name.endswith(".json"):
                try:
                    value = jsonsafe.loads(blob, what=f"{where}: {name}", error=SessionError,
                                           max_bytes=MAX_DRAFT_JSON_BYTES)
                except SessionError as e:
                    _refuse(source, e.problem)
                _check(isinstance(value, dict), source, f"{where}: {name} is not a JSON object")
        out.append({"entry": entry, "path": d["path"], "files": got})
    return out


def _install_drafts(drafts: list[dict], store, source: str) -> dict[str, str]:
    """Write each draft into <store>/drafts/<entry> (or <entry>-<digest> when another draft has that name;
    an identical one already there is used as it is), each checked with load_draft before it is placed,
    all placed or none. Returns {path in the archive: path in this store}."""
    placed = {}
    with contextlib.ExitStack() as stack:
        for d in drafts:
            digest = hashlib.sha256("".join(sorted(hashlib.sha256(b).hexdigest() for b in d["files"].values()))
                                    .encode()).hexdigest()
            for name in (d["entry"], f"{d['entry'][:100]}-{digest[:12]}"):
                dest = Path(store.path("drafts", name))
                if not dest.exists() or _same_draft(dest, d["files"]):
                    break
            else:
                _refuse(source, f"drafts/{d['entry']} and drafts/{name} of this store hold other drafts",
                        "Remove one of them from the store, or import without drafts")
            placed[d["path"]] = str(dest)
            if dest.exists():
                continue
            try:
                tmp = stack.enter_context(staged(dest))
                for f, blob in d["files"].items():
                    (tmp / f).write_bytes(blob)
            except OSError as e:
                raise write_error(e, dest) from None
            try:
                load_draft(tmp)
            except LayerScopeError as e:
                _refuse(source, f"draft {d['entry']!r} does not load ({e.problem})")
    return placed


def _same_draft(directory: Path, files: dict[str, bytes]) -> bool:
    present = {f for f in DRAFT_FILES if (directory / f).is_file()}
    return present == set(files) and all((directory / f).read_bytes() == b for f, b in files.items())
