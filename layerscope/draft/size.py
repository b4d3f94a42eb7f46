"""What a draft takes, in parameters and bytes, before it is built: from the target's config alone (DraftConfig.shapes:
exact, nothing allocated). preflight checks the disk with it, forecast prices training with it.

    draft_params(shape, layers, v)      parameters and buffers of one draft reading `layers`, with a draft vocabulary v
    draft_bytes(shape, layers, v)       its file: float32 at most, 4 bytes a parameter
    checkpoint_bytes(shape, sets, v)    a training checkpoint of one draft per set: weights and Adam's two moments
"""

from __future__ import annotations

import math

from layerscope.draft.model import DraftConfig


def draft_params(shape, layers, draft_vocab: int) -> int:
    """Parameters and buffers of a draft reading `layers` of a target with config `shape` (DraftConfig.shapes:
    exact, nothing allocated)."""
    vocab = int(shape.vocab_size)
    config = DraftConfig.from_target(shape, sorted(set(layers)), min(int(draft_vocab), vocab))
    return sum(math.prod(s) for s in config.shapes().values())


def draft_bytes(shape, layers, draft_vocab: int) -> int:
    return 4 * draft_params(shape, layers, draft_vocab)


def checkpoint_bytes(shape, layer_sets, draft_vocab: int) -> int:
    return 3 * sum(draft_bytes(shape, s, draft_vocab) for s in layer_sets)
