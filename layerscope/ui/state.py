"""The active analysis session of a browser tab, and the store it lives in.

The session id rides in the URL (``?session=ID``), so a browser refresh or a share link opens the
same session: it is loaded from the store, where every change is saved at once (`commit`). A tab
keeps its `Session` object in `st.session_state` between reruns.
"""

from __future__ import annotations

import streamlit as st

from layerscope.errors import SessionError
from layerscope.session import storage
from layerscope.session.model import Session
from layerscope.session.schema import valid_id
from layerscope.store import Store, default_root
from layerscope.ui.models import device_label

SESSION_KEY = "ls_session"
NOTICE_KEY = "ls_session_notice"
STAMP_KEY = "ls_session_stamp"      # mtime of the stored archive this tab last read or wrote


@st.cache_resource(show_spinner=False)
def _store(root: str):
    return Store(root)


def get_store():
    """The Store at $LAYERSCOPE_STORE (else ./cache), one object per root per server process."""
    return _store(str(default_root()))


def _query_session_id() -> str | None:
    value = st.query_params.get("session")
    if isinstance(value, list):
        value = value[-1] if value else None
    return value or None


def active_session() -> Session:
    """The tab's session: from session_state, else the URL's ?session=ID, else a new one."""
    store = get_store()
    wanted = _query_session_id()
    current: Session | None = st.session_state.get(SESSION_KEY)
    if current is not None and (wanted is None or wanted == current.id):
        s = current
        stamp = _stamp(store, s.id)
        if stamp is not None and stamp != st.session_state.get(STAMP_KEY):
            # another tab (or a share-link viewer) saved this session since: take its state
            try:
                s = storage.load(store, s.id)
            except SessionError as e:
                st.session_state[NOTICE_KEY] = ("error", f"{e.problem}. {e.fix}")
            st.session_state[STAMP_KEY] = stamp
    elif wanted is not None:
        s = _open(store, wanted)
    else:
        s = Session()
    st.session_state[SESSION_KEY] = s
    if s is not current:
        st.session_state[STAMP_KEY] = _stamp(store, s.id)
    if _query_session_id() != s.id:
        st.query_params["session"] = s.id
    return s


def _stamp(store, sid: str):
    try:
        return (store.path("sessions", sid) / storage.ARCHIVE_NAME).stat().st_mtime_ns
    except OSError:
        return None


def _open(store, sid: str) -> Session:
    if not valid_id(sid):
        st.session_state[NOTICE_KEY] = ("warning", f"?session={sid[:40]} is not a session id; started a new session.")
        return Session()
    if not storage.exists(store, sid):
        # A tab refreshed before anything was saved, or a link to a session this server does not hold.
        st.session_state[NOTICE_KEY] = ("info", f"Session {sid} is not saved on this server; this is a new, empty session.")
        return Session(id=sid)
    try:
        return storage.load(store, sid)
    except SessionError as e:
        st.session_state[NOTICE_KEY] = ("error", f"{e.problem}. {e.fix}")
        return Session()


def switch_to(s: Session) -> None:
    """Make `s` the tab's active session (after opening or importing one)."""
    st.session_state[SESSION_KEY] = s
    st.session_state[STAMP_KEY] = _stamp(get_store(), s.id)
    st.query_params["session"] = s.id
    # widgets that show the previous session's values (names, picks, choices) start afresh
    for k in [k for k in st.session_state if str(k).startswith(("ls_w_", "ls_sets_", "ls_cka_", "ls_spec_"))]:
        del st.session_state[k]


def commit(s: Session) -> None:
    """Save the session into the store now (atomic), so refreshes and share links see this state."""
    s.device = s.device or device_label()
    store = get_store()
    storage.save(s, store)
    if st.session_state.get(SESSION_KEY) is s:
        st.session_state[STAMP_KEY] = _stamp(store, s.id)


def pop_notice():
    return st.session_state.pop(NOTICE_KEY, None)


def bind_view(s: Session, name: str, key: str, default, *, options=None, clamp=None):
    """Tie the widget keyed `key` to the session's view choice `name` (s.view), so the choice survives page
    changes, refreshes, new tabs and share links. Call it for the widget's `on_change=` before the widget is
    drawn (the widget takes no `value=`): on every run it sets the widget from the session (the session is the
    one place the value lives; Streamlit forgets a widget's value when its page is left); the callback saves
    a change. A stored value not among `options`, or outside `clamp` = (lo, hi), falls back to `default`."""
    value = s.view.get(name, default)
    if options is not None and value not in options and not (isinstance(value, list) and all(v in options for v in value)):
        value = default
    if clamp is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = type(value)(min(max(value, clamp[0]), clamp[1]))
    st.session_state[key] = value

    def changed():
        if st.session_state[key] is None and clamp is not None:
            # a number field left empty or given letters (widgets.number_field): refused, the last good value stays
            st.session_state[f"ls_refused_{key}"] = True
            return
        current = st.session_state.get(SESSION_KEY) or s
        current.view[name] = st.session_state[key]
        commit(current)

    return changed


def session_title(s: Session) -> str:
    """How a session is named on screen: its name, else 'unnamed session ID' (it is saved as you work either way)."""
    return s.name or f"unnamed session {s.id}"


# ---------------------------------------------------------------------------- notes: changes the user must hear of

NOTES = "notes"          # s.view[NOTES]: sentences about changes the app made to the session, until dismissed


def add_note(s: Session, text: str) -> None:
    """Say a change the app made to the session (a set dropped, picks cleared): shown on every page until dismissed."""
    notes = [n for n in s.view.get(NOTES, []) if n != text]
    s.view[NOTES] = (notes + [text])[-10:]


def notes(s: Session) -> list[str]:
    return list(s.view.get(NOTES, []))


def dismiss_notes(s: Session) -> None:
    s.view.pop(NOTES, None)
    commit(s)
