"""Helpers every subcommand uses: the store, JSON output, a progress bar on stderr, and the options several
commands share (lists, layer sets, the training flags of train-draft and study, --wait-quiet)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from tqdm import tqdm

from layerscope import eta, layerset
from layerscope.draft.training.fit import TRAIN_DTYPES, TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.errors import LayerScopeError
from layerscope.quietness import WAIT_S, MachineOptions
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


def parse_list(text: str, flag: str, kind) -> list:
    """'0,1,2' -> [0, 1, 2] (kind int) or finite floats (kind float); a clear error for anything else."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LayerScopeError(f"{flag} {text!r} is not a comma-separated list of {kind.__name__}s",
                              f"Write it like {flag} 0,1") from None
    if kind is float and any(not math.isfinite(v) for v in values):
        raise LayerScopeError(f"{flag} {text!r} holds a value that is not a finite number", f"Write it like {flag} 0,1")
    return values


def add_training_arguments(p) -> None:
    """The training flags train-draft and study share, written once (defaults: TrainOptions and OnlineOptions): the
    budget (--steps, --tokens, --time), the recipe (--ttt-steps, --batch-size, --seq-len, --lr, --fc-norm,
    --draft-intermediate) and online training's data (--responses, --val-conversations)."""
    t, on = TrainOptions(), OnlineOptions()
    p.add_argument("--steps", type=int, default=t.steps,
                   help="training budget per draft, in optimizer steps (training from a capture: default 300 on a "
                        "CPU, 2000 on a GPU)")
    p.add_argument("--tokens", default=None, help="budget in tokens through the draft, e.g. 2M or 500k")
    p.add_argument("--time", default=None, help="budget in training time, e.g. 45m, 2h, 1h30m")
    p.add_argument("--ttt-steps", type=int, default=t.ttt_steps,
                   help="unrolled draft steps in training, 1..7 (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=t.batch_size,
                   help="windows per step (online: conversations per step); default %(default)s")
    p.add_argument("--seq-len", type=int, default=t.seq_len, help="rows per draft window (default %(default)s)")
    p.add_argument("--lr", type=float, default=t.lr, help="learning rate (default %(default)s)")
    p.add_argument("--fc-norm", action=argparse.BooleanOptionalAction, default=t.fc_norm,
                   help="an RMSNorm on each auxiliary layer's state before fc (EAGLE-3.1: the layers' states have very "
                        "different norms, and the largest dominate fc); saved as fc_norm, which vLLM, SGLang, "
                        "SpecForge and speculators read")
    p.add_argument("--train-dtype", choices=TRAIN_DTYPES, default=t.train_dtype,
                   help="the draft's forward and backward in training: float32 (default) or bfloat16 (autocast; "
                        "weights, optimizer and the target's logits stay float32): 2.4x faster on a CPU with AMX")
    p.add_argument("--draft-intermediate", type=int, default=t.draft_intermediate, metavar="N",
                   help="the draft's MLP width (default: the target's, as EAGLE-3 builds it; a narrower one makes a "
                        "large target's draft smaller and cheaper to train: 1024 on Qwen2.5-Coder 1.5B halves it)")
    p.add_argument("--responses", default=on.responses, choices=["regenerate", "own"],
                   help="online: 'regenerate' = the target's own greedy answers, generated once and stored as token "
                        "ids (EAGLE-3's choice); 'own' = the conversations' own assistant turns (ShareGPT, faster) "
                        "(default %(default)s)")
    p.add_argument("--val-conversations", type=int, default=on.val_conversations,
                   help="online: held-out training conversations for the learning curve (default %(default)s)")


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


LOG_EVERY_S = 30.0          # stderr not a terminal (a long run's log): one line this often, not a frame a second;
LOG_EVERY_ENV = "LAYERSCOPE_PROGRESS_EVERY"   # seconds, to say otherwise (0: a line every update, as the tests read)


class Progress:
    """A tqdm bar on stderr driven by callbacks: `update(done, total, eta_s=..., **postfix)`; eta_s (seconds, or
    None while estimating) is the time left of the current phase as the step measured it (layerscope.eta).
    Where stderr is not a terminal (a log file) the bar is a line every LOG_EVERY_S seconds and one at the end:
    a 5-hour run's log of carriage-return frames was thousands of redraws on one line."""

    def __init__(self, desc: str, unit: str = "tok", enabled: bool = True, clock=time.monotonic):
        self.log = not sys.stderr.isatty()
        try:
            self.every = max(0.0, float(os.environ.get(LOG_EVERY_ENV) or LOG_EVERY_S))
        except ValueError:                                          # not a number: the default, as if unset
            self.every = LOG_EVERY_S
        self.clock, self.last = clock, None
        self.bar = tqdm(desc=desc, unit=unit, file=sys.stderr, disable=not enabled, dynamic_ncols=True, bar_format=BAR,
                        **({"mininterval": float("inf"), "delay": float("inf")} if self.log else {}))

    def update(self, done: int, total: int | None = None, eta_s=NO_ETA, **postfix) -> None:
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.bar.n = done
        parts = [f"{k}={f'{v:.3g}' if isinstance(v, float) else v}" for k, v in postfix.items()]
        if eta_s is not NO_ETA:
            parts.append(eta.text(eta_s))
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
        if not self.log:
            self.bar.refresh()
        elif not self.bar.disable and (self.last is None or self.clock() - self.last >= self.every):
            self.last = self.clock()
            sys.stderr.write(f"{self.bar}\n")                        # a line, no redraw after it
            sys.stderr.flush()

    def note(self, line: str) -> None:
        """A line on stderr above the bar (the bar is redrawn below it; in a log, just the line)."""
        if self.log:
            sys.stderr.write(f"{line}\n")
            sys.stderr.flush()
        else:
            self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        if self.log and not self.bar.disable and self.last is not None:
            sys.stderr.write(f"{self.bar}\n")                        # where it ended (tqdm draws nothing here)
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
