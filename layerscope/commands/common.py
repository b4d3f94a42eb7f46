"""Helpers every subcommand uses: the store, JSON output, a progress bar on stderr."""

from __future__ import annotations

import json
import sys

from tqdm import tqdm

from layerscope.errors import LayerScopeError
from layerscope.store import Store

STORE_HELP = "artifact store directory (default: $LAYERSCOPE_STORE, else ./cache under the working directory)"


def open_store(args) -> Store:
    """The store at --store, else $LAYERSCOPE_STORE, else ./cache (store.default_root)."""
    return Store(args.store)


def print_json(obj) -> None:
    """Machine-readable output: one JSON document on stdout."""
    print(json.dumps(obj, indent=2, default=float))


def parse_layers(text: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27]; a clear error for anything else."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LayerScopeError(f"--layers {text!r} is not a comma-separated list of integers",
                              "Write it like --layers 2,15,27") from None


class Progress:
    """A tqdm bar on stderr driven by callbacks: `update(done, total, **postfix)`."""

    def __init__(self, desc: str, unit: str = "tok", enabled: bool = True):
        self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, disable=not enabled, dynamic_ncols=True)

    def update(self, done: int, total: int | None = None, **postfix) -> None:
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.bar.n = done
        if postfix:
            self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
