"""Helpers several test modules share: seeded generators, synthetic layers, a random draft head, a draft that
knows the answer, the small options of online training on tiny-llama."""

from __future__ import annotations

import torch
from torch import nn

from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab

# online training on tiny-llama in a few seconds: 12 builtin prompts, short answers, tiny batches and vocabulary
SMALL_ONLINE = dict(prompts="builtin", limit=12, max_new_tokens=10, batch_size=3, seq_len=64, gen_batch_size=4,
                    val_conversations=2, eval_points=2, draft_vocab=64)


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


class LookupDraft(nn.Module):
    """Obeys the DraftHead contract; predicts from a known greedy continuation `ref` (the target's own,
    computed by the test). Row at position p reading x_{p+1} proposes ref[p+2] when
    x_{p+1} == ref[p+1] (the alignment of docs/internals.md), else nothing useful (uniform). For target
    indices in `wrong`, a wrong token ranks first and the right one second (so a tree can still find it)."""

    def __init__(self, ref: list[int], vocab: int, aux_layers=(1,), wrong=()):
        super().__init__()
        self.ref, self.vocab, self.wrong = ref, vocab, set(wrong)
        self.aux_layers = list(aux_layers)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool))
        self.rows_seen: list[tuple[int, int]] = []       # (position, input id) of every row fed

    def fuse(self, aux):
        return aux[..., :1]

    def to_target_ids(self, ids):
        return ids + self.d2t[ids]

    def forward(self, input_ids, hidden, position_ids, cache=None, attention_mask=None):
        B, T = input_ids.shape
        if cache is not None:
            cache.append(torch.zeros(B, 1, T, 1), torch.zeros(B, 1, T, 1))
            if attention_mask is not None:
                assert attention_mask.shape == (B, 1, T, cache.length) and attention_mask.dtype == torch.bool
        logits = torch.zeros(B, T, self.vocab)
        for i, (p, x) in enumerate(zip(position_ids[0].tolist(), input_ids[0].tolist())):
            self.rows_seen.append((p, x))
            if p + 2 < len(self.ref) and x == self.ref[p + 1]:
                right = self.ref[p + 2]
                logits[0, i, right] = 5.0
                if p + 2 in self.wrong:
                    logits[0, i, (right + 1) % self.vocab] = 6.0
        return logits, hidden
