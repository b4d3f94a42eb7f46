"""Matrix entropy: known answers, route agreement, invariances, the α=2 aggregate identity."""

import math

import pytest
import torch

from layerscope.stats import cka as C
from layerscope.stats import entropy as E
from tests.helpers import correlated_layers, gen


def decaying(n, d, seed=0):
    """Tokens with a decaying spectrum (not flat, not rank-1)."""
    g = gen(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * torch.logspace(0, -1.5, d, dtype=torch.float64)


@pytest.mark.parametrize("route", ["gram", "cov"])
def test_identity_gram_is_log_n(route):
    n = 12
    assert E.matrix_entropy(torch.eye(n), route=route, prepared=True) == pytest.approx(math.log(n), abs=1e-12)
    # Through `prepare`, centering removes the all-ones direction: n - 1 equal eigenvalues remain.
    assert E.matrix_entropy(torch.eye(n), route=route) == pytest.approx(math.log(n - 1), abs=1e-12)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, 3.0])
def test_rank_one_is_zero(alpha):
    g = gen(1)
    z = torch.randn(40, 1, generator=g, dtype=torch.float64) * torch.randn(1, 16, generator=g, dtype=torch.float64)
    z = z + torch.randn(1, 16, generator=g, dtype=torch.float64)
    assert E.matrix_entropy(z, alpha) == pytest.approx(0.0, abs=1e-10)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0, float("inf")])
def test_r_equal_eigenvalues_give_log_r(alpha):
    r, m, d = 5, 6, 16
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen(2), dtype=torch.float64))[0][:, :r]
    rows = torch.cat([basis.T, -basis.T]).repeat(m, 1)        # ±e_k equally often: centered, unit rows
    assert E.matrix_entropy(rows, alpha) == pytest.approx(math.log(r), abs=1e-10)
    assert E.normalized(E.matrix_entropy(rows, alpha), rows.shape[0], r) == pytest.approx(1.0, abs=1e-10)


@pytest.mark.parametrize("shape", [(80, 20), (20, 80), (30, 30)])
def test_gram_and_covariance_routes_agree(shape):
    p = E.prepare(decaying(*shape, seed=3))
    a, b = E.spectrum(p, "gram"), E.spectrum(p, "cov")
    k = min(a.numel(), b.numel())
    assert torch.allclose(a[:k], b[:k], atol=1e-12)
    assert a[k:].abs().sum() < 1e-12 and b[k:].abs().sum() < 1e-12
    for alpha in (0.5, 1.0, 2.0):
        assert E.renyi(a, alpha) == pytest.approx(E.renyi(b, alpha), abs=1e-10)


@pytest.mark.parametrize("c", [3.7, -0.2])
def test_invariant_to_scaling_and_rotation(c):
    z = decaying(50, 24, seed=4)
    q = torch.linalg.qr(torch.randn(24, 24, generator=gen(5), dtype=torch.float64))[0]
    for alpha in (1.0, 2.0):
        assert E.matrix_entropy(c * z @ q, alpha) == pytest.approx(E.matrix_entropy(z, alpha), abs=1e-10)


def test_non_increasing_in_alpha_and_continuous_at_one():
    eigs = E.spectrum(E.prepare(decaying(60, 30, seed=6)))
    alphas = [0.0, 0.3, 0.9, 0.999, 1.0, 1.001, 1.5, 2.0, 4.0, float("inf")]
    values = [E.renyi(eigs, a) for a in alphas]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))
    assert values[0] > values[-1] + 0.1                          # strictly decreasing here: spectrum not flat
    s1 = E.renyi(eigs, 1.0)
    for eps in (1e-3, 1e-5, 1e-6, 1e-7, 1e-9):
        assert abs(E.renyi(eigs, 1 - eps) - s1) < 10 * eps and abs(E.renyi(eigs, 1 + eps) - s1) < 10 * eps


def test_alpha2_is_minus_log_purity():
    p = E.prepare(decaying(40, 10, seed=7))
    k = p @ p.T
    k = k / k.trace()
    assert E.matrix_entropy(p, 2.0, prepared=True) == pytest.approx(-math.log(float((k @ k).trace())), abs=1e-12)


@pytest.mark.parametrize("kernel", ["linear", "cosine"])
@pytest.mark.parametrize("n,d", [(120, 16), (10, 24)])
def test_alpha2_aggregate_identity(n, d, kernel):
    zs = correlated_layers(4, n, d, seed=8)
    zs[1] = zs[1] * torch.linspace(0.2, 5, n, dtype=torch.float64)[:, None]   # unequal token norms
    for subset in ([0], [0, 1], [0, 2, 3], [0, 1, 2, 3]):
        direct = E.aggregate_entropy([zs[i] for i in subset], alpha=2.0, kernel=kernel)
        h2 = torch.tensor([E.matrix_entropy(zs[i], 2.0, kernel=kernel) for i in subset], dtype=torch.float64)
        cka = torch.tensor([[C.cka(zs[i], zs[j], kernel=kernel) for j in subset] for i in subset],
                           dtype=torch.float64)
        assert E.aggregate_entropy2(h2, cka) == pytest.approx(direct, abs=1e-10)
    # the preparation matters: mixing cosine entropies with linear CKA breaks the identity
    if kernel == "linear":
        h2c = torch.tensor([E.matrix_entropy(z, 2.0, kernel="cosine") for z in zs[:2]], dtype=torch.float64)
        ckal = torch.tensor([[C.cka(a, b) for b in zs[:2]] for a in zs[:2]], dtype=torch.float64)
        assert abs(E.aggregate_entropy2(h2c, ckal) - E.aggregate_entropy(zs[:2], 2.0)) > 1e-3


def test_linear_preparation_only_centres():
    z = decaying(30, 8, seed=12) + 4.0
    p = E.prepare(z)
    assert torch.allclose(p, z - z.mean(0), atol=1e-12)
    c = E.prepare(z, "cosine")
    assert torch.allclose(c.mean(0), torch.zeros(8, dtype=torch.float64), atol=1e-12)
    assert not torch.allclose(c.norm(dim=1), p.norm(dim=1))


def test_aggregate_of_identical_layers_is_the_layer_and_grows_with_new_information():
    zs = correlated_layers(3, 100, 12, seed=9)
    h = E.matrix_entropy(zs[0], 1.0)
    assert E.aggregate_entropy([zs[0], 3 * zs[0]], 1.0) == pytest.approx(h, abs=1e-10)
    assert E.aggregate_entropy([zs[0], torch.randn(100, 12, generator=gen(10))], 1.0) > h + 0.1


def test_group_entropies_equal_one_at_a_time():
    z = decaying(70, 12, seed=11)
    groups = [torch.arange(0, 9), torch.arange(9, 40), torch.tensor([40, 45, 50, 55, 60, 65])]
    for alpha in (1.0, 2.0):
        batched = E.group_entropies(z, groups, alpha)
        assert batched == pytest.approx([E.matrix_entropy(z[g], alpha) for g in groups], abs=1e-10)
