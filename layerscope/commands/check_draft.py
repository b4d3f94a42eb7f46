"""`layerscope check-draft`: which layers each engine would actually read from a draft directory."""

from __future__ import annotations

from layerscope.commands.common import open_store, print_json
from layerscope.draft import engines
from layerscope.draft.export.check import check_draft
from layerscope.errors import DraftError
from layerscope.steps import preflight
from layerscope.target.load import load_model

NAME = "check-draft"
HELP = ("report which layers vLLM, SGLang, SpecForge and speculators would read from a draft directory for a "
        "target, and fail when that is not the set the draft was trained on; for a speculators directory also "
        "whether its verifier resolves from here and whether it carries the target's embedding")


def add_arguments(p) -> None:
    p.add_argument("directory", help="a draft directory (train-draft --out, or layerscope export --out)")
    p.add_argument("--target", required=True, help="the target model spec the draft is served with")
    p.add_argument("--for", dest="engines", action="append", choices=engines.ENGINES, default=None,
                   help="engines that must read the trained set (repeatable; default: the engine the directory was "
                        "exported for, else every engine that loads this directory as it is)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    preflight.draft_dir(args.directory, agree=False)    # before the model loads; disagreements are this command's to show
    target = load_model(args.target, store=open_store(args))
    report = check_draft(args.directory, engines.target_facts(target), only=args.engines)
    if args.json:
        print_json(report)
    else:
        t = report["target"]
        print(f"{report['directory']}: trained on layers {report['trained']} (hidden_states indices); target "
              f"{args.target} ({t['model_type']}, {t['num_layers']} layers)")
        for r in report["rows"]:
            mark = ("ok  " if r["ok"] else "FAIL") if r["checked"] else "info"
            print(f"  {mark} {r['engine']:<12} reads {str(r['reads']):<16} from {r['source']}: {r['status']}")
            if "library_reads" in r:
                print(f"       {'':<12} (that is vLLM's reading; speculators' own from_pretrained reads "
                      f"{r['library_reads']} from {r['library_source']})")
            if r["checked"]:
                for note in r["notes"]:
                    print(f"       {'':<12} {note}")
        norm = report["fc_norm"]
        if norm["config"] is not None:
            print(f"  info fc_norm      {'on' if norm['config'] else 'off'} in config.json ({norm['weights']} "
                  f"fc_norm weights in model.safetensors)")
        spec = report.get("speculators")
        if spec and not spec["verifier_problem"]:
            print(f"  info verifier     `{spec['verifier']}` resolves from here")
        for w in report.get("warnings", []):
            print(f"  warn {w}")
    if report["weights"]:
        raise DraftError(f"{report['directory']} does not load: " + "; ".join(report["weights"]),
                         "Its weights are damaged or not those its config.json describes; train or export the draft again")
    if not report["ok"]:
        raise DraftError(f"Engines would not read the trained layers {report['trained']}: "
                         + "; ".join(report["problems"]),
                         "Export the draft for that engine with `layerscope export DRAFT --for ENGINE` "
                         "and do not edit the ids in its config.json")
    return 0
