"""Online training's steps after the first epoch, with the feature cache (later epochs read the target's features from
the run's folder) and without it (the target runs every step): seconds per step, by epoch, in one quiet window.

    .venv/bin/python benchmarks/feature_cache.py --model smollm2-135m --conversations 48 --epochs 3
    .venv/bin/python benchmarks/feature_cache.py --model qwen2.5-coder-1.5b --conversations 32 --epochs 2

ShareGPT conversations with their own answers (--responses own: nothing is generated), one layer set, each run in a
fresh temporary store (the model itself comes from the default store). The two runs see the same batches in the same
order. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from layerscope.draft.training.online import train_online
from layerscope.draft.training.progress import TrainProgress
from layerscope.store import Store, default_root
from layerscope.target.load import load_model


def timed_run(target, store_dir: Path, cache: bool, a) -> tuple[list[float], dict]:
    """Seconds of each training step (from one step's report to the next; the first step's, not seen, nan)."""
    marks: list[float] = []

    def progress(p):
        if isinstance(p, TrainProgress):
            marks.append(time.perf_counter())

    data = dict(prompts="sharegpt", responses="own", limit=a.conversations + a.held_out, val_conversations=a.held_out,
                batch_size=a.batch_size, max_prompt_tokens=256, max_new_tokens=192, eval_points=1,
                draft_intermediate=a.ff)
    n = train_online(target, [a.layers], Store(store_dir / "count"), steps=1, **data).conversations   # those that fit
    batches = -(-n // a.batch_size)
    result = train_online(target, [a.layers], Store(store_dir), steps=a.epochs * batches, feature_cache=cache,
                          progress=progress, **data)
    steps = [float("nan")] + [b - m for m, b in zip(marks, marks[1:])]      # step 1's start is not seen
    return steps, {"conversations": result.conversations, "batches": batches, "features": result.features}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=48, help="training conversations (about)")
    ap.add_argument("--held-out", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--layers", default=None, help="the set, e.g. 2,15,27 (default: [2, N//2, N-3])")
    ap.add_argument("--ff", type=int, default=None, help="the draft's MLP width (default: the target's)")
    a = ap.parse_args()
    target = load_model(a.model, store=Store(default_root()))
    N = target.num_layers
    a.layers = [int(x) for x in a.layers.split(",")] if a.layers else [2, N // 2, N - 3]
    print(f"{a.model} in {target.model.dtype}, layers {a.layers}, {a.epochs} epochs of about {a.conversations} "
          f"conversations, batches of {a.batch_size}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cache in (True, False):
            steps, info = timed_run(target, Path(tmp) / ("cache" if cache else "plain"), cache, a)
            b = info["batches"]
            by_epoch = [steps[e * b:(e + 1) * b] for e in range(a.epochs)]
            rows[cache] = [sum(x for x in s if x == x) / sum(1 for x in s if x == x) for s in by_epoch if len(s) > 1]
            print(f"{'with the cache' if cache else 'without it    '}: {info['conversations']} conversations, {b} "
                  f"batches an epoch; seconds a step by epoch " + ", ".join(f"{x:.3f}" for x in rows[cache])
                  + f"; features {info['features']}", flush=True)
    later = [p / c for c, p in zip(rows[True][1:], rows[False][1:])]
    print("epochs after the first, a step without the cache / with it: " + ", ".join(f"{x:.2f}x" for x in later)
          + f"; the first epoch {rows[False][0] / rows[True][0]:.2f}x (writing the features)")


if __name__ == "__main__":
    main()
