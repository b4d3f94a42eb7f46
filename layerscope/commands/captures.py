"""`layerscope captures`: list stored captures."""

from __future__ import annotations

from layerscope.commands.common import open_store, print_json

NAME = "captures"
HELP = "list stored captures (key, model, prompts, tokens, size, date)"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    rows = open_store(args).list_captures()
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no captures yet: run `layerscope capture`")
        return 0
    print(f"{'key':<24}  {'model':<16} {'prompts':<16} {'conv':>5} {'tokens':>8} {'size':>9}  created")
    for r in rows:
        print(f"{r['key']:<24}  {str(r['model'])[:16]:<16} {str(r['prompt_set'])[:16]:<16} {r['conversations']:>5} "
              f"{r['tokens']:>8} {r['size_bytes'] / 2**20:>7.1f}MB  {r['created']}")
    return 0
