"""Analysis sessions: what a user looked at, saved on disk and shareable, never pickled.

A session names a capture (key and a summary of it), the model spec and prompt set, the analysis
options, the layer sets chosen for testing, the layers hand-picked on the heatmap, trained drafts
and benchmark results. It also carries a snapshot of the layer statistics (per-layer entropy, CKA
matrices) as tensors, so a session imported on another installation shows the same curves and
heatmap even when that installation does not hold the capture.

On disk a session is one archive, ``<store>/sessions/<id>/session.zip``, holding exactly:

    session.json          {"layerscope_session": FORMAT, "session": {...}}   (JSON, UTF-8)
    arrays.safetensors    named float tensors (optional)

The same archive is the downloadable/shareable file. Loading validates every field and tensor and
refuses anything else with a `SessionError`; JSON and safetensors cannot execute code.
"""

from __future__ import annotations

import io
import json
import math
import re
import secrets
import zipfile
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from layerscope.analysis import ARRAY_FIELDS, join_arrays, split_arrays
from layerscope.errors import SessionError
from layerscope.store import atomic_write_bytes

FORMAT = 1
ARCHIVE_NAME = "session.zip"
JSON_MEMBER = "session.json"
ARRAYS_MEMBER = "arrays.safetensors"
MAX_JSON_BYTES = 16 * 2**20
MAX_ARRAYS_BYTES = 256 * 2**20
ID_RE = re.compile(r"^[0-9a-f]{12}$")
NAME_MAX = 120
# Layer statistics that are stored as tensors rather than JSON lists: LayerStats decides which.
ARRAY_KEYS = ARRAY_FIELDS


def new_id() -> str:
    return secrets.token_hex(6)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def valid_id(sid) -> bool:
    return isinstance(sid, str) and bool(ID_RE.match(sid))


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
        return join_arrays({k: v for k, v in self.arrays.items() if k in ARRAY_KEYS}, self.stats)

    def add_layer_set(self, name: str, layers, strategy: str = "manual") -> dict:
        """Add a set to test (or rename the existing entry with the same layers). Returns the entry."""
        layers = sorted({int(x) for x in layers})
        if not layers:
            raise SessionError("A layer set needs at least one layer", "Pick one or more layers first")
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

    def to_bytes(self) -> bytes:
        """The session as a zip archive: session.json + arrays.safetensors."""
        doc = {"layerscope_session": FORMAT, "session": self.to_json()}
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(JSON_MEMBER, json.dumps(doc, indent=1, allow_nan=False))
            if self.arrays:
                tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in self.arrays.items()}
                z.writestr(ARRAYS_MEMBER, save_tensors(tensors, metadata={"layerscope_session": str(FORMAT)}))
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "the file", *, arrays: bool = True) -> "Session":
        """Parse and validate an archive; any problem is a SessionError naming it.

        With arrays=False the tensors are not read (a quick look for listings); the rest is validated.
        """
        doc, tensors = _read_archive(data, source, with_arrays=arrays)
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


def _read_archive(data: bytes, source: str, with_arrays: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    if not isinstance(data, (bytes, bytearray)) or not data:
        _refuse(source, "it is empty")
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        if data[:1] in (b"{", b"["):
            _refuse(source, "it is a JSON file, not a session archive",
                    "Import the .zip archive that LayerScope's Sessions page downloads")
        _refuse(source, "it is not a zip archive (corrupted or another kind of file)",
                "Import the .zip archive that LayerScope's Sessions page downloads")
    with z:
        infos = {i.filename: i for i in z.infolist()}
        unknown = sorted(set(infos) - {JSON_MEMBER, ARRAYS_MEMBER})
        if JSON_MEMBER not in infos:
            _refuse(source, f"the archive has no {JSON_MEMBER}" + (f" (it holds {', '.join(unknown[:5])})" if unknown else ""))
        if unknown:
            _refuse(source, f"the archive holds unexpected files: {', '.join(unknown[:5])}")
        if infos[JSON_MEMBER].file_size > MAX_JSON_BYTES:
            _refuse(source, f"{JSON_MEMBER} is larger than {MAX_JSON_BYTES >> 20} MiB")
        if ARRAYS_MEMBER in infos and infos[ARRAYS_MEMBER].file_size > MAX_ARRAYS_BYTES:
            _refuse(source, f"{ARRAYS_MEMBER} is larger than {MAX_ARRAYS_BYTES >> 20} MiB")
        try:
            raw = z.read(JSON_MEMBER)
            blob = z.read(ARRAYS_MEMBER) if with_arrays and ARRAYS_MEMBER in infos else None
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
            _refuse(source, f"the archive is corrupted ({e})")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=lambda c: _refuse(source, f"{c} in {JSON_MEMBER}"))
    except UnicodeDecodeError:
        _refuse(source, f"{JSON_MEMBER} is not UTF-8 text")
    except json.JSONDecodeError as e:
        _refuse(source, f"{JSON_MEMBER} is not valid JSON ({e.msg} at line {e.lineno})")
    arrays: dict[str, torch.Tensor] = {}
    if blob is not None:
        try:
            arrays = load_tensors(blob)
        except Exception as e:  # safetensors raises its own error types for malformed headers
            _refuse(source, f"{ARRAYS_MEMBER} is not a valid safetensors file ({e})")
    return doc, arrays


def _check(cond: bool, source: str, problem: str) -> None:
    if not cond:
        _refuse(source, problem)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt_str(d: dict, key: str, source: str, max_len: int = 4096) -> None:
    v = d.get(key)
    _check(v is None or (isinstance(v, str) and len(v) <= max_len), source, f"field {key!r} must be a string")


def _layers_ok(layers, n: int | None) -> bool:
    if not isinstance(layers, list) or not layers or not all(_is_int(x) for x in layers):
        return False
    if len(set(layers)) != len(layers):
        return False
    return all(0 <= x <= (n if n is not None else 10_000) for x in layers)


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
        if not name or len(name) > NAME_MAX:
            raise SessionError(f"A session name must be 1..{NAME_MAX} characters", "Type a shorter, non-empty name")
        session.name = name
    if touch:
        session.updated = now_iso()
    data = session.to_bytes()
    path = _archive_path(store, session.id)
    atomic_write_bytes(path, data)
    return path


def exists(store, sid: str) -> bool:
    return valid_id(sid) and _archive_path(store, sid).is_file()


def load(store, sid: str) -> Session:
    """The stored session `sid`; SessionError when it is missing or broken."""
    _check_id(sid)
    path = _archive_path(store, sid)
    if not path.is_file():
        raise SessionError(f"No saved session {sid} in {store.root}",
                           "Check the link, or open the Sessions page to list the saved sessions")
    session = Session.from_bytes(path.read_bytes(), source=f"Session {sid}")
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
            s = Session.from_bytes(path.read_bytes(), source=f"Session {d.name}", arrays=False)
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


def export_bytes(session: Session) -> bytes:
    """The shareable archive (the same bytes the store keeps)."""
    return session.to_bytes()


def import_bytes(data: bytes, store, *, source: str = "the uploaded file") -> Session:
    """Validate an archive and save it into the store. Keeps its id unless a different session owns it."""
    session = Session.from_bytes(data, source=source)
    if exists(store, session.id):
        try:
            same = load(store, session.id).to_json() == session.to_json()
        except SessionError:
            same = False
        if not same:
            session.id = new_id()
    save(session, store, touch=False)
    return session
