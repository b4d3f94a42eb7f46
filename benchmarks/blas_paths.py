"""Which MKL code path makes a verify cheap on this machine: the cost curve under each MKL_CBWR setting.

    .venv/bin/python benchmarks/blas_paths.py [--model smollm2-135m] [--max-tokens 8] [--repeats 3]
                                               [--settings default,AUTO,COMPATIBLE,AVX2] [--rounds 2]

MKL reads MKL_CBWR once per process, so every setting is measured in its own process: `layerscope profile
--fresh --json` with LAYERSCOPE_BLAS=default (LayerScope leaves MKL alone) and MKL_CBWR set or not. The
settings alternate for `--rounds` rounds so a drift of the machine touches all alike; each row reports the
median over rounds. Run it alone on the machine (each profile also checks and prints the machine state).
Prints per setting: a 1-token forward's seconds, the 2-, 4- and 8-token forwards as multiples of it, and
the break-even tau of a K=1 chain. The setting LayerScope uses is `layerscope.blas.CHOICE`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def profile(setting: str, args) -> dict:
    env = dict(os.environ, LAYERSCOPE_BLAS="default")
    env.pop("MKL_CBWR", None)
    if setting != "default":
        env["MKL_CBWR"] = setting
    cmd = [sys.executable, "-m", "layerscope", "profile", "--model", args.model, "--fresh", "--json",
           "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settings", default="default,AUTO,COMPATIBLE,AVX2")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(a.rounds):
        for s in settings:
            print(f"round {r + 1}/{a.rounds}: MKL_CBWR={s} ...", file=sys.stderr, flush=True)
            runs[s].append(profile(s, a))
    print(f"{a.model}, {a.rounds} rounds, median per setting")
    print(f"{'MKL_CBWR':<12} {'T=1 s':>7} {'T=2':>6} {'T=4':>6} {'T=8':>6} {'break-even K=1':>15}  machine")
    for s in settings:
        def med(f):
            return statistics.median(f(doc) for doc in runs[s])

        def at(doc, T):
            return doc["cost_curve"][min(T, len(doc["cost_curve"])) - 1]["seconds"]

        t1 = med(lambda d: at(d, 1))
        ratios = [med(lambda d, T=T: at(d, T) / at(d, 1)) for T in (2, 4, 8)]
        tau = med(lambda d: d["break_even_tau_by_decoding"]["chain k=1"])
        quiet = all(d["machine"]["quiet"] for d in runs[s])
        print(f"{s:<12} {t1:>7.4f} " + " ".join(f"{x:>5.2f}x" for x in ratios)
              + f" {tau:>15.2f}  {'quiet' if quiet else 'BUSY'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
