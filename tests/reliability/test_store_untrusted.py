"""The store's index (diskcache's cache.db) is untrusted input: a shared or copied store may hold any rows, Settings,
triggers and files (issue 51, item 8). No command deletes, reads or follows a path that an index row names outside
the index's own value files; a pipe or an oversized file is never read; what diskcache would run or apply from the
index (triggers, views, Settings) is removed first; an index that is damaged or not diskcache's is started anew
and the entries stay. Each test plants the input in a real store under tmp_path; nothing else is touched."""

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest

import layerscope.store as store_mod
from layerscope.capture.stored import list_captures
from layerscope.commands import cli
from layerscope.store import MAX_INDEX_VALUE_BYTES, BoundedJSONDisk, Store, StoreWarning, _MemoryIndex

PLANTED = zlib.compress(json.dumps({"planted": 1}).encode(), 1)     # a value as diskcache's JSON disk writes it
VALUE_FILE = "ab/cd/" + "e" * 28 + ".val"                            # a name of the shape diskcache makes
USED = "used/captures/" + "c" * 24


def db_key(name: str):
    return BoundedJSONDisk("/nonexistent").put(name)[0]


def plant(root: Path, name: str, **columns) -> None:
    """Set columns of the index row of key `name`, with sqlite directly, as a crafted store would."""
    db = sqlite3.connect(Path(root) / "index" / "cache.db")
    sets = ", ".join(f"{c} = ?" for c in columns)
    assert db.execute(f"UPDATE Cache SET {sets} WHERE key = ?", (*columns.values(), db_key(name))).rowcount == 1
    db.commit()
    db.close()


def sql(root: Path, script: str) -> None:
    db = sqlite3.connect(Path(root) / "index" / "cache.db")
    db.executescript(script)
    db.commit()
    db.close()


def new_store(tmp_path: Path) -> Store:
    """A store with an analysis and a use recorded (rows a command replaces, reads and pops), closed."""
    store = Store(tmp_path / "s")
    store.put_json("analysis", "abc", {"x": 1})
    store.touch("captures", "c" * 24)
    store.close()
    return store


def use(store: Store) -> None:
    """What `analyze` and `select` do with the index: read a value, replace it, record a use, pop one."""
    assert store.get_json("analysis", "abc") in (None, {"x": 1})     # never a planted value
    store.put_json("analysis", "abc", {"x": 2})
    store.touch("captures", "c" * 24)
    store.remove("captures", "c" * 24)
    assert store.get_json("analysis", "abc") == {"x": 2}


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail, rather than hang, when a blocking open or read outlives `seconds` (a pipe with no writer)."""
    def expire(*_):
        raise TimeoutError(f"still blocked after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def child(*argv, timeout=180) -> subprocess.CompletedProcess:
    """A real process (a hang in sqlite cannot be interrupted in this one): killed after `timeout`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=env)


# ---------------------------------------------------------------------------- (a) rows naming files elsewhere

@pytest.mark.parametrize("mode", [2, 3, 4])          # diskcache's MODE_BINARY, MODE_TEXT, MODE_PICKLE with a file
@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_a_row_naming_a_file_outside_the_index_is_never_read_nor_removed(tmp_path, mode, where):
    outside = tmp_path / "outside.val"
    outside.write_bytes(PLANTED)
    store = new_store(tmp_path)
    name = str(outside) if where == "absolute" else "../../outside.val"
    for key in ("analysis/abc", USED):
        plant(store.root, key, mode=mode, filename=name, value=None)
    fresh = Store(store.root)
    with pytest.warns(StoreWarning, match="not a value file of the index|diskcache mode"):
        use(fresh)            # replacing and popping a row is where diskcache removes the row's file
    fresh.close()
    assert outside.read_bytes() == PLANTED
    plant(store.root, "analysis/abc", mode=2, filename=name, value=None)
    index = _MemoryIndex(store.root / "index")         # the read-only reader: the same rule
    with pytest.raises(store_mod.StoreError, match="not a value file"):
        index.get("analysis/abc")
    index.close()


@pytest.mark.parametrize("link", ["file", "directory"])
def test_a_value_file_reached_through_a_link_is_never_followed(tmp_path, link):
    elsewhere = tmp_path / "elsewhere"
    target = elsewhere / "cd" / ("e" * 28 + ".val")
    target.parent.mkdir(parents=True)
    target.write_bytes(PLANTED)
    store = new_store(tmp_path)
    index = store.root / "index"
    if link == "directory":
        (index / "ab").symlink_to(elsewhere)
    else:
        (index / VALUE_FILE).parent.mkdir(parents=True)
        (index / VALUE_FILE).symlink_to(target)
    for key in ("analysis/abc", USED):
        plant(store.root, key, mode=2, filename=VALUE_FILE, value=None)
    fresh = Store(store.root)
    with pytest.warns(StoreWarning, match="link"):
        use(fresh)
    fresh.close()
    assert target.read_bytes() == PLANTED


def test_cli_analyze_and_select_never_remove_a_file_an_index_row_names(tmp_path, tiny_capture, capsys):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the store's")
    store = Store(tmp_path / "s")
    key = tiny_capture.key
    shutil.copytree(tiny_capture.path, store.path("captures", key))
    store.touch("captures", key)
    store.close()
    plant(store.root, f"used/captures/{key}", mode=2, filename=str(outside), value=None)
    assert cli.main(["analyze", key[:8], "--store", str(store.root), "--max-tokens", "32"]) == 0
    plant(store.root, f"used/captures/{key}", mode=4, filename="../../outside.txt", value=None)
    assert cli.main(["select", key[:8], "--store", str(store.root), "--k", "2", "--max-tokens", "32"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert outside.read_text() == "not the store's"


# ---------------------------------------------------------------------------- (b) special and oversized files

@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_row_naming_a_pipe_never_blocks(tmp_path, where):
    store = new_store(tmp_path)
    if where == "outside":
        pipe = tmp_path / "pipe"
        name = str(pipe)
    else:
        pipe = store.root / "index" / VALUE_FILE
        pipe.parent.mkdir(parents=True)
        name = VALUE_FILE
    os.mkfifo(pipe)
    plant(store.root, "analysis/abc", mode=2, filename=name, value=None)
    fresh = Store(store.root)
    with deadline(20), pytest.warns(StoreWarning, match="not a value file|not a regular file"):
        use(fresh)
    fresh.close()
    assert where == "inside" or stat.S_ISFIFO(os.lstat(pipe).st_mode)


def test_an_oversized_value_file_is_refused_before_it_is_read(tmp_path):
    store = new_store(tmp_path)
    big = store.root / "index" / VALUE_FILE
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:                       # sparse: no disk used
        f.truncate(MAX_INDEX_VALUE_BYTES + 2**20)
    plant(store.root, "analysis/abc", mode=2, filename=VALUE_FILE, value=None)
    fresh = Store(store.root)
    tracemalloc.start()
    try:
        with pytest.warns(StoreWarning, match="larger than"):
            assert fresh.get_json("analysis", "abc") is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    fresh.close()
    assert peak < 32 * 2**20


# ---------------------------------------------------------------------------- (c) crafted Settings and schema

CRAFTED_SETTINGS = [("eviction_policy", "bogus"), ("size_limit", -1), ("sqlite_mmap_size", 2**62),
                    ("sqlite_cache_size", -2**40), ("disk_compress_level", 99), ("cull_limit", "x" * 100),
                    ("_directory", "/nonexistent/elsewhere"), ("sqlite_query_only", 1), ("count", b"\0" * 100)]

HANG = "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)"
CRAFTED_SCHEMA = {
    "triggers": f"CREATE TRIGGER hang BEFORE UPDATE ON Cache BEGIN {HANG}; END; "
                f"CREATE TRIGGER hang_too BEFORE INSERT ON Cache BEGIN {HANG}; END; "
                "CREATE TRIGGER wipe AFTER INSERT ON Cache BEGIN DELETE FROM Cache; END; "
                "CREATE INDEX big ON Cache (length(zeroblob(100000)));",
    "view": f"ALTER TABLE Cache RENAME TO Old; CREATE VIEW Cache AS SELECT Old.* FROM Old, ({HANG});",
}

STORE_SCRIPT = ("import sys, warnings; warnings.simplefilter('ignore'); from layerscope.store import Store; "
                "s = Store(sys.argv[1]); print(s.get_json('analysis', 'abc')); s.put_json('analysis', 'abc', {'x': 2}); "
                "s.touch('captures', 'c' * 24); s.remove('captures', 'c' * 24); print(s.get_json('analysis', 'abc'))")


def test_crafted_settings_are_never_applied(tmp_path):
    store = new_store(tmp_path)
    db = sqlite3.connect(store.root / "index" / "cache.db")
    db.executemany("INSERT OR REPLACE INTO Settings VALUES (?, ?)", CRAFTED_SETTINGS)
    db.commit()
    db.close()
    r = child("-c", STORE_SCRIPT, store.root)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.split() == ["{'x':", "1}", "{'x':", "2}"]            # read and written in place, not in memory
    db = sqlite3.connect(store.root / "index" / "cache.db")
    settings = dict(db.execute("SELECT key, value FROM Settings"))
    db.close()
    assert settings["eviction_policy"] == "none" and settings["size_limit"] == 2**40
    assert settings["sqlite_mmap_size"] == store_mod.INDEX_SETTINGS["sqlite_mmap_size"]
    assert not {"disk_compress_level", "_directory", "sqlite_query_only"} & set(settings)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("crafted", sorted(CRAFTED_SCHEMA))
def test_crafted_triggers_and_views_never_run(tmp_path, crafted):
    store = new_store(tmp_path)
    sql(store.root, CRAFTED_SCHEMA[crafted])
    r = child("-c", STORE_SCRIPT, store.root, timeout=120)     # a trigger that ran would never return
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.split()[-2:] == ["{'x':", "2}"]
    db = sqlite3.connect(store.root / "index" / "cache.db")
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type IN ('trigger', 'view', 'index')")}
    db.close()
    assert not {"hang", "hang_too", "wipe", "big"} & names
    if crafted == "view":              # not diskcache's table: a new index, the old one kept aside
        assert len(list(store.root.glob(".index.damaged-*"))) == 1


# ---------------------------------------------------------------------------- (d) damaged or foreign index files

def _garbage(db: Path, tmp_path: Path) -> None:
    db.write_bytes(b"this is not a sqlite database" * 100)


def _torn_page(db: Path, tmp_path: Path) -> None:
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page + 8: 2 * page] = os.urandom(page - 8)     # the second page (the Settings table) overwritten
    db.write_bytes(bytes(data))


def _foreign_layout(db: Path, tmp_path: Path) -> None:
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE Cache RENAME COLUMN filename TO path")
    con.commit()
    con.close()


def _link_to_a_database_elsewhere(db: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.db"
    con = sqlite3.connect(elsewhere)
    con.execute("CREATE TABLE mine (x)")
    con.commit()
    con.close()
    db.unlink()
    db.symlink_to(elsewhere)


@pytest.mark.parametrize("damage", [_garbage, _torn_page, _foreign_layout, _link_to_a_database_elsewhere],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_or_foreign_index_is_started_anew_and_the_entries_stay(tmp_path, tiny_capture, damage):
    store = Store(tmp_path / "s")
    key = tiny_capture.key
    shutil.copytree(tiny_capture.path, store.path("captures", key))
    store.put_json("analysis", "abc", {"x": 1})
    store.close()
    db = store.root / "index" / "cache.db"
    for side in ("cache.db-wal", "cache.db-shm"):
        (db.parent / side).unlink(missing_ok=True)
    damage(db, tmp_path)
    outside = tmp_path / "elsewhere.db"
    before = outside.read_bytes() if outside.exists() else None
    fresh = Store(store.root)
    with pytest.warns(StoreWarning, match="started a new one"):
        assert [r["key"] for r in list_captures(fresh)] == [key]
        assert fresh.get_json("analysis", "abc") is None           # the cache is gone, never wrong
    fresh.put_json("analysis", "abc", {"x": 2})
    assert fresh.get_json("analysis", "abc") == {"x": 2}
    fresh.close()
    assert len(list(store.root.glob(".index.damaged-*"))) == 1 and not db.is_symlink()
    if before is not None:
        assert outside.read_bytes() == before                      # never opened through the link


def test_an_index_database_that_is_a_pipe_never_blocks(tmp_path):
    store = new_store(tmp_path)
    db = store.root / "index" / "cache.db"
    for side in ("cache.db-wal", "cache.db-shm"):
        (db.parent / side).unlink(missing_ok=True)
    db.unlink()
    os.mkfifo(db)
    r = child("-c", STORE_SCRIPT, store.root, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.split() == ["None", "{'x':", "2}"]
    assert len(list(store.root.glob(".index.damaged-*"))) == 1


# ---------------------------------------------------------------------------- an index that cannot be used at all

def test_an_index_that_cannot_be_opened_is_one_line_and_exit_2(tmp_path, tiny_capture, capsys, monkeypatch):
    store = Store(tmp_path / "s")
    key = tiny_capture.key
    shutil.copytree(tiny_capture.path, store.path("captures", key))
    store.close()

    def fails(directory):        # an error no rule foresaw, raised by diskcache while opening the index
        raise ValueError("disk must subclass diskcache.Disk")
    monkeypatch.setattr(store_mod, "new_cache", fails)
    for argv in (["analyze", key[:8]], ["select", key[:8], "--k", "2"], ["captures"]):
        code = cli.main([*argv, "--store", str(store.root)])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert "Traceback" not in err, err
        if argv[0] != "captures" or code:
            assert code == 2 and len(lines) == 1 and "store index" in lines[0] and "Move" in lines[0], err
