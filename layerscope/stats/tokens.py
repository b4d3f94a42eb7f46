"""Which captured tokens enter the statistics: one rule shared by entropy and CKA.

Filters, in order, each counted in the report:
1. response tokens only (the target's own generations, as EAGLE training data) or all tokens;
2. attention sinks: position 0 of every conversation, always;
3. massive activations: tokens whose hidden-state norm at any layer exceeds `outlier_factor` × the
   median norm of that layer (over the tokens still in). A handful of such tokens otherwise
   dominates every Gram matrix and drives CKA between unrelated layers to ~1;
4. token entropy: keep tokens whose predictive entropy (nats) is at least `min_entropy`, or at least
   the `quantile` of the remaining tokens' entropies when a quantile is given;
5. a cap: at most `max_tokens`, a seeded random subsample (kept in capture order).
`breakdown(report)` says where every captured token went (the counts add up to the captured total).
Pure functions, no I/O.
"""

from __future__ import annotations

import torch

OUTLIER_FACTOR = 10.0   # "many times the median norm": sinks on SmolLM2 sit ~100× above it


def select_tokens(tokens: dict[str, torch.Tensor], norms: torch.Tensor | None, *, response_only: bool = True,
                  min_entropy: float | None = 0.5, quantile: float | None = None,
                  outlier_factor: float | None = OUTLIER_FACTOR, max_tokens: int | None = 8192,
                  seed: int = 0) -> tuple[torch.Tensor, dict]:
    """tokens: the capture's token table (position, is_response, entropy: each [T]).
    norms: [L, T] hidden-state L2 norm of every token at each layer, or None to skip outlier removal.
    Returns (kept global token indices, LongTensor [n] ascending; report dict).
    """
    position, entropy = tokens["position"], tokens["entropy"].to(torch.float64)
    total = position.numel()
    keep = tokens["is_response"].bool().clone() if response_only else torch.ones(total, dtype=torch.bool)

    sinks = keep & (position == 0)
    keep &= ~sinks

    outliers = torch.zeros(total, dtype=torch.bool)
    if outlier_factor is not None and norms is not None and keep.any():
        if norms.shape[-1] != total:
            raise ValueError(f"norms must be [L, {total}], got {tuple(norms.shape)}")
        norms = norms.to(torch.float64).reshape(-1, total)
        median = norms[:, keep].median(dim=1).values                  # [L]
        outliers = keep & (norms > outlier_factor * median[:, None]).any(0)
        keep &= ~outliers

    if quantile is not None:
        if not 0.0 <= quantile < 1.0:
            raise ValueError(f"quantile must be in [0, 1), got {quantile}")
        threshold = float(torch.quantile(entropy[keep], quantile)) if keep.any() else 0.0
    else:
        threshold = float(min_entropy or 0.0)
    low = keep & (entropy < threshold)
    keep &= ~low

    index = keep.nonzero().squeeze(1)
    candidates = index.numel()
    if max_tokens is not None and candidates > max_tokens:
        g = torch.Generator().manual_seed(seed)
        index = index[torch.randperm(candidates, generator=g)[:max_tokens]].sort().values

    report = {
        "tokens_total": total,
        "response_only": response_only,
        "prompt_dropped": int(total - tokens["is_response"].bool().sum()) if response_only else 0,
        "sink_dropped": int(sinks.sum()),
        "outliers_dropped": int(outliers.sum()),
        "outlier_factor": outlier_factor,
        "low_entropy_dropped": int(low.sum()),
        "threshold": threshold,
        "quantile": quantile,
        "tokens_eligible": candidates,
        "cap": max_tokens,
        "tokens_kept": int(index.numel()),
        "capped": candidates - int(index.numel()),
        "seed": seed,
    }
    return index, report


def breakdown(report: dict) -> list[tuple[str, int]]:
    """Where every captured token went, in the filters' order, as (what, count); the counts add up to
    report["tokens_total"]. A report saved before prompt tokens were counted gets them as the rest."""
    eligible = int(report.get("tokens_eligible", report.get("tokens_kept", 0)))
    kept = int(report.get("tokens_kept", 0))
    parts = [("position 0 (attention sinks)", int(report.get("sink_dropped", 0))),
             ("massive activations", int(report.get("outliers_dropped", 0))),
             ("below the entropy threshold", int(report.get("low_entropy_dropped", 0))),
             ("over the token cap", eligible - kept), ("kept", kept)]
    prompt = int(report.get("tokens_total", 0)) - sum(n for _, n in parts)
    return [("prompt tokens (response tokens only)", prompt)] + parts
