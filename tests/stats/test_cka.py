"""Linear CKA: invariances, estimators, the fast all-pairs matrix against the float64 reference."""

import numpy as np
import pytest
import torch

from layerscope.stats import cka as C
from layerscope.stats import entropy as E
from tests.helpers import correlated_layers, gen


def rand(n, d, seed):
    return torch.randn(n, d, generator=gen(seed), dtype=torch.float64)


def orthogonal(d, seed):
    return torch.linalg.qr(rand(d, d, seed))[0]


@pytest.mark.parametrize("n,d", [(60, 12), (12, 30)])
@pytest.mark.parametrize("debiased", [False, True])
def test_invariances_give_one(n, d, debiased):
    x = rand(n, d, 1) * torch.linspace(2, 0.1, d, dtype=torch.float64)
    b = rand(1, d, 2)
    assert C.cka(x, x @ orthogonal(d, 3), debiased) == pytest.approx(1.0, abs=1e-10)
    assert C.cka(x, -2.5 * x + b, debiased) == pytest.approx(1.0, abs=1e-10)
    assert C.cka(x, 0.01 * x + 7.0, debiased) == pytest.approx(1.0, abs=1e-10)


@pytest.mark.parametrize("debiased", [False, True])
def test_symmetric_and_invariant_to_token_permutation(debiased):
    x, y = correlated_layers(2, 50, 10, seed=4)
    perm = torch.randperm(50, generator=gen(5))
    v = C.cka(x, y, debiased)
    assert 0.05 < v < 0.999
    assert C.cka(y, x, debiased) == pytest.approx(v, abs=1e-12)
    assert C.cka(x[perm], y[perm], debiased) == pytest.approx(v, abs=1e-12)
    assert C.cka(x[perm], y, debiased) != pytest.approx(v, abs=1e-3)   # pairing tokens matters


def test_routes_of_the_reference_agree():
    x, y = correlated_layers(2, 40, 30, seed=6)
    p, q = E.prepare(x), E.prepare(y)
    kp, kq = p @ p.T, q @ q.T
    gram = float((kp * kq).sum() / ((kp * kp).sum() * (kq * kq).sum()).sqrt())
    feat = float((p.T @ q).square().sum() / ((p.T @ p).square().sum() * (q.T @ q).square().sum()).sqrt())
    assert gram == pytest.approx(feat, abs=1e-12)
    assert C.cka(x, y) == pytest.approx(gram, abs=1e-12)                  # n > d: feature route
    p, q = E.prepare(x[:20]), E.prepare(y[:20])                           # n ≤ d: n×n route
    feat = float((p.T @ q).square().sum() / ((p.T @ p).square().sum() * (q.T @ q).square().sum()).sqrt())
    assert C.cka(x[:20], y[:20]) == pytest.approx(feat, abs=1e-12)


@pytest.mark.parametrize("n,d", [(40, 8), (9, 20)])
def test_feature_space_unbiased_hsic_equals_textbook_form(n, d):
    x, y = correlated_layers(2, n, d, seed=7)
    x = x + 0.3                                       # raw, uncentered: the formula is general
    k, l = x @ x.T, y @ y.T
    want = C.hsic_unbiased_gram(k, l)
    kx, sx, ax = C._hsic_parts(x)
    ky, sy, ay = C._hsic_parts(y)
    got = float(C._hsic_unbiased((x.T @ y).square().sum(), kx @ ky, sx, sy, ax @ ay, n))
    assert got == pytest.approx(want, rel=1e-10)
    ref = C.hsic_unbiased_gram(k, l) / (C.hsic_unbiased_gram(k, k) * C.hsic_unbiased_gram(l, l)) ** 0.5
    px, py = E.prepare(x), E.prepare(y)
    kp, kq = px @ px.T, py @ py.T
    ref = C.hsic_unbiased_gram(kp, kq) / (C.hsic_unbiased_gram(kp, kp) * C.hsic_unbiased_gram(kq, kq)) ** 0.5
    assert C.cka(x, y, debiased=True) == pytest.approx(ref, abs=1e-10)


def test_debiased_removes_the_small_sample_bias():
    x, y = rand(100, 60, 8), rand(100, 60, 9)           # independent: population CKA is 0
    assert C.cka(x, y) > 0.3                             # biased estimate is far from 0 when d ~ n
    assert abs(C.cka(x, y, debiased=True)) < 0.05


def reference_matrix(layers, debiased):
    L = len(layers)
    return torch.tensor([[C.cka(layers[i], layers[j], debiased) for j in range(L)] for i in range(L)],
                        dtype=torch.float64)


@pytest.mark.parametrize("n,route", [(700, "features"), (700, "auto"), (30, "gram"), (30, "auto")])
def test_fast_all_pairs_matches_float64_reference(n, route):
    layers = correlated_layers(6, n, 24, seed=10)
    layers[3] = layers[3] * 50 + 3                     # scale and shift must not matter
    p = torch.stack([E.prepare(z).float() for z in layers], dim=1)
    res = C.cka_all_pairs(p, debiased=True, block=128, route=route)
    assert (res.biased - reference_matrix(layers, False)).abs().max() < 1e-6
    assert (res.debiased - reference_matrix(layers, True)).abs().max() < 1e-6
    assert torch.equal(res.biased, res.biased.T) and torch.equal(res.debiased, res.debiased.T)
    off = res.biased[~torch.eye(6, dtype=torch.bool)]
    assert off.min() > 0.05 and off.max() < 0.999      # a real spread of values, not a trivial case


def test_all_pairs_is_positive_semidefinite_and_permutation_invariant():
    layers = correlated_layers(8, 200, 16, seed=11)
    res = C.cka_matrix(layers, debiased=False, block=64)
    assert torch.linalg.eigvalsh(res.biased).min() > -1e-9
    perm = torch.randperm(200, generator=gen(12))
    again = C.cka_matrix([z[perm] for z in layers], debiased=False, block=64)
    assert (again.biased - res.biased).abs().max() < 1e-6


@pytest.mark.parametrize("rank", [1, 3, 8])
def test_lowrank_error_within_its_bound(rank):
    layers = correlated_layers(5, 300, 24, seed=13)
    p = torch.stack([E.prepare(z).float() for z in layers], dim=1)
    exact = C.cka_all_pairs(p, debiased=False).biased
    low = C.cka_lowrank(p, rank)
    err = (low.biased - exact).abs()
    assert (err <= low.bound + 1e-6).all()
    assert err.max() > 1e-5                                       # the cut is real
    if rank == 8:                                                 # past the latent rank: a useful bound
        assert low.bound.max() < 0.1


def test_lowrank_at_full_rank_is_exact():
    layers = correlated_layers(4, 100, 10, seed=14)
    p = torch.stack([E.prepare(z).float() for z in layers], dim=1)
    low = C.cka_lowrank(p, 10)
    assert low.bound.max() < 1e-6
    assert (low.biased - C.cka_all_pairs(p, debiased=False).biased).abs().max() < 1e-6


def test_tail_energy():
    assert C.tail_energy(torch.tensor([3.0, 4.0, 0.0]), 1) == pytest.approx(0.6)   # sqrt(9) / sqrt(9 + 16)
    assert C.tail_energy(torch.tensor([3.0, 4.0]), 2) == 0.0


# ---- the two kernels -----------------------------------------------------------------------------

def kornblith_linear_cka(x, y):
    """Linear CKA exactly as Kornblith et al. (2019) write it, in numpy: centre the columns, then
    ‖YᵀX‖_F² / (‖XᵀX‖_F ‖YᵀY‖_F); checked against their Gram form with the centring matrix H."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xc, yc = x - x.mean(0), y - y.mean(0)
    feat = np.linalg.norm(yc.T @ xc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))
    n = x.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n
    k, l = h @ (x @ x.T) @ h, h @ (y @ y.T) @ h
    gram = np.sum(k * l) / np.sqrt(np.sum(k * k) * np.sum(l * l))
    assert abs(feat - gram) < 1e-10
    return float(feat)


@pytest.mark.parametrize("n,d", [(80, 12), (15, 40)])
def test_standard_linear_cka_matches_numpy_kornblith(n, d):
    x, y = correlated_layers(2, n, d, seed=21)
    x = x * 3 + 5.0                                       # uncentered, unscaled: the formula centres
    y[0] *= 40                                            # one large-norm token: no row normalisation
    want = kornblith_linear_cka(x.numpy(), y.numpy())
    assert C.cka(x, y) == pytest.approx(want, abs=1e-10)                  # the default kernel
    assert C.cka(x, y, kernel="linear") == pytest.approx(want, abs=1e-10)
    res = C.cka_matrix([x, y], debiased=False)
    assert float(res.biased[0, 1]) == pytest.approx(want, abs=1e-6)
    # the cosine kernel is Kornblith's formula on row-normalised centred tokens, and differs here
    unit = lambda z: (z - z.mean(0)) / (z - z.mean(0)).norm(dim=1, keepdim=True)   # noqa: E731
    cos = kornblith_linear_cka(unit(x).numpy(), unit(y).numpy())
    assert C.cka(x, y, kernel="cosine") == pytest.approx(cos, abs=1e-10)
    assert abs(cos - want) > 0.01


def test_unknown_kernel_is_refused():
    x = rand(10, 4, 1)
    with pytest.raises(ValueError, match="kernel"):
        C.cka(x, x, kernel="rbf")
