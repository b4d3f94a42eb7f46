"""A chain's acceptance is the product of accept-given-accepted rates (P(position i accepted | 1..i-1 accepted)), as a
calibration measures them, never of per-position rates taken as independent: planted ranks whose conditional rates
fall with depth while every position alone is right half the time."""

from __future__ import annotations

import math

import pytest
import torch

from layerscope.decoding import costmodel as cm

DEPTH = 8
N = 2000
CONDITIONAL = (1 / 2, 3 / 10, 1 / 10, 0, 0, 0, 0, 0)     # P(accept i | 1..i-1 accepted), falling with depth


def planted_ranks() -> torch.Tensor:
    """N calibration states [N, DEPTH] of ranks 0 (first choice) or 1: exactly N * prod(CONDITIONAL[:i]) states
    accept positions 1..i, and every depth's first choice is right in exactly half the states (a state whose chain
    already broke is teacher-forced past it, where the draft is often right again)."""
    reach = [round(N * math.prod(CONDITIONAL[:i])) for i in range(DEPTH + 1)]      # states accepting 1..i
    chain = [max(i for i in range(DEPTH + 1) if reach[i] > s) for s in range(N)]   # each state's accepted run
    ranks = torch.ones(N, DEPTH, dtype=torch.long)
    for s, m in enumerate(chain):
        ranks[s, :m] = 0
    for j in range(DEPTH):                      # fill first choices where the chain broke before depth j
        free = [s for s in range(N) if chain[s] < j]
        need = N // 2 - int((ranks[:, j] == 0).sum())
        ranks[free[:need], j] = 0
    return ranks


def closed_form(curve: cm.CostCurve, k: int) -> tuple[float, float]:
    """(tau, speedup) of a chain of depth k from the planted conditionals: tau = 1 + sum_i prod_{j<=i} c_j."""
    tau = 1 + sum(math.prod(CONDITIONAL[:i]) for i in range(1, k + 1))
    return tau, tau * curve.target_s(1) / cm.step_seconds(curve, k=k, tau=tau)


def test_chain_acceptance_is_the_product_of_accept_given_accepted_rates():
    curve = cm.CostCurve("cpu", "float32", 1, tuple(0.1 + 0.001 * T for T in range(1, 33)), (0.001,) * 8)
    profile = cm.profile_from_ranks(planted_ranks())
    assert all(r[0] == pytest.approx(0.5) for r in profile.rank)           # every position alone: 0.5
    assert profile.chain == pytest.approx([math.prod(CONDITIONAL[:i]) for i in range(1, DEPTH + 1)])
    for k in range(1, DEPTH + 1):
        tau, speedup = closed_form(curve, k)
        pred = cm.predict(curve, profile, k=k)
        assert pred.tau == pytest.approx(tau) and pred.speedup == pytest.approx(speedup), k
    best = max(range(1, DEPTH + 1), key=lambda k: closed_form(curve, k)[1])
    assert best == 2 and cm.best_chain(curve, profile).k == best
    # the per-position rates taken as independent (0.5 ** i) would call a deep chain best on this curve
    independent = cm.AcceptanceProfile.from_chain([0.5 ** i for i in range(1, DEPTH + 1)])
    assert cm.best_chain(curve, independent).k == 4
