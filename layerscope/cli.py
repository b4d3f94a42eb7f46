"""The `layerscope` command: one subcommand per module in `layerscope/commands/`.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
Every command takes `--store DIR` (else $LAYERSCOPE_STORE, else ./cache under the working directory)
and most take `--json`. The steps themselves are in layerscope/workflow.py; a command parses and prints.
A `LayerScopeError` prints its message and exits 2, and so does an OSError of a full or read-only disk
(store.as_write_error); nothing else is caught.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from safetensors import SafetensorError

from layerscope.commands.common import STORE_HELP
from layerscope.errors import LayerScopeError
from layerscope.store import as_write_error, default_root
from layerscope.validate import OneLineParser

COMMAND_MODULES = [
    "capture",
    "import_states", "export_states",
    "captures",
    "analyze",
    "select",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except LayerScopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, SafetensorError) as e:     # the last resort for a write that met a full or read-only disk
        error = as_write_error(e, where=Path(args.store).expanduser() if args.store else default_root())
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
