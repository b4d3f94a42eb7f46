"""What a draft takes, in parameters and bytes, before it is built: from the target's config alone (DraftConfig.shapes:
exact, nothing allocated). preflight checks the disk with it, forecast prices training with it.

    draft_params(shape, layers, v, ff)  parameters and buffers of one draft reading `layers`, with a draft vocabulary v
                                        and an MLP ff wide (None: the target's, TrainOptions.draft_intermediate)
    draft_bytes(shape, layers, v, ff)   its file: float32 at most, 4 bytes a parameter
    checkpoint_bytes(shape, sets, v, ff)  a training checkpoint of one draft per set: weights and Adam's two moments
"""

from __future__ import annotations

import math

from layerscope.draft.model import DraftConfig


def draft_params(shape, layers, draft_vocab: int, intermediate: int | None = None) -> int:
    """Parameters and buffers of a draft reading `layers` of a target with config `shape` (DraftConfig.shapes:
    exact, nothing allocated), with fc_norm (the default; a draft without it has len(layers) x d fewer)."""
    vocab = int(shape.vocab_size)
    config = DraftConfig.from_target(shape, sorted(set(layers)), min(int(draft_vocab), vocab), fc_norm=True,
                                     intermediate_size=intermediate)
    return sum(math.prod(s) for s in config.shapes().values())


def draft_bytes(shape, layers, draft_vocab: int, intermediate: int | None = None) -> int:
    return 4 * draft_params(shape, layers, draft_vocab, intermediate)


def checkpoint_bytes(shape, layer_sets, draft_vocab: int, intermediate: int | None = None) -> int:
    return 3 * sum(draft_bytes(shape, s, draft_vocab, intermediate) for s in layer_sets)
