"""Exact tree verification in 16-bit floats: each node of a tree attends as the chain through its path would.

A tree is verified in one target forward, its nodes flattened into rows under a 4-D mask (specdec.tree_mask), so an
accepted node's ancestors sit among rejected cousins that the mask hides. In bfloat16 the attention's reductions then
pair the visible terms otherwise than plain decoding, which reads the same keys side by side, and a near-tie can flip:
7 of 41 outputs of Qwen2.5-Coder-1.5B differed from plain decoding under a 12-node tree (docs/internals.md, "bfloat16
and lossless"). Every other part of a forward works row by row, and padded forwards (specdec.row_alignment) already
compute a row alike whatever rows surround it. So only attention changes, and only inside a tree's forward:

    plan = path_plan(parent_row, anc, prefix, align)     # the tree's root-to-leaf paths, laid out as chains
    with paths(plan):
        model(...)                                       # each attention layer runs `attention` below

`attention` lays each path out as the chain verifying it would be (the cached prefix, then the path's nodes side by
side, as many rows as `padding_rows` gives that chain), one path per batch item, runs transformers' own sdpa on that
batch, and gives each node the output of a path through it. Outside a plan it is transformers' sdpa itself (plain
decoding, chains, prefills: the same function on the same tensors, the same bits).

`install(model)` switches a target that attends with transformers' sdpa to this function (registered with
transformers' AttentionInterface and AttentionMaskInterface as ATTENTION, the documented way to add one:
https://huggingface.co/docs/transformers/en/attention_interface). Cost: P paths of R rows attend over the prefix
instead of one R-row forward; the projections and MLPs, most of a forward, are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "layerscope_sdpa"


@dataclass(frozen=True)
class PathPlan:
    """A tree's root-to-leaf paths, each laid out as a chain verification.

    rows: [P, R] the tree row at each place of each path (root first), -1 past its end; R is the rows of the chain
    verifying the longest path from `prefix` (its padding included), so prefix + R is the chain's key length.
    source: [T] where each of the T tree rows takes its output: index b * R + j of path b, place j.
    """

    rows: torch.Tensor
    source: torch.Tensor
    prefix: int


def path_plan(parent_row: torch.Tensor, anc: torch.Tensor, prefix: int, rows: int) -> PathPlan:
    """The PathPlan of a tree of T rows (row 0 the root, parents before children) verified after `prefix` cached
    positions, each path laid out on `rows` rows (at least the deepest path's length: the caller pads it as a chain).

    parent_row [T] (the root is its own), anc [T, T] bool: anc[i, j] = row j is row i or one of its ancestors."""
    T = parent_row.shape[0]
    has_child = torch.zeros(T, dtype=torch.bool, device=parent_row.device)
    has_child[parent_row[1:]] = True
    leaves = (~has_child).nonzero().flatten()
    depth = anc.sum(1) - 1                                                   # [T] place of each row on its paths
    if int(depth.max()) + 1 > rows:
        raise ValueError(f"a path of {int(depth.max()) + 1} rows does not fit {rows} rows")
    table = torch.full((leaves.shape[0], rows), -1, dtype=torch.long, device=parent_row.device)
    for b, leaf in enumerate(leaves.tolist()):
        path = anc[leaf].nonzero().flatten()                                 # ascending: root first
        table[b, :path.shape[0]] = path
    # each row's first path through it: the lowest b with rows[b, depth] == row
    on = table[:, None, :] == torch.arange(T, device=parent_row.device)[None, :, None]   # [P, T, R]
    first = on.any(2).int().argmax(0)                                        # [T]
    return PathPlan(table, first * rows + depth, prefix)


_PLAN: ContextVar[PathPlan | None] = ContextVar("layerscope_tree_plan", default=None)


@contextmanager
def paths(plan: PathPlan) -> Iterator[None]:
    """Within this block (this thread or task only), the target's attention lays out `plan`'s paths."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' sdpa, or, inside `paths`, the same sdpa over the plan's paths laid out as chains.

    query [1, H, Q, D] (the tree's T rows and the forward's padding rows), key/value [1, Hkv, prefix+Q, D] (the cache
    and this forward's rows), attention_mask [1, 1, Q, prefix+Q] (additive or bool; a tree's, specdec.tree_mask).
    Returns (output [1, Q, H, D], None) as sdpa does; the padding rows' output is zero (they are thrown away)."""
    plan = _PLAN.get()
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or attention_mask is None:
        raise ValueError("a tree verifies one sequence under a 4-D mask")
    L, (P, R) = plan.prefix, plan.rows.shape
    Q = query.shape[2]
    real = plan.rows >= 0                                                    # [P, R]
    at = plan.rows.clamp_min(0)                                              # [P, R] tree row at each place
    cols = torch.cat([torch.arange(L, device=at.device).expand(P, L), L + at], 1)    # [P, L+R] keys of each path
    # the chain's layout: queries [P, R, H, D] seen as [P, H, R, D], keys and values [P, Hkv, L+R, D] contiguous
    q = query[0].transpose(0, 1)[at].transpose(1, 2)
    k = key[0][:, cols].transpose(0, 1).contiguous()
    v = value[0][:, cols].transpose(0, 1).contiguous()
    m = attention_mask[0][:, at]                                             # [h, P, R, prefix+Q]
    m = m.gather(-1, cols[None, :, None, :].expand(m.shape[0], P, R, L + R))             # [h, P, R, L+R]
    hidden = False if m.dtype == torch.bool else torch.finfo(m.dtype).min
    seen = True if m.dtype == torch.bool else 0.0
    key_real = torch.cat([torch.ones(P, L, dtype=torch.bool, device=at.device), real], 1)
    m = m.masked_fill(~key_real[None, :, None, :], hidden)                   # places past a path's end
    pad = ~real[None, :, :, None]
    m = m.masked_fill(pad, hidden)
    m[..., 0] = m[..., 0].masked_fill(pad[..., 0], seen)                     # a padding row sees key 0: never empty
    out, _ = sdpa_attention_forward(module, q, k, v, m.transpose(0, 1), **kwargs)        # [P, R, H, D]
    result = out.new_zeros(1, Q, *out.shape[2:])
    result[0, :plan.source.shape[0]] = out.reshape(P * R, *out.shape[2:])[plan.source]
    return result, None


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def install(model) -> bool:
    """Let `model` verify trees exactly: switch its attention from transformers' sdpa to ATTENTION (sdpa itself
    outside a plan). True when the model attends with ATTENTION afterwards; False for other attention
    implementations (eager, flash, flex) and models that cannot switch theirs."""
    if model.config._attn_implementation == "sdpa" and model._can_set_attn_implementation():
        model.set_attn_implementation(ATTENTION)
    return model.config._attn_implementation == ATTENTION
