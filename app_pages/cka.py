"""CKA heatmap: how redundant every pair of layers is; its kernel; click cells or drag a box to pick layers."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import fmt
from layerscope.capture.format import capture_state_kinds
from layerscope.capture.stored import KIND as CAPTURES
from layerscope.stats.analysis import sample_note
from layerscope.stats.entropy import KERNELS
from layerscope.ui import plots
from layerscope.ui.kernel import kernel_of, session_kernel, set_kernel
from layerscope.ui.labels import colors
from layerscope.ui.picks import heatmap_picks, manual_layers, picks_over_limit, set_size, sets_for_display
from layerscope.ui.state import SESSION_KEY, bind_view, commit
from layerscope.ui.views import page_header, stats_or_progress
from layerscope.ui.widgets import chart, layer_picker, md_text, number_field, table

TOOLS = ["click cells", "drag a box"]

s, store = page_header("CKA between layers",
                       "CKA of every pair of layers (linear or cosine kernel) over the kept tokens (response tokens, "
                       "attention sinks and massive activations excluded, entropy filter as set on the Entropy page). "
                       "1 = the two layers carry the same information up to rotation and scale. White boxes: "
                       "compartments, contiguous blocks of similar layers. Click a cell to pick its two layers for a "
                       "hand-made set, or drag a box along the diagonal (choose the mouse tool above the heatmap); "
                       "picking picked layers again unpicks them.")

stats = stats_or_progress(s, store, key="cka")
if stats is not None:
    n = int(stats["num_layers"])
    has_debiased = stats.get("cka_debiased") is not None
    c1, c2, c3 = st.columns([1.2, 1, 1.6])
    kinds = ["biased", "debiased"] if has_debiased else ["biased"]
    max_k = max(1, min(n, len(stats.get("compartments_by_k") or {}) or 1))
    on_kind = bind_view(s, "cka_estimator", "ls_w_cka_kind", "biased")
    if st.session_state.ls_w_cka_kind not in kinds:
        st.session_state.ls_w_cka_kind = "biased"
    kind = c1.radio("Estimator", kinds, horizontal=True, key="ls_w_cka_kind", on_change=on_kind,
                    help="Debiased CKA uses the unbiased HSIC estimator: less inflated on few tokens")
    on_k = bind_view(s, "cka_compartments", "ls_w_cka_k", min(3, max_k), clamp=(1, max_k))
    st.session_state.ls_w_cka_k = max(1, min(int(st.session_state.ls_w_cka_k), max_k))
    k_comp = number_field(c2, "Compartments", min_value=1, max_value=max_k, key="ls_w_cka_k", on_change=on_k,
                             help="How many contiguous blocks to outline (the `spread` strategy uses them)")
    matrix = stats["cka_debiased"] if kind == "debiased" else stats["cka"]
    comps = (stats.get("compartments_by_k") or {}).get(str(int(k_comp)), stats.get("compartments"))
    kernel = kernel_of(stats)      # the statistics shown; the radio below shows the session's choice
    c3.markdown(f"**{fmt.count(stats['tokens_kept'])}** of {fmt.count(stats['tokens_total'])} tokens · "
                f"{fmt.count(stats['outliers_dropped'])} outliers dropped · threshold {stats['threshold']:.2f} nats · "
                f"{kernel} kernel · layer {n} is the final state ({stats.get('final_state', 'post-norm')})"
                + (f" · tokens {sample_note(stats['sample_positions'])}" if stats.get("sample_positions") else ""))

    def _kernel_changed():
        set_kernel(st.session_state.get(SESSION_KEY) or s, st.session_state["ls_w_cka_kernel"])

    picks = manual_layers(s)
    limit = set_size(s, n)
    r1, r2 = st.columns([1, 1.6])
    st.session_state["ls_w_cka_kernel"] = session_kernel(s)
    r1.radio("Kernel", KERNELS, horizontal=True, key="ls_w_cka_kernel", on_change=_kernel_changed,
             help="linear: standard linear CKA on centered token states; cosine: tokens scaled to unit length first. "
                  "The session's choice (the Entropy page's too): its statistics are computed again with it, and the "
                  "Layer sets page's strategies use it")
    tool = r2.radio("Mouse on the heatmap", TOOLS, horizontal=True, key="ls_w_cka_tool",
                    on_change=bind_view(s, "cka_tool", "ls_w_cka_tool", TOOLS[0], options=TOOLS),
                    help="click cells: a click picks the cell's row and column layer, a drag zooms in, a double "
                         f"click zooms out; drag a box: the layers whose own cells (on the diagonal) the box covers, "
                         f"at most the set size k = {limit} (Layer sets page). Either way, picking picked layers "
                         "again unpicks them.")
    said = st.session_state.pop("ls_cka_said", None)     # what the last box did not pick, and why
    if said:
        st.warning(md_text(said), icon=":material/select:")
    # each layer's kind, from the capture's manifest (none for a capture made before kinds were recorded)
    layer_kinds = capture_state_kinds(store.path(CAPTURES, s.capture_key), n) if s.capture_key else None
    fig = plots.cka_heatmap(matrix, compartments=comps, sets=sets_for_display(s), picks=picks,
                            title=f"CKA, {kernel} kernel ({kind}){', ' + s.model if s.model else ''}",
                            final_state=stats.get("final_state", "post-norm"), box_select=tool == "drag a box",
                            colors=colors(s), kinds=layer_kinds)
    round_ = st.session_state.setdefault("ls_cka_round", 0)     # a new chart key starts with no selection
    event = chart(fig, key=f"ls_cka_chart_{round_}", filename=f"cka-{kernel}-{kind}-{s.capture_key or 'session'}",
                  on_select="rerun", selection_mode=("points", "box", "lasso"))
    if event and (event.selection.get("points") or event.selection.get("box") or event.selection.get("lasso")):
        after, said = heatmap_picks(dict(event.selection), picks, limit=limit, num_layers=n)
        st.session_state["ls_cka_round"] = round_ + 1     # the next click, on the same cell too, is a new selection
        if said:
            st.session_state["ls_cka_said"] = said
        if after != picks:
            s.manual_picks = after
            commit(s)
        st.rerun()

    def _picks_changed():
        s.manual_picks = sorted(int(x) for x in st.session_state["ls_cka_picks"])
        commit(s)

    st.session_state["ls_cka_picks"] = picks
    over = picks_over_limit(picks, limit)
    if over:
        st.warning(md_text(over), icon=":material/select:")
    layer_picker(st, "Picked layers", n, key="ls_cka_picks", on_change=_picks_changed,
                 max_selections=max(limit, len(picks)),      # at most k, as a click or a box; more from elsewhere: no more
                 placeholder="none yet: click cells or drag a box on the heatmap",
                 help=f"Click a cell to pick its row and column layer, click it again to unpick; type a layer and "
                      f"Enter to pick it, or remove a layer here. At most the set size k = {limit} (Layer sets page)")
    st.page_link("app_pages/layer_sets.py", label="Use them on Layer sets", icon=":material/arrow_forward:")

    with st.expander("CKA matrix as a table"):
        df = pd.DataFrame(matrix, index=[f"L{i}" for i in range(n + 1)], columns=[f"L{j}" for j in range(n + 1)]).round(4)
        table(df, key="ls_cka_table", filename=f"cka-{kernel}-{kind}", hide_index=False)
