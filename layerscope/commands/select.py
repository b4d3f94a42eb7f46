"""`layerscope select KEY`: propose the layers an EAGLE-3 draft should read, or compare strategies."""

from __future__ import annotations

from layerscope import layerset
from layerscope.capture.stored import open_capture
from layerscope.commands.analyze import add_analysis_arguments, load_stats, token_line
from layerscope.commands.common import open_store, parse_layers, print_json
from layerscope.stats.select import NEEDS_PROBE, REGISTRY, describe
from layerscope.steps import workflow

NAME = "select"
HELP = "propose a layer set for an EAGLE-3 draft from the layer statistics (or --compare all strategies)"


def add_arguments(p) -> None:
    d = workflow.SelectOptions()
    add_analysis_arguments(p)
    p.add_argument("--k", type=int, default=d.k, help="number of layers (default %(default)s)")
    p.add_argument("--strategy", choices=list(REGISTRY), default=d.strategy,
                   help="default: aggregate, or manual when --layers is given; "
                        + "; ".join(f"{name}: {desc}" for name, desc in describe()).replace("%", "%%"))
    p.add_argument("--lam", type=float, default=d.lam,
                   help="λ: weight of redundancy in greedy mRMR and in the mrmr score (default %(default)s)")
    p.add_argument("--layers", default=None, help="a manual set, e.g. 2,15,27 (scored like the others)")
    p.add_argument("--compare", action="store_true", default=d.compare,
                   help="run every strategy and print them side by side")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args) -> int:
    layers = parse_layers(args.layers) if args.layers is not None else None    # "" is refused, not ignored
    if layers is not None:             # before the statistics are computed: the capture's depth is in its manifest
        layerset.check(layers, open_capture(open_store(args), args.key).num_layers, "--layers")
    options = workflow.SelectOptions(k=args.k, strategy=args.strategy, lam=args.lam, compare=args.compare,
                                     layers=tuple(layers) if layers is not None else None)
    stats = load_stats(args)
    probe = workflow.probe_input(open_store(args), args.key) if options.strategy in NEEDS_PROBE else None
    sels = workflow.select(stats, options, probe=probe)
    if args.compare:
        if args.json:
            print_json([s.to_dict() for s in sels])
            return 0
        print(token_line(stats))
        print(f"\n{'strategy':<13} {'layers':<18} {'score':>7} {'mean H':>7} {'H/Hmax':>7} {'mean CKA':>8} "
              f"{'mrmr':>7}  objective")
        for s in sels:
            e = s.explanation
            obj = e["objective"]
            print(f"{s.strategy:<13} {str(s.layers):<18} {s.score:>7.4f} {e['mean_entropy']:>7.4f} "
                  f"{e['mean_entropy_normalized']:>7.4f} {e['mean_cka']:>8.4f} {e['mrmr']:>7.4f}  "
                  f"{obj['name']} = {obj['value']:.4f}")
        spread = next(s for s in sels if s.strategy == "spread")
        print(f"\nscore: aggregate entropy of the set (α=2, nats); mrmr: mean normalized entropy − {args.lam:g}·mean CKA")
        print("compartments (spread): " + ", ".join(f"{f}-{e}" for f, e in spread.explanation["compartments"]))
        return 0
    sel = sels[0]
    if args.json:
        print_json(sel.to_dict())
        return 0
    e = sel.explanation
    print(f"{sel.strategy}: layers {sel.layers}   score {sel.score:.4f} (aggregate entropy, α=2, nats)")
    if e.get("note"):
        print(f"note: {e['note']}")
    print(f"objective: {e['objective']['name']} = {e['objective']['value']:.4f}")
    print(f"\n{'layer':>5}  {'entropy':>8}  {'normalized':>10}   CKA to the others in the set")
    for i, l in enumerate(sel.layers):
        others = "  ".join(f"{sel.layers[j]}:{e['cka'][i][j]:.3f}" for j in range(len(sel.layers)) if j != i)
        print(f"{l:>5}  {e['entropy'][i]:>8.4f}  {e['entropy_normalized'][i]:>10.4f}   {others}")
    print(f"\nmean entropy {e['mean_entropy']:.4f} nats (normalized {e['mean_entropy_normalized']:.4f}), "
          f"mean pairwise CKA {e['mean_cka']:.4f}, mrmr (λ={e['lam']:g}) {e['mrmr']:.4f}")
    if "compartments" in e:
        print("compartments: " + ", ".join(f"{f}-{l}" for f, l in e["compartments"]))
    print(token_line(stats))
    return 0
