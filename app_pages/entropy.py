"""Entropy: how much information each layer's states spread over (matrix entropy per layer)."""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd
import streamlit as st

from layerscope import plots
from layerscope.analysis import AnalysisOptions
from layerscope.metrics.entropy import KERNELS
from layerscope.select import default_layers
from layerscope.ui import apply
from layerscope.ui.state import bind_view, commit
from layerscope.ui.views import live_job, page_header, stats_or_progress
from layerscope.ui.widgets import chart, job_status, md_text, option_changes, table, wait_briefly

s, store = page_header("Matrix entropy per layer",
                       "For each layer, the Rényi entropy of the trace-normalized Gram matrix of its (centered, unit-length) "
                       "token states, in nats: higher means the layer spreads its tokens over more directions. Computed on the "
                       "kept tokens; normalized = entropy / log min(n, d).")

ALPHAS = [0.5, 1.0, 2.0, 3.0]
opts = {**asdict(AnalysisOptions()), **s.analysis_options}
# The option widgets edit a pending copy of the session's options: nothing changes for the session (and
# for everyone who opens it) until Recompute. They follow the session when its options change elsewhere.
if st.session_state.get("ls_ent_synced") != opts:
    st.session_state.update({
        "ls_ent_synced": opts,
        "ls_ent_alpha": float(opts["alpha"]) if float(opts["alpha"]) in ALPHAS else 1.0,
        "ls_ent_filter": opts.get("min_entropy") not in (None, 0, 0.0),
        "ls_ent_threshold": float(opts.get("min_entropy") or 0.5),
        "ls_ent_response": bool(opts["response_only"]),
        "ls_ent_outliers": opts.get("outlier_factor") is not None,
        "ls_ent_max_tokens": int(opts.get("max_tokens") or 8192),
        "ls_ent_kernel": opts.get("kernel", "linear"),
    })
with st.container(border=True):
    c1, c2 = st.columns(2)
    c1.select_slider("Rényi order α", options=ALPHAS, key="ls_ent_alpha",
                     help="α = 1: von Neumann (Shannon) entropy; α = 2: collision entropy")
    c2.radio("Kernel", KERNELS, key="ls_ent_kernel", horizontal=True,
             help="linear: standard linear CKA on centered token states; cosine: tokens scaled to unit length first")
    c1.toggle("Token-entropy filter", key="ls_ent_filter", help="Drop tokens the target is sure about (low predictive entropy)")
    c1.slider("Threshold (nats)", 0.0, 5.0, step=0.05, key="ls_ent_threshold", disabled=not st.session_state.ls_ent_filter,
              help="The red line on the histogram below follows this slider; Recompute applies it")
    c2.toggle("Response tokens only", key="ls_ent_response", help="Only the tokens the target generated, as in EAGLE training data")
    c2.toggle("Drop massive activations", key="ls_ent_outliers",
              help="Tokens whose norm exceeds 10× the layer's median (attention sinks etc.) dominate the statistics")
    c2.number_input("Max tokens", min_value=8, max_value=1_000_000, step=1024, key="ls_ent_max_tokens",
                    help="A seeded random subsample keeps interactive use fast")
    pending = {**opts, "alpha": float(st.session_state.ls_ent_alpha),
               "min_entropy": float(st.session_state.ls_ent_threshold) if st.session_state.ls_ent_filter else 0.0,
               "response_only": bool(st.session_state.ls_ent_response),
               "outlier_factor": (opts.get("outlier_factor") or AnalysisOptions().outlier_factor) if st.session_state.ls_ent_outliers else None,
               "max_tokens": int(st.session_state.ls_ent_max_tokens), "kernel": st.session_state.ls_ent_kernel}
    changes = option_changes(opts, pending)
    b1 = st.container(horizontal=True, vertical_alignment="center")
    if b1.button("Recompute", type="primary", icon=":material/refresh:", key="ls_ent_recompute", width="content") and changes:
        st.session_state["ls_ent_undo"] = (s.id, dict(s.analysis_options), changes)
        s.analysis_options = {k: pending[k] for k in ("alpha", "min_entropy", "response_only", "outlier_factor",
                                                       "max_tokens", "kernel")}
        commit(s)
        st.rerun()
    if changes:
        b1.caption("Not applied yet: " + "; ".join(changes) + ". Recompute changes this session's statistics on every "
                   "page, for everyone who opens this session.")
    undo = st.session_state.get("ls_ent_undo")
    if undo and undo[0] == s.id:
        u1, u2 = st.columns([4, 1])
        u1.info("This session's statistics were recomputed (" + "; ".join(undo[2]) + "); every page and everyone who "
                "opens this session now sees them.", icon=":material/info:")
        if u2.button("Undo", key="ls_ent_undo_btn", icon=":material/undo:"):
            s.analysis_options = undo[1]
            st.session_state.pop("ls_ent_undo", None)
            commit(s)
            st.rerun()

stats = stats_or_progress(s, store, key="entropy")
if stats is not None:
    n = int(stats["num_layers"])
    tok = stats.get("tokens", {})
    m = st.columns(3) + st.columns(3)     # two rows: six labels never fit one row at 1024 px
    m[0].metric("Tokens kept", f"{stats['tokens_kept']:,}", help=f"of {stats['tokens_total']:,} captured")
    m[1].metric("Captured", f"{stats['tokens_total']:,}")
    m[2].metric("Outliers dropped", f"{stats['outliers_dropped']:,}", help="massive-activation tokens")
    m[3].metric("Sinks dropped", f"{tok.get('sink_dropped', 0):,}", help="position 0 of every conversation")
    m[4].metric("Below threshold", f"{tok.get('low_entropy_dropped', 0):,}")
    m[5].metric("Threshold", f"{stats['threshold']:.2f} nats")

    v1, v2 = st.columns(2)
    v3 = v1
    scale = v1.radio("Scale", ["raw (nats)", "normalized"], horizontal=True, key="ls_w_ent_scale",
                     on_change=bind_view(s, "entropy_scale", "ls_w_ent_scale", "raw (nats)"))
    levels = v2.multiselect("Level", ["dataset", "prompt"], key="ls_w_ent_levels",
                            on_change=bind_view(s, "entropy_levels", "ls_w_ent_levels", ["dataset", "prompt"]),
                            help="dataset: all kept tokens together; prompt: mean over conversations of each one's entropy")
    compare_unfiltered = v3.toggle("Compare with the unfiltered curve", key="ls_w_ent_compare",
                                   on_change=bind_view(s, "entropy_compare", "ls_w_ent_compare", False),
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
    st.caption(f"Layer 0 is the embedding output, layer {n} the final state ({md_text(stats.get('final_state', 'post-norm'))}); "
               f"drafts read layers 0..{n - 1}. Markers: the layer sets of this session and the default rule.")

    # The line follows the threshold slider at once; the counts are over the tokens shown in the histogram.
    live_threshold = float(st.session_state.ls_ent_threshold) if st.session_state.ls_ent_filter else None
    applied = bool((stats.get("options") or {}).get("min_entropy"))
    eligible = tok.get("tokens_eligible")
    same = live_threshold is not None and applied and abs(live_threshold - float(stats["threshold"])) < 1e-9
    hist = plots.entropy_histogram(
        stats.get("token_entropy") or [], live_threshold,
        kept=eligible if same else None,
        total=(None if eligible is None else eligible + tok.get("low_entropy_dropped", 0)) if same else None,
        title="Predictive entropy (nats) of the target at each candidate token"
              + ("" if same or live_threshold is None else " · line: the threshold not applied yet"))
    chart(hist, key="ls_entropy_hist", filename=f"token-entropy-{s.capture_key or 'session'}")

    df = pd.DataFrame({"layer": list(range(n + 1)), "entropy": stats["entropy"],
                       "normalized": stats["entropy_normalized"], "entropy α=2": stats.get("entropy2"),
                       "prompt-level": stats.get("entropy_prompt"),
                       "prompt-level normalized": stats.get("entropy_prompt_normalized")}).round(5)
    with st.expander("Per-layer values"):
        table(df, key="ls_entropy_table", filename=f"entropy-{s.capture_key or 'session'}")
