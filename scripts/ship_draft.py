"""Ship a trained draft inside the package as `--draft builtin` (layerscope/draft/builtin.py).

    python scripts/ship_draft.py DRAFT_DIR --command "layerscope train-draft ..." [--model smollm2-135m]

DRAFT_DIR: a draft directory or the key of a draft in the store ($LAYERSCOPE_STORE). The draft is checked
against the target, written in bfloat16 to layerscope/data/drafts/<slot>/ (replaced whole) with TRAINED.md,
and its size printed. Commit the folder: `pip install .` carries it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerscope.draft import builtin
from layerscope.errors import LayerScopeError
from layerscope.store import Store, default_root
from layerscope.target.aliases import DEFAULT_MODEL
from layerscope.target.load import load_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("draft", help="draft directory or store key")
    p.add_argument("--command", required=True, help="the command that trained it (written into TRAINED.md)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target it ships for (default %(default)s)")
    p.add_argument("--store", default=None, help="artifact store (default: $LAYERSCOPE_STORE)")
    args = p.parse_args(argv)
    try:
        store = Store(args.store or default_root())
        src = builtin.resolve(args.draft, args.model, store)
        target = load_model(args.model, store=store)
        out = builtin.ship(src, args.model, args.command, target=target)
    except LayerScopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in Path(out).iterdir())
    print(f"shipped {src} as the builtin draft for {args.model}: {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
