"""`layerscope import-states`: an engine's hidden-state dump (speculators, SpecForge) as a LayerScope capture."""

from __future__ import annotations

import sys

from layerscope import disk
from layerscope.capture.engine_dumps import FORMATS
from layerscope.capture.import_states import ImportOptions
from layerscope.commands.common import Progress, open_store, print_json
from layerscope.steps import workflow

NAME = "import-states"
HELP = "store an engine's hidden-state dump (speculators' hs_<i>.safetensors, SpecForge's .ckpt) as a capture"


def add_arguments(p) -> None:
    d = ImportOptions()
    p.add_argument("directory", help="speculators: the prepare-data folder (its hidden_states/ holds hs_<i>.safetensors);"
                                     " specforge: prepare_hidden_states.py's --output-path")
    p.add_argument("--format", required=True, choices=FORMATS, help="which engine wrote the dump")
    p.add_argument("--model", required=True, help="the target the dump came from: alias | directory | HF id | .gguf "
                                                  "(only its embedding, final norm and lm_head are loaded)")
    p.add_argument("--layers", default=d.layers,
                   help="the layer ids exactly as the engine was given them (speculators: launch_vllm.py "
                        "--target-layer-ids, vLLM ids; specforge: --aux-hidden-states-layers, SGLang ids = "
                        "LayerScope's - 1), or 'all' (default %(default)s)")
    p.add_argument("--hidden-states", default=d.hidden_states,
                   help="speculators: the folder of hs_<i>.safetensors if not <directory>/hidden_states")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="conversations per chunk (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    options = ImportOptions(format=args.format, layers=args.layers, hidden_states=args.hidden_states,
                            batch_size=args.batch_size)
    with Progress("import", unit="tok", enabled=True) as bar:
        def on_progress(p):
            bar.update(p.tokens_done, None, phase=p.phase, samples=f"{p.conversations_done}/{p.conversations_total}",
                       tok_s=p.tokens_per_s)
        result = workflow.import_states(args.directory, args.model, options, open_store(args), progress=on_progress)
    m = result.manifest
    imported = m["imported"]
    if args.json:
        print_json({"key": result.key, "model": m["model"], "num_layers": m["num_layers"],
                    "hidden_size": m["hidden_size"], "conversations": m["conversations"], "tokens": result.tokens,
                    "bytes": sum(c["bytes"] for c in m["chunks"]), "cached": result.cached,
                    "seconds": round(result.seconds, 3), "path": str(result.path), "imported": imported})
        return 0
    source = "from the store" if result.cached else f"in {result.seconds:.1f} s"
    print(f"capture {result.key}: {m['conversations']} conversations, {result.tokens} tokens imported from "
          f"{imported['format']}, layers 0..{m['num_layers']} (d={m['hidden_size']}), "
          f"{disk.mib(sum(c['bytes'] for c in m['chunks']))}, {source}")
    ids = imported["layer_map"]
    print(f"layers: LayerScope l <- {imported['format']} id: " + ", ".join(f"{l}<-{e}" for l, e in ids.items()) +
          (f"; {m['num_layers']} = final norm of id {imported['prenorm_final_engine_id']}"
           if imported["prenorm_final_engine_id"] is not None else f"; {m['num_layers']} = the dump's hidden_state") +
          (f"; computed from the target: {imported['computed_layers']}" if imported["computed_layers"] else ""))
    skipped = imported.get("skipped_count", len(imported["skipped"]))
    if skipped:
        shown = "; ".join(f"{s['sample']}: {s['reason']}" for s in imported["skipped"][:10])
        listed = min(len(imported["skipped"]), 10)
        more = (f"; and {skipped - listed} more (--json lists the first {len(imported['skipped'])})"
                if skipped > listed else "")
        print(f"warning: {skipped} of {imported['samples']} samples skipped, not used ({shown}{more})", file=sys.stderr)
    print(f"stored at {result.path}")
    return 0
