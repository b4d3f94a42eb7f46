"""`layerscope train-draft`: train an EAGLE-3 draft on a stored capture for one layer set."""

from __future__ import annotations

import sys

from layerscope.commands.common import Progress, open_store, parse_layers, print_json

NAME = "train-draft"
HELP = "train an EAGLE-3 draft head reading a layer set, from a stored capture; save it for vLLM/SGLang"


def add_arguments(p) -> None:
    p.add_argument("key", help="capture key (or a unique prefix); see `layerscope captures`")
    p.add_argument("--layers", default=None, help="layer set, e.g. 2,15,27 (hidden_states indices 0..N-1)")
    p.add_argument("--strategy", default=None,
                   help="take the set from selection instead: default | entropy-topk | greedy | aggregate | spread")
    p.add_argument("--k", type=int, default=3, help="layers to select with --strategy")
    p.add_argument("--steps", type=int, default=None, help="training budget in optimizer steps (default 2000 on a GPU, 300 on a CPU, where 300 steps take 20-25 min)")
    p.add_argument("--tokens", type=int, default=None, help="training budget in sequence tokens instead of steps")
    p.add_argument("--out", default=None, help="draft directory to write (default: the store, drafts/<key>)")
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps in training (1..7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most frequent response tokens)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out conversations for validation")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def layers_from_strategy(cap, store, strategy: str, k: int) -> list[int]:
    from layerscope import select
    from layerscope.errors import SelectionError

    if strategy == "default":
        return select.default_layers(cap.num_layers)[0]
    try:
        from layerscope.analysis import analyze
    except ModuleNotFoundError as e:
        if e.name != "layerscope.analysis":
            raise
        raise SelectionError(f"--strategy {strategy} needs the layer statistics (layerscope.analysis), which this "
                             "checkout does not have", "Pass --layers, or --strategy default") from None
    return select.select(analyze(cap, store), strategy, k).layers


def run(args) -> int:
    from layerscope.draft.export import save_draft
    from layerscope.draft.train import draft_for, draft_meta, target_weights, train_draft
    from layerscope.errors import DraftError
    from layerscope.models import load_model
    from layerscope.select import check_layers

    if (args.layers is None) == (args.strategy is None):
        raise DraftError("Give the layer set with --layers or --strategy (one of them)", "E.g. --layers 2,15,27")
    store = open_store(args)
    cap = store.open_capture(args.key)
    if args.layers is not None:
        layers = check_layers(parse_layers(args.layers), cap.num_layers)
    else:
        layers = layers_from_strategy(cap, store, args.strategy, args.k)
    target = load_model(cap.manifest["model"], store=store)
    if target.fingerprint != cap.manifest.get("fingerprint", target.fingerprint):
        raise DraftError(f"Model {cap.manifest['model']} now loads with fingerprint {target.fingerprint}, but capture "
                         f"{cap.key} was made with {cap.manifest['fingerprint']}", "Capture again with the current model")
    default_steps = 300 if target.device.type == "cpu" else 2000
    options = dict(steps=args.steps if args.steps is not None or args.tokens is not None else default_steps, tokens=args.tokens,
                   ttt_steps=args.ttt_steps, seed=args.seed, lr=args.lr, batch_size=args.batch_size,
                   seq_len=args.seq_len, draft_vocab=args.draft_vocab, val_fraction=args.val_fraction)
    if not args.json:
        print(f"training a draft on layers {layers} of {cap.manifest['model']} (capture {cap.key}, "
              f"{cap.num_tokens} tokens)", file=sys.stderr)
    with Progress("train-draft", unit="step") as bar:
        def on_progress(p):
            bar.update(p["step"], p["steps"], loss=p["loss"], acc1=p["acc"][0], tok_s=p["tokens_per_s"])
        if args.out is None:
            out = draft_for(cap, layers, target, store, strategy=args.strategy, progress=on_progress, **options)
        else:
            config, embed, lm_head = target_weights(target)
            head, report = train_draft(cap, layers, config, embed, lm_head, progress=on_progress, **options)
            out = save_draft(args.out, head, draft_meta(report, cap, target.fingerprint, target.spec, args.strategy))
    from layerscope.draft.export import read_meta

    meta = read_meta(out)
    result = {"out": str(out), "layers": meta["layers"], "steps": meta["budget"]["resolved_steps"],
              "train_tokens": meta["train_tokens"], "seconds": meta["seconds"], "val_accuracy": meta["val_accuracy"]}
    if args.json:
        print_json(result)
    else:
        acc = ", ".join(f"{a:.3f}" for a in result["val_accuracy"])
        print(f"draft on layers {result['layers']}: {result['steps']} steps over {result['train_tokens']} training "
              f"tokens in {result['seconds']:.1f} s; validation top-1 agreement per TTT step: {acc}")
        for note in meta.get("serving_notes", []):
            print(f"note: {note}")
        print(f"saved to {out}")
    return 0
