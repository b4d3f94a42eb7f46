"""A session as one self-contained HTML report: figures, tables and the verdict, readable offline.

`session_report(session)` -> str. plotly.js is inlined once (the page opens without a network); every
piece of user text (session, set and draft names, model specs) is escaped by `fmt.escape`, the rule the figures
use too. No Streamlit here.
"""

from __future__ import annotations

import pandas as pd
from plotly.offline import get_plotlyjs

from layerscope import fmt, layerset
from layerscope.decoding import sanity
from layerscope.decoding.bench import interval_note
from layerscope.session.model import Session, now_iso
from layerscope.stats.analysis import sample_note
from layerscope.study import recommend
from layerscope.study.recommend import set_label
from layerscope.ui import plots, speculate

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2rem auto;padding:0 1rem;color:#222}
h1{font-size:1.7rem}h2{font-size:1.3rem;margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.3rem}
table{border-collapse:collapse;font-size:.9rem;margin:.8rem 0}th,td{border:1px solid #ddd;padding:.3rem .6rem;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}.verdict{background:#eef6ee;border-left:4px solid #2ca02c;
padding:.8rem 1rem}.note{color:#666;font-size:.9rem}.warn{background:#fff4e5;border-left:4px solid #ff9800;padding:.5rem 1rem}"""


_e = fmt.escape


def _table(rows: list[dict]) -> str:
    """Rows as an HTML table; every text cell and header escaped by `fmt.escape`, every number in the one form
    (`fmt.cell`: a whole number as one, 1 and 128, never 1.000 or 128.0; missing values "—")."""
    if not rows:
        return ""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    whole = {k for k in columns if _whole_numbers([r.get(k) for r in rows])}
    df = pd.DataFrame([{_e(k): _e(_cell(r.get(k), k in whole)) for k in columns} for r in rows], dtype=object)
    return df.to_html(index=False, escape=False, border=0)


def _whole_numbers(values) -> bool:
    """A column of whole numbers, some of them floats (pandas turns ints into floats where a row has none)."""
    present = [v for v in values if not fmt.missing(v)]
    return bool(present) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()
                                 for v in present) and any(isinstance(v, int) or fmt.missing(v) for v in values)


def _cell(v, whole: bool) -> str:
    if hasattr(v, "item"):                      # numpy and pandas scalars
        v = v.item()
    return fmt.count(v) if whole and not fmt.missing(v) else fmt.cell(v)


def _figure(fig) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "responsive": True})


def session_report(s: Session) -> str:
    """The whole session on one page: what was captured, the statistics, the ranked sets and recommendation,
    benchmark and study results."""
    title = s.name or f"unnamed session {s.id}"
    parts = [f"<h1>LayerScope report: {_e(title)}</h1>",
             f"<p class='note'>Session {_e(s.id)} · written {_e(fmt.when(now_iso()))} · device {_e(s.device or '—')}</p>"]
    parts.append(_capture_section(s))
    colors = plots.palette([x["layers"] for x in s.layer_sets] + [d["layers"] for d in s.drafts],
                           default=layerset.default_layers(s.num_layers)[0] if s.num_layers else None)
    stats = s.stats_dict()
    verdict = verdict_head = None
    if stats is not None:
        parts += _statistics_section(s, stats, colors)
        verdict_head, verdict, ranked = _ranked_sets_section(s, stats)
        parts += ranked
    parts += _drafts_section(s)
    if s.bench_results:
        parts += _benchmark_section(s, s.bench_results[-1], colors)
    if s.study:
        parts += _study_section(s, s.study[-1])
    if verdict:
        parts.insert(2, f"<div class='verdict'><b>{_e(verdict_head)}.</b> {_e(verdict)}</div>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>LayerScope report: {_e(title)}</title><style>{STYLE}</style>"
            f"<script>{get_plotlyjs()}</script></head><body>" + "\n".join(parts) + "</body></html>")


def _capture_section(s: Session) -> str:
    """What was captured: model, prompt set, capture key, its size."""
    cap = s.capture or {}
    return "<h2>Capture</h2>" + _table([{
        "model": s.model, "prompt set": s.prompt_set, "capture": s.capture_key, "prompts": cap.get("conversations"),
        "tokens": cap.get("tokens"), "layers": f"0..{cap.get('num_layers')}" if cap.get("num_layers") else None}])


def _statistics_section(s: Session, stats: dict, colors: dict) -> list[str]:
    """The layer statistics: what was kept, the entropy curve and the CKA heatmap, with the session's sets."""
    n = int(stats["num_layers"])
    final = stats.get("final_state", "post-norm")
    kernel = (stats.get("options") or {}).get("kernel", "linear")
    parts = ["<h2>Layer statistics</h2>" + _table([{
        "tokens kept": stats.get("tokens_kept"), "of": stats.get("tokens_total"),
        "threshold (nats)": stats.get("threshold"), "α": stats.get("alpha"), "kernel": kernel,
        **({"tokens": sample_note(stats["sample_positions"])} if stats.get("sample_positions") else {})}])]
    default, _ = layerset.default_layers(n)
    sets = [(x["name"], x["layers"]) for x in s.layer_sets] + [("default", default)]
    parts.append(_figure(plots.entropy_curve({"dataset-level": stats["entropy"]}, sets=sets, final_state=final,
                                             colors=colors)))
    estimator = "debiased" if s.view.get("cka_estimator") == "debiased" and stats.get("cka_debiased") else "biased"
    matrix = stats["cka_debiased"] if estimator == "debiased" else stats["cka"]
    parts.append(_figure(plots.cka_heatmap(matrix, compartments=stats.get("compartments"), sets=sets,
                                           picks=s.manual_picks, final_state=final, colors=colors,
                                           title=f"CKA, {kernel} kernel ({estimator})")))
    return parts


def _ranked_sets_section(s: Session, stats: dict) -> tuple[str, str, list[str]]:
    """The layer sets ranked and the recommendation: (the verdict's heading, the verdict, the section)."""
    rec = recommend.as_left(s, stats)
    verdict_head = ("Verdict" if rec.basis == "τ" else        # a measurement; else say what it rests on
                    f"Recommendation (no measured τ: {f'an estimate from {rec.source}' if rec.basis else 'nothing measured yet'})")
    basis = f"ranked by {rec.basis} ({rec.source})" if rec.basis else "not ranked: nothing measured tells them apart"
    parts = [f"<h2>Layer sets of {rec.k} layers, {_e(basis)}</h2>" + _table([{
        "rank": r.rank, "set": r.name, "layers": fmt.layers(r.layers),
        "draft": recommend.draft_text(r),        # whose τ, agreement and budget: one draft's to a row
        "role": " · ".join(x for x in ("recommended" if r is rec.best else "",
                                      "default rule" if r.is_default else "") if x),
        "τ [95% interval]": fmt.interval(r.tau, r.tau_ci, "tau") if r.tau is not None else None,
        "measured in": r.tau_source,
        "held-out agreement": fmt.percent(r.agreement) if r.agreement is not None else None,
        "held-out positions": r.agreement_n, "training tokens": r.budget,
        "probe agreement [95% interval]": (fmt.interval(r.probe, r.probe_ci, "percent")
                                           if r.probe is not None else None),
        "probe sample": (f"{fmt.count(sum(r.probe_counts))} positions, {len(r.probe_counts)} conversations"
                         if r.probe_counts else None),
        "tie": "tied at the top" if r.tied else "",
        "aggregate entropy (nats)": r.aggregate_entropy, "mean entropy": r.mean_entropy,
        "mean CKA": fmt.NOT_APPLICABLE if r.mean_cka is None else r.mean_cka,
        "flags": "; ".join(f.split(":")[0] for f in r.flags)} for r in rec.ranked])]
    if rec.best is not None:                                      # the page's notes on the recommended set
        parts += [f"<p class='warn'>Note: {_e(flag)}.</p>" for flag in rec.best.flags]
    parts.append("<p class='note'>Entropy and CKA describe each set; every strategy maximises one of them, so "
                 "they do not rank. Sets are ranked by measured τ, else trained drafts' held-out agreement, else "
                 "the probe, within one set size.</p>")
    return verdict_head, rec.text, parts


def _drafts_section(s: Session) -> list[str]:
    """The Speculative decoding page's drafts table, and its warning when drafts did not learn."""
    parts = []
    if s.drafts:
        parts.append("<h2>Drafts</h2>" + _table(speculate.drafts_frame(s.drafts).to_dict("records")))
    collapsed = sanity.collapse_warning(s.drafts) if s.drafts else None
    if collapsed:
        parts.append(f"<p class='warn'>{_e(collapsed)}</p>")
    return parts


def _benchmark_section(s: Session, b: dict, colors: dict) -> list[str]:
    """The latest benchmark run: its table, notes and warnings, and its chart."""
    rows = b.get("results") or []
    parts = [f"<h2>Benchmark</h2><p class='note'>{_e(b.get('prompts'))} {_e(b.get('prompt_set', ''))} prompts × "
             f"{_e(b.get('max_new_tokens'))} new tokens · {_e(b.get('device'))} · {_e(fmt.when(b.get('created')))}</p>"]
    parts.append(_table([{"contender": r.get("name"), "layers": fmt.layers(r["layers"]) if r.get("layers") else "",
                          "τ": fmt.interval(r.get("tau"), r.get("tau_ci"), "tau"),
                          "tokens/s": fmt.number(r.get("tokens_per_s"), 1),
                          "speedup": fmt.interval(r.get("speedup"), r.get("speedup_ci"), "speedup"),
                          "lossless": r.get("lossless")} for r in rows]))
    if b.get("intervals"):
        parts.append(f"<p class='note'>{_e(interval_note(b['intervals']))}</p>")
    for level, text in speculate.run_warnings(b, s.drafts):        # every warning the page showed
        parts.append(f"<p class='{'note' if level == 'note' else 'warn'}'>{_e(text)}</p>")
    if rows:
        parts.append(_figure(plots.bench_comparison(rows, colors=colors)))
    return parts


def _study_section(s: Session, st_: dict) -> list[str]:
    """The latest study: its table, verdict, warnings and the proxies' correlation with τ."""
    rows = st_.get("rows") or []
    parts = ["<h2>Study: does a proxy predict τ?</h2>" + _table([{
        "set": set_label(r.get("strategies") or [], r.get("layers") or [], s.layer_sets),
        "layers": fmt.layers(r.get("layers")), "τ": fmt.interval(r.get("tau"), r.get("tau_ci"), "tau"),
        "τ − default": fmt.interval(r.get("delta_vs_default"), r.get("delta_ci"), "delta"),
        "τ range over seeds": fmt.tau(r.get("tau_seed_range")) if len(r.get("seeds") or []) > 1 else None,
        "speedup": fmt.interval(r.get("speedup"), r.get("speedup_ci"), "speedup"),
        "aggregate entropy": r.get("aggregate_entropy"), "mean entropy": r.get("mean_entropy"),
        "mean CKA": r.get("mean_cka") if len(r.get("layers") or []) > 1 else fmt.NOT_APPLICABLE} for r in rows])]
    if st_.get("verdict"):
        parts.append(f"<p><b>The study's verdict.</b> {_e(st_['verdict'])}</p>")
    for w in sanity.study_warnings(rows, int(st_.get("prompts") or 0)):
        parts.append(f"<p class='warn'>{_e(w)}</p>")
    corr = st_.get("spearman") or {}
    if corr:
        parts.append("<p>Spearman correlation with τ: " + " · ".join(
            f"{_e(fmt.name(k))} {'n/a' if v is None else fmt.delta(v)}" for k, v in corr.items()) + "</p>")
    return parts
