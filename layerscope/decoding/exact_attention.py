"""Exact attention in 16-bit floats: a decoding forward's rows attend one at a time, each over exactly its visible keys.

Lossless speculative decoding in bfloat16 asks that a token's numbers be the same whether plain decoding's one-token
step computes them, a row of a chain's verification, or a node of a tree verified under a 4-D mask among rejected
cousins (docs/internals.md, "bfloat16 and lossless"). The projections and MLPs work row by row once a forward has
enough rows (row_invariance, specdec.padding_rows). Attention does not: torch's CPU kernels reduce a query row
differently by the other rows' masks and by the keys' length (on an AMD EPYC with AVX-512 BF16, 2026-12-07, 24 of 260
rows of SmolLM2-135M differed from the one-token step's under 16-row padding, flash and math kernels alike), and a
tree's flattened layout pairs an accepted node's keys otherwise than the chain through it does. So:

    with rows_alone(T):                 # specdec._target_forward, around every padded decoding forward and tree
        model(...)                      # each attention layer runs `attention` below: `row_attention`

Row i gathers the keys its mask shows, in order (for a tree node: the prefix, its ancestors, itself; for a chain's
row: the prefix and the rows before it), and attends to them alone. That call depends on nothing but the row's query
and its keys, so every decoder makes the same call for the same token, whatever kernel torch picks for it. Outside
`rows_alone` (a prompt's prefill, which every decoder runs alike, and float32 targets) it is transformers' sdpa itself.

`install(model)` switches a target that attends with transformers' sdpa to this function (registered with
transformers' AttentionInterface and AttentionMaskInterface as ATTENTION, the documented way to add one:
https://huggingface.co/docs/transformers/en/attention_interface). Cost: one small attention call per real row and
layer instead of one per layer (the 1.5B on the EPYC: a 16-row verification 305-327 ms against 278-303 ms with sdpa
unpadded; a one-token step as fast as unpadded sdpa). Targets attending otherwise (eager, flash, flex) keep their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "layerscope_sdpa"
_ROWS: ContextVar[int | None] = ContextVar("layerscope_rows_alone", default=None)


@contextmanager
def rows_alone(rows: int) -> Iterator[None]:
    """Within this block (this thread or task only), the target's attention computes its first `rows` query rows one
    at a time, each over exactly the keys its mask shows (`row_attention`); the rows after them (a padded forward's
    throwaway rows) get zeros."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


_VISIBLE: dict = {}     # id(mask) -> (mask, rows): the last forward's masks, each laid out once for all its layers


def visible(attention_mask, rows: int, N: int, Q: int) -> list:
    """Each of the first `rows` query rows' visible keys among N: an int n where they are keys 0..n-1 (a causal
    row; the values are then a view, the same numbers as a gathered copy), else their indices [n] in order (a tree
    node: the prefix, then its ancestors and itself). attention_mask [1, 1, Q, N] additive or bool, or None (causal,
    the last Q keys being the rows'). transformers hands every layer of a kind the same mask tensor, so each mask is
    read once a forward."""
    if attention_mask is None:
        return [N - Q + i + 1 for i in range(rows)]
    hit = _VISIBLE.get(id(attention_mask))
    if hit is not None and hit[0] is attention_mask and len(hit[1]) == rows:
        return hit[1]
    seen = attention_mask[0, 0, :rows]
    seen = seen if seen.dtype == torch.bool else seen == 0
    out = []
    for row in seen:
        idx = row.nonzero().flatten()
        n = idx.shape[0]
        out.append(n if n and int(idx[-1]) == n - 1 else idx)
    if len(_VISIBLE) > 8:
        _VISIBLE.clear()
    _VISIBLE[id(attention_mask)] = (attention_mask, out)
    return out


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, rows: int,
                  scaling: float | None = None) -> torch.Tensor:
    """Attention of the first `rows` query rows, each alone: output [1, Q, H, D] (zeros after `rows`).

    query [1, H, Q, D], key/value [1, Hkv, N, D], attention_mask [1, 1, Q, N] (additive or bool; None: causal, the
    last Q keys being the rows'). Row i gathers the keys its mask shows, in order, and attends to them with its H query
    heads as the G = H / Hkv rows of each key head (no mask, no repeated key heads). That call depends only on the
    row's query and its visible keys: a token gets the same numbers in a one-token step, in any row of a chain's
    verification and as a tree node (its keys: the prefix, then its ancestors and itself, as the chain through it
    has them), whichever kernel torch picks for the call (docs/internals.md, "bfloat16 and lossless")."""
    _, H, Q, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    G = H // Hkv
    out = query.new_zeros(1, Q, H, D)
    for i, seen in enumerate(visible(attention_mask, rows, N, Q)):
        if isinstance(seen, int):                                        # keys 0..seen-1: a view, no copy
            k, v = key[0, :, :seen], value[0, :, :seen]
        else:
            k, v = key[0].index_select(1, seen), value[0].index_select(1, seen)          # [Hkv, n, D]
        q = query[0, :, i].reshape(Hkv, G, D)
        o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], scale=scaling)
        out[0, i] = o[0].reshape(H, D)
    return out


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
              dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' sdpa, or, inside `rows_alone`, `row_attention` (output [1, Q, H, D], None as sdpa returns)."""
    rows = _ROWS.get()
    # a batch, or a layer asking what sdpa does not do (a softcap, a position bias: sdpa ignores them as before)
    if rows is None or query.shape[0] != 1 or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return row_attention(query, key, value, attention_mask, rows, scaling), None


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def install(model) -> bool:
    """Let `model` decode exactly: switch its attention from transformers' sdpa to ATTENTION (sdpa itself
    outside `rows_alone`). True when the model attends with ATTENTION afterwards; False for other attention
    implementations (eager, flash, flex) and models that cannot switch theirs."""
    if model.config._attn_implementation == "sdpa" and model._can_set_attn_implementation():
        model.set_attn_implementation(ATTENTION)
    return model.config._attn_implementation == ATTENTION
