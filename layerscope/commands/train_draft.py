"""`layerscope train-draft`: train EAGLE-3 drafts, online with the target in the loop or from a stored capture.

    layerscope train-draft --model MODEL --prompts SET --layers 2,15,27 [--layers ...] --tokens 2M|--time 45m|--steps N
    layerscope train-draft KEY --layers 2,15,27 [--steps N]          (from a capture, as before)

Online, every --layers set trains its own draft from the same target forward, with identical batches;
the same command run again resumes from the last checkpoint or returns the finished drafts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

import torch

from layerscope import fmt
from layerscope.capture.stored import open_capture
from layerscope.commands.common import Progress, add_training_arguments, open_store, parse_layers, print_json
from layerscope.draft import builtin, init_from
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.draft.training.progress import FeaturesProgress, ResponsesProgress, TrainProgress
from layerscope.errors import DraftError
from layerscope.steps import preflight, workflow
from layerscope.validate import check_number, parse_count, parse_duration

NAME = "train-draft"
HELP = ("train EAGLE-3 draft heads reading layer sets: online (--model, the target in the loop, several sets per "
        "pass, resumable) or from a stored capture (KEY); save them for vLLM/SGLang")

D = {f.name: f.default for f in fields(OnlineOptions)}
T = {f.name: f.default for f in fields(TrainOptions)}

THREADS_HELP = ("torch threads (default: $OMP_NUM_THREADS when set, else every core of the machine); with several "
                "jobs side by side give each --threads 1 (or OMP_NUM_THREADS=1)")


def add_arguments(p) -> None:
    p.add_argument("key", nargs="?", default=None, help="capture key (or unique prefix) to train from a capture; "
                   "leave it out and give --model to train online")
    p.add_argument("--model", default=None, help="train online with this target in the loop (e.g. smollm2-135m)")
    p.add_argument("--prompts", default=D["prompts"], help=f"online data: builtin | sharegpt | a file (default {D['prompts']})")
    p.add_argument("--limit", type=int, default=D["limit"], help="online: conversations to draw from the prompt set (default: all)")
    p.add_argument("--kinds", default=D["kinds"], metavar="KIND=W,...",
                   help="online, --prompts sharegpt: draw conversations by kind of first request, e.g. "
                        "code=2,translation=2,summarization=2 (kinds: code, translation, summarization, math, chat; "
                        "a weight is how many times more often than weight 1, 0 leaves the kind out, a kind not "
                        "named keeps 1, *=W sets the rest; docs/training.md has the rules)")
    p.add_argument("--max-new-tokens", type=int, default=D["max_new_tokens"], help="online: response length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=D["max_prompt_tokens"], help="online: longer prompts are left out")
    p.add_argument("--eval-points", type=int, default=D["eval_points"], help="held-out evaluations over the budget")
    p.add_argument("--layers", action="append", default=None,
                   help="a layer set, e.g. 2,15,27 (hidden_states indices 0..N-1); repeat for several sets")
    p.add_argument("--strategy", default=None,
                   help="capture training: take the set from selection instead: default | entropy-topk | greedy | aggregate | spread")
    p.add_argument("--k", type=int, default=3, help="layers to select with --strategy")
    add_training_arguments(p)      # --steps --tokens --time --ttt-steps --batch-size --seq-len --lr --fc-norm
    #                                --responses --val-conversations, as study takes them
    p.add_argument("--out", default=None, help="capture training: draft directory to write (default: the store)")
    p.add_argument("--seed", type=int, default=T["seed"])
    p.add_argument("--warmup", type=int, default=T["warmup"], help=f"linear warm-up steps (default {T['warmup']})")
    p.add_argument("--feature-loss", type=float, default=T["feature_loss"],
                   help="weight of the feature regression toward the target's final hidden state (EAGLE-1; 0 = off)")
    p.add_argument("--noise-std", type=float, default=T["noise_std"],
                   help="Gaussian noise added to the auxiliary hidden states in training (0 = off)")
    p.add_argument("--freeze-lm-head", action=argparse.BooleanOptionalAction, default=T["freeze_lm_head"],
                   help="keep lm_head at the target's rows and the final norm at the target's (frozen)")
    p.add_argument("--warm-start", type=int, default=T["warm_start"],
                   help="steps of data for a closed-form (ridge) fc before gradient training (0 = off)")
    p.add_argument("--init-from", action="append", default=None, metavar="DRAFT",
                   help="continue training this draft (a directory, a stored draft's key, or builtin) instead of a "
                        "fresh head; one per --layers set, matched by its layers; the budget is what is added")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"draft vocabulary size (most frequent response tokens; default {T['draft_vocab']}, with "
                        "--init-from the continued draft's own)")
    p.add_argument("--val-fraction", type=float, default=T["val_fraction"], help="capture training: held-out conversations")
    p.add_argument("--checkpoint-every", default="5m", help="online: training time between checkpoints (default 5m)")
    p.add_argument("--feature-cache", action=argparse.BooleanOptionalAction, default=D["feature_cache"],
                   help="online: keep each training conversation's target features in the run's folder after its "
                        "first forward, so later epochs read them instead of running the target (removed when the "
                        "run ends; off by itself where the disk has no room)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    if args.threads is not None:
        check_number("--threads", args.threads, minimum=1, maximum=os.cpu_count() or 1, integer=True, error=DraftError,
                     fix=f"Pass --threads 1..{os.cpu_count() or 1} (this machine's cores) or leave it out")
        torch.set_num_threads(args.threads)
    if (args.key is None) == (args.model is None):
        raise DraftError("Give a capture KEY to train from a capture, or --model to train online (one of them)",
                         "E.g. train-draft --model smollm2-135m --prompts sharegpt --layers 2,15,27 --tokens 2M")
    store = open_store(args)
    args.init_from = tuple(str(builtin.resolve(d, args.model, store)) for d in (args.init_from or ()))
    if args.draft_vocab is None:            # a continued draft keeps its vocabulary: its size is the default
        preflight.starting_drafts(args.init_from)
        args.draft_vocab = init_from.vocab_of(args.init_from) or T["draft_vocab"]
    if args.model is not None:              # workflow.train_online and workflow.train check the rest before any load
        return run_online(args, store)
    return run_capture(args, store)


def run_online(args, store) -> int:
    if not args.layers:
        raise DraftError("Online training needs at least one --layers set", "E.g. --layers 2,15,27 --layers 5,27,29")
    if args.strategy is not None:
        raise DraftError("--strategy picks a set from a capture's statistics; online training takes --layers",
                         "Run `layerscope select KEY --compare` and pass the sets it prints with --layers")
    budgets = [b for b in (args.steps, args.tokens, args.time) if b is not None]
    if len(budgets) != 1:
        raise DraftError("Give the online budget as exactly one of --steps, --tokens or --time",
                         "E.g. --tokens 2M or --time 45m")
    sets = [parse_layers(s) for s in args.layers]
    options = OnlineOptions(
        prompts=args.prompts, limit=args.limit, kinds=args.kinds, responses=args.responses,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, val_conversations=args.val_conversations,
        checkpoint_every_s=parse_duration(args.checkpoint_every), feature_cache=args.feature_cache, **recipe(args))
    if not args.json:
        print(f"training {len(sets)} draft(s) online on {args.model} ({args.prompts}, {args.responses} responses), "
              f"layer sets {sets}, {torch.get_num_threads()} thread(s)", file=sys.stderr)
    bars = {}

    def on_progress(p):
        if isinstance(p, ResponsesProgress):
            bar = bars.setdefault(p.phase, Progress("responses", unit="batch"))
            bar.update(p.done, p.total, eta_s=p.eta_s, tok_s=p.tokens_per_s, **({"reused": p.reused} if p.reused else {}))
        elif isinstance(p, FeaturesProgress):
            bar = bars.setdefault(p.phase, Progress("held-out features", unit="conv"))
            bar.update(p.done, p.total)
        elif isinstance(p, TrainProgress):
            bar = bars.setdefault(p.phase, Progress("train", unit="%"))
            best = [v[0] for v in p.val if v]
            bar.update(round(100 * p.fraction), 100, eta_s=p.eta_s, step=p.step, tokens=p.tokens,
                       tok_s=p.tokens_per_s, loss=p.mean_loss, val1=max(best) if best else "-")

    try:
        result = workflow.train_online(store, args.model, sets, options, progress=on_progress,
                                       estimate=lambda f: print(f.line(), file=sys.stderr))   # before it starts
    finally:
        for bar in bars.values():
            bar.close()
    if args.json:
        print_json(result.to_json())
        return 0
    how = "from the store" if result.cached else ("resumed and finished" if result.resumed else "trained")
    print(f"{len(result.drafts)} draft(s) {how}: {result.conversations} training conversations "
          f"({result.data_tokens} tokens), {result.seconds:.0f} s of training at {result.tokens_per_s:.0f} tok/s")
    mix = ", ".join(f"{k} {n}" for k, n in result.kind_mix.items())
    print(f"  training conversations by kind: {mix}" + (f" (drawn with --kinds {result.kinds})" if result.kinds else ""))
    if result.features is not None:
        f = result.features
        print(f"  target features: every epoch ran the target ({f['off']})" if not f["written"] and not f["read"] else
              f"  target features: {f['written']} conversations forwarded once and kept, read back {f['read']} times"
              + (f" ({f['off']})" if f["off"] else ""))
    for d in result.drafts:
        acc = ", ".join(f"{a:.3f}" for a in d.val_accuracy)
        curve = "  ".join(f"{t}:{a[0]:.3f}" for t, a in d.curve)
        seen = f"{d.tokens_seen} tokens seen" + (f" ({d.tokens_seen_total} with the draft it continued)"
                                                 if d.tokens_seen_total is not None else "")
        print(f"  layers {d.layers}: {seen}; held-out agreement per TTT step {acc} "
              f"(draft vocabulary covers {d.val_coverage:.1%}); {fmt.NAMES['simulated_acc_len']} "
              f"{fmt.number(d.simulated_acc_len)}; curve (tokens:step-1) {curve}")
        for when, by_kind in (("", d.val_by_kind), (" of the draft it continued, before", d.val_by_kind_start)):
            if by_kind:
                print(f"    held-out agreement by kind{when}: " + "; ".join(
                    f"{k} {', '.join(f'{a:.3f}' for a in v['val_accuracy'])} ({v['conversations']} conversations, "
                    f"{v['positions']} positions)" for k, v in by_kind.items()))
        print(f"    {d.path}")
    return 0


def recipe(args) -> dict:
    """The TrainOptions fields the command line sets (budget and recipe), shared by both data sources."""
    return dict(steps=args.steps, tokens=parse_count(args.tokens) if args.tokens is not None else None,
                time_s=parse_duration(args.time) if args.time is not None else None, ttt_steps=args.ttt_steps,
                seed=args.seed, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len, warmup=args.warmup,
                eval_points=args.eval_points, draft_vocab=args.draft_vocab, feature_loss=args.feature_loss,
                noise_std=args.noise_std, freeze_lm_head=args.freeze_lm_head, warm_start=args.warm_start,
                init_from=args.init_from, fc_norm=args.fc_norm, draft_intermediate=args.draft_intermediate,
                train_dtype=args.train_dtype)


def run_capture(args, store) -> int:
    if args.kinds is not None:
        raise DraftError("--kinds weights the conversations online training draws; training from a capture uses the "
                         "capture's own conversations", "Pass --model to train online, or leave --kinds out")
    if args.layers is not None and len(args.layers) > 1:
        raise DraftError("Several --layers sets train in one pass only online",
                         "Pass --model to train online, or run train-draft once per set")
    if (args.layers is None) == (args.strategy is None):
        raise DraftError("Give the layer set with --layers or --strategy (one of them)", "E.g. --layers 2,15,27")
    if args.strategy is not None:           # the strategy's statistics are work: check the destination first
        preflight.train_capture(store, args.key, [], args.draft_vocab, args.out)
    cap = open_capture(store, args.key)
    layers = parse_layers(args.layers[0]) if args.layers else workflow.layers_from_strategy(store, cap, args.strategy, args.k)
    options = TrainOptions(val_fraction=args.val_fraction, **recipe(args))
    if not args.json:
        print(f"training a draft on layers {layers} of {cap.manifest['model']} (capture {cap.key}, "
              f"{cap.num_tokens} tokens)", file=sys.stderr)
    with Progress("train-draft", unit="step") as bar:
        def on_progress(p: TrainProgress):          # one set: its loss, its step-1 agreement on the batch
            if p.steps is not None:
                bar.update(p.step, p.steps, eta_s=p.eta_s, loss=p.mean_loss, acc1=p.acc[0][0], tok_s=p.tokens_per_s)
            else:
                bar.update(round(100 * p.fraction), 100, eta_s=p.eta_s, step=p.step, loss=p.mean_loss,
                           acc1=p.acc[0][0], tok_s=p.tokens_per_s)
        trained = workflow.train(store, cap.key, layers, options, strategy=args.strategy, out=args.out,
                                 progress=on_progress, estimate=lambda f: bar.note(f.line()))
    meta = trained.meta
    result = {"out": str(trained.path), "layers": meta["layers"], "steps": meta["budget"]["resolved_steps"],
              "train_tokens": meta["train_tokens"], "seconds": meta["seconds"], "val_accuracy": meta["val_accuracy"],
              "simulated_acc_len": meta["simulated_acc_len"]}
    if args.json:
        print_json(result)
    else:
        acc = ", ".join(f"{a:.3f}" for a in result["val_accuracy"])
        print(f"draft on layers {result['layers']}: {result['steps']} steps over {result['train_tokens']} training "
              f"tokens in {result['seconds']:.1f} s; held-out agreement per TTT step (every position): {acc}; "
              f"{fmt.NAMES['simulated_acc_len']} {fmt.number(result['simulated_acc_len'])}")
        for note in meta.get("serving_notes", []):
            print(f"note: {note}")
        print(f"saved to {trained.path}")
    return 0


