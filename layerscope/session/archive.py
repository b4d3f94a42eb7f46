"""The session archive: one zip file, written and read here, and nothing in it can execute code.

    session.json          {"layerscope_session": FORMAT, "session": {...}}   (JSON, UTF-8)
    arrays.safetensors    named float tensors (optional)

An exported archive may also carry the session's drafts (format 2):

    drafts/<entry>/config.json, model.safetensors, layers.json, layerscope.json
                          each draft folder's files; session.json lists them under "drafts" with
                          the path the session knew, each file's size and sha256

`write` makes the bytes; `read` takes them apart, refusing anything else (member names from a fixed set,
nothing pointing outside the archive's folder, sizes, JSON, safetensors, the format marker) and
checking every member's sizes before it inflates one (the declared size against the limits and, for a draft
file, against session.json's list; the compression ratio against MAX_RATIO; each read a block at a time and
never past its declared size), and
`drafts_in` checks the draft files against their list. An archive is written as the lowest format it
needs: a format 1 archive (no drafts) reads as before. The `session` object itself is checked by check.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
import zlib

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from layerscope import jsonsafe
from layerscope.capture.format import SHA256_RE
from layerscope.draft.checkpoint import FILES as DRAFT_FILES
from layerscope.errors import SessionError
from layerscope.session.check import refuse, require
from layerscope.session.schema import LIST_MAX, is_int, problem, req

FORMAT = 2                                    # what this version reads; an archive is written as the lowest it needs
PLAIN_FORMAT = 1                              # no drafts inside (stored sessions, plain exports)
JSON_MEMBER = "session.json"
ARRAYS_MEMBER = "arrays.safetensors"
MAX_JSON_BYTES = 16 * 2**20
MAX_ARRAYS_BYTES = 256 * 2**20
MAX_ARCHIVE_BYTES = MAX_JSON_BYTES + MAX_ARRAYS_BYTES   # the archive itself (compressed), on import and on save
MAX_DRAFTS_BYTES = 4 * 2**30                  # all draft files of one archive together (uncompressed)
MAX_DRAFT_JSON_BYTES = 4 * 2**20              # each JSON file of a draft
DRAFT_REQUIRED = ("config.json", "model.safetensors")
MAX_RATIO = 200                               # a member over 1 MiB inflating more than this is refused unread
DRAFT_MEMBER_RE = re.compile(r"drafts/([A-Za-z0-9][A-Za-z0-9_-]{0,127})/(" +
                             "|".join(re.escape(f) for f in DRAFT_FILES) + ")")
FILE_SCHEMA = ("obj", {"bytes": req(("range", 0, MAX_DRAFTS_BYTES)), "sha256": req("str")}, True)
DRAFT_ENTRY_SCHEMA = ("obj", {"entry": req("str"), "path": req("str"), "files": req(("map", FILE_SCHEMA))}, True)


def write(body: dict, arrays: dict[str, torch.Tensor], drafts: list[dict] | None = None) -> bytes:
    """The archive of a session's JSON `body` and its tensors (format 1); with `drafts`
    ([{"entry", "path", "files": {name: bytes}}]) also their files and their list in session.json (format 2)."""
    doc = {"layerscope_session": FORMAT if drafts else PLAIN_FORMAT, "session": body}
    if drafts:
        doc["drafts"] = [{"entry": d["entry"], "path": d["path"],
                          "files": {f: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                                    for f, b in d["files"].items()}} for d in drafts]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(JSON_MEMBER, json.dumps(doc, indent=1, allow_nan=False))
        if arrays:
            tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in arrays.items()}
            z.writestr(ARRAYS_MEMBER, save_tensors(tensors, metadata={"layerscope_session": str(PLAIN_FORMAT)}))
        for d in drafts or []:
            for f, b in d["files"].items():
                z.writestr(f"drafts/{d['entry']}/{f}", b,
                           compress_type=zipfile.ZIP_STORED if f.endswith(".safetensors") else zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def _outside(name: str) -> bool:
    """A member name that would point outside a folder it were unpacked into."""
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":")


def read(data: bytes, source: str, with_arrays: bool = True,
         with_drafts: bool = False) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict[str, bytes]]]:
    """(session.json, tensors, draft files {entry: {file: bytes}}). Draft members are checked by name always
    and read only `with_drafts` (an import); the archive may then be up to MAX_DRAFTS_BYTES larger.
    session.json is a {"layerscope_session": format this version reads, "session": {...}} object."""
    if not isinstance(data, (bytes, bytearray)) or not data:
        refuse(source, "it is empty")
    if len(data) > MAX_ARCHIVE_BYTES + (MAX_DRAFTS_BYTES if with_drafts else 0):
        refuse(source, f"it is larger than {MAX_ARCHIVE_BYTES >> 20} MiB"
               + (f" plus {MAX_DRAFTS_BYTES >> 20} MiB of drafts" if with_drafts else ""))
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        if data[:1] in (b"{", b"["):
            refuse(source, "it is a JSON file, not a session archive",
                   "Import the .zip archive that LayerScope's Sessions page downloads")
        refuse(source, "it is not a zip archive (corrupted or another kind of file)",
               "Import the .zip archive that LayerScope's Sessions page downloads")
    with z:
        names = [i.filename for i in z.infolist()]
        infos = {i.filename: i for i in z.infolist()}
        escaping = [n for n in names if _outside(n)]
        if escaping:
            refuse(source, f"the member {escaping[0][:200]!r} points outside the archive's folder; nothing was written",
                   "Import only archives LayerScope exported; this one may have been made to overwrite files")
        if len(infos) != len(names):
            refuse(source, f"the archive holds {next(n for n in names if names.count(n) > 1)[:200]!r} twice")
        drafts = {n: DRAFT_MEMBER_RE.fullmatch(n) for n in names}
        unknown = sorted(n for n in set(infos) - {JSON_MEMBER, ARRAYS_MEMBER} if drafts[n] is None)
        if JSON_MEMBER not in infos:
            refuse(source, f"the archive has no {JSON_MEMBER}" + (f" (it holds {', '.join(unknown[:5])})" if unknown else ""))
        if unknown:
            refuse(source, f"the archive holds unexpected files: {', '.join(u[:200] for u in unknown[:5])}")
        if infos[JSON_MEMBER].file_size > MAX_JSON_BYTES:
            refuse(source, f"{JSON_MEMBER} is larger than {MAX_JSON_BYTES >> 20} MiB")
        if ARRAYS_MEMBER in infos and infos[ARRAYS_MEMBER].file_size > MAX_ARRAYS_BYTES:
            refuse(source, f"{ARRAYS_MEMBER} is larger than {MAX_ARRAYS_BYTES >> 20} MiB")
        members = {n: m for n, m in drafts.items() if m is not None}
        if not members and len(data) > MAX_ARCHIVE_BYTES:
            refuse(source, f"it is larger than {MAX_ARCHIVE_BYTES >> 20} MiB")
        if with_drafts:
            if sum(infos[n].file_size for n in members) > MAX_DRAFTS_BYTES:
                refuse(source, f"its drafts hold more than {MAX_DRAFTS_BYTES >> 20} MiB")
            big = [n for n, m in members.items() if m[2].endswith(".json") and infos[n].file_size > MAX_DRAFT_JSON_BYTES]
            if big:
                refuse(source, f"{big[0]} is larger than {MAX_DRAFT_JSON_BYTES >> 20} MiB")
        bombs = [i for n, i in infos.items() if n in (JSON_MEMBER, ARRAYS_MEMBER) or (with_drafts and n in members)
                 if i.file_size > 2**20 and i.file_size > MAX_RATIO * max(i.compress_size, 1)]
        if bombs:
            refuse(source, f"{bombs[0].filename[:200]} would inflate {bombs[0].file_size / max(bombs[0].compress_size, 1):.0f} "
                   f"times (to {bombs[0].file_size >> 20} MiB); an archive LayerScope writes inflates at most {MAX_RATIO} times "
                   "(nothing was unpacked)")
        files: dict[str, dict[str, bytes]] = {}
        try:
            raw = _inflate(z, infos[JSON_MEMBER])
            doc = _parse(raw, source)
            if with_drafts:
                listed = _listed_sizes(doc)
                for n, m in members.items():
                    if (m[1], m[2]) not in listed:
                        refuse(source, f"{n[:200]} is not in session.json's list: the draft files in the archive and "
                               "in session.json differ (nothing was unpacked)")
                    if listed[(m[1], m[2])] != infos[n].file_size:
                        refuse(source, f"{n[:200]} holds {infos[n].file_size} bytes but session.json lists "
                               f"{listed[(m[1], m[2])]} for it (nothing was unpacked)")
            blob = _inflate(z, infos[ARRAYS_MEMBER]) if with_arrays and ARRAYS_MEMBER in infos else None
            for n, m in (members.items() if with_drafts else ()):
                files.setdefault(m[1], {})[m[2]] = _inflate(z, infos[n])
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, zlib.error) as e:
            refuse(source, f"the archive is corrupted ({e})")
    arrays: dict[str, torch.Tensor] = {}
    if blob is not None:
        try:
            arrays = load_tensors(blob)
        except Exception as e:  # safetensors raises its own error types for malformed headers
            refuse(source, f"{ARRAYS_MEMBER} is not a valid safetensors file ({e})")
    if members and not (isinstance(doc, dict) and is_int(doc.get("layerscope_session"))
                        and doc["layerscope_session"] >= 2):
        refuse(source, "it holds draft files but session.json is not format 2")
    require(isinstance(doc, dict) and "layerscope_session" in doc, source,
            "session.json has no 'layerscope_session' marker (it comes from another program)")
    version = doc["layerscope_session"]
    require(is_int(version), source, "the format marker is not a number")
    if version > FORMAT:
        raise SessionError(f"{source} was written by a newer LayerScope (session format {version}, this one reads {FORMAT})",
                           "Update LayerScope and import it again")
    require(isinstance(doc.get("session"), dict), source, "session.json has no 'session' object")
    return doc, arrays, files


def _inflate(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A member's bytes, read a block at a time and never past the size its entry declares (which the caller has
    checked): a member whose data inflates further is refused as corrupted, not held in memory."""
    out = bytearray()
    with z.open(info) as f:
        while block := f.read(1 << 20):
            out += block
            if len(out) > info.file_size:
                raise ValueError(f"{info.filename[:200]} inflates past its declared {info.file_size} bytes")
    return bytes(out)


def _parse(raw: bytes, source: str) -> dict:
    try:
        return jsonsafe.loads(raw, what=JSON_MEMBER, error=SessionError, max_bytes=MAX_JSON_BYTES, allow_nan=False)
    except SessionError as e:
        refuse(source, e.problem)


def _listed_sizes(doc) -> dict[tuple[str, str], int]:
    """{(draft entry, file name): bytes} as session.json lists them (what is malformed there is drafts_in's to say)."""
    out = {}
    for d in (doc.get("drafts") if isinstance(doc, dict) and isinstance(doc.get("drafts"), list) else []):
        files = d.get("files") if isinstance(d, dict) else None
        for name, f in (files.items() if isinstance(files, dict) else ()):
            if isinstance(f, dict) and is_int(f.get("bytes")):
                out[(str(d.get("entry")), name)] = f["bytes"]
    return out


def drafts_in(doc: dict, files: dict[str, dict[str, bytes]], source: str) -> list[dict]:
    """The drafts session.json lists [{"entry", "path", "files": {name: bytes}}], each checked against the
    archive's files (from `read` with_drafts): names, sizes, sha256, JSON."""
    listed = doc.get("drafts", [])
    found = problem(listed, ("list", DRAFT_ENTRY_SCHEMA, LIST_MAX), "drafts")
    require(found is None, source, found or "")
    entries = [d["entry"] for d in listed]
    require(len(set(entries)) == len(entries), source, "session.json lists a draft folder twice")
    require(set(entries) == set(files), source, "the draft folders in the archive and in session.json differ")
    out = []
    for d in listed:
        entry, got = d["entry"], files[d["entry"]]
        where = f"draft {entry[:40]!r}"
        require(set(d["files"]) == set(got), source, f"{where}: its files and those listed in session.json differ")
        require(all(f in got for f in DRAFT_REQUIRED), source, f"{where} lacks {' or '.join(DRAFT_REQUIRED)}")
        for name, blob in got.items():
            want = d["files"][name]
            require(len(blob) == want["bytes"] and SHA256_RE.fullmatch(want["sha256"]) is not None
                    and hashlib.sha256(blob).hexdigest() == want["sha256"], source,
                    f"{where}: {name} does not match its size and checksum (damaged in transfer?)")
            if name.endswith(".json"):
                try:
                    value = jsonsafe.loads(blob, what=f"{where}: {name}", error=SessionError,
                                           max_bytes=MAX_DRAFT_JSON_BYTES)
                except SessionError as e:
                    refuse(source, e.problem)
                require(isinstance(value, dict), source, f"{where}: {name} is not a JSON object")
        out.append({"entry": entry, "path": d["path"], "files": got})
    return out
