"""The Speculative decoding page's larger blocks: the live panels of its jobs, a benchmark run's and a study's
results, the engine export. They draw; what they show comes from `ui.speculate` (tables, labels, lines) and
the backend. The page (app_pages/speculate.py) keeps its forms and the order of things.
"""

from __future__ import annotations

import streamlit as st

from layerscope import eta, fmt
from layerscope.decoding import sanity, specdec
from layerscope.decoding.bench import auto_note, interval_note, lookup_auto_note
from layerscope.draft import engines
from layerscope.draft.export.engine_export import engine_verdict, export_zip
from layerscope.draft.training.fit import TrainOptions
from layerscope.steps import forecast
from layerscope.study.recommend import set_label
from layerscope.ui import plots, speculate, tasks
from layerscope.ui.state import bind_view, commit
from layerscope.ui.widgets import (
    chart,
    estimate_caption,
    guard,
    highlighted_tokens,
    in_app_words,
    legend_html,
    md_text,
    number_field,
    offered,
    show_error,
    table,
)

# ---------------------------------------------------------------------------- live panels (views.live_job's details)

def train_details(v) -> None:
    """A training job's live numbers and curves: an online run's tokens and learning curves, a capture run's
    loss, accuracy and training curves."""
    m = v.metrics
    if speculate.is_online(m):
        if v.running and m.get("phase") == "train":
            a, b, c = st.columns(3)
            a.metric("Tokens seen", f"{m.get('tokens', 0):,}")
            b.metric("Tokens / s", f"{m.get('tokens_per_s', 0):.0f}")
            c.metric("Training", eta.text(m.get("eta_s")))
        curve = speculate.online_curves(v.series)
        if curve:
            chart(plots.learning_curves(curve), key=f"ls_spec_online_curve_{'live' if v.running else 'done'}",
                  filename="learning-curves")
        return
    hist = v.series.get("history", [])
    if v.running and m:
        a, b, c = st.columns(3)
        a.metric("Loss", f"{m.get('loss', float('nan')):.3f}")
        acc = m.get("accuracy") or []
        b.metric("Accuracy step 1", f"{acc[0]:.0%}" if acc else "—")
        c.metric("Tokens / s", f"{m.get('tokens_per_s', 0):.0f}")
    if len(hist) >= 2:
        chart(plots.training_curves(hist), key=f"ls_spec_train_curve_{'live' if v.running else 'done'}",
              filename="draft-training")


def bench_details(v) -> None:
    """A running benchmark: the contender decoding now, its running τ and speed, acceptance per draft position,
    τ per step, and the text with the accepted draft tokens highlighted."""
    if not v.running:
        return
    m = v.metrics
    live = m.get("live") or {}
    cur = m.get("contender")
    if not cur:
        return
    c = st.columns(5)
    c[0].markdown(f"**Decoding with**  \n{md_text(cur)}  \nprompt {m.get('prompt')}/{m.get('prompts_total')}")
    c[1].metric("τ this step", "—" if m.get("step_tau") is None else f"{m['step_tau']}")
    c[2].metric("Running τ", f"{live.get(cur, {}).get('tau') or 0:.3f}")
    c[3].metric("Tokens / s", f"{live.get(cur, {}).get('tokens_per_s') or 0:.1f}")
    c[4].metric("Speedup vs plain", "—" if m.get("speedup") is None else f"{m['speedup']:.2f}×")
    acc = speculate.live_acceptance(m)
    # one above the other, full width: side by side at 1024 px each had ~350 px and its labels were cut
    if acc:
        st.plotly_chart(plots.acceptance_bars(acc, title="Acceptance per draft position (live)"),
                        key="ls_spec_live_acc", config=plots.figure_config("acceptance-live"))
    taus = v.series.get(f"tau:{cur}", [])
    if taus:
        st.plotly_chart(plots.tau_over_time(taus[-400:], title=f"τ per step: {cur} (live)"),
                        key="ls_spec_live_tau", config=plots.figure_config("tau-live"))
    if m.get("text"):
        st.markdown(f"**Generating** ({fmt.escape(m.get('text_of'))}): " + legend_html(), unsafe_allow_html=True)
        st.markdown(highlighted_tokens(m["text"]), unsafe_allow_html=True)


def study_details(v) -> None:
    """A running study's phase."""
    if v.running:
        st.caption(f"Phase: {v.metrics.get('phase', 'starting')}")


# ---------------------------------------------------------------------------- drafts

def session_drafts(s, store, labels_of: dict[str, str], colors: dict) -> None:
    """The session's drafts: their table and learning curves, the engine export, the store's drafts that can be
    added, and the store's drafts that cannot be used."""
    st.subheader("Drafts of this session")
    if s.drafts:
        table(speculate.drafts_frame(s.drafts), key="ls_spec_drafts", filename="drafts")
        st.caption(speculate.SIMULATED_NOTE)
        collapsed = sanity.collapse_warning(s.drafts)
        if collapsed:
            st.warning(md_text(collapsed), icon=":material/warning:")
        curves, layers_of = speculate.draft_curves(s.drafts, labels_of)
        if curves:
            chart(plots.learning_curves(curves, layers=layers_of, colors=colors), key="ls_spec_learning_curves",
                  filename="learning-curves")
            st.caption("Held-out agreement at the first draft position (every position counts: the estimate of "
                       "decoding acceptance) as each draft saw more tokens. Sets trained in one online pass saw the "
                       "same data in the same order, so their curves compare directly.")
    else:
        st.caption("None yet: train one, or add one the store already holds.")
    if s.drafts:
        engine_export(s, labels_of)
    fp = (s.capture or {}).get("fingerprint")
    with guard("stored drafts"):
        stored = speculate.stored_choices(tasks.stored_drafts(store, fingerprint=fp), s.drafts, s.capture_key)
        if stored:
            offered("ls_spec_stored", stored)      # a draft added a moment ago has left the list
            p = st.selectbox("Trained drafts in the store for this model", list(stored), format_func=lambda x: stored[x][1],
                             key="ls_spec_stored")
            if st.button("Add to this session", key="ls_spec_add_stored", icon=":material/add:"):
                s.drafts.append(stored[p][0])
                commit(s)
                st.rerun()
        broken = tasks.broken_drafts(store)
        if broken:      # listed, not hidden: what is wrong and the fix (plain text: keys and paths are not Markdown)
            st.text(speculate.broken_text(broken))


def engine_export(s, labels_of: dict[str, str]) -> None:
    """The expander that builds a draft's folder for a serving engine (what `layerscope export --for` writes)."""
    with st.expander("Export a draft for a serving engine"):
        e1, e2 = st.columns(2)
        ex_path = e1.selectbox("Draft", list(labels_of), format_func=labels_of.get, key="ls_w_spec_export_draft",
                               on_change=bind_view(s, "export_draft", "ls_w_spec_export_draft", next(iter(labels_of)),
                                                   options=list(labels_of)))
        ex_engine = e2.selectbox("Engine", engines.ENGINES, key="ls_w_spec_export_engine",
                                 on_change=bind_view(s, "export_engine", "ls_w_spec_export_engine", engines.ENGINES[0],
                                                     options=list(engines.ENGINES)),
                                 help="The folder `layerscope export --for ENGINE` writes, with COMMANDS.md")
        with guard("engine export"):
            verdict = engine_verdict(ex_path, ex_engine)
            if verdict["refusal"]:
                show_error(f"{ex_engine} cannot take this draft: {verdict['refusal']}",
                           "Pick another engine, or train a draft on a layer set this engine takes")
            else:
                for note in verdict["notes"]:
                    st.text(f"Note: {note}")
                if st.button("Build the export", key="ls_spec_export_build", icon=":material/package_2:"):
                    name, data = export_zip(ex_path, ex_engine)
                    st.session_state["ls_spec_export"] = {"for": (ex_path, ex_engine), "name": name, "data": data}
                built = st.session_state.get("ls_spec_export")
                if built and built["for"] == (ex_path, ex_engine):
                    st.download_button(f"Download {built['name']}", data=built["data"], file_name=built["name"],
                                       mime="application/zip", key="ls_spec_export_download", on_click="ignore",
                                       icon=":material/download:")


# ---------------------------------------------------------------------------- results

def bench_run(s, i: int, colors: dict) -> None:
    """Benchmark run `i` of the session: its table, notes and warnings, then τ and speedup, acceptance per
    draft position, the cost curve and the per-category table."""
    res = s.bench_results[i]
    rows = res.get("results", [])
    df, _ = speculate.bench_frame(res, s.drafts)
    table(df, key="ls_spec_bench_table", filename=f"benchmark-{i + 1}")
    st.caption(md_text(interval_note(res["intervals"])) if res.get("intervals")
               else "No intervals: this run had a single prompt, or was saved before benchmarks kept per-prompt totals.")
    for r in rows:
        if r.get("chosen"):
            st.markdown(md_text(in_app_words(auto_note(r))))
        elif r.get("verdict"):
            st.caption(md_text(f"{r['name']}: {r['verdict']}"))
        if r.get("lookup_auto"):
            st.caption(md_text(in_app_words(lookup_auto_note(r))))
    for level, text in speculate.run_warnings(res, s.drafts):        # the report says the same (ui/report.py)
        if level == "note":
            st.caption(md_text(text))
        else:
            (st.error if level == "error" else st.warning)(md_text(text), icon=":material/warning:")
    # τ and speedup span the page (two panels of contender names: at half width they were cramped)
    chart(plots.bench_comparison(rows, colors=colors), key="ls_spec_bench_cmp", filename=f"benchmark-{i + 1}-tau-speedup")
    g1, g2 = st.columns(2)
    with g1:
        acc, layers_of = speculate.acceptance_of(rows)
        if acc:
            chart(plots.acceptance_bars(acc, layers=layers_of, colors=colors),
                  key="ls_spec_bench_acc", filename=f"benchmark-{i + 1}-acceptance")
    with g2:
        if res.get("cost_curve"):
            measured = next((r for r in rows if r.get("draft_step_seconds") is not None), None)
            chart(plots.cost_curve(res["cost_curve"], steps=rows,     # the draft step Home and the verdicts use
                                   draft_step_seconds=(measured or res).get("draft_step_seconds")),
                  key="ls_spec_bench_cost", filename=f"benchmark-{i + 1}-cost-curve")
    cdf = speculate.category_frame(rows)
    if cdf is not None:
        with st.expander("Per prompt category"):
            table(cdf, key="ls_spec_bench_cat", filename=f"benchmark-{i + 1}-categories")


# ---------------------------------------------------------------------------- the study

def study_form(s, store, manager, stats, n: int, *, ttt, seed) -> None:
    """The study's options, the sets it will train (with its estimate) and the button that starts it; the TTT
    steps and seed are the training form's."""
    q1, q2, q3 = st.columns(3)         # two rows: five labels a row wrapped at 1024 px
    q4, q5, _ = st.columns(3)
    st_k = number_field(q1, "Layers per set (k)", min_value=1, max_value=max(1, n), key="ls_w_study_k",
                           on_change=bind_view(s, "study_k", "ls_w_study_k", min(3, max(1, n)), clamp=(1, max(1, n))))
    st_steps = number_field(q2, "Steps (each)", min_value=1, max_value=1_000_000, key="ls_w_study_steps",
                               on_change=bind_view(s, "study_steps", "ls_w_study_steps", tasks.train_defaults().steps,
                                                   clamp=(1, 1_000_000)),
                               help="Training steps of every draft of the study: one budget for all")
    st_src = q3.selectbox("Prompt set", ["sharegpt-heldout", "builtin"], key="ls_w_study_src",
                          on_change=bind_view(s, "study_prompts", "ls_w_study_src", "sharegpt-heldout",
                                              options=["sharegpt-heldout", "builtin"]))
    st_n = number_field(q4, "Study prompts", min_value=1, max_value=500, key="ls_w_study_n",
                           on_change=bind_view(s, "study_n", "ls_w_study_n", 8, clamp=(1, 500)))
    st_new = number_field(q5, "Study new tokens", min_value=1, max_value=2048, key="ls_w_study_new",
                             on_change=bind_view(s, "study_new", "ls_w_study_new", 48, clamp=(1, 2048)))
    with guard("study sets"):
        options = tasks.study_options(s.layer_sets, k=int(st_k),
                                      train=TrainOptions(steps=int(st_steps), ttt_steps=int(ttt), seed=int(seed)),
                                      prompts=st_src, limit=int(st_n), max_new_tokens=int(st_new),
                                      depth=int(st.session_state.get("ls_w_spec_bench_k") or specdec.DEFAULT_K))
        plan = tasks.study_plan(stats, options)
        st.markdown("Sets in the study: " + " · ".join(
            f"**{md_text(set_label(names, layers, s.layer_sets))}** `{fmt.layers(layers)}`" for layers, names in plan))
        estimate_caption(lambda: forecast.study(store, s.model, options, sets=len(plan)))
        study_running = any(j.kind == "study" for j in manager.active(s.id))
        if st.button("Run the study", type="primary", key="ls_spec_study", icon=":material/science:",
                     disabled=study_running or len(plan) < 2):
            manager.submit(s.id, "study", tasks.study_job(store=store, capture_key=s.capture_key, model=s.model,
                                                          options=options, analysis_options=s.analysis_options),
                           title=f"Study of {len(plan)} layer sets")
            st.rerun()


def study(s, i: int, colors: dict) -> None:
    """Study `i` of the session: what it ran, its verdict, the table and correlations, τ with its intervals,
    τ against each proxy, the learning curves, and τ and speedup per set."""
    res = s.study[i]
    rows = res["rows"]
    st.markdown(md_text(speculate.study_heading(res, i, len(s.study))))
    if res.get("verdict"):
        st.info(md_text(res["verdict"]), icon=":material/gavel:")
    table(speculate.study_frame(rows, s.layer_sets), key="ls_spec_study_table", filename="study")
    st.caption("[lo, hi]: 95% paired bootstrap intervals over the prompts; seed range: max − min of τ over the "
               "training seeds; mean CKA n/a: a one-layer set has no pair of layers. " + speculate.SIMULATED_NOTE)
    cdf = speculate.correlations_frame(res)
    if cdf is not None:
        table(cdf, key="ls_spec_study_corr", filename="study-correlations")
    if any(r.get("tau_ci") for r in rows):
        chart(plots.study_intervals(rows, colors=colors), key="ls_spec_study_ci", filename="study-tau-intervals")
    versions = list(rows[0].get("proxies") or {}) if rows else []
    if versions:
        version = st.selectbox("Proxy version (kernel, token-entropy filter)", versions, key="ls_w_study_version",
                               on_change=bind_view(s, "study_version", "ls_w_study_version", versions[0], options=versions))
        chart(plots.study_proxies(rows, version, correlations=res.get("correlations") or [], colors=colors),
              key="ls_spec_study_proxies", filename="study-tau-vs-proxies")
    curves, layers_of = speculate.study_curves(rows, s.layer_sets)
    if curves:
        chart(plots.learning_curves(curves, layers=layers_of, colors=colors,
                                    title="Study: held-out agreement per set as the drafts saw more tokens"),
              key="ls_spec_study_curves", filename="study-learning-curves")
        st.caption("First training seed. Sets trained in one online pass saw the same data in the same order.")
    corr = res.get("spearman") or {}
    st.markdown("**Spearman correlation with τ** over the sets: " + md_text(speculate.spearman_text(corr))
                + ("  \n(n/a: fewer than 3 sets, or a constant column)" if any(v is None for v in corr.values()) else ""))
    for w in sanity.study_warnings(rows, int(res.get("prompts") or 0)):
        st.warning(md_text(w), icon=":material/warning:")
    chart(plots.bench_comparison(speculate.study_bench_rows(rows, s.layer_sets), title="Study: τ and speedup per layer set",
                                 colors=colors), key="ls_spec_study_chart", filename="study-tau-speedup")
