"""Speculative decoding: train a draft per layer set, benchmark drafts with live acceptance, run the study."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import streamlit as st

from layerscope import fmt, layerset, machine, plots
from layerscope.decoding import specdec
from layerscope.decoding.bench import auto_note, interval_note
from layerscope.draft import engines
from layerscope.draft.engine_export import engine_verdict, export_zip
from layerscope.draft.train import TrainOptions
from layerscope.study.run import online_settings
from layerscope.ui import sanity, tasks
from layerscope.ui.apply import colors as palette_of
from layerscope.ui.apply import draft_labels, run_label
from layerscope.ui.jobs import get_manager
from layerscope.ui.recommend import set_label
from layerscope.ui.state import SESSION_KEY, bind_view, commit
from layerscope.ui.views import live_job, page_header, stats_or_progress
from layerscope.ui.widgets import (
    chart,
    guard,
    highlighted_tokens,
    legend_html,
    md_text,
    number_field,
    show_error,
    table,
)

SMALL_CAPTURE_TOKENS = 20_000     # below this a draft memorises its training prompts (README: 63k tokens took 21 min)

s, store = page_header("Speculative decoding",
                       "The proof of a layer set: train an EAGLE-3 draft that reads those layers, then decode with it and count "
                       "how many draft tokens the target accepts. Greedy decoding is lossless: the text is exactly what the "
                       "target alone writes; only the speed changes.")
manager = get_manager()

# The draft shipped for the default model is in every new session's list, preselected for the benchmark, so
# speculative decoding can be seen to pay before anything is trained (removed by hand, it stays away).
with guard("builtin draft"):
    if tasks.offer_builtin(s):
        commit(s)
if not s.capture_key and not s.drafts:
    st.info("This session has no capture yet: the drafts train on a capture's hidden states. Start on the **Capture** page.",
            icon=":material/info:")
    st.page_link("app_pages/capture.py", label="Go to Capture", icon=":material/arrow_forward:")
    st.stop()

have_capture = bool(s.capture_key) and store.has_capture(s.capture_key)
n = s.num_layers or 0

# ---------------------------------------------------------------------------- drafts
st.header("1 · Drafts")
sets = [(x["name"], x["layers"], x["strategy"]) for x in s.layer_sets]
if n and not any(tuple(x[1]) == tuple(layerset.default_layers(n)[0]) for x in sets):
    sets.append(("default", layerset.default_layers(n)[0], "default"))
train_col, list_col = st.container(), st.container()     # one above the other: side by side, the tables were cut
with train_col:
    st.subheader("Train drafts")
    if not s.capture_key:
        st.info("Training a draft needs a capture (its hidden states) or the target in the loop: start on the "
                "**Capture** page. The builtin draft below is ready to benchmark now.", icon=":material/info:")
        st.page_link("app_pages/capture.py", label="Go to Capture", icon=":material/arrow_forward:")
    else:
        labels = [f"{name} {layers}" for name, layers, _ in sets]
        train_running = any(j.kind == "train" for j in manager.active(s.id))
        mode = st.radio("Training data", ["capture", "online"], horizontal=True, key="ls_w_spec_mode",
                        on_change=bind_view(s, "spec_mode", "ls_w_spec_mode", "capture", options=["capture", "online"]),
                        format_func={"capture": "from this capture", "online": "online: the target in the loop"}.get,
                        help="From the capture: quick, one set at a time, as much data as the capture holds. Online: the "
                             "target runs inside the training loop on as many conversations as you like, every chosen set "
                             "trains from the same target pass, and a stopped run resumes (docs/training.md).")
        c1, c2, c3 = st.columns(3)
        ttt = number_field(c2, "TTT steps", min_value=1, max_value=7, step=1, key="ls_w_spec_ttt",
                              on_change=bind_view(s, "spec_ttt", "ls_w_spec_ttt", tasks.train_defaults().ttt_steps, clamp=(1, 7)),
                              help="Draft steps unrolled in training (EAGLE-3 uses 7; 3 keeps CPU training cheap)")
        seed = number_field(c3, "Seed", min_value=0, step=1, key="ls_w_spec_seed",
                               on_change=bind_view(s, "spec_seed", "ls_w_spec_seed", 0, clamp=(0, 2**31 - 1)))
        if mode == "capture":
            if not have_capture:
                st.warning(f"Capture {s.capture_key} is not in this store, so drafts cannot be trained from it here. "
                           "Run the same capture on the Capture page, train online, or use drafts already in the store.")
            cap_tokens = int((s.capture or {}).get("tokens") or 0)
            if have_capture and cap_tokens < SMALL_CAPTURE_TOKENS:
                st.warning(f"This capture holds {cap_tokens:,} tokens: far too few to train a useful draft (it will learn "
                           f"the training prompts by heart: high training accuracy, low held-out acceptance). Capture at "
                           f"least {SMALL_CAPTURE_TOKENS:,} tokens, or train online.", icon=":material/warning:")
            steps = number_field(c1, "Training steps", min_value=1, max_value=1_000_000, step=50, key="ls_w_spec_steps",
                                    on_change=bind_view(s, "spec_steps", "ls_w_spec_steps", tasks.train_defaults().steps,
                                                        clamp=(1, 1_000_000)),
                                    help="The same budget for every set keeps the comparison fair")
            pick = st.selectbox("Layer set", labels, key="ls_w_spec_set",
                                on_change=bind_view(s, "spec_set", "ls_w_spec_set", labels[0] if labels else None, options=labels),
                                help="The session's sets to test (Layer sets page) and the default rule")
            if st.button("Train draft", type="primary", key="ls_spec_train", icon=":material/model_training:",
                         disabled=not (have_capture and labels) or train_running):
                name, layers, strategy = sets[labels.index(pick)]
                with guard("start training"):
                    manager.submit(s.id, "train", tasks.train_job(
                        store=store, capture_key=s.capture_key, model=s.model, layers=list(layers), strategy=strategy,
                        name=name, options={"steps": int(steps), "ttt_steps": int(ttt), "seed": int(seed)}),
                        title=f"Draft for {name} {list(layers)}")
                    st.rerun()
        else:
            kilo = number_field(c1, "Budget (k tokens)", min_value=1, max_value=1_000_000, step=50, key="ls_w_spec_online_tokens",
                                   on_change=bind_view(s, "spec_online_tokens", "ls_w_spec_online_tokens", 200,
                                                       clamp=(1, 1_000_000)),
                                   help="Tokens through each draft; every set gets the same. On a 2-core CPU about 100-300 "
                                        "tokens/s for three sets; on a GPU thousands")
            picks = st.multiselect("Layer sets (one draft each, same batches)", labels, key="ls_w_spec_online_sets",
                                   on_change=bind_view(s, "spec_online_sets", "ls_w_spec_online_sets", labels[:3],
                                                       options=labels))
            d1, d2, d3 = st.columns(3)
            prompts = d1.selectbox("Conversations", ["sharegpt", "builtin"], key="ls_w_spec_online_prompts",
                                   on_change=bind_view(s, "spec_online_prompts", "ls_w_spec_online_prompts", "sharegpt",
                                                       options=["sharegpt", "builtin"]),
                                   help="sharegpt: its training split (benchmarks use the held-out split)")
            limit = number_field(d2, "Conversations drawn", min_value=8, max_value=20_000, step=100, key="ls_w_spec_online_limit",
                                    on_change=bind_view(s, "spec_online_limit", "ls_w_spec_online_limit", 1000,
                                                        clamp=(8, 20_000)))
            responses = d3.selectbox("Responses", ["regenerate", "own"], key="ls_w_spec_online_responses",
                                     on_change=bind_view(s, "spec_online_responses", "ls_w_spec_online_responses",
                                                         "regenerate", options=["regenerate", "own"]),
                                     help="regenerate: the target's own answers, generated once and kept (EAGLE-3's "
                                          "choice; costs a generation pass); own: the conversations' own answers "
                                          "(ShareGPT only; no generation)")
            if st.button("Train online", type="primary", key="ls_spec_train_online", icon=":material/model_training:",
                         disabled=not picks or train_running):
                chosen = [sets[labels.index(p)] for p in picks]
                with guard("start online training"):
                    manager.submit(s.id, "train", tasks.online_train_job(
                        store=store, model=s.model, sets=[(name, list(layers), strategy) for name, layers, strategy in chosen],
                        options={"prompts": prompts, "limit": int(limit), "responses": responses,
                                 "tokens": int(kilo) * 1000, "ttt_steps": int(ttt), "seed": int(seed)}),
                        title=f"Online drafts for {len(chosen)} set(s)")
                    st.rerun()

    def _train_details(v):
        m = v.metrics
        if "val" in m or m.get("phase") in ("responses", "features", "eval"):     # an online run
            if v.running and m.get("phase") == "train":
                a, b, c = st.columns(3)
                a.metric("Tokens seen", f"{m.get('tokens', 0):,}")
                b.metric("Tokens / s", f"{m.get('tokens_per_s', 0):.0f}")
                c.metric("ETA", fmt.duration(m["eta_s"]) if m.get("eta_s") else "—")
            curve = {}
            for p in v.series.get("curve", []):
                curve.setdefault(p["set"], []).append([p["tokens"], p["accuracy"]])
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

labels_of = draft_labels(s.drafts)      # path -> "name [layers]", told apart when two read the same set
colors = palette_of(s)                  # one color per layer set in every chart of the session
with list_col:
    st.subheader("Drafts of this session")
    if s.drafts:
        flags = sanity.collapse_reasons(s.drafts)
        df = pd.DataFrame([{"name": d["name"], "layers": fmt.layers(d["layers"]), "steps": d.get("steps"),
                            "tokens seen": d.get("tokens_seen") or d.get("train_tokens"),
                            "held-out agreement per step": ", ".join(fmt.percent(a) for a in (d.get("val_accuracy") or [])),
                            "trained in": fmt.duration(d["seconds"]) if d.get("seconds") else None,
                            "stored as": Path(d["path"]).name, "flag": flag or ""} for d, flag in zip(s.drafts, flags)])
        table(df, key="ls_spec_drafts", filename="drafts")
        collapsed = sanity.collapse_warning(s.drafts)
        if collapsed:
            st.warning(md_text(collapsed), icon=":material/warning:")
        curves = {labels_of[d["path"]]: d["curve"] for d in s.drafts if d.get("curve")}
        if curves:
            chart(plots.learning_curves(curves, layers={labels_of[d["path"]]: d["layers"] for d in s.drafts},
                                        colors=colors), key="ls_spec_learning_curves", filename="learning-curves")
            st.caption("Held-out agreement at the first draft position (every position counts: the estimate of "
                       "decoding acceptance) as each draft saw more tokens. Sets trained in one online pass saw the "
                       "same data in the same order, so their curves compare directly.")
    else:
        st.caption("None yet: train one, or add one the store already holds.")
    if s.drafts:
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
    fp = (s.capture or {}).get("fingerprint")
    with guard("stored drafts"):
        stored = [d for d in tasks.stored_drafts(store, fingerprint=fp) if d["path"] not in {x["path"] for x in s.drafts}]
        if stored:
            lab = {d["path"]: f"{d['name']} {d['layers']} · {d.get('steps')} steps · "
                              + ("this capture" if d.get("capture_key") == s.capture_key else f"capture {d.get('capture_key')}")
                   for d in stored}
            p = st.selectbox("Trained drafts in the store for this model", list(lab), format_func=lab.get, key="ls_spec_stored")
            if st.button("Add to this session", key="ls_spec_add_stored", icon=":material/add:"):
                s.drafts.append(next(d for d in stored if d["path"] == p))
                commit(s)
                st.rerun()
        broken = tasks.broken_drafts(store)
        if broken:      # listed, not hidden: what is wrong and the fix (plain text: keys and paths are not Markdown)
            st.text(f"{len(broken)} draft(s) in the store cannot be used:\n"
                    + "\n".join(f"  {b['key']}: {b['problem']}. {b['fix']}" for b in broken))

live_job(s.id, "train", key="spec_train", details=_train_details)    # full width: curves stay readable at 1024 px

# ---------------------------------------------------------------------------- benchmark
st.header("2 · Benchmark")
if not s.drafts:
    st.caption("Train or add a draft first.")
else:
    by_path = {d["path"]: d for d in s.drafts}
    # The session keeps the drafts left out of the comparison (s.view["bench_skip"]): a draft trained or added
    # later joins it at once, and the choice survives leaving the page.
    skip = [p for p in s.view.get("bench_skip", []) if p in by_path]
    st.session_state["ls_spec_bench_drafts"] = [p for p in by_path if p not in skip]

    def _compare_changed():
        current = st.session_state.get(SESSION_KEY) or s
        kept = st.session_state["ls_spec_bench_drafts"]
        current.view["bench_skip"] = [d["path"] for d in current.drafts if d["path"] not in kept]
        commit(current)

    b1, b2 = st.columns([2, 1])
    chosen = b1.multiselect("Drafts to compare", list(by_path), key="ls_spec_bench_drafts", format_func=labels_of.get,
                            on_change=_compare_changed, placeholder="choose one or more drafts")
    source = b2.radio("Prompts", ["sharegpt-heldout", "builtin"], key="ls_w_spec_bench_src", horizontal=True,
                      on_change=bind_view(s, "bench_prompts", "ls_w_spec_bench_src", "sharegpt-heldout",
                                          options=["sharegpt-heldout", "builtin"]),
                      help="sharegpt-heldout: conversations no capture for training ever uses")
    b3, b4, b5, b6 = st.columns([1, 1, 1.3, 1.6])
    n_prompts = number_field(b3, "Prompts", min_value=1, max_value=500, step=1, key="ls_w_spec_bench_n",
                                on_change=bind_view(s, "bench_n", "ls_w_spec_bench_n", 4, clamp=(1, 500)))
    new_tokens = number_field(b4, "New tokens", min_value=1, max_value=2048, step=8, key="ls_w_spec_bench_new",
                                 on_change=bind_view(s, "bench_new", "ls_w_spec_bench_new", 48, clamp=(1, 2048)))
    auto_k = b5.toggle("K = auto", key="ls_w_spec_bench_auto",
                       on_change=bind_view(s, "bench_auto", "ls_w_spec_bench_auto", True, options=[True, False]),
                       help="The depth with the best speedup predicted for this machine, from a short calibration "
                            "of each draft (shown as progress) and the machine's cost curve; off: the depth below")
    depth = number_field(b5, "Draft depth K", min_value=1, max_value=16, step=1, key="ls_w_spec_bench_k",
                         on_change=bind_view(s, "bench_k", "ls_w_spec_bench_k", specdec.DEFAULT_K, clamp=(1, 16)),
                         disabled=auto_k, help="Draft tokens proposed per target forward (chain)")
    peers = b6.toggle("HF peers", key="ls_w_spec_bench_peers",
                      on_change=bind_view(s, "bench_peers", "ls_w_spec_bench_peers", False, options=[True, False]),
                      help="HF generate and prompt lookup: the decoders a user has without LayerScope, measured in "
                           "the same run (slower)")
    lookup = b6.toggle("+ prompt lookup", key="ls_w_spec_bench_lookup",
                       on_change=bind_view(s, "bench_lookup", "ls_w_spec_bench_lookup", False, options=[True, False]),
                       help=f"Also each draft's chain with prompt lookup first: where the text's last 3 or 2 tokens "
                            f"occurred before, up to {specdec.DEFAULT_LOOKUP} tokens that followed them are verified "
                            f"instead of the draft's (pays where answers copy the prompt: summaries, extraction)")
    bench_running = any(j.kind == "bench" for j in manager.active(s.id))
    if st.button("Run benchmark", type="primary", key="ls_spec_bench", icon=":material/speed:",
                 disabled=not chosen or bench_running):
        with guard("start benchmark"):
            manager.submit(s.id, "bench", tasks.bench_job(
                store=store, model=s.model, drafts=[by_path[c] for c in chosen], prompts=source,
                limit=int(n_prompts), max_new_tokens=int(new_tokens), k="auto" if auto_k else int(depth or specdec.DEFAULT_K), peers=bool(peers),
                lookup=specdec.DEFAULT_LOOKUP if lookup else 0,
                capture_key=s.capture_key),
                title=f"Benchmark of {len(chosen)} draft(s)")
            st.rerun()

    def _bench_details(v):
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
        acc = {name: [a / d if d else 0.0 for a, d in zip(x["accepted"], x["drafted"])]
               for name, x in (m.get("acceptance") or {}).items() if x["drafted"]}
        # one above the other, full width: side by side at 1024 px each had ~350 px and its labels were cut
        if acc:
            st.plotly_chart(plots.acceptance_bars(acc, title="Acceptance per draft position (live)"),
                            key="ls_spec_live_acc", config=plots.figure_config("acceptance-live"))
        taus = v.series.get(f"tau:{cur}", [])
        if taus:
            st.plotly_chart(plots.tau_over_time(taus[-400:], title=f"τ per step: {cur} (live)"),
                            key="ls_spec_live_tau", config=plots.figure_config("tau-live"))
        if m.get("text"):
            st.markdown(f"**Generating** ({html.escape(str(m.get('text_of')))}): " + legend_html(), unsafe_allow_html=True)
            st.markdown(highlighted_tokens(m["text"]), unsafe_allow_html=True)

    live_job(s.id, "bench", key="spec_bench", details=_bench_details, interval=1.0)

    if s.bench_results:
        st.subheader("Results")
        runs = list(range(len(s.bench_results)))[::-1]     # newest first; a new result becomes the shown one (apply)
        on_run = bind_view(s, "bench_run", "ls_spec_bench_run", runs[0], options=runs)
        pick_run = st.selectbox("Benchmark run", runs, key="ls_spec_bench_run", on_change=on_run,
                                format_func=lambda i: run_label(s.bench_results[i], i))
        res = s.bench_results[pick_run]
        rows = res.get("results", [])
        depth_max = max((len(r.get("acceptance_by_position") or []) for r in rows), default=0)
        paired = any(r.get("paired") for r in rows)
        agreement_of = {d["name"]: by_path[d["path"]].get("val_accuracy") for d in res.get("drafts") or []
                        if d.get("path") in by_path}
        measured = [{**r, "val_accuracy": agreement_of.get(r["name"])} if r.get("layers") else {} for r in rows]
        flags = sanity.collapse_reasons(measured)
        df = pd.DataFrame([{
            "contender": r["name"], "layers": fmt.layers(r["layers"]) if r.get("layers") else "",
            "τ": fmt.interval(r.get("tau"), r.get("tau_ci"), "tau"),
            "speedup": fmt.interval(r.get("speedup"), r.get("speedup_ci"), "speedup"),     # what was measured first
            **{f"acc@{i + 1}": fmt.percent(((r.get("acceptance_by_position") or []) + [None] * depth_max)[i])
               for i in range(depth_max)},
            "tokens/s": fmt.number(r.get("tokens_per_s"), 1), "decoding": r.get("decoding", ""),
            **({"chosen K": (r.get("chosen") or {}).get("k"),
                "calibration predicted": fmt.speedup((r.get("calibrated") or {}).get("speedup"))}
               if any(x.get("chosen") for x in rows) else {}),
            **({"Δτ vs reference": fmt.interval((r.get("paired") or {}).get("tau", {}).get("delta"),
                                                (r.get("paired") or {}).get("tau", {}).get("ci"), "delta")} if paired else {}),
            **({"predicted": fmt.speedup(r.get("predicted_speedup"))} if res.get("cost_curve") else {}),
            "lossless": r.get("lossless"), "flag": flag or "",
        } for r, flag in zip(rows, flags)])
        table(df, key="ls_spec_bench_table", filename=f"benchmark-{pick_run + 1}")
        collapsed = sanity.collapse_warning([m for m in measured if m])
        if collapsed:
            st.warning(md_text(collapsed), icon=":material/warning:")
        st.caption(md_text(interval_note(res["intervals"])) if res.get("intervals")
                   else "No intervals: this run had a single prompt, or was saved before benchmarks kept per-prompt totals.")
        for r in rows:
            if r.get("chosen"):
                st.markdown(md_text(auto_note(r)))
        if res.get("machine"):
            (st.caption if res["machine"].get("quiet") else st.warning)(md_text(machine.line(res["machine"])))
        for w in res.get("warnings") or []:
            st.caption(f"Note: {md_text(w)}.")
        for w in sanity.bench_warnings(rows, int(res.get("prompts") or 0)):
            st.warning(w, icon=":material/warning:")
        bad = [r["name"] for r in rows if r.get("lossless") is False]
        if bad:
            st.error(f"**Outputs differ from plain greedy decoding for {', '.join(bad)}.** This is a bug in the decoder; "
                     "please report it with the session file.")
        # τ and speedup span the page (two panels of contender names: at half width they were cramped)
        chart(plots.bench_comparison(rows, colors=colors), key="ls_spec_bench_cmp",
              filename=f"benchmark-{pick_run + 1}-tau-speedup")
        g1, g2 = st.columns(2)
        with g1:
            acc = {r["name"]: r["acceptance_by_position"] for r in rows if r.get("acceptance_by_position")}
            if acc:
                chart(plots.acceptance_bars(acc, layers={r["name"]: r.get("layers") for r in rows}, colors=colors),
                      key="ls_spec_bench_acc", filename=f"benchmark-{pick_run + 1}-acceptance")
        with g2:
            if res.get("cost_curve"):
                chart(plots.cost_curve(res["cost_curve"], draft_step_seconds=res.get("draft_step_seconds")),
                      key="ls_spec_bench_cost", filename=f"benchmark-{pick_run + 1}-cost-curve")
        cats = sorted({c for r in rows for c in (r.get("by_category") or {})})
        if len(cats) > 1:
            with st.expander("Per prompt category"):
                cdf = pd.DataFrame([{"category": c, "contender": r["name"], "τ": fmt.tau(r["by_category"][c].get("tau")),
                                     "tokens/s": fmt.number(r["by_category"][c].get("tokens_per_s"), 1),
                                     "speedup": fmt.speedup(r["by_category"][c].get("speedup"))}
                                    for c in cats for r in rows if c in (r.get("by_category") or {})])
                table(cdf, key="ls_spec_bench_cat", filename=f"benchmark-{pick_run + 1}-categories")

# ---------------------------------------------------------------------------- the study
st.header("3 · The study")
st.caption("The experiment LayerScope exists for: one draft per layer set (every strategy's set and this session's "
           "sets) trained with exactly the same budget, data and seed, all benchmarked on the same held-out prompts. "
           "Does a proxy score (entropy, redundancy, aggregate entropy) predict τ? Drafts already trained come from "
           "the store, so adding one set trains only that one.")
stats = stats_or_progress(s, store, key="study") if have_capture else None
if not (have_capture and stats):
    st.caption("The study needs this session's capture in the store and its layer statistics.")
else:
    q1, q2, q3 = st.columns(3)         # two rows: five labels a row wrapped at 1024 px
    q4, q5, _ = st.columns(3)
    st_k = number_field(q1, "Layers per set (k)", min_value=1, max_value=max(1, n), step=1, key="ls_w_study_k",
                           on_change=bind_view(s, "study_k", "ls_w_study_k", min(3, max(1, n)), clamp=(1, max(1, n))))
    st_steps = number_field(q2, "Steps (each)", min_value=1, max_value=1_000_000, step=50, key="ls_w_study_steps",
                               on_change=bind_view(s, "study_steps", "ls_w_study_steps", tasks.train_defaults().steps,
                                                   clamp=(1, 1_000_000)),
                               help="Training steps of every draft of the study: one budget for all")
    st_src = q3.selectbox("Prompt set", ["sharegpt-heldout", "builtin"], key="ls_w_study_src",
                          on_change=bind_view(s, "study_prompts", "ls_w_study_src", "sharegpt-heldout",
                                              options=["sharegpt-heldout", "builtin"]))
    st_n = number_field(q4, "Study prompts", min_value=1, max_value=500, step=1, key="ls_w_study_n",
                           on_change=bind_view(s, "study_n", "ls_w_study_n", 8, clamp=(1, 500)))
    st_new = number_field(q5, "Study new tokens", min_value=1, max_value=2048, step=8, key="ls_w_study_new",
                             on_change=bind_view(s, "study_new", "ls_w_study_new", 48, clamp=(1, 2048)))
    with guard("study sets"):
        options = tasks.study_options(s.layer_sets, k=int(st_k),
                                      train=TrainOptions(steps=int(st_steps), ttt_steps=int(ttt), seed=int(seed)),
                                      prompts=st_src, limit=int(st_n), max_new_tokens=int(st_new),
                                      depth=int(st.session_state.get("ls_w_spec_bench_k") or specdec.DEFAULT_K))
        plan = tasks.study_plan(stats, options)
        st.markdown("Sets in the study: " + " · ".join(
            f"**{md_text(set_label(names, layers, s.layer_sets))}** `{fmt.layers(layers)}`" for layers, names in plan))
        st.caption(sanity.study_cost(plan, options, tasks.stored_drafts(store, fingerprint=(s.capture or {}).get("fingerprint")),
                                     s.bench_results))
        study_running = any(j.kind == "study" for j in manager.active(s.id))
        if st.button("Run the study", type="primary", key="ls_spec_study", icon=":material/science:",
                     disabled=study_running or len(plan) < 2):
            manager.submit(s.id, "study", tasks.study_job(store=store, capture_key=s.capture_key, model=s.model,
                                                          options=options, analysis_options=s.analysis_options),
                           title=f"Study of {len(plan)} layer sets")
            st.rerun()

    def _study_details(v):
        if v.running:
            st.caption(f"Phase: {v.metrics.get('phase', 'starting')}")

    live_job(s.id, "study", key="spec_study", details=_study_details)
    if s.study:
        studies = list(range(len(s.study)))[::-1]      # newest first; a new result becomes the shown one (apply)
        if len(studies) > 1:
            pick_study = st.selectbox("Study", studies, key="ls_spec_study_run",
                                      on_change=bind_view(s, "study_run", "ls_spec_study_run", studies[0], options=studies),
                                      format_func=lambda i: f"#{i + 1} · {len(s.study[i]['rows'])} sets · "
                                                            f"{s.study[i].get('prompts')} prompts · "
                                                            f"{fmt.when(s.study[i].get('created'))}")
        else:
            pick_study = 0
        res = s.study[pick_study]
        rows, o = res["rows"], res.get("options") or {}
        budget = (f"online training, {md_text(', '.join(f'{k} {v}' for k, v in online_settings(o['online']).items()))}"
                  if o.get("online") else f"{(o.get('train') or {}).get('steps')} training steps each")
        st.markdown(f"{'Latest study' if pick_study == len(s.study) - 1 else f'Study #{pick_study + 1}'}: {len(rows)} sets · "
                    f"{budget} · {res['prompts']} {md_text(o.get('prompts', ''))} prompts × {o.get('max_new_tokens')} "
                    f"tokens · K = {o.get('depth')} · {md_text(res.get('device', ''))}"
                    + (f" · {fmt.when(res['created'])}" if res.get("created") else ""))
        if res.get("verdict"):
            st.info(md_text(res["verdict"]), icon=":material/gavel:")
        flags = sanity.collapse_reasons(rows)
        df = pd.DataFrame([{"set": set_label(r["strategies"], r["layers"], s.layer_sets), "layers": fmt.layers(r["layers"]),
                            "τ": fmt.interval(r.get("tau"), r.get("tau_ci"), "tau"),
                            "Δτ vs default": fmt.interval(r.get("delta_vs_default"), r.get("delta_ci"), "delta"),
                            "seed range": fmt.tau(r.get("tau_seed_range")) if len(r.get("seeds") or []) > 1 else "",
                            "speedup": fmt.interval(r.get("speedup"), r.get("speedup_ci"), "speedup"),
                            "held-out agreement @1": fmt.percent(sanity.agreement(r.get("val_accuracy"))),
                            "mean entropy": fmt.number(r["mean_entropy"]),
                            "mean CKA": fmt.number(r["mean_cka"]) if len(r["layers"]) > 1 else fmt.NOT_APPLICABLE,
                            "aggregate entropy": fmt.number(r["aggregate_entropy"]),
                            "lossless": r.get("lossless"), "flag": flag or ""} for r, flag in zip(rows, flags)])
        table(df, key="ls_spec_study_table", filename="study")
        st.caption("[lo, hi]: 95% paired bootstrap intervals over the prompts; seed range: max − min of τ over the "
                   "training seeds; mean CKA n/a: a one-layer set has no pair of layers.")
        if res.get("correlations"):
            best = {p: c.get("version") for p, c in (res.get("best_proxies") or {}).items()}
            cdf = pd.DataFrame([{"proxy": fmt.name(c["proxy"]), "version": c["version"],
                                 "Spearman ρ with τ": fmt.interval(c["rho"], c.get("ci"), "delta"),
                                 "best version": best.get(c["proxy"]) == c["version"]}
                                for c in res["correlations"]])
            table(cdf, key="ls_spec_study_corr", filename="study-correlations")
        if any(r.get("tau_ci") for r in rows):
            chart(plots.study_intervals(rows, colors=colors), key="ls_spec_study_ci", filename="study-tau-intervals")
        versions = list(rows[0].get("proxies") or {}) if rows else []
        if versions:
            version = st.selectbox("Proxy version (kernel, token-entropy filter)", versions, key="ls_w_study_version",
                                   on_change=bind_view(s, "study_version", "ls_w_study_version", versions[0],
                                                       options=versions))
            chart(plots.study_proxies(rows, version, correlations=res.get("correlations") or [], colors=colors),
                  key="ls_spec_study_proxies",
                  filename="study-tau-vs-proxies")
        curves = {set_label(r["strategies"], r["layers"], s.layer_sets): (r.get("seeds") or [{}])[0].get("curve")
                  for r in rows}
        curves = {name: c for name, c in curves.items() if c}
        if curves:
            chart(plots.learning_curves(curves, layers={set_label(r["strategies"], r["layers"], s.layer_sets): r["layers"]
                                                        for r in rows}, colors=colors,
                                        title="Study: held-out agreement per set as the drafts saw more tokens"),
                  key="ls_spec_study_curves", filename="study-learning-curves")
            st.caption("First training seed. Sets trained in one online pass saw the same data in the same order.")
        corr = res.get("spearman") or {}
        st.markdown("**Spearman correlation with τ** over the sets: " + " · ".join(
            f"{md_text(fmt.name(name))} {'n/a' if v is None else fmt.delta(v)}" for name, v in corr.items())
            + ("  \n(n/a: fewer than 3 sets, or a constant column)" if any(v is None for v in corr.values()) else ""))
        for w in sanity.study_warnings(rows, int(res.get("prompts") or 0)):
            st.warning(md_text(w), icon=":material/warning:")
        chart(plots.bench_comparison([{"name": set_label(r["strategies"], r["layers"], s.layer_sets), "layers": r["layers"],
                                       "tau": r.get("tau"), "tau_ci": r.get("tau_ci"), "speedup": r.get("speedup"),
                                       "speedup_ci": r.get("speedup_ci")} for r in rows],
                                     title="Study: τ and speedup per layer set", colors=colors),
              key="ls_spec_study_chart", filename="study-tau-speedup")
