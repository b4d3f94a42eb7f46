"""float32 against bfloat16 weights on this machine, for every real model: what layerscope/target/precision.py decides.

For each model, in one process and one quiet window (the same weights, cast), the median seconds of:
    decode     one token after a 256-token context (plain decoding's step)
    verify     16 tokens after the same context (a verification's forward)
    prefill    4 x 128 tokens from scratch (a capture's or online training's target forward), as tokens/s
and precision.measure's ratios at the model's shape with the choice it leads to. Prints a Markdown table.

    .venv/bin/python benchmarks/dtype.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
from transformers import DynamicCache

from layerscope import quietness
from layerscope.store import default_root
from layerscope.target import precision
from layerscope.target.load import load_model


def median(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(model, vocab: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, vocab - 1, (1, 256), generator=gen)
    out = {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(context, past_key_values=cache, use_cache=True)
        for name, T in (("decode", 1), ("verify", 16)):
            x = torch.randint(100, vocab - 1, (1, T), generator=gen)

            def step():
                model(x, past_key_values=cache, use_cache=True)
                cache.crop(-T)
            step()
            out[name] = median(step, repeats)
        batch = torch.randint(100, vocab - 1, (4, 128), generator=gen)
        model(batch[:, :16])
        out["prefill_tok_s"] = batch.numel() / median(lambda: model(batch), max(1, repeats // 2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    os.environ["LAYERSCOPE_DTYPE"] = "float32"        # load in float32; cast below
    rows = []
    before = quietness.sample(2.0)
    with quietness.Monitor() as watched:
        for spec in args.models.split(","):
            loaded = load_model(spec.strip())
            text = loaded.model.config.get_text_config(decoder=True)
            d, ff = text.hidden_size, getattr(text, "intermediate_size", 4 * text.hidden_size)
            ratios = precision.measure(d, ff)
            row = {"model": spec, "choice": precision.decide(ratios).why, "ratios": ratios}
            for dtype in (torch.float32, torch.bfloat16):
                loaded.model.to(dtype)
                row[str(dtype).replace("torch.", "")] = measure(loaded.model, text.vocab_size, args.repeats)
            row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            rows.append(row)
            print(json.dumps(row), flush=True)
            del loaded
    print()
    print("| model | dtype | decode step | verify 16 | verify 16 / step | prefill tok/s | bf16 speed at 1/16/256 rows | choice |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        for dt in ("float32", "bfloat16"):
            m = r[dt]
            ratios = "/".join(f"{r['ratios'][k]:.2f}x" for k in sorted(r["ratios"]))
            print(f"| {r['model']} | {dt} | {m['decode'] * 1e3:.0f} ms | {m['verify'] * 1e3:.0f} ms | "
                  f"{m['verify'] / m['decode']:.2f} | {m['prefill_tok_s']:.0f} | {ratios if dt == 'float32' else ''} | "
                  f"{r['choice'].split(':')[0] if dt == 'float32' else ''} |")
    print()
    print(quietness.line(before), "(before)")
    print(quietness.line(watched.state), f"torch {torch.__version__}, {torch.get_num_threads()} threads, store {default_root()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "machine": watched.state.to_json()}, f, indent=1)


if __name__ == "__main__":
    main()
