"""The active analysis session of a browser tab, and the store it lives in.

The session id rides in the URL (``?session=ID``), so a browser refresh or a share link opens the
same session: it is loaded from the store, where every change is saved at once (`commit`). A tab
keeps its `Session` object in `st.session_state` between reruns.

A session this browser does not own (someone else's, an old one without an owner, or a shared snapshot) opens
read-only: the tab works on an unsaved copy of it under a new id, owned by this browser, while the URL still
names the original. The first change (or "Make my copy") saves the copy and the URL moves to it; the original
is never written. Jobs are keyed by the copy's id, so a viewer never sees or cancels the owner's jobs.
"""

from __future__ import annotations

import streamlit as st

from layerscope.errors import SessionError
from layerscope.session import storage
from layerscope.session.model import Session
from layerscope.session.schema import NAME_MAX, valid_id
from layerscope.store import Store, StoreWriteError, default_root
from layerscope.ui.access import me
from layerscope.ui.model_cache import device_label
from layerscope.ui.widgets import show_error

SESSION_KEY = "ls_session"
NOTICE_KEY = "ls_session_notice"
STAMP_KEY = "ls_session_stamp"      # mtime of the stored archive this tab last read or wrote
VIEWING_KEY = "ls_session_viewing"  # the id of the read-only session this tab shows through an unsaved copy


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
    viewing = st.session_state.get(VIEWING_KEY)
    if current is not None and viewing is not None and wanted in (None, viewing):
        s = current         # the unsaved copy of a read-only session: nothing stored to refresh from yet
    elif current is not None and (wanted is None or wanted == current.id):
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
        s = Session(owner=me())
    st.session_state[SESSION_KEY] = s
    if s is not current:
        st.session_state[STAMP_KEY] = _stamp(store, s.id)
    shown = st.session_state.get(VIEWING_KEY) or s.id
    if _query_session_id() != shown:
        st.query_params["session"] = shown
    return s


def _stamp(store, sid: str):
    try:
        return (store.path("sessions", sid) / storage.ARCHIVE_NAME).stat().st_mtime_ns
    except OSError:
        return None


def _open(store, sid: str) -> Session:
    st.session_state.pop(VIEWING_KEY, None)
    if not valid_id(sid):
        st.session_state[NOTICE_KEY] = ("warning", f"?session={sid[:40]} is not a session id; started a new session.")
        return Session(owner=me())
    if not storage.exists(store, sid):
        # A tab refreshed before anything was saved, or a link to a session this server does not hold.
        st.session_state[NOTICE_KEY] = ("info", f"Session {sid} is not saved on this server; this is a new, empty session.")
        return Session(id=sid, owner=me())
    try:
        return _for_this_browser(storage.load(store, sid))
    except SessionError as e:
        st.session_state[NOTICE_KEY] = ("error", f"{e.problem}. {e.fix}")
        return Session(owner=me())


COPY_SUFFIX = " (copy)"     # ends the name of a browser's copy of a session it does not own (the original's name)


def _for_this_browser(s: Session) -> Session:
    """`s` itself when this browser may change it; else an unsaved copy of it that this browser owns, with the
    tab marked as viewing `s` read-only (the URL keeps naming `s` until the copy is saved)."""
    if s.editable_by(me()):
        st.session_state.pop(VIEWING_KEY, None)
        return s
    st.session_state[VIEWING_KEY] = s.id
    return s.copy(owner=me(), name=f"{s.name[:NAME_MAX - len(COPY_SUFFIX)]}{COPY_SUFFIX}" if s.name else None)


SHARE = "share"          # s.view[SHARE]: {"id", "at"} of the snapshot the session's share link opens


def make_share_snapshot(s: Session) -> Session:
    """Save `s` and an immutable snapshot of it, the target of its share link (remembered in s.view[SHARE]):
    what the link shows never changes, whatever the session does next; a new link is a new snapshot."""
    commit(s)
    snap = storage.snapshot(s, get_store())
    s.view[SHARE] = {"id": snap.id, "at": snap.updated}
    commit(s)
    return snap


def make_my_copy() -> None:
    """Save the tab's copy of the read-only session it shows as this browser's own (the 'Make my copy' action)."""
    s = st.session_state.get(SESSION_KEY)
    if s is not None and viewing() is not None:
        commit(s)


def viewing() -> str | None:
    """The id of the read-only session this tab shows (through its unsaved copy), or None."""
    return st.session_state.get(VIEWING_KEY)


def new_session() -> Session:
    """Start a new, empty session of this browser in the tab (the 'New session' action); the old one stays saved."""
    s = Session(owner=me())
    switch_to(s)
    return s


def new_session_for_capture(s: Session) -> Session:
    """A new session of this browser carrying the Capture page's choices and the analysis options of `s`, saved
    and made the tab's session: a capture started there replaces nothing of `s`."""
    fresh = Session(owner=me(), analysis_options=dict(s.analysis_options),
                    view={k: v for k, v in s.view.items() if k.startswith("cap_") or k == "image_format"})
    switch_to(fresh)
    commit(fresh)
    return fresh


def switch_to(s: Session) -> None:
    """Make `s` the tab's active session (after opening or importing one); one this browser does not own opens
    read-only, through an unsaved copy."""
    st.session_state.pop(VIEWING_KEY, None)
    s = _for_this_browser(s) if storage.exists(get_store(), s.id) else s
    st.session_state[SESSION_KEY] = s
    st.session_state[STAMP_KEY] = _stamp(get_store(), s.id)
    st.query_params["session"] = st.session_state.get(VIEWING_KEY) or s.id
    # widgets that show the previous session's values (names, picks, choices) start afresh
    for k in [k for k in st.session_state if str(k).startswith(("ls_w_", "ls_sets_", "ls_cka_", "ls_spec_"))]:
        del st.session_state[k]


def commit(s: Session, *, name: str | None = None) -> bool:
    """Save the session into the store now (atomic), so refreshes see this state; with `name`, under that name.
    The unsaved copy of a read-only session is saved as this browser's own session, and the URL moves to it.

    Another tab or server that saved the session since this tab read it is merged with (session.storage.save).
    A full or read-only disk (StoreWriteError), or a change that no longer fits what the other writer saved
    (SessionConflict), is shown as its one line where the save was asked for (a widget's callback included, where
    an exception would be Streamlit's error page) and False is returned; the stored version stays whole. After a
    full disk the tab keeps the change and the next commit with room saves it; after a conflict the tab's next
    run shows the stored version."""
    if not s.editable_by(me()):
        raise SessionError("Read-only: someone else's session", "Make a copy to edit (the Make my copy button)")
    s.device = s.device or device_label()
    store = get_store()
    try:
        storage.save(s, store, name=name)
    except (StoreWriteError, storage.SessionConflict) as e:
        show_error(e)
        return False
    if st.session_state.get(SESSION_KEY) is s:
        st.session_state[STAMP_KEY] = _stamp(store, s.id)
        if st.session_state.pop(VIEWING_KEY, None) is not None:
            st.query_params["session"] = s.id
            st.session_state[NOTICE_KEY] = ("info", f"Your change went into your own copy, session {s.id}; "
                                                    f"the session you opened stays as it was.")
    return True


def pop_notice():
    return st.session_state.pop(NOTICE_KEY, None)


def bind_view(s: Session, name: str, key: str, default, *, options=None, clamp=None):
    """Tie the widget keyed `key` to the session's view choice `name` (s.view), so the choice survives page
    changes, refreshes, new tabs and share links. Call it for the widget's `on_change=` before the widget is
    drawn (the widget takes no `value=`): on every run it sets the widget from the session (the session is the
    one place the value lives; Streamlit forgets a widget's value when its page is left) where the widget holds
    another value, and only there: setting a widget sends the value to the browser, so a run that began before the
    user's last change (an arrow key on a slider) would send the value before it back over it. The callback saves
    a change. A stored value not among `options`, or outside `clamp` = (lo, hi), falls back to `default`."""
    value = s.view.get(name, default)
    if options is not None and value not in options and not (isinstance(value, list) and all(v in options for v in value)):
        value = default
    if clamp is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = type(value)(min(max(value, clamp[0]), clamp[1]))
    if key not in st.session_state or st.session_state[key] != value:
        st.session_state[key] = value

    def changed():
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
