"""Entropy: how much information each layer's states spread over (matrix entropy per layer)."""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd
import streamlit as st

from layerscope import plots
from layerscope.analysis import AnalysisOptions
from layerscope.select import default_layers
from layerscope.ui import apply
from layerscope.ui.state import commit
from layerscope.ui.views import live_job, page_header, stats_or_progress
from layerscope.ui.widgets import chart, job_status, table, wait_briefly

s, store = page_header("Matrix entropy per layer",
                       "For each layer, the Rényi entropy of the trace-normalized Gram matrix of its (centered, unit-length) "
                       "token states, in nats: higher means the layer spreads its tokens over more directions. Computed on the "
                       "kept tokens; normalized = entropy / log min(n, d).")

opts = {**asdict(AnalysisOptions()), **s.analysis_options}
with st.form("ls_entropy_form", border=True):
    c1, c2, c5 = st.columns([1, 1.3, 1])
    alpha = c1.select_slider("Rényi order α", options=[0.5, 1.0, 2.0, 3.0], value=float(opts["alpha"]) if float(opts["alpha"]) in (0.5, 1.0, 2.0, 3.0) else 1.0,
                             help="α = 1: von Neumann (Shannon) entropy; α = 2: collision entropy")
    use_filter = c2.toggle("Token-entropy filter", key="ls_ent_filter", value=opts.get("min_entropy") not in (None, 0, 0.0),
                           help="Drop tokens the target is sure about (low predictive entropy)")
    threshold = c2.slider("Threshold (nats)", 0.0, 5.0, float(opts.get("min_entropy") or 0.5), 0.05)
    c3, c4 = st.columns([1, 1.3])
    response_only = c3.toggle("Response tokens only", value=bool(opts["response_only"]),
                              help="Only the tokens the target generated, as in EAGLE training data")
    drop_outliers = c4.toggle("Drop massive activations", value=opts.get("outlier_factor") is not None,
                              help="Tokens whose norm exceeds 10× the layer's median (attention sinks etc.) dominate the statistics")
    max_tokens = c5.number_input("Max tokens", min_value=8, max_value=1_000_000, value=int(opts.get("max_tokens") or 8192),
                                 step=1024, help="A seeded random subsample keeps interactive use fast")
    if st.form_submit_button("Recompute", type="primary", icon=":material/refresh:", key="ls_ent_recompute"):
        s.analysis_options = {"alpha": float(alpha), "min_entropy": float(threshold) if use_filter else 0.0,
                              "response_only": bool(response_only),
                              "outlier_factor": 10.0 if drop_outliers else None, "max_tokens": int(max_tokens)}
        commit(s)

stats = stats_or_progress(s, store, key="entropy")
if stats is not None:
    n = int(stats["num_layers"])
    tok = stats.get("tokens", {})
    m = st.columns(6)
    m[0].metric("Tokens kept", f"{stats['tokens_kept']:,}", help=f"of {stats['tokens_total']:,} captured")
    m[1].metric("Captured", f"{stats['tokens_total']:,}")
    m[2].metric("Outliers dropped", f"{stats['outliers_dropped']:,}", help="massive-activation tokens")
    m[3].metric("Sinks dropped", f"{tok.get('sink_dropped', 0):,}", help="position 0 of every conversation")
    m[4].metric("Below threshold", f"{tok.get('low_entropy_dropped', 0):,}")
    m[5].metric("Threshold", f"{stats['threshold']:.2f} nats")

    v1, v2, v3 = st.columns([1, 1.4, 1.4])
    scale = v1.radio("Scale", ["raw (nats)", "normalized"], horizontal=True, key="ls_w_ent_scale")
    levels = v2.multiselect("Level", ["dataset", "prompt"], default=["dataset", "prompt"], key="ls_w_ent_levels",
                            help="dataset: all kept tokens together; prompt: mean over conversations of each one's entropy")
    compare_unfiltered = v3.toggle("Compare with the unfiltered curve", key="ls_w_ent_compare",
                                   help="The same statistics without the token-entropy filter")
    norm = scale == "normalized"
    curves = {}
    if "dataset" in levels or not levels:
        curves["dataset-level"] = stats["entropy_normalized" if norm else "entropy"]
    if "prompt" in levels and stats.get("entropy_prompt"):
        curves[f"prompt-level ({stats.get('prompts_used', '?')} prompts)"] = \
            stats["entropy_prompt_normalized" if norm else "entropy_prompt"]
    if compare_unfiltered:
        other_opts = {**asdict(AnalysisOptions()), **s.analysis_options, "min_entropy": 0.0}
        other, job = apply.extra_stats(s, store, other_opts)
        if job is not None and job.view().running:
            wait_briefly(job)
            other, job = apply.extra_stats(s, store, other_opts)
        if other is not None:
            curves["dataset-level, unfiltered"] = other["entropy_normalized" if norm else "entropy"]
        elif job is not None and job.view().running:
            live_job(s.id, "analysis-compare", key="ent_cmp")
        elif job is not None:
            job_status(job.view(), key="ent_cmp")
    default, _ = default_layers(n)
    sets = apply.sets_for_display(s, extra=[("default", default)])
    fig = plots.entropy_curve(curves, sets=sets, title=f"Matrix entropy per layer (α = {stats['alpha']:g})",
                              y_title="normalized entropy" if norm else "entropy (nats)",
                              final_state=stats.get("final_state", "post-norm"))
    chart(fig, key="ls_entropy_curve", filename=f"entropy-{s.capture_key or 'session'}")
    st.caption(f"Layer 0 is the embedding output, layer {n} the final state ({stats.get('final_state', 'post-norm')}); "
               f"drafts read layers 0..{n - 1}. Markers: the layer sets of this session and the default rule.")

    filtered = bool((stats.get("options") or {}).get("min_entropy")) or (stats.get("options") or {}).get("quantile") is not None
    eligible = tok.get("tokens_eligible")
    hist = plots.entropy_histogram(
        stats.get("token_entropy") or [], stats["threshold"] if filtered else None,
        kept=eligible, total=None if eligible is None else eligible + tok.get("low_entropy_dropped", 0),
        title="Predictive entropy (nats) of the target at each candidate token")
    chart(hist, key="ls_entropy_hist", filename=f"token-entropy-{s.capture_key or 'session'}")

    df = pd.DataFrame({"layer": list(range(n + 1)), "entropy": stats["entropy"],
                       "normalized": stats["entropy_normalized"], "entropy α=2": stats.get("entropy2"),
                       "prompt-level": stats.get("entropy_prompt"),
                       "prompt-level normalized": stats.get("entropy_prompt_normalized")}).round(5)
    with st.expander("Per-layer values"):
        table(df, key="ls_entropy_table", filename=f"entropy-{s.capture_key or 'session'}")
