"""Shared Streamlit widgets: errors with their fix, charts with exports, tables with CSV, job panels."""

from __future__ import annotations

import contextlib
import html
import io
import logging
import time

import streamlit as st

from layerscope import plots
from layerscope.errors import LayerScopeError
from layerscope.ui.jobs import CANCELLED, DONE, FAILED, JobView, get_manager

log = logging.getLogger("layerscope.ui")

IMAGE_FORMAT_KEY = "ls_image_format"


# ---------------------------------------------------------------------------- errors

def show_error(e: BaseException | str, fix: str | None = None) -> None:
    """A LayerScopeError (or problem + fix) as an error box: the problem in bold, then the fix."""
    if isinstance(e, LayerScopeError):
        problem, fix = e.problem, e.fix
    elif isinstance(e, BaseException):
        problem = f"Unexpected error: {type(e).__name__}: {e}"
        fix = fix or "This is a bug in LayerScope; the server log has the details"
    else:
        problem = str(e).rstrip(".")
    st.error(f"**{problem}.** {fix or ''}".strip(), icon=":material/error:")


@contextlib.contextmanager
def guard(what: str = ""):
    """Run a block; a LayerScopeError or any other exception is shown as an error box, never a traceback.

    Streamlit's own control flow (st.rerun, st.stop) derives from BaseException and passes through.
    """
    try:
        yield
    except LayerScopeError as e:
        show_error(e)
    except Exception as e:  # a bug: log the traceback on the server, show one readable line
        log.exception("error in %s", what or "page")
        show_error(e)


# ---------------------------------------------------------------------------- charts and tables

def image_format() -> str:
    return st.session_state.get(IMAGE_FORMAT_KEY, "png")


def chart(fig, *, key: str, filename: str, on_select=None, selection_mode=None, height: int | None = None):
    """A Plotly chart whose toolbar downloads PNG or SVG (sidebar choice), plus a standalone-HTML download.

    With `on_select`, returns Streamlit's selection state (a dict with ``selection.points``).
    """
    config = plots.figure_config(filename, image_format())
    kwargs = dict(key=key, config=config, width="stretch")
    if height:
        kwargs["height"] = height
    if on_select is not None:
        kwargs["on_select"] = on_select
        kwargs["selection_mode"] = selection_mode or ("points", "box")
    state = st.plotly_chart(fig, **kwargs)
    st.download_button(
        "Download chart as HTML", data=lambda: plots.figure_html(fig).encode(), file_name=f"{filename}.html",
        mime="text/html", key=f"{key}_html", on_click="ignore", icon=":material/download:",
    )
    return state if on_select is not None else None


def table(df, *, key: str, filename: str, hide_index: bool = True, **kwargs) -> None:
    """A dataframe with a CSV download under it."""
    st.dataframe(df, hide_index=hide_index, key=f"{key}_df", width="stretch", **kwargs)
    buf = io.StringIO()
    df.to_csv(buf, index=not hide_index)
    st.download_button("Download table as CSV", data=buf.getvalue().encode(), file_name=f"{filename}.csv",
                       mime="text/csv", key=f"{key}_csv", on_click="ignore", icon=":material/download:")


# ---------------------------------------------------------------------------- jobs

def fmt_seconds(s: float) -> str:
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(s), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def job_status(view: JobView, *, key: str, show_cancel: bool = True) -> None:
    """Progress bar, message, elapsed time and a cancel button for a queued/running job; the outcome after."""
    if view.running:
        p = view.progress if view.progress is not None else 0.0
        label = f"{view.title}: {view.message}" + (" (cancelling…)" if view.cancel_requested else "")
        st.progress(p, text=f"{label} · {fmt_seconds(view.elapsed)}")
        if show_cancel and not view.cancel_requested:
            if st.button("Cancel", key=f"{key}_cancel_{view.id}", icon=":material/stop_circle:"):
                get_manager().cancel(view.id)
                st.rerun()
    elif view.state == FAILED:
        show_error(view.error or "The job failed", view.fix)
    elif view.state == CANCELLED:
        st.warning(f"{view.title} was cancelled after {fmt_seconds(view.elapsed)}. "
                   + (view.fix or ""), icon=":material/stop_circle:")
    elif view.state == DONE:
        st.success(f"{view.title}: done in {fmt_seconds(view.elapsed)}.", icon=":material/check_circle:")


def poll_interval(view: JobView | None, seconds: float = 0.5) -> float | None:
    """How often a fragment should rerun to follow `view`: while it runs, else never."""
    return seconds if view is not None and view.running else None


def wait_briefly(job, seconds: float = 0.8) -> None:
    """Give a job that usually finishes at once (cached results) a moment before drawing a progress bar."""
    deadline = time.time() + seconds
    while time.time() < deadline and job.view().running:
        time.sleep(0.05)


# ---------------------------------------------------------------------------- text

def highlighted_tokens(pieces) -> str:
    """HTML for generated text with accepted draft tokens highlighted.

    pieces: [(text, kind)] with kind "draft" (accepted draft token), "target" (produced by the target:
    bonus or correction) or "prompt".
    """
    style = {
        "draft": "background:#c7f0c2;border-radius:3px;",
        "target": "background:#fde2b8;border-radius:3px;",
        "prompt": "color:#777;",
    }
    spans = []
    for text, kind in pieces:
        t = html.escape(text).replace("\n", "↵<br>")
        spans.append(f'<span style="{style.get(kind, "")}">{t}</span>')
    return ('<div style="font-family:ui-monospace,monospace;font-size:0.9rem;line-height:1.6;'
            'white-space:pre-wrap;border:1px solid #ddd;border-radius:6px;padding:0.6rem;">'
            + "".join(spans) + "</div>")


def legend_html() -> str:
    return ('<span style="background:#c7f0c2;padding:0 4px;border-radius:3px">accepted draft token</span> '
            '<span style="background:#fde2b8;padding:0 4px;border-radius:3px">target token (bonus / correction)</span>')
