"""What one change to the training does to the same layer sets: two outcome folders, paired draft by draft.

    pairs = pair_folders(OutcomeFolder("with"), OutcomeFolder("without"))   # same target, set, seed, benchmark
    rows = effect_rows(pairs)          # agreement and τ of each side, Δτ (b − a) with a paired interval
    print(format_effect(rows, a_name="no fc_norm", b_name="fc_norm"))

A study's outcome (layerscope.study.outcomes) names everything that decided it: the target, the layers, the
training seed, the training options and the benchmark (its prompts' content, new tokens, depth, device).
Two outcomes pair when all of that but the training options agree: the same draft trained two ways and
decoded greedily on the same prompts. Greedy decoding makes a prompt's τ a property of the draft, not of
the machine or the run, so the per-prompt τ of two benchmark runs pair as if they were one (speedup does
not: it is timed, so each side's speedup is read against its own run's plain decoding only).

The interval of Δτ is the study's paired bootstrap over prompts (layerscope.stats.paired.compare_sets);
it covers prompt sampling, not training noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerscope import fmt
from layerscope.stats.paired import compare_sets
from layerscope.study.outcomes import Outcome, OutcomeError, OutcomeFolder


@dataclass
class OutcomePair:
    """The same (target, layers, seed, benchmark) trained two ways."""
    layers: list[int]
    seed: int
    target: str
    a: Outcome
    b: Outcome
    differs: dict[str, tuple]         # training option -> (a's value, b's value); an absent option is None


def _training_options(identity: dict) -> dict:
    """Every training option of an outcome's identity, flattened (`online.fc_norm`, `prompts`, ...)."""
    out = {}

    def walk(prefix: str, d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out[f"{prefix}{k}"] = v
    walk("", identity.get("training") or {})
    return out


def pair_folders(a: OutcomeFolder, b: OutcomeFolder) -> list[OutcomePair]:
    """Every outcome of `a` that has a partner in `b` (same target, layers, seed and benchmark; training
    options differing), ordered as `a` lists them. An outcome in either folder without a partner is left out;
    none at all is one clear error."""
    def index(folder: OutcomeFolder) -> dict:
        out = {}
        for path, d in folder.listing():
            ident = d.get("identity") or {}
            match = (ident.get("target"), tuple(ident.get("layers") or ()), ident.get("seed"),
                     repr(sorted((ident.get("bench") or {}).items())))
            out.setdefault(match, []).append(d)
        return out

    ia, ib = index(a), index(b)
    pairs = []
    for match, docs in ia.items():
        if match not in ib:
            continue
        if len(docs) > 1 or len(ib[match]) > 1:
            raise OutcomeError(f"More than one outcome of layers {list(match[1])}, seed {match[2]} in "
                               f"{a.root if len(docs) > 1 else b.root}",
                               "Keep one training recipe per folder: move the others to a folder of their own")
        da, db = docs[0], ib[match][0]
        oa, ob = Outcome.from_json(da), Outcome.from_json(db)
        ta, tb = _training_options(da["identity"]), _training_options(db["identity"])
        differs = {k: (ta.get(k), tb.get(k)) for k in sorted(set(ta) | set(tb)) if ta.get(k) != tb.get(k)}
        pairs.append(OutcomePair(layers=list(match[1]), seed=int(match[2]), target=str(match[0]), a=oa, b=ob,
                                 differs=differs))
    if not pairs:
        raise OutcomeError(f"No outcome of {a.root} has a partner in {b.root}",
                           "Pair folders of the same target, layer sets, seeds and benchmark (prompts, new "
                           "tokens, depth), trained two ways")
    return pairs


def _agreement(o: Outcome) -> list[float]:
    return [float(x) for x in (o.meta.get("val_accuracy") or [])]


def effect_rows(pairs: list[OutcomePair]) -> list[dict]:
    """One row per pair: each side's held-out agreement (positions 1..), τ with its interval and speedup (vs its
    own run's plain decoding), and Δτ = τ(b) − τ(a) with its paired 95 % interval."""
    rows = []
    for p in pairs:
        (ra, rb), _ = compare_sets([[p.a.per_prompt], [p.b.per_prompt]], reference=0)
        rows.append({"layers": p.layers, "seed": p.seed, "target": p.target, "differs": p.differs,
                     "a": {"agreement": _agreement(p.a), "tau": ra["tau"], "tau_ci": ra["tau_ci"],
                           "speedup": p.a.result.get("speedup"), "tokens_seen": p.a.meta.get("tokens_seen")},
                     "b": {"agreement": _agreement(p.b), "tau": rb["tau"], "tau_ci": rb["tau_ci"],
                           "speedup": p.b.result.get("speedup"), "tokens_seen": p.b.meta.get("tokens_seen")},
                     "delta_tau": rb["delta_vs_default"], "delta_ci": rb["delta_ci"]})
    return rows


def format_effect(rows: list[dict], a_name: str = "a", b_name: str = "b") -> str:
    """The rows as a Markdown table: a row per side, the paired difference on b's row."""
    head = ("| set | seed | training | agreement pos. 1 / 2 / 3 | τ [95 %] | speedup (own run) | Δτ vs "
            f"{a_name} [paired 95 %] |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        for side, name in (("a", a_name), ("b", b_name)):
            s = r[side]
            agree = " / ".join(f"{x:.3f}" for x in s["agreement"][:3]) or "—"
            delta = "" if side == "a" else fmt.interval(r["delta_tau"], r["delta_ci"], "delta")
            lines.append(f"| {fmt.layers(r['layers'])} | {r['seed']} | {name} | {agree} | "
                         f"{fmt.interval(s['tau'], s['tau_ci'])} | {fmt.speedup(s['speedup'])} | {delta} |")
    differs = sorted({f"{k}: {v[0]} → {v[1]}" for r in rows for k, v in r["differs"].items()})
    lines.append("")
    lines.append("Training options that differ: " + ("; ".join(differs) if differs else "none"))
    return "\n".join(lines)
