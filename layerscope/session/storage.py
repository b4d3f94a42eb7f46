"""Sessions in the store: one archive per session, ``<store>/sessions/<id>/session.zip``.

Saving writes atomically (temp file + rename) after checking the archive it is about to write with the
checks import makes, so a session that saves always loads again. A stored archive is read only if it is a
regular file (not a link, pipe or device) under the size limit. Stored sessions never hold drafts.

Who may change a stored session is `Session.editable_by`; here it is enforced where it matters: `save` never
writes over a snapshot (frozen) or over a session of another owner, and `delete` removes only the owner's own.

Several writers (two tabs, two app servers on one store): a save holds the store's write lock of the session, and
a Session remembers the archive it was read from or last saved as. When the stored archive has changed since (an
other tab or server saved it), the save merges instead of overwriting: what this object changed since it read the
session goes over the stored version, and every other change of the stored version stays (`merge`); the object
then holds the merged session. A merge that does not make a valid session (say a layer set added here that the
other side's new capture has no room for) is refused (`SessionConflict`), the stored version untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
from dataclasses import fields
from pathlib import Path

import torch

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


class SessionConflict(SessionError):
    """This save and another writer's changed the same session in ways that do not make one valid session."""


def save(session: Session, store, *, name: str | None = None, touch: bool = True) -> Path:
    """Write the session into the store (atomically: temp file + rename), merged with what another writer saved
    since this object read it (the module docstring). Returns the archive path."""
    _check_id(session.id)
    if name is not None:
        name = name.strip()
        if not name or len(name) > NAME_MAX or CONTROL.search(name):
            raise SessionError(f"A session name must be 1..{NAME_MAX} characters on one line",
                               "Type a shorter, non-empty name")
        session.name = name
    if touch:
        session.updated = now_iso()
    data = _checked_bytes(session)
    path = _archive_path(store, session.id)
    try:
        with store.lock("sessions", session.id) if hasattr(store, "lock") else contextlib.nullcontext():
            stored_data = _stored_bytes(path)
            stored = _parse(stored_data, arrays=False)
            if stored is not None and (stored.frozen or stored.owner != session.owner):
                raise SessionError(f"Session {session.id} is {'a shared snapshot' if stored.frozen else 'someone else’s'}: "
                                   "it is never saved over", "Make your own copy of it and change that")
            base = getattr(session, BASE, None)
            if stored is not None and base is not None and _digest(stored_data) != base[0]:
                merged = merge(base, session, _parse(stored_data, arrays=True))
                try:
                    data = _checked_bytes(merged)
                except SessionError as e:
                    raise SessionConflict(
                        f"Session {session.id} was changed elsewhere (another tab or server) since this tab read it, "
                        f"and this change does not fit with that one: {e.problem}",
                        "The saved version is kept; reload the page to see it, then make the change again") from None
                for f in fields(Session):
                    setattr(session, f.name, getattr(merged, f.name))
            atomic_write_bytes(path, data)
    except StoreWriteError as e:        # a full or read-only disk: the temporary file is gone, the old archive stays
        raise StoreWriteError(f"Session {session.id} was not saved: {e.problem[:1].lower()}{e.problem[1:]}",
                              "Its last saved version is intact; free disk space (or use a writable store) and the "
                              "session is saved again with the next change") from None
    _remember(session, data)
    _drop_stale_temps(path.parent)
    return path


def _checked_bytes(session: Session) -> bytes:
    """The archive of `session`, checked as import checks it (what saves, loads again), under the size limit."""
    data = session.to_bytes()
    if len(data) > MAX_ARCHIVE_BYTES:
        raise SessionError(f"This session's archive would be {len(data) >> 20} MiB, over the limit of "
                           f"{MAX_ARCHIVE_BYTES >> 20} MiB that import accepts", "Remove old benchmark runs or studies")
    Session.from_bytes(data, source="This session")
    return data


# ---------------------------------------------------------------------------- several writers

BASE = "_stored_as"      # on a Session read or saved here: (sha256 of that archive, its fields as JSON, its arrays)
SHARED_STATE = ("model", "prompt_set", "capture_key", "capture", "analysis_options", "stats")   # with the arrays
OWN = ("id", "owner", "frozen", "origin", "created")     # who and what the session is: this object's
ENTRY_KEYS = {"layer_sets": "layers", "drafts": "path"}  # list entries known by a key (others: by their whole JSON)
VIEW_INDICES = {"bench_run": "bench_results", "study_run": "study", "cmp_bench_runs": "bench_results"}   # view keys
#   that hold positions in a list (one position or a list of them): a merge points them at the same entries again


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fields(session: Session) -> dict:
    """Every field but the arrays, as the archive holds them (what merge compares and builds a Session from)."""
    return {"owner": None, "frozen": False, "origin": None, **session.to_json()}


def _remember(session: Session, data: bytes) -> None:
    setattr(session, BASE, (_digest(data), _fields(session), dict(session.arrays)))


def merge(base: tuple, mine: Session, theirs: Session) -> Session:
    """Three-way merge: `mine` and `theirs` both started from `base` (what _remember kept). Per field, the side
    that changed it wins; when both did, lists keep both sides' entries (an entry `mine` removed goes, one it
    edited replaces theirs), the view merges key by key, and anything else is `mine`'s. The capture, its
    statistics and their arrays are one unit, never mixed from two sides."""
    _, b, b_arrays = base
    m, t = _fields(mine), _fields(theirs)
    out = {}
    mine_moved = [m[k] for k in SHARED_STATE] != [b.get(k) for k in SHARED_STATE] or not _same_arrays(mine.arrays,
                                                                                                       b_arrays)
    side, arrays = (m, mine.arrays) if mine_moved else (t, theirs.arrays)
    for k in SHARED_STATE:
        out[k] = side[k]
    for k in m:
        if k in SHARED_STATE:
            continue
        if k in OWN or m[k] != b.get(k) and t[k] == b.get(k):
            out[k] = m[k]
        elif m[k] == b.get(k):
            out[k] = t[k]
        elif isinstance(m[k], list) and isinstance(t[k], list):
            out[k] = _merge_list(b.get(k) or [], m[k], t[k], ENTRY_KEYS.get(k))
        elif isinstance(m[k], dict) and isinstance(t[k], dict):
            out[k] = _merge_dict(b.get(k) or {}, m[k], t[k])
        else:
            out[k] = m[k]
    out["view"] = _view_positions(b, m, t, out)
    merged = Session(**out)
    merged.arrays = dict(arrays)
    return merged


def _view_positions(b: dict, m: dict, t: dict, out: dict) -> dict:
    """The merged view, with every position in a list (VIEW_INDICES) pointing at the entry it pointed at on the
    side the value came from (mine where this object changed it, else theirs): a merged list can hold that entry
    elsewhere (the other side appended its own first), or not at all (removed there: the key goes, and the page
    shows its default)."""
    view = dict(out["view"])
    for key, field in VIEW_INDICES.items():
        if key not in view:
            continue
        side = m if key in m["view"] and m["view"][key] != b.get("view", {}).get(key) else t
        where = {json.dumps(x, sort_keys=True): i for i, x in reversed(list(enumerate(out[field])))}

        def moved(i):
            entries = side[field]
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(entries):
                return None
            return where.get(json.dumps(entries[i], sort_keys=True))
        value = side["view"].get(key, view[key])
        if isinstance(value, list):
            view[key] = [j for j in map(moved, value) if j is not None]
        elif (j := moved(value)) is None:
            view.pop(key)
        else:
            view[key] = j
    return view


def _same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] or torch.equal(a[k], b[k]) for k in a)


def _merge_list(base: list, mine: list, theirs: list, key: str | None) -> list:
    ident = (lambda x: json.dumps(x.get(key) if isinstance(x, dict) else x, sort_keys=True)) if key else \
        (lambda x: json.dumps(x, sort_keys=True))
    removed = {ident(x) for x in base} - {ident(x) for x in mine}
    out = [x for x in theirs if ident(x) not in removed]
    for x in mine:
        if x in base:
            continue                                  # unchanged here: theirs says what became of it
        at = next((i for i, y in enumerate(out) if ident(y) == ident(x)), None)
        if at is None:
            out.append(x)
        else:
            out[at] = x
    return out


def _merge_dict(base: dict, mine: dict, theirs: dict) -> dict:
    out = dict(theirs)
    for k in set(base) | set(mine):
        if k in mine and (k not in base or mine[k] != base[k]):
            out[k] = mine[k]
        elif k not in mine and k in base:
            out.pop(k, None)                          # removed here
    return out


def _stored_bytes(path: Path) -> bytes | None:
    """The stored archive's bytes, or None when there is none or it cannot be read as one."""
    if not path.is_file():
        return None
    try:
        return _read_file(path, "The stored session")
    except SessionError:
        return None


def _parse(data: bytes | None, *, arrays: bool) -> Session | None:
    if data is None:
        return None
    try:
        return Session.from_bytes(data, arrays=arrays)
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
    data = _read_file(path, f"Session {sid}")
    session = Session.from_bytes(data, source=f"Session {sid}")
    if session.id != sid:
        raise SessionError(f"Session {sid} holds another session's data ({session.id})", "Delete it and save again")
    _remember(session, data)
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
