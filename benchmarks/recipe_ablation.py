"""The draft recipe, chosen by measurement: one cell per change to the recipe, at equal CPU time.

    LAYERSCOPE_STORE=$HOME/layerscope-store .venv/bin/python benchmarks/recipe_ablation.py \
        --cpu-minutes 8 --out docs/ablation.json [--cells base,own,feature1] [--threads 1]
    .venv/bin/python benchmarks/recipe_ablation.py --table a.json [b.json ...]     # the finished cells as Markdown

Every cell trains one draft on the default set [2, 15, 27] of SmolLM2-135M, online (the target in the loop:
its forward is part of the cell's CPU time), through the one training loop (layerscope.draft.training.fit) with a CPU
clock, for the same CPU seconds of this process (so a cell measures the same work whatever else runs on the
machine). Every cell is evaluated on the SAME held-out conversations: `--val` ShareGPT prompts of the
--limit sample with the target's own greedy answers (what speculative decoding verifies), never trained on.
Agreement at positions 1-3 counts every held-out position (an argmax outside the draft vocabulary is a miss).
The `ridge` row is the closed-form floor: a ridge map from the draft's inputs (the set's hidden states at t
and the target embedding of token t+1) to the target's final state at t+1, fitted on the training
conversations the cell's CPU time allows, scored by the target's lm_head on the same held-out positions.

Each finished cell is written to --out at once (JSON, one entry per cell), so a killed run loses at most the
cell in progress: run the same command again and it does the cells that are missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from layerscope.draft.model import build_draft_vocab
from layerscope.draft.training.data import windows_of
from layerscope.draft.training.fit import FitState, build_drafters, final_norm, fit
from layerscope.draft.training.loss import evaluate
from layerscope.draft.training.online import OnlineOptions, OnlineSource, held_out_splits, split_for, target_features
from layerscope.draft.training.responses import Conversations, load_conversations
from layerscope.stats.ridge import explained_variance, ridge
from layerscope.store import Store, atomic_write_json
from layerscope.study.probe import agreement
from layerscope.target.load import load_model

LAYERS = [2, 15, 27]

# name -> (what it changes, the OnlineOptions fields it sets, data: "regenerate" | "own", training pool size or None)
CELLS = {
    "base":       ("the current defaults (regenerated answers, all training conversations)", {}, "regenerate", None),
    "own":        ("ShareGPT's own answers instead of the target's", {}, "own", None),
    "pool100":    ("epochs over 100 regenerated conversations", {}, "regenerate", 100),
    "feature0.1": ("+ feature regression toward h_N, weight 0.1", {"feature_loss": 0.1}, "regenerate", None),
    "feature1":   ("+ feature regression toward h_N, weight 1", {"feature_loss": 1.0}, "regenerate", None),
    "warm20":     ("closed-form fc from 20 steps of data, then gradient training", {"warm_start": 20}, "regenerate", None),
    "frozen":     ("lm_head and final norm from the target, frozen", {"freeze_lm_head": True}, "regenerate", None),
    "noise":      ("Gaussian noise std 0.05 on the hidden states", {"noise_std": 0.05}, "regenerate", None),
    "ttt5":       ("5 TTT steps instead of 3", {"ttt_steps": 5}, "regenerate", None),
    "lr3e-3":     ("learning rate 3e-3", {"lr": 3e-3}, "regenerate", None),
    "lr3e-4":     ("learning rate 3e-4", {"lr": 3e-4}, "regenerate", None),
    "warmup100":  ("warm-up 100 steps", {"warmup": 100}, "regenerate", None),
    "vocab4k":    ("draft vocabulary 4k", {"draft_vocab": 4096}, "regenerate", None),
    "vocab16k":   ("draft vocabulary 16k", {"draft_vocab": 16384}, "regenerate", None),
    "ridge":      ("closed-form ridge map of the draft's inputs (the floor)", {}, "regenerate", None),
}


def pools(target, store, args):
    """(regenerated conversations, own-answer conversations, held-out ids): the held-out conversations are
    the first --val of a seeded order of the regenerated ones, and are removed from both training pools."""
    base = OnlineOptions(prompts="sharegpt", limit=args.limit, max_prompt_tokens=256, steps=1)
    regen = load_conversations(target, base, store)
    own = load_conversations(target, replace(base, responses="own"), store)
    order = torch.randperm(len(regen), generator=torch.Generator().manual_seed(1234)).tolist()
    val_ids = {regen.ids[i] for i in order[: args.val]}
    return regen, own, val_ids


def subset(convs: Conversations, keep) -> list[int]:
    return [i for i, cid in enumerate(convs.ids) if keep(cid)]


def run_cell(name, target, regen, own, val_ids, args) -> dict:
    what, fields, data, pool = CELLS[name]
    o = OnlineOptions(prompts="sharegpt", limit=args.limit, time_s=args.cpu_minutes * 60, clock="cpu",
                      eval_points=4, **fields)
    o.validate()
    convs = own if data == "own" else regen
    train_idx = subset(convs, lambda cid: cid not in val_ids)
    if pool is not None:
        train_idx = train_idx[:pool]
    val_idx = subset(regen, lambda cid: cid in val_ids)
    vocab = int(target.model.get_input_embeddings().weight.shape[0])
    resp = torch.tensor([t for i in train_idx for t in convs.response[i]], dtype=torch.long)
    d2t, t2d = build_draft_vocab(resp, o.draft_vocab, vocab)
    val_split = held_out_splits(target, regen, val_idx, [LAYERS], LAYERS, o, lambda p: None)[0]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if name == "ridge":
        acc, ev, seen = ridge_floor(target, convs, train_idx, val_split, o, args.cpu_minutes * 60)
        return {"cell": name, "what": what, "agreement": acc, "explained_variance": ev, "tokens_seen": seen,
                "cpu_s": round(time.process_time() - cpu0, 1), "wall_s": round(time.perf_counter() - wall0, 1),
                "train_conversations": len(train_idx)}
    embed, lm_head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    drafters = build_drafters(target.model.config, embed, lm_head, final_norm(target.model), [LAYERS], d2t, t2d, o,
                              target.device)
    J = 3                                                       # every cell is scored at positions 1-3

    def run_eval():
        return [evaluate(drafters[0].head, val_split, windows_of(val_split, o.seq_len, val_split.counted, J), J,
                         drafters[0].teacher, o.batch_size, target.device)]

    def say(p):
        if p.phase == "train" and p.step % 25 == 0:
            print(f"  {name}: step {p.step} {p.tokens} tokens {100 * p.fraction:.0f}% "
                  f"val {p.val[0]}", file=sys.stderr, flush=True)

    state = fit(drafters, OnlineSource(target, convs, train_idx, [LAYERS], o, t2d), o, state=FitState(1),
                evaluate=run_eval, progress=say, device=target.device)
    acc, loss, positions, cov = state.last_eval[0]
    return {"cell": name, "what": what, "options": {k: v for k, v in fields.items()}, "data": data, "pool": pool,
            "agreement": [round(a, 4) for a in acc], "val_loss": loss, "val_positions": positions,
            "coverage": round(cov, 4), "curve": state.curves[0], "tokens_seen": state.tokens, "steps": state.step,
            "train_conversations": len(train_idx), "cpu_s": round(time.process_time() - cpu0, 1),
            "wall_s": round(time.perf_counter() - wall0, 1), "cpu_budget_s": args.cpu_minutes * 60}


@torch.no_grad()
def ridge_floor(target, convs, train_idx, val_split, o, cpu_budget_s):
    """Agreement (position 1) and explained variance of the ridge map [h_S[t]; embed(x_{t+1})] -> h_N[t+1],
    fitted on as many training conversations as cpu_budget_s allows (float64 normal equations, λ on a grid
    chosen on the last tenth of the fitted rows)."""
    N, embed = target.num_layers, target.model.get_input_embeddings().weight.detach().float()
    lm_head = target.model.get_output_embeddings().weight.detach().float()

    def pairs(aux, final, token_id, position, counted):
        """At every counted position p (the target's choice there is a response token; what a draft's step 1 is
        scored on) with p-1 in the same conversation: x = [aux[p-1] ; embed(x_p) ; 1], y = final[p]. Returns x, y, p."""
        p = (counted & (position > 0)).nonzero().squeeze(1)
        x = torch.cat([aux[p - 1].double(), embed[token_id[p]].double(), torch.ones(len(p), 1, dtype=torch.double)], 1)
        return x, final[p].double(), p

    xs, ys, seen, cpu0 = [], [], 0, time.process_time()
    for i in range(0, len(train_idx), o.batch_size):
        rows, feats = target_features(target, convs, train_idx[i: i + o.batch_size], LAYERS)
        sp = split_for(rows, feats, LAYERS, N)
        x, y, _ = pairs(sp.aux.float(), sp.final.float(), sp.token_id, sp.position, sp.counted)
        xs.append(x)
        ys.append(y)
        seen += len(sp.token_id)
        if time.process_time() - cpu0 > cpu_budget_s * 0.8:
            break
    X, Y = torch.cat(xs), torch.cat(ys)
    cut = int(0.9 * len(X))
    best = None
    for lam in (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0):
        w = solve(X[:cut], Y[:cut], lam)
        a = float(((X[cut:] @ w).float() @ lm_head.T).argmax(-1).eq((Y[cut:].float() @ lm_head.T).argmax(-1)).float().mean())
        best = max(best or (a, lam), (a, lam))
    w = solve(X, Y, best[1])
    xv, yv, pv = pairs(val_split.aux.float(), val_split.final.float(), val_split.token_id, val_split.position,
                       val_split.counted)
    pred = xv @ w
    return [round(agreement(pred, val_split.target_next[pv], lm_head), 4)], round(explained_variance(pred, yv), 4), seen


def solve(x, y, lam):
    """The probe's ridge (layerscope/study/probe.py: each column penalised by λ × its centred sum of squares, the bias
    column last and free). The table in docs/training.md was measured with one λ × the mean diagonal for all."""
    return ridge(x.T @ x, x.T @ y, lam)


def table(paths: list[str]) -> str:
    """The finished cells of one or more --out files as a Markdown table, best position-1 agreement first."""
    cells = {}
    for path in paths:
        cells.update(json.loads(Path(path).read_text())["cells"])
    lines = ["| cell | what | agreement @1 / @2 / @3 | tokens seen | CPU s | wall s |", "|---|---|---|---|---|---|"]
    for c in sorted(cells.values(), key=lambda c: -c["agreement"][0]):
        acc = " / ".join(f"{a:.3f}" for a in c["agreement"])
        lines.append(f"| {c['cell']} | {c['what']} | {acc} | {c['tokens_seen']:,} | {c['cpu_s']:.0f} | {c['wall_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--cpu-minutes", type=float, default=8.0)
    p.add_argument("--limit", type=int, default=2000, help="ShareGPT prompts in the sample (regenerated once, stored)")
    p.add_argument("--val", type=int, default=48, help="held-out conversations, the same for every cell")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    done = json.loads(out.read_text()) if out.is_file() else {"cells": {}}
    store = Store(None)
    target = load_model("smollm2-135m", store=store)
    regen, own, val_ids = pools(target, store, args)
    print(f"{len(regen)} regenerated and {len(own)} own-answer conversations; {len(val_ids)} held out", file=sys.stderr)
    for name in args.cells.split(","):
        if name in done["cells"]:
            continue
        print(f"cell {name}: {CELLS[name][0]}", file=sys.stderr, flush=True)
        row = run_cell(name, target, regen, own, val_ids, args)
        print(json.dumps(row), flush=True)
        done = json.loads(out.read_text()) if out.is_file() else {"cells": {}}     # another process may have added cells
        done["cells"][name] = row
        done["setup"] = {"layers": LAYERS, "limit": args.limit, "val": args.val, "cpu_minutes": args.cpu_minutes,
                         "threads": args.threads, "model": "smollm2-135m"}
        atomic_write_json(out, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
