"""`layerscope analyze KEY`: per-layer matrix entropy, pairwise CKA and the tokens they were computed on."""

from __future__ import annotations

from layerscope.commands.common import Progress, open_store, print_json
from layerscope.stats.analysis import AnalysisOptions, LayerStats, sample_note
from layerscope.stats.entropy import KERNELS
from layerscope.steps import workflow

NAME = "analyze"
HELP = "matrix entropy per layer and CKA between layers of a stored capture (cached in the store)"


def add_analysis_arguments(p) -> None:
    """The options that define a set of statistics (shared with `layerscope select`); defaults: AnalysisOptions."""
    d = AnalysisOptions()
    p.add_argument("key", help="capture key (a unique prefix is enough; see `layerscope captures`)")
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help="Rényi order of the matrix entropy (1 = von Neumann; default %(default)s)")
    p.add_argument("--min-entropy", type=float, default=d.min_entropy,
                   help="keep tokens whose predictive entropy is at least this many nats (0: keep all; default %(default)s)")
    p.add_argument("--quantile", type=float, default=d.quantile,
                   help="keep tokens at or above this quantile of predictive entropy (overrides --min-entropy)")
    p.add_argument("--all-tokens", action="store_true", default=not d.response_only,
                   help="prompt tokens too, not only the target's responses")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="random subsample cap on kept tokens (0: no cap; default %(default)s)")
    p.add_argument("--outlier-factor", type=float, default=d.outlier_factor,
                   help="drop tokens whose norm at some layer exceeds this × the median (0: keep them; default %(default)s)")
    p.add_argument("--rank", type=int, default=d.rank, help="low-rank CKA with an error bound (faster); default exact")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the token subsample")
    p.add_argument("--kernel", choices=KERNELS, default=d.kernel,
                   help="token preparation of entropy and CKA: linear = standard linear CKA (Kornblith et al. 2019, "
                        "centred columns; default), cosine = tokens scaled to unit length first")


def options_from_args(args) -> AnalysisOptions:
    return AnalysisOptions(alpha=args.alpha, min_entropy=args.min_entropy, quantile=args.quantile,
                           response_only=not args.all_tokens, outlier_factor=args.outlier_factor or None,
                           max_tokens=args.max_tokens or None, seed=args.seed, rank=args.rank,
                           kernel=args.kernel)


def load_stats(args) -> LayerStats:
    """workflow.analyze: the capture's LayerStats for these options, from the store or computed (progress on stderr)."""
    with Progress("analyze", unit="%") as bar:
        return workflow.analyze(open_store(args), args.key, options_from_args(args),
                                progress=lambda frac, msg="": bar.update(round(100 * frac), 100, step=msg))


def add_arguments(p) -> None:
    add_analysis_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def token_line(stats) -> str:
    t = stats.tokens
    scope = "response tokens" if t.get("response_only") else "all tokens"
    cap = f", capped at {t['cap']}" if t.get("cap") and t.get("tokens_eligible", 0) > t["cap"] else ""
    rule = f"quantile {t['quantile']:g} = " if t.get("quantile") is not None else ""
    sampled = f"; the capture's tokens are {sample_note(stats.sample_positions)}" if stats.sample_positions else ""
    return (f"tokens: {stats.tokens_kept} of {stats.tokens_total} kept ({scope}; dropped {t.get('sink_dropped', 0)} "
            f"position-0 sinks, {stats.outliers_dropped} massive-activation outliers, "
            f"{t.get('low_entropy_dropped', 0)} below the entropy threshold {rule}{stats.threshold:.3g} nats{cap}"
            f"{sampled})")


def kernel_name(kernel: str) -> str:
    return {"linear": "standard linear CKA (centred columns)",
            "cosine": "cosine-kernel CKA (linear CKA of unit-length tokens)"}.get(kernel, f"CKA ({kernel})")


def print_matrix(m, fmt: str = "{:5.2f}") -> None:
    n = len(m)
    print("      " + "".join(f"{j:>5d}" for j in range(n)))
    for i, row in enumerate(m):
        print(f"{i:>5d} " + "".join(fmt.format(v) for v in row))


def run(args) -> int:
    stats = load_stats(args)
    if args.json:
        out = stats.to_dict()
        out.pop("token_entropy")          # bulk data for the app's histogram
        print_json(out)
        return 0
    N = stats.num_layers
    print(f"capture {stats.capture_key} ({stats.model}): layers 0..{N}, d={stats.hidden_size}; "
          f"layer {N} is the final state ({stats.final_state}), drafts read 0..{N - 1}")
    print(token_line(stats))
    print(f"\nmatrix entropy, Rényi α={stats.alpha:g}, {stats.kernel} kernel (nats); normalized by log min(n, d); "
          f"per-prompt = mean over {stats.prompts_used} conversations")
    print(f"{'layer':>5}  {'entropy':>8}  {'normalized':>10}  {'per-prompt':>10}")
    for l in range(N + 1):
        print(f"{l:>5}  {stats.entropy[l]:>8.4f}  {stats.entropy_normalized[l]:>10.4f}  {stats.entropy_prompt[l]:>10.4f}")
    blocks = ", ".join(f"{f}-{e}" for f, e in stats.compartments)
    print(f"\ncompartments of layers 0..{N - 1} (contiguous clusters of the CKA matrix): {blocks}")
    note = "" if stats.cka_bound is None else \
        f", low rank: error at most {max(max(r) for r in stats.cka_bound):.3g}"
    print(f"\n{kernel_name(stats.kernel)} (biased, {stats.cka_route}{note}):")
    print_matrix(stats.cka)
    print(f"\n({stats.seconds:.1f} s to compute; cached as analysis {stats.key})")
    return 0
