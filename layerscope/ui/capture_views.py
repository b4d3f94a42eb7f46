"""The Capture page's larger blocks: the live panel of its capture job and the table of stored captures. They
draw; the page (app_pages/capture.py) keeps its form, the start of a capture and the order of things.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from layerscope import fmt
from layerscope.capture.stored import list_captures
from layerscope.ui import apply
from layerscope.ui.state import commit
from layerscope.ui.widgets import guard, job_status, offered, poll_interval, table


def m_total(v) -> int | None:
    """How many prompts the capture will record, once it knows (not while the model loads)."""
    return v.metrics.get("conversations_total") or None


def live_capture(s, manager, view) -> None:
    """The session's latest capture job, polled: its progress while it runs, its result once it finished.
    `view` is the job's view as the page last drew it (None: no capture job yet)."""

    @st.fragment(run_every=poll_interval(view))
    def live_capture():
        j = manager.latest(s.id, "capture")
        if j is None:
            return
        v = j.view()
        if view is not None and view.running and not v.running:
            # It just finished: redraw the whole page with its result. Only then: a job that is still running (loading
            # the model, waiting in line) must not rerun the page, or every rerun finds it running and reruns again at
            # once: a loop of full runs that greys the page out, slows the job, and can leave the page frozen (issue 51).
            st.rerun()
        job_status(v, key="capture")
        if v.running and m_total(v):
            m = v.metrics
            a, b, c = st.columns(3)
            a.metric("Tokens recorded", f"{m.get('tokens', 0):,}")
            b.metric("Tokens / s", f"{m.get('tokens_per_s', 0.0):.0f}")
            c.metric("Prompts done", f"{m.get('conversations', 0)}/{m_total(v)}")
        elif v.running:
            # before the first batch (the model loading, a first use de-quantizing it; or waiting for another job) there
            # are no numbers yet: the bar above says what it does and for how long, and the panel keeps polling
            st.caption("Tokens recorded, tokens/s and prompts done show here from the first batch; the page stays usable "
                       "meanwhile.")
        elif v.finished_ok and v.result:
            r = v.result
            st.caption(f"Capture `{r['key']}`: {r['tokens']:,} tokens"
                       + (" (served from the store)" if r.get("cached") else f" in {fmt.duration(r['seconds'])}")
                       + ". Next: the **Entropy** and **CKA heatmap** pages.")

    live_capture()


def stored_captures(s, store) -> None:
    """The store's captures as a table (damaged and unfinished ones too, marked with their fix), and opening one."""
    with guard("stored captures"):
        caps = list_captures(store, incomplete=True)     # damaged and unfinished ones too, marked with their fix
        if not caps:
            st.caption("The store is empty: run a capture above.")
            return
        df = pd.DataFrame([{
            "key": c.get("key"), "model": c.get("model"), "prompt set": c.get("prompt_set"),
            "prompts": c.get("conversations"), "tokens": c.get("tokens"), "layers": c.get("num_layers"),
            "created": fmt.when(c.get("created")), "MB": round((c.get("size_bytes") or 0) / 2**20, 1),
            "active": "●" if c.get("key") == s.capture_key else "",
            "state": "ok" if c.get("state", "ok") == "ok" else f"{c['state'].upper()}: {c.get('problem')}. {c.get('fix')}",
        } for c in caps])
        table(df, key="ls_cap_table", filename="captures")
        keys = [c["key"] for c in caps if c.get("state") != "incomplete"]
        offered("ls_cap_pick", keys)
        pick = st.selectbox("Capture to open", keys, key="ls_cap_pick",
                            index=keys.index(s.capture_key) if s.capture_key in keys else 0,
                            format_func=lambda k: next(f"{k} · {c.get('model')} · {c.get('prompt_set')} · "
                                                       f"{fmt.count(c.get('tokens'))} tokens" if c.get("state", "ok") == "ok"
                                                       else f"DAMAGED · {k} · {c.get('problem')}"
                                                       for c in caps if c["key"] == k))
        if st.button("Open this capture", key="ls_cap_open", icon=":material/folder_open:"):
            with guard("open capture"):
                apply.open_capture(s, store, pick)
                commit(s)
                st.rerun()
