"""Ridge regression from streamed sufficient statistics: the probe's algebra (layerscope/study/probe.py).

Rows x [n, B·d] are B blocks of width d (a draft's layers, then the embedding); y [n, d] the target.

    g = Gram(B, d); g.add(x, y)          accumulate XᵀX (upper block triangle), XᵀY, column sums, n; float64
    A, Bm = g.system(idx)                normal equations of blocks idx (in that order) plus a bias column:
                                         A [p, p], Bm [p, d], p = len(idx)·d + 1
    W = ridge(A, Bm, lam)                (A + λD)⁻¹ Bm by Cholesky, D = penalty(A): each column's centred sum of
                                         squares (standardised ridge), 0 for the bias; None if not positive definite
    M = logit_metric(lm_head)            [d, d]: e M eᵀ is the mean squared logit error of a state error e [d]
    logit_loss(err, M), explained_variance(pred, y)

Pure functions on tensors, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

F64 = torch.float64


class Gram:
    """Sufficient statistics of rows x [n, B·d] (B blocks of width d) and y [n, d] for every set of blocks:
    xx[a] = X_aᵀ[X_a … X_{B−1}] [d, (B−a)·d] (the upper block triangle), xy = XᵀY [B·d, d], xs = Σ x [B·d],
    n rows; float64."""

    def __init__(self, blocks: int, d: int):
        self.blocks, self.d, self.n = blocks, d, 0
        self.xx = [torch.zeros(d, (blocks - a) * d, dtype=F64) for a in range(blocks)]
        self.xy = torch.zeros(blocks * d, d, dtype=F64)
        self.xs = torch.zeros(blocks * d, dtype=F64)
        self.ys = torch.zeros(d, dtype=F64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Accumulate rows: x [n, B·d], y [n, d] (cast to float64)."""
        x, y, d = x.to(F64), y.to(F64), self.d
        assert x.shape[1] == self.blocks * d and y.shape == (x.shape[0], d), (x.shape, y.shape)
        for a in range(self.blocks):
            self.xx[a] += x[:, a * d:(a + 1) * d].T @ x[:, a * d:]
        self.xy += x.T @ y
        self.xs += x.sum(0)
        self.ys += y.sum(0)
        self.n += x.shape[0]

    def block(self, a: int, b: int) -> torch.Tensor:
        """X_aᵀX_b [d, d]."""
        if a > b:
            return self.block(b, a).T
        return self.xx[a][:, (b - a) * self.d:(b - a + 1) * self.d]

    def system(self, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(A = X_Sᵀ X_S [p, p], B = X_Sᵀ Y [p, d]) for blocks idx in that order, bias last: p = len(idx)·d + 1."""
        d, k = self.d, len(idx)
        p = k * d + 1
        A = torch.empty(p, p, dtype=F64)
        for i, a in enumerate(idx):
            for j, b in enumerate(idx):
                A[i * d:(i + 1) * d, j * d:(j + 1) * d] = self.block(a, b)
        cols = block_columns(idx, d)
        A[-1, :-1] = A[:-1, -1] = self.xs[cols]
        A[-1, -1] = self.n
        B = torch.cat([self.xy[cols], self.ys[None]])
        return A, B


def block_columns(idx: Sequence[int], d: int) -> torch.Tensor:
    """Column indices of blocks idx (in that order) in a row of B·d values."""
    return torch.cat([torch.arange(a * d, (a + 1) * d) for a in idx])


def with_bias(x: torch.Tensor) -> torch.Tensor:
    """[n, q] -> [n, q + 1] float64, a column of ones last."""
    return torch.cat([x.to(F64), torch.ones(x.shape[0], 1, dtype=F64)], dim=1)


def penalty(A: torch.Tensor) -> torch.Tensor:
    """D of a Gram A = XᵀX whose last column is the bias: each column's centred sum of squares
    Σ x_j² − (Σ x_j)² / n (floored at 1e-9 of their mean, so a constant column stays solvable), 0 for the bias."""
    n, s = A[-1, -1], A[-1, :-1]
    spread = A.diagonal()[:-1] - s * s / n
    spread = spread.clamp_min(1e-9 * float(spread.mean().clamp_min(1e-300)))
    return torch.cat([spread, torch.zeros(1, dtype=A.dtype)])


def ridge(A: torch.Tensor, B: torch.Tensor, lam: float) -> torch.Tensor | None:
    """W = (A + λD)⁻¹ B by Cholesky, D = penalty(A) (standardised ridge: scaling a column of X by c scales its
    row of W by 1/c and leaves X W unchanged); None if not positive definite."""
    L, info = torch.linalg.cholesky_ex(A + torch.diag(float(lam) * penalty(A)))
    if int(info) != 0:
        return None
    return torch.cholesky_solve(B, L)


def logit_metric(lm_head: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """M = lm_headᵀ lm_head / vocab [d, d] float64: e M eᵀ is the mean squared logit error of a state error e."""
    V, d = lm_head.shape
    M = torch.zeros(d, d, dtype=F64)
    for i in range(0, V, block):
        w = lm_head[i:i + block].detach().to("cpu", F64)
        M += w.T @ w
    return M / V


def logit_loss(err: torch.Tensor, M: torch.Tensor) -> float:
    """Mean over rows of e M eᵀ: err [n, d] float64."""
    return float(((err @ M) * err).sum() / max(err.shape[0], 1))


def explained_variance(pred: torch.Tensor, y: torch.Tensor) -> float:
    """1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖² over rows (all dimensions pooled)."""
    sst = float((y - y.mean(0)).square().sum())
    return 1.0 - float((y - pred).square().sum()) / sst if sst > 0 else float("nan")
