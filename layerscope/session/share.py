"""Sharing a session: the downloadable archive, with the session's drafts if asked, and importing one.

`export_bytes(s)` is the archive the store keeps (format 1); `export_bytes(s, drafts=True)` also carries
the files of every session draft this server holds (format 2; those it does not hold stay references by
path). `import_archive` checks an archive (archive.read, check.py, archive.drafts_in, and load_draft on
each draft), writes each draft into the importing store's drafts/ atomically (all or none), points the
session's drafts there and saves the session into the store.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from layerscope.draft.checkpoint import FILES as DRAFT_FILES
from layerscope.draft.checkpoint import load_draft
from layerscope.errors import LayerScopeError, SessionError
from layerscope.session import archive
from layerscope.session.check import refuse
from layerscope.session.model import Session, new_id
from layerscope.session.schema import NAME_MAX
from layerscope.session.storage import ANY, exists, list_sessions, load, save
from layerscope.store import ENTRY_NAME_RE, staged, write_error

# ---------------------------------------------------------------------------- export


def export_bytes(session: Session, *, drafts: bool = False) -> bytes:
    """The shareable archive: the same bytes the store keeps, or with `drafts` also the files of every
    session draft this server holds (`draft_files`; those it does not hold stay references by path)."""
    return session.to_bytes(draft_files(session)[0] if drafts else None)


def draft_files(session: Session) -> tuple[list[dict], list[str]]:
    """The session's drafts as archive entries [{"entry", "path", "files": {name: bytes}}] (each folder once,
    each loading with load_draft), and the paths of those not on this server. A draft folder that is here
    but does not load is a SessionError naming it."""
    included, missing, seen = [], [], set()
    for d in session.drafts:
        path = Path(d["path"])
        if d["path"] in seen:
            continue
        seen.add(d["path"])
        if not _held(path):
            missing.append(d["path"])
            continue
        try:
            load_draft(path)
        except LayerScopeError as e:
            raise SessionError(f"Draft {d['name'] if d.get('name') else path} does not load ({e.problem})",
                               "Export without drafts, or train the draft again") from None
        entry = path.name if ENTRY_NAME_RE.fullmatch(path.name) else f"draft-{len(included) + 1}"
        if entry in {x["entry"] for x in included}:
            entry = f"{entry[:100]}-{len(included) + 1}"
        included.append({"entry": entry, "path": d["path"],
                         "files": {f: (path / f).read_bytes() for f in DRAFT_FILES if (path / f).is_file()}})
    total = sum(len(b) for d in included for b in d["files"].values())
    if total > archive.MAX_DRAFTS_BYTES:
        raise SessionError(f"This session's drafts hold {total >> 20} MiB, over the {archive.MAX_DRAFTS_BYTES >> 20} MiB "
                           "an archive may carry", "Export without drafts, or remove drafts from the session")
    return included, missing


def _held(path) -> bool:
    """Whether this server holds the draft folder `path` (its required files are there)."""
    return all((Path(path) / f).is_file() for f in archive.DRAFT_REQUIRED)


def missing_drafts(session: Session) -> list[str]:
    """Paths of the session's drafts that this server does not hold (an export cannot include them)."""
    return [d["path"] for d in session.drafts if not _held(d["path"])]


# ---------------------------------------------------------------------------- import

@dataclass
class Imported:
    session: Session
    drafts: list[str] = field(default_factory=list)     # the draft folders the archive brought, in this store


IMPORTED = " (imported)"


def imported_name(name: str | None) -> str | None:
    """An imported session's name: the original's with " (imported)", so the two read apart (once, within NAME_MAX)."""
    if not name or name.endswith(IMPORTED):
        return name
    return name[:NAME_MAX - len(IMPORTED)].rstrip() + IMPORTED


def import_bytes(data: bytes, store, *, source: str = "the uploaded file", owner: str | None = None) -> Session:
    """Validate an archive and save it into the store (with its drafts, if it carries any); the session."""
    return import_archive(data, store, source=source, owner=owner).session


def import_archive(data: bytes, store, *, source: str = "the uploaded file", owner: str | None = None) -> Imported:
    """Validate an archive and save it into the store as `owner`'s session, named "<name> (imported)" ("<name>
    (imported) (2)" when `owner` has a session of that name: distinct_name) and editable (a snapshot imported is a
    session again). Keeps its id unless a different session has it.
    Drafts inside are checked and written to the store's drafts/ (all or none) before the session, whose
    draft paths then point at them."""
    doc, tensors, files = archive.read(data, source, with_drafts=True)
    session = Session.from_doc(doc, tensors, source)
    session.name, session.owner, session.frozen = imported_name(session.name), owner, False
    placed = _install_drafts(archive.drafts_in(doc, files, source), store, source)
    for d in session.drafts:
        d["path"] = placed.get(d["path"], d["path"])
    if exists(store, session.id):
        try:
            same = load(store, session.id).to_json() == session.to_json()
        except SessionError:
            same = False
        if not same:
            session.id = new_id()
    session.name = distinct_name(session.name, store, owner=owner, own_id=session.id)
    save(session, store, touch=False)
    return Imported(session, sorted(set(placed.values())))


def distinct_name(name: str | None, store, *, owner: str | None, own_id: str) -> str | None:
    """`name`, or "<name> (2)", "(3)", ... when another session of `owner` in `store` (its Sessions page's list) has it
    already: a file imported twice gives two sessions that read apart. Within NAME_MAX."""
    if not name:
        return name
    taken = {r.get("name") for r in list_sessions(store, owner=owner if owner is not None else ANY) if r["id"] != own_id}
    number = 1
    candidate = name
    while candidate in taken:
        number += 1
        suffix = f" ({number})"
        candidate = name[:NAME_MAX - len(suffix)].rstrip() + suffix
    return candidate


def _install_drafts(drafts: list[dict], store, source: str) -> dict[str, str]:
    """Write each draft into <store>/drafts/<entry> (or <entry>-<digest> when another draft has that name;
    an identical one already there is used as it is), each checked with load_draft before it is placed,
    all placed or none. Returns {path in the archive: path in this store}."""
    placed = {}
    with contextlib.ExitStack() as stack:
        for d in drafts:
            digest = hashlib.sha256("".join(sorted(hashlib.sha256(b).hexdigest() for b in d["files"].values()))
                                    .encode()).hexdigest()
            for name in (d["entry"], f"{d['entry'][:100]}-{digest[:12]}"):
                dest = Path(store.path("drafts", name))
                if not dest.exists() or _same_draft(dest, d["files"]):
                    break
            else:
                refuse(source, f"drafts/{d['entry']} and drafts/{name} of this store hold other drafts",
                       "Remove one of them from the store, or import without drafts")
            placed[d["path"]] = str(dest)
            if dest.exists():
                continue
            try:
                tmp = stack.enter_context(staged(dest))
                for f, blob in d["files"].items():
                    (tmp / f).write_bytes(blob)
            except OSError as e:
                raise write_error(e, dest) from None
            try:
                load_draft(tmp)
            except LayerScopeError as e:
                refuse(source, f"draft {d['entry']!r} does not load ({e.problem})")
    return placed


def _same_draft(directory: Path, files: dict[str, bytes]) -> bool:
    present = {f for f in DRAFT_FILES if (directory / f).is_file()}
    return present == set(files) and all((directory / f).read_bytes() == b for f, b in files.items())
