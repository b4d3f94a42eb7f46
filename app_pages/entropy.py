"""Entropy: how much information each layer's states spread over (matrix entropy per layer)."""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd
import streamlit as st

from layerscope import layerset
from layerscope.capture.format import capture_state_kinds
from layerscope.capture.stored import KIND as CAPTURES
from layerscope.stats.analysis import AnalysisOptions, sample_note
from layerscope.stats.entropy import KERNELS
from layerscope.stats.tokens import breakdown as token_breakdown
from layerscope.ui import plots
from layerscope.ui.labels import colors
from layerscope.ui.picks import sets_for_display
from layerscope.ui.state import SESSION_KEY, bind_view, commit
from layerscope.ui.stats_access import ensure_extra_stats
from layerscope.ui.views import live_job, page_header, stats_or_progress
from layerscope.ui.widgets import chart, job_status, md_text, number_field, option_changes, table, wait_briefly

s, store = page_header("Matrix entropy per layer",
                       "For each layer, the Rényi entropy of the trace-normalized Gram matrix of its (centered, unit-length) "
                       "token states, in nats: higher means the layer spreads its tokens over more directions. Computed on the "
                       "kept tokens; normalized = entropy / log min(n, d).")

ALPHAS = [0.5, 1.0, 2.0, 3.0]
CONTROLS = ("alpha", "kernel", "filter", "threshold", "response", "outliers", "max_tokens")
OPTION_KEYS = ("alpha", "min_entropy", "response_only", "outlier_factor", "max_tokens", "kernel")
FEW_TOKENS = 1000          # below this, entropy and CKA estimates are mostly noise


def controls_of(opts: dict) -> dict:
    """What the option widgets show for analysis options `opts`."""
    return {"alpha": float(opts["alpha"]) if float(opts["alpha"]) in ALPHAS else 1.0,
            "kernel": opts.get("kernel", "linear") if opts.get("kernel") in KERNELS else "linear",
            "filter": opts.get("min_entropy") not in (None, 0, 0.0),
            "threshold": float(opts.get("min_entropy") or AnalysisOptions().min_entropy),
            "response": bool(opts["response_only"]), "outliers": opts.get("outlier_factor") is not None,
            "max_tokens": int(opts.get("max_tokens") or AnalysisOptions().max_tokens)}


def options_of(c: dict, base: dict) -> dict:
    """The analysis options the widgets' values `c` ask for (the rest from `base`)."""
    return {**base, "alpha": float(c["alpha"]), "min_entropy": float(c["threshold"]) if c["filter"] else 0.0,
            "response_only": bool(c["response"]),
            "outlier_factor": (base.get("outlier_factor") or AnalysisOptions().outlier_factor) if c["outliers"] else None,
            "max_tokens": int(c["max_tokens"]), "kernel": c["kernel"]}


def stored_controls(value) -> dict | None:
    """The session's edited (not yet applied) widget values, when they are whole and valid."""
    if not isinstance(value, dict) or set(value) != set(CONTROLS):
        return None
    ok = (value["alpha"] in ALPHAS and value["kernel"] in KERNELS and isinstance(value["threshold"], (int, float))
          and 0 <= value["threshold"] <= 5 and isinstance(value["max_tokens"], int) and 8 <= value["max_tokens"] <= 1_000_000)
    return {**value, "threshold": float(value["threshold"])} if ok else None


# The widgets edit a copy of the session's options, kept in the session (s.view["entropy_controls"]) so an edit
# survives leaving the page, a reload and a new tab; nothing changes for the session (and for everyone who
# opens it) until the changes are reviewed and confirmed.
# A widget is set only when it holds another value: setting it sends the value to the browser, so a run begun before
# the user's last arrow-key step would send the step before it back (the slider showed 0.75, 0.70 was applied).
applied = {**asdict(AnalysisOptions()), **s.analysis_options}
for name, value in (stored_controls(s.view.get("entropy_controls")) or controls_of(applied)).items():
    if st.session_state.get(f"ls_ent_{name}") != value:
        st.session_state[f"ls_ent_{name}"] = value


def _edited():
    current = st.session_state.get(SESSION_KEY) or s
    c = {name: st.session_state[f"ls_ent_{name}"] for name in CONTROLS}
    if c == controls_of({**asdict(AnalysisOptions()), **current.analysis_options}):
        current.view.pop("entropy_controls", None)
    else:
        current.view["entropy_controls"] = c
    commit(current)


with st.container(border=True):
    c1, c2 = st.columns(2)
    c1.select_slider("Rényi order α", options=ALPHAS, key="ls_ent_alpha", on_change=_edited,
                     help="α = 1: von Neumann (Shannon) entropy; α = 2: collision entropy")
    c2.radio("Kernel", KERNELS, key="ls_ent_kernel", horizontal=True, on_change=_edited,
             help="linear: standard linear CKA on centered token states; cosine: tokens scaled to unit length first")
    c1.toggle("Token-entropy filter", key="ls_ent_filter", on_change=_edited,
              help="Drop tokens the target is sure about (low predictive entropy)")
    c1.slider("Threshold (nats)", 0.0, 5.0, step=0.05, key="ls_ent_threshold", disabled=not st.session_state.ls_ent_filter,
              on_change=_edited, help="The red line on the histogram below follows this slider; applying recomputes")
    c2.toggle("Response tokens only", key="ls_ent_response", on_change=_edited,
              help="Only the tokens the target generated, as in EAGLE training data")
    c2.toggle("Drop massive activations", key="ls_ent_outliers", on_change=_edited,
              help="Tokens whose norm exceeds 10× the layer's median (attention sinks etc.) dominate the statistics")
    number_field(c2, "Max tokens", min_value=8, max_value=1_000_000, key="ls_ent_max_tokens",
                 on_change=_edited, help="A seeded random subsample keeps interactive use fast")
    pending = options_of({name: st.session_state[f"ls_ent_{name}"] for name in CONTROLS}, applied)
    changes = option_changes(applied, pending)
    reviewing = st.session_state.get("ls_ent_review") == s.id and bool(changes)
    b1 = st.container(horizontal=True, vertical_alignment="center")
    if b1.button("Review and apply…", type="primary", icon=":material/fact_check:", key="ls_ent_recompute",
                 width="content", disabled=not changes or reviewing):
        st.session_state["ls_ent_review"] = s.id
        st.rerun()
    if changes and b1.button("Discard changes", key="ls_ent_discard", icon=":material/close:", width="content"):
        s.view.pop("entropy_controls", None)
        st.session_state.pop("ls_ent_review", None)
        commit(s)
        st.rerun()
    if changes and not reviewing:
        b1.caption(f"{len(changes)} change(s) not applied yet: " + "; ".join(changes) + ".")
    if reviewing:
        with st.container(border=True):
            st.markdown("**Apply these changes to this session?** The statistics are recomputed with them, and every "
                        "page (and everyone who opens this session) then shows the new ones:\n"
                        + "\n".join(f"- {c}" for c in changes))
            if int(pending["max_tokens"]) < FEW_TOKENS:
                st.warning(f"Max tokens {int(pending['max_tokens']):,}: entropy and CKA computed on fewer than "
                           f"{FEW_TOKENS:,} tokens are mostly noise.", icon=":material/warning:")
            r1 = st.container(horizontal=True)
            if r1.button("Apply and recompute", type="primary", key="ls_ent_confirm", icon=":material/refresh:",
                         width="content"):
                st.session_state["ls_ent_undo"] = (s.id, dict(s.analysis_options), changes)
                st.session_state.pop("ls_ent_review", None)
                s.analysis_options = {k: pending[k] for k in OPTION_KEYS}
                s.view.pop("entropy_controls", None)
                commit(s)
                st.rerun()
            if r1.button("Keep editing", key="ls_ent_back", icon=":material/edit:", width="content"):
                st.session_state.pop("ls_ent_review", None)
                st.rerun()
    undo = st.session_state.get("ls_ent_undo")
    if undo and undo[0] == s.id:
        u1, u2 = st.columns([4, 1])
        u1.info("This session's statistics were recomputed (" + "; ".join(undo[2]) + "); every page and "
                "everyone who opens this session now sees them.", icon=":material/info:")
        if u2.button("Undo", key="ls_ent_undo_btn", icon=":material/undo:"):
            s.analysis_options = undo[1]
            s.view.pop("entropy_controls", None)
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
    st.caption(f"{stats['tokens_total']:,} captured = "
               + " + ".join(f"{count:,} {what}" for what, count in token_breakdown(
                   {"tokens_total": stats["tokens_total"], "tokens_kept": stats["tokens_kept"], **tok})))
    if stats.get("sample_positions") is not None:
        st.caption(f"The capture's tokens are {sample_note(stats['sample_positions'])}: these statistics come from a "
                   "sample, and drafts cannot be trained from this capture.")

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
        other, job = ensure_extra_stats(s, store, other_opts)
        if job is not None and job.view().running:
            wait_briefly(job)
            other, job = ensure_extra_stats(s, store, other_opts)
        if other is not None:
            curves["dataset-level, unfiltered"] = other["entropy_normalized" if norm else "entropy"]
        elif job is not None and job.view().running:
            live_job(s.id, "analysis-compare", key="ent_cmp")
        elif job is not None:
            job_status(job.view(), key="ent_cmp")
    default, _ = layerset.default_layers(n)
    sets = sets_for_display(s, extra=[("default", default)])
    # each layer's kind, from the capture's manifest (none for a capture made before kinds were recorded)
    kinds = capture_state_kinds(store.path(CAPTURES, s.capture_key), n) if s.capture_key else None
    fig = plots.entropy_curve(curves, sets=sets, title=f"Matrix entropy per layer (α = {stats['alpha']:g})",
                              y_title="normalized entropy" if norm else "entropy (nats)",
                              final_state=stats.get("final_state", "post-norm"), colors=colors(s),
                              kinds=kinds)
    chart(fig, key="ls_entropy_curve", filename=f"entropy-{s.capture_key or 'session'}")
    st.caption(f"Layer 0 is the embedding output, layer {n} the final state ({md_text(stats.get('final_state', 'post-norm'))}); "
               f"drafts read layers 0..{n - 1}. Markers: the layer sets of this session and the default rule."
               + (" Bands: the kind of the decoder layer whose output each layer is (attention, sliding, linear "
                  "attention, SSM, conv)." if plots.mixed_kinds(kinds) else
                  f" Every decoder layer: {plots.kind_label(kinds[1])}." if kinds else ""))

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
                       "prompt-level normalized": stats.get("entropy_prompt_normalized")})
    with st.expander("Per-layer values"):
        table(df, key="ls_entropy_table", filename=f"entropy-{s.capture_key or 'session'}")
