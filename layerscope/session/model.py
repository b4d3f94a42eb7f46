"""The Session: what a user looked at, as plain JSON-able fields plus tensors.

A session names a capture (key and a summary of it), the model spec and prompt set, the analysis
options, the layer sets chosen for testing, the layers hand-picked on the heatmap, trained drafts
and benchmark results. It also carries a snapshot of the layer statistics (per-layer entropy, CKA
matrices) as tensors, so a session imported on another installation shows the same curves and
heatmap even when that installation does not hold the capture.

`to_bytes` / `from_bytes` are the archive (archive.py), checked on the way in by check.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from layerscope import layerset
from layerscope.errors import SessionError
from layerscope.session import archive
from layerscope.session.check import session_fields
from layerscope.session.schema import SESSION_FIELDS
from layerscope.stats.analysis import ARRAY_FIELDS, join_arrays, split_arrays

# Layer statistics that are stored as tensors rather than JSON lists: LayerStats decides which.
ARRAY_KEYS = ARRAY_FIELDS


def new_id() -> str:
    return secrets.token_hex(6)


def owner_hash(token: str) -> str:
    """What a session records of its owner: 24 hex characters of sha256 over the browser's secret token (the
    token itself is never stored, so the store cannot be read for a way to act as the owner)."""
    return hashlib.sha256(f"layerscope-owner:{token}".encode()).hexdigest()[:24]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
    owner: str | None = None                # owner_hash of the browser that made it; None: made before owners (read-only)
    frozen: bool = False                    # a snapshot behind a share link: never saved over
    origin: str | None = None               # the session this one is a copy or snapshot of
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

    def editable_by(self, owner: str | None) -> bool:
        """The one rule of who may change a session: its owner, and nobody for a snapshot or an ownerless one."""
        return not self.frozen and owner is not None and self.owner == owner

    def copy(self, *, owner: str | None, frozen: bool = False, name: str | None = None) -> Session:
        """A copy under a new id (arrays shared: tensors are never changed in place); the original is untouched."""
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "arrays"}
        body = json.loads(json.dumps(body))
        body.update(id=new_id(), owner=owner, frozen=frozen, origin=self.id, name=name if name is not None else self.name)
        out = Session(**body)
        out.arrays = dict(self.arrays)
        return out

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
        for name, unset in (("owner", None), ("frozen", False), ("origin", None)):
            if body[name] == unset:          # a session without them reads and writes back as it was (format 1, 2)
                del body[name]
        return _finite(json.loads(json.dumps(body, default=_json_default)))

    def to_bytes(self, drafts: list[dict] | None = None) -> bytes:
        """The session as a zip archive: session.json + arrays.safetensors (format 1); with `drafts`
        (from `share.draft_files`) also their files under drafts/<entry>/ and their list in session.json (format 2)."""
        return archive.write(self.to_json(), self.arrays, drafts)

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "the file", *, arrays: bool = True) -> Session:
        """Parse and validate an archive; any problem is a SessionError naming it.

        With arrays=False the tensors are not read (a quick look for listings); the rest is validated.
        """
        doc, tensors, _ = archive.read(data, source, with_arrays=arrays)
        return cls.from_doc(doc, tensors, source)

    @classmethod
    def from_doc(cls, doc: dict, tensors: dict[str, torch.Tensor], source: str) -> Session:
        """The session of a session.json that `archive.read` returned and its tensors, checked in full."""
        kwargs, checked = session_fields(doc["session"], tensors, source)
        s = cls(**kwargs)
        s.arrays = checked
        return s


# the schema has one spec per field that session.json holds
assert set(SESSION_FIELDS) == {f.name for f in fields(Session)} - {"arrays"}, "schema.SCHEMA and Session disagree"


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
