"""How much of the target's output a draft vocabulary of size V covers, to choose --draft-vocab.

    .venv/bin/python benchmarks/draft_vocab.py [--store cache] [--sizes 2048,4096,8192,16384,32768]

Reads every set of regenerated responses in the store (responses/<key>/part-*.json: the target's own
greedy answers, token ids), builds the vocabulary as training does (the V most frequent response tokens
of the training conversations, draft.model.build_draft_vocab) and reports, on the held-out
conversations (a seeded 10 %), the share of response tokens inside it. With greedy responses a response
token IS the target's argmax at the position before it, so this share is the ceiling of first-position
acceptance. Cost of a larger V: the draft's lm_head is V x d (d=576 for SmolLM2), computed at every
draft step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from layerscope.draft.model import build_draft_vocab
from layerscope.store import Store


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None)
    p.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    p.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size (SmolLM2: 49152)")
    a = p.parse_args()
    root = Store(a.store).root / "responses"
    sizes = [int(x) for x in a.sizes.split(",")]
    for entry in sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []:
        convs = [r["response"] for part in sorted(entry.glob("part-*.json"))
                 for r in json.loads(part.read_text())["responses"] if r["response"]]
        if len(convs) < 10:
            continue
        held = torch.zeros(len(convs), dtype=torch.bool)
        held[torch.randperm(len(convs), generator=torch.Generator().manual_seed(0))[: max(1, len(convs) // 10)]] = True
        train = torch.tensor([t for c, h in zip(convs, held) if not h for t in c])
        val = torch.tensor([t for c, h in zip(convs, held) if h for t in c])
        print(f"{entry.name}: {len(convs)} conversations, {len(train)} training and {len(val)} held-out response tokens, "
              f"{len(torch.unique(train))} distinct training tokens")
        for V in sizes:
            _, t2d = build_draft_vocab(train, V, a.vocab)
            print(f"  V={V:6d}: held-out coverage {float(t2d[val].float().mean()):.4f}, "
                  f"training coverage {float(t2d[train].float().mean()):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
