"""A model's statistics and probe as Markdown tables for docs/results.md, from the JSON that `layerscope analyze`,
`select --compare` and `probe` print (benchmarks/long_run.sh qwen-stats keeps them in docs/study-qwen15/stats/).

    .venv/bin/python benchmarks/stats_tables.py docs/study-qwen15/stats qwen2.5-coder-1.5b
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, model: str, step: str):
    path = folder / f"{model}-{step}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> None:
    folder, model = Path(sys.argv[1]), sys.argv[2]
    a, s, p, ps = (load(folder, model, step) for step in ("analyze", "select", "probe", "probe-sets"))
    if a:
        print(f"**{model}**: capture `{a['capture_key']}`, {a['num_layers']} layers, d={a['hidden_size']}, "
              f"{a['tokens_kept']:,} of {a['tokens_total']:,} tokens kept (entropy filter {a['threshold']} nats), "
              f"kernel {a['kernel']}; compartments (CKA blocks) {', '.join(f'{x}-{y}' for x, y in a['compartments'])}")
        print()
        print("| states | " + " | ".join(str(i) for i in range(len(a["entropy"]))) + " |")
        print("|---|" + "---:|" * len(a["entropy"]))
        print("| entropy (nats) | " + " | ".join(f"{x:.2f}" for x in a["entropy"]) + " |")
        print()
    if s:
        probed = {tuple(x["layers"]): x for x in (p or {}).get("sets", []) + (ps or {}).get("sets", [])}
        print("| strategy | layers | aggregate entropy | mean CKA | probe agreement [95 %] |")
        print("|---|---|---:|---:|---|")
        for row in s:
            e = row["explanation"]
            q = probed.get(tuple(row["layers"]))
            ci = f"{q['agreement']:.3f} [{q['agreement_ci'][0]:.3f}, {q['agreement_ci'][1]:.3f}]" if q and q.get("agreement_ci") else "-"
            print(f"| {row['strategy']} | {row['layers']} | {e['aggregate_entropy']:.3f} | {e['mean_cka']:.3f} | {ci} |")
        print()
    if p:
        c, pos = p["conversations"], p["positions"]
        print(f"Probe ({p.get('search', {}).get('method', 'sets')} search, k={p.get('search', {}).get('k', '-')}, "
              f"objective {p.get('search', {}).get('objective', '-')}): fit {c['fit']} conversations ({pos['fit']:,} "
              f"positions), held out {c['held_out']} ({pos['held_out']:,}); {p['scored']} sets scored in {p['seconds']:.0f} s")
        print()
        print("| rank | layers | held-out agreement [95 %] | validation loss | source |")
        print("|---:|---|---|---:|---|")
        for i, x in enumerate(p["sets"], start=1):
            ci = x.get("agreement_ci") or [float("nan")] * 2
            print(f"| {i} | {x['layers']} | {x['agreement']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | {x['val_loss']:.4f} | "
                  f"{x.get('source', '')} |")


if __name__ == "__main__":
    main()
