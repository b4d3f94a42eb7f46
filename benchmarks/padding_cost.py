"""What the row alignment costs plain decoding: one step of our padded plain decoding, of the same unpadded, and of
transformers' own `generate`, at a short and a long prompt, and where a padded step's time goes.

    .venv/bin/python benchmarks/padding_cost.py --model qwen2.5-coder-1.5b [--new 24] [--profile]

In 16-bit floats the decoders pad every target forward to the rows this machine needs (specdec.row_alignment: 16-31 on
a CPU with AMX, 2-3 on an AMD EPYC with AVX-512 BF16) and let each real row attend alone (exact_attention), so that a
token's numbers do not depend on the forward's shape (token-exact speculative decoding). The cost curve `bench` measures is
itself padded, so it cannot show what the padding costs; this does. Each number is the median step over `--new`
tokens after the prefill; transformers' is (generate of N tokens − generate of 1) / (N − 1). Run it alone: it times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from layerscope.decoding import specdec as sd
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import Store, default_root
from layerscope.target.load import load_model

PROMPTS = Path(__file__).resolve().parents[1] / "docs/study-qwen15/bench-code.jsonl"


def our_step(model, ids: list[int], n: int, align: bool) -> float:
    """Median seconds of our plain decoding's steps after the prefill, padded (align) or not."""
    saved = sd.row_alignment
    if not align:
        sd.row_alignment = lambda model: 0        # float32's path: no padding, sdpa over the rows at once
    try:
        steps = [e.elapsed_s for e in sd.autoregressive(model, ids, n)][1:]
    finally:
        sd.row_alignment = saved
    return statistics.median(steps)


def hf_step(model, ids: list[int], n: int) -> float:
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=2, do_sample=False)              # warm
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, do_sample=False)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=n, do_sample=False)
        return (time.perf_counter() - t0 - one) / (n - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--new", type=int, default=24, help="new tokens per prompt")
    p.add_argument("--long", type=int, default=400, help="prompt tokens of the long prompt (at most)")
    p.add_argument("--profile", action="store_true", help="also profile 6 padded steps at the long prompt")
    a = p.parse_args()
    loaded = load_model(a.model, store=Store(default_root()))
    model, tok = loaded.model, loaded.tokenizer
    print(f"{a.model} in {loaded.dtype_name} ({loaded.dtype_why}); row alignment {sd.row_alignment(model)}; "
          f"{torch.get_num_threads()} threads")
    prompts = sorted(load_prompts(str(PROMPTS)).prompts, key=lambda prompt: len(prompt.turns[0]))
    for name, prompt in (("short", prompts[2]), ("long", prompts[-1])):
        ids = chat_ids(tok, prompt)[:a.long]
        padded, unpadded, hf = our_step(model, ids, a.new, True), our_step(model, ids, a.new, False), hf_step(model, ids, a.new)
        print(f"{name} prompt ({len(ids)} tokens): padded {padded:.3f} s a step, unpadded {unpadded:.3f} s, "
              f"transformers' generate {hf:.3f} s; padded / unpadded {padded / unpadded:.2f}x", flush=True)
        if a.profile and name == "long":
            from torch.profiler import ProfilerActivity, profile
            steps = sd.autoregressive(model, ids, 8)
            next(steps)                                                        # the prefill
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(6):
                    next(steps)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
