"""`layerscope capture`: run the target over a prompt set and store every layer's hidden states."""

from __future__ import annotations

from layerscope.commands.common import Progress, open_store, print_json

NAME = "capture"
HELP = "capture every layer's hidden states and token entropies for a model and prompt set"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny-llama | HF id | directory | .gguf file")
    p.add_argument("--prompts", default="builtin", help="builtin | sharegpt | sharegpt-heldout | .jsonl/.txt/.csv file")
    p.add_argument("--limit", type=int, default=None, help="number of conversations (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="response length cap per conversation")
    p.add_argument("--max-tokens", type=int, default=None, help="stop once this many tokens are recorded")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="prompt sampling and (with --temperature) response sampling")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses (default)")
    p.add_argument("--skip-long", action="store_true", help="leave out prompts longer than the model's context")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="leave out prompts longer than this many tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    from layerscope.capture import capture
    from layerscope.models import load_model
    from layerscope.prompts import load_prompts

    if args.limit is not None and args.limit < 1:
        from layerscope.errors import CaptureError
        raise CaptureError(f"--limit must be at least 1 (got {args.limit})", "Pass --limit 1 or more, or leave it out for all prompts")
    store = open_store(args)
    prompt_set = load_prompts(args.prompts, limit=args.limit, seed=args.seed)
    for w in prompt_set.warnings:
        print(f"warning: {w}", file=__import__("sys").stderr)
    loaded = load_model(args.model, store=store)
    with Progress("capture", unit="tok", enabled=True) as bar:
        def on_progress(p):
            phase = f"generate {p.generated}/{args.max_new_tokens}" if p.phase == "generate" else p.phase
            bar.update(p.tokens_done, None, phase=phase, conv=f"{p.conversations_done}/{p.conversations_total}",
                       tok_s=p.tokens_per_s)
        result = capture(loaded, prompt_set, store, progress=on_progress, limit=args.limit,
                         max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens,
                         batch_size=args.batch_size, seed=args.seed, temperature=args.temperature, skip_long=args.skip_long,
                         max_prompt_tokens=args.max_prompt_tokens)
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
