"""Blocks several pages share: 'statistics or their progress', live job panels that rerun the page when done."""

from __future__ import annotations

import streamlit as st

from layerscope.capture.stored import has_capture
from layerscope.ui.jobs import INTERRUPTED, get_manager
from layerscope.ui.state import active_session, get_store, make_my_copy, viewing
from layerscope.ui.stats_access import ensure_stats
from layerscope.ui.widgets import JOB_WORDS, job_status, md_text, poll_interval, wait_briefly


def live_job(owner: str, kind: str, *, key: str, details=None, interval: float = 0.5) -> None:
    """Follow the latest `kind` job of `owner`: progress + cancel while it runs, then a full rerun.

    `details(view)` may draw live numbers/figures under the progress bar on every poll.
    """
    manager = get_manager()
    job = manager.latest(owner, kind)
    first = job.view() if job else None

    @st.fragment(run_every=poll_interval(first, interval))
    def _panel():
        j = manager.latest(owner, kind)
        if j is None:
            return
        v = j.view()
        if first is not None and first.running and not v.running:
            st.rerun()       # it just finished: redraw the whole page with the result
        job_status(v, key=key)
        if details is not None and (v.running or v.state == "done"):
            details(v)

    _panel()


def stats_or_progress(s, store, options: dict | None = None, *, key: str) -> dict | None:
    """The layer statistics for the page, or a progress bar while they are computed (then a rerun)."""
    running = get_manager().latest(s.id, "capture")
    if running is not None and running.view().running:
        st.info("A capture is running for this session; this page updates when it is done.", icon=":material/hourglass_top:")
        live_job(s.id, "capture", key=f"{key}_capture")
        if not s.has_stats:
            return None
    if not s.capture_key and not s.has_stats:
        st.info("This session has no capture yet. Start one on the **Capture** page "
                "(or open a saved session on the **Sessions** page).", icon=":material/info:")
        st.page_link("app_pages/capture.py", label="Go to Capture", icon=":material/arrow_forward:")
        return None
    stats, job = ensure_stats(s, store, options)
    if job is not None and job.view().running:
        wait_briefly(job)           # cached statistics come back at once: no progress bar flash
        stats, job = ensure_stats(s, store, options)
    if job is not None:
        v = job.view()
        if v.running:
            live_job(s.id, "analysis", key=f"{key}_analysis")
            if stats is not None:
                st.caption("Showing the previous statistics until the new ones are ready.")
        elif v.state in ("failed", "cancelled"):
            job_status(v, key=f"{key}_analysis")
            if stats is not None:
                st.caption("Showing the statistics computed with the previous options.")
    elif stats is not None and s.capture_key and not has_capture(store, s.capture_key):
        st.caption(f"Capture {s.capture_key} is not in this store: showing the statistics saved with the session.")
    return stats


JOB_PAGES = {"capture": "app_pages/capture.py", "analysis": "app_pages/entropy.py", "probe": "app_pages/layer_sets.py",
             "train": "app_pages/speculate.py", "bench": "app_pages/speculate.py", "study": "app_pages/speculate.py"}


def interrupted_jobs(owner: str) -> None:
    """One warning per job of `owner` that a stopped server left unfinished (jobs.INTERRUPTED, from its record in
    the store), saying how to resume, with a link to the page that starts it again and dismisses it (Home)."""
    manager = get_manager()
    for kind, page in JOB_PAGES.items():
        job = manager.latest(owner, kind)
        if job is not None and job.state == INTERRUPTED:
            st.warning(f"{md_text(job.error)}. {md_text(job.fix)}.", icon=":material/restart_alt:")
            st.page_link(page, label=f"Open the page of the {JOB_WORDS.get(kind, kind)}", icon=":material/arrow_forward:")


def page_header(title: str, caption: str):
    """Every page's opening: its title and one-paragraph caption; returns (the tab's Session, the Store)."""
    s, store = active_session(), get_store()
    st.title(title)
    st.caption(caption)
    return s, store


def read_only_banner() -> None:
    """When the tab shows a session this browser does not own: say so, and offer the copy that makes it editable."""
    original = viewing()
    if original is None:
        return
    st.info(f"Read-only: someone else's session (or a shared snapshot), {original}. Make a copy to edit: anything "
            "you change is saved as your own copy, and the session you opened stays as it is.",
            icon=":material/visibility:")
    st.button("Make my copy", key="ls_make_copy", icon=":material/content_copy:", on_click=make_my_copy)
