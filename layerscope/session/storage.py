"""Sessions in the store: one archive per session, ``<store>/sessions/<id>/session.zip``.

Saving writes atomically (temp file + rename) after checking the archive it is about to write with the
checks import makes, so a session that saves always loads again. A stored archive is read only if it is a
regular file (not a link, pipe or device) under the size limit. Stored sessions never hold drafts.

Who may change a stored session is `Session.editable_by`; here it is enforced where it matters: `save` never
writes over a snapshot (frozen) or over a session of another owner, and `delete` removes only the owner's own.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

from layerscope.errors import SessionError
from layerscope.session.archive import MAX_ARCHIVE_BYTES
from layerscope.session.check import refuse
from layerscope.session.model import Session, now_iso
from layerscope.session.schema import CONTROL, NAME_MAX, valid_id
from layerscope.store import StoreWriteError, atomic_write_bytes

ARCHIVE_NAME = "session.zip"


def _archive_path(store, sid: str) -> Path:
    return Path(store.path("sessions", sid)) / ARCHIVE_NAME


def _check_id(sid) -> str:
    if not valid_id(sid):
        raise SessionError(f"{sid!r} is not a session id",
                           "A session id is 12 lowercase hex characters, as in the share link ?session=0123456789ab")
    return sid


def save(session: Session, store, *, name: str | None = None, touch: bool = True) -> Path:
    """Write the session into the store (atomically: temp file + rename). Returns the archive path."""
    _check_id(session.id)
    if name is not None:
        name = name.strip()
        if not name or len(name) > NAME_MAX or CONTROL.search(name):
            raise SessionError(f"A session name must be 1..{NAME_MAX} characters on one line",
                               "Type a shorter, non-empty name")
        session.name = name
    if touch:
        session.updated = now_iso()
    data = session.to_bytes()
    if len(data) > MAX_ARCHIVE_BYTES:
        raise SessionError(f"This session's archive would be {len(data) >> 20} MiB, over the limit of "
                           f"{MAX_ARCHIVE_BYTES >> 20} MiB that import accepts", "Remove old benchmark runs or studies")
    Session.from_bytes(data, source="This session")     # the checks import makes: what saves, loads again
    path = _archive_path(store, session.id)
    stored = _stored(path)
    if stored is not None and (stored.frozen or stored.owner != session.owner):
        raise SessionError(f"Session {session.id} is {'a shared snapshot' if stored.frozen else 'someone else’s'}: "
                           "it is never saved over", "Make your own copy of it and change that")
    try:
        atomic_write_bytes(path, data)
    except StoreWriteError as e:        # a full or read-only disk: the temporary file is gone, the old archive stays
        raise StoreWriteError(f"Session {session.id} was not saved: {e.problem[:1].lower()}{e.problem[1:]}",
                              "Its last saved version is intact; free disk space (or use a writable store) and the "
                              "session is saved again with the next change") from None
    _drop_stale_temps(path.parent)
    return path


def _stored(path: Path) -> Session | None:
    """The session stored at `path` (without its tensors), or None when there is none or it does not read."""
    if not path.is_file():
        return None
    try:
        return Session.from_bytes(_read_file(path, "The stored session"), arrays=False)
    except SessionError:
        return None


def snapshot(session: Session, store) -> Session:
    """An immutable copy of `session` under a new id, for a share link: what the link shows never changes
    (a later save of `session` does not touch it; a new link is a new snapshot)."""
    snap = session.copy(owner=session.owner, frozen=True)
    save(snap, store, touch=False)
    return snap


def _drop_stale_temps(directory: Path, age_s: float = 3600.0) -> None:
    """Temporary archives of saves killed over an hour ago (a live save renames its own within seconds)."""
    now = time.time()
    for p in directory.glob(f".{ARCHIVE_NAME}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > age_s:
                p.unlink()


def _read_file(path: Path, source: str) -> bytes:
    """A stored archive's bytes: a regular file (not a link, pipe or device) under the size limit."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            refuse(source, "its archive is not a regular file", "Delete it and save the session again")
        if st.st_size > MAX_ARCHIVE_BYTES:
            refuse(source, f"its archive is larger than {MAX_ARCHIVE_BYTES >> 20} MiB", "Delete it")
        return path.read_bytes()
    except OSError as e:
        raise SessionError(f"{source} cannot be read ({e.strerror})", "Check the store directory") from None


def exists(store, sid: str) -> bool:
    return valid_id(sid) and _archive_path(store, sid).is_file()


def load(store, sid: str) -> Session:
    """The stored session `sid`; SessionError when it is missing or broken."""
    _check_id(sid)
    path = _archive_path(store, sid)
    if not path.is_file():
        raise SessionError(f"No saved session {sid} in {store.root}",
                           "Check the link, or open the Sessions page to list the saved sessions")
    session = Session.from_bytes(_read_file(path, f"Session {sid}"), source=f"Session {sid}")
    if session.id != sid:
        raise SessionError(f"Session {sid} holds another session's data ({session.id})", "Delete it and save again")
    if hasattr(store, "touch"):
        store.touch("sessions", sid)
    return session


def delete(store, sid: str, *, owner: str | None) -> None:
    """Delete the stored session `sid` if `owner` owns it (Session.editable_by); else a SessionError."""
    _check_id(sid)
    stored = load(store, sid) if exists(store, sid) else None
    if stored is not None and not stored.editable_by(owner):
        raise SessionError(f"Session {sid} is not yours to delete"
                           + (" (a shared snapshot: its link must keep working)" if stored.frozen else ""),
                           "Only the browser that made a session can delete it")
    if hasattr(store, "remove"):
        store.remove("sessions", sid)
    else:
        _archive_path(store, sid).unlink(missing_ok=True)


ANY = object()      # list_sessions(owner=ANY): every session of the store (the store's own view, not the app's)


def list_sessions(store, *, include_unnamed: bool = True, owner=ANY) -> list[dict]:
    """Summaries of stored sessions, most recently updated first. A broken entry is listed with `error`.
    With `owner` (an owner_hash): only that owner's sessions, snapshots left out (broken entries too: whose
    they are cannot be read)."""
    root = Path(store.path("sessions", "0" * 12)).parent
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        path = d / ARCHIVE_NAME
        if not (d.is_dir() and valid_id(d.name) and path.is_file()):
            continue
        try:
            s = Session.from_bytes(_read_file(path, f"Session {d.name}"), source=f"Session {d.name}", arrays=False)
        except SessionError as e:
            if owner is not ANY:
                continue
            out.append({"id": d.name, "name": None, "error": str(e), "updated": ""})
            continue
        if s.name is None and not include_unnamed:
            continue
        if owner is not ANY and (s.owner != owner or s.frozen):
            continue
        out.append({
            "id": s.id, "name": s.name, "model": s.model, "prompt_set": s.prompt_set,
            "capture_key": s.capture_key, "tokens": s.capture.get("tokens"),
            "num_layers": s.num_layers, "layer_sets": [x["layers"] for x in s.layer_sets],
            "drafts": len(s.drafts), "benchmarks": len(s.bench_results), "updated": s.updated,
            "owner": s.owner, "frozen": s.frozen, "origin": s.origin,
        })
    return sorted(out, key=lambda r: r.get("updated") or "", reverse=True)
