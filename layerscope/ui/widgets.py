"""Shared Streamlit widgets: errors with their fix, charts with exports, tables with CSV, job panels."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time

import streamlit as st

from layerscope import eta, fmt
from layerscope.errors import LayerScopeError
from layerscope.ui import image_export, plots
from layerscope.ui.jobs import INTERRUPTED, JobView, get_manager
from layerscope.ui.worker import CANCELLED, DONE, FAILED
from layerscope.validate import read_number

log = logging.getLogger("layerscope.ui")

IMAGE_FORMAT_KEY = "ls_image_format"


# ---------------------------------------------------------------------------- errors

# The backend writes its messages for both faces in the command line's words; the app says its own actions.
CLI_WORDS = (
    ("Run the same command again", "Start the same job again on its page"),
    ("run the same command again", "start the same job again on its page"),
    ("pass --store on a larger disk", "point LAYERSCOPE_STORE at a larger disk and restart the app"),
    ("(--auto-even-if-slower runs it anyway)", "(turn K = auto off and pick a depth to run the draft anyway)"),
    ("--k auto", "K = auto"),
    ("--tree auto", "tree = auto"),
    ("--lookup auto", "prompt lookup = auto"),
)


def in_app_words(text: str | None) -> str:
    """A backend message as the app says it: the command line's actions replaced by the app's (CLI_WORDS)."""
    text = "" if text is None else str(text)
    for cli, app in CLI_WORDS:
        text = text.replace(cli, app)
    return text


def show_error(e: BaseException | str, fix: str | None = None) -> None:
    """A LayerScopeError (or problem + fix) as an error box: the problem in bold, then the fix."""
    if isinstance(e, LayerScopeError):
        problem, fix = e.problem, e.fix
    elif isinstance(e, BaseException):
        problem = f"Unexpected error: {type(e).__name__}: {e}"
        fix = fix or "This is a bug in LayerScope; the server log has the details"
    else:
        problem = str(e).rstrip(".")
    problem, fix = in_app_words(problem), in_app_words(fix)
    st.error(f"**{md_text(problem)}.** {md_text(fix or '')}".strip(), icon=":material/error:")   # user text inside: escaped


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
    """The image format of chart downloads: the session's choice (sidebar), PNG until one is made."""
    s = st.session_state.get("ls_session")
    kind = (s.view.get("image_format") if s is not None else None) or st.session_state.get(IMAGE_FORMAT_KEY, "png")
    return kind if kind in ("png", "svg") else "png"


def chart(fig, *, key: str, filename: str, on_select=None, selection_mode=None, height: int | None = None):
    """A Plotly chart with one download button under it, in the image format chosen in the sidebar (PNG or SVG,
    rendered on click by headless chromium); the chart's own toolbar has no second download.

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
    image_buttons(fig, key=key, filename=filename)
    return state if on_select is not None else None


def image_buttons(fig, *, key: str, filename: str) -> None:
    """One download of `fig` in the chosen image format; the image is rendered only when the button is pressed."""
    kind = image_format()
    st.download_button(f"Download {kind.upper()}", data=_image_maker(fig, kind), file_name=f"{filename}.{kind}",
                       mime="image/png" if kind == "png" else "image/svg+xml", key=f"{key}_image",
                       on_click="ignore", icon=":material/image:", width="content",
                       help=f"Download this chart as {kind.upper()} (the format is set in the sidebar)")


def _image_maker(fig, fmt: str):
    def make() -> bytes:
        try:
            return image_export.figure_image(fig, fmt)
        except image_export.ImageExportError as e:   # the browser gets a short text file saying why
            log.warning("static image export failed: %s", e)
            return f"LayerScope could not render this chart as {fmt.upper()}: {e}\n".encode()
    return make


MISSING = fmt.MISSING


def display_frame(df, na: dict | None = None):
    """`df` for the screen: every cell through the one formatter (`layerscope.fmt.cell`: numbers in one form, never
    an exponent cut short; layer lists in full; missing values "—", or `na[column]` for that column)."""
    import pandas as pd  # here, not at the top: the app's shell and Home page start without pandas

    out = {}
    for c in df.columns:
        gone = (na or {}).get(c)
        col = df[c]
        if pd.api.types.is_float_dtype(col) and col.isna().any() and (col.dropna() % 1 == 0).all():
            col = [None if pd.isna(v) else int(v) for v in col]      # whole numbers pandas made float by a gap
        out[c] = [gone if gone is not None and fmt.missing(v if not hasattr(v, "item") else v.item()) else fmt.cell(v)
                  for v in col]
    return pd.DataFrame(out, index=df.index)


def _numeric(col) -> bool:
    values = [v for v in col if not fmt.missing(v if not hasattr(v, "item") else v.item())]
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) or hasattr(v, "dtype")
                                for v in values)


def table(df, *, key: str, filename: str, hide_index: bool = True, column_config: dict | None = None,
          na: dict | None = None, **kwargs) -> None:
    """A dataframe as text in the one number form (missing values "—"; columns of numbers, formatted or not,
    right-aligned), with a CSV download of the real values under it."""
    shown = display_frame(df, na)
    config = {c: st.column_config.TextColumn(c, alignment="right") for c in df.columns
              if _numeric(df[c]) or _formatted_number(df[c])}
    config.update(column_config or {})
    st.dataframe(shown, hide_index=hide_index, key=f"{key}_df", width="stretch", column_config=config, **kwargs)
    buf = io.StringIO()
    df.to_csv(buf, index=not hide_index)
    st.download_button("CSV", data=buf.getvalue().encode(), file_name=f"{filename}.csv",
                       mime="text/csv", key=f"{key}_csv", on_click="ignore", icon=":material/download:",
                       help="Download this table as CSV")


_NUMBER_TEXT = re.compile(r"^[+\-−]?[\d,]+(\.\d+)?(%|×)?( \[[^\]]+\])?$")


def _formatted_number(col) -> bool:
    """A column of numbers already formatted by layerscope.fmt ("1.133 [1.091, 1.160]", "24.5%")."""
    values = [v for v in col if isinstance(v, str) and v not in ("", MISSING, fmt.NOT_APPLICABLE)]
    return bool(values) and all(_NUMBER_TEXT.match(v) for v in values)


# ---------------------------------------------------------------------------- jobs

JOB_WORDS = {"bench": "benchmark", "train": "training", "analysis-compare": "comparison"}
CANCEL_OWNER_KEY = "ls_cancel_owner"     # job id -> the widget key that draws its cancel button this run


def time_left(view: JobView) -> str | None:
    """The running job's time left as its current phase measured it (the job's `eta_s`, layerscope.eta): "about
    3 min left", "estimating time left…"; None for a job that is not running or says nothing of it."""
    if view.state != "running" or "eta_s" not in view.metrics:
        return None
    return eta.text(view.metrics["eta_s"])


def estimate_caption(make, what: str = "estimate") -> None:
    """A step's estimate before it starts (the forecast.Forecast `make()` returns), as a caption by its start button;
    a problem with it is one error line, the page goes on."""
    with guard(what):
        st.caption(md_text(make().line()))


def rate_text(view: JobView) -> str:
    """The job's own throughput, when it reports one: tokens/s, steps/s."""
    m = view.metrics
    if m.get("tokens_per_s"):
        return f"{fmt.count(m['tokens_per_s'])} tokens/s"
    return ""


def job_status(view: JobView, *, key: str, show_cancel: bool = True) -> None:
    """Progress bar with phase, done/total (in the message), rate, elapsed and ETA, and one cancel button
    per job on the page; the outcome after."""
    if view.running:
        p = view.progress if view.progress is not None else 0.0
        parts = [f"{md_text(view.title)}: {md_text(in_app_words(view.message))}"
                 + (" (cancelling…)" if view.cancel_requested else "")]
        rate = rate_text(view)
        if rate:
            parts.append(rate)
        parts.append(f"{fmt.duration(view.elapsed)} elapsed")
        left = time_left(view)
        if left:
            parts.append(left)
        st.progress(p, text=" · ".join(parts))
        owners = st.session_state.setdefault(CANCEL_OWNER_KEY, {})
        if show_cancel and not view.cancel_requested and owners.setdefault(view.id, key) == key:
            if st.button(f"Cancel {JOB_WORDS.get(view.kind, view.kind)}", key=f"{key}_cancel_{view.id}", icon=":material/stop_circle:"):
                get_manager().cancel(view.id)
                st.rerun()
    elif view.state == FAILED:
        show_error(view.error or "The job failed", view.fix)
    elif view.state == INTERRUPTED:
        st.warning(f"{md_text(view.error)}. {md_text(view.fix)}.", icon=":material/restart_alt:")
        if st.button("Dismiss", key=f"{key}_dismiss_{view.id}", help="Forget this interrupted job (its record in the store)"):
            get_manager().dismiss(view.owner, view.kind)
            st.rerun()
    elif view.state == CANCELLED:
        st.warning(f"{md_text(view.title)} was cancelled after {fmt.duration(view.elapsed)}. "
                   + in_app_words(view.fix), icon=":material/stop_circle:")
    elif view.state == DONE:
        st.success(f"{md_text(view.title)}: done in {fmt.duration(view.elapsed)}.", icon=":material/check_circle:")


def poll_interval(view: JobView | None, seconds: float = 1.0) -> float | None:
    """How often a fragment should rerun to follow `view`: while it runs, else never."""
    return seconds if view is not None and view.running else None


def wait_briefly(job, seconds: float = 0.8) -> None:
    """Give a job that usually finishes at once (cached results) a moment before drawing a progress bar."""
    deadline = time.time() + seconds
    while time.time() < deadline and job.view().running:
        time.sleep(0.05)


# ---------------------------------------------------------------------------- pickers

def offered(key: str, options, default=None) -> None:
    """Forget the choice remembered at `key` when its picker no longer offers it (a draft that joined the session
    leaves the store's list; a capture or session was deleted), so the picker shows `default` (its first option when
    None) instead of a choice that is gone. Call it before drawing the picker."""
    if key in st.session_state and st.session_state[key] not in list(options):
        if default is None:
            del st.session_state[key]
        else:
            st.session_state[key] = default


def layer_picker(where, label: str, num_layers: int, *, key: str, on_change=None, max_selections: int | None = None,
                 placeholder: str | None = None, help: str | None = None):
    """A multiselect of layers 0..num_layers-1 where a typed number and Enter pick that one layer. Streamlit's
    dropdown puts "Select N matches" first when several options match what was typed ("8" matches 8, 18 and 28), and
    Enter takes the first row: so no bulk row here, and options match by prefix, which puts the typed number first."""
    return where.multiselect(label, list(range(num_layers)), key=key, on_change=on_change, max_selections=max_selections,
                             placeholder=placeholder, help=help, select_all=False, filter_mode="prefix")


# ---------------------------------------------------------------------------- number fields

def refused_key(key: str) -> str:
    return f"ls_refused_{key}"


def showing_refused_key(key: str) -> str:
    return f"ls_refused_shown_{key}"


def holds_refused_entry(*keys: str) -> bool:
    """Whether a number field of `keys`, as drawn this run, shows an entry it refused (its error under it): a button
    that acts on the fields stays off until the entry is fixed, whatever number the field still keeps."""
    return any(st.session_state.get(showing_refused_key(k), False) for k in keys)


def text_key(key: str) -> str:
    """The key of the text box of the number field whose number lives in st.session_state[key]."""
    return f"{key}_text"


def number_text(value) -> str:
    """How a field shows the number it holds: digits for a whole number, the shortest exact form otherwise."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def number_field(where, label: str, *, key: str, min_value, max_value=None, integer: bool = True, on_change=None,
                 help=None, disabled: bool = False):
    """A number typed as text and read strictly (`validate.read_number`, its range by `validate.check_number`).

    A number input of the browser turns '1e3' into 1 in a whole-number field and drops letters without a word; here
    the server reads exactly what was typed: a good entry becomes st.session_state[key] and `on_change` runs (with
    `state.bind_view`, the session keeps it); anything else changes nothing and one line under the field says what
    was wrong and what to type ("'1e3' is not a whole number in digits. Type 1000"). The number lives in
    st.session_state[key], set before the field is drawn (bind_view, or the page); the text box is keyed
    `text_key(key)`. Returns the number the field holds."""
    box = text_key(key)
    refused = st.session_state.pop(refused_key(key), None)
    st.session_state[showing_refused_key(key)] = refused is not None     # for holds_refused_entry, this run
    if refused is None:                       # the box shows the held number; a refused entry stays in view once
        st.session_state[box] = number_text(st.session_state.get(key))

    def typed():
        try:
            value = read_number(st.session_state[box], label, integer=integer, minimum=min_value, maximum=max_value)
        except LayerScopeError as e:
            st.session_state[refused_key(key)] = (e.problem, e.fix)
            return
        st.session_state[key] = value
        if on_change is not None:
            on_change()

    kind = "a whole number" if integer else "a number"
    where.text_input(label, key=box, on_change=typed, help=help, disabled=disabled,
                     placeholder=f"{kind}{_range_words(min_value, max_value)}")
    value = st.session_state.get(key)
    if refused is not None:
        problem, fix = refused
        where.error(f"**{md_text(problem)}.** {md_text(fix)}; the field keeps "
                    f"{'nothing' if value is None else number_text(value)}.", icon=":material/block:")
    return value


def _range_words(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f", {minimum:,} to {maximum:,}"
    return f", at least {minimum:,}" if minimum is not None else ""


# ---------------------------------------------------------------------------- options

OPTION_LABELS = {"alpha": "α", "min_entropy": "threshold", "response_only": "response tokens only",
                 "outlier_factor": "outlier factor", "max_tokens": "max tokens", "kernel": "kernel"}


def option_changes(old: dict, new: dict) -> list[str]:
    """What differs between two analysis option dicts, as 'threshold 0.5 → 1' phrases (labelled keys only)."""
    def fmt(v):
        if v is None:
            return "off"
        if isinstance(v, bool):
            return "on" if v else "off"
        return f"{v:g}" if isinstance(v, float) else str(v)

    return [f"{label} {fmt(old.get(k))} → {fmt(new.get(k))}" for k, label in OPTION_LABELS.items()
            if k in new and fmt(old.get(k)) != fmt(new.get(k))]


# ---------------------------------------------------------------------------- text

_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~$:])")


def md_text(text) -> str:
    """User text (a session or set name) for a Markdown string: every Markdown character escaped, so
    it shows exactly as typed and never as formatting, a link or LaTeX."""
    return _MD_SPECIAL.sub(r"\\\1", str(text)).replace("\n", " ")


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
        t = fmt.escape(text).replace("\n", "↵<br>")
        spans.append(f'<span style="{style.get(kind, "")}">{t}</span>')
    return ('<div style="font-family:ui-monospace,monospace;font-size:0.9rem;line-height:1.6;'
            'white-space:pre-wrap;border:1px solid #ddd;border-radius:6px;padding:0.6rem;">'
            + "".join(spans) + "</div>")


def legend_html() -> str:
    return ('<span style="background:#c7f0c2;padding:0 4px;border-radius:3px">accepted draft token</span> '
            '<span style="background:#fde2b8;padding:0 4px;border-radius:3px">target token (bonus / correction)</span>')
