"""Depth compartments: contiguous blocks of layers that represent tokens alike.

`compartments(cka, k)` cuts layers 0..M-1 into k contiguous blocks by clustering a CKA matrix
[M, M] (contiguous kernel k-means, exact by dynamic programming); `compartment_objective` scores a
cut. Used by the analysis (blocks for every k, drawn on the heatmap) and by the `spread` strategy.
Pure functions on tensors, no I/O.
"""

from __future__ import annotations

import torch

from layerscope.errors import SelectionError


def compartments(cka, k: int) -> list[list[int]]:
    """Cut layers 0..M-1 into k contiguous blocks [first, last] by clustering the CKA matrix [M, M].

    Contiguous kernel k-means with CKA as the kernel (a PSD matrix): maximise
    Σ_blocks (1/|b|) Σ_{i,j∈b} CKA_ij, solved exactly by dynamic programming in O(k·M²).
    """
    c = torch.as_tensor(cka, dtype=torch.float64)
    m = c.shape[0]
    if not 1 <= k <= m:
        raise SelectionError(f"Cannot cut {m} layers into {k} compartments", f"Ask for 1..{m}")
    s = torch.zeros(m + 1, m + 1, dtype=torch.float64)
    s[1:, 1:] = c.cumsum(0).cumsum(1)
    a = torch.arange(m)
    first, last = a[:, None], a[None, :]             # block [first, last]
    size = (last - first + 1).clamp_min(1)
    total = s[last + 1, last + 1] - s[first, last + 1] - s[last + 1, first] + s[first, first]
    gain = torch.where(last >= first, total / size, torch.full_like(total, float("-inf")))
    best = gain[0].clone()                          # best[e]: layers 0..e in 1 block
    cut = [[0] * m]                                 # cut[j][e]: start of the last block
    for _ in range(1, k):
        new, starts = torch.full_like(best, float("-inf")), [0] * m
        for e in range(m):
            for f in range(1, e + 1):               # last block [f, e], earlier blocks cover 0..f-1
                v = best[f - 1] + gain[f, e]
                if v > new[e]:
                    new[e], starts[e] = v, f
        best = new
        cut.append(starts)
    blocks, e = [], m - 1
    for j in range(k - 1, -1, -1):
        f = cut[j][e]
        blocks.append([f, e])
        e = f - 1
    return blocks[::-1]


def compartment_objective(cka, blocks) -> float:
    """The clustering objective of a segmentation: Σ_blocks mean within-block CKA × |block|."""
    c = torch.as_tensor(cka, dtype=torch.float64)
    return float(sum(c[f:e + 1, f:e + 1].sum() / (e - f + 1) for f, e in blocks))
