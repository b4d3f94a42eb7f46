"""`layerscope capture`: run the target over a prompt set and store every layer's hidden states."""

from __future__ import annotations

import sys

from layerscope.capture.run import CaptureOptions
from layerscope.commands.common import Progress, open_store, print_json
from layerscope.steps import workflow
from layerscope.target.aliases import DEFAULT_MODEL
from layerscope.validate import parse_size

NAME = "capture"
HELP = "capture every layer's hidden states and token entropies for a model and prompt set"


def add_arguments(p) -> None:
    d = CaptureOptions()
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="smollm2-135m | tiny-llama | HF id | directory | .gguf file (default %(default)s)")
    p.add_argument("--prompts", default=workflow.DEFAULT_PROMPTS,
                   help="builtin | sharegpt | sharegpt-heldout | .jsonl/.txt/.csv file (default %(default)s)")
    p.add_argument("--limit", type=int, default=d.limit, help="number of conversations (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="response length cap per conversation (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="stop once this many tokens are recorded")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="default %(default)s")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt sampling and (with --temperature) response sampling")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy responses (default)")
    p.add_argument("--skip-long", action="store_true", default=d.skip_long,
                   help="leave out prompts longer than the model's context")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="leave out prompts longer than this many tokens")
    p.add_argument("--sample-positions", type=int, default=d.sample_positions, metavar="N",
                   help="keep a seeded sample of at most N token positions per conversation (never position 0): "
                        "for statistics only; training and the probe refuse such a capture (default: every position)")
    p.add_argument("--max-store-bytes", default=None, metavar="SIZE",
                   help="refuse the capture, before any forward, when its estimate is larger: 500M, 2G, 1.5GiB "
                        "(default: no budget; the free space is always checked)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    options = CaptureOptions(limit=args.limit, max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens,
                             batch_size=args.batch_size, seed=args.seed, temperature=args.temperature,
                             skip_long=args.skip_long, max_prompt_tokens=args.max_prompt_tokens,
                             sample_positions=args.sample_positions,
                             max_store_bytes=parse_size(args.max_store_bytes) if args.max_store_bytes else None)
    with Progress("capture", unit="tok", enabled=True) as bar:
        def on_progress(p):
            if p.estimate is not None:            # before the first batch: what it will write
                for line in p.estimate.lines():
                    bar.note(line)
                return
            phase = f"generate {p.generated}/{args.max_new_tokens}" if p.phase == "generate" else p.phase
            bar.update(p.tokens_done, None, phase=phase, conv=f"{p.conversations_done}/{p.conversations_total}",
                       tok_s=p.tokens_per_s, **({"eta_s": p.eta_s} if p.phase in ("generate", "record") else {}))
        done = workflow.capture(args.model, args.prompts, options, open_store(args), progress=on_progress,
                                estimate=lambda f: bar.note(f.line()))
    result, loaded = done.result, done.target
    for w in done.prompt_set.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        print_json({"key": result.key, "model": loaded.spec, "num_layers": loaded.num_layers,
                    "hidden_size": loaded.hidden_size, "prompts": result.manifest["conversations"],
                    "tokens": result.tokens, "sample_positions": result.manifest.get("sample_positions"),
                    "cached": result.cached, "seconds": round(result.seconds, 3),
                    "path": str(result.path)})
    else:
        source = "from the store" if result.cached else f"in {result.seconds:.1f} s"
        sample = result.manifest.get("sample_positions")
        sampled = f" (a sample of at most {sample} positions per conversation)" if sample is not None else ""
        print(f"capture {result.key}: {result.manifest['conversations']} conversations, {result.tokens} tokens{sampled}, "
              f"layers 0..{loaded.num_layers} (d={loaded.hidden_size}), {source}")
        print(f"stored at {result.path}")
    return 0
