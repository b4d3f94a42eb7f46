"""How much of the target's output a draft vocabulary of size V covers, to choose --draft-vocab.

    .venv/bin/python benchmarks/draft_vocab.py [--conversations 96] [--sizes 2048,4096,8192,16384,32768]

The target reads ShareGPT conversations (training split, their own answers); at every answer position its
argmax is the token greedy decoding would write, which the draft must propose. The conversations are split
90/10; a vocabulary of the V most frequent tokens (draft.model.build_draft_vocab) is built from the
training part two ways, as the two online modes do:
  - from the target's argmax tokens (what --responses regenerate trains on: the target's own answers),
  - from the answers' own text tokens (what --responses own trains on),
and the share of held-out argmax tokens inside it is printed: the ceiling of first-position acceptance.
A larger V costs a V x d lm_head product at every draft step (d = 576 for SmolLM2).
"""

from __future__ import annotations

import argparse

import torch

from layerscope.draft.model import build_draft_vocab
from layerscope.draft.training.data import target_argmax
from layerscope.draft.training.online import OnlineOptions, target_features
from layerscope.draft.training.responses import load_conversations
from layerscope.store import Store
from layerscope.target.load import load_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    p.add_argument("--store", default=None)
    a = p.parse_args()
    store = Store(a.store)
    target = load_model(a.model, store=store)
    convs = load_conversations(target, OnlineOptions(prompts="sharegpt", limit=a.conversations, responses="own",
                                                     steps=1), store)
    argmax, text = [], []
    for i in range(0, len(convs), 8):
        index = list(range(i, min(i + 8, len(convs))))
        rows, feats = target_features(target, convs, index, [])
        choice = target_argmax(feats[target.num_layers], target.model.get_output_embeddings().weight)
        conv = rows["conversation"]
        nxt_resp = torch.zeros_like(rows["is_response"])
        nxt_resp[:-1] = rows["is_response"][1:] & (conv[1:] == conv[:-1])
        for c in index:
            m = nxt_resp & (conv == c)
            argmax.append(choice[m])
            text.append(rows["token_id"][rows["is_response"] & (conv == c)])
    n_val = max(1, len(convs) // 10)
    vocab = int(target.model.get_input_embeddings().weight.shape[0])
    val = torch.cat(argmax[:n_val])
    print(f"{a.model}: {len(convs)} conversations, {sum(len(x) for x in argmax[n_val:])} training and {len(val)} "
          f"held-out answer positions")
    print(f"{'V':>7}  {'from argmax (regenerate)':>25}  {'from answer text (own)':>23}")
    for V in (int(x) for x in a.sizes.split(",")):
        _, from_argmax = build_draft_vocab(torch.cat(argmax[n_val:]), V, vocab)
        _, from_text = build_draft_vocab(torch.cat(text[n_val:]), V, vocab)
        print(f"{V:>7}  {float(from_argmax[val].float().mean()):>25.4f}  {float(from_text[val].float().mean()):>23.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
