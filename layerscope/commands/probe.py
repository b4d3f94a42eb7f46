"""`layerscope probe KEY`: how well a closed-form ridge map of a draft's inputs predicts the target, per layer set."""

from __future__ import annotations

from layerscope.commands.common import Progress, open_store, parse_layers, parse_list, print_json
from layerscope.steps import workflow
from layerscope.study import probe as probe_mod

NAME = "probe"
HELP = ("score layer sets without training: a ridge map from the set's hidden states and the next token's "
        "embedding to the target's final state, its held-out agreement with the target's argmax and explained "
        "variance (--layers sets, or --search over the layers)")


def add_arguments(p) -> None:
    d = probe_mod.ProbeOptions()
    p.add_argument("key", help="capture key (a unique prefix is enough)")
    p.add_argument("--layers", action="append", default=[], metavar="L1,L2,...", help="a layer set to score (repeatable)")
    p.add_argument("--search", choices=probe_mod.SEARCHES, default=None,
                   help=f"search the layers for the best k-set: greedy forward selection, or greedy then one-layer "
                        f"swaps (default without --layers: {d.search})")
    p.add_argument("--k", type=int, default=3, help="layers per searched set (default %(default)s)")
    p.add_argument("--candidates", default=None, metavar="L1,L2,...", help="layers the search may pick (default: all)")
    p.add_argument("--objective", choices=probe_mod.OBJECTIVES, default=d.objective,
                   help="what λ and the search optimise on the validation split: loss (squared logit error) or "
                        "agreement (slower) (default %(default)s)")
    p.add_argument("--lambdas", default=",".join(f"{x:g}" for x in d.lambdas), metavar="R1,R2,...",
                   help="the λ grid: each column is penalised by λ × its own centred sum of squares "
                        "(default %(default)s)")
    p.add_argument("--top", type=int, default=d.top, help="sets a search reports (default %(default)s)")
    p.add_argument("--max-memory-gb", type=float, default=d.max_memory_gb,
                   help="refuse a probe that would hold more than this many GB (default: three quarters "
                        "of the memory available when it starts, at least 6)")
    p.add_argument("--model", default=None, help="target model spec (default: the capture's model)")
    p.add_argument("--fresh", action="store_true", help="recompute instead of using the stored result")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    sets = [parse_layers(x) for x in args.layers]
    options = probe_mod.ProbeOptions(search=args.search or probe_mod.ProbeOptions().search, objective=args.objective,
                                     lambdas=tuple(parse_list(args.lambdas, "--lambdas", float)), top=args.top,
                                     max_memory_gb=args.max_memory_gb,
                                     candidates=tuple(parse_layers(args.candidates)) if args.candidates else None)
    options.validate()                                       # bad options fail before the model loads
    store = open_store(args)
    source = workflow.probe_input(store, args.key, options, model=args.model)
    cache = None if args.fresh else store
    with Progress("probe", unit="%") as bar:
        def show(frac, msg=""):
            bar.update(round(100 * frac), 100, step=msg)
        if args.search or not sets:
            report = probe_mod.search(source.cap, source.target, args.k, options, sets=sets, store=cache, progress=show)
        else:
            report = probe_mod.score_sets(source.cap, source.target, sets, options, store=cache, progress=show)
    if args.json:
        print_json(report.to_json())
        return 0
    print(format_report(report))
    return 0


def format_report(report: probe_mod.ProbeReport) -> str:
    pos, convs = report.positions, report.conversations
    lines = [f"capture {report.capture}: {report.tokens} tokens; counted response positions fit {pos['fit']} "
             f"({convs['fit']} conversations), validation {pos['validation']} ({convs['validation']}), held-out "
             f"{pos['held_out']} ({convs['held_out']})", ""]
    lines.append(f"{'layers':<18} {'source':<7} {'agreement':>9} {'expl.var':>8} {'lambda':>10} {'val loss':>10}")
    for s in report.sets:
        lines.append(f"{str(s.layers):<18} {s.source:<7} {s.agreement:>9.4f} {s.explained_variance:>8.4f} "
                     f"{s.lam:>10.3g} {s.val_loss:>10.4g}")
    lines.append("")
    lines.append("agreement: held-out positions where the target's lm_head on the predicted final state gives the "
                 "target's own argmax (comparable to a draft's held-out agreement at position 1)")
    if report.search:
        r = report.search
        path = " -> ".join(f"{m['move']} {m['layers']}" for m in r["path"])
        lines.append(f"search: {r['method']} over {len(r['candidates'])} layers, k={r['k']}, objective {r['objective']}, "
                     f"{r['passes']} swap passes: {path}")
        fewer = report.smaller_was_better()
        if fewer is not None:
            lines.append(f"note: {fewer['layers']} ({len(fewer['layers'])} layers) had a lower validation loss "
                         f"({fewer['val_loss']:.4g}) than the best {r['k']}-layer set ({report.best().val_loss:.4g}): "
                         f"on this capture more layers overfit the map (a bigger capture, or a smaller --k)")
    lines.append(f"{report.scored} sets fitted in {report.seconds:.1f} s" + (" (from the store)" if report.cached else ""))
    return "\n".join(lines)
