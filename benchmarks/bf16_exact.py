"""Is speculative decoding token-exact in bfloat16? Plain greedy decoding against chains and a tree with the same
weights and dtype, with the decoders' row alignment (specdec.row_alignment) and without it.

    LAYERSCOPE_DTYPE=bfloat16 .venv/bin/python benchmarks/bf16_exact.py --model smollm2-135m --prompts 16
    LAYERSCOPE_DTYPE=bfloat16 .venv/bin/python benchmarks/bf16_exact.py --no-align --tree
    LAYERSCOPE_DTYPE=bfloat16 .venv/bin/python benchmarks/bf16_exact.py --tree --no-row-attention --align 16

Prints each output that differs (prompt, decoding, first differing token) and the count. Uses the model's shipped
draft (--draft builtin) or a draft directory or store key. The rounding is the machine's: run it on the machine
whose numbers you report, alone or not (it measures agreement, not time).
"""

from __future__ import annotations

import argparse
import time

from layerscope.decoding import exact_attention, row_invariance
from layerscope.decoding import specdec as sd
from layerscope.draft import builtin
from layerscope.draft.checkpoint import load_draft
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import Store, default_root
from layerscope.target.load import load_model


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="builtin")
    p.add_argument("--prompts", type=int, default=16, help="builtin prompts (a seeded, stratified sample)")
    p.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    p.add_argument("--k", default="1,3", help="chain depths")
    p.add_argument("--tree", action="store_true", help="also a tree (--tree-spec)")
    p.add_argument("--no-align", action="store_true", help="forwards as they are (the decoders before the padding)")
    p.add_argument("--no-row-attention", action="store_true",
                   help="every row of a forward attends in one sdpa call (the decoders before exact_attention)")
    p.add_argument("--align", type=int, default=None, help="pad to this many rows instead of the measured alignment")
    p.add_argument("--tree-spec", default="16,4,5", help="the tree's budget, top-k and depth")
    a = p.parse_args()
    if a.no_row_attention:
        exact_attention.install = lambda model: False
    if a.align is not None:
        row_invariance.alignment = lambda *args: a.align
    if a.no_align:
        sd.row_alignment = lambda model: 0
    store = Store(default_root())
    target = load_model(a.model, store=store)
    model = target.model
    draft = load_draft(builtin.resolve(a.draft, a.model, store), target)
    ways = [(f"chain k={k}", {"k": int(k)}) for k in a.k.split(",") if k] + (
        [(f"tree {a.tree_spec.replace(',', '/')}", {"tree": sd.TreeSpec(*map(int, a.tree_spec.split(",")))})]
        if a.tree else [])
    print(f"{a.model} in {model.dtype}, row alignment {sd.row_alignment(model)}", flush=True)
    differ = runs = 0
    t0 = time.time()
    for prompt in load_prompts("builtin", limit=a.prompts).prompts:
        ids = chat_ids(target.tokenizer, prompt)
        plain, _ = sd.collect(sd.autoregressive(model, ids, a.new))
        for name, kw in ways:
            out, _ = sd.collect(sd.speculative(model, draft, ids, a.new, **kw))
            runs += 1
            if out != plain:
                differ += 1
                print(f"{prompt.id} {name}: differs at token {first_difference(out, plain)}", flush=True)
    print(f"{differ} of {runs} outputs differ from plain decoding ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
