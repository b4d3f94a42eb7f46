"""Layer sets: every strategy's set, the default rule's and a hand-picked one ranked on one scale, one recommended."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import fmt
from layerscope.stats import select as sel
from layerscope.study import recommend
from layerscope.ui import plots, stats_access, tasks
from layerscope.ui.jobs import get_manager
from layerscope.ui.kernel import kernel_of
from layerscope.ui.labels import colors as palette_of
from layerscope.ui.picks import default_set_size, manual_layers
from layerscope.ui.state import bind_view, commit
from layerscope.ui.views import live_job, page_header, stats_or_progress
from layerscope.ui.widgets import chart, guard, layer_picker, md_text, number_field, table

s, store = page_header("Layer sets",
                       "Each strategy proposes the layers a draft should read. Sets of one size are ranked by evidence no "
                       "strategy optimises: measured τ (a study or benchmark), else trained drafts' held-out agreement, else "
                       "the probe. Entropy and CKA describe each set, but every strategy maximises one of them, so they "
                       "never rank the strategies.")

stats = stats_or_progress(s, store, key="sets")
if stats is not None:
    n = int(stats["num_layers"])
    layer_stats = stats_access.layer_stats(stats)
    colors = palette_of(s)
    c1, c2, c3 = st.columns([1.1, 1.1, 2.3])
    k = number_field(c1, "Set size k", min_value=1, max_value=n, key="ls_w_sets_k",
                        on_change=bind_view(s, "sets_k", "ls_w_sets_k", default_set_size(n), clamp=(1, n)),
                        help="Sets are ranked against sets of the same size only; the default is the default rule's size")
    lam = c2.slider("Redundancy λ", 0.0, 2.0, step=0.05, key="ls_w_sets_lam",
                    on_change=bind_view(s, "sets_lam", "ls_w_sets_lam", 0.5, clamp=(0.0, 2.0)),
                    help="greedy (mRMR) maximises normalized entropy − λ · mean CKA to the layers already chosen")

    def _manual_changed():
        s.manual_picks = sorted(int(x) for x in st.session_state["ls_sets_manual"])
        commit(s)

    st.session_state["ls_sets_manual"] = manual_layers(s)       # picks always fit (apply clears those that do not)
    manual = layer_picker(c3, f"Hand-picked set (layers 0..{n - 1}; pre-filled by clicks on the CKA heatmap)", n,
                          key="ls_sets_manual", on_change=_manual_changed)
    name_changed = bind_view(s, "sets_name", "ls_w_sets_name", "hand-picked")
    manual_name = str(st.session_state.get("ls_w_sets_name") or "").strip() or "hand-picked"

    selections, rec = [], None
    with guard("layer-set comparison"):
        rec, selections = recommend.for_session(s, stats, int(k), lam=float(lam), manual=manual, manual_name=manual_name)
    if rec is not None:
        with st.container(border=True):
            st.markdown("**Recommendation**")
            said = rec.text.replace(" " + rec.disagreement, "") if rec.disagreement else rec.text
            st.markdown(md_text(said))
            if rec.disagreement:
                st.warning(md_text(rec.disagreement), icon=":material/compare_arrows:")
            for flag in (rec.best.flags if rec.best else []):
                st.caption(f"Note: {md_text(flag)}.")
            unscored = [r.layers for r in rec.ranked + rec.other_sizes if r.probe is None]
            if stats_access.capture_available(s, store) and s.model:
                p1 = st.container(horizontal=True, vertical_alignment="center")
                running = any(j.kind == "probe" for j in get_manager().active(s.id))
                if p1.button("Score the sets with the probe", key="ls_sets_probe", icon=":material/query_stats:",
                             disabled=running or not unscored, width="content"):
                    with guard("start the probe"):
                        get_manager().submit(s.id, "probe", tasks.probe_job(store=store, capture_key=s.capture_key,
                                                                             model=s.model, sets=unscored),
                                             title=f"Probe of {len(unscored)} layer set(s)")
                        st.rerun()
                p1.caption("A closed-form ridge map per set from its layers' states to the target's final state, "
                           "scored by how often it gives the target's next token on held-out conversations: evidence "
                           "no strategy optimises, without training a draft"
                           + ("" if unscored else " (every set here has its score)") + ".")
                too_few = recommend.probe_note((s.capture or {}).get("conversations"))
                if too_few:
                    st.warning(md_text(too_few), icon=":material/info:")
                probe_job = get_manager().latest(s.id, "probe")
                if recommend.probe_job_current(probe_job.view() if probe_job else None, int(k)):
                    live_job(s.id, "probe", key="sets_probe")

        def row_of(r):
            """One set's row: the evidence first (short headers: the table fits 1024 px), then the proxies."""
            tau = fmt.interval(r.tau, r.tau_ci, "tau") if r.tau is not None else None
            if tau and rec.basis == "τ" and r.tau_source != rec.source:
                tau += f" ({r.tau_source})"          # measured elsewhere than the ranking's source
            marks = ("★ " if r is rec.best else "") + r.name.replace(" = ", ", ") + (" ◆" if r.is_default else "")
            return {"rank": r.rank, "set": marks, "layers": fmt.layers(r.layers),
                    "draft": recommend.draft_text(r),     # whose figures: one draft's to a row
                    "τ [95% CI]": tau,
                    "agreement": fmt.percent(r.agreement) if r.agreement is not None else None,
                    "trained on": f"{fmt.count(r.budget)} tok" if r.budget else None,
                    "probe [95% CI]": fmt.interval(r.probe, r.probe_ci, "percent") if r.probe is not None else None,
                    "aggr. entropy": r.aggregate_entropy, "mean entropy": r.mean_entropy,
                    "mean CKA": r.mean_cka, "flags": "; ".join(f.split(":")[0] for f in r.flags)}

        st.markdown(f"**Sets of {int(k)} layers**, ranked by "
                    + (f"{rec.basis} ({md_text(rec.source)})" if rec.basis else "nothing yet: no evidence tells them apart"))
        table(pd.DataFrame([row_of(r) for r in rec.ranked]), key="ls_sets_table",
              filename=f"layer-sets-{s.capture_key or 'session'}", na={"mean CKA": fmt.NOT_APPLICABLE},
              column_config={
                  "τ [95% CI]": st.column_config.TextColumn("τ [95% CI]", alignment="right",
                                                            help="Measured τ with its 95% interval"),
                  "agreement": st.column_config.TextColumn("agreement", alignment="right",
                                                           help="A trained draft's held-out agreement at position 1"),
                  "trained on": st.column_config.TextColumn(
                      "trained on", alignment="right",
                      help="The draft's training tokens: agreement is compared only between drafts of one budget"),
                  "probe [95% CI]": st.column_config.TextColumn(
                      "probe [95% CI]", alignment="right",
                      help="The closed-form probe's held-out agreement, with a 95% bootstrap interval over the "
                           "held-out conversations"),
                  "aggr. entropy": st.column_config.TextColumn(
                      "aggr. entropy", alignment="right",
                      help="Aggregate entropy (nats): describes the set (α = 2 entropy of its layers together); the "
                           "aggregate strategy maximises it, so it does not rank")})
        sources = sorted({r.tau_source for r in rec.ranked if r.tau_source})
        st.caption("★ recommended · ◆ the default rule [2, N//2, N−3] · rank: by the evidence named above, sets "
                   "the evidence cannot tell apart ranked level (a tie); — where that evidence did not measure the set"
                   + (f" · τ measured in {', '.join(sources)}" if sources and rec.basis != "τ" else "") + ".")
        if rec.other_sizes:
            with st.expander(f"{len(rec.other_sizes)} set(s) of another size (not ranked with sets of {int(k)} layers)"):
                table(pd.DataFrame([row_of(r) for r in rec.other_sizes]).drop(columns=["rank"]), key="ls_sets_other",
                      filename="layer-sets-other-sizes", na={"mean CKA": fmt.NOT_APPLICABLE})
        with st.expander("What the columns mean, and what good values look like"):
            st.markdown(
                "- **τ** (tokens per target forward, with its 95% interval): what decoding with a draft reading the set "
                "achieved. Above the break-even τ of this machine (Home page) the draft speeds decoding up.\n"
                "- **Held-out agreement**: how often a trained draft's first proposal is the target's own choice on "
                "conversations it never saw: the estimate of first-position acceptance. Near 0: it has not learned.\n"
                "- **Probe agreement**: the same for a closed-form ridge map of the set's states (no training): a quick "
                "first look.\n"
                f"- **Aggregate entropy** (α = 2, nats): how many directions the set's layers spread the tokens over, "
                f"together; from about the layers' own α = 2 entropy (copies) to that plus log k = "
                f"{recommend.headroom(int(k)):.2f} nats for k = {int(k)} (they share nothing).\n"
                f"- **Mean entropy** (α = {stats['alpha']:g}, nats): how informative each layer is on its own.\n"
                "- **Mean CKA** between the set's layers (0..1; n/a for one layer): below about 0.5 they carry different "
                "information, above 0.9 they are near copies.\n"
                "- The proxies describe; they do not rank: `aggregate` maximises aggregate entropy, `entropy-topk` mean "
                "entropy, `greedy` a mix of both, so ranking by one of them crowns its own strategy. Whether a proxy "
                "predicts τ on this model is what the study measures (Spearman correlation).\n"
                f"- **Flags**: layer 0 is the embedding output; layer {n} (the final state) is not readable by a draft.")
        with st.expander("Each strategy's own objective (not comparable across strategies)"):
            own = [{"strategy": fmt.strategy(x.strategy), "layers": fmt.layers(x.layers),
                    "objective": fmt.name((x.explanation.get("objective") or {}).get("name")),
                    "value": (x.explanation.get("objective") or {}).get("value"),
                    "mRMR (λ)": x.explanation.get("mrmr"), "note": x.explanation.get("note") or ""} for x in selections]
            table(pd.DataFrame(own), key="ls_sets_own", filename="layer-sets-objectives")

        a1, a2, a3 = st.columns([1.8, 1.5, 0.8])
        labels = [f"{fmt.strategy(x.strategy)} {fmt.layers(x.layers)}" for x in selections]
        by_label = {label: (x.strategy, list(x.layers)) for label, x in zip(labels, selections)}
        to_add = a1.multiselect("Add to the session's sets to test", labels, key="ls_sets_to_add",
                                placeholder="choose one or more sets")
        a2.text_input("Hand-picked set's name", key="ls_w_sets_name", max_chars=60, on_change=name_changed)

        def _add(chosen=tuple(to_add), by_label=by_label, name=manual_name):
            for label in chosen:
                strategy, layers = by_label[label]
                s.add_layer_set(name if strategy == "manual" else strategy, layers, strategy=strategy)
            commit(s)
            st.session_state["ls_sets_to_add"] = []      # the sets are in; clear the chooser

        a3.button("Add", type="primary", key="ls_sets_add", disabled=not to_add, icon=":material/add:", on_click=_add)

        distinct = [r for i, r in enumerate(rec.ranked)                      # a set once, whatever its drafts
                    if all(x.layers != r.layers for x in rec.ranked[:i])]
        shown = [(r.name.split(" = ")[0], r.layers) for r in distinct]
        t1, t2 = st.tabs(["Proxies", "On the curves"])
        with t1:
            chart(plots.set_comparison([{"name": r.name.split(" = ")[0], "layers": r.layers,
                                         "aggregate_entropy": r.aggregate_entropy, "mean_entropy": r.mean_entropy,
                                         "mean_cka": r.mean_cka} for r in distinct],
                                       metrics=("aggregate_entropy", "mean_entropy", "mean_cka"),
                                       title=f"Proxies of the sets of {int(k)} layers (they describe, they do not rank)",
                                       colors=colors),
                  key="ls_sets_cmp", filename="layer-sets-proxies")
        with t2:
            chart(plots.entropy_curve({"entropy": stats["entropy"]}, sets=shown, title="Sets on the entropy curve",
                                      final_state=stats.get("final_state", "post-norm"), colors=colors),
                  key="ls_sets_curve", filename="layer-sets-entropy")
            chart(plots.cka_heatmap(stats["cka"], compartments=stats.get("compartments"), sets=shown,
                                    title=f"Sets on the CKA heatmap ({kernel_of(stats)} kernel)",
                                    final_state=stats.get("final_state", "post-norm"), colors=colors),
                  key="ls_sets_heat", filename="layer-sets-cka")

    st.subheader("Sets to test in this session")
    if not s.layer_sets:
        st.caption("None yet: add sets above. The Speculative decoding page trains and benchmarks a draft for each.")
    else:
        scored = []
        for x in s.layer_sets:
            try:
                e = sel.score_set(layer_stats, x["layers"], lam=float(lam))
                scored.append({"name": x["name"], "strategy": fmt.strategy(x["strategy"]),
                               "layers": fmt.layers(x["layers"]), "aggr. entropy": e["aggregate_entropy"],
                               "mean entropy": e["mean_entropy"],
                               "mean CKA": e["mean_cka"] if len(x["layers"]) > 1 else None, "problem": ""})
            except Exception as err:  # a set that does not fit this capture: say so in the row
                scored.append({"name": x["name"], "strategy": fmt.strategy(x["strategy"]),
                               "layers": fmt.layers(x["layers"]), "aggr. entropy": None, "mean entropy": None,
                               "mean CKA": None, "problem": str(err)})
        table(pd.DataFrame(scored), key="ls_sets_session", filename="session-layer-sets",
              na={"mean CKA": fmt.NOT_APPLICABLE})
        r1, r2 = st.columns([3, 1])
        gone = r1.selectbox("Remove a set", [f"{x['name']} {fmt.layers(x['layers'])}" for x in s.layer_sets],
                            key="ls_sets_rm_pick")
        if r2.button("Remove", key="ls_sets_rm", icon=":material/delete:"):
            idx = [f"{x['name']} {fmt.layers(x['layers'])}" for x in s.layer_sets].index(gone)
            s.remove_layer_set(s.layer_sets[idx]["layers"])
            commit(s)
            st.rerun()
