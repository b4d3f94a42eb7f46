"""`layerscope study`: one draft per strategy's layer set, same budget, benchmarked together."""

from __future__ import annotations

import json
import sys
import time

from layerscope.commands.common import Progress, open_store, parse_layers, print_json

NAME = "study"
HELP = ("train one draft per strategy's layer set with the same budget, benchmark them on held-out prompts, "
        "and correlate the proxy scores with tau")


def add_arguments(p) -> None:
    from layerscope.study import STUDY_STRATEGIES, StudyOptions

    p.add_argument("key", help="capture key (a unique prefix is enough)")
    p.add_argument("--model", default=None, help="target model spec (default: the capture's model)")
    p.add_argument("--strategies", default=",".join(STUDY_STRATEGIES), help="comma-separated strategies")
    p.add_argument("--layers", action="append", default=[], metavar="L1,L2,...", help="a hand-picked set (repeatable)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--lam", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=300, help="training budget per draft, in optimizer steps")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prompts", default=StudyOptions.prompts, help="benchmark prompts (default sharegpt-heldout)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=StudyOptions.depth, help="chain draft depth K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from layerscope.models import load_model
    from layerscope.study import StudyOptions, format_study, run_study

    store = open_store(args)
    cap = store.open_capture(args.key)
    target = load_model(args.model or cap.manifest["model"], store=store)
    options = StudyOptions(
        strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
        extra_sets=tuple(tuple(parse_layers(x)) for x in args.layers), k=args.k, lam=args.lam,
        train={"steps": args.steps, "ttt_steps": args.ttt_steps, "batch_size": args.batch_size,
               "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed},
        prompts=args.prompts, limit=args.limit, seed=args.seed, max_new_tokens=args.max_new_tokens, depth=args.depth)
    t0 = time.perf_counter()
    with Progress("study", unit="step") as bar:
        def show(p):
            if p.phase == "train" and isinstance(p.detail, dict):
                bar.update(p.detail.get("step", 0), p.detail.get("steps"), phase=p.message,
                           loss=p.detail.get("loss", 0.0))
            elif p.phase == "bench" and p.detail is not None:
                bar.update(p.detail.runs_done, p.detail.runs_total, phase=p.message,
                           tau=p.detail.tau if p.detail.tau is not None else "-")
            else:
                bar.update(0, None, phase=p.message)
        report = run_study(cap, target, store, options, progress=show)
    if args.json:
        print_json([r.to_json() for r in report.rows])
        print("spearman with tau: " + json.dumps(report.spearman), file=sys.stderr)
    else:
        print(f"study of capture {cap.key} on {target.spec}: {report.prompts} held-out prompts, "
              f"{args.steps} training steps per draft, {time.perf_counter() - t0:.0f} s")
        print(format_study(report))
    return 0
