"""Layer sets: a hand-picked set beside every automatic strategy and the default rule, on one scale."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import plots
from layerscope import select as sel
from layerscope.ui import apply
from layerscope.ui.state import commit
from layerscope.ui.views import page_header, stats_or_progress
from layerscope.ui.widgets import chart, guard, table

s, store = page_header("Layer sets",
                       "Each strategy proposes the layers a draft should read; every set, your own included, is scored the same "
                       "way: mean entropy (informative), mean pairwise CKA (redundant), aggregate entropy of the set taken "
                       "together (α = 2, nats; the common score) and the mRMR objective (mean normalized entropy − λ·mean CKA).")

stats = stats_or_progress(s, store, key="sets")
if stats is not None:
    n = int(stats["num_layers"])
    layer_stats = apply.layer_stats(stats)
    c1, c2, c3 = st.columns([1, 1, 2.5])
    k = c1.number_input("Layers per set (k)", min_value=1, max_value=n, value=min(3, n), step=1, key="ls_w_sets_k")
    lam = c2.slider("Redundancy weight λ", 0.0, 2.0, 0.5, 0.05, key="ls_w_sets_lam",
                    help="greedy (mRMR) maximises normalized entropy − λ · mean CKA to the layers already chosen")

    def _manual_changed():
        s.manual_picks = sorted(int(x) for x in st.session_state["ls_sets_manual"])
        commit(s)

    st.session_state["ls_sets_manual"] = [l for l in apply.manual_layers(s) if l < n]
    manual = c3.multiselect(f"Hand-picked set (layers 0..{n - 1}; pre-filled by clicks on the CKA heatmap)",
                            list(range(n)), key="ls_sets_manual", on_change=_manual_changed)

    selections = []
    with guard("layer-set comparison"):
        selections = sel.compare(layer_stats, int(k), lam=float(lam), layers=manual or None)
    if selections:
        rows = []
        for x in selections:
            e = x.explanation
            obj = e.get("objective") or {}
            rows.append({
                "strategy": x.strategy, "layers": x.layers,
                "mean entropy": e["mean_entropy"], "mean norm. entropy": e["mean_entropy_normalized"],
                "mean CKA": e["mean_cka"], "aggregate entropy": e["aggregate_entropy"], "mRMR": e["mrmr"],
                "objective": f"{obj.get('name')} = {obj['value']:.4g}" if isinstance(obj.get("value"), (int, float)) else obj.get("name"),
                "note": e.get("note", ""),
            })
        df = pd.DataFrame(rows)
        table(df.round(4), key="ls_sets_table", filename=f"layer-sets-{s.capture_key or 'session'}",
              column_config={"layers": st.column_config.ListColumn("layers")})

        a1, a2, a3 = st.columns([2, 1.2, 1])
        labels = [f"{x.strategy} {x.layers}" for x in selections]
        by_label = {label: (x.strategy, list(x.layers)) for label, x in zip(labels, selections)}
        to_add = a1.multiselect("Add to the session's sets to test", labels, key="ls_sets_to_add",
                                placeholder="choose one or more sets")
        manual_name = a2.text_input("Name for the hand-picked set", value="manual", key="ls_w_sets_name")

        def _add(chosen=tuple(to_add), by_label=by_label, name=manual_name):
            for label in chosen:
                strategy, layers = by_label[label]
                s.add_layer_set((name.strip() or "manual") if strategy == "manual" else strategy, layers, strategy=strategy)
            commit(s)
            st.session_state["ls_sets_to_add"] = []      # the sets are in; clear the chooser

        a3.button("Add", type="primary", key="ls_sets_add", disabled=not to_add, icon=":material/add:", on_click=_add)

        shown = [(x.strategy if x.strategy != "manual" else (manual_name.strip() or "manual"), x.layers) for x in selections]
        t1, t2 = st.tabs(["Scores", "On the curves"])
        with t1:
            chart(plots.set_comparison([{"name": r["strategy"], "layers": r["layers"], "mean_entropy": r["mean entropy"],
                                         "mean_cka": r["mean CKA"], "aggregate_entropy": r["aggregate entropy"],
                                         "objective": r["mRMR"]} for r in rows],
                                       metrics=("mean_entropy", "mean_cka", "aggregate_entropy", "objective"),
                                       title="Sets compared (objective = mRMR)"),
                  key="ls_sets_cmp", filename="layer-sets-scores")
        with t2:
            chart(plots.entropy_curve({"entropy": stats["entropy"]}, sets=shown, title="Sets on the entropy curve",
                                      final_state=stats.get("final_state", "post-norm")),
                  key="ls_sets_curve", filename="layer-sets-entropy")
            chart(plots.cka_heatmap(stats["cka"], compartments=stats.get("compartments"), sets=shown,
                                    title="Sets on the CKA heatmap", final_state=stats.get("final_state", "post-norm")),
                  key="ls_sets_heat", filename="layer-sets-cka")

    st.subheader("Sets to test in this session")
    if not s.layer_sets:
        st.caption("None yet: add sets above. The Speculative decoding page trains and benchmarks a draft for each.")
    else:
        scored = []
        for x in s.layer_sets:
            try:
                e = sel.score_set(layer_stats, x["layers"], lam=float(lam))
                scored.append({"name": x["name"], "strategy": x["strategy"], "layers": x["layers"],
                               "mean entropy": e["mean_entropy"], "mean CKA": e["mean_cka"],
                               "aggregate entropy": e["aggregate_entropy"], "mRMR": e["mrmr"]})
            except Exception as err:  # a set that does not fit this capture: say so in the row
                scored.append({"name": x["name"], "strategy": x["strategy"], "layers": x["layers"], "mean entropy": None,
                               "mean CKA": None, "aggregate entropy": None, "mRMR": None, "problem": str(err)})
        table(pd.DataFrame(scored).round(4), key="ls_sets_session", filename="session-layer-sets",
              column_config={"layers": st.column_config.ListColumn("layers")})
        r1, r2 = st.columns([3, 1])
        gone = r1.selectbox("Remove a set", [f"{x['name']} {x['layers']}" for x in s.layer_sets], key="ls_sets_rm_pick")
        if r2.button("Remove", key="ls_sets_rm", icon=":material/delete:"):
            idx = [f"{x['name']} {x['layers']}" for x in s.layer_sets].index(gone)
            s.remove_layer_set(s.layer_sets[idx]["layers"])
            commit(s)
            st.rerun()
