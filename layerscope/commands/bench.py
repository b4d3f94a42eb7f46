"""`layerscope bench`: speculative decoding with drafts vs plain decoding, HF generate and prompt lookup."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from layerscope import disk, quietness
from layerscope.commands.common import Progress, add_wait_quiet, machine_options, open_store, print_json
from layerscope.decoding import specdec
from layerscope.decoding.bench import BenchOptions, folder_names, format_table, parse_lookup
from layerscope.decoding.specdec import TreeSpec
from layerscope.draft import builtin
from layerscope.errors import LayerScopeError
from layerscope.steps import preflight, workflow
from layerscope.store import atomic_write_json

NAME = "bench"
HELP = ("decode the same prompts with each draft, plain decoding, HF generate, HF prompt lookup and (--assistant) "
        "HF assisted generation; "
        "report tau, acceptance per draft position, tokens/s, speedup and losslessness")


def add_arguments(p) -> None:
    d, t = BenchOptions(), TreeSpec()
    p.add_argument("--draft", action="append", default=[], metavar="DIR",
                   help="draft directory, store key (or a unique prefix of one), or `builtin` (the draft shipped for "
                        "the default model); repeat for several; none: only the baselines run")
    p.add_argument("--model", default=d.model,
                   help="target model spec (default: the one the first draft was trained for, else smollm2-135m)")
    p.add_argument("--prompts", default=d.prompts,
                   help="builtin | sharegpt | sharegpt-heldout | a .jsonl/.txt/.csv file (default %(default)s)")
    p.add_argument("--split", default=d.split, help="train | heldout (ShareGPT only)")
    p.add_argument("--limit", type=int, default=d.limit, help="prompts to run (a seeded sample; default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="default %(default)s")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="leave out longer prompts, taking the next of the sample instead (default %(default)s)")
    p.add_argument("--k", action="append", default=None,
                   help=f"chain draft depth; a list like 2,3,4,6 benchmarks each; `auto`: the depth with the best "
                        f"speedup predicted for this machine (repeatable; default {','.join(map(str, d.ks))})")
    p.add_argument("--tree", nargs="?", const="fixed", default=None, choices=["fixed", "auto"],
                   help="also decode each draft with an EAGLE-2 tree (the --tree-* shape); `--tree auto`: the "
                        "shape with the best speedup predicted for this machine")
    p.add_argument("--auto-even-if-slower", action="store_true",
                   help="with --k auto / --tree auto: run the pick even when it is predicted to lose to plain decoding "
                        "(by default auto then says so and decodes plainly)")
    p.add_argument("--tree-budget", type=int, default=t.budget, help="draft tokens verified per tree (default %(default)s)")
    p.add_argument("--tree-top-k", type=int, default=t.top_k, help="children per expanded node (default %(default)s)")
    p.add_argument("--tree-depth", type=int, default=t.depth, help="tree depth (default %(default)s)")
    p.add_argument("--no-peers", action="store_true", help="skip HF generate and HF prompt lookup")
    p.add_argument("--assistant", default=d.assistant, metavar="MODEL",
                   help="also transformers' assisted generation with this small model as assistant_model (contender "
                        "hf-assisted, the classic small-model draft), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; "
                        "its tokenizer must be the target's")
    p.add_argument("--prompt-lookup", type=int, default=d.lookup_tokens,
                   help="prompt_lookup_num_tokens for the HF peer (default %(default)s)")
    p.add_argument("--lookup", default=str(d.draft_lookup), metavar="N|N..M|auto",
                   help="also decode each draft's chain and tree (with --k/--tree auto: the chosen ones) with prompt lookup first: "
                        "where the context's last 3 or 2 tokens occurred before, up to N tokens that followed "
                        f"them are verified instead of the draft's; N..M: adaptive, N tokens first, "
                        f"{specdec.LOOKUP_GROW} more after a lookup accepted whole (up to M), {specdec.LOOKUP_SHRINK} "
                        "fewer after a rejection; `auto`: for each chain and the --tree auto tree the span "
                        "(fixed or adaptive) with the best speedup predicted for this machine, or none when none "
                        "beats the draft alone (default %(default)s: off; the app's fixed span is "
                        f"{specdec.DEFAULT_LOOKUP}, see `layerscope profile` for what a longer verify costs)")
    add_wait_quiet(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--save-json", default=None, metavar="FILE",
                   help="also write the JSON object to FILE (replaced whole), whatever is printed")


def parse_ks(text: str) -> tuple[int, ...]:
    """'2,3,4' -> (2, 3, 4); a clear error for anything else."""
    try:
        ks = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise LayerScopeError(f"--k {text!r} is not a list of positive integers", "Write it like --k 4 or --k 2,3,4")
    return ks


def parse_k_args(values: list[str] | None) -> tuple[tuple[int, ...], bool]:
    """The --k values ('1,2,3,4', 'auto', '2,auto', ...) -> (chain depths, auto)."""
    if not values:
        return BenchOptions().ks, False
    parts = [x.strip() for v in values for x in str(v).split(",") if x.strip()]
    auto = "auto" in parts
    rest = [x for x in parts if x != "auto"]
    ks = parse_ks(",".join(rest)) if rest else ()
    if not ks and not auto:
        raise LayerScopeError(f"--k {values!r} names no chain depth", "Write it like --k 4, --k 2,3,4 or --k auto")
    return ks, auto


def options_from_args(args) -> BenchOptions:
    trees = (TreeSpec(args.tree_budget, args.tree_top_k, args.tree_depth),) if args.tree == "fixed" else ()
    ks, auto_k = parse_k_args(args.k)
    draft_lookup, auto_lookup = parse_lookup(args.lookup)
    return BenchOptions(model=args.model, prompts=args.prompts, split=args.split, limit=args.limit, seed=args.seed,
                        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                        ks=tuple(dict.fromkeys(ks)), trees=trees, peers=not args.no_peers,
                        lookup_tokens=args.prompt_lookup, assistant=args.assistant, draft_lookup=draft_lookup,
                        auto_k=auto_k, auto_tree=args.tree == "auto",
                        auto_lookup=auto_lookup, auto_even_if_slower=args.auto_even_if_slower,
                        machine=machine_options(args))


def run(args) -> int:
    store = open_store(args)
    paths = [builtin.resolve(d, args.model, store) for d in args.draft]
    preflight.bench_drafts(paths)           # a missing or looping --draft: one line before the model loads
    if args.save_json:
        disk.directory_writable(Path(args.save_json).expanduser().parent)   # before the model loads
    options = options_from_args(args)
    shown = 0.0
    with Progress("bench", unit="run") as bar:
        def show(p):
            nonlocal shown
            if p.phase == "wait":
                bar.update(0, None, phase=p.message)
                return
            if p.phase == "cost curve":
                bar.update(0, None, eta_s=p.eta_s, phase=p.message)
                return
            if p.phase == "calibrate":
                bar.update(p.runs_done, p.runs_total, eta_s=p.eta_s, phase=p.message)
                return
            if p.event is None or time.monotonic() - shown > 0.5:    # every run's end, else twice a second
                shown = time.monotonic()
                bar.update(p.runs_done, p.runs_total, eta_s=p.eta_s, on=p.contender, prompt=p.prompt_index + 1,
                           tau=p.tau if p.tau is not None else "-",
                           tok_s=p.tokens_per_s if p.tokens_per_s is not None else "-")
        done = workflow.bench(list(zip(folder_names(args.draft), paths)), options, store, progress=show,
                              estimate=lambda f: bar.note(f.line()))
    if args.save_json:
        out = Path(args.save_json).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, done.report.to_json())
    for w in done.prompt_set.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        print_json(done.report.to_json())
        if not (done.report.machine or {}).get("quiet", True):
            print(quietness.line(done.report.machine), file=sys.stderr)
    else:
        print(f"prompt set {done.prompt_set.name} on {done.target.spec}")
        print(format_table(done.report))
    return 0
