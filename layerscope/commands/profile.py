"""`layerscope profile`: what a verification forward over T tokens and a draft step cost on this machine."""

from __future__ import annotations

import sys

from layerscope import quietness
from layerscope.commands.common import Progress, add_wait_quiet, machine_options, open_store, print_json
from layerscope.decoding import costmodel
from layerscope.decoding.specdec import DEFAULT_K, decoding_draft
from layerscope.draft import builtin
from layerscope.draft.checkpoint import load_draft
from layerscope.steps import preflight, workflow
from layerscope.target.aliases import DEFAULT_MODEL
from layerscope.validate import check_number

NAME = "profile"
HELP = ("measure the target's cost curve (seconds of a forward over T = 1..32 new tokens) and a draft step on "
        "this device and thread count; print it with the break-even tau of each decoding (cached in the store)")


def add_arguments(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model spec (default %(default)s)")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="draft directory, store key (or a unique prefix), or `builtin` (default: an untrained draft "
                        "of the default shape: it costs the same)")
    p.add_argument("--max-tokens", type=int, default=costmodel.MAX_TOKENS,
                   help="longest verification forward measured (default %(default)s)")
    p.add_argument("--repeats", type=int, default=costmodel.REPEATS, help="timings per point (default %(default)s)")
    p.add_argument("--fresh", action="store_true",
                   help="measure again instead of reading the stored curve (only a curve measured on a quiet machine "
                        "is ever read back)")
    add_wait_quiet(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args) -> int:
    check_number("--max-tokens", args.max_tokens, minimum=2, maximum=costmodel.MAX_TOKENS_LIMIT, integer=True)
    check_number("--repeats", args.repeats, minimum=1, maximum=costmodel.MAX_REPEATS, integer=True)
    store = open_store(args)
    path = builtin.resolve(args.draft, args.model, store) if args.draft else None
    if path:
        preflight.draft_dir(path)           # before the model loads
    target = workflow.load_target(args.model, store)
    target.check_room(max(costmodel.CACHE_LENGTHS), args.max_tokens, "the longest prefix measured", "--max-tokens")
    draft = decoding_draft(load_draft(path, target), target) if path else None
    options = machine_options(args)
    with Progress("profile", unit="") as bar:
        curve = costmodel.cost_curve(target, store, draft, fresh=args.fresh, max_tokens=args.max_tokens,
                                     repeats=args.repeats, machine_options=options,
                                     progress=lambda message, eta_s=None: bar.update(0, None, phase=message))
    taus = costmodel.break_even_taus(curve)
    doc = curve.to_json() | {"model": target.spec, "break_even_tau": taus[f"chain k={DEFAULT_K}"],
                             "break_even_tau_by_decoding": taus}
    state = quietness.line(curve.machine, "these costs")
    if args.json:
        print_json(doc)
        if curve.machine is not None and not curve.machine.quiet:
            print(state, file=sys.stderr)
        return 0
    print(f"{target.spec} on {curve.device} ({curve.dtype}, {curve.threads} thread{'s' if curve.threads > 1 else ''}); "
          f"prefix lengths {', '.join(map(str, curve.cache_lengths))}")
    print(state or "machine: not recorded")
    base = curve.target_s(1)
    print(f"{'tokens':>6}  {'seconds':>9}  {'x T=1':>6}")
    for T in range(1, len(curve.target) + 1):
        print(f"{T:>6}  {curve.target_s(T):>9.4f}  {curve.target_s(T) / base:>6.2f}")
    print(f"draft step: {curve.draft_s(1):.4f} s ({curve.draft_s(1) / base:.2f}x a one-token forward)")
    print("break-even tau (tokens per step a decoding needs to match plain decoding):")
    for name, tau in taus.items():
        print(f"  {name:<36} {tau:.2f}")
    return 0
