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

`attention` lays each path out as the chain verifying it would be: one path per batch item, its nodes side by side as
the queries, the cached prefix and then the path's nodes as the keys, the keys ending where the chain's padded forward
would end them (a multiple of the row alignment); each node takes the output of a path through it. Outside a plan it
is transformers' sdpa itself (plain decoding, chains, prefills: the same function on the same tensors, the same bits).
What a chain's forward has besides (its padding rows, the key heads repeated for each query head) does not change a
real row's numbers in torch's CPU kernel, so the batch leaves them out (tested against the chain's own layout).

`install(model)` switches a target that attends with transformers' sdpa to this function (registered with
transformers' AttentionInterface and AttentionMaskInterface as ATTENTION, the documented way to add one:
https://huggingface.co/docs/transformers/en/attention_interface). Cost: P paths of at most depth + 1 rows each attend
over the prefix, which is gathered once per path; the projections and MLPs, most of a forward, are unchanged. The
1.5B's tree forward (16 nodes, 9-10 paths) took 0.95-1.07x the same forward under the flattened mask at 42- to
450-token prompts (benchmarks/tree_cost.py), the first layout (each chain's padded rows, key heads repeated) 1.15-1.5x.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "layerscope_sdpa"


@dataclass(frozen=True)
class PathPlan:
    """A tree's root-to-leaf paths, each laid out as the chain verifying it.

    rows: [P, R] the tree row at each place of each path (root first), -1 past its end; R is the deepest path's
    length (at least 2: one query row would take another kernel, see `attention`).
    source: [T] where each of the T tree rows takes its output: index b * R + j of path b, place j.
    keys: the key length of every path, prefix + R rounded up to a multiple of the row alignment, as a padded
    chain's forward ends (`specdec.padding_rows`); keys past a path's own rows are hidden.
    cols: [P, keys] the forward's key index at each key place of each path (a hidden place reads key 0).
    seen: [P, keys] bool, the places that hold the path's own keys (the prefix, then its rows).
    """

    rows: torch.Tensor
    source: torch.Tensor
    prefix: int
    keys: int
    cols: torch.Tensor
    seen: torch.Tensor
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    def mask(self, attention_mask: torch.Tensor, groups: int) -> torch.Tensor:
        """The tree's mask [1, 1, Q, prefix+Q] (additive or bool) laid out on the paths, once for each of `groups`
        query heads a key head serves: [P, 1, groups * R, keys]. Every layer of a kind gets the same mask tensor,
        so each is laid out once a forward."""
        hit = self._masks.get((id(attention_mask), groups))
        if hit is not None and hit[0] is attention_mask:
            return hit[1]
        P, R = self.rows.shape
        cols, seen = self.cols, self.seen
        real = self.rows >= 0                                                # [P, R]
        m = attention_mask[0][:, self.rows.clamp_min(0)]                     # [h, P, R, prefix+Q]
        m = m.gather(-1, cols[None, :, None, :].expand(m.shape[0], P, R, self.keys))        # [h, P, R, keys]
        hidden = False if m.dtype == torch.bool else torch.finfo(m.dtype).min
        shown = True if m.dtype == torch.bool else 0.0
        m = m.masked_fill(~seen[None, :, None, :], hidden)                   # places past a path's end
        pad = ~real[None, :, :, None]
        m = m.masked_fill(pad, hidden)
        m[..., 0] = m[..., 0].masked_fill(pad[..., 0], shown)                # a row past a path's end sees key 0
        m = m.transpose(0, 1).repeat(1, 1, groups, 1)
        self._masks[id(attention_mask), groups] = (attention_mask, m)
        return m


def path_plan(parent_row: torch.Tensor, anc: torch.Tensor, prefix: int, align: int) -> PathPlan:
    """The PathPlan of a tree of T rows (row 0 the root, parents before children) verified after `prefix` cached
    positions, whose chains' forwards end on a multiple of `align` positions (`specdec.row_alignment`, > 0).

    parent_row [T] (the root is its own), anc [T, T] bool: anc[i, j] = row j is row i or one of its ancestors."""
    T = parent_row.shape[0]
    has_child = torch.zeros(T, dtype=torch.bool, device=parent_row.device)
    has_child[parent_row[1:]] = True
    leaves = (~has_child).nonzero().flatten()
    depth = anc.sum(1) - 1                                                   # [T] place of each row on its paths
    rows = max(2, int(depth.max()) + 1)
    table = torch.full((leaves.shape[0], rows), -1, dtype=torch.long, device=parent_row.device)
    for b, leaf in enumerate(leaves.tolist()):
        path = anc[leaf].nonzero().flatten()                                 # ascending: root first
        table[b, :path.shape[0]] = path
    # each row's first path through it: the lowest b with rows[b, depth] == row
    on = table[:, None, :] == torch.arange(T, device=parent_row.device)[None, :, None]   # [P, T, R]
    first = on.any(2).int().argmax(0)                                        # [T]
    keys = prefix + rows + (-(prefix + rows)) % align
    P, dev = table.shape[0], table.device
    fill = torch.zeros(P, keys - prefix - rows, dtype=torch.long, device=dev)
    cols = torch.cat([torch.arange(prefix, device=dev).expand(P, prefix), prefix + table.clamp_min(0), fill], 1)
    seen = torch.cat([torch.ones(P, prefix, dtype=torch.bool, device=dev), table >= 0, fill.bool()], 1)
    return PathPlan(table, first * rows + depth, prefix, keys, cols, seen)


_PLAN: ContextVar[PathPlan | None] = ContextVar("layerscope_tree_plan", default=None)


@contextmanager
def paths(plan: PathPlan) -> Iterator[None]:
    """Within this block (this thread or task only), the target's attention lays out `plan`'s paths."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
              dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' sdpa, or, inside `paths`, torch's sdpa over the plan's paths laid out as chains.

    query [1, H, Q, D] (the tree's T rows and the forward's padding rows), key/value [1, Hkv, prefix+Q, D] (the cache
    and this forward's rows), attention_mask [1, 1, Q, prefix+Q] (additive or bool; a tree's, specdec.tree_mask).
    Returns (output [1, Q, H, D], None) as sdpa does; the padding rows' output is zero (they are thrown away).

    Each path is one batch item: its own rows as queries (R of them, rows past its end hidden), and as keys the
    prefix, its rows, and hidden places up to `plan.keys`. A chain's forward has more rows (its padding, 16-31 in
    all) and repeats the key heads for each query head (transformers' repeat_kv under a mask); neither changes a
    real row's numbers in torch's CPU kernel, as long as there are at least two query rows and the keys end where
    the chain's forward would round them (tests/decoding/test_row_alignment.py checks each node against the chain's
    layout and against plain decoding, bit for bit). So a tree of P paths costs P * R query rows over P * keys keys,
    without a copy of each key head per query head: at a 450-token prompt the 1.5B's exact tree forward took about
    1.04x the flattened one, where running each chain's padded rows with the key heads repeated took 1.5x."""
    plan = _PLAN.get()
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or attention_mask is None:
        raise ValueError("a tree verifies one sequence under a 4-D mask")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("sdpa takes no attention softcap or position bias")
    (P, R), (H, Q, D), Hkv = plan.rows.shape, query.shape[1:], key.shape[1]
    G = H // Hkv                                                                     # query heads per key head
    # the G query heads of a key head are one batch item's G * R rows (as transformers' pack_gqa does for one row)
    q = query[0].index_select(1, plan.rows.clamp_min(0).flatten()).view(H, P, R, D)
    q = q.transpose(0, 1).reshape(P, Hkv, G * R, D)
    # each path's keys, gathered whole rows at a time (index_select), seen as [P, Hkv, keys, D] without a copy
    k = key[0].index_select(1, plan.cols.flatten()).view(Hkv, P, plan.keys, D).transpose(0, 1)
    v = value[0].index_select(1, plan.cols.flatten()).view(Hkv, P, plan.keys, D).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=plan.mask(attention_mask, G), dropout_p=dropout, scale=scaling)     # [P, Hkv, G*R, D]
    out = out.reshape(P, H, R, D).transpose(1, 2).reshape(P * R, H, D)
    result = out.new_zeros(1, Q, H, D)
    result[0, :plan.source.shape[0]] = out.index_select(0, plan.source)
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
