"""`layerscope verify`: the full check of stored captures (schema, sizes, headers, sha256 of every chunk)."""

from __future__ import annotations

from layerscope.capture.stored import list_captures, resolve_capture_key, verify_capture
from layerscope.commands.common import open_store, print_json

NAME = "verify"
HELP = "check stored captures in full (every chunk's checksum); --delete removes the damaged ones"


def add_arguments(p) -> None:
    p.add_argument("keys", nargs="*", help="capture keys or unique prefixes (default: every stored capture)")
    p.add_argument("--delete", action="store_true", help="remove each damaged capture (capture it again afterwards)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    store = open_store(args)
    keys = [resolve_capture_key(store, k) for k in args.keys] or [r["key"] for r in list_captures(store)]
    report = {}
    for key in keys:
        problems = verify_capture(store, key)
        damaged = any("no checksum" not in p for p in problems)
        if damaged and args.delete:
            store.remove("captures", key)
        report[key] = {"ok": not damaged, "problems": problems, "deleted": bool(damaged and args.delete)}
    if args.json:
        print_json(report)
    else:
        if not keys:
            print("no captures to verify")
        for key, r in report.items():
            status = "ok" if r["ok"] else ("damaged, deleted" if r["deleted"] else "DAMAGED")
            print(f"{key}  {status}" + "".join(f"\n    {p}" for p in r["problems"]))
    return 0 if all(r["ok"] or r["deleted"] for r in report.values()) else 1
