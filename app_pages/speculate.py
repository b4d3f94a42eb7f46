"""Speculative decoding: train a draft per layer set, benchmark drafts with live acceptance, run the study."""

from __future__ import annotations

import streamlit as st

from layerscope.capture.stored import has_capture
from layerscope.decoding import sanity, specdec
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.steps import forecast
from layerscope.ui import speculate, speculate_views, tasks
from layerscope.ui.jobs import get_manager
from layerscope.ui.labels import colors as palette_of
from layerscope.ui.labels import draft_labels, run_label
from layerscope.ui.state import SESSION_KEY, bind_view, commit
from layerscope.ui.views import live_job, page_header, stats_or_progress
from layerscope.ui.widgets import estimate_caption, guard, number_field

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

have_capture = bool(s.capture_key) and has_capture(store, s.capture_key)
n = s.num_layers or 0

# ---------------------------------------------------------------------------- drafts
st.header("1 · Drafts")
sets = speculate.train_sets(s.layer_sets, n)
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
                        on_change=bind_view(s, "spec_mode", "ls_w_spec_mode", speculate.default_training_mode(s.capture),
                                            options=["capture", "online"]),
                        format_func={"capture": "from this capture", "online": "online: the target in the loop"}.get,
                        help="From the capture: quick, one set at a time, as much data as the capture holds. Online: the "
                             "target runs inside the training loop on as many conversations as you like, every chosen set "
                             "trains from the same target pass, and a stopped run resumes (docs/training.md).")
        c1, c2, c3 = st.columns(3)
        ttt = number_field(c2, "TTT steps", min_value=1, max_value=7, key="ls_w_spec_ttt",
                              on_change=bind_view(s, "spec_ttt", "ls_w_spec_ttt", tasks.train_defaults().ttt_steps, clamp=(1, 7)),
                              help="Draft steps unrolled in training (EAGLE-3 uses 7; 3 keeps CPU training cheap)")
        seed = number_field(c3, "Seed", min_value=0, max_value=2**31 - 1, key="ls_w_spec_seed",
                               on_change=bind_view(s, "spec_seed", "ls_w_spec_seed", 0, clamp=(0, 2**31 - 1)))
        fc_norm = st.checkbox("Norm each layer before fc (fc_norm)", key="ls_w_spec_fc_norm",
                              on_change=bind_view(s, "spec_fc_norm", "ls_w_spec_fc_norm", tasks.train_defaults().fc_norm,
                                                  options=[False, True]),
                              help="EAGLE-3.1: an RMSNorm on each auxiliary layer's state before fc, so the layers with "
                                   "the largest states do not dominate it; vLLM, SGLang, SpecForge and speculators load it")
        if mode == "capture":
            if not have_capture:
                st.warning(f"Capture {s.capture_key} is not in this store, so drafts cannot be trained from it here. "
                           "Run the same capture on the Capture page, train online, or use drafts already in the store.")
            small = speculate.small_capture_warning(s.capture)
            if have_capture and small:
                st.warning(small, icon=":material/warning:")
            steps = number_field(c1, "Training steps", min_value=1, max_value=1_000_000, key="ls_w_spec_steps",
                                    on_change=bind_view(s, "spec_steps", "ls_w_spec_steps", tasks.train_defaults().steps,
                                                        clamp=(1, 1_000_000)),
                                    help="The same budget for every set keeps the comparison fair")
            pick = st.selectbox("Layer set", labels, key="ls_w_spec_set",
                                on_change=bind_view(s, "spec_set", "ls_w_spec_set", labels[0] if labels else None, options=labels),
                                help="The session's sets to test (Layer sets page) and the default rule")
            recipe = {"steps": int(steps), "ttt_steps": int(ttt), "seed": int(seed), "fc_norm": bool(fc_norm)}
            if pick in labels:
                estimate_caption(lambda: forecast.training(store, s.model, sets[labels.index(pick)][1], TrainOptions(**recipe)))
            if st.button("Train draft", type="primary", key="ls_spec_train", icon=":material/model_training:",
                         disabled=not (have_capture and labels) or train_running):
                name, layers, strategy = sets[labels.index(pick)]
                with guard("start training"):
                    manager.submit(s.id, "train", tasks.train_job(
                        store=store, capture_key=s.capture_key, model=s.model, layers=list(layers), strategy=strategy,
                        name=name, options=recipe), title=f"Draft for {name} {list(layers)}")
                    st.rerun()
        else:
            kilo = number_field(c1, "Budget (k tokens)", min_value=1, max_value=1_000_000, key="ls_w_spec_online_tokens",
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
            limit = number_field(d2, "Conversations drawn", min_value=8, max_value=20_000, key="ls_w_spec_online_limit",
                                    on_change=bind_view(s, "spec_online_limit", "ls_w_spec_online_limit", 1000,
                                                        clamp=(8, 20_000)))
            responses = d3.selectbox("Responses", ["regenerate", "own"], key="ls_w_spec_online_responses",
                                     on_change=bind_view(s, "spec_online_responses", "ls_w_spec_online_responses",
                                                         "regenerate", options=["regenerate", "own"]),
                                     help="regenerate: the target's own answers, generated once and kept (EAGLE-3's "
                                          "choice; costs a generation pass); own: the conversations' own answers "
                                          "(ShareGPT only; no generation)")
            chosen = [sets[labels.index(p)] for p in picks]
            recipe = {"prompts": prompts, "limit": int(limit), "responses": responses, "tokens": int(kilo) * 1000,
                      "ttt_steps": int(ttt), "seed": int(seed), "fc_norm": bool(fc_norm)}
            if chosen:
                estimate_caption(lambda: forecast.online(store, s.model, [x[1] for x in chosen], OnlineOptions(**recipe)))
            if st.button("Train online", type="primary", key="ls_spec_train_online", icon=":material/model_training:",
                         disabled=not picks or train_running):
                with guard("start online training"):
                    manager.submit(s.id, "train", tasks.online_train_job(
                        store=store, model=s.model, sets=[(name, list(layers), strategy) for name, layers, strategy in chosen],
                        options=recipe), title=f"Online drafts for {len(chosen)} set(s)")
                    st.rerun()

labels_of = draft_labels(s.drafts)      # path -> "name [layers]", told apart when two read the same set
colors = palette_of(s)                  # one color per layer set in every chart of the session
with list_col:
    speculate_views.session_drafts(s, store, labels_of, colors)

live_job(s.id, "train", key="spec_train", details=speculate_views.train_details)    # full width: curves stay readable at 1024 px

# ---------------------------------------------------------------------------- benchmark
st.header("2 · Benchmark")
if not s.drafts:
    st.caption("Train or add a draft first.")
else:
    by_path = {d["path"]: d for d in s.drafts}
    # The session keeps the drafts left out of the comparison (s.view["bench_skip"]): a draft trained or added
    # later joins it at once, and the choice survives leaving the page.
    st.session_state["ls_spec_bench_drafts"] = speculate.bench_kept(s.drafts, s.view.get("bench_skip", []))

    def _compare_changed():
        current = st.session_state.get(SESSION_KEY) or s
        kept = st.session_state["ls_spec_bench_drafts"]
        current.view["bench_skip"] = speculate.bench_skipped(current.drafts, kept)
        commit(current)

    b1, b2 = st.columns([2, 1])
    chosen = b1.multiselect("Drafts to compare", list(by_path), key="ls_spec_bench_drafts", format_func=labels_of.get,
                            on_change=_compare_changed, placeholder="choose one or more drafts")
    source = b2.radio("Prompts", ["sharegpt-heldout", "builtin"], key="ls_w_spec_bench_src", horizontal=True,
                      on_change=bind_view(s, "bench_prompts", "ls_w_spec_bench_src", "sharegpt-heldout",
                                          options=["sharegpt-heldout", "builtin"]),
                      help="sharegpt-heldout: conversations no capture for training ever uses")
    b3, b4, b5, b6 = st.columns([1, 1, 1.3, 1.6])
    n_prompts = number_field(b3, "Prompts", min_value=1, max_value=500, key="ls_w_spec_bench_n",
                                on_change=bind_view(s, "bench_n", "ls_w_spec_bench_n", tasks.bench_defaults().limit,
                                                    clamp=(1, 500)),
                                help=f"Compare drafts on at least {sanity.ENOUGH_PROMPTS} prompts: with fewer, τ and "
                                     "speedup change a lot from one prompt set to the next")
    new_tokens = number_field(b4, "New tokens", min_value=1, max_value=2048, key="ls_w_spec_bench_new",
                                 on_change=bind_view(s, "bench_new", "ls_w_spec_bench_new", 48, clamp=(1, 2048)))
    auto_k = b5.toggle("K = auto", key="ls_w_spec_bench_auto",
                       on_change=bind_view(s, "bench_auto", "ls_w_spec_bench_auto", True, options=[True, False]),
                       help="The depth with the best speedup predicted for this machine, from a short calibration "
                            "of each draft (shown as progress) and the machine's cost curve; off: the depth below")
    depth = number_field(b5, "Draft depth K", min_value=1, max_value=16, key="ls_w_spec_bench_k",
                         on_change=bind_view(s, "bench_k", "ls_w_spec_bench_k", specdec.DEFAULT_K, clamp=(1, 16)),
                         disabled=auto_k, help="Draft tokens proposed per target forward (chain)")
    peers = b6.toggle("HF peers", key="ls_w_spec_bench_peers",
                      on_change=bind_view(s, "bench_peers", "ls_w_spec_bench_peers", False, options=[True, False]),
                      help="HF generate and prompt lookup: the decoders a user has without LayerScope, measured in "
                           "the same run (slower)")
    lookups = list(speculate.LOOKUP_CHOICES)
    lookup = b6.selectbox("+ prompt lookup", lookups, key="ls_w_spec_bench_lookup",
                          format_func=speculate.LOOKUP_CHOICES.get,
                          on_change=bind_view(s, "bench_lookup", "ls_w_spec_bench_lookup", "0", options=lookups),
                          help=f"Also each draft's chain with prompt lookup first: where the text's last 3 or 2 "
                               f"tokens occurred before, up to {specdec.DEFAULT_LOOKUP} tokens that followed them are "
                               f"verified instead of the draft's (pays where answers copy the prompt: summaries, "
                               f"extraction). Adaptive: {specdec.LOOKUP_GROW} more after a lookup accepted whole, up "
                               f"to {specdec.DEFAULT_ADAPTIVE_CAP}, {specdec.LOOKUP_SHRINK} fewer after a rejection. "
                               f"Auto: the span predicted "
                               f"best for this machine from the calibration, or none when none pays")
    assistant = b6.text_input("+ assistant model", key="ls_w_spec_bench_assistant", placeholder="e.g. qwen2.5-coder-0.5b",
                              on_change=bind_view(s, "bench_assistant", "ls_w_spec_bench_assistant", ""),
                              help="Also transformers' assisted generation with this small model as its assistant "
                                   "(hf-assisted): the classic small-model draft, for a target of the same tokenizer")
    bench_running = any(j.kind == "bench" for j in manager.active(s.id))
    choice = {"model": s.model, "prompts": source, "limit": int(n_prompts), "max_new_tokens": int(new_tokens),
              "k": "auto" if auto_k else int(depth or specdec.DEFAULT_K), "peers": bool(peers),
              "lookup": lookup, "assistant": assistant or ""}
    if chosen:
        estimate_caption(lambda: tasks.bench_estimate(store, [by_path[c] for c in chosen], manager, **choice))
    if st.button("Run benchmark", type="primary", key="ls_spec_bench", icon=":material/speed:",
                 disabled=not chosen or bench_running):
        with guard("start benchmark"):
            manager.submit(s.id, "bench", tasks.bench_job(store=store, drafts=[by_path[c] for c in chosen],
                                                          capture_key=s.capture_key, **choice),
                           title=f"Benchmark of {len(chosen)} draft(s)")
            st.rerun()

    live_job(s.id, "bench", key="spec_bench", details=speculate_views.bench_details, interval=1.0)

    if s.bench_results:
        st.subheader("Results")
        runs = list(range(len(s.bench_results)))[::-1]     # newest first; a new result becomes the shown one (apply)
        on_run = bind_view(s, "bench_run", "ls_spec_bench_run", runs[0], options=runs)
        pick_run = st.selectbox("Benchmark run", runs, key="ls_spec_bench_run", on_change=on_run,
                                format_func=lambda i: run_label(s.bench_results[i], i))
        speculate_views.bench_run(s, pick_run, colors)

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
    speculate_views.study_form(s, store, manager, stats, n, ttt=ttt, seed=seed)

    live_job(s.id, "study", key="spec_study", details=speculate_views.study_details)
    if s.study:
        studies = list(range(len(s.study)))[::-1]      # newest first; a new result becomes the shown one (apply)
        if len(studies) > 1:
            pick_study = st.selectbox("Study", studies, key="ls_spec_study_run",
                                      on_change=bind_view(s, "study_run", "ls_spec_study_run", studies[0], options=studies),
                                      format_func=lambda i: speculate.study_label(s.study, i))
        else:
            pick_study = 0
        speculate_views.study(s, pick_study, colors)
