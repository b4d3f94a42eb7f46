"""Capture: run the target on a prompt set and record every layer's hidden states into the store."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import fmt
from layerscope.capture.run import CaptureOptions
from layerscope.steps import forecast, preflight
from layerscope.target.aliases import ALIASES, DEFAULT_MODEL
from layerscope.target.load import TINY_ABOUT
from layerscope.ui import apply, capture_views, state, tasks
from layerscope.ui.jobs import get_manager
from layerscope.ui.prompt_preview import preview_prompts
from layerscope.ui.state import bind_view
from layerscope.ui.views import page_header
from layerscope.ui.widgets import guard, holds_refused_entry, md_text, number_field, show_error
from layerscope.validate import parse_size

s, store = page_header("Capture hidden states",
                       "The target answers each prompt itself (as EAGLE-3 training data is made); one forward pass then "
                       "records the hidden state of every layer 0..N and the predictive entropy of every token. "
                       "Captures are stored once and reused: the same model, prompts and options come back from the store.")
manager = get_manager()

# Every control's value lives in the session (s.view), so it survives leaving the page, a reload and a new tab.
SOURCES = ["builtin", "sharegpt", "upload"]
KNOWN = {**{spec: alias.about for spec, alias in ALIASES.items()},   # the models that need no download
         "tiny-llama": TINY_ABOUT}
on = {"model": bind_view(s, "cap_model", "ls_w_cap_model", s.model or DEFAULT_MODEL),
      "source": bind_view(s, "cap_source", "ls_w_cap_source", "builtin", options=SOURCES),
      "limit": bind_view(s, "cap_limit", "ls_w_cap_limit", 16, clamp=(1, 100_000)),
      "new": bind_view(s, "cap_new", "ls_w_cap_new", 48, clamp=(1, 4096)),
      "batch": bind_view(s, "cap_batch", "ls_w_cap_batch", 8, clamp=(1, 256)),
      "seed": bind_view(s, "cap_seed", "ls_w_cap_seed", 0, clamp=(0, 2**31 - 1)),
      "sample": bind_view(s, "cap_sample", "ls_w_cap_sample", 0, clamp=(0, 1_000_000)),
      "budget": bind_view(s, "cap_budget", "ls_w_cap_budget", "")}

job = manager.latest(s.id, "capture")
view = job.view() if job else None

left, right = st.columns([1, 1], gap="large")
with left:
    st.text_input("Target model", key="ls_w_cap_model", on_change=on["model"],
                  help=f"{', '.join(f'`{k}`' for k in KNOWN)} (pick one below), a Hugging Face id such as "
                       f"`{ALIASES[DEFAULT_MODEL].hf_id}`, a local directory or a .gguf file")

    def pick_known():
        """A built-in model picked: it becomes the typed spec (and the session's choice)."""
        if st.session_state.ls_w_cap_known:
            st.session_state.ls_w_cap_model = st.session_state.ls_w_cap_known
            on["model"]()

    # the pill shows which built-in model the text names (none for anything else)
    st.session_state.ls_w_cap_known = st.session_state.ls_w_cap_model if st.session_state.ls_w_cap_model in KNOWN else None
    st.pills("Built-in models", list(KNOWN), key="ls_w_cap_known", on_change=pick_known,
             help="  \n".join(f"`{k}`: {md_text(v)}" for k, v in KNOWN.items()))
    source = st.radio("Prompt set", SOURCES, key="ls_w_cap_source", horizontal=True, on_change=on["source"],
                      help="builtin: prompts written for LayerScope in several task categories; "
                           "sharegpt: real conversations (training split); upload: your own .jsonl/.txt/.csv")
    prompt_spec = source
    if source == "upload":
        up = st.file_uploader("Prompt file", type=["jsonl", "txt", "csv"], key="ls_cap_upload",
                              help=".jsonl with prompt / turns / conversations, .txt one prompt per line, .csv with a 'prompt' column")
        prompt_spec = None
        if up is not None:
            with guard("upload"):
                prompt_spec = str(tasks.save_upload(store, up.name, up.getvalue()))
    c1, c2 = st.columns(2)
    number_field(c1, "Prompts (limit)", min_value=1, max_value=100_000, key="ls_w_cap_limit", on_change=on["limit"])
    number_field(c2, "New tokens per response", min_value=1, max_value=4096, key="ls_w_cap_new", on_change=on["new"])
    c3, c4 = st.columns(2)
    number_field(c3, "Batch size", min_value=1, max_value=256, key="ls_w_cap_batch", on_change=on["batch"])
    number_field(c4, "Seed", min_value=0, max_value=2**31 - 1, key="ls_w_cap_seed", on_change=on["seed"])
    c5, c6 = st.columns(2)
    number_field(c5, "Sample positions (0 = all)", min_value=0, max_value=1_000_000, key="ls_w_cap_sample",
                 on_change=on["sample"], help="Keep a seeded sample of at most this many token positions per "
                 "conversation (response positions first, never position 0): a smaller capture for the statistics "
                 "only; drafts cannot be trained from it")
    c6.text_input("Storage budget", key="ls_w_cap_budget", on_change=on["budget"], placeholder="none, e.g. 2G",
                  help="Refuse the capture when its estimate is larger: 500M, 2G, 1.5GiB (empty: no budget)")

# the capture's options as the page has them (CaptureOptions: the one source of the others' defaults)
budget, budget_ok = None, False          # Start capture stays off while the budget does not read as a size
estimate = None                          # its time and storage before it starts (forecast), shown by the button
with guard("storage budget"):
    text = st.session_state.ls_w_cap_budget.strip()
    budget, budget_ok = parse_size(text) if text else None, True
options = CaptureOptions(limit=int(st.session_state.ls_w_cap_limit), max_new_tokens=int(st.session_state.ls_w_cap_new),
                         batch_size=int(st.session_state.ls_w_cap_batch), seed=int(st.session_state.ls_w_cap_seed),
                         sample_positions=int(st.session_state.ls_w_cap_sample) or None, max_store_bytes=budget)

with right:
    st.subheader("Prompt preview")
    if prompt_spec:
        readable = False          # Start capture stays off until the prompt set reads without an error
        with guard("prompt preview"):
            ps = preview_prompts(prompt_spec, int(st.session_state.ls_w_cap_limit), int(st.session_state.ls_w_cap_seed))
            readable = bool(ps.prompts)
            rows = [{"id": p.id, "category": p.category, "prompt": p.turns[0][:160]} for p in ps.prompts[:200]]
            st.caption(f"{md_text(ps.name)}: {len(ps.prompts)} prompts (after the limit)")
            if ps.warnings:
                st.warning(f"{len(ps.warnings)} line(s) skipped: " + md_text("; ".join(ps.warnings[:3])))
            st.dataframe(pd.DataFrame(rows), hide_index=True, height=260, width="stretch")
        if not readable:
            prompt_spec = None
        else:
            st.subheader("Storage")
            with guard("storage estimate"):
                plan = preflight.capture_estimate(store, st.session_state.ls_w_cap_model.strip(), ps.prompts, options)
                estimate = forecast.capture(store, st.session_state.ls_w_cap_model.strip(), plan, options.batch_size,
                                            held=tasks.held(manager, st.session_state.ls_w_cap_model)) if plan else None
                if plan is None:
                    st.caption("The estimate needs the model's config: it shows once the model has loaded here (a "
                               "first capture), and the capture states it before its first batch.")
                else:
                    # one under the other: three side by side in this half of the page cut their values at 1024 px
                    st.metric("Per token", fmt.size(plan.bytes_per_token),
                              help=f"{plan.states} hidden states of d={plan.hidden_size} in float16, and the token table")
                    st.metric("Estimated size", fmt.size(plan.total), help="At most: every response at its full length")
                    st.metric("Free on disk", fmt.size(plan.free))
                    st.caption(md_text(plan.lines()[1]))
                    if plan.over_budget:
                        st.warning(f"Over the budget of {fmt.size(plan.budget)}: the capture would be refused. Take "
                                   "fewer prompts, fewer new tokens per response, or sample positions.")
                    elif plan.total > plan.free:
                        st.warning(f"The disk has {fmt.size(plan.free)} free, less than the estimate.")
    else:
        st.info("Upload a prompt file to preview it.")

running = view is not None and view.running
PENDING = "ls_cap_pending"        # Start capture was pressed in a session a capture would replace: asking first
if prompt_spec and estimate is not None:
    st.caption(md_text(estimate.line()))


model = st.session_state.ls_w_cap_model.strip()


def start_capture(target) -> None:
    """Start the capture job of the page's choices in session `target` (the session takes the model and prompt
    set from the finished capture, never from a failed one)."""
    global job, view
    hold = tasks.hold_upload(store, prompt_spec)      # an uploaded file stays while this capture may read it
    try:
        job = manager.submit(target.id, "capture", tasks.capture_job(
            model=model, prompts=prompt_spec, limit=options.limit, max_new_tokens=options.max_new_tokens,
            batch_size=options.batch_size, seed=options.seed, sample_positions=options.sample_positions,
            max_store_bytes=options.max_store_bytes, store=store, analysis_options=target.analysis_options,
            upload_hold=hold), title=f"Capture of {model}",
            on_drop=(lambda spec=prompt_spec: tasks.release_upload(store, spec, hold)) if hold else None)
    except Exception:
        if hold:
            tasks.release_upload(store, prompt_spec, hold)
        raise
    view = job.view()


refused = holds_refused_entry(*(f"ls_w_cap_{name}" for name in ("limit", "new", "batch", "seed", "sample")))
if refused:
    st.caption("Start capture is off while a field above shows an entry it refused: fix or clear it first.")
if st.button("Start capture", type="primary", icon=":material/play_arrow:",
             disabled=running or not prompt_spec or not budget_ok or refused, key="ls_cap_start"):
    if not model:
        show_error("No model given", f"Type a model spec or pick one of {', '.join(KNOWN)}")
    elif apply.capture_replaces(s):
        st.session_state[PENDING] = True
    else:
        with guard("start capture"):
            start_capture(s)
at_risk = apply.capture_replaces(s)
if st.session_state.get(PENDING) and at_risk and not running:
    with st.container(border=True):
        st.warning("This session already has " + md_text("; ".join(at_risk)) + ". A new capture replaces its "
                   "capture, and removes the layer sets and drafts that do not fit it. Start it in a new session "
                   "instead? This one stays as it is.", icon=":material/help:")
        a, b, c = st.columns([2, 2, 1])                     # labels short enough for 1024 px
        if a.button("New session", type="primary", key="ls_cap_new_session", icon=":material/add:",
                    help="Start this capture in a new session; this one stays as it is"):
            st.session_state.pop(PENDING, None)
            with guard("start capture"):
                fresh = state.new_session_for_capture(s)
                start_capture(fresh)
                st.rerun()
        if b.button("Replace here", key="ls_cap_replace", icon=":material/sync:",
                    help="Start it in this session: its capture is replaced, and its sets and drafts that do not fit go"):
            st.session_state.pop(PENDING, None)
            with guard("start capture"):
                start_capture(s)
        if c.button("Cancel", key="ls_cap_cancel"):
            st.session_state.pop(PENDING, None)
            st.rerun()
else:
    st.session_state.pop(PENDING, None)


capture_views.live_capture(s, manager, view)

st.divider()
st.subheader("Stored captures")
capture_views.stored_captures(s, store)
