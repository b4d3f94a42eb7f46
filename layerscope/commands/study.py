"""`layerscope study`: one draft per strategy's layer set, same budget, benchmarked together."""

from __future__ import annotations

import json
import sys
import time

from layerscope import workflow
from layerscope.commands.common import Progress, open_store, parse_layers, print_json
from layerscope.draft.train import TrainOptions
from layerscope.study import StudyOptions, format_study

NAME = "study"
HELP = ("train one draft per strategy's layer set with the same budget, benchmark them on held-out prompts, "
        "and correlate the proxy scores with tau")


def add_arguments(p) -> None:
    d, t = StudyOptions(), TrainOptions()
    p.add_argument("key", help="capture key (a unique prefix is enough)")
    p.add_argument("--model", default=None, help="target model spec (default: the capture's model)")
    p.add_argument("--strategies", default=",".join(d.strategies), help="comma-separated strategies (default %(default)s)")
    p.add_argument("--layers", action="append", default=[], metavar="L1,L2,...", help="a hand-picked set (repeatable)")
    p.add_argument("--k", type=int, default=d.k, help="layers per set (default %(default)s)")
    p.add_argument("--lam", type=float, default=d.lam, help="λ of the greedy mRMR strategy (default %(default)s)")
    p.add_argument("--steps", type=int, default=t.steps,
                   help="training budget per draft, in optimizer steps (default 300 on a CPU, 2000 on a GPU)")
    p.add_argument("--ttt-steps", type=int, default=t.ttt_steps, help="default %(default)s")
    p.add_argument("--batch-size", type=int, default=t.batch_size, help="default %(default)s")
    p.add_argument("--seq-len", type=int, default=t.seq_len, help="default %(default)s")
    p.add_argument("--lr", type=float, default=t.lr, help="default %(default)s")
    p.add_argument("--prompts", default=d.prompts, help="benchmark prompts (default %(default)s)")
    p.add_argument("--limit", type=int, default=d.limit, help="benchmark prompts to run (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="default %(default)s")
    p.add_argument("--depth", type=int, default=d.depth, help="chain draft depth K (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt sample and training seed")
    p.add_argument("--json", action="store_true")


def options_from_args(args) -> StudyOptions:
    train = {"ttt_steps": args.ttt_steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
             "seed": args.seed}
    if args.steps is not None:
        train["steps"] = args.steps
    return StudyOptions(strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
                        extra_sets=tuple(tuple(parse_layers(x)) for x in args.layers), k=args.k, lam=args.lam,
                        train=train, prompts=args.prompts, limit=args.limit, seed=args.seed,
                        max_new_tokens=args.max_new_tokens, depth=args.depth)


def run(args) -> int:
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
        done = workflow.study(open_store(args), args.key, options_from_args(args), model=args.model, progress=show)
    report = done.report
    if args.json:
        print_json([r.to_json() for r in report.rows])
        print("spearman with tau: " + json.dumps(report.spearman), file=sys.stderr)
    else:
        print(f"study of capture {report.capture} on {done.target.spec}: {report.prompts} held-out prompts, "
              f"{report.options['train']['steps']} training steps per draft, {time.perf_counter() - t0:.0f} s")
        print(format_study(report))
    return 0
