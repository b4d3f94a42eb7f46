"""The Layer sets page's decision: every set ranked on one comparable scale, one set recommended and why.

The scale is the α = 2 aggregate entropy of the set's layers taken together (`select.score_set`,
nats): the only score every strategy's set, the default rule's and a hand-picked one share. Mean
entropy, the mRMR value and compartment cohesion are each strategy's own objective and are not
comparable across strategies, so they never enter the ranking. No Streamlit here: plain data in, out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCORE = "aggregate_entropy"


@dataclass
class Ranked:
    rank: int                 # 1 = highest aggregate entropy (ties share the lower layer indices' order)
    name: str                 # strategy or the hand-picked set's name
    layers: list[int]
    aggregate_entropy: float  # nats, the ranking score
    mean_entropy: float
    mean_cka: float
    flags: list[str] = field(default_factory=list)


@dataclass
class Recommendation:
    ranked: list[Ranked]
    best: Ranked
    default_rank: int | None  # where the default rule [2, N//2, N-3] stands, 1-based
    text: str                 # two sentences: which set and why


def flags(layers, num_layers: int) -> list[str]:
    """Warnings about a set's layers: the embedding output (layer 0) and the final state (layer N)."""
    out = []
    if 0 in layers:
        out.append("reads layer 0, the embedding output: token identity only, which the draft already gets "
                   "from its own input embedding")
    if num_layers in layers:
        out.append(f"reads layer {num_layers}, the final state after the norm: drafts read layers 0..{num_layers - 1}")
    return out


def rank(selections, num_layers: int, names: dict[str, str] | None = None) -> list[Ranked]:
    """Selections (select.compare output) ranked by aggregate entropy, highest first; one row per distinct set,
    named after the first strategy that proposes it (the others are listed in its name)."""
    names = names or {}
    merged: dict[tuple, Ranked] = {}
    for x in selections:
        e = x.explanation
        label = names.get(x.strategy, x.strategy)
        key = tuple(x.layers)
        if key in merged:
            merged[key].name += f" = {label}"
            continue
        merged[key] = Ranked(0, label, list(x.layers), float(e[SCORE]), float(e["mean_entropy"]), float(e["mean_cka"]),
                             flags(x.layers, num_layers))
    out = sorted(merged.values(), key=lambda r: (-r.aggregate_entropy, r.layers))
    for i, r in enumerate(out, start=1):
        r.rank = i
    return out


def recommend(selections, num_layers: int, names: dict[str, str] | None = None) -> Recommendation:
    """The highest-ranked set that does not read layer 0 (when there is one), with the reason in two sentences."""
    ranked = rank(selections, num_layers, names)
    if not ranked:
        raise ValueError("recommend needs at least one layer set")
    clean = [r for r in ranked if not r.flags]
    best = clean[0] if clean else ranked[0]
    default = next((r for r in ranked if r.name.split(" = ")[0] == "default" or " = default" in r.name), None)
    k = len(best.layers)
    where = f"{len(ranked)} sets" + (" that do not read layer 0" if best.rank != 1 else "")
    if default is None or default is best:
        aside = "; it is the default rule's own set" if default is best else ""
    else:
        aside = (f"; the default rule {default.layers} ranks {default.rank} of {len(ranked)} "
                 f"at {default.aggregate_entropy:.3f} nats")
    first = (f"Recommended: {best.name} {best.layers}, the highest aggregate entropy of the {where} "
             f"({best.aggregate_entropy:.3f} nats{aside}).")
    second = (f"Its {k} layer{'s' if k != 1 else ''} together spread the tokens over the most directions"
              + (f" (mean CKA {best.mean_cka:.2f} between them: {redundancy_words(best.mean_cka)})" if k > 1 else "")
              + ", which is what a draft reading them can use; confirm it with the study's measured τ on the "
              "Speculative decoding page.")
    return Recommendation(ranked, best, None if default is None else default.rank, first + " " + second)


def redundancy_words(cka: float) -> str:
    """What a mean CKA between a set's layers says, in words."""
    if cka < 0.5:
        return "they share little"
    if cka < 0.8:
        return "they overlap in part"
    return "largely redundant, as every set here is"


def headroom(k: int) -> float:
    """How far a set's aggregate entropy can rise above its layers' own α = 2 entropy: log k (no shared information)."""
    return math.log(k) if k > 0 else 0.0
