"""`layerscope export-states --out` given hostile folders, through the real CLI on a real capture of the tiny model:
odd links (a loop, a dangling link, a link to a file), names and paths too long to create, a folder inside the
store, and a read-only place. Each is one `error:` line (exit 2, no traceback) before anything is written: the
capture stays byte for byte, nothing half-written is left beside --out, and the store lists no new capture."""

from __future__ import annotations

import os

import pytest

from layerscope.capture.stored import list_captures
from layerscope.commands import cli
from layerscope.store import Store
from tests.reliability.test_reliability import cli_line, read_only, tree


def export(capsys, store: Store, key: str, out) -> tuple[int, str]:
    return cli_line(capsys, "export-states", key[:8], "--layers", "1,2", "--out", out, "--store", store.root)


def leftovers(directory) -> list[str]:
    """Hidden temporary folders an export cut short would leave beside its --out."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".partial")) if directory.is_dir() else []


def refused(capsys, store: Store, key: str, out, said: str) -> str:
    """Export to `out`: exit 2 with one line holding `said`; the store's captures unchanged and nothing written."""
    before = tree(store.root / "captures")
    code, line = export(capsys, store, key, out)
    assert code == 2 and said in line, line
    assert tree(store.root / "captures") == before
    assert [r["key"] for r in list_captures(store, incomplete=True)] == [key]
    return line


def test_a_symlink_loop_is_one_line(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    refused(capsys, store, key, tmp_path / "a", "goes through a symbolic link loop")
    refused(capsys, store, key, tmp_path / "a" / "out", "goes through a symbolic link loop")
    assert leftovers(tmp_path) == [] and os.readlink(tmp_path / "a") == str(tmp_path / "b")


def test_a_dangling_link_is_one_line_and_stays_a_link(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    refused(capsys, store, key, tmp_path / "dangling", "is a symbolic link to")
    assert (tmp_path / "dangling").is_symlink() and not (tmp_path / "nowhere").exists()
    assert leftovers(tmp_path) == []


def test_a_link_to_a_file_is_one_line_and_the_file_is_kept(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    (tmp_path / "notes.txt").write_text("keep me")
    os.symlink(tmp_path / "notes.txt", tmp_path / "to-file")
    refused(capsys, store, key, tmp_path / "to-file", "is a file; a directory would replace it")
    assert (tmp_path / "notes.txt").read_text() == "keep me" and (tmp_path / "to-file").is_symlink()
    assert leftovers(tmp_path) == []


def test_a_name_longer_than_the_file_system_allows_is_one_line(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    refused(capsys, store, key, tmp_path / ("n" * 300), "has a name of 300 bytes")
    refused(capsys, store, key, tmp_path / ("n" * 300) / "out", "has a name of 300 bytes")    # a folder above it
    refused(capsys, store, key, tmp_path / ("n" * 250), "the file system allows 246 (its temporary name beside it")
    assert leftovers(tmp_path) == []


def test_a_path_longer_than_path_max_is_one_line(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    deep = tmp_path.joinpath(*["deep-folder"] * 400)
    line = refused(capsys, store, key, deep, "the system allows paths under 4096")
    assert len(line) < 400                                            # the path is shortened in the line
    assert not (tmp_path / "deep-folder").exists()


@pytest.mark.parametrize("where", ["captures/new-export", "new-export", "linked"])
def test_a_folder_inside_the_store_is_refused(where, store_with_capture, tmp_path, capsys):
    """The store would evict the export, or list it under captures/ as a capture: refused, links followed."""
    store, key = store_with_capture
    out = store.root / where
    if where == "linked":
        os.symlink(store.root / "captures", tmp_path / "into-store")
        out = tmp_path / "into-store" / "export"
    refused(capsys, store, key, out, "lies inside the store")
    assert not out.exists() and leftovers(out.parent) == []


def test_a_read_only_place_is_the_output_folder_not_the_store(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    (tmp_path / "src").mkdir()
    with read_only(tmp_path / "src", tmp_path / "ro") as ro:
        line = refused(capsys, store, key, ro / "out", f"The output folder {ro / 'out'} (--out) is not writable")
        assert "store" not in line.lower()
    assert list((tmp_path / "src").iterdir()) == []


def test_a_link_to_an_empty_folder_is_written_through(store_with_capture, tmp_path, capsys):
    """What a link names is where the export goes: the link stays, the folder it points to holds the export."""
    store, key = store_with_capture
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert cli.main(["export-states", key[:8], "--layers", "1,2", "--out", str(tmp_path / "link"),
                     "--store", str(store.root)]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "token_freq.pt").is_file()
    assert leftovers(tmp_path) == []
