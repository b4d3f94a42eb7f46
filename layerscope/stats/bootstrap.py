"""Bootstrap over prompts: resampled indices, ratio-of-sums statistics, percentile intervals.

Every contender of a study decodes the same prompts, so one set of resampled prompt indices serves
all of them: a statistic of two contenders under the same resample is a *paired* comparison, and the
interval of their difference is far narrower than the two separate intervals suggest.

The statistics are ratios of sums over prompts (τ = Σ tokens / Σ target forwards, acceptance =
Σ accepted / Σ drafted, tokens/s = Σ tokens / Σ seconds), exactly how the benchmark pools them, so
the point estimate (all prompts once) equals the benchmark's own number.
Pure functions on tensors, no I/O.
"""

from __future__ import annotations

import torch

DRAWS = 2000     # bootstrap resamples
LEVEL = 0.95     # two-sided interval level


def resample(n: int, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """[draws, n] indices into 0..n-1, drawn with replacement from a generator seeded with `seed`."""
    if n < 1:
        raise ValueError("cannot resample an empty sample")
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, n, (draws, n), generator=g)


def ratio_of_sums(num: torch.Tensor, den: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Σ num / Σ den over the prompts (last dim) of num, den [..., P].

    idx [B, P]: resampled prompt indices -> result [B, ...]; None -> all prompts once, result [...].
    A zero denominator gives NaN.
    """
    num, den = num.to(torch.float64), den.to(torch.float64)
    if idx is None:
        return num.sum(-1) / den.sum(-1)
    n, d = num[..., idx].sum(-1), den[..., idx].sum(-1)         # [..., B]
    return (n / d).movedim(-1, 0)


def interval(samples: torch.Tensor, level: float = LEVEL) -> list[float] | None:
    """Percentile interval [lo, hi] of bootstrap samples [B] (NaN samples ignored); None when none is finite."""
    s = samples[torch.isfinite(samples)].to(torch.float64)
    if s.numel() == 0:
        return None
    tail = (1 - level) / 2
    lo, hi = torch.quantile(s, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return [lo, hi]

