"""Layer sets: every strategy's set, the default rule's and a hand-picked one ranked on one scale, one recommended."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import plots
from layerscope import select as sel
from layerscope.ui import apply, recommend
from layerscope.ui.state import commit
from layerscope.ui.views import page_header, stats_or_progress
from layerscope.ui.widgets import chart, guard, md_text, table

s, store = page_header("Layer sets",
                       "Each strategy proposes the layers a draft should read. Every set, your own included, is ranked on "
                       "one scale: the aggregate entropy of its layers taken together (α = 2, nats). Mean entropy and mean "
                       "CKA explain the rank; each strategy's own objective is listed apart, since those are not comparable.")

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
    manual_name = st.session_state.get("ls_w_sets_name", "hand-picked").strip() or "hand-picked"

    selections = []
    with guard("layer-set comparison"):
        selections = sel.compare(layer_stats, int(k), lam=float(lam), layers=manual or None)
    if selections:
        rec = recommend.recommend(selections, n, names={"manual": manual_name})
        with st.container(border=True):
            st.markdown("**Recommendation**")
            st.text(rec.text)
            for flag in rec.best.flags:
                st.caption(f"Note: {flag}.")
        rows = [{"rank": r.rank, "set": r.name, "layers": r.layers, "aggregate entropy (nats)": r.aggregate_entropy,
                 "mean entropy": r.mean_entropy, "mean CKA": r.mean_cka,
                 "": ("★ recommended" if r is rec.best else "") + ("  ◆ default rule" if "default" in r.name.split(" = ") else ""),
                 "flags": "; ".join(f.split(",")[0] for f in r.flags)} for r in rec.ranked]
        df = pd.DataFrame(rows)
        table(df.round(4), key="ls_sets_table", filename=f"layer-sets-{s.capture_key or 'session'}",
              column_config={"layers": st.column_config.ListColumn("layers"),
                             "aggregate entropy (nats)": st.column_config.NumberColumn(
                                 help="The ranking score: α = 2 entropy of the set's layers together")})
        with st.expander("What the scores mean, and what good values look like"):
            st.markdown(
                f"- **Aggregate entropy** (α = 2, nats; the rank): how many directions the set's layers spread the tokens "
                f"over, taken together. Higher is better. It ranges from about the layers' own α = 2 entropy (the layers "
                f"are copies of each other) to that plus log k = {recommend.headroom(int(k)):.2f} nats for k = {int(k)} "
                f"(they share nothing). Compare it only between sets of one capture and one k.\n"
                f"- **Mean entropy** (α = {stats['alpha']:g}, nats): how informative each layer is on its own; at most "
                f"log min(tokens, d). The Entropy page shows the curve; a layer in a dip carries little.\n"
                "- **Mean CKA** between the set's layers (0..1): below about 0.5 they carry different information, "
                "above 0.9 they are near copies and a draft gains little from reading both.\n"
                "- **How this relates to τ**: these are proxies. EAGLE-3 drafts read low, middle and high layers because "
                "each adds something; whether a higher score gives a higher τ (accepted tokens per target forward) on "
                "this model is what the study on the Speculative decoding page measures (Spearman correlation).\n"
                f"- **Flags**: layer 0 is the embedding output; layer {n} (the final state) is not readable by a draft.")
        with st.expander("Each strategy's own objective (not comparable across strategies)"):
            own = [{"strategy": x.strategy, "layers": x.layers,
                    "objective": (x.explanation.get("objective") or {}).get("name"),
                    "value": (x.explanation.get("objective") or {}).get("value"),
                    "mRMR (λ)": x.explanation.get("mrmr"), "note": x.explanation.get("note") or ""} for x in selections]
            table(pd.DataFrame(own).round(4), key="ls_sets_own", filename="layer-sets-objectives",
                  column_config={"layers": st.column_config.ListColumn("layers")})

        a1, a2, a3 = st.columns([2, 1.2, 1])
        labels = [f"{x.strategy} {x.layers}" for x in selections]
        by_label = {label: (x.strategy, list(x.layers)) for label, x in zip(labels, selections)}
        to_add = a1.multiselect("Add to the session's sets to test", labels, key="ls_sets_to_add",
                                placeholder="choose one or more sets")
        a2.text_input("Name for the hand-picked set", value="hand-picked", key="ls_w_sets_name", max_chars=60)

        def _add(chosen=tuple(to_add), by_label=by_label, name=manual_name):
            for label in chosen:
                strategy, layers = by_label[label]
                s.add_layer_set(name if strategy == "manual" else strategy, layers, strategy=strategy)
            commit(s)
            st.session_state["ls_sets_to_add"] = []      # the sets are in; clear the chooser

        a3.button("Add", type="primary", key="ls_sets_add", disabled=not to_add, icon=":material/add:", on_click=_add)

        shown = [(r.name.split(" = ")[0], r.layers) for r in rec.ranked]
        t1, t2 = st.tabs(["Scores", "On the curves"])
        with t1:
            chart(plots.set_comparison([{"name": r.name.split(" = ")[0], "layers": r.layers,
                                         "aggregate_entropy": r.aggregate_entropy, "mean_entropy": r.mean_entropy,
                                         "mean_cka": r.mean_cka} for r in rec.ranked],
                                       metrics=("aggregate_entropy", "mean_entropy", "mean_cka"),
                                       title="Sets ranked by aggregate entropy"),
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
                               "aggregate entropy (nats)": e["aggregate_entropy"], "mean entropy": e["mean_entropy"],
                               "mean CKA": e["mean_cka"], "problem": ""})
            except Exception as err:  # a set that does not fit this capture: say so in the row
                scored.append({"name": x["name"], "strategy": x["strategy"], "layers": x["layers"],
                               "aggregate entropy (nats)": None, "mean entropy": None, "mean CKA": None,
                               "problem": str(err)})
        table(pd.DataFrame(scored).round(4), key="ls_sets_session", filename="session-layer-sets",
              column_config={"layers": st.column_config.ListColumn("layers")})
        r1, r2 = st.columns([3, 1])
        gone = r1.selectbox("Remove a set", [f"{x['name']} {x['layers']}" for x in s.layer_sets], key="ls_sets_rm_pick")
        if r2.button("Remove", key="ls_sets_rm", icon=":material/delete:"):
            idx = [f"{x['name']} {x['layers']}" for x in s.layer_sets].index(gone)
            s.remove_layer_set(s.layer_sets[idx]["layers"])
            commit(s)
            st.rerun()
