"""The `layerscope` command: one subcommand per module in `layerscope/commands/`.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
Every command takes `--store DIR` (else $LAYERSCOPE_STORE, else ./cache under the working directory)
and most take `--json`. The steps themselves are in layerscope/steps/workflow.py; a command parses and prints.
A `LayerScopeError` prints its message and exits 2, and so does an OSError of a full or read-only disk
(store.as_write_error); nothing else is caught.

SIGTERM (`kill`, a scheduler's stop, `timeout`) stops a command exactly as Ctrl-C (SIGINT) does: it goes to
whatever handles SIGINT at that moment (`interrupts`), so online training saves a checkpoint and stops between
steps, and anything else raises KeyboardInterrupt where it is (temporary files are removed, locks freed,
finished chunks kept). Either way the command ends with one `error:` line that says how to resume, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from pathlib import Path

from safetensors import SafetensorError

from layerscope.commands.common import STORE_HELP
from layerscope.errors import LayerScopeError
from layerscope.store import RESUME, as_write_error, default_root
from layerscope.validate import OneLineParser

COMMAND_MODULES = [
    "capture",
    "import_states", "export_states",
    "captures",
    "analyze",
    "select",
    "recommend",
    "probe",
    "train_draft",
    "bench",
    "study",
    "verify",
    "export", "check_draft",
    "profile",
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="layerscope", description=__doc__.splitlines()[0],   # finite floats, one-line errors
                                     epilog=f"Every command takes --store DIR: the {STORE_HELP}.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"layerscope.commands.{name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        p.add_argument("--store", default=None, help=STORE_HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


@contextlib.contextmanager
def interrupts():
    """While in effect, SIGTERM is handled as SIGINT is: by the SIGINT handler of the moment (Python's, which
    raises KeyboardInterrupt, or online training's, which stops after the step), else by a KeyboardInterrupt.
    Yields the list of signals received (their names), for the line that ends the command."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():      # signals reach the main thread only
        yield received
        return

    def on_sigint(signum, frame):
        received.append("SIGINT")
        raise KeyboardInterrupt

    def on_sigterm(signum, frame):
        received.append("SIGTERM")
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not on_sigint:
            handler(signal.SIGINT, frame)
        else:                                   # Python's own, ignored (a background job) or the default
            raise KeyboardInterrupt

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # Python's: the same, and it says which
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


RESUMING = ("capture", "train-draft", "study", "import-states")    # the commands that keep what they finished
                                                                 # (train-draft online only: from a capture, none)


def main(argv: list[str] | None = None) -> int:
    args = None
    with interrupts() as received:
        try:
            args = build_parser().parse_args(argv)
            return int(args._run(args) or 0)
        except LayerScopeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (OSError, SafetensorError) as e:     # the last resort for a write that met a full or read-only disk
            store = getattr(args, "store", None)
            error = as_write_error(e, where=Path(store).expanduser() if store else default_root())
            if error is None:
                raise
            print(f"error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            how = received[-1] if received else "SIGINT"
            command = getattr(args, "command", None)
            if command == "train-draft" and getattr(args, "key", None) is not None:     # no checkpoint to resume from
                fix = ("Run the same command again: training from a capture keeps no checkpoint, so it starts over "
                       "(online training, --model, resumes from its last checkpoint)")
            elif command in RESUMING:
                fix = RESUME[0].upper() + RESUME[1:]
            else:
                fix = f"Run the same command again: `{command or 'layerscope'}` keeps nothing of an unfinished run, so it starts over"
            print(f"error: {LayerScopeError(f'Interrupted by {how}', fix)}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
