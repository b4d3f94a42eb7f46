"""Linear CKA between layers: how redundant two layers' token representations are.

All inputs are prepared token matrices P [n, d] (see `entropy.prepare`), so the Grams K = P Pᵀ are
centered and
    biased CKA(i, j) = tr(K_i K_j) / sqrt(tr K_i² · tr K_j²),   tr(K_i K_j) = ‖P_iᵀ P_j‖_F²
(the feature-space form, O(n·d²), instead of O(n²·d) with n×n Grams). The debiased estimator
replaces each tr(K K') with the unbiased HSIC of Song et al. (2012), also in feature space.

Two token preparations (`kernel`):
- "linear" (default): centered columns only. This is standard linear CKA (Kornblith et al. 2019),
  what torch_cka and most papers report.
- "cosine": centered columns, unit rows, centered again: linear CKA on row-normalised tokens (a
  cosine kernel). LayerScope's only convention before; less sensitive to a few huge-norm tokens.
The two can differ a lot (on SmolLM2 by 0.2 on average over layer pairs), so every result names its kernel.

Three ways to get every pair of L layers:
- `cka` per pair, float64: the straightforward reference.
- `cka_all_pairs`: exact. One float32 matrix [n, L·d] holds every prepared layer; for each layer i
  one pass over token blocks accumulates P_iᵀ [P_i … P_{L-1}] in float64 across blocks, and each
  pair's ‖P_iᵀ P_j‖_F² is read off its d×d block. Small n uses n×n Grams in float64 instead.
- `cka_lowrank`: each layer projected onto its top-r principal directions; the error against the
  exact biased CKA is at most ε_i + ε_j (returned as `bound`), ε_i = tail energy of K_i's spectrum.
Pure functions on tensors, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from layerscope.stats.entropy import check_kernel, prepare


@dataclass
class CKAResult:
    biased: torch.Tensor                  # [L, L] float64, symmetric, 1 on the diagonal
    debiased: torch.Tensor | None = None  # [L, L] float64 (unbiased HSIC), None when not computed
    bound: torch.Tensor | None = None     # [L, L] max |biased - exact biased| (low-rank mode only)
    route: str = "features"               # "features", "gram" or "lowrank-<r>"


# ---- per pair, float64: the reference ------------------------------------------------------------

def hsic_unbiased_gram(k: torch.Tensor, l: torch.Tensor) -> float:
    """Unbiased HSIC (Song et al. 2012) from two n×n Grams, textbook form (n ≥ 4). A reference implementation kept
    for the tests, which check the feature-space debiased CKA against it; LayerScope's own code does not call it."""
    n = k.shape[0]
    k = k.to(torch.float64).clone().fill_diagonal_(0)
    l = l.to(torch.float64).clone().fill_diagonal_(0)
    one = torch.ones(n, dtype=torch.float64)
    t1 = (k * l).sum()
    t2 = (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
    t3 = 2 * (one @ k) @ (l @ one) / (n - 2)
    return float((t1 + t2 - t3) / (n * (n - 3)))


def _hsic_parts(x: torch.Tensor):
    """Per-layer terms of the feature-space unbiased HSIC for K = X Xᵀ: diag k [n], 1ᵀK̃1, K̃1 [n]."""
    k = (x * x).sum(1)
    u = x.sum(0)
    return k, (u @ u) - k.sum(), x @ u - k


def _hsic_unbiased(cross: torch.Tensor, kk: torch.Tensor, s_i, s_j, aa: torch.Tensor, n: int) -> torch.Tensor:
    """Unbiased HSIC from tr(K_i K_j), k_iᵀk_j, 1ᵀK̃_i1, 1ᵀK̃_j1, (K̃_i1)ᵀ(K̃_j1); broadcasts."""
    return (cross - kk + s_i * s_j / ((n - 1) * (n - 2)) - 2 * aa / (n - 2)) / (n * (n - 3))


def _ratio(num: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    den = (a * b).clamp_min(0).sqrt()
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def cka(x: torch.Tensor, y: torch.Tensor, debiased: bool = False, prepared: bool = False,
        kernel: str = "linear") -> float:
    """Linear CKA of two layers' tokens x [n, d1], y [n, d2] (same tokens, same order), float64,
    under the `kernel` token preparation ("linear": standard; "cosine": row-normalised)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must hold the same tokens: {x.shape[0]} != {y.shape[0]} rows")
    p, q = (x, y) if prepared else (prepare(x, kernel), prepare(y, kernel))
    p, q = p.to(torch.float64), q.to(torch.float64)
    n = p.shape[0]
    if not debiased:
        if n <= max(p.shape[1], q.shape[1]):   # n×n route
            kp, kq = p @ p.T, q @ q.T
            xy, xx, yy = (kp * kq).sum(), (kp * kp).sum(), (kq * kq).sum()
        else:                                   # feature route
            xy, xx, yy = (p.T @ q).square().sum(), (p.T @ p).square().sum(), (q.T @ q).square().sum()
        return float(_ratio(xy, xx, yy))
    if n < 4:
        raise ValueError("debiased CKA needs at least 4 tokens")
    kp, sp, ap = _hsic_parts(p)
    kq, sq, aq = _hsic_parts(q)
    hxy = _hsic_unbiased((p.T @ q).square().sum(), kp @ kq, sp, sq, ap @ aq, n)
    hxx = _hsic_unbiased((p.T @ p).square().sum(), kp @ kp, sp, sp, ap @ ap, n)
    hyy = _hsic_unbiased((q.T @ q).square().sum(), kq @ kq, sq, sq, aq @ aq, n)
    return float(_ratio(hxy, hxx, hyy))


# ---- all pairs, exact ----------------------------------------------------------------------------

def cross_energies(p: torch.Tensor, block: int = 4096, route: str = "auto",
                   progress: Callable[[float], None] | None = None) -> tuple[torch.Tensor, str]:
    """tr(K_i K_j) = ‖P_iᵀ P_j‖_F² for every pair of layers in p [n, L, d] -> ([L, L] float64, route).

    "features": float32 products over token blocks of `block` rows, float64 accumulation across
    blocks, one pass per layer i against layers i..L-1 (memory d × L·d float64); progress(fraction)
    is called after each pass.
    "gram": n×n Grams in float64 and their Frobenius inner products (cheaper when n is small).
    """
    n, L, d = p.shape
    if route == "auto":
        gram_cost, feat_cost = L * n * n * d + L * L * n * n, n * (L * d) ** 2 / 2
        route = "gram" if gram_cost < feat_cost and L * n * n * 8 <= 2**28 else "features"
    out = torch.zeros(L, L, dtype=torch.float64, device=p.device)
    if route == "gram":
        grams = torch.stack([p[:, i].double() @ p[:, i].double().T for i in range(L)]).reshape(L, n * n)
        out = grams @ grams.T
        return (out + out.T) / 2, "gram"
    if route != "features":
        raise ValueError(f"route must be 'auto', 'gram' or 'features', not {route!r}")
    flat = p.to(torch.float32).reshape(n, L * d)
    for i in range(L):
        acc = torch.zeros(d, (L - i) * d, dtype=torch.float64, device=p.device)
        for s in range(0, n, block):
            rows = flat[s:s + block]
            acc += (rows[:, i * d:(i + 1) * d].T @ rows[:, i * d:]).double()
        out[i, i:] = acc.view(d, L - i, d).square().sum((0, 2))
        if progress:
            progress(1 - (L - i - 1) * (L - i) / (L * (L + 1)))   # share of the L(L+1)/2 blocks done
    return out.triu() + out.triu(1).T, "features"


def cka_all_pairs(p: torch.Tensor, debiased: bool = True, block: int = 4096, route: str = "auto",
                  progress: Callable[[float], None] | None = None) -> CKAResult:
    """Biased (and debiased) linear CKA for every pair of layers of prepared p [n, L, d]."""
    n, L, d = p.shape
    cross, route = cross_energies(p, block, route, progress)
    diag = cross.diagonal()
    biased = _ratio(cross, diag[:, None], diag[None, :])
    biased.fill_diagonal_(1.0)
    result = CKAResult(biased=biased, route=route)
    if debiased:
        if n < 4:
            raise ValueError("debiased CKA needs at least 4 tokens")
        parts = [_hsic_parts(p[:, i].double()) for i in range(L)]
        k = torch.stack([x[0] for x in parts])                # [L, n]
        s = torch.stack([x[1] for x in parts])                # [L]
        a = torch.stack([x[2] for x in parts])                # [L, n]
        h = _hsic_unbiased(cross, k @ k.T, s[:, None], s[None, :], a @ a.T, n)
        h = (h + h.T) / 2
        hd = h.diagonal()
        result.debiased = _ratio(h, hd[:, None], hd[None, :])
        result.debiased.fill_diagonal_(1.0)
    return result


def cka_matrix(layers, debiased: bool = True, block: int = 4096, kernel: str = "linear") -> CKAResult:
    """All-pairs CKA from raw layers: a list of [n, d] tensors or a tensor [L, n, d]. A reference implementation kept
    for the tests (the analysis prepares each layer once itself and calls `cka_all_pairs`)."""
    check_kernel(kernel)
    p = torch.stack([prepare(z, kernel).to(torch.float32) for z in layers], dim=1)
    return cka_all_pairs(p, debiased=debiased, block=block)


# ---- all pairs, low rank with an error bound -----------------------------------------------------

def covariance(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """xᵀx [d, d] float64 for x [n, d]: float32 products over token blocks, float64 accumulation."""
    x = x.to(torch.float32)
    acc = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], block):
        acc += (x[s:s + block].T @ x[s:s + block]).double()
    return acc


def tail_energy(eigs: torch.Tensor, rank: int) -> float:
    """ε = sqrt(Σ_{k>r} λ_k²) / sqrt(Σ λ_k²) for eigenvalues of K: the relative Frobenius norm of
    K - K_r, the part a rank-r projection drops."""
    lam = eigs.to(torch.float64).clamp_min(0).sort(descending=True).values
    total = lam.square().sum()
    return float((lam[rank:].square().sum() / total).sqrt()) if total > 0 else 0.0


def cka_lowrank(p: torch.Tensor, rank: int, block: int = 4096) -> CKAResult:
    """Biased CKA of prepared p [n, L, d] with each layer cut to its top-`rank` principal directions.

    Y_i = P_i V_i (V_i: top eigenvectors of P_iᵀ P_i) gives Y_i Y_iᵀ = K_i^r, the best rank-r
    approximation of K_i, and K_i - K_i^r is Frobenius-orthogonal to K_i^r. So the angle θ_i between
    K_i and K_i^r has sin θ_i = ε_i (`tail_energy`). CKA is the cosine of the angle between Grams,
    angles obey the triangle inequality, and Grams of PSD matrices are never more than 90° apart, so
        |CKA^r_ij - CKA_ij| ≤ sin(θ_i + θ_j) ≤ ε_i + ε_j,
    returned (capped at 1) as `bound`. Cost: n·d² per layer plus n·(L·r)² for the pairs.
    """
    n, L, d = p.shape
    r = max(1, min(rank, d, n))
    ys, eps = [], []
    for i in range(L):
        ev, vec = torch.linalg.eigh(covariance(p[:, i], block))
        ys.append((p[:, i].to(torch.float32) @ vec[:, -r:].flip(1).to(torch.float32)))
        eps.append(tail_energy(ev, r))
    result = cka_all_pairs(torch.stack(ys, dim=1), debiased=False, block=block, route="features")
    e = torch.tensor(eps, dtype=torch.float64, device=p.device)
    result.bound = (e[:, None] + e[None, :]).clamp_max(1.0)
    result.bound.fill_diagonal_(0.0)
    result.route = f"lowrank-{r}"
    return result
