"""The artifact store: one directory per entry (captures, drafts, models, sessions ...), cached JSON results.

Layout under the root (the `root` argument, else $LAYERSCOPE_STORE, else ./cache under the working directory):
    index/                    a diskcache.Cache holding JSON only (never pickle: a store can be shared)
    captures/<key>/           a finished capture (captures in a store: layerscope/capture/stored.py;
                              their files: layerscope/capture/format.py)
    locks/<kind>/<key>.lock   one lock file per entry being written (fcntl.flock; never listed)
    models/<fingerprint>/     de-quantized model weights
    drafts/<key>/, sessions/<id>/ ...   other kinds, one directory per entry

Guarantees (docs/internals.md, "Store guarantees"): every file is written to a temporary name and
renamed into place, so a run killed at any moment leaves a complete entry or none; one writer per
entry at a time (`Store.lock`), the others wait and then find the finished entry; a directory is put
in place whole (`staged`, `replace_dir`); only names that are entry keys are listed, and an entry is used only where layerscope/paths.py allows
(a link leaving the store is a problem every listing, `verify` and every open reports alike). The index
is a cache of what is on disk: when it is damaged (and only then: a full or read-only disk is not
damage) a new one is started; when it cannot be written it is read as it is and new results
live in memory. Its values are bounded JSON (layerscope/jsonsafe.py). The index is untrusted input (a store
may be shared or copied): it is checked before diskcache opens it (vet_index: triggers, views and Settings it
would run or apply are removed, its settings come from INDEX_SETTINGS; an index that fails sqlite's check or is not
diskcache's layout is started anew), and a row's file is read or removed only when it is one of the index's own
value files (BoundedJSONDisk), so no row makes a command read, follow or delete a path elsewhere. A write that meets a full or
read-only disk is one `StoreWriteError` line (`as_write_error` is the one rule, also applied by the CLI
and the app's worker to OSErrors that escape elsewhere); what was finished stays on disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import shutil
import sqlite3
import stat
import struct
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import diskcache
import torch
from diskcache.core import DEFAULT_SETTINGS, EVICTION_POLICY, METADATA, MODE_BINARY, MODE_RAW, UNKNOWN
from safetensors import SafetensorError
from safetensors.torch import save_file

from layerscope import jsonsafe
from layerscope.errors import StoreError
from layerscope.paths import LINK_FIX, entry_problem

ENTRY_KINDS = ("captures", "drafts", "models", "sessions", "uploads")   # directory kinds the size limit evicts
RUN_CACHE = "features"      # runs/<key>/features: online training's kept target features (draft/training/
                            # feature_cache.py); a stopped run's count in the size limit and are evicted like entries
DEFAULT_SIZE_LIMIT = 50 * 2**30
KEY_RE = re.compile(r"[0-9a-f]{24}")               # a key make_key makes, in full (a capture's, a session's capture)
ENTRY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")   # any entry directory name (no dots: temp names have them)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
MAX_INDEX_VALUE_BYTES = 256 * 2**20          # one decompressed index value (an analysis with its token table)
INDEX_DAMAGE = ("not a database", "malformed", "no such table", "no such column", "corrupt")


class StoreWarning(UserWarning):
    """Something in the store was repaired or could not be written; the command goes on."""


def default_root() -> Path:
    """The store when none is named: $LAYERSCOPE_STORE, else ./cache under the working directory."""
    env = os.environ.get("LAYERSCOPE_STORE")
    if env:
        return Path(env).expanduser()
    return Path.cwd() / "cache"


def make_key(obj) -> str:
    """24 hex chars of sha256 over canonical JSON: the content address of whatever `obj` describes."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def file_sha256(path: Path) -> str:
    """sha256 hex of the file at `path`, read in blocks (a capture chunk's, a GGUF file's)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------------------- writes

class StoreWriteError(StoreError):
    """A write met a full or read-only disk (or a file-size or quota limit). Never a sign of damage."""


RESUME = "run the same command again: what was finished is kept (capture chunks, the last training checkpoint) and it resumes"


def write_error(e: OSError, path: Path | None, where: Path | None = None) -> StoreError:
    """An OSError met while writing `path` (None: not known; then `where`, the store, names the disk), as one
    clear line: full disk, read-only store, or other."""
    reason = e.strerror or os.strerror(e.errno or 0)
    disk = f"the disk holding {Path(path).parent if path is not None else where}" if (path or where) else "the disk"
    writing = f" (while writing {Path(path).name}: {reason})" if path is not None else f" ({reason})"
    if e.errno in NO_SPACE:
        return StoreWriteError(f"No space left on {disk}{writing}",
                               f"Free disk space or pass --store on a larger disk, then {RESUME}")
    if e.errno in READ_ONLY:
        store = f"The store at {Path(path).parent if path is not None else where}" if (path or where) else "The store"
        return StoreWriteError(f"{store} is read-only ({reason})",
                               "Pass --store (or set LAYERSCOPE_STORE) to a writable directory; reading and listing "
                               "still work here")
    return StoreWriteError(f"Cannot write {path if path is not None else 'a file'}: {reason}",
                           "Check the disk and the store directory")


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind `e`: itself, or the one a SafetensorError reports as 'os error N'."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, SafetensorError):
        code = re.search(r"os error (\d+)", str(e))
        if code:
            return OSError(int(code[1]), os.strerror(int(code[1])))
    return None


def as_write_error(e: BaseException, path=None, where=None) -> StoreWriteError | None:
    """The one rule for a write that failed: an OSError (or SafetensorError) with errno ENOSPC, EDQUOT, EFBIG,
    EROFS, EACCES or EPERM is a StoreWriteError (one line, never 'damaged'); anything else is None."""
    if isinstance(e, StoreWriteError):
        return e
    err = os_error_of(e)
    if err is None or err.errno not in NO_SPACE + READ_ONLY:
        return None
    name = path or err.filename or err.filename2
    return write_error(err, Path(os.fsdecode(name)) if name else None, where)


def _write_via_temp(path: Path, write) -> None:
    """Create `path` through a temporary sibling (never listed: it starts with a dot) and one rename."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)   # mkstemp makes it private; a store may be shared
        write(fd, tmp)
        os.replace(tmp, path)
    except OSError as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise write_error(e, path) from None
    except BaseException:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(fd, tmp):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _write_via_temp(path, write)


SAFETENSORS_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32",
                     torch.int64: "I64", torch.bool: "BOOL"}


def atomic_stream_tensors(path: Path, entries) -> None:
    """Write a safetensors file one tensor at a time, atomically: `entries` is [(name, dtype, shape, make)], and
    make() returns that tensor when its turn comes, so only one tensor is in memory at once (a chunk larger than
    memory can be written). Tensors are laid out in the order given; a tensor whose dtype or shape differs from
    its entry raises ValueError and nothing is left at `path`."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def write(fd, tmp):
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, dtype, shape, make in entries:
                t = make()
                if t.dtype != dtype or list(t.shape) != list(shape):
                    raise ValueError(f"tensor {name} is {t.dtype} {list(t.shape)}, not {dtype} {list(shape)}")
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            f.flush()
            os.fsync(f.fileno())
    _write_via_temp(path, write)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, default=str).encode())


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    def write(fd, tmp):
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        except SafetensorError as e:      # an I/O error inside safetensors: keep its errno (full disk ...)
            err = os_error_of(e)
            if err is None:
                raise
            raise err from None
        os.chmod(tmp, 0o644)              # safetensors writes a file of its own, private like mkstemp's
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    _write_via_temp(path, write)


# ---------------------------------------------------------------------------- whole directories

STAGING = ".layerscope-staging"      # where `staged` builds a directory: beside its destination, never listed


class staged:
    """`with staged(path) as tmp:` fill the new directory `tmp`; on a clean exit it replaces `path` whole
    (replace_dir), on an error it is removed and `path` is untouched. tmp lives in `<parent>/.layerscope-staging/`
    (same file system, a name no listing shows); what a killed writer left there is removed by the next one."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.area = self.path.parent / STAGING

    def __enter__(self) -> Path:
        for attempt in range(3):     # another writer may remove the empty staging folder between the two calls
            self.area.mkdir(parents=True, exist_ok=True)
            try:
                self.tmp = Path(tempfile.mkdtemp(dir=self.area, prefix=f"{self.path.name}.{os.getpid()}."))
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        _remove_stale(self.area, self.path.name)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                replace_dir(self.tmp, self.path)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)   # what is left of a failed write
            with contextlib.suppress(OSError):
                self.area.rmdir()                          # only when empty: other writers may be staging
        return False


def replace_dir(new: Path, path: Path) -> None:
    """Put the complete directory `new` at `path`, replacing what is there, then remove the old directory.
    `new` must be on the same file system under a name no listing shows (`staged` makes one). A reader of
    `path` finds the old directory or the new one, whole, never a mix. What a process killed at each point
    leaves:
      `path` absent        one rename: before it nothing is at `path`, after it the new directory.
      Linux (renameat2)    one atomic exchange: before it `path` is the old directory, after it the new one,
                           and the old one lies at `new` until it is removed (or the next `staged` write
                           removes it).
      elsewhere            `path` is renamed to `<new>.old`, then `new` to `path`, then the old one removed:
                           between the two renames `path` is missing while both complete directories exist
                           (the old at `<new>.old`, the new at `new`), never a half-written one."""
    new, path = Path(new), Path(path)
    if not path.exists():
        os.replace(new, path)
        return
    if _exchange(new, path):
        old = new
    else:
        old = new.with_name(new.name + ".old")
        os.replace(path, old)
        os.replace(new, path)
    if old.is_symlink():         # `path` was a link: the link goes, never what it points to
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the system cannot."""
    fn = getattr(_LIBC, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_stale(area: Path, name: str) -> None:
    """Staging folders for `name` left by processes that no longer run."""
    for entry in area.glob(f"{name}.*"):
        try:
            pid = int(entry.name[len(name) + 1:].split(".", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_entry_name(kind: str, key: str) -> str:
    """`key` as one safe directory name (no separators, no dots, no leading dash), else StoreError."""
    if not isinstance(key, str) or not ENTRY_NAME_RE.fullmatch(key):
        raise StoreError(f"{key!r} is not a valid {kind[:-1] if kind.endswith('s') else kind} name",
                         "Use letters, digits, '-' and '_' only (a capture key is 24 hex characters)")
    return key


# ---------------------------------------------------------------------------- the index

INDEX_FILE_RE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")   # the only file names Disk.filename makes
INDEX_FIX = "It is ignored (never read nor removed) and recomputed"


class BoundedJSONDisk(diskcache.JSONDisk):
    """diskcache's JSON disk whose values are read as bounded JSON: a value planted in the index that is
    too large once decompressed, or nested too deep, or stored in another mode than the two JSONDisk writes
    (compressed bytes in the row or in a file; never pickle, which would run code), is a StoreError (the
    caller treats it as a miss).

    The index is untrusted input (a store may be shared or copied): a row's `filename` is used only when it is
    a name diskcache itself makes (INDEX_FILE_RE: relative, inside the index directory, no `..`), reached
    through real directories (no link on the way), and the file is a regular file (not a link, a pipe or a
    device) of bounded size. Any other row reads as a damaged value and its file is never removed."""

    def value_path(self, filename) -> str:
        """The full path of the value file a row names, or StoreError."""
        if not isinstance(filename, str) or not INDEX_FILE_RE.fullmatch(filename):
            shown = filename if not isinstance(filename, str) else filename[:120]
            raise StoreError(f"An index row names the file {shown!r}, not a value file of the index", INDEX_FIX)
        parent = self._directory
        for part in filename.split("/")[:2]:
            parent = os.path.join(parent, part)
            try:
                mode = os.lstat(parent).st_mode
            except FileNotFoundError:
                break                       # the file is not there: a miss
            if not stat.S_ISDIR(mode):
                raise StoreError(f"An index value file {filename} lies behind a link or a file, not a directory",
                                 INDEX_FIX)
        return os.path.join(self._directory, filename)

    def filename(self, key=UNKNOWN, value=UNKNOWN):
        filename, full_path = super().filename(key, value)
        self.value_path(filename)           # a link planted on the way: the value is not written through it
        return filename, full_path

    def remove(self, file_path):
        try:
            self.value_path(file_path)
        except StoreError:
            return                          # a path the index names outside its own files is never removed
        super().remove(file_path)

    def _open_value(self, filename):
        path = self.value_path(filename)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(f"An index value file {filename} is a link", INDEX_FIX) from None
            raise                           # missing: diskcache reads it as a miss
        f = os.fdopen(fd, "rb")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StoreError(f"An index value file {filename} is not a regular file (a pipe or a device)",
                                 INDEX_FIX)
            if info.st_size > MAX_INDEX_VALUE_BYTES:
                raise StoreError(f"An index value file is larger than {MAX_INDEX_VALUE_BYTES >> 20} MiB", INDEX_FIX)
        except BaseException:
            f.close()
            raise
        return f

    def fetch(self, mode, filename, value, read):
        if mode not in (MODE_RAW, MODE_BINARY):
            raise StoreError(f"An index value is stored in diskcache mode {mode!r}, not as JSON bytes", "It is recomputed")
        if mode == MODE_BINARY:
            f = self._open_value(filename)
            if read:
                return f
            with f:
                data = f.read(MAX_INDEX_VALUE_BYTES + 1)
            if len(data) > MAX_INDEX_VALUE_BYTES:
                raise StoreError(f"An index value file is larger than {MAX_INDEX_VALUE_BYTES >> 20} MiB", INDEX_FIX)
        else:
            data = diskcache.Disk.fetch(self, mode, filename, value, read)
        if read:
            return data
        if not isinstance(data, bytes):
            raise StoreError("An index value is not compressed JSON", "It is recomputed")
        try:
            unzip = zlib.decompressobj()
            text = unzip.decompress(data, MAX_INDEX_VALUE_BYTES + 1)
        except zlib.error as e:
            raise StoreError(f"An index value is not compressed JSON ({e})", "It is recomputed") from None
        if len(text) > MAX_INDEX_VALUE_BYTES or unzip.unconsumed_tail:
            raise StoreError(f"An index value is larger than {MAX_INDEX_VALUE_BYTES >> 20} MiB", "It is recomputed")
        return jsonsafe.loads(text, what="An index value", error=StoreError, fix="It is recomputed")


# Every setting the index is opened with comes from here, never from its Settings table (which diskcache would
# otherwise apply: pragmas, Disk arguments, attributes of the Cache).
INDEX_SETTINGS = {**DEFAULT_SETTINGS, "eviction_policy": "none", "size_limit": 2**40}
MAX_INDEX_ROW_BYTES = 16 * 2**20       # one string or blob sqlite reads from the index (inline values are < 32 kB)
INDEX_CHECK_SECONDS = 30.0             # checking an index that takes longer: it is not used as it is


class StoreIndexError(StoreError):
    """The store's index cannot be used at all (an error no rule of the store foresaw): one line, exit 2."""


class UntrustedIndex(sqlite3.DatabaseError):
    """The index is not one diskcache made (its layout, its files) or fails sqlite's integrity check: a new one
    is started (index_damaged)."""


def bound_connection(con: sqlite3.Connection, seconds: float | None = None) -> None:
    """Bound what one sqlite connection to the index may do: no string or blob over MAX_INDEX_ROW_BYTES is read
    (memory), and with `seconds` every statement after this is interrupted once that time has passed."""
    setlimit = getattr(con, "setlimit", None)          # Python 3.11+
    if setlimit is not None:
        setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_INDEX_ROW_BYTES)
    with contextlib.suppress(sqlite3.Error):
        con.execute("PRAGMA trusted_schema = OFF")
    if seconds is not None:
        deadline = time.monotonic() + seconds
        con.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)


class IndexCache(diskcache.Cache):
    """diskcache's Cache whose every sqlite connection is bound (bound_connection)."""

    @property
    def _con(self):
        con = diskcache.Cache._con.fget(self)
        if getattr(self._local, "bounded", None) is not con:
            bound_connection(con)
            self._local.bounded = con
        return con


@functools.lru_cache(maxsize=1)
def _index_schema() -> frozenset:
    """The schema objects (type, name, table, sql) diskcache 5 makes: those of a new index opened with
    INDEX_SETTINGS, and the indexes its other eviction policies and its tag index add."""
    with tempfile.TemporaryDirectory(prefix="layerscope-index-") as tmp:
        cache = diskcache.Cache(tmp, disk=diskcache.JSONDisk, **INDEX_SETTINGS)
        try:
            for policy in EVICTION_POLICY.values():
                if policy["init"]:
                    cache._sql(policy["init"])
            cache.create_tag_index()
            return frozenset(cache._sql("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall())
        finally:
            cache.close()


def _index_files_problem(directory: Path) -> str | None:
    """Why the index directory or its database files may not be opened (a link, a pipe, a device ...), or None."""
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        return f"{directory.name} is {'a link' if stat.S_ISLNK(mode) else 'not a directory'}"
    for name in ("cache.db", "cache.db-wal", "cache.db-shm", "cache.db-journal"):
        try:
            mode = os.lstat(directory / name).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            return f"its {name} is {'a link' if stat.S_ISLNK(mode) else 'not a regular file'}"
    return None


def _table_problem(schema, table: str) -> str | None:
    """Why `table` in `schema` (rows of sqlite_master) is not diskcache's table of that name, or None (also
    when it is absent: diskcache makes it)."""
    rows = [r for r in schema if str(r[1]).lower() == table.lower()]
    if rows and not all(tuple(r) in _index_schema() for r in rows):
        return f"its {table} table is not diskcache's (a {rows[0][0]} of another layout)"
    return None


def vet_index(directory: Path) -> list[str]:
    """Check the index in `directory` before diskcache opens it, as untrusted input: its files must be regular
    files, sqlite's quick_check must pass and its Cache and Settings tables must be diskcache's own, else
    UntrustedIndex (a new index is started). What diskcache would run or apply from it is removed in place:
    triggers, views and indexes it does not make, and Settings rows it does not write (INDEX_SETTINGS then
    replaces the rest). Returns what was removed (for a warning). Bounded in time (INDEX_CHECK_SECONDS)."""
    directory = Path(directory)
    problem = _index_files_problem(directory)
    if problem:
        raise UntrustedIndex(problem)
    if not (directory / "cache.db").exists():
        return []
    con = sqlite3.connect(str(directory / "cache.db"), timeout=60, isolation_level=None, check_same_thread=False)
    try:
        bound_connection(con, INDEX_CHECK_SECONDS)
        try:
            check = con.execute("PRAGMA quick_check").fetchall()
            schema = con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
        except sqlite3.OperationalError as e:
            if "interrupted" in str(e):
                raise UntrustedIndex(f"it could not be checked within {INDEX_CHECK_SECONDS:.0f} s") from None
            raise
        if check != [("ok",)]:
            raise UntrustedIndex(f"it fails sqlite's integrity check ({str(check[0][0])[:200] if check else 'no answer'})")
        for table in ("Cache", "Settings"):
            problem = _table_problem(schema, table)
            if problem:
                raise UntrustedIndex(problem)
        drop = [(kind, name) for kind, name, table, sql in schema
                if kind in ("trigger", "view", "index") and sql is not None
                and (kind, name, table, sql) not in _index_schema()]
        keys = sorted(set(INDEX_SETTINGS) | set(METADATA))
        settings_rule = (f"NOT (key IN ({', '.join('?' * len(keys))}) AND typeof(value) IN ('integer', 'real', 'text')"
                         " AND length(value) <= 64)")
        has_settings = any(str(r[1]).lower() == "settings" and r[0] == "table" for r in schema)
        bad_settings = con.execute(f"SELECT count(*) FROM Settings WHERE {settings_rule}", keys).fetchone()[0] \
            if has_settings else 0
        if not drop and not bad_settings:
            return []
        con.execute("BEGIN IMMEDIATE")
        try:
            for kind, name in drop:
                con.execute(f'DROP {kind.upper()} IF EXISTS "{name.replace(chr(34), chr(34) * 2)}"')
            if bad_settings:
                con.execute(f"DELETE FROM Settings WHERE {settings_rule}", keys)
            con.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                con.execute("ROLLBACK")
            raise
        removed = [f"{kind} {name[:60]!r}" for kind, name in drop]
        if bad_settings:
            removed.append(f"{bad_settings} Settings row(s) diskcache does not write")
        return removed
    finally:
        con.close()


def new_cache(directory: Path) -> IndexCache:
    """diskcache's Cache in `directory` with INDEX_SETTINGS (JSON only, never pickle). Open an existing index
    with open_cache, which checks it first."""
    return IndexCache(str(directory), disk=BoundedJSONDisk, **INDEX_SETTINGS)


def open_cache(directory: Path, warn=None) -> IndexCache:
    """The diskcache index in `directory`, checked first as untrusted input (vet_index: UntrustedIndex when it
    may not be used as it is; `warn` gets what was removed from it), its table touched once (opening is lazy
    about some damage)."""
    removed = vet_index(directory)
    if removed and warn is not None:
        warn(f"The store index in {Path(directory).parent} held what diskcache does not make "
             f"({', '.join(removed)}); removed (cached results are kept)")
    cache = new_cache(directory)
    cache.get("used/check")
    return cache


def index_damaged(e: BaseException) -> bool:
    """Whether an index error means its database is damaged (start a new one), rather than that the disk is full,
    read-only, locked or failing (read it as it is; never move it aside)."""
    return isinstance(e, UntrustedIndex) or \
        isinstance(e, sqlite3.DatabaseError) and any(w in str(e).lower() for w in INDEX_DAMAGE)


# diskcache has no read-only mode (opening a Cache writes its Settings table), so an index that cannot be written
# is read with sqlite directly, as diskcache 5's Cache.get reads it: the row of the Cache table whose key and raw
# columns are Disk.put(key) and that has not expired, decoded by Disk.fetch(mode, filename, value) (Disk's put and
# fetch are diskcache's documented serialization interface; the table is its private layout). So the dependency is
# pinned below 6 (pyproject.toml, requirements.txt), and a Cache table without these columns is not read at all:
# every value is then a miss (recomputed, never a wrong value), with a warning.
CACHE_COLUMNS = ("key", "raw", "expire_time", "mode", "filename", "value")


class _MemoryIndex(dict):
    """Stand-in for the diskcache index when the store cannot hold one (read-only): same calls, no disk.

    With `readonly_dir` it also reads the values an existing index holds (sqlite opened read-only, see
    CACHE_COLUMNS); what is set lives in memory and shadows them. `problem` says why an existing index
    is not read (None when it is read, or when there is none or it is not a database)."""

    def __init__(self, readonly_dir: Path | None = None):
        super().__init__()
        self._db = self._disk = self.problem = None
        self._deadline = 0.0
        db = Path(readonly_dir) / "cache.db" if readonly_dir else None
        problem = _index_files_problem(Path(readonly_dir)) if readonly_dir else None
        if problem:                 # a link or a pipe in place of the index: never opened
            self.problem = problem
            return
        if db is not None and db.is_file():
            try:   # immutable: a WAL database opens without writing its -shm file
                self._db = sqlite3.connect(f"{db.resolve().as_uri()}?immutable=1", uri=True, check_same_thread=False)
                bound_connection(self._db)
                self._db.set_progress_handler(lambda: time.monotonic() > self._deadline, 10_000)
                self._deadline = time.monotonic() + INDEX_CHECK_SECONDS
                schema = self._db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
                self._db.execute("SELECT 1 FROM Cache LIMIT 1").fetchall()
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(Cache)")}
                self._disk = BoundedJSONDisk(str(readonly_dir))
            except (sqlite3.Error, OSError):
                self.close()
                return
            missing = [c for c in CACHE_COLUMNS if c not in columns]
            if missing:
                self.problem = f"its Cache table has no {', '.join(missing)} column (not diskcache 5's layout)"
                self.close()
            else:
                self.problem = _table_problem(schema, "Cache")     # a view or another table: never queried
                if self.problem:
                    self.close()

    def get(self, key, default=None):
        if key in self:
            return self[key]
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error, OSError, ValueError):
                db_key, raw = self._disk.put(key)
                self._deadline = time.monotonic() + INDEX_CHECK_SECONDS
                row = self._db.execute("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = ? "
                                       "AND (expire_time IS NULL OR expire_time > ?)",
                                       (db_key, raw, time.time())).fetchone()
                if row is not None:
                    return self._disk.fetch(row[0], row[1], row[2], False)
        return default

    def set(self, key, value):
        self[key] = value

    def close(self):
        if self._db is not None:
            self._db.close()
            self._db = None


# ---------------------------------------------------------------------------- the store

class LockWaitCancelled(StoreError):
    """should_stop() asked to give up waiting for another writer."""


class Store:
    """One store directory. Cheap to construct; safe to share between processes."""

    def __init__(self, root: str | os.PathLike | None = None, size_limit: int | None = None):
        self.root = Path(root).expanduser() if root else default_root()
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"The store path {self.root} is a file, not a directory",
                             "Pass --store (or set LAYERSCOPE_STORE) to a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"Cannot create the store directory {self.root} ({e.strerror or e})",
                             "Pass --store (or set LAYERSCOPE_STORE) to a directory you can write") from None
        self.size_limit = size_limit or int(os.environ.get("LAYERSCOPE_STORE_LIMIT", DEFAULT_SIZE_LIMIT))
        self._index = None
        self.warnings: list[str] = []   # repairs and skipped writes, for the UI; also sent to warnings.warn

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            warnings.warn(message, StoreWarning, stacklevel=3)

    @property
    def writable(self) -> bool:
        return os.access(self.root, os.W_OK)

    @property
    def index(self):
        """The diskcache index; a new one when damaged, in memory when the store is read-only."""
        if self._index is None:
            self._index = self._open_index()
        return self._index

    def _open_index(self):
        try:
            try:
                return open_cache(self.root / "index", self.warn)
            except (sqlite3.DatabaseError, OSError) as e:
                if index_damaged(e):
                    return self._repair_index(e)
                return self._unwritable_index(e)
        except StoreError:
            raise
        except Exception as e:    # anything else an index can make diskcache or sqlite raise: one line, never a traceback
            raise StoreIndexError(f"The store index in {self.root / 'index'} cannot be used ({type(e).__name__}: "
                             f"{str(e)[:200]})",
                             f"Move {self.root / 'index'} aside (it holds only cached results; the entries stay) "
                             "and run again") from None

    def _unwritable_index(self, error: Exception):
        """The index read as it is (sqlite opened read-only), new results in memory: a full or read-only disk,
        or another error that is not damage. Nothing is moved or rebuilt."""
        why = getattr(error, "strerror", None) or str(error)
        if not self.writable or isinstance(error, OSError) and error.errno in READ_ONLY \
                or "readonly" in why or "read-only" in why:
            self.warn(f"The store at {self.root} is read-only: new results are kept in memory only")
        else:
            self.warn(f"The store index in {self.root} cannot be written ({why}); it is read as it is and new "
                      "results are kept in memory only (free disk space to cache them again)")
        index = _MemoryIndex(self.root / "index")
        if index.problem:
            self.warn(f"The store index in {self.root} is not read: {index.problem}; cached results are recomputed")
        return index

    def _repair_index(self, error: Exception):
        """Move a damaged index aside and start a new one (under the index lock): it holds only caches, and
        every entry is read from its directory."""
        if not self.writable:
            return self._unwritable_index(error)
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.lock("index", "repair"))
            except StoreWriteError as e:          # the lock file cannot be made: the disk is full or read-only
                return self._unwritable_index(e)
            try:   # another process may have repaired it while we waited
                return open_cache(self.root / "index", self.warn)
            except (sqlite3.DatabaseError, OSError) as e:
                if not index_damaged(e):
                    return self._unwritable_index(e)
            aside = self.root / f".index.damaged-{int(time.time())}-{os.getpid()}"
            try:
                os.replace(self.root / "index", aside)     # a link or a pipe in its place is moved, never followed
                cache = new_cache(self.root / "index")
            except (sqlite3.DatabaseError, OSError) as e:
                self.warn(f"The store index in {self.root} is damaged and could not be rebuilt ({e}); "
                          "cached results are kept in memory only")
                return _MemoryIndex()
            self.warn(f"The store index in {self.root} was damaged ({error}); started a new one (the entries on disk "
                      f"are intact; the damaged copy is in {aside.name}; cached analyses will be recomputed)")
            return cache

    def _index_call(self, method: str, *args, default=None):
        """One index operation. A damaged index is repaired once; a full or read-only one is skipped with a
        warning (never moved aside); a damaged value (too large, too deep) reads as missing."""
        for attempt in (0, 1):
            try:
                return getattr(self.index, method)(*args)
            except sqlite3.DatabaseError as e:
                if not index_damaged(e) or attempt:
                    self.warn(f"The store index in {self.root} cannot be written ({e}); results are not cached")
                    return default
                self.close()
                self._index = self._repair_index(e)
            except OSError as e:
                self.warn(f"The store index in {self.root} cannot be used ({e.strerror or e}); results are not cached")
                return default
            except diskcache.Timeout:
                self.warn(f"The store index in {self.root} stayed locked by another process; results are not cached")
                return default
            except StoreIndexError:
                raise
            except StoreError as e:
                self.warn(f"The store index in {self.root} holds a damaged value under {args[0] if args else '?'} "
                          f"({e.problem}); it is ignored and recomputed")
                return default
        return default

    def close(self) -> None:
        if self._index is not None:
            with contextlib.suppress(Exception):
                self._index.close()
            self._index = None

    # ------------------------------------------------------------------ small JSON results
    def get_json(self, namespace: str, key: str):
        value = self._index_call("get", f"{namespace}/{key}")
        if value is not None:
            self.touch(namespace, key)
        return value

    def put_json(self, namespace: str, key: str, value) -> None:
        self._index_call("set", f"{namespace}/{key}", json.loads(json.dumps(value, default=float)))

    # ------------------------------------------------------------------ locks
    @contextlib.contextmanager
    def lock(self, kind: str, key: str, *, should_stop=None, on_wait=None, poll_s: float = 0.2):
        """Hold the exclusive write lock of entry kind/key (fcntl.flock on locks/<kind>/<key>.lock).

        Blocks while another process holds it, calling on_wait() once; should_stop() true while waiting
        raises LockWaitCancelled. The lock goes with the process: a killed holder frees it at once.
        """
        check_entry_name(kind, key)
        path = self.root / "locks" / kind / f"{key}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise write_error(e, path) from None
        try:
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not waited and on_wait is not None:
                        on_wait()
                    waited = True
                    if should_stop is not None and should_stop():
                        raise LockWaitCancelled(f"Stopped waiting for another process writing {kind}/{key}",
                                                "Run it again later: the other process's result will be there")
                    time.sleep(poll_s)
            yield
        finally:
            os.close(fd)      # releases the lock

    # ------------------------------------------------------------------ directory entries
    def path(self, kind: str, key: str) -> Path:
        """The directory for entry `key` of `kind` (not created)."""
        return self.root / kind / key

    def entry_names(self, kind: str) -> list[Path]:
        """Every entry of a kind, usable or not: entry names only (temporary and partial names carry dots),
        directories and links."""
        base = self.root / kind
        if not base.is_dir():
            return []
        return [p for p in base.iterdir() if ENTRY_NAME_RE.fullmatch(p.name) and (p.is_symlink() or p.is_dir())]

    def entry_problem(self, kind: str, key: str) -> str | None:
        """Why entry kind/key may not be used (a link leaving the store, a loop, ...: layerscope/paths.py),
        or None. The one rule of every listing, verify and open."""
        return entry_problem(self.root / kind, self.path(kind, key))

    def _entry_dirs(self, kind: str) -> list[Path]:
        """The usable entry directories of a kind (entry_problem is None)."""
        return [p for p in self.entry_names(kind) if self.entry_problem(kind, p.name) is None]

    def touch(self, kind: str, key: str) -> None:
        """Record a use, for least-recently-used eviction (best effort: a read-only store skips it)."""
        self._index_call("set", f"used/{kind}/{key}", time.time())

    def entry_size(self, kind: str, key: str) -> int:
        p = self.path(kind, key)
        total = 0
        if p.is_dir():
            for f in p.rglob("*"):
                with contextlib.suppress(OSError):     # a file removed by another process meanwhile
                    if f.is_file():
                        total += f.stat().st_size
        return total

    def evict(self, limit_bytes: int | None = None) -> list[str]:
        """Delete least recently used entries until the store is under `limit_bytes`; returns what went."""
        limit = self.size_limit if limit_bytes is None else limit_bytes
        entries = []
        for kind in ENTRY_KINDS:
            for p in self._entry_dirs(kind):
                with contextlib.suppress(OSError):
                    used = self._index_call("get", f"used/{kind}/{p.name}") or p.stat().st_mtime
                    entries.append((used, kind, p.name, self.entry_size(kind, p.name)))
        for p in self._entry_dirs("runs"):      # a stopped run's features: a cache its resume computes again
            key = f"{p.name}/{RUN_CACHE}"
            cache = self.path("runs", key)
            if cache.is_dir() and not cache.is_symlink() and not self.locked("runs", p.name):   # a running one stays
                with contextlib.suppress(OSError):
                    entries.append((cache.stat().st_mtime, "runs", key, self.entry_size("runs", key)))
        total = sum(e[3] for e in entries)
        removed = []
        for used, kind, key, size in sorted(entries):
            if total <= limit:
                break
            self.remove(kind, key)
            total -= size
            removed.append(f"{kind}/{key}")
        return removed

    def remove(self, kind: str, key: str) -> None:
        """Delete entry kind/key (or a stopped run's features, key "<run key>/features": `evict`)."""
        p = self.path(kind, key)
        if p.is_dir() or p.is_symlink():
            trash = p.with_name(f".{p.name}.deleting-{os.getpid()}")
            try:
                os.replace(p, trash)      # the entry vanishes at once; the files go after
            except FileNotFoundError:     # another process removed it first
                pass
            except OSError as e:
                raise write_error(e, p) from None
            if trash.is_symlink():        # a link entry: the link goes, never what it points to
                trash.unlink(missing_ok=True)
            shutil.rmtree(trash, ignore_errors=True)
        self._index_call("pop", f"used/{kind}/{key}", None)

    def check_entry(self, kind: str, key: str) -> None:
        """Raise StoreError when entry kind/key may not be used (entry_problem), naming why and the fix."""
        problem = self.entry_problem(kind, key)
        if problem is not None:
            raise StoreError(f"{kind[:-1].capitalize()} {key} cannot be used: {problem}",
                             LINK_FIX.format(where=self.path(kind, key)))

    def locked(self, kind: str, key: str) -> bool:
        """Whether another process holds the write lock of kind/key now (a read-only probe)."""
        path = self.root / "locks" / kind / f"{key}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
