"""The learning curve's power law and the budget it predicts, on curves with known answers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from layerscope.draft.training import learning_curve as lc
from layerscope.draft.training.loss import simulated_acc_len


def _law(c, b, ceiling=1.0, tokens=(125_000, 250_000, 500_000, 1_000_000)):
    return [(n, ceiling - c * n ** -b) for n in tokens]


def test_an_exact_power_law_is_recovered_and_read_forward():
    fit = lc.fit_power_law(_law(6.0, 0.25, ceiling=0.87), ceiling=0.87)
    assert fit.c == pytest.approx(6.0, rel=1e-9) and fit.b == pytest.approx(0.25, rel=1e-9)
    assert fit.rms_log == pytest.approx(0.0, abs=1e-9)
    assert fit.agreement(4e6) == pytest.approx(0.87 - 6.0 * 4e6 ** -0.25)
    # the inverse in closed form: 0.87 - 6 N^-1/4 = 0.6  <=>  N = (6 / 0.27)^4
    assert fit.tokens_for(0.6) == pytest.approx((6.0 / 0.27) ** 4, rel=1e-9)
    assert fit.tokens_for(0.87) is None and fit.tokens_for(0.95) is None       # at or above the ceiling: never


def test_noisy_points_fit_by_least_squares_on_the_logarithms():
    pts = _law(3.0, 0.3)
    noisy = [(n, 1 - (1 - a) * f) for (n, a), f in zip(pts, (1.05, 0.95, 1.05, 0.95))]
    fit = lc.fit_power_law(noisy)
    assert fit.b == pytest.approx(0.3, abs=0.05) and 0 < fit.rms_log <= math.log(1.06)


def test_no_forecast_without_learning_or_points():
    assert lc.fit_power_law([]) is None
    assert lc.fit_power_law([(1000, 0.2)]) is None                              # one point
    assert lc.fit_power_law([(1000, 0.2), (1000, 0.3)]) is None                 # one token count
    assert lc.fit_power_law([(1000, 0.3), (2000, 0.2)]) is None                 # agreement fell: no learning
    assert lc.fit_power_law([(1000, 0.0), (2000, 0.9)], ceiling=0.9) is None    # neither inside (0, ceiling)


def test_the_budget_for_a_tau_is_where_the_fitted_chain_reaches_it():
    fits = [lc.fit_power_law(_law(c, 0.3, ceiling=0.9), ceiling=0.9) for c in (4.0, 5.0, 6.0)]
    n = lc.tokens_for_tau(fits, 2.0)
    assert lc.tau_at(fits, n) == pytest.approx(2.0, abs=2e-3)
    assert lc.tau_at(fits, n * 0.99) < 2.0 <= lc.tau_at(fits, n * 1.001)
    a = [0.9 - c * n ** -0.3 for c in (4.0, 5.0, 6.0)]
    assert lc.tau_at(fits, n) == pytest.approx(1 + simulated_acc_len(a))
    # three positions capped at 0.9 give at most 1 + 0.9 + 0.81 + 0.729 = 3.439
    assert lc.tokens_for_tau(fits, 3.5) is None
    assert lc.tokens_for_tau(fits, 1.0) == 1.0                                  # any budget reaches τ 1
    assert lc.tokens_for_tau([], 2.0) is None


def test_the_script_reads_a_running_study_and_forecasts_what_it_held_back(tmp_path):
    """benchmarks/learning_curve.py on a run's newest checkpoint (curves of two sets, exact power laws): the points
    held back are what the fit on the others says, and each set gets its budget per τ."""
    ckpt = tmp_path / "run" / "ckpt-000000093"
    ckpt.mkdir(parents=True)
    (ckpt / "tensors.safetensors").write_bytes(b"")
    curves = [[[n, [0.9 - c * n ** -0.3 for c in cs], 0.9] for n in (125_000, 250_000, 500_000, 1_000_000)]
              for cs in ((4.0, 5.0, 6.0), (5.0, 6.0, 7.0))]
    (ckpt / "state.json").write_text(json.dumps({"curves": curves}))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "learning_curve.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--names", "default,probe",
                          "--holdout", "1", "--tau", "2,3.5"], capture_output=True, text=True, check=True).stdout
    assert "## default" in out and "## probe" in out
    a = [0.9 - c * 1e6 ** -0.3 for c in (4.0, 5.0, 6.0)]
    measured = " / ".join(f"{x:.3f}" for x in a)
    assert f"held back 1,000,000: fit {measured} (simulated_acc_len {simulated_acc_len(a):.3f}), measured {measured}" in out
    fits = [lc.fit_power_law([(n, 0.9 - c * n ** -0.3) for n in (1e5, 1e6)], ceiling=0.9) for c in (4.0, 5.0, 6.0)]
    n = lc.tokens_for_tau(fits, 2.0)
    said = f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n / 1e3:,.0f}k"
    assert f"chain τ 2 (1 + simulated_acc_len over 3 positions): {said}" in out
    assert "chain τ 3.5 (1 + simulated_acc_len over 3 positions): never (capped by the coverage)" in out
