"""The Home page's reading of a session: how far it went through the workflow, and what "good" is on this machine.

    steps(s) -> [Step]      captured → analysed → sets → drafts → benchmark → study, each done or not, with one
                            line saying what the session holds and the page that does the step
    break_even(s) -> dict   {"k": [1..8], "tau": [...], "source": ...} from the cost curve the session's latest
                            benchmark measured (costmodel's rule), or None when no benchmark measured one
Plain data in and out; no Streamlit here.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerscope import fmt
from layerscope.decoding import costmodel, sanity


@dataclass
class Step:
    name: str          # "Capture", "Analyse", ...
    done: bool
    summary: str       # what the session holds for this step, or what the step does
    page: str          # the app page that does it


def _best_tau(rows) -> dict | None:
    drafts = [r for r in rows if r.get("layers") and r.get("tau") is not None]
    return max(drafts, key=lambda r: r["tau"]) if drafts else None


def steps(s) -> list[Step]:
    cap = s.capture or {}
    out = [Step("Capture", bool(s.capture_key),
                f"{s.model} · {fmt.count(cap.get('tokens'))} tokens of {cap.get('conversations', '?')} prompts · layers "
                f"0..{cap.get('num_layers', '?')}" if s.capture_key else
                "Run the target on a prompt set and record every layer's hidden states.", "app_pages/capture.py")]
    stats = s.stats if s.has_stats else {}
    kernel = (stats.get("options") or {}).get("kernel", "linear")
    out.append(Step("Analyse", s.has_stats,
                    f"entropy and CKA ({kernel} kernel) over {fmt.count(stats.get('tokens_kept'))} kept tokens"
                    if s.has_stats else "Matrix entropy per layer and CKA between layers (Entropy, CKA heatmap).",
                    "app_pages/entropy.py"))
    out.append(Step("Layer sets", bool(s.layer_sets),
                    f"{len(s.layer_sets)} set(s) to test: " + "; ".join(f"{x['name']} {fmt.layers(x['layers'])}"
                                                                          for x in s.layer_sets[:4])
                    + (" …" if len(s.layer_sets) > 4 else "") if s.layer_sets else
                    "Compare the strategies' sets, pick your own, choose which to test.", "app_pages/layer_sets.py"))
    flagged = sum(1 for why in sanity.collapse_reasons(s.drafts) if why) if s.drafts else 0
    out.append(Step("Drafts", bool(s.drafts),
                    f"{len(s.drafts)} trained draft(s)" + (f", {flagged} of them may not have learned" if flagged else "")
                    if s.drafts else "Train an EAGLE-3 draft that reads each set (same budget for all).",
                    "app_pages/speculate.py"))
    if s.bench_results:
        last = s.bench_results[-1]
        top = _best_tau(last.get("results") or [])
        bench = (f"{len(s.bench_results)} run(s); latest: {last.get('prompts')} prompts"
                 + (f", best τ {fmt.interval(top['tau'], top.get('tau_ci'), 'tau')} ({top['name']})" if top else ""))
    else:
        bench = "Decode with the drafts (lossless) and measure τ, acceptance and speedup."
    out.append(Step("Benchmark", bool(s.bench_results), bench, "app_pages/speculate.py"))
    if s.study:
        last = s.study[-1]
        study = f"{len(s.study)} study(ies); latest: {len(last.get('rows') or [])} sets" + (
            f". {last['verdict'].split('. ')[0].rstrip('.')}." if last.get("verdict") else "")
    else:
        study = "One draft per strategy's set and controls, one budget, one benchmark: does a proxy predict τ?"
    out.append(Step("Study", bool(s.study), study, "app_pages/speculate.py"))
    return out


def next_step(all_steps: list[Step]) -> Step | None:
    """The first step not done yet."""
    return next((x for x in all_steps if not x.done), None)


KS = tuple(range(1, 9))


def break_even(s) -> dict | None:
    """The τ a chain of depth K needs on this machine to match plain decoding, K = 1..8, from the session's latest
    benchmark that measured a cost curve: costmodel.break_even_tau, the rule every verdict uses, with the draft step
    that run measured (its first draft row's `draft_step_seconds`: the draft forward and the step's upkeep), else
    the one the curve timed. So the K the run decoded reads here as in its verdict and on its cost chart."""
    for i in range(len(s.bench_results) - 1, -1, -1):
        b = s.bench_results[i]
        points, draft = b.get("cost_curve"), b.get("draft_step_seconds")
        if not points or not draft:
            continue
        measured = next((r for r in b.get("results") or [] if r.get("draft_step_seconds") is not None), None)
        try:
            curve = costmodel.CostCurve(str(b.get("device") or "?"), "?", 0,
                                        tuple(float(p["seconds"]) for p in points), (float(draft),))
            if measured is not None:
                curve = costmodel.with_draft_step(curve, float(measured["draft_step_seconds"]))
            taus = costmodel.break_even_taus(curve, ks=KS, trees=())
        except (KeyError, TypeError, ValueError):
            continue
        return {"k": list(KS), "tau": [taus[f"chain k={k}"] for k in KS], "source": f"benchmark #{i + 1}",
                "device": b.get("device"), "when": b.get("created"),
                "busy": (b.get("machine") or {}).get("quiet") is False,
                "draft_step": curve.draft_s(1) / curve.target_s(1),
                "draft_from": measured.get("name") if measured is not None else None}
    return None
