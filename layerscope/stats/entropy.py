"""Matrix entropy of a layer: how many directions its token representations really use.

For a token matrix Z [n, d] of one layer:
    P = prepare(Z, kernel)           the token preparation, float64:
        "linear"  center columns (standard linear CKA, Kornblith et al. 2019: K = Z̃ Z̃ᵀ)
        "cosine"  center columns, scale rows to unit length, center again (a cosine kernel: every
                  token gets one vote, so a few huge-norm tokens cannot dominate the Gram)
    K = P Pᵀ / tr(P Pᵀ)              trace-normalized Gram [n, n]; eigenvalues λ ≥ 0 sum to 1
    S_α = log(Σ λ^α) / (1 - α)       Rényi entropy in nats; α = 1 is the von Neumann limit -Σ λ log λ
    S_α / log min(n, d)              normalized entropy in [0, 1]
When n > d the spectrum comes from the d×d covariance Pᵀ P (same nonzero eigenvalues, cheaper).
Both preparations end with centered columns, so K is already centered and CKA on prepared matrices
needs no further centering; entropy and CKA must use the same preparation for the identity below.

Aggregate entropy of a layer set: the entropy of the concatenation [P_1/‖P_1‖, ..., P_k/‖P_k‖]
(each block scaled to unit trace, so no layer dominates by norm); its Gram is the mean of the K_i.
For α = 2 it follows exactly from per-layer entropies and pairwise CKA (see `aggregate_entropy2`).
Pure functions on tensors, no I/O.
"""

from __future__ import annotations

import math

import torch

KERNELS = ("linear", "cosine")   # token preparations; "linear" is standard linear CKA and the default


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
    return kernel


def prepare(z: torch.Tensor, kernel: str = "linear") -> torch.Tensor:
    """[n, d] any float -> [n, d] float64 with centered columns.

    "linear": centered columns only. "cosine": centered columns, unit rows, centered columns again.
    """
    check_kernel(kernel)
    p = z.to(torch.float64, copy=True)
    p -= p.mean(0, keepdim=True)
    if kernel == "cosine":
        p /= p.norm(dim=1, keepdim=True).clamp_min(1e-300)   # an all-zero row stays zero
        p -= p.mean(0, keepdim=True)
    return p


def spectrum(p: torch.Tensor, route: str = "auto") -> torch.Tensor:
    """Eigenvalues of K = P Pᵀ / tr(P Pᵀ) for a prepared P [n, d], descending, ≥ 0, summing to 1.

    route: "gram" (n×n), "cov" (d×d) or "auto" (the smaller). Only nonzero eigenvalues matter, and
    both routes share them. Eigenvalues below numerical precision are set to 0 (entries never are).
    """
    n, d = p.shape
    if route == "auto":
        route = "cov" if n > d else "gram"
    if route not in ("gram", "cov"):
        raise ValueError(f"route must be 'auto', 'gram' or 'cov', not {route!r}")
    p = p.to(torch.float64)
    m = p.T @ p if route == "cov" else p @ p.T
    return _clean(torch.linalg.eigvalsh(m), max(n, d))


def _clean(ev: torch.Tensor, size: int) -> torch.Tensor:
    """Ascending eigenvalues of a PSD matrix -> descending, clipped at 0, numerical zeros set to 0, sum 1."""
    ev = ev.flip(-1).clamp_min(0.0)
    if ev.numel() == 0 or ev[0] <= 0:
        return torch.zeros(0, dtype=torch.float64)
    ev = torch.where(ev > ev[0] * size * torch.finfo(torch.float64).eps, ev, torch.zeros_like(ev))
    return ev / ev.sum()


def renyi(eigs: torch.Tensor, alpha: float = 1.0) -> float:
    """Rényi entropy (nats) of a probability vector `eigs`; α = 1 is the Shannon limit."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    lam = eigs[eigs > 0].to(torch.float64)
    if lam.numel() == 0:
        return 0.0
    lam = lam / lam.sum()
    log = lam.log()
    if abs(alpha - 1.0) < 1e-6:   # the limit, plus its first-order term (dS/dα = -Var(log λ)/2 at 1)
        s1 = -(lam * log).sum()
        var = (lam * (log + s1).square()).sum()
        return float(s1 - (alpha - 1.0) * var / 2)
    if math.isinf(alpha):
        return float(-lam.max().log())
    # log Σ λ^α computed as logsumexp(α log λ): stable for any α
    return float(torch.logsumexp(alpha * log, 0) / (1.0 - alpha))


def matrix_entropy(z: torch.Tensor, alpha: float = 1.0, route: str = "auto", prepared: bool = False,
                   kernel: str = "linear") -> float:
    """Rényi matrix entropy (nats) of one layer's tokens Z [n, d] under the `kernel` preparation. A reference
    implementation kept for the tests (the analysis prepares each layer once and calls `spectrum` and `renyi`)."""
    p = z if prepared else prepare(z, kernel)
    return renyi(spectrum(p, route), alpha)


def group_entropies(z: torch.Tensor, groups: list[torch.Tensor], alpha: float = 1.0,
                    kernel: str = "linear") -> list[float]:
    """Entropy (nats) of each group of rows of z [n, d] (e.g. one conversation's tokens), each group
    prepared on its own. Batched: groups are padded with zero rows, which add only zero eigenvalues."""
    if not groups:
        return []
    m, d = max(len(g) for g in groups), z.shape[1]
    batch = torch.zeros(len(groups), m, d, dtype=torch.float64, device=z.device)
    for i, g in enumerate(groups):
        batch[i, :len(g)] = prepare(z[g], kernel)
    grams = batch @ batch.mT if m <= d else batch.mT @ batch
    ev = torch.linalg.eigvalsh(grams)
    return [renyi(_clean(ev[i], max(m, d)), alpha) for i in range(len(groups))]


def max_entropy(n: int, d: int) -> float:
    """log min(n, d): the entropy of a Gram with min(n, d) equal eigenvalues."""
    m = min(n, d)
    return math.log(m) if m > 1 else 0.0


def normalized(h: float, n: int, d: int) -> float:
    """H / log min(n, d), in [0, 1]."""
    top = max_entropy(n, d)
    return h / top if top > 0 else 0.0


def concat_unit_trace(ps: list[torch.Tensor]) -> torch.Tensor:
    """Prepared blocks [n, d_i] -> [n, Σ d_i], each block scaled to ‖P_i‖_F = 1 (unit-trace Gram)."""
    return torch.cat([p / p.norm().clamp_min(1e-300) for p in ps], dim=1)


def aggregate_entropy(zs: list[torch.Tensor], alpha: float = 1.0, prepared: bool = False,
                      kernel: str = "linear") -> float:
    """Entropy (nats) of a layer set: the matrix entropy of its unit-trace blocks side by side."""
    ps = [z if prepared else prepare(z, kernel) for z in zs]
    return renyi(spectrum(concat_unit_trace(ps)), alpha)


def aggregate_entropy2(h2: torch.Tensor, cka: torch.Tensor) -> float:
    """α = 2 aggregate entropy of a set from its layers' α = 2 entropies h2 [k] and biased CKA [k, k].

    K_S = (1/k) Σ K_i, and tr(K_i K_j) = CKA_ij · exp(-(H2_i + H2_j)/2) because H2_i = -log tr(K_i²), so
        H2(S) = -log( (1/k²) Σ_ij CKA_ij exp(-(H2_i + H2_j)/2) ).
    Holds for either kernel as long as the entropies and the CKA come from the same preparation.
    """
    h2 = torch.as_tensor(h2, dtype=torch.float64)
    c = torch.as_tensor(cka, dtype=torch.float64).clone()
    c.fill_diagonal_(1.0)
    w = torch.exp(-h2 / 2)
    return float(-torch.log((c * w[:, None] * w[None, :]).sum() / h2.numel() ** 2))
