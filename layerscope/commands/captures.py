"""`layerscope captures`: list stored captures, with the damaged and unfinished ones marked and their fix."""

from __future__ import annotations

from layerscope.capture.stored import list_captures, verify_capture
from layerscope.commands.common import open_store, print_json

NAME = "captures"
HELP = "list stored captures (key, model, prompts, tokens, size, date, state; damaged and unfinished ones with their fix)"


def add_arguments(p) -> None:
    p.add_argument("--verify", action="store_true",
                   help="also check every chunk's sha256 now (reads every byte; without it, sizes and headers are "
                        "checked, and checksums when a capture is first read)")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    store = open_store(args)
    if args.verify:
        for r in list_captures(store):
            if r["state"] == "ok":
                verify_capture(store, r["key"])        # a mismatch is remembered: the listing below says DAMAGED
    rows = list_captures(store, incomplete=True)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no captures yet: run `layerscope capture`")
        return 0
    print(f"{'key':<24}  {'state':<10} {'model':<16} {'prompts':<16} {'conv':>5} {'tokens':>8} {'size':>9}  created")
    for r in rows:
        state = "ok" if r["state"] == "ok" else r["state"].upper()
        if r["state"] == "damaged":          # its manifest cannot be trusted: no counts shown
            r = {**r, "conversations": None, "tokens": None}
        print(f"{r['key']:<24}  {state:<10} {_cell(r['model'])[:16]:<16} {_cell(r['prompt_set'])[:16]:<16} "
              f"{_cell(r['conversations']):>5} {_cell(r['tokens']):>8} {r['size_bytes'] / 2**20:>7.1f}MB  "
              f"{r['created'] or '-'}")
        if r["state"] != "ok":
            print(f"{'':<26}{r['problem']}. {r['fix']}")
    if not args.verify:
        print("\nok: sizes and headers checked; checksums are checked when a capture is first read, and by "
              "`layerscope captures --verify`")
    bad = {s: sum(r["state"] == s for r in rows) for s in ("damaged", "incomplete")}
    if any(bad.values()):
        print(f"\n{len(rows) - sum(bad.values())} usable, " + ", ".join(f"{n} {s}" for s, n in bad.items() if n)
              + ": only usable captures can be analysed (the line under each other one says what to do)")
    return 0


def _cell(value) -> str:
    return "-" if value is None else str(value)
