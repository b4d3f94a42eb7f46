"""What k layer sets in one online pass cost against k separate runs, measured in one process.

    .venv/bin/python benchmarks/online_sets.py [--model smollm2-135m] [--steps 4] [--sets 2,15,27 5,27,29 7,20,27]

Runs layerscope.draft.training.online.train_online on the same conversations (ShareGPT's own answers, so nothing
is generated) for `--steps` steps with the first set alone, then with all sets together, in separate
temporary stores, and compares the training seconds per step (target forward + every set's draft step;
held-out features and evaluations are not counted). Prints the ratio
    time(k sets in one pass) / (k x time(one set))
which is what training k sets in one pass costs against k separate runs.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from layerscope.draft.training.online import train_online
from layerscope.store import Store
from layerscope.target.load import load_model


def seconds_per_step(target, sets, steps: int) -> tuple[float, int]:
    seen = []
    with tempfile.TemporaryDirectory() as tmp:
        train_online(target, sets, Store(tmp), progress=seen.append, prompts="sharegpt", limit=96, responses="own",
                     steps=steps, eval_points=1, val_conversations=8)
    train = [p for p in seen if p.phase == "train"]
    return train[-1].elapsed_s / len(train), train[-1].tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sets", nargs="+", default=["2,15,27", "5,27,29", "7,20,27"])
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_model(a.model, store=Store())
    sets = [[int(x) for x in s.split(",")] for s in a.sets]
    one, tokens = seconds_per_step(target, sets[:1], a.steps)
    many, _ = seconds_per_step(target, sets, a.steps)
    k = len(sets)
    print(f"{a.model}, {torch.get_num_threads()} thread(s), {a.steps} steps of {tokens // a.steps} rows on average")
    print(f"  1 set:  {one:.2f} s/step")
    print(f"  {k} sets: {many:.2f} s/step in one pass, against {k * one:.2f} s for {k} separate runs")
    print(f"  ratio {many / (k * one):.3f} (one pass / separate runs); each extra set costs {(many - one) / (k - 1) / one:.2f}x "
          f"a one-set step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
