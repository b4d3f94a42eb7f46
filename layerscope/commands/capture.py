"""`layerscope capture`: run the target over a prompt set and store every layer's hidden states."""

from __future__ import annotations

import sys

from layerscope import workflow
from layerscope.capture.run import CaptureOptions
from layerscope.commands.common import Progress, open_store, print_json
from layerscope.models import DEFAULT_MODEL

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
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    options = CaptureOptions(limit=args.limit, max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens,
                             batch_size=args.batch_size, seed=args.seed, temperature=args.temperature,
                             skip_long=args.skip_long, max_prompt_tokens=args.max_prompt_tokens)
    with Progress("capture", unit="tok", enabled=True) as bar:
        def on_progress(p):
            phase = f"generate {p.generated}/{args.max_new_tokens}" if p.phase == "generate" else p.phase
            bar.update(p.tokens_done, None, phase=phase, conv=f"{p.conversations_done}/{p.conversations_total}",
                       tok_s=p.tokens_per_s)
        done = workflow.capture(args.model, args.prompts, options, open_store(args), progress=on_progress)
    result, loaded = done.result, done.target
    for w in done.prompt_set.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        print_json({"key": result.key, "model": loaded.spec, "num_layers": loaded.num_layers,
                    "hidden_size": loaded.hidden_size, "prompts": result.manifest["conversations"],
                    "tokens": result.tokens, "cached": result.cached, "seconds": round(result.seconds, 3),
                    "path": str(result.path)})
    else:
        source = "from the store" if result.cached else f"in {result.seconds:.1f} s"
        print(f"capture {result.key}: {result.manifest['conversations']} conversations, {result.tokens} tokens, "
              f"layers 0..{loaded.num_layers} (d={loaded.hidden_size}), {source}")
        print(f"stored at {result.path}")
    return 0
