"""A session as one self-contained HTML report: figures, tables and the verdict, readable offline.

`session_report(session)` -> str. plotly.js is inlined once (the page opens without a network); every
piece of user text (session, set and draft names, model specs) is HTML-escaped. No Streamlit here.
"""

from __future__ import annotations

import html

import pandas as pd
from plotly.offline import get_plotlyjs

from layerscope import plots
from layerscope import select as sel
from layerscope.bench import interval_note, with_ci
from layerscope.analysis import LayerStats
from layerscope.session import Session, now_iso
from layerscope.ui import recommend
from layerscope.ui.apply import set_label

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2rem auto;padding:0 1rem;color:#222}
h1{font-size:1.7rem}h2{font-size:1.3rem;margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.3rem}
table{border-collapse:collapse;font-size:.9rem;margin:.8rem 0}th,td{border:1px solid #ddd;padding:.3rem .6rem;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}.verdict{background:#eef6ee;border-left:4px solid #2ca02c;
padding:.8rem 1rem}.note{color:#666;font-size:.9rem}.warn{background:#fff4e5;border-left:4px solid #ff9800;padding:.5rem 1rem}"""


def _e(text) -> str:
    return html.escape("" if text is None else str(text))


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    df = pd.DataFrame(rows)
    return df.to_html(index=False, escape=True, na_rep="—", float_format=lambda v: f"{v:.4g}", border=0)


def _ci(x, ci, **kw) -> str | None:
    """bench.with_ci's "1.13 [1.09, 1.16]", or None (the table's dash) when there is no number."""
    return None if x is None else with_ci(x, ci, **kw)


def _figure(fig) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True})


def session_report(s: Session) -> str:
    """The whole session on one page: what was captured, the statistics, the ranked sets and recommendation,
    benchmark and study results."""
    parts = [f"<h1>LayerScope report: {_e(s.title())}</h1>",
             f"<p class='note'>Session {_e(s.id)} · written {_e(now_iso())} · device {_e(s.device or '—')}</p>"]
    cap = s.capture or {}
    parts.append("<h2>Capture</h2>" + _table([{
        "model": s.model, "prompt set": s.prompt_set, "capture": s.capture_key, "prompts": cap.get("conversations"),
        "tokens": cap.get("tokens"), "layers": f"0..{cap.get('num_layers')}" if cap.get("num_layers") else None}]))
    stats = s.stats_dict()
    verdict = None
    if stats is not None:
        n = int(stats["num_layers"])
        final = stats.get("final_state", "post-norm")
        parts.append("<h2>Layer statistics</h2>" + _table([{
            "tokens kept": stats.get("tokens_kept"), "of": stats.get("tokens_total"),
            "threshold (nats)": stats.get("threshold"), "α": stats.get("alpha"),
            "kernel": (stats.get("options") or {}).get("kernel", "linear")}]))
        default, _ = sel.default_layers(n)
        sets = [(x["name"], x["layers"]) for x in s.layer_sets] + [("default", default)]
        parts.append(_figure(plots.entropy_curve({"dataset-level": stats["entropy"]}, sets=sets, final_state=final)))
        estimator = "debiased" if s.view.get("cka_estimator") == "debiased" and stats.get("cka_debiased") else "biased"
        matrix = stats["cka_debiased"] if estimator == "debiased" else stats["cka"]
        parts.append(_figure(plots.cka_heatmap(matrix, compartments=stats.get("compartments"), sets=sets,
                                               picks=s.manual_picks, final_state=final,
                                               title=f"Linear CKA ({estimator})")))
        layer_stats = LayerStats.from_dict(stats)
        selections = sel.compare(layer_stats, min(3, n), layers=s.manual_picks or None)
        rec = recommend.recommend(selections, n)
        verdict = rec.text
        parts.append("<h2>Layer sets, ranked by aggregate entropy</h2>" + _table([{
            "rank": r.rank, "set": r.name, "layers": str(r.layers), "aggregate entropy (nats)": r.aggregate_entropy,
            "mean entropy": r.mean_entropy, "mean CKA": r.mean_cka,
            "flags": "; ".join(f.split(":")[0] for f in r.flags)} for r in rec.ranked]))
    if s.bench_results:
        b = s.bench_results[-1]
        rows = b.get("results") or []
        parts.append(f"<h2>Benchmark</h2><p class='note'>{_e(b.get('prompts'))} {_e(b.get('prompt_set', ''))} prompts × "
                     f"{_e(b.get('max_new_tokens'))} new tokens · {_e(b.get('device'))} · {_e(b.get('created', ''))}</p>")
        parts.append(_table([{"contender": r.get("name"), "layers": str(r.get("layers") or ""),
                              "τ": _ci(r.get("tau"), r.get("tau_ci")), "tokens/s": r.get("tokens_per_s"),
                              "speedup": _ci(r.get("speedup"), r.get("speedup_ci"), unit="×"),
                              "lossless": r.get("lossless")} for r in rows]))
        if b.get("intervals"):
            parts.append(f"<p class='note'>{_e(interval_note(b['intervals']))}</p>")
        if rows:
            parts.append(_figure(plots.bench_comparison(rows)))
    if s.study:
        st_ = s.study[-1]
        rows = st_.get("rows") or []
        parts.append("<h2>Study: does a proxy predict τ?</h2>" + _table([{
            "set": set_label(r.get("strategies") or [], r.get("layers") or [], s.layer_sets),
            "layers": str(r.get("layers")), "aggregate entropy": r.get("aggregate_entropy"),
            "mean entropy": r.get("mean_entropy"), "mean CKA": r.get("mean_cka"),
            "τ": _ci(r.get("tau"), r.get("tau_ci"), digits=3),
            "τ − default": _ci(r.get("delta_vs_default"), r.get("delta_ci"), digits=3, sign=True),
            "τ range over seeds": r.get("tau_seed_range") if len(r.get("seeds") or []) > 1 else None,
            "speedup": _ci(r.get("speedup"), r.get("speedup_ci"), unit="×")} for r in rows]))
        if st_.get("verdict"):
            parts.append(f"<p><b>The study's verdict.</b> {_e(st_['verdict'])}</p>")
        corr = st_.get("spearman") or {}
        if corr:
            parts.append("<p>Spearman correlation with τ: " + " · ".join(
                f"{_e(k.replace('_', ' '))} {'n/a' if v is None else f'{v:+.2f}'}" for k, v in corr.items()) + "</p>")
        measured = [r for r in rows if r.get("tau") is not None]
        if measured:
            top = max(measured, key=lambda r: r["tau"])
            verdict = ((verdict + " ") if verdict else "") + (
                f"Measured: the highest τ in the study was {top['tau']:.3f} for "
                f"{set_label(top.get('strategies') or [], top.get('layers') or [], s.layer_sets)} {top.get('layers')}.")
    if verdict:
        parts.insert(2, f"<div class='verdict'><b>Verdict.</b> {_e(verdict)}</div>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>LayerScope report: {_e(s.title())}</title><style>{STYLE}</style>"
            f"<script>{get_plotlyjs()}</script></head><body>" + "\n".join(parts) + "</body></html>")
