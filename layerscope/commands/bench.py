"""`layerscope bench`: speculative decoding with drafts vs plain decoding, HF generate and prompt lookup."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from layerscope.commands.common import Progress, open_store, print_json

NAME = "bench"
HELP = ("decode the same prompts with each draft, plain decoding, HF generate and HF prompt lookup; "
        "report tau, acceptance per draft position, tokens/s, speedup and losslessness")


def add_arguments(p) -> None:
    from layerscope import bench
    from layerscope.specdec import DEFAULT_K, TreeSpec

    p.add_argument("--draft", action="append", default=[], metavar="DIR",
                   help="draft directory (repeat for several); none: only the baselines run")
    p.add_argument("--model", default=None,
                   help="target model spec (default: the one the first draft was trained for, else smollm2-135m)")
    p.add_argument("--prompts", default="sharegpt-heldout",
                   help="builtin | sharegpt | sharegpt-heldout | a .jsonl/.txt/.csv file (default sharegpt-heldout)")
    p.add_argument("--split", default=None, help="train | heldout (ShareGPT only)")
    p.add_argument("--limit", type=int, default=20, help="prompts to run (a seeded sample; default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=bench.MAX_PROMPT_TOKENS,
                   help="leave out longer prompts, taking the next of the sample instead (default %(default)s)")
    p.add_argument("--k", default=str(DEFAULT_K),
                   help=f"chain draft depth; a list like 2,3,4,6 benchmarks each (default {DEFAULT_K})")
    p.add_argument("--tree", action="store_true", help="also decode each draft with an EAGLE-2 tree")
    p.add_argument("--tree-budget", type=int, default=TreeSpec.budget, help="draft tokens verified per tree (default %(default)s)")
    p.add_argument("--tree-top-k", type=int, default=TreeSpec.top_k, help="children per expanded node (default %(default)s)")
    p.add_argument("--tree-depth", type=int, default=TreeSpec.depth, help="tree depth (default %(default)s)")
    p.add_argument("--no-peers", action="store_true", help="skip HF generate and HF prompt lookup")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens for the HF peer")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args) -> int:
    from layerscope import bench
    from layerscope.draft.export import load_draft, read_meta
    from layerscope.errors import LayerScopeError
    from layerscope.models import load_model
    from layerscope.prompts import load_fitting_prompts
    from layerscope.specdec import TreeSpec

    try:
        ks = [int(x) for x in str(args.k).split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise LayerScopeError(f"--k {args.k!r} is not a list of positive integers", "Write it like --k 4 or --k 2,3,4")
    if args.max_new_tokens < 1:
        raise LayerScopeError("--max-new-tokens must be at least 1", "")
    store = open_store(args)
    spec = args.model or (read_meta(args.draft[0]).get("target_model") if args.draft else None) or "smollm2-135m"
    target = load_model(spec, store=store)
    names = _names(args.draft)
    drafts = [(name, load_draft(path, target)) for name, path in zip(names, args.draft)]
    prompt_set = load_fitting_prompts(args.prompts, target.tokenizer, limit=args.limit, seed=args.seed,
                                      max_tokens=args.max_prompt_tokens,
                                      **({"split": args.split} if args.split else {}))
    prompts = bench.encode(target.tokenizer, prompt_set)
    trees = [TreeSpec(args.tree_budget, args.tree_top_k, args.tree_depth)] if args.tree else []
    lineup = bench.build_contenders(drafts, ks=ks, trees=trees, peers=not args.no_peers,
                                    lookup_tokens=args.prompt_lookup)
    eos = target.model.generation_config.eos_token_id
    eos = eos if eos is not None else target.tokenizer.eos_token_id
    pad = target.tokenizer.pad_token_id
    for w in prompt_set.warnings:
        print(f"warning: {w}", file=sys.stderr)
    report, shown = None, 0.0
    with Progress("bench", unit="run") as bar:
        for p in bench.run(target.model, prompts, lineup, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                           pad_token_id=pad if pad is not None else (eos if isinstance(eos, int) else None)):
            if p.report is not None:
                report = p.report
            elif p.event is None or time.monotonic() - shown > 0.5:    # every run's end, else twice a second
                shown = time.monotonic()
                bar.update(p.runs_done, p.runs_total, on=p.contender, prompt=p.prompt_index + 1,
                           tau=p.tau if p.tau is not None else "-",
                           tok_s=p.tokens_per_s if p.tokens_per_s is not None else "-")
    if args.json:
        print_json(report.to_json())
    else:
        print(f"prompt set {prompt_set.name} on {target.spec}")
        print(bench.format_table(report))
    return 0


def _names(paths: list[str]) -> list[str]:
    """Contender names for draft directories: their folder names, numbered where two are alike."""
    names = [Path(p).resolve().name or "draft" for p in paths]
    return [f"{n}#{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]
