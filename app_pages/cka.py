"""CKA heatmap: how redundant every pair of layers is; click or box-select cells to pick layers."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import plots
from layerscope.ui import apply
from layerscope.ui.state import commit
from layerscope.ui.views import page_header, stats_or_progress
from layerscope.ui.widgets import chart, table

s, store = page_header("CKA between layers",
                       "Linear CKA of every pair of layers over the kept tokens (response tokens, attention sinks and "
                       "massive activations excluded, entropy filter as set on the Entropy page). 1 = the two layers carry the "
                       "same information up to rotation and scale. White boxes: compartments, contiguous blocks of similar layers. "
                       "Click a cell or drag a box to pick layers for a hand-made set.")

stats = stats_or_progress(s, store, key="cka")
if stats is not None:
    n = int(stats["num_layers"])
    has_debiased = stats.get("cka_debiased") is not None
    c1, c2, c3 = st.columns([1.2, 1, 1.6])
    kind = c1.radio("Estimator", ["biased", "debiased"] if has_debiased else ["biased"], horizontal=True,
                    key="ls_w_cka_kind", help="Debiased CKA uses the unbiased HSIC estimator: less inflated on few tokens")
    max_k = max(1, min(n, len(stats.get("compartments_by_k") or {}) or 1))
    k_comp = c2.number_input("Compartments", min_value=1, max_value=max_k, value=min(3, max_k), step=1,
                             key="ls_w_cka_k", help="How many contiguous blocks to outline (the `spread` strategy uses them)")
    matrix = stats["cka_debiased"] if kind == "debiased" else stats["cka"]
    comps = (stats.get("compartments_by_k") or {}).get(str(int(k_comp)), stats.get("compartments"))
    c3.markdown(f"**{stats['tokens_kept']:,}** of {stats['tokens_total']:,} tokens · "
                f"{stats['outliers_dropped']} outliers dropped · threshold {stats['threshold']:.2f} nats · "
                f"layer {n} is the final state ({stats.get('final_state', 'post-norm')})")

    picks = apply.manual_layers(s)
    fig = plots.cka_heatmap(matrix, compartments=comps, sets=apply.sets_for_display(s), picks=picks,
                            title=f"Linear CKA ({kind}), {s.model or ''}", final_state=stats.get("final_state", "post-norm"))
    round_ = st.session_state.setdefault("ls_cka_round", 0)     # a new chart key clears its selection
    event = chart(fig, key=f"ls_cka_chart_{round_}", filename=f"cka-{kind}-{s.capture_key or 'session'}",
                  on_select="rerun", selection_mode=("points", "box"))
    chosen = plots.cells_to_layers(event.selection.points) if event else []
    chosen = [l for l in chosen if l < n]        # drafts read 0..N-1
    sig = tuple(chosen)
    if chosen and st.session_state.get("ls_cka_last_sel") != sig:
        st.session_state["ls_cka_last_sel"] = sig
        s.manual_picks = sorted(set(s.manual_picks) | set(chosen))
        commit(s)
        st.rerun()

    a, b, c = st.columns([3, 1, 1])
    a.markdown("**Picked layers:** " + (", ".join(map(str, apply.manual_layers(s))) if s.manual_picks else
                                        "none yet — click cells (each cell picks its row and column layer)"))
    if b.button("Clear picks", key="ls_cka_clear", disabled=not s.manual_picks, icon=":material/clear:"):
        s.manual_picks = []
        st.session_state.pop("ls_cka_last_sel", None)
        st.session_state["ls_cka_round"] = round_ + 1
        commit(s)
        st.rerun()
    c.page_link("app_pages/layer_sets.py", label="Use them on Layer sets", icon=":material/arrow_forward:")

    with st.expander("CKA matrix as a table"):
        df = pd.DataFrame(matrix, index=[f"L{i}" for i in range(n + 1)], columns=[f"L{j}" for j in range(n + 1)]).round(4)
        table(df, key="ls_cka_table", filename=f"cka-{kind}", hide_index=False)
