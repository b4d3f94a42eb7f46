"""Rank correlation between a proxy score and measured acceptance."""

from __future__ import annotations

import torch


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based, ties share their mean rank) of a 1-D tensor."""
    order = torch.argsort(x, stable=True)
    r = torch.empty_like(x, dtype=torch.float64)
    r[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    for v in torch.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman(a, b) -> float | None:
    """Spearman's ρ over the pairs where both values are known; None with fewer than 3 pairs or no spread."""
    pairs = [(float(x), float(y)) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    x, y = (torch.tensor(v, dtype=torch.float64) for v in zip(*pairs))
    rx, ry = ranks(x) - (len(pairs) + 1) / 2, ranks(y) - (len(pairs) + 1) / 2
    denom = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denom) if denom > 0 else None
