"""The Markdown tables of docs/results.md from a study's report (`layerscope study ... --json`).

    .venv/bin/python benchmarks/study_tables.py ~/layerscope-store/logs/long-gemma3-study.json

Prints, in the form docs/results.md uses for every study:
- the sets: held-out agreement at position 1 (mean over seeds), the training-free probe's agreement, τ with its
  95 % interval, τ per seed, τ − default with its paired 95 % interval, speedup;
- the seed spread (the largest and smallest move of a set's τ between seeds);
- Spearman ρ of each proxy with τ: the study's own version (linear kernel, H ≥ 0.5) and each proxy's best;
- the verdict as the study printed it.
Nothing is computed here that the report does not hold: the numbers are the study's own (layerscope/study/run.py,
whose format_study prints the same report as plain text), in its interval format (fmt.ci).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerscope import fmt

STUDY_VERSION = "linear, H≥0.5"
PROXIES = (("mean_entropy", "mean entropy"), ("aggregate_entropy", "aggregate entropy"), ("mean_cka", "mean CKA"),
           ("probe", "probe (held-out agreement, training-free)"), ("val_accuracy@1", "val_accuracy@1 (the trained drafts' own)"))


def set_name(row: dict) -> str:
    return f"{'/'.join(row['strategies']) or 'manual'} {row['layers']}"


def study_table(report: dict) -> list[str]:
    lines = ["| set | agreement pos. 1 | probe | τ | 95 % CI | τ per seed | τ − default | 95 % CI | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        agreement = r["val_accuracy"][0] if isinstance(r["val_accuracy"], list) else r["val_accuracy"]
        probe = (r.get("probe") or {}).get("agreement")
        per_seed = " / ".join(f"{s['tau']:.3f}" for s in sorted(r["seeds"], key=lambda s: s["seed"]))
        delta = "0" if r["delta_vs_default"] == 0 else f"{r['delta_vs_default']:+.3f}"
        lines.append(f"| {set_name(r)} | {agreement:.3f} | {'—' if probe is None else f'{probe:.3f}'} | {r['tau']:.3f} | "
                     f"{fmt.ci(r['tau_ci'], 'tau')} | {per_seed} | {delta} | {fmt.ci(r['delta_ci'], 'delta')} | "
                     f"{r['speedup']:.2f}× |")
    return lines


def seed_spread(report: dict) -> str:
    moves = sorted((r["tau_seed_range"], set_name(r)) for r in report["rows"] if len(r["seeds"]) > 1)
    if not moves:
        return "One training seed: the seed spread is not measured."
    return (f"Seed spread: retraining with the other seed moves a set's τ by {moves[0][0]:.3f} ({moves[0][1]}) to "
            f"{moves[-1][0]:.3f} ({moves[-1][1]}).")


def proxy_table(report: dict) -> list[str]:
    by = {(c["proxy"], c["version"]): c for c in report["correlations"]}
    best = report.get("best_proxies", {})
    lines = [f"| proxy | {STUDY_VERSION} | best version |", "|---|---|---|"]

    def rho(c) -> str:
        return f"{c['rho']:+.2f} {fmt.ci(c['ci'], 'delta')}"     # as format_study prints it

    for name, label in PROXIES:
        own = by.get((name, STUDY_VERSION))
        b = best.get(name)
        if own is None and b is not None:          # a proxy with one version (probe, val_accuracy@1)
            lines.append(f"| {label} | {rho(b)} | — |")
        elif own is not None:
            other = "—" if b is None else f"{rho(b)} ({b['version']})"
            lines.append(f"| {label} | {rho(own)} | {other} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="a study's --json report")
    args = ap.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        rows = report["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.report} is not a study's --json report ({e}); pass the file `layerscope study ... "
              f"--json` wrote", file=sys.stderr)
        return 2
    print(f"{len(rows)} sets, {report.get('prompts')} prompts\n")
    print("\n".join(study_table(report)))
    print(f"\n{seed_spread(report)}\n")
    print("\n".join(proxy_table(report)))
    print(f"\nThe verdict as printed: *\"{report['verdict']}\"*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
