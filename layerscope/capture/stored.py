"""Captures in a store: finding, opening, finishing, listing and verifying them (the files: capture/format.py).

    captures/<key>/            a finished capture (key: 24 hex characters, store.make_key of what was captured)
    captures/<key>.partial/    the chunks of a capture in progress, renamed to captures/<key>/ when complete

    has_capture(store, key) -> bool                       finished (or a link the path rule refuses: opening says why)
    resolve_capture_key(store, key_or_prefix) -> str      hex only; an ambiguous prefix lists the matches
    open_capture(store, key_or_prefix) -> CaptureReader   checked cheaply: schema, sizes, chunk headers
    partial_capture_dir(store, key) / finish_capture(store, key, manifest)   the writer's side (capture/run.py)
    list_captures(store, incomplete=False) -> list[dict]  summaries, newest first, damaged ones with their fix
    verify_capture(store, key) -> list[str]               every problem, sha256 included; [] when sound

The store (layerscope/store.py) gives what every kind of entry has: the directory, the write lock, the path
rule (store.entry_problem), use times and eviction. What is listed is what opens, and the other way round.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from layerscope.capture.format import (
    SUMMARY_KEYS,
    CaptureReader,
    check_chunk_files,
    list_chunks,
    read_manifest,
    summarize_manifest,
    validate_manifest,
    verify_capture_files,
)
from layerscope.errors import StoreError
from layerscope.paths import LINK_FIX
from layerscope.store import KEY_RE, Store, atomic_write_json, write_error

KIND = "captures"
PREFIX_RE = re.compile(r"[0-9a-f]{1,24}")          # what a user may type for a capture key


def has_capture(store: Store, key: str) -> bool:
    """Whether captures/<key> is there as a finished capture, or as a link the path rule refuses (then
    opening it says why: what is listed is what opens, and the other way round)."""
    if not KEY_RE.fullmatch(str(key)):
        return False
    p = store.path(KIND, key)
    return p.is_symlink() and store.entry_problem(KIND, key) is not None or (p / "manifest.json").is_file()


def resolve_capture_key(store: Store, key: str) -> str:
    """The full key of a stored capture from its key or an unambiguous prefix (hex); StoreError otherwise."""
    key = str(key).strip().lower()
    if not PREFIX_RE.fullmatch(key):
        raise StoreError(f"{key!r} is not a capture key", "A capture key is hex characters (24 in full, or a "
                         "unique prefix); run `layerscope captures` to list them")
    if has_capture(store, key):
        return key
    matches = sorted(p.name for p in store.entry_names(KIND) if p.name.startswith(key) and has_capture(store, p.name))
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(matches[:10]) + (f" and {len(matches) - 10} more" if len(matches) > 10 else "")
        raise StoreError(f"The prefix {key!r} matches {len(matches)} captures: {shown}",
                         "Type more characters of the key")
    unfinished = [r for r in incomplete_captures(store) if r["key"].startswith(key)]
    if len(unfinished) == 1:          # named as `captures` lists it, with the same fix
        r = unfinished[0]
        raise StoreError(f"Capture {r['key']} is incomplete: {r['problem']}", r["fix"])
    raise StoreError(f"No capture with key {key!r} in {store.root}",
                     "Run `layerscope captures` to list the stored keys, or capture first")


def open_capture(store: Store, key: str) -> CaptureReader:
    """The finished capture `key` (or unique prefix), checked cheaply (schema, sizes, chunk headers)."""
    key = resolve_capture_key(store, key)
    store.check_entry(KIND, key)
    reader = CaptureReader(store.path(KIND, key))
    store.touch(KIND, key)
    return reader


def partial_capture_dir(store: Store, key: str) -> Path:
    """captures/<key>.partial: where the chunks of capture `key` are written until it is finished."""
    return store.root / KIND / f"{key}.partial"


def finish_capture(store: Store, key: str, manifest: dict) -> Path:
    """Write the manifest into the partial directory and rename it into place: the capture now exists.

    Call with `store.lock("captures", key)` held. A capture that already exists is never replaced: the
    partial directory is dropped and the existing capture stands.
    """
    partial = partial_capture_dir(store, key)
    final = store.path(KIND, key)
    if (final / "manifest.json").is_file():
        shutil.rmtree(partial, ignore_errors=True)
        return final
    validate_manifest(manifest, key)
    atomic_write_json(partial / "manifest.json", manifest)
    if final.exists():          # a directory without a manifest: leftovers, not a capture
        shutil.rmtree(final)
    try:
        os.replace(partial, final)
    except OSError as e:
        raise write_error(e, final) from None
    store.touch(KIND, key)
    store.evict()
    return final


def list_captures(store: Store, *, incomplete: bool = False) -> list[dict]:
    """Summaries of finished captures, newest first, each with `state` "ok" or "damaged" (then `problem`
    and `fix` say what and what to do). With `incomplete`, also captures not finished yet (their chunks
    in captures/<key>.partial/, state "incomplete"): never opened, listed so that nothing is hidden."""
    out = []
    for p in store.entry_names(KIND):
        if not has_capture(store, p.name):
            continue
        link = store.entry_problem(KIND, p.name)
        try:
            if link is not None:
                raise StoreError(f"Capture {p.name} cannot be used: {link}", LINK_FIX.format(where=store.path(KIND, p.name)))
            manifest = read_manifest(p)
            check_chunk_files(p, manifest)
            summary = summarize_manifest(manifest) | {"state": "ok", "problem": None, "fix": None}
        except StoreError as e:
            summary = {k: None for k in SUMMARY_KEYS} | {"key": p.name, "conversations": None, "tokens": None,
                                                        "created": "", "state": "damaged",
                                                        "problem": e.problem, "fix": e.fix}
        summary["size_bytes"] = store.entry_size(KIND, p.name) if link is None else 0
        out.append(summary)
    if incomplete:
        out += incomplete_captures(store)
    return sorted(out, key=lambda s: s.get("created") or "", reverse=True)


def incomplete_captures(store: Store) -> list[dict]:
    """Captures begun and not finished: captures/<key>.partial/ with the chunks written so far."""
    base = store.root / KIND
    rows = []
    for p in sorted(base.glob("*.partial")) if base.is_dir() else []:
        key = p.name[: -len(".partial")]
        if not (KEY_RE.fullmatch(key) and p.is_dir() and not p.is_symlink()) or has_capture(store, key):
            continue
        chunks = list_chunks(p)
        busy = store.locked(KIND, key)
        rows.append({k: None for k in SUMMARY_KEYS} | {
            "key": key, "conversations": max((e for _, e, _ in chunks), default=0), "tokens": None,
            "created": "", "state": "incomplete", "size_bytes": sum(c.stat().st_size for _, _, c in chunks),
            "problem": ("being written by another process now" if busy else
                        f"not finished ({len(chunks)} chunk{'s' if len(chunks) != 1 else ''} written)"),
            "fix": ("Wait for it to finish" if busy else "Run the same capture command again to resume from "
                    f"its chunks, or delete {p} to drop them")})
    return rows


def verify_capture(store: Store, key: str) -> list[str]:
    """Every problem of capture `key` (full check: schema, sizes, headers and sha256 of every chunk)."""
    key = resolve_capture_key(store, key)
    problem = store.entry_problem(KIND, key)
    if problem is not None:
        return [problem]
    return verify_capture_files(store.path(KIND, key))
