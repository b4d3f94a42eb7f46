"""How many rows a 16-bit target forward needs for each row's numbers not to depend on the rows beside it.

Lossless speculative decoding in bfloat16 asks that a token's logits have the same bits whether a one-token step of
plain decoding computes them or a row of a k-token verification does (docs/internals.md, "bfloat16 and lossless").
Attention is made so by letting each row attend alone (exact_attention). The matrix products are not everywhere: a
library picks its kernel by the row count, and on some CPUs a one-row product rounds otherwise than a product of
several rows. On an AMD EPYC with AVX-512 BF16 (2026-12-07) SmolLM2-135M's MLP down-projection gave one row other bits
alone than among 4 rows for the model's own activations, while random rows of the same shapes agreed: so this is
measured on the model itself, not on random matrices. A forward is padded with throwaway rows to at least
`alignment` rows (specdec.padding_rows), the fewest that keep every row alike.

    alignment(model, forward, new_cache, crop)       the smallest of CANDIDATES with no row apart, else the largest
    rows_apart(model, forward, a, new_cache, crop)   verification rows whose logits differ from the one-token steps'

The decoders' own parts are passed in (specdec.row_alignment does): `forward(ids, positions, cache, align)`, their
padded forward at that alignment, logits [len(ids), V]; `new_cache()` and `crop(cache, length)`, their cache's. The
probe decodes a fixed pseudo-random sequence (its tokens' embeddings give the layers real activations) after a
48-token prefix: STEPS one-token steps, then verifications of 2 to 10 rows from several starts over the same
positions. It runs once per process for a model's shapes, dtype, device and thread count.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# Row counts tried, smallest first: 1 (no padding), then powers of two up to one AMX tile (16 rows)
CANDIDATES = (1, 2, 4, 8, 16)
PREFIX, STEPS = 48, 10
# (start after the prefix, rows) of the probe's verifications: every place of a row among 2 to 10
VERIFICATIONS = ((0, 2), (1, 5), (0, 10), (3, 7), (6, 3))

_CACHE: dict[tuple, int] = {}       # (shapes, dtype, device, threads) -> alignment, for this process
_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # model -> shapes(model), read once a model

Forward = Callable[[list[int], torch.Tensor, object, int], torch.Tensor]


def shapes(model) -> tuple:
    """The distinct weight shapes of the model's linear layers (what a product kernel is chosen by); walked once a
    model, for `alignment` is asked on every decoding forward."""
    hit = _SHAPES.get(model)
    if hit is None:
        hit = _SHAPES[model] = tuple(sorted({tuple(m.weight.shape) for m in model.modules()
                                             if isinstance(m, torch.nn.Linear)}))
    return hit


def rows_apart(model, forward: Forward, align: int, new_cache: Callable[[], object],
               crop: Callable[[object, int], None]) -> int:
    """Rows of the probe's verifications whose logits are not, bit for bit, the one-token steps' at the same
    positions, every forward padded to `align` rows (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    seq = torch.randint(0, vocab, (PREFIX + STEPS,), generator=gen).tolist()
    dev = model.device
    apart = 0
    with torch.inference_mode():
        cache = new_cache()
        forward(seq[:PREFIX], torch.arange(PREFIX, device=dev), cache, align)
        steps = [forward([seq[PREFIX + i]], torch.tensor([PREFIX + i], device=dev), cache, align)[0]
                 for i in range(STEPS)]
        for start, rows in VERIFICATIONS:
            crop(cache, PREFIX + start)
            at = PREFIX + start
            logits = forward(seq[at:at + rows], torch.arange(at, at + rows, device=dev), cache, align)
            apart += sum(not torch.equal(logits[j], steps[start + j]) for j in range(rows))
    return apart


def alignment(model, forward: Forward, new_cache: Callable[[], object], crop: Callable[[object, int], None]) -> int:
    """The rows a forward of `model` (16-bit weights) is padded to at least: the smallest of CANDIDATES whose probe
    finds no row apart, else the largest; measured once per process for the model's shapes, dtype, device and
    thread count."""
    key = (shapes(model), model.dtype, str(model.device), torch.get_num_threads())
    hit = _CACHE.get(key)
    if hit is None:
        hit = next((a for a in CANDIDATES if rows_apart(model, forward, a, new_cache, crop) == 0), CANDIDATES[-1])
        _CACHE[key] = hit
    return hit
