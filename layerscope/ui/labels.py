"""How results are named and coloured in pickers and figures: drafts, benchmark runs, the session's palette.
Read-only: nothing here changes the session."""

from __future__ import annotations

from pathlib import Path

from layerscope import fmt, layerset
from layerscope.session.model import Session
from layerscope.ui import plots


def draft_labels(drafts) -> dict[str, str]:
    """{path: "name [layers]"} for pickers and charts; two drafts that would read alike get their folder name too."""
    base = {d["path"]: f"{d['name']} {fmt.layers(d['layers'])}" for d in drafts}
    seen: dict[str, int] = {}
    for label in base.values():
        seen[label] = seen.get(label, 0) + 1
    return {p: label + (f" · {Path(p).name[:8]}" if seen[label] > 1 else "") for p, label in base.items()}


def colors(s: Session) -> dict:
    """The session's palette: one color per layer set (its sets, then its drafts', studies' and benchmarks'), the
    default rule grey; every figure takes it, so a set and the drafts reading it keep one color across charts."""
    n = s.num_layers
    sets = ([x["layers"] for x in s.layer_sets] + [d["layers"] for d in s.drafts]
            + [r["layers"] for study in s.study for r in study.get("rows") or []]
            + [r["layers"] for b in s.bench_results for r in b.get("results") or [] if r.get("layers")])
    return plots.palette(sets, default=layerset.default_layers(n)[0] if n else None)


def run_label(res: dict, i: int) -> str:
    """How a benchmark run reads in its picker: number, prompts, tokens, depth, device, when."""
    parts = [f"#{i + 1}", f"{res.get('prompts')} {res.get('prompt_set', '')} prompts".replace("  ", " "),
             f"{res.get('max_new_tokens')} new tokens"]
    if res.get("k") is not None:
        parts.append(f"K {res['k']}")
    parts += [str(res.get("device") or "?"), fmt.when(res.get("created"))]
    return " · ".join(parts)
