"""The disk under the store: can a file be written there, and is there room for what a step will write.

    writable(store)                      the store takes a new file (a real probe: root and a read-only mount)
    directory_writable(directory)        the same for any directory (or its nearest existing ancestor)
    output_writable(folder, what)        the same where a folder the user names (--out) is made, said as it
    free_bytes(directory)                bytes free to this user on the disk holding `directory`
    need_space(directory, nbytes, what)  the disk holding `directory` has room for an estimated output
                                         (MARGIN over the estimate, plus RESERVE for the index and small files)
Every failure is a StoreWriteError (one line naming the problem and the fix); nothing has been written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from layerscope import fmt
from layerscope.store import READ_ONLY, Store, StoreWriteError, write_error

MARGIN = 1.05                  # free space must exceed the estimate by 5% ...
RESERVE = 8 * 2**20            # ... and by 8 MiB (the index, locks, small JSON files)


def writable(store: Store) -> None:
    """StoreWriteError (read-only, full, not permitted) unless a file can be created in the store root.
    A real probe: os.access says yes to root on a read-only directory, and to anyone before a mount check."""
    directory_writable(store.root)


def free_bytes(directory: Path) -> int:
    """Bytes available to this user on the disk holding `directory` (its nearest existing ancestor)."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def need_space(directory: Path, nbytes: int | None, what: str) -> None:
    """StoreWriteError when the disk holding `directory` has less free space than `what` needs (about nbytes)."""
    if not nbytes:
        return
    free = free_bytes(directory)
    if free < nbytes * MARGIN + RESERVE:
        raise StoreWriteError(f"Not enough free space for {what}: it needs about {mib(nbytes)}, and LayerScope keeps "
                              f"{MARGIN - 1:.0%} more plus {RESERVE >> 20} MiB for the index ({mib(int(nbytes * MARGIN + RESERVE))} "
                              f"in all); the disk holding {directory} has {mib(free)} free",
                              "Free disk space or pass --store on a larger disk (nothing was written)")


def mib(n: int) -> str:
    """A size in an error message: fmt.size, never below MiB (a step's estimate reads 0.5 MiB, not 512.0 KiB)."""
    return fmt.size(n) if n >= 2**20 else f"{n / 2**20:.1f} MiB"


def directory_writable(directory: Path) -> None:
    """A file can be created in `directory`, or in its nearest existing ancestor (which then gets the folders)."""
    try:
        _probe(directory)
    except OSError as e:
        raise write_error(e, Path(directory) / ".preflight") from None


def output_writable(folder: Path, what: str) -> None:
    """directory_writable where the folder the user names (`what`: --out) is made beside its siblings (its parent,
    or the nearest existing ancestor); read-only or not permitted is said of that folder, never of the store."""
    try:
        _probe(Path(folder).parent)
    except OSError as e:
        if e.errno in READ_ONLY:
            raise StoreWriteError(f"The output folder {folder} ({what}) is not writable ({e.strerror})",
                                  f"Pass {what} a folder you can write to (nothing was written)") from None
        raise write_error(e, Path(folder) / ".preflight") from None


def _probe(directory: Path) -> None:
    """Create and remove a file in `directory` or its nearest existing ancestor; the OSError when that fails."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    fd, probe = tempfile.mkstemp(dir=d, prefix=".preflight-", suffix=".tmp")
    os.close(fd)
    os.unlink(probe)
