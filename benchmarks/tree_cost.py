"""What exact verification costs: one target forward of a draft's tree with each real row attending alone over its
visible keys (decoding/exact_attention.py), the same forward with torch's sdpa under the flattened tree mask, and
chains of the deepest path's length and of one row both ways, at a short, a middle and a long prompt.

    .venv/bin/python benchmarks/tree_cost.py --model qwen2.5-coder-1.5b [--tree 16,3,4] [--repeats 6]

In 16-bit floats every row of a decoding forward attends alone so that each token gets plain decoding's bits; sdpa over
all rows at once is the cheaper call that rounds apart (docs/internals.md, "bfloat16 and lossless"). Both are padded
to this machine's row alignment. The tree is the one the model's shipped draft grows after the prompt. Each number is
the median of `--repeats` forwards, the kinds interleaved so that a machine's slow spell touches them alike. Run it
alone: it times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from layerscope.decoding import exact_attention
from layerscope.decoding import specdec as sd
from layerscope.draft import builtin
from layerscope.draft.checkpoint import load_draft
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import Store, default_root
from layerscope.target.load import load_model

PROMPTS = Path(__file__).resolve().parents[1] / "docs/study-qwen15/bench-code.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tree", default="16,3,4", help="the tree's budget, top-k and depth")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--long", type=int, default=450, help="prompt tokens of the long prompt (at most)")
    a = p.parse_args()
    store = Store(default_root())
    loaded = load_model(a.model, store=store)
    model, tok = loaded.model, loaded.tokenizer
    draft = load_draft(builtin.resolve("builtin", a.model, store), loaded)
    spec = sd.TreeSpec(*map(int, a.tree.split(",")))
    align = sd.row_alignment(model)
    if not align or not exact_attention.install(model):
        raise SystemExit(f"{a.model} in {loaded.dtype_name} does not attend row by row (float32 or not sdpa)")
    print(f"{a.model} in {loaded.dtype_name}; row alignment {align}; tree {spec.budget}/{spec.top_k}/{spec.depth}; "
          f"{torch.get_num_threads()} threads", flush=True)
    layout, aux_layers = sd.attention_layout(model), list(draft.aux_layers)
    prompts = sorted(load_prompts(str(PROMPTS)).prompts, key=lambda prompt: len(prompt.turns[0]))
    for prompt in (prompts[2], prompts[len(prompts) // 2], prompts[-1]):
        ids = chat_ids(tok, prompt)[:a.long]
        cache, d = sd.new_cache(model), sd._Draft(draft, model.device)
        with torch.inference_mode():
            logits, aux = sd._target_forward(model, ids, torch.arange(len(ids)), cache, aux_layers, last_only=True)
            last = int(logits[-1].argmax())
            d.add_rows(ids[1:] + [last], aux)
            grown = sd.tree_forward(model, d, cache, last, spec.depth, spec, layout)
        L, M = sd.cache_length(cache), len(grown.node_ids) - 1

        def timed(run, alone: bool = True) -> float:
            install = exact_attention.install
            if not alone:                                    # sdpa over every row at once, as before exact attention
                exact_attention.install = lambda model: False
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    run()
                sd.crop_cache(cache, L)
                return time.perf_counter() - t0
            finally:
                exact_attention.install = install

        def tree():
            grown.run(model, cache, aux_layers)

        def chain(rows: int):
            return lambda: sd._target_forward(model, ids[:rows], torch.arange(L, L + rows), cache, aux_layers)

        c = grown.depth + 1
        kinds = {"tree, rows alone (exact)": lambda: timed(tree), "tree, sdpa": lambda: timed(tree, False),
                 f"chain of {c}, alone": lambda: timed(chain(c)), f"chain of {c}, sdpa": lambda: timed(chain(c), False),
                 "one row, alone": lambda: timed(chain(1)), "one row, sdpa": lambda: timed(chain(1), False)}
        times = {name: [] for name in kinds}
        for _ in range(a.repeats):
            for name, run in kinds.items():
                times[name].append(run())
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"prompt of {L} tokens, tree of {M} nodes: "
              + ", ".join(f"{name} {s * 1000:.0f} ms" for name, s in med.items())
              + f"; tree alone / sdpa {med['tree, rows alone (exact)'] / med['tree, sdpa']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
