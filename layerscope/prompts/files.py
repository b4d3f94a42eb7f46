"""User prompt files: .jsonl, .txt, .csv and .json, read as a list of prompts with warnings.

    .jsonl   one JSON record per line (layerscope/prompts/record.py: "prompt", "turns" or ShareGPT
             "conversations", optional "category"); id "file/<line>"
    .txt     one prompt per line, or paragraphs separated by blank lines; id "file/<first line>"
    .csv     a header row with a "prompt" column (optional "category"), one prompt per row; id "file/<line>"
    .json    a ShareGPT-style array of records, cut-off tail tolerated; id "file/<record number>"

A line or record that cannot be used is left out with a warning ("line 7: not valid JSON: ..."); a file
with no usable prompt, or an empty one, is a PromptSetError saying how to fix it.

Limits. A user file must be a regular file (not a pipe, device or socket) of at most MAX_FILE_BYTES;
it is read line by line (a .json array record by record), never whole. A line or record over
MAX_LINE_BYTES, and a prompt over MAX_PROMPT_CHARS characters, is left out with a warning.
"""

from __future__ import annotations

import csv
import os
import stat
from pathlib import Path

from layerscope import jsonsafe
from layerscope.errors import PromptSetError
from layerscope.prompts.record import Prompt, record_category, user_turns
from layerscope.prompts.sharegpt import JSON_ARRAY_HELP, JsonArrayScan

FILE_TYPES = (".jsonl", ".txt", ".csv", ".json")
MAX_FILE_BYTES = 2**30        # a user prompt file
MAX_LINE_BYTES = 2**20        # one line of a .jsonl/.txt/.csv file, one record of a .json array
MAX_PROMPT_CHARS = 2**20      # one prompt (a .txt paragraph may span lines)

FORMAT_HELP = {
    ".jsonl": 'each line must be a JSON object with a "prompt" string, a "turns" list of strings, '
              'or ShareGPT "conversations" (optional "category")',
    ".txt": "write one prompt per line, or paragraphs separated by blank lines",
    ".csv": 'give a header row with a "prompt" column (optional "category") and one prompt per row',
    ".json": JSON_ARRAY_HELP,
}


def user_path(spec: str) -> Path:
    """The path of the prompt file `spec`, checked: it exists, has a known type and is a regular file under
    MAX_FILE_BYTES (opened once, nothing read); PromptSetError saying what to fix otherwise."""
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


def file_lines(path: Path):
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


def user_file(path: Path, turns: int) -> tuple[list[Prompt], list[str]]:
    """Prompts of a user file in file order, ids "file/<line>" ("file/<record>" for .json), and warnings."""
    kind = path.suffix.lower()
    if kind == ".json":
        prompts, warnings, empty = _read_json_array(path, turns)
    else:
        empty = all(line is not None and not line.strip() for _, line in file_lines(path))   # stops at the first text
        prompts, warnings = [], []
        if not empty:
            reader = {".jsonl": lambda t: read_jsonl(t, turns), ".txt": _read_txt, ".csv": _read_csv}[kind]
            prompts, warnings = reader(file_lines(path))
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


def read_jsonl(lines, turns: int) -> tuple[list[Prompt], list[str]]:
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
        user, problem = user_turns(record, turns)
        if user is None:
            warnings.append(f"line {n}: {problem}")
            continue
        prompts.append(Prompt(f"file/{n}", record_category(record), user))
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
        user, problem = user_turns(record, turns)
        if user is None:
            warnings.append(f"line {line}: record {scan.count}: {problem}")
            continue
        prompts.append(Prompt(f"file/{scan.count}", record_category(record), user))
    if scan.tail_bytes:
        warnings.append(f"line {scan.tail_line}: skipped the last {scan.tail_bytes} bytes, not a complete "
                        f"record ({scan.tail_error})")
    return prompts, warnings, not scan.started
