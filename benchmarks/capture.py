"""Capture throughput against a plain forward pass over the same inputs, measured in one run.

    .venv/bin/python benchmarks/capture.py [--model smollm2-135m] [--limit 16] [--max-new-tokens 48] [--batch-size 8]

Responses are generated first (not timed here: generation is the same work with or without
LayerScope). Then, batch by batch and interleaved so both see the same machine state:
  plain    model(input_ids, attention_mask) — what any forward over these tokens costs;
  capture  layerscope.capture.run.record(...) + writing the chunk file — hidden states of all
           layers, entropies and the token table, stored as safetensors.
Prints tokens/s of each and the ratio capture/plain (goal: >= 0.85).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from layerscope.capture.format import chunk_name
from layerscope.capture.run import CaptureOptions, generate_responses, record
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import Store, atomic_save_tensors
from layerscope.target.load import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="builtin")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    loaded = load_model(args.model, store=Store())
    prompts = load_prompts(args.prompts, limit=args.limit)
    encoded = [chat_ids(loaded.tokenizer, p) for p in prompts.prompts]
    opts = CaptureOptions(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    t = time.perf_counter()
    batches = []
    for s in range(0, len(encoded), args.batch_size):
        part = encoded[s: s + args.batch_size]
        batches.append((s, part, generate_responses(loaded, part, opts)))
    gen_s = time.perf_counter() - t
    tokens = sum(len(p) + len(r) for _, ps, rs in batches for p, r in zip(ps, rs))
    print(f"model {loaded.spec}: {len(encoded)} prompts, {tokens} tokens (prompt + response); "
          f"generation took {gen_s:.1f} s")

    plain_s = capture_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for start, ps, rs in batches:
                ids, mask = _padded(loaded, ps, rs)
                t = time.perf_counter()
                with torch.no_grad():
                    loaded.model(input_ids=ids, attention_mask=mask, use_cache=False)
                plain_s += time.perf_counter() - t
                t = time.perf_counter()
                tensors = record(loaded, ps, rs, first_conversation=start)
                atomic_save_tensors(Path(tmp) / chunk_name(start, start + len(ps)), tensors)
                capture_s += time.perf_counter() - t
    n = tokens * args.repeats
    print(f"plain forward : {n / plain_s:8.1f} tok/s")
    print(f"capture       : {n / capture_s:8.1f} tok/s  (all {loaded.num_layers + 1} layers + entropies, written to disk)")
    print(f"ratio capture/plain = {plain_s / capture_s:.3f}  (goal >= 0.85)")


def _padded(loaded, prompts, responses):
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), loaded.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(loaded.device), mask.to(loaded.device)


if __name__ == "__main__":
    main()
