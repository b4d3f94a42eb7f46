"""Helpers several test modules share: seeded generators, synthetic layers, a random draft head."""

from __future__ import annotations

import torch

from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab


def gen(seed):
    return torch.Generator().manual_seed(seed)


def correlated_layers(L, n, d, seed=0):
    """L layers sharing a latent signal that drifts with depth, plus noise."""
    g = gen(seed)
    latent = torch.randn(n, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, d, generator=g, dtype=torch.float64)
    out = []
    for _ in range(L):
        w = w + 0.7 * torch.randn(8, d, generator=g, dtype=torch.float64)
        out.append(latent @ w + 0.8 * torch.randn(n, d, generator=g, dtype=torch.float64))
    return out


def untrained_draft(model, layers=(1, 2, 3), draft_vocab=128, seed=1) -> DraftHead:
    """A real DraftHead with random weights: a genuinely different model, so acceptance is low."""
    torch.manual_seed(seed)
    V = model.config.vocab_size
    d2t, t2d = build_draft_vocab(torch.randint(0, V, (4 * V,)), draft_vocab, V)
    cfg = DraftConfig.from_target(model.config, list(layers), draft_vocab)
    return DraftHead(cfg, embed_weight=model.get_input_embeddings().weight, d2t=d2t, t2d=t2d).eval()
