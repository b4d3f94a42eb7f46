"""`layerscope study`: one draft per strategy's layer set, same budget, benchmarked together."""

from __future__ import annotations

import time

from layerscope.commands.common import (
    Progress,
    add_training_arguments,
    add_wait_quiet,
    machine_options,
    open_store,
    parse_layers,
    parse_list,
    print_json,
)
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.draft.training.progress import DoneProgress, EvalProgress, FeaturesProgress, ResponsesProgress, TrainProgress
from layerscope.errors import LayerScopeError
from layerscope.stats.analysis import AnalysisOptions
from layerscope.stats.entropy import KERNELS
from layerscope.steps import workflow
from layerscope.study.run import StudyOptions, budget_text, format_study
from layerscope.validate import parse_count, parse_duration

NAME = "study"
HELP = ("train one draft per strategy's layer set (and per training seed) with the same budget, benchmark them "
        "on held-out prompts against controls, and report tau with paired intervals, a verdict, and how well "
        "each proxy predicts tau")


def add_arguments(p) -> None:
    d, a = StudyOptions(), AnalysisOptions()
    p.add_argument("key", help="capture key (a unique prefix is enough)")
    p.add_argument("--model", default=None, help="target model spec (default: the capture's model)")
    p.add_argument("--strategies", default=",".join(d.strategies),
                   help="comma-separated strategies; the controls are random (seeded random sets of the same size), "
                        "last-k (the k deepest layers) and single (layer N-1); probe adds the probe's search's best set "
                        "(minutes, cached); the default rule is always in (default %(default)s)")
    p.add_argument("--random-sets", type=int, default=d.random_sets,
                   help="random control sets that 'random' adds (default %(default)s)")
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="training seeds: each set is trained once per seed, the table shows the spread (default: --seed)")
    p.add_argument("--kernel", choices=KERNELS, default=a.kernel,
                   help="token preparation of the statistics that pick the sets: linear = standard linear CKA, "
                        "cosine = unit-length tokens (default %(default)s); the proxies are reported under both")
    p.add_argument("--min-entropy", type=float, default=a.min_entropy,
                   help="token-entropy filter (nats) of the statistics that pick the sets (default %(default)s)")
    p.add_argument("--filters", default=",".join(f"{x:g}" for x in d.filters), metavar="H1,H2,...",
                   help="token-entropy thresholds (nats; 0 = no filter) at which the proxies are also computed "
                        "(default %(default)s)")
    p.add_argument("--layers", action="append", default=[], metavar="L1,L2,...", help="a hand-picked set (repeatable)")
    p.add_argument("--k", type=int, default=d.k, help="layers per set (default %(default)s)")
    p.add_argument("--lam", type=float, default=d.lam, help="λ of the greedy mRMR strategy (default %(default)s)")
    add_training_arguments(p)      # --steps --tokens --time --ttt-steps --batch-size --seq-len --lr --fc-norm
    #                                --responses --val-conversations, as train-draft takes them
    on = OnlineOptions()
    p.add_argument("--online", action="store_true",
                   help="train the drafts online (the target in the loop, every set from one target pass per seed, "
                        "resumable; see `train-draft --model`) instead of from the capture")
    p.add_argument("--train-prompts", default=on.prompts, help="online: training conversations (default %(default)s)")
    p.add_argument("--train-limit", type=int, default=on.limit, help="online: conversations drawn (default: all)")
    p.add_argument("--train-kinds", default=on.kinds, metavar="KIND=W,...",
                   help="online, --train-prompts sharegpt: draw the training conversations by kind of first request, "
                        "as train-draft --kinds takes it (e.g. code=2,summarization=2; docs/training.md)")
    p.add_argument("--train-max-prompt-tokens", type=int, default=on.max_prompt_tokens,
                   help="online: longer training prompts are left out (default %(default)s)")
    p.add_argument("--train-max-new-tokens", type=int, default=on.max_new_tokens,
                   help="online: cap of the regenerated answers (default %(default)s)")
    p.add_argument("--sets-per-pass", type=int, default=d.sets_per_pass, metavar="N",
                   help="online: train N sets per target pass (default: all in one), each pass benchmarked as it "
                        "finishes: passes sized to what one sitting of the machine can finish (sets already in "
                        "--outcomes are left out before the passes are formed)")
    p.add_argument("--outcomes", default=d.outcomes, metavar="DIR",
                   help="keep every finished draft's outcome (its record and benchmark, a small JSON file) in DIR "
                        "and read it back instead of training again: commit DIR to carry a long study across "
                        "machines")
    p.add_argument("--prompts", default=d.prompts, help="benchmark prompts (default %(default)s)")
    p.add_argument("--limit", type=int, default=d.limit, help="benchmark prompts to run (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="default %(default)s")
    p.add_argument("--depth", type=int, default=d.depth, help="chain draft depth K (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt sample and training seed")
    add_wait_quiet(p)
    p.add_argument("--json", action="store_true")


def options_from_args(args) -> StudyOptions:
    train = TrainOptions(steps=args.steps, ttt_steps=args.ttt_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                         lr=args.lr, seed=args.seed, fc_norm=args.fc_norm, draft_intermediate=args.draft_intermediate,
                         train_dtype=args.train_dtype)
    online = None
    if args.online and args.train_kinds is not None and str(args.train_prompts).strip() != "sharegpt":
        raise LayerScopeError(f"--train-kinds weights ShareGPT's conversations; --train-prompts {args.train_prompts} "
                              "is another set", "Use --train-prompts sharegpt, or leave --train-kinds out")
    if args.online:
        online = OnlineOptions(prompts=args.train_prompts, limit=args.train_limit, kinds=args.train_kinds,
                               responses=args.responses,
                               max_prompt_tokens=args.train_max_prompt_tokens,
                               max_new_tokens=args.train_max_new_tokens, val_conversations=args.val_conversations,
                               fc_norm=args.fc_norm, draft_intermediate=args.draft_intermediate,
                               train_dtype=args.train_dtype,
                               batch_size=args.batch_size, seq_len=args.seq_len,
                               ttt_steps=args.ttt_steps, lr=args.lr, seed=args.seed, steps=args.steps,
                               tokens=parse_count(args.tokens) if args.tokens else None,
                               time_s=parse_duration(args.time) if args.time else None)
        online.validate()
    elif args.tokens or args.time:
        raise LayerScopeError("--tokens and --time are budgets of online training", "Add --online, or pass --steps")
    elif args.train_kinds is not None:
        raise LayerScopeError("--train-kinds weights the conversations of online training; without --online the "
                              "drafts train from the capture", "Add --online, or leave --train-kinds out")
    return StudyOptions(strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
                        extra_sets=tuple(tuple(parse_layers(x)) for x in args.layers), k=args.k, lam=args.lam,
                        train=train, prompts=args.prompts, limit=args.limit, seed=args.seed,
                        max_new_tokens=args.max_new_tokens, depth=args.depth,
                        seeds=tuple(parse_list(args.seeds, "--seeds", int)) if args.seeds else None,
                        random_sets=args.random_sets, filters=tuple(parse_list(args.filters, "--filters", float)),
                        online=online, machine=machine_options(args), sets_per_pass=args.sets_per_pass,
                        outcomes=args.outcomes)


def run(args) -> int:
    t0 = time.perf_counter()
    with Progress("study", unit="step") as bar:
        def show(p):
            d = p.detail
            if p.phase == "train" and isinstance(d, TrainProgress) and args.online:    # online: a share of the budget
                bar.update(round(100 * d.fraction), 100, eta_s=p.eta_s, phase=p.message, tokens=d.tokens,
                           loss=d.mean_loss if d.loss else 0.0, tok_s=d.tokens_per_s)
            elif p.phase == "train" and isinstance(d, ResponsesProgress):
                bar.update(d.done, d.total, eta_s=p.eta_s, phase=f"{p.message}: {d.phase}")
            elif p.phase == "train" and isinstance(d, FeaturesProgress):
                bar.update(d.done, d.total, phase=f"{p.message}: {d.phase}")
            elif p.phase == "train" and isinstance(d, (EvalProgress, DoneProgress)):
                bar.update(bar.bar.n, None, phase=f"{p.message}: held-out evaluation at {d.tokens:,} tokens")
            elif p.phase == "train" and isinstance(d, TrainProgress):                  # from the capture: steps
                bar.update(d.step, d.steps, eta_s=p.eta_s, phase=p.message, loss=d.mean_loss)
            elif p.phase == "bench" and d is not None and d.phase not in ("decode", "calibrate"):   # the wait
                bar.update(bar.bar.n, None, phase=p.message)
            elif p.phase == "bench" and d is not None:
                bar.update(d.runs_done, d.runs_total, eta_s=p.eta_s, phase=p.message,
                           tau=d.tau if d.tau is not None else "-")
            else:
                bar.update(0, None, phase=p.message)
        done = workflow.study(open_store(args), args.key, options_from_args(args), model=args.model,
                              analysis=AnalysisOptions(kernel=args.kernel, min_entropy=args.min_entropy), progress=show,
                              estimate=lambda f: bar.note(f.line()))
    report = done.report
    if args.json:
        print_json(report.to_json())
    else:
        print(f"study of capture {report.capture} on {done.target.spec}: {report.prompts} held-out prompts, "
              f"{budget_text(report.options)}, {time.perf_counter() - t0:.0f} s")
        print(format_study(report))
    return 0
