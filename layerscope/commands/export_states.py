"""`layerscope export-states`: a capture as speculators' offline training data for a chosen layer set."""

from __future__ import annotations

from layerscope import disk, fmt
from layerscope.capture.stored import resolve_capture_key
from layerscope.commands.common import Progress, open_store, parse_layers, print_json
from layerscope.steps import workflow

NAME = "export-states"
HELP = "write a capture as speculators' offline training data (hs_<i>.safetensors + data + token_freq.pt)"


def add_arguments(p) -> None:
    p.add_argument("capture", help="capture key (or a unique prefix)")
    p.add_argument("--format", default="speculators", choices=("speculators",), help="default %(default)s")
    p.add_argument("--layers", required=True, type=parse_layers,
                   help="the draft's layers, LayerScope ids = vLLM ids, e.g. 2,15,27 (the last layer is added)")
    p.add_argument("--out", required=True, help="a new folder to write")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    store = open_store(args)
    key = resolve_capture_key(store, args.capture)
    with Progress("export", unit="conv", enabled=True) as bar:
        summary = workflow.export_states(store, key, args.layers, args.out, progress=lambda d, t: bar.update(d, t))
    if args.json:
        print_json(summary | {"capture": key})
        return 0
    print(f"wrote {summary['conversations']} conversations, {summary['tokens']} tokens, {disk.mib(summary['bytes'])} "
          f"to {summary['path']}: layers {fmt.layers(summary['layers'])} + the last layer (vLLM id "
          f"{summary['last_layer_id']}, before the final norm)")
    print(f"train with: {summary['train_command']}")
    return 0
