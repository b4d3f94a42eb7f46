"""A study's finished drafts as small JSON files: what outlives the machine that trained them.

A study of strong drafts is hours of CPU per training seed, longer than one sitting on a small machine,
and the store that holds its drafts (tens of MB each) may not come back. What the study's statistics
need of a finished draft is small: its record (layerscope.json: held-out agreement, learning curve,
options) and its benchmark (the entry and the per-prompt totals against plain decoding in the same run).
`StudyOptions.outcomes` names a folder that keeps exactly that, one file per (layer set, training seed):

    <folder>/<layers>-seed<seed>-<key>.json   {"format", "key", "identity", "layers", "seed", "draft",
                                               "meta", "result", "per_prompt", "machine", "baseline"}

`identity` is everything that decides the outcome before anything is trained: the target, the layers,
the training (the capture or the online data, every option, the seed, the starting drafts) and the
benchmark (prompt set content, new tokens, depth, device). A study finds a (set, seed) there by the key
of that identity, and neither trains nor benchmarks it again; so a folder committed to a repository
carries a long study across machines, and a re-run on another machine reproduces the report from it.
Files are written atomically, one when its draft has been benchmarked; a file that is damaged or names
another identity is one clear error, never silently replaced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError
from layerscope.stats.paired import PromptRuns
from layerscope.store import atomic_write_json, make_key

FORMAT = 1
MAX_BYTES = 4 * 2**20                 # one outcome is ~20-60 kB (the draft's record and per-prompt totals)
NAME = re.compile(r"^[0-9-]+-seed-?[0-9]+-[0-9a-f]{24}\.json$")


class OutcomeError(LayerScopeError):
    """A study outcome file that cannot be used."""


@dataclass
class Outcome:
    """One finished (layer set, training seed) of a study: all its statistics read of the draft."""
    layers: list[int]
    seed: int
    draft: str                        # where the draft was written (it may be gone: the outcome is enough)
    meta: dict                        # the draft's layerscope.json
    result: dict                      # its benchmark entry (bench.measure's result for the draft)
    per_prompt: PromptRuns            # per-prompt totals, against plain decoding in the same run
    machine: dict | None              # the machine during that benchmark (layerscope.quietness)
    baseline: dict                    # plain decoding's entry of the same run

    def to_json(self) -> dict:
        return {"layers": self.layers, "seed": self.seed, "draft": self.draft, "meta": self.meta,
                "result": self.result, "per_prompt": self.per_prompt.to_json(), "machine": self.machine,
                "baseline": self.baseline}

    @classmethod
    def from_json(cls, d: dict) -> "Outcome":
        return cls(layers=[int(x) for x in d["layers"]], seed=int(d["seed"]), draft=str(d["draft"]),
                   meta=dict(d["meta"]), result=dict(d["result"]), per_prompt=PromptRuns.from_json(d["per_prompt"]),
                   machine=d.get("machine"), baseline=dict(d.get("baseline") or {}))


def file_name(layers: list[int], seed: int, key: str) -> str:
    return f"{'-'.join(map(str, layers))}-seed{seed}-{key}.json"


class OutcomeFolder:
    """The outcome files of one folder, found by identity key."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise OutcomeError(f"Study outcomes {self.root} is a file, not a folder",
                               "Pass a folder (it is created when missing) to --outcomes")

    def get(self, identity: dict) -> Outcome | None:
        """The outcome of `identity` (a dict: see the module docstring), or None when the folder has none."""
        key = make_key(identity)
        hits = sorted(self.root.glob(f"*-{key}.json")) if self.root.is_dir() else []
        if not hits:
            return None
        path = hits[0]
        what = f"Study outcome {path}"
        fix = f"Remove {path.name} from {self.root} to train and benchmark that draft again"
        d = jsonsafe.loads(path.read_bytes(), what=what, error=OutcomeError, max_bytes=MAX_BYTES, fix=fix)
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("key") != key:
            raise OutcomeError(f"{what} is not a format-{FORMAT} outcome of key {key}", fix)
        if make_key(d.get("identity")) != key:
            raise OutcomeError(f"{what} names an identity whose key is not {key} (edited by hand?)", fix)
        try:
            return Outcome.from_json(d)
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise OutcomeError(f"{what} lacks a field or has one of the wrong type ({str(e)[:120]})", fix) from None

    def put(self, identity: dict, outcome: Outcome) -> Path:
        key = make_key(identity)
        path = self.root / file_name(outcome.layers, outcome.seed, key)
        atomic_write_json(path, {"format": FORMAT, "key": key, "identity": identity, **outcome.to_json()})
        return path

    def listing(self) -> list[tuple[Path, dict]]:
        """Every outcome file of the folder with its parsed JSON, by name (for a status table; no identity check)."""
        out = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            if NAME.match(path.name):
                out.append((path, jsonsafe.loads(path.read_bytes(), what=f"Study outcome {path}", error=OutcomeError,
                                                 max_bytes=MAX_BYTES)))
        return out

    def __len__(self) -> int:
        return sum(1 for p in self.root.glob("*.json") if NAME.match(p.name)) if self.root.is_dir() else 0
