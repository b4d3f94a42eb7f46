"""A draft's learning curve and the budget it predicts: held-out agreement against tokens seen, a power law fitted
to what is still missed, read forward to the tokens a goal needs.

    fit = fit_power_law([(tokens, agreement), ...], ceiling=coverage)    None: too few points, or no learning
    fit.agreement(tokens)         ceiling - c * tokens ** -b
    fit.tokens_for(goal)          tokens at which the fit reaches goal (None: at or above its ceiling)
    tokens_for_tau(fits, tau)     tokens at which a chain over len(fits) draft positions reaches τ (loss.simulated_acc_len + 1)

The model: what the draft still misses, ceiling - agreement, falls as a power of the tokens seen (a straight line
in log-log), fitted by least squares on the logarithms. The ceiling is the share of positions the draft can get at
all: the held-out coverage (the target's token in the draft vocabulary), 1 without one.

What it is not: the points of one run are read while its learning rate decays toward the end of that run's budget,
so its last points fall faster than a longer run would at the same tokens; reading the fit forward beyond the run
mixes both. It is a forecast to plan the next budget with, not a result: the closing numbers are measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from layerscope.draft.training.loss import simulated_acc_len

MAX_TOKENS = 1e15                       # the search's end: beyond it a forecast says "never"


@dataclass(frozen=True)
class PowerLaw:
    """agreement(N) = ceiling - c * N**-b, fitted on `points` (tokens, agreement)."""
    c: float
    b: float
    ceiling: float
    points: tuple[tuple[float, float], ...]
    rms_log: float                      # root mean square residual of log(ceiling - agreement)

    def agreement(self, tokens: float) -> float:
        return self.ceiling - self.c * tokens ** -self.b

    def tokens_for(self, goal: float) -> float | None:
        """Tokens at which the fit reaches `goal` agreement; None when goal is at or above the ceiling."""
        if goal >= self.ceiling:
            return None
        return (self.c / (self.ceiling - goal)) ** (1.0 / self.b)


def fit_power_law(points: Sequence[tuple[float, float]], ceiling: float = 1.0) -> PowerLaw | None:
    """Least squares of log(ceiling - a) = log c - b log N over the points with 0 < a < ceiling and N > 0.

    None with fewer than two such points at different N, or when the misses do not fall (b <= 0): no learning
    to read forward."""
    pts = [(float(n), float(a)) for n, a in points if n > 0 and 0 < a < ceiling]
    if len({n for n, _ in pts}) < 2:
        return None
    xs = [math.log(n) for n, _ in pts]
    ys = [math.log(ceiling - a) for _, a in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope >= 0:
        return None
    log_c = my - slope * mx
    rms = math.sqrt(sum((y - (log_c + slope * x)) ** 2 for x, y in zip(xs, ys)) / len(xs))
    return PowerLaw(c=math.exp(log_c), b=-slope, ceiling=ceiling, points=tuple(pts), rms_log=rms)


def tau_at(fits: Sequence[PowerLaw], tokens: float) -> float:
    """τ of a chain over len(fits) draft positions at `tokens`: 1 + simulated_acc_len of the fitted agreements
    (the bonus token plus SpecForge's estimate; loss.simulated_acc_len says why it is an estimate)."""
    return 1.0 + simulated_acc_len([max(f.agreement(tokens), 0.0) for f in fits])


def tokens_for_tau(fits: Sequence[PowerLaw], tau: float, start: float = 1.0) -> float | None:
    """The fewest tokens (to 0.1 %) at which tau_at(fits, N) >= tau; None when it never does below MAX_TOKENS
    (the ceilings cap it). τ rises with N (each fit's agreement does), so a bisection on log N finds it."""
    if not fits:
        return None
    if tau_at(fits, start) >= tau:
        return start
    if tau_at(fits, MAX_TOKENS) < tau:
        return None
    lo, hi = math.log(start), math.log(MAX_TOKENS)
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if tau_at(fits, math.exp(mid)) >= tau else (mid, hi)
    return math.exp(hi)
