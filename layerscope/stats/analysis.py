"""Layer statistics of a capture: per-layer matrix entropy, pairwise CKA, depth compartments.

    stats = analyze(cap, store, AnalysisOptions(alpha=1.0, min_entropy=0.5, kernel="linear"))

1. tokens   one pass over the layers for hidden-state norms, then `metrics.tokens.select_tokens`
            (response tokens, no sinks or massive activations, entropy filter, seeded cap);
2. layers   a second pass reads each layer 0..N at the kept tokens, prepares it once (float64) with
            the `kernel` preparation ("linear": centered columns, standard linear CKA; "cosine":
            also unit rows), takes its entropy (dataset level, and the mean over conversations)
            and stores it float32 in one [n, N+1, d] matrix;
3. pairs    biased and debiased CKA of every pair from that matrix (exact; or low rank with a
            bound when `rank` is set), then contiguous depth compartments of layers 0..N-1.
The result is a `LayerStats`, cached in the store under capture key + options (kernel included).

`LayerStats` is the one statistics contract: `to_json`/`from_json` for the store, the CLI and the
app, `to_arrays`/`from_arrays` (per-layer vectors and matrices as tensors, the rest as JSON) for
sessions. A new statistic is a new field here (listed in ARRAY_FIELDS when it is an array).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch

from layerscope.errors import LayerScopeError
from layerscope.stats import cka as C
from layerscope.stats import entropy as E
from layerscope.stats.compartments import compartments as segment
from layerscope.stats.tokens import OUTLIER_FACTOR, select_tokens
from layerscope.store import make_key
from layerscope.validate import check_number

VERSION = 2                  # bump when the statistics change meaning: old cache entries are ignored
MIN_TOKENS = 8               # fewer kept tokens than this is an error
MIN_PROMPT_TOKENS = 8        # a conversation enters the per-prompt mean with at least this many kept tokens
MAX_COMPARTMENTS = 8
TOKEN_ENTROPY_SAMPLE = 20000  # token entropies kept in the stats for the histogram


@dataclass
class AnalysisOptions:
    alpha: float = 1.0                  # Rényi order of the matrix entropy (1 = von Neumann)
    min_entropy: float | None = 0.5     # keep tokens whose predictive entropy (nats) is at least this
    quantile: float | None = None       # ... or at least this quantile of the eligible tokens' entropies
    response_only: bool = True          # only tokens the target generated
    outlier_factor: float | None = OUTLIER_FACTOR   # drop tokens whose norm exceeds factor × median
    max_tokens: int | None = 8192       # seeded random cap on kept tokens
    seed: int = 0
    rank: int | None = None             # low-rank CKA (interactive); None = exact
    debiased: bool = True               # also compute debiased CKA
    kernel: str = "linear"              # token preparation: "linear" (standard CKA) or "cosine" (unit rows)

    def validate(self) -> None:
        """The kernel by name; every number by layerscope.validate's one rule (finite, inside its range)."""
        if self.kernel not in E.KERNELS:
            raise LayerScopeError(f"kernel must be one of {', '.join(E.KERNELS)} (got {self.kernel!r})",
                                  "Use --kernel linear (standard linear CKA) or --kernel cosine (row-normalised tokens)")
        alpha_fix = "Use 1 for von Neumann entropy, 2 for collision entropy"
        if check_number("alpha", self.alpha, fix=alpha_fix) < 0:     # the wording sessions and users already see
            raise LayerScopeError(f"alpha must be >= 0 (got {self.alpha})", alpha_fix)
        check_number("min_entropy", self.min_entropy, optional=True,
                     fix="Pass e.g. --min-entropy 0.5, or 0 for no token-entropy filter")
        check_number("quantile", self.quantile, minimum=0, maximum=1, below=True, optional=True, fix="Pass e.g. --quantile 0.5")
        check_number("max_tokens", self.max_tokens, minimum=MIN_TOKENS, optional=True, fix="Raise --max-tokens")
        check_number("rank", self.rank, minimum=1, optional=True, fix="Leave it out for exact CKA")
        check_number("outlier_factor", self.outlier_factor, minimum=1, above=True, optional=True,
                     fix="Use e.g. 10 (× the median norm)")


# Fields that hold per-layer vectors or layer×layer matrices (None allowed): tensors in a session.
ARRAY_FIELDS = ("entropy", "entropy_normalized", "entropy2", "entropy_prompt", "entropy_prompt_normalized",
                "cka", "cka_debiased", "cka_bound", "token_entropy")


@dataclass
class LayerStats:
    capture_key: str
    num_layers: int                      # N: layers 0..N, drafts read 0..N-1
    hidden_size: int
    alpha: float
    entropy: list[float]                 # [N+1] nats, all kept tokens together
    entropy_normalized: list[float]      # [N+1] entropy / log min(n, d)
    entropy2: list[float]                # [N+1] α = 2 entropies (aggregate entropy of sets)
    cka: list[list[float]]               # [N+1][N+1] biased linear CKA
    cka_debiased: list[list[float]] | None = None
    cka_bound: list[list[float]] | None = None   # low-rank mode: max |cka - exact cka| per pair
    cka_route: str = ""
    entropy_prompt: list[float] = field(default_factory=list)   # [N+1] mean of per-conversation entropies
    entropy_prompt_normalized: list[float] = field(default_factory=list)
    prompts_used: int = 0                # conversations in the per-prompt mean
    compartments: list[list[int]] = field(default_factory=list)  # layers 0..N-1 in 3 blocks [first, last]
    compartments_by_k: dict[str, list[list[int]]] = field(default_factory=dict)  # "k" -> k blocks, k ≤ 8
    tokens_total: int = 0
    tokens_kept: int = 0
    outliers_dropped: int = 0
    threshold: float = 0.0               # entropy threshold applied (nats)
    tokens: dict = field(default_factory=dict)          # the full token-selection report
    token_entropy: list[float] = field(default_factory=list)   # eligible tokens' entropies (sample), for a histogram
    final_state: str = "post-norm"
    model: str = ""
    options: dict = field(default_factory=dict)
    key: str = ""
    seconds: float = 0.0
    version: int = VERSION
    kernel: str = "linear"               # token preparation of entropy and CKA: "linear" or "cosine"
    sample_positions: int | None = None  # the capture kept a sample of this many positions per conversation (None: all)

    def to_dict(self) -> dict:
        return asdict(self)

    to_json = to_dict

    @staticmethod
    def kernel_of(d: dict) -> str:
        """The kernel statistics in `to_dict` form were computed with (every reader asks here: the pages, the
        Compare page, `from_dict`). Statistics from before the kernel option (no "kernel" key) were computed on
        row-normalised tokens, so they read as "cosine"."""
        return str(d.get("kernel") or (d.get("options") or {}).get("kernel") or "cosine")

    @classmethod
    def from_dict(cls, d: dict) -> "LayerStats":
        """From `to_dict` output; unknown keys are ignored; the kernel by `kernel_of`."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["kernel"] = cls.kernel_of(d)
        return cls(**kwargs)

    from_json = from_dict

    def to_arrays(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(arrays, rest): ARRAY_FIELDS that are set as float64 tensors; every other field as JSON."""
        return split_arrays(self.to_dict())

    @classmethod
    def from_arrays(cls, arrays: dict[str, torch.Tensor], rest: dict) -> "LayerStats":
        return cls.from_dict(join_arrays(arrays, rest))


def split_arrays(stats: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A statistics dict -> (ARRAY_FIELDS that are not None as float64 tensors, the other keys)."""
    arrays = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in stats.items()
              if k in ARRAY_FIELDS and v is not None}
    return arrays, {k: v for k, v in stats.items() if k not in arrays}


def join_arrays(arrays: dict[str, torch.Tensor], rest: dict) -> dict:
    """The inverse of `split_arrays`: one plain dict, tensors as (nested) lists of floats."""
    unknown = set(arrays) - set(ARRAY_FIELDS)
    if unknown:
        raise ValueError(f"not layer-statistics arrays: {sorted(unknown)}")
    return dict(rest) | {k: t.to(torch.float64).tolist() for k, t in arrays.items()}


def analysis_key(capture_key: str, options: AnalysisOptions) -> str:
    """Cache key: capture, every option (the kernel among them) and VERSION."""
    return make_key({"capture": capture_key, "options": asdict(options), "version": VERSION})


def token_index(cap, options: AnalysisOptions) -> tuple[torch.Tensor, dict]:
    """Kept global token indices and the selection report for a capture (one pass for the norms)."""
    table = cap.tokens()
    norms = None
    if options.outlier_factor is not None:
        norms = torch.stack([cap.layer(l).norm(dim=1) for l in range(cap.num_layers + 1)])
    return select_tokens(table, norms, response_only=options.response_only, min_entropy=options.min_entropy,
                         quantile=options.quantile, outlier_factor=options.outlier_factor,
                         max_tokens=options.max_tokens, seed=options.seed)


def analyze(cap, store=None, options: AnalysisOptions | None = None,
            progress: Callable[[float, str], None] | None = None) -> LayerStats:
    """Statistics of capture `cap` (a CaptureReader); served from `store` when cached there."""
    options = options or AnalysisOptions()
    options.validate()
    key = analysis_key(cap.key, options)
    if store is not None:
        cached = store.get_json("analysis", key)
        if cached is not None and cached.get("version") == VERSION:
            return LayerStats.from_dict(cached)
    report = progress or (lambda frac, msg="": None)
    t0 = time.perf_counter()

    report(0.0, "selecting tokens")
    index, tok = token_index(cap, options)
    n = int(index.numel())
    if n < MIN_TOKENS:
        raise LayerScopeError(
            f"Only {n} of {tok['tokens_total']} tokens pass the filters ({tok['sink_dropped']} sinks, "
            f"{tok['outliers_dropped']} outliers, {tok['low_entropy_dropped']} below {tok['threshold']:.3g} nats)",
            "Lower --min-entropy, use --all-tokens, or capture more prompts")
    table = cap.tokens()
    eligible = _eligible_entropies(table, options)

    L, d = cap.num_layers + 1, cap.hidden_size
    conv = table["conversation"][index]
    groups = [g for g in (torch.nonzero(conv == c).squeeze(1) for c in conv.unique()) if g.numel() >= MIN_PROMPT_TOKENS]
    stack = torch.empty(n, L, d, dtype=torch.float32)
    h, hn, h2, hp, hpn = [], [], [], [], []
    for l in range(L):
        report(0.1 + 0.5 * l / L, f"entropy of layer {l}/{L - 1}")
        x = cap.layer(l, index)
        p = E.prepare(x, options.kernel)
        eigs = E.spectrum(p)
        h.append(E.renyi(eigs, options.alpha))
        hn.append(E.normalized(h[-1], n, d))
        h2.append(E.renyi(eigs, 2.0))
        per = E.group_entropies(x, groups, options.alpha, options.kernel)
        hp.append(sum(per) / len(per) if per else 0.0)
        hpn.append(sum(E.normalized(v, len(g), d) for v, g in zip(per, groups)) / len(per) if per else 0.0)
        stack[:, l] = p.to(torch.float32)
        del x, p

    report(0.6, "CKA of all layer pairs" + (f" (rank {options.rank})" if options.rank else ""))
    if options.rank:
        res = C.cka_lowrank(stack, options.rank)
    else:
        res = C.cka_all_pairs(stack, debiased=options.debiased and n >= 4,
                              progress=lambda f: report(0.6 + 0.38 * f, "CKA of all layer pairs"))
    del stack
    cka = res.biased
    N = cap.num_layers
    by_k = {str(k): segment(cka[:N, :N], k) for k in range(1, min(N, MAX_COMPARTMENTS) + 1)}

    stats = LayerStats(
        capture_key=cap.key, num_layers=N, hidden_size=d, alpha=options.alpha,
        entropy=h, entropy_normalized=hn, entropy2=h2, entropy_prompt=hp, entropy_prompt_normalized=hpn,
        cka=_rows(cka), cka_debiased=_rows(res.debiased), cka_bound=_rows(res.bound), cka_route=res.route,
        compartments=by_k[str(min(3, N))], compartments_by_k=by_k,
        tokens_total=tok["tokens_total"], tokens_kept=n, outliers_dropped=tok["outliers_dropped"],
        threshold=tok["threshold"], tokens=tok, token_entropy=eligible, prompts_used=len(groups),
        final_state=cap.manifest.get("final_state", "post-norm"), model=str(cap.manifest.get("model", "")),
        options=asdict(options), key=key, seconds=round(time.perf_counter() - t0, 3), kernel=options.kernel,
        sample_positions=cap.sample_positions,
    )
    if store is not None:
        store.put_json("analysis", key, stats.to_dict())
    report(1.0, "done")
    return stats


def sample_note(sample_positions) -> str:
    """How statistics from a sampled capture say so (the CLI, the app's statistics pages, the report); '' for a
    capture of every position."""
    if sample_positions is None:
        return ""
    return f"from a sample of at most {int(sample_positions):,} positions per conversation (--sample-positions)"


def _rows(m: torch.Tensor | None) -> list[list[float]] | None:
    return None if m is None else [[float(v) for v in row] for row in m]


def _eligible_entropies(table, options) -> list[float]:
    """Predictive entropies (nats, 4 decimals) of the tokens in scope before the entropy filter:
    response tokens (or all) without position 0; a seeded sample of at most TOKEN_ENTROPY_SAMPLE."""
    keep = table["position"] != 0
    if options.response_only:
        keep &= table["is_response"].bool()
    values = table["entropy"][keep]
    if values.numel() > TOKEN_ENTROPY_SAMPLE:
        g = torch.Generator().manual_seed(options.seed)
        values = values[torch.randperm(values.numel(), generator=g)[:TOKEN_ENTROPY_SAMPLE]]
    return [round(float(v), 4) for v in values]
