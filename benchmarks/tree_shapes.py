"""Which tree shape pays on a target: plain decoding and several fixed EAGLE-2 trees (each with prompt lookup first, or
without), decoded one prompt at a time with every shape in turn, so that a slow spell of the machine touches all alike.

    .venv/bin/python benchmarks/tree_shapes.py --model qwen2.5-coder-1.5b --trees 16,3,4 24,4,5 31,4,6 --lookup 8
    .venv/bin/python benchmarks/tree_shapes.py --trees 16,3,4 --draft-dtypes float32 bfloat16

--draft-dtypes runs each shape with the draft's weights in each dtype (`layerscope bench` runs the draft in its
target's dtype, specdec.decoding_draft; a float32 draft was the rule before, and may propose other tokens).

`layerscope bench --tree auto` picks one shape from a calibration and the cost curve; this measures the shapes it
weighs, side by side, on the prompts of the issue-50 benchmark (docs/study-qwen15/bench-code.jsonl). Per shape: tau
(tokens per target forward), milliseconds per step, and the speedup over plain decoding in the same run (the prefill
left out of both). Every output is checked against plain decoding's. Run it alone: it times.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from layerscope.decoding import specdec as sd
from layerscope.draft import builtin
from layerscope.draft.checkpoint import TORCH_DTYPES, load_draft
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import Store, default_root
from layerscope.target.load import load_model

PROMPTS = Path(__file__).resolve().parents[1] / "docs/study-qwen15/bench-code.jsonl"


def decode(model, draft, ids: list[int], new: int, tree: sd.TreeSpec | None, lookup: int) -> tuple[list[int], int, float]:
    """(tokens after the prompt, steps after the prefill, seconds after the prefill) of one decoding."""
    events = sd.autoregressive(model, ids, new) if tree is None else sd.speculative(model, draft, ids, new, tree=tree,
                                                                                    lookup=lookup)
    tokens, steps, t0 = [], 0, 0.0
    for i, ev in enumerate(events):
        if i == 0:
            t0 = time.perf_counter()                             # the prefill's event: timing starts after it
        else:
            steps += 1
        tokens += list(ev.tokens)
    return tokens, steps, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--trees", nargs="+", default=["16,3,4", "24,4,5", "31,4,6"], help="budget,top_k,depth each")
    p.add_argument("--lookup", type=int, default=8, help="prompt lookup tokens tried first (0: the draft alone)")
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--first", type=int, default=4, help="the first prompt of the file to decode")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--draft-dtypes", nargs="+", choices=sorted(TORCH_DTYPES),
                   help="the draft's weights in each of these dtypes (default: the target's, as `layerscope bench`)")
    a = p.parse_args()
    store = Store(default_root())
    loaded = load_model(a.model, store=store)
    model, tok = loaded.model, loaded.tokenizer
    path = builtin.resolve("builtin", a.model, store)
    if a.draft_dtypes:
        drafts = {d: load_draft(path, loaded).to(TORCH_DTYPES[d]) for d in a.draft_dtypes}
    else:                                                        # as bench decodes it
        drafts = {loaded.dtype_name: sd.decoding_draft(load_draft(path, loaded), loaded)}
    shapes = {"plain": (None, None)}
    for t in a.trees:
        for d in drafts:
            name = t if len(drafts) == 1 else f"{t} {d}"
            shapes[name] = (sd.TreeSpec(*map(int, t.split(","))), drafts[d])
    prompts = load_prompts(a.prompts).prompts[a.first:a.first + a.limit]
    print(f"{a.model} in {loaded.dtype_name}, {len(prompts)} prompts x {a.max_new_tokens} tokens, lookup {a.lookup}, "
          f"{torch.get_num_threads()} threads", flush=True)
    total = {name: [0, 0, 0.0] for name in shapes}                # tokens, steps, seconds
    differ = dict.fromkeys(shapes, 0)
    for prompt in prompts:
        ids = chat_ids(tok, prompt)[:a.max_prompt_tokens]
        plain = None
        with torch.inference_mode():
            for name, (tree, draft) in shapes.items():
                tokens, steps, seconds = decode(model, draft, ids, a.max_new_tokens, tree, a.lookup)
                plain = tokens if tree is None else plain
                differ[name] += tokens != plain
                total[name][0] += len(tokens) - 1                # the prefill's token is not a step's
                total[name][1] += steps
                total[name][2] += seconds
    base = total["plain"][0] / total["plain"][2]
    for name, (tokens, steps, seconds) in total.items():
        print(f"{name:17s} tau {tokens / steps:.3f}  {1000 * seconds / steps:6.1f} ms/step  {tokens / seconds:5.2f} tok/s  "
              f"speedup {tokens / seconds / base:.3f}x  differ from plain: {differ[name]} of {len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
