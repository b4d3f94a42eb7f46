"""Layer sets for an EAGLE-3 draft: strategies over the layer statistics, one score for any set.

Every strategy reads a `LayerStats` (per-layer entropies, pairwise CKA; see `analysis.py`) and
returns a `Selection`. Drafts may read layers 0..N-1 (N is the final state). Strategies:
    default        [2, N//2, N-3], the rule vLLM, SGLang and EAGLE use (layerset.default_layers)
    entropy-topk   the k most informative layers (highest matrix entropy)
    greedy         mRMR: start from the most informative layer, then repeatedly add the layer with
                   the largest  normalized entropy - λ · mean CKA to the layers already chosen
    aggregate      the set with the largest aggregate entropy (α = 2, exact from entropies and CKA):
                   exhaustive for k ≤ 3, then greedy additions
    spread         cut depth into k contiguous compartments by clustering the CKA matrix, then the
                   most informative layer of each compartment
    manual         a set given by the user
    probe          the set whose closed-form ridge map of the draft's inputs best predicts the target's
                   final state (layerscope/study/probe.py; needs the capture and the target: `probe=ProbeInput`)
Controls (for the study: what "better than the default" means against chance; not in `compare`):
    random         k distinct layers drawn uniformly from 0..N-1 with a seeded generator (`seed`)
    last-k         the k deepest layers N-k..N-1
    single         one layer, N-1 (an EAGLE-1-style draft that reads the top of the stack)
Each strategy is one function in REGISTRY (name -> (function, description)), which the CLI lists from.
All sets get the same `score_set` explanation and `score` (aggregate entropy, nats), so sets from
different strategies, hand-picked ones included, are compared on one scale. Ties break toward
lower layer indices; every strategy is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerscope import layerset
from layerscope.errors import SelectionError
from layerscope.stats.compartments import compartment_objective, compartments
from layerscope.stats.entropy import aggregate_entropy2

STRATEGIES = ("default", "entropy-topk", "greedy", "aggregate", "spread", "manual")
AUTOMATIC = STRATEGIES[:-1]
CONTROLS = ("random", "last-k", "single")


@dataclass
class Selection:
    strategy: str
    layers: list[int]       # ascending, each in 0..N-1
    score: float            # aggregate entropy of the set (α = 2, nats): the common scale
    explanation: dict       # see `score_set`, plus the strategy's own objective

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "layers": self.layers, "score": self.score, "explanation": self.explanation}


# ---- the statistics as tensors -------------------------------------------------------------------

def _tensors(stats):
    """(N, entropy [N+1], normalized entropy [N+1], α=2 entropy [N+1], biased CKA [N+1, N+1]), float64."""
    f = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return stats.num_layers, f(stats.entropy), f(stats.entropy_normalized), f(stats.entropy2), f(stats.cka)


def _check_k(k: int, n: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise SelectionError(f"k must be a positive integer, got {k!r}", "Ask for at least one layer, e.g. --k 3")
    if k > n:
        raise SelectionError(f"k={k} exceeds the {n} layers a draft may read (0..{n - 1})",
                             f"Ask for at most {n} layers")


# ---- one score for any set -----------------------------------------------------------------------

def score_set(stats, layers, lam: float = 0.5) -> dict:
    """Everything that explains a set, on the same scale for every set.

    entropy / entropy_normalized: per layer of the set; cka: pairwise biased CKA inside the set;
    mean_entropy, mean_entropy_normalized, mean_cka (over pairs; 0 for one layer);
    aggregate_entropy: α = 2 entropy of the set's layers together (nats; the `score`);
    mrmr: mean normalized entropy - λ · mean CKA.
    """
    n, h, hn, h2, c = _tensors(stats)
    layers = layerset.check(layers, n)
    idx = torch.tensor(layers)
    sub = c[idx][:, idx]
    k = len(layers)
    mean_cka = float(sub[~torch.eye(k, dtype=torch.bool)].mean()) if k > 1 else 0.0
    mean_hn = float(hn[idx].mean())
    return {
        "layers": layers,
        "alpha": stats.alpha,
        "kernel": stats.kernel,
        "entropy": [float(h[l]) for l in layers],
        "entropy_normalized": [float(hn[l]) for l in layers],
        "cka": [[float(v) for v in row] for row in sub],
        "mean_entropy": float(h[idx].mean()),
        "mean_entropy_normalized": mean_hn,
        "mean_cka": mean_cka,
        "aggregate_entropy": aggregate_entropy2(h2[idx], sub),
        "lam": lam,
        "mrmr": mean_hn - lam * mean_cka,
    }


def _selection(stats, strategy, layers, lam, objective: dict, **extra) -> Selection:
    ex = score_set(stats, layers, lam)
    ex["objective"] = objective
    ex.update(extra)
    return Selection(strategy, ex["layers"], ex["aggregate_entropy"], ex)


# ---- strategies ----------------------------------------------------------------------------------

def top_by_entropy(hn: torch.Tensor, candidates: list[int], k: int) -> list[int]:
    """The k highest entropies among candidates; ties toward the lower layer."""
    return sorted(sorted(candidates, key=lambda l: (-float(hn[l]), l))[:k])


def greedy_mrmr(hn: torch.Tensor, c: torch.Tensor, n: int, k: int, lam: float) -> tuple[list[int], list[float]]:
    """mRMR: most informative first, then argmax  hn_l - λ·mean_{s∈S} CKA(l, s). Returns (set, gains)."""
    chosen, gains = [], []
    for _ in range(k):
        best, best_gain = None, None
        for l in range(n):
            if l in chosen:
                continue
            gain = float(hn[l]) - (lam * float(c[l, chosen].mean()) if chosen else 0.0)
            if best_gain is None or gain > best_gain:
                best, best_gain = l, gain
        chosen.append(best)
        gains.append(best_gain)
    return chosen, gains


def _purity(w: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """Σ_ij W_ij over each set: [m, k] layer sets -> [m]; W_ij = CKA_ij exp(-(H2_i + H2_j)/2)."""
    return w[sets[:, :, None], sets[:, None, :]].sum((1, 2))


def best_aggregate(h2: torch.Tensor, c: torch.Tensor, n: int, k: int) -> list[int]:
    """Maximise α=2 aggregate entropy over sets of k layers from 0..N-1.

    H2(S) = -log(Σ_ij W_ij / k²), so the best set minimises Σ_ij W_ij: exhaustive over all sets for
    k ≤ 3 (vectorised; lexicographically first among ties), then greedy additions.
    """
    e = torch.exp(-h2[:n] / 2)
    cc = c[:n, :n].clone()
    cc.fill_diagonal_(1.0)
    w = cc * e[:, None] * e[None, :]
    sets = torch.combinations(torch.arange(n), r=min(k, 3))
    chosen = sets[int(torch.argmin(_purity(w, sets)))].tolist()
    while len(chosen) < k:
        rest = torch.tensor([l for l in range(n) if l not in chosen])
        trial = torch.cat([torch.tensor(chosen).expand(len(rest), -1), rest[:, None]], dim=1)
        chosen.append(int(rest[int(torch.argmin(_purity(w, trial)))]))
    return sorted(chosen)


def random_layers(n: int, k: int, seed: int) -> list[int]:
    """k distinct layers of 0..n-1, uniformly at random from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(int(seed))
    return sorted(torch.randperm(n, generator=g)[:k].tolist())


# ---- the registry: name -> (function, description) ----------------------------------------------

@dataclass(frozen=True)
class Request:
    """What a strategy may read besides the statistics."""
    k: int
    lam: float
    layers: list[int] | None
    seed: int
    probe: object | None              # a probe.ProbeInput (the `probe` strategy only)


def _manual(stats, r: Request) -> Selection:
    return _selection(stats, "manual", layerset.check(r.layers, stats.num_layers), r.lam,
                      {"name": "aggregate_entropy", "value": None})


def _default(stats, r: Request) -> Selection:
    chosen, note = layerset.default_layers(stats.num_layers)
    if r.k != 3:
        note = (note + "; " if note else "") + f"the default rule always reads 3 layers (k={r.k} ignored)"
    return _selection(stats, "default", chosen, r.lam, {"name": "fixed rule [2, N//2, N-3]", "value": None}, note=note)


def _entropy_topk(stats, r: Request) -> Selection:
    n, _, hn, _, _ = _tensors(stats)
    sel = _selection(stats, "entropy-topk", top_by_entropy(hn, list(range(n)), r.k), r.lam,
                     {"name": "mean_entropy", "value": None})
    sel.explanation["objective"]["value"] = sel.explanation["mean_entropy"]
    return sel


def _greedy(stats, r: Request) -> Selection:
    n, _, hn, _, c = _tensors(stats)
    order, gains = greedy_mrmr(hn, c, n, r.k, r.lam)
    sel = _selection(stats, "greedy", order, r.lam, {"name": "mrmr", "value": None}, order=order, gains=gains)
    sel.explanation["objective"]["value"] = sel.explanation["mrmr"]
    return sel


def _aggregate(stats, r: Request) -> Selection:
    n, _, _, h2, c = _tensors(stats)
    how = "exhaustive" if r.k <= 3 else "exhaustive over 3, then greedy"
    return _selection(stats, "aggregate", best_aggregate(h2, c, n, r.k), r.lam,
                      {"name": "aggregate_entropy", "value": None, "search": how})


def _spread(stats, r: Request) -> Selection:
    n, _, hn, _, c = _tensors(stats)
    blocks = compartments(c[:n, :n], r.k)
    chosen = [top_by_entropy(hn, list(range(f, e + 1)), 1)[0] for f, e in blocks]
    return _selection(stats, "spread", chosen, r.lam,
                      {"name": "compartment_cohesion", "value": compartment_objective(c[:n, :n], blocks)},
                      compartments=blocks, compartment_mean_cka=[_mean_offdiag(c[f:e + 1, f:e + 1]) for f, e in blocks])


def _control(name: str, chosen, rule: str):
    def pick(stats, r: Request) -> Selection:
        return _selection(stats, name, chosen(stats.num_layers, r), r.lam, {"name": f"control: {rule(r)}", "value": None})
    return pick


def _probe(stats, r: Request) -> Selection:
    """The probe's search (layerscope/study/probe.py): needs the capture and the target, passed as `probe=`."""
    if r.probe is None:
        raise SelectionError("The probe strategy needs the capture and the target model, not only the statistics",
                             "Run `layerscope select KEY --strategy probe` or `layerscope probe KEY`, or pass "
                             "probe=probe.ProbeInput(cap, target)")
    if r.probe.cap.num_layers != stats.num_layers:
        raise SelectionError(f"The probe's capture has {r.probe.cap.num_layers} layers, the statistics "
                             f"{stats.num_layers}", "Pass the capture the statistics were computed from")
    report = r.probe.search(r.k)
    best = report.best()
    return _selection(stats, "probe", best.layers, r.lam,
                      {"name": "probe agreement (held-out)", "value": best.agreement,
                       "search": report.search["method"] if report.search else None, "scored": report.scored},
                      probe=best.to_json())


REGISTRY: dict[str, tuple] = {     # name -> (function(stats, Request) -> Selection, description)
    "default": (_default, "[2, N//2, N-3], the rule vLLM, SGLang and EAGLE use"),
    "entropy-topk": (_entropy_topk, "the k most informative layers (highest matrix entropy)"),
    "greedy": (_greedy, "mRMR: the most informative layer, then the best normalized entropy - λ · mean CKA"),
    "aggregate": (_aggregate, "the set with the largest aggregate entropy (α = 2)"),
    "spread": (_spread, "k depth compartments by CKA clustering, the most informative layer of each"),
    "manual": (_manual, "a set given by the user"),
    "random": (_control("random", lambda n, r: random_layers(n, r.k, r.seed),
                        lambda r: f"uniform random draw, seed {r.seed}"), "control: k seeded random layers"),
    "last-k": (_control("last-k", lambda n, r: list(range(n - r.k, n)), lambda r: f"the {r.k} deepest layers"),
               "control: the k deepest layers"),
    "single": (_control("single", lambda n, r: [n - 1], lambda r: "one layer, the deepest a draft may read"),
               "control: one layer, N-1"),
    "probe": (_probe, "the set whose closed-form ridge map of the draft's inputs best predicts the target's "
                      "final state (greedy + swap search; needs the capture and the target)"),
}
NEEDS_PROBE = ("probe",)           # strategies that read the capture and the target, not only LayerStats


def describe() -> list[tuple[str, str]]:
    """(name, description) of every strategy, for the CLI and the app."""
    return [(name, desc) for name, (_, desc) in REGISTRY.items()]


def select(stats, strategy: str = "aggregate", k: int = 3, *, lam: float = 0.5, layers=None,
           seed: int = 0, probe=None) -> Selection:
    """One layer set from `stats` (a LayerStats) by `strategy`; k layers (the default rule has 3,
    `single` has 1). `seed` seeds the `random` control; `probe` (a probe.ProbeInput) feeds the `probe` strategy."""
    if strategy not in REGISTRY:
        raise SelectionError(f"Unknown strategy {strategy!r}", f"Use one of {', '.join(REGISTRY)}")
    if strategy != "manual":
        _check_k(k, stats.num_layers)
    pick, _ = REGISTRY[strategy]
    sel = pick(stats, Request(k, lam, layers, seed, probe))
    if sel.explanation["objective"]["value"] is None:
        sel.explanation["objective"]["value"] = sel.score
    return sel


def _mean_offdiag(block: torch.Tensor) -> float:
    m = block.shape[0]
    return float(block[~torch.eye(m, dtype=torch.bool)].mean()) if m > 1 else 1.0


def compare(stats, k: int = 3, *, lam: float = 0.5, layers=None) -> list[Selection]:
    """Every automatic strategy (and the manual set when `layers` is given), in STRATEGIES order; not `probe`,
    which needs the capture and the target (and minutes), nor the controls."""
    out = [select(stats, s, k, lam=lam) for s in AUTOMATIC]
    if layers:
        out.append(select(stats, "manual", k, lam=lam, layers=layers))
    return out
