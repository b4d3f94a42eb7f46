"""Compare: two captures side by side (entropy curves, CKA difference) and the session's runs in one table."""

from __future__ import annotations

from dataclasses import asdict

import streamlit as st

from layerscope.stats.analysis import AnalysisOptions
from layerscope.ui import compare, plots, speculate
from layerscope.ui.labels import colors, draft_labels, run_label
from layerscope.ui.state import bind_view
from layerscope.ui.views import live_job, page_header
from layerscope.ui.widgets import chart, guard, job_status, md_text, table, wait_briefly

s, store = page_header("Compare captures and runs",
                       "Two captures (two models, two prompt sets, two seeds) under this session's analysis options "
                       "(set on the Entropy page): their entropy curves on one figure and the difference of their CKA "
                       "matrices. Below, every benchmark, study and draft of this session with the capture it came from.")

opts = {**asdict(AnalysisOptions()), **s.analysis_options}
by_key = {}
with guard("captures"):
    by_key = {c["key"]: c for c in compare.capture_choices(s, store)}
    keys = list(by_key)
    damaged = compare.damaged_captures(store)
    if damaged:           # left out, and said: a listing never hides damage (plain text: keys and problems)
        st.text(f"Left out, damaged ({len(damaged)}):\n"
                + "\n".join(f"  {c['key']}: {c['problem']}. {c.get('fix') or ''}" for c in damaged))
    if len(keys) < 2:
        st.info(f"Comparing needs two captures; this store holds {len(keys)}. Run another capture on the **Capture** "
                "page (another model, prompt set or seed), then come back.", icon=":material/info:")
        st.page_link("app_pages/capture.py", label="Go to Capture", icon=":material/arrow_forward:")
    else:
        default_a, default_b = compare.default_pair(keys, s.capture_key)
        # the choices live in the session (s.view), so they survive leaving the page and coming back
        on_a = bind_view(s, "cmp_a", "ls_w_cmp_a", default_a, options=keys)
        on_b = bind_view(s, "cmp_b", "ls_w_cmp_b", default_b, options=keys)
        c1, c2 = st.columns(2)
        key_a = c1.selectbox("Capture A", keys, key="ls_w_cmp_a", on_change=on_a,
                             format_func=lambda k: compare.capture_label(by_key[k]))
        key_b = c2.selectbox("Capture B", keys, key="ls_w_cmp_b", on_change=on_b,
                             format_func=lambda k: compare.capture_label(by_key[k]))
        st.caption(f"Statistics under this session's options: threshold {float(opts.get('min_entropy') or 0):.2f} nats · "
                   f"α = {float(opts['alpha']):g} · {md_text(opts['kernel'])} kernel · "
                   f"{'response tokens only' if opts['response_only'] else 'all tokens'} · at most "
                   f"{opts['max_tokens'] or 'all'} tokens. Change them on the Entropy page.")
        if key_a == key_b:
            st.warning("A and B are the same capture: every difference is 0. Pick another capture for B.",
                       icon=":material/warning:")

        got = {}
        for slot, key in zip(compare.SLOTS, (key_a, key_b)):
            stats, job = compare.stats_of(s, store, slot, key, s.analysis_options)
            if job is not None and job.view().running:
                wait_briefly(job)            # cached statistics come back at once: no progress bar flash
                stats, job = compare.stats_of(s, store, slot, key, s.analysis_options)
            if stats is not None:
                got[slot] = stats
            elif job is not None and job.view().running:
                live_job(s.id, job.kind, key=f"cmp_{slot}")
            elif job is not None:
                job_status(job.view(), key=f"cmp_{slot}")
                if st.button(f"Compute capture {slot}'s statistics again", key=f"ls_cmp_retry_{slot}",
                             icon=":material/refresh:"):
                    compare.compute(s, store, slot, key, s.analysis_options)
                    st.rerun()
            else:
                st.warning(f"Capture {slot} ({key}) is not in this store and has no statistics here.",
                           icon=":material/warning:")

        if len(got) == 2:
            a, b = got["A"], got["B"]
            n_a, n_b = int(a["num_layers"]), int(b["num_layers"])
            name_a = f"A: {by_key[key_a].get('model')} · {by_key[key_a].get('prompt_set')}"
            name_b = f"B: {by_key[key_b].get('model')} · {by_key[key_b].get('prompt_set')}"
            for slot, st_ in (("A", a), ("B", b)):
                if st_.get("requested", s.analysis_options) != s.analysis_options:
                    st.caption(f"Capture {slot}: the statistics saved with the session (its capture is not in this "
                               "store), computed under other options.")
            v1, v2 = st.columns(2)
            scale = v1.radio("Entropy scale", ["raw (nats)", "normalized"], horizontal=True, key="ls_w_cmp_scale",
                             on_change=bind_view(s, "entropy_scale", "ls_w_cmp_scale", "raw (nats)"),
                             help="normalized = entropy / log min(n, d): comparable across hidden sizes and token counts")
            kinds = ["biased", "debiased"] if a.get("cka_debiased") and b.get("cka_debiased") else ["biased"]
            on_kind = bind_view(s, "cka_estimator", "ls_w_cmp_kind", "biased")
            if st.session_state.ls_w_cmp_kind not in kinds:
                st.session_state.ls_w_cmp_kind = "biased"
            estimator = v2.radio("CKA estimator", kinds, horizontal=True, key="ls_w_cmp_kind", on_change=on_kind)
            norm = scale == "normalized"

            fig = plots.entropy_overlay({name_a: compare.entropy_of(a, norm), name_b: compare.entropy_of(b, norm)},
                                        y_title="normalized entropy" if norm else "entropy (nats)",
                                        final_states=[a.get("final_state", "post-norm"), b.get("final_state", "post-norm")])
            chart(fig, key="ls_cmp_entropy", filename=f"entropy-{key_a}-vs-{key_b}")
            if n_a != n_b:
                st.caption(f"A has {n_a} layers, B {n_b}: both curves are drawn against relative depth layer / N "
                           "(0 = embeddings, 1 = the final state).")

            kernel = compare.kernel_of(a)
            reason = compare.no_difference_reason(n_a, n_b)
            if compare.kernel_of(b) != kernel:
                st.warning(f"A's statistics use the {kernel} kernel, B's the {compare.kernel_of(b)} kernel: their CKA "
                           "values are not on one footing.", icon=":material/warning:")
            if reason is None:
                d = compare.cka_difference(compare.cka_of(a, estimator), compare.cka_of(b, estimator))
                m = st.columns(3)
                m[0].metric("Mean |ΔCKA|", f"{d.mean_abs:.4f}", help="over all layer pairs i < j")
                m[1].metric("Max |ΔCKA|", f"{d.max_abs:.4f}", help=f"A − B = {d.signed:+.4f} at that pair")
                m[2].metric("Where", f"layers {d.where[0]} × {d.where[1]}")
                chart(plots.cka_difference_heatmap(d.diff.tolist(), kernel=kernel, estimator=estimator,
                                                   final_state=a.get("final_state", "post-norm")),
                      key="ls_cmp_cka_diff", filename=f"cka-diff-{key_a}-{key_b}")
                st.caption("Red: the two layers are more alike in A than in B; blue: less alike. The colour scale is "
                           "symmetric about 0.")
            else:
                st.info(reason, icon=":material/info:")
                # one above the other at full width: side by side at 1024 px each square matrix was half as wide as
                # its chart was tall, under a blank band
                for st_, name, k in ((a, name_a, "a"), (b, name_b, "b")):
                    chart(plots.cka_heatmap(compare.cka_of(st_, estimator), compartments=st_.get("compartments"),
                                            title=f"CKA ({kernel}, {estimator}), {name}",
                                            final_state=st_.get("final_state", "post-norm")),
                          key=f"ls_cmp_cka_{k}", filename=f"cka-{k}")

st.header("Benchmark runs side by side")
with guard("run comparison"):
    runs = list(range(len(s.bench_results)))[::-1]
    if len(runs) < 2:
        st.caption("Two or more benchmark runs of this session are compared here: their options side by side and "
                   "each contender's τ and speedup overlaid, run by run.")
    else:
        picked = st.multiselect("Runs", runs, key="ls_w_cmp_bench_runs", format_func=lambda i: run_label(s.bench_results[i], i),
                                on_change=bind_view(s, "cmp_bench_runs", "ls_w_cmp_bench_runs", runs[:3], options=runs),
                                placeholder="choose two or more runs")
        chosen = [(f"#{i + 1}", s.bench_results[i]) for i in sorted(picked)]
        if chosen:
            table(compare.run_options(chosen), key="ls_cmp_run_options", filename="benchmark-run-options")
            # one above the other at full width: side by side at 1024 px each title ran under its legend
            chart(plots.runs_comparison(compare.run_contenders(chosen), metric="tau"), key="ls_cmp_runs_tau",
                  filename="benchmark-runs-tau")
            chart(plots.runs_comparison(compare.run_contenders(chosen), metric="speedup"), key="ls_cmp_runs_speedup",
                  filename="benchmark-runs-speedup")
names = draft_labels(s.drafts)
curves = {names[d["path"]]: d["curve"] for d in s.drafts if d.get("curve")}
if curves:
    st.subheader("Learning curves of the session's drafts")
    chart(plots.learning_curves(curves, layers={names[d["path"]]: d["layers"] for d in s.drafts}, colors=colors(s)),
          key="ls_cmp_learning", filename="learning-curves-all")
    table(speculate.learning_frame(s.drafts, names), key="ls_cmp_learning_options", filename="draft-options")

st.header("Runs of this session")
with guard("runs"):
    rows = compare.runs_table(s, by_key)
    if not rows:
        st.caption("No benchmark, study or draft in this session yet: they come from the **Speculative decoding** page.")
    else:
        present = list(dict.fromkeys(r["capture"] for r in rows))
        labels = {k: compare.capture_label(by_key.get(k), k) for k in present if k}
        f1, f2 = st.columns([3, 2])        # Kinds as pills: each a short button, none cut at 1024 px (a multiselect's
                                           # chips and clear button did not fit)
        pick = f1.selectbox("Capture", ["all"] + present, key="ls_w_cmp_runs_capture",
                            on_change=bind_view(s, "cmp_runs_capture", "ls_w_cmp_runs_capture", "all",
                                                options=["all"] + present),
                            format_func=lambda k: "every capture" if k == "all" else
                            ("no capture recorded (older entries)" if k is None else labels[k]))
        kinds = f2.pills("Kinds", ["study", "bench", "draft"], selection_mode="multi", key="ls_w_cmp_runs_kinds",
                         on_change=bind_view(s, "cmp_runs_kinds", "ls_w_cmp_runs_kinds", ["study", "bench", "draft"],
                                             options=["study", "bench", "draft"])) or []
        shown = compare.filter_runs(rows, capture=pick, kinds=kinds)
        table(compare.runs_frame(shown), key="ls_cmp_runs", filename="runs")
        st.caption("A benchmark's draft row names the capture its draft was trained on; plain decoding and the HF "
                   "peers the capture the session had when the benchmark ran. Entries saved before runs recorded "
                   "their capture show —.")
