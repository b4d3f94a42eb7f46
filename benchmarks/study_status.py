"""Where a long study stands: one line per finished (layer set, seed) in an outcomes folder (`study --outcomes`).

    .venv/bin/python benchmarks/study_status.py docs/study-500k/outcomes

Each line: the layers, the seed, the strategy that proposed them, tokens trained, held-out agreement at
positions 1..3, τ of the benchmark and its speedup over plain decoding in the same run, and the machine's state
during that run. Reads the files only: no model, no store.
"""

from __future__ import annotations

import argparse

from layerscope.study.outcomes import OutcomeFolder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    folder = OutcomeFolder(p.parse_args().folder)
    rows = folder.listing()
    print(f"{len(rows)} outcome(s) in {folder.root}")
    for path, d in rows:
        meta, result, machine = d["meta"], d["result"], d.get("machine") or {}
        acc = " / ".join(f"{a:.3f}" for a in meta.get("val_accuracy") or [])
        tps = result.get("tokens_per_s")
        base = (d.get("baseline") or {}).get("tokens_per_s")
        speed = f"{tps / base:.2f}x" if tps and base else "-"
        print(f"  {str(d['layers']):14s} seed {d['seed']}  {meta.get('strategy') or '-':13s} "
              f"{meta.get('tokens_seen', 0):>9,} tokens  agreement {acc}  tau {result.get('tau', float('nan')):.3f}  "
              f"{speed}  machine {machine.get('text', 'not measured')}  ({meta.get('saved', '')})")


if __name__ == "__main__":
    main()
