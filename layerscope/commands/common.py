"""Helpers every subcommand uses: the store, JSON output, a progress bar on stderr."""

from __future__ import annotations

import json
import sys

from tqdm import tqdm

from layerscope import eta, layerset
from layerscope.machine import WAIT_S, MachineOptions
from layerscope.store import Store
from layerscope.validate import parse_duration

STORE_HELP = "artifact store directory (default: $LAYERSCOPE_STORE, else ./cache under the working directory)"


def open_store(args) -> Store:
    """The store at --store, else $LAYERSCOPE_STORE, else ./cache (store.default_root)."""
    return Store(args.store)


def print_json(obj) -> None:
    """Machine-readable output: one JSON document on stdout."""
    print(json.dumps(obj, indent=2, default=float))


def parse_layers(text: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27]; a clear error for anything else, an empty list included (layerset.parse)."""
    return layerset.parse(text)


def add_wait_quiet(p) -> None:
    """--wait-quiet [SECONDS] of the commands that time something (profile, bench, study)."""
    q = MachineOptions()
    p.add_argument("--wait-quiet", nargs="?", const=f"{WAIT_S:g}", default=None, metavar="SECONDS",
                   help=f"before timing, wait up to SECONDS (e.g. 300, 10m; default {WAIT_S:g} s) for the machine to "
                        f"be quiet (other processes under {q.max_others_cpu:g} of a core), showing what it sees; if it "
                        f"stays busy, time anyway and mark the result busy")


def machine_options(args) -> MachineOptions:
    """MachineOptions from --wait-quiet (durations as train-draft's --time: 300, 90s, 10m, 1h)."""
    wait = getattr(args, "wait_quiet", None)
    options = MachineOptions(wait_s=parse_duration(wait) if wait is not None else None)
    options.validate()
    return options


NO_ETA = object()           # Progress.update without eta_s: the phase has no time left to say (a wait, a load)
BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"   # tqdm's own rate and time left left out: a bar
                                                                 # spans phases of different speed (layerscope.eta)


class Progress:
    """A tqdm bar on stderr driven by callbacks: `update(done, total, eta_s=..., **postfix)`; eta_s (seconds, or
    None while estimating) is the time left of the current phase as the step measured it (layerscope.eta)."""

    def __init__(self, desc: str, unit: str = "tok", enabled: bool = True):
        self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, disable=not enabled, dynamic_ncols=True, bar_format=BAR)

    def update(self, done: int, total: int | None = None, eta_s=NO_ETA, **postfix) -> None:
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.bar.n = done
        parts = [f"{k}={f'{v:.3g}' if isinstance(v, float) else v}" for k, v in postfix.items()]
        if eta_s is not NO_ETA:
            parts.append(eta.text(eta_s))
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
        self.bar.refresh()

    def note(self, line: str) -> None:
        """A line on stderr above the bar (the bar is redrawn below it)."""
        self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
