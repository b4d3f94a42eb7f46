"""Rank correlation between a proxy score and measured acceptance: average ranks and Spearman's ρ, for one
pair of lists (`spearman`) or a whole batch of bootstrap resamples at once (`spearman_rows`). Pure functions on
tensors, no I/O."""

from __future__ import annotations

import math

import torch


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based, ties share their mean rank) along the last dim of x [..., n], float64."""
    x = x.to(torch.float64)
    less = (x[..., None, :] < x[..., :, None]).sum(-1)           # [..., n]: how many are smaller
    equal = (x[..., None, :] == x[..., :, None]).sum(-1)         # ... equal (itself included)
    return less.to(torch.float64) + (equal.to(torch.float64) + 1) / 2


def spearman_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman's ρ of every row pair of a, b [B, n] -> [B]; NaN where a row has no spread."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    den = (ra.square().sum(-1) * rb.square().sum(-1)).sqrt()
    return torch.where(den > 0, (ra * rb).sum(-1) / den.clamp_min(1e-300), torch.full_like(den, float("nan")))


def spearman(a, b) -> float | None:
    """Spearman's ρ over the pairs where both values are known; None with fewer than 3 pairs or no spread."""
    pairs = [(float(x), float(y)) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    x, y = (torch.tensor(v, dtype=torch.float64) for v in zip(*pairs))
    rho = float(spearman_rows(x[None], y[None])[0])
    return None if math.isnan(rho) else rho                      # NaN: no spread
