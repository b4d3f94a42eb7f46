"""One training change's effect on the same layer sets: two study outcome folders, paired draft by draft.

    .venv/bin/python benchmarks/paired_outcomes.py docs/study-gemma3/outcomes-no-fc-norm docs/study-gemma3/outcomes \
        --names "no fc_norm,fc_norm" [--json]

Prints a Markdown table: for every (layer set, seed) held in both folders (same target, seed and benchmark),
each side's held-out agreement and τ with its interval, and Δτ (second − first) with its paired 95 % interval
over the benchmark's prompts (layerscope/study/effect.py). Issue 38.3 reads `fc_norm` this way on both models.
"""

from __future__ import annotations

import argparse
import json
import sys

from layerscope.errors import LayerScopeError
from layerscope.study.effect import effect_rows, format_effect, pair_folders
from layerscope.study.outcomes import OutcomeFolder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", help="outcome folder of the first training recipe (the reference)")
    ap.add_argument("second", help="outcome folder of the second recipe")
    ap.add_argument("--names", default="first,second", help="the two recipes' names in the table (a,b)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    args = ap.parse_args(argv)
    names = args.names.split(",")
    if len(names) != 2:
        ap.error("--names takes two names separated by a comma, e.g. 'no fc_norm,fc_norm'")
    try:
        rows = effect_rows(pair_folders(OutcomeFolder(args.first), OutcomeFolder(args.second)))
    except LayerScopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=1) if args.json else format_effect(rows, *names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
