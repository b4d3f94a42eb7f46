"""Learning curves and the budget they predict: held-out agreement at positions 1..3 and simulated_acc_len
against tokens seen, a power law fitted per position (draft/training/learning_curve.py), and the tokens at which
each set's chain is predicted to reach each τ.

    .venv/bin/python benchmarks/learning_curve.py $LAYERSCOPE_STORE/runs/<key> --names default,aggregate,probe,random
    .venv/bin/python benchmarks/learning_curve.py docs/study-gemma3/outcomes --holdout 2
    .venv/bin/python benchmarks/learning_curve.py $LAYERSCOPE_STORE/drafts/<key>

PATH is an online run (runs/<key>: its newest checkpoint's curves while it trains, its result.json once done, one
per set), a study's
outcomes folder (one curve per finished set and seed) or a draft folder (layerscope.json). --holdout K fits on all
but the last K points of each curve and prints what the fit said of them beside what was measured: how far the
forecast can be trusted. Reads files only: no model, no store.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerscope.draft.training import learning_curve as lc
from layerscope.draft.training.checkpoints import complete_checkpoints
from layerscope.draft.training.loss import simulated_acc_len


def curves_of(path: Path, names: list[str]) -> list[tuple[str, list, float]]:
    """[(label, [(tokens, [agreement per position]), ...], coverage)] of every curve PATH holds."""
    ckpts = complete_checkpoints(path)
    if ckpts:
        state = json.loads((ckpts[-1] / "state.json").read_text())
        out = []
        for i, pts in enumerate(state["curves"]):
            label = names[i] if i < len(names) else f"set {i + 1}"
            out.append((label, [(p[0], p[1]) for p in pts], pts[-1][2] if pts else 1.0))
        return out
    if (path / "result.json").is_file():       # a finished online run: one draft per set, each with its curve
        drafts = json.loads((path / "result.json").read_text())["drafts"]
        return [(names[i] if i < len(names) else f"set {i + 1}", [(p[0], p[1]) for p in d.get("curve") or []],
                 d.get("val_coverage") or 1.0) for i, d in enumerate(drafts)]
    files = [path / "layerscope.json"] if (path / "layerscope.json").is_file() else sorted(path.glob("*.json"))
    if not files:
        raise SystemExit(f"{path}: no checkpoint (ckpt-*), finished run (result.json), outcome (*.json) or draft "
                         "(layerscope.json) there")
    out = []
    for f in files:
        d = json.loads(f.read_text())
        meta = d.get("meta", d)
        label = f"{meta.get('layers')} seed {meta.get('seed')} {meta.get('strategy') or ''}".rstrip()
        out.append((label, [(p[0], p[1]) for p in meta.get("curve") or []], meta.get("val_coverage") or 1.0))
    return out


def tokens_text(n: float | None) -> str:
    if n is None:
        return "never (capped by the coverage)"
    if n >= 1e12:                        # far beyond any training budget: the fit says no more than "never"
        return "beyond 1T (out of reach)"
    if n >= 1e9:
        return f"{n / 1e9:,.1f}B"
    return f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n / 1e3:,.0f}k"


def report(label: str, points: list, coverage: float, taus: list[float], holdout: int) -> None:
    print(f"\n## {label}  (held-out coverage {coverage:.3f}: the ceiling of every position's agreement)")
    print("   tokens | agreement 1 / 2 / 3     | simulated_acc_len")
    for n, acc in points:
        print(f"{n:>9,} | {' / '.join(f'{a:.3f}' for a in acc):23s} | {simulated_acc_len(acc):.3f}")
    fitted = points[:len(points) - holdout] if holdout else points
    positions = len(points[0][1]) if points else 0
    fits = [lc.fit_power_law([(n, acc[j]) for n, acc in fitted], ceiling=coverage) for j in range(positions)]
    if not fits or any(f is None for f in fits):
        print(f"no forecast: {len(fitted)} point(s) fitted, and a power law needs two with learning at every position")
        return
    print("fit per position (coverage - c * tokens^-b): "
          + ", ".join(f"b {f.b:.3f} c {f.c:.3g} rms(log) {f.rms_log:.3f}" for f in fits))
    for n, acc in points[len(points) - holdout:] if holdout else []:
        said = [f.agreement(n) for f in fits]
        print(f"  held back {n:,}: fit {' / '.join(f'{a:.3f}' for a in said)} (simulated_acc_len "
              f"{simulated_acc_len(said):.3f}), measured {' / '.join(f'{a:.3f}' for a in acc)} "
              f"({simulated_acc_len(acc):.3f})")
    for tau in taus:
        print(f"  chain τ {tau:g} (1 + simulated_acc_len over {positions} positions): "
              f"{tokens_text(lc.tokens_for_tau(fits, tau))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path)
    p.add_argument("--names", default="", help="labels of a run's sets, in its order (comma-separated)")
    p.add_argument("--tau", default="1.5,2,2.5", help="the τ goals to forecast a budget for (comma-separated)")
    p.add_argument("--holdout", type=int, default=0, help="fit without each curve's last K points, and show them")
    a = p.parse_args()
    names = [s for s in a.names.split(",") if s]
    for label, points, coverage in curves_of(a.path, names):
        report(label, points, coverage, [float(t) for t in a.tau.split(",") if t], a.holdout)


if __name__ == "__main__":
    main()
