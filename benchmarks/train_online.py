"""Train drafts online and benchmark them against plain decoding in the same run.

    .venv/bin/python benchmarks/train_online.py --layers 2,15,27 --layers 5,27,29 --layers 7,20,27 \
        --prompts sharegpt --limit 1200 --time 75m --bench-limit 20 --max-new-tokens 48 --k 2,3

1. layerscope.steps.workflow.train_online: one draft per --layers set from one target pass per step (resumable:
   rerun the same command after a kill and it continues from the last checkpoint; a finished run is
   served from the store).
2. layerscope.steps.workflow.bench: every draft (chain depths --k, and a tree with --tree) against our plain
   decoding, HF generate and HF prompt lookup, on the same held-out ShareGPT prompts, one process.
Prints the learning curve of every set (held-out agreement at each evaluation, by tokens seen), then the
benchmark table (tau, acceptance by draft position, tokens/s, speedup against plain decoding) and writes
both as JSON with --json-out. Ratios within this one run are the numbers to trust; say what else ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch

from layerscope.decoding import bench as bench_mod
from layerscope.decoding.specdec import TreeSpec
from layerscope.draft.training.online import OnlineOptions
from layerscope.steps import workflow
from layerscope.store import Store
from layerscope.validate import parse_count, parse_duration


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default="sharegpt")
    p.add_argument("--limit", type=int, default=1200)
    p.add_argument("--responses", default="regenerate", choices=["regenerate", "own"])
    p.add_argument("--layers", action="append", required=True)
    p.add_argument("--time", default=None)
    p.add_argument("--tokens", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=OnlineOptions.batch_size)
    p.add_argument("--lr", type=float, default=OnlineOptions.lr)
    p.add_argument("--ttt-steps", type=int, default=OnlineOptions.ttt_steps)
    p.add_argument("--draft-vocab", type=int, default=OnlineOptions.draft_vocab)
    p.add_argument("--eval-points", type=int, default=OnlineOptions.eval_points)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bench-limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", default="2")
    p.add_argument("--tree", action="store_true", help="also a tree contender per draft (the bench's default tree)")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--store", default=None)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    store = Store(a.store)
    sets = [[int(x) for x in s.split(",")] for s in a.layers]
    o = OnlineOptions(prompts=a.prompts, limit=a.limit, responses=a.responses, batch_size=a.batch_size, lr=a.lr,
                      ttt_steps=a.ttt_steps, draft_vocab=a.draft_vocab, eval_points=a.eval_points, steps=a.steps,
                      tokens=parse_count(a.tokens) if a.tokens else None,
                      time_s=parse_duration(a.time) if a.time else None)
    t0 = time.time()
    last = [0.0]

    def say(p):
        if p.phase != "train" or time.time() - last[0] > 60 or p.fraction >= 1:
            last[0] = time.time()
            keep = {"phase": p.phase} | {k: v for k, v in asdict(p).items() if k not in ("sets",)}
            print(time.strftime("%H:%M:%S"), json.dumps(keep, default=lambda x: round(x, 4)), flush=True)

    result = workflow.train_online(store, a.model, sets, o, progress=say)
    print(f"\ntraining: {result.conversations} conversations ({result.data_tokens} tokens), "
          f"{result.seconds:.0f} s of training at {result.tokens_per_s:.0f} tok/s, "
          f"{'from the store' if result.cached else 'resumed' if result.resumed else 'fresh'}, "
          f"{torch.get_num_threads()} thread(s)")
    print("\nlearning curves: held-out agreement per TTT step (every position) by tokens seen")
    for d in result.drafts:
        print(f"  {d.layers}: " + "  ".join(f"{t}: {'/'.join(f'{x:.3f}' for x in acc)}" for t, acc in d.curve)
              + f"   (vocabulary coverage {d.val_coverage:.3f})")
    out = {"training": result.to_json(), "options": asdict(o)}
    if not a.no_bench:
        ks = tuple(int(k) for k in a.k.split(","))
        bo = bench_mod.BenchOptions(model=a.model, prompts="sharegpt-heldout", limit=a.bench_limit,
                                    max_new_tokens=a.max_new_tokens, ks=ks, trees=(TreeSpec(),) if a.tree else ())
        drafts = [(",".join(map(str, d.layers)), d.path) for d in result.drafts]
        benched = workflow.bench(drafts, bo, store, progress=None)
        rep = benched.report
        print("\n" + bench_mod.format_table(rep))
        out["bench"] = rep.to_json()
    print(f"\nwall time {time.time() - t0:.0f} s")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
