"""`layerscope export`: package a draft for one engine (vLLM, SGLang, SpecForge, speculators) with COMMANDS.md."""

from __future__ import annotations

from pathlib import Path

from layerscope.commands.common import open_store, print_json
from layerscope.draft import builtin, engines
from layerscope.draft.checkpoint import read_layers_record, recorded_facts
from layerscope.draft.export.engine_export import export_draft
from layerscope.errors import DraftError
from layerscope.steps import preflight
from layerscope.target.load import load_model

NAME = "export"
HELP = ("write a draft the way one engine takes it (sglang | vllm | specforge | speculators), with the layer ids in "
        "its convention, the target's dtype and COMMANDS.md to train at scale, serve and benchmark there")


def add_arguments(p) -> None:
    p.add_argument("draft", help="draft directory, the key of a draft in the store (drafts/<key>), or `builtin` (the draft "
                                       "shipped for the default model)")
    p.add_argument("--for", dest="engine", required=True, choices=engines.ENGINES, help="the engine to export for")
    p.add_argument("--out", required=True, help="directory to write (replaced whole; the old one stays until the new is complete)")
    p.add_argument("--target", default=None,
                   help="the target model spec (as for capture); default: the target facts recorded in layers.json "
                        "(and for speculators, whose export carries the target's embedding, the model layerscope.json names)")
    p.add_argument("--target-path", default=None,
                   help="how the export names the target (speculators' verifier, COMMANDS.md); default: an alias's "
                        "Hugging Face id, a local folder relative to --out when they share a parent, else as given")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the target's dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def resolve_draft(spec: str, args) -> Path:
    """A draft directory from a path, a store key or `builtin` (the draft shipped for --target, else the default model)."""
    path = builtin.resolve(spec, args.target, open_store(args))
    if path.is_dir():
        return path
    raise DraftError(f"{spec} is neither a draft directory nor a draft in the store",
                     "Give the directory `layerscope train-draft --out` wrote")


def target_of(args, draft: Path):
    """(TargetFacts, the loaded target or None) from --target, else from layers.json."""
    if args.target is None:
        facts = recorded_facts(draft)
        if facts is None:
            raise DraftError(f"{draft}/layers.json does not record the target's family, depth and dtype",
                             "Pass --target MODEL (the model the draft was trained for)")
        return facts, None
    target = load_model(args.target, store=open_store(args))
    return engines.target_facts(target), target


def run(args) -> int:
    draft = resolve_draft(args.draft, args)
    preflight.draft_dir(draft)              # before a --target model loads
    preflight.output(args.out)
    facts, target = target_of(args, draft)
    store = open_store(args) if args.engine == "speculators" and target is None else None
    out = export_draft(draft, args.engine, args.out, facts, dtype=args.dtype, target_path=args.target_path,
                       target=target, store=store)
    record = read_layers_record(out)
    result = {"out": str(out), "engine": args.engine, "layers": record.get("hf_hidden_states"),
              "vllm_speculators_ids": record.get("vllm_speculators_ids"),
              "sglang_specforge_ids": record.get("sglang_specforge_ids"), "target": facts.to_dict(),
              "files": sorted(p.name for p in out.iterdir())}
    if args.json:
        print_json(result)
    else:
        print(f"exported layers {result['layers']} for {args.engine} to {out} "
              f"(vLLM/speculators ids {result['vllm_speculators_ids']}, SGLang/SpecForge ids "
              f"{result['sglang_specforge_ids']}; {facts.model_type} target, {facts.num_layers} layers)")
        print(f"files: {', '.join(result['files'])}; commands in {out}/COMMANDS.md")
    return 0
