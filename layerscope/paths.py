"""One path policy for store entries and for the paths a user gives (draft directories, --out).

    real(path, what)                 the path with every link followed; a symlink loop is a PathError
    entry_problem(base, entry)       a store entry: None when it may be used, else why not (one line)
    existing_dir(path, what)         a directory the user named that must exist (a draft): its real path
    output_dir(path, what)           a directory about to be written and replaced whole (--out): its real path
    length_problem(path, room)       why a path cannot be created for its length (a name over NAME_MAX bytes, the
                                     whole over PATH_MAX), or None

Links are followed deliberately and the real path is what gets checked:
- Inside the store, an entry (`<root>/<kind>/<name>`) is a directory whose real path lies inside its kind's
  directory: a real directory, or a link to another place in that directory. A link that leaves it, a
  dangling link and a link loop are problems, reported the same way by every listing, `verify` and every
  open, so what can be read is exactly what is listed. The store root and its kind directories may
  themselves be links (a store moved to a bigger disk): they are followed.
- A path the user gives may be a link anywhere; a loop, or a link to nothing, is refused in one line
  before any work starts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from layerscope.errors import LayerScopeError


class PathError(LayerScopeError):
    """A path that is a symbolic link loop, missing, or of the wrong kind."""


def real(path, what: str = "The path", error: type[LayerScopeError] = PathError) -> Path:
    """`path` with ~ expanded and every symbolic link followed (it need not exist); a loop is `error`."""
    p = Path(path).expanduser()
    try:
        return p.resolve()
    except RuntimeError:       # Python 3.11: "Symlink loop from ..."
        raise error(f"{what} {path} goes through a symbolic link loop",
                    "Point it at the real directory (`ls -l` shows where each link leads)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{what} {path} goes through a symbolic link loop",
                        "Point it at the real directory (`ls -l` shows where each link leads)") from None
        raise error(f"{what} {path} cannot be resolved ({e.strerror})", "Check the path") from None


def _within(p: Path, base: Path) -> bool:
    return p == base or base in p.parents


def entry_problem(base: Path, entry: Path) -> str | None:
    """Why the store entry `entry` (a name in the kind directory `base`) may not be used, or None."""
    if not entry.is_symlink():
        return None if entry.is_dir() else f"{entry.name} is not a directory"
    try:
        target = entry.resolve(strict=True)
        inside = real(base)
    except (RuntimeError, PathError):
        return f"{entry.name} is a symbolic link loop"
    except OSError:
        return f"{entry.name} is a symbolic link to {os.readlink(entry)}, which does not exist"
    if not _within(target, inside) or target == inside:
        return f"{entry.name} is a symbolic link to {target}, outside the store's {base.name}/ directory"
    if not target.is_dir():
        return f"{entry.name} is a symbolic link to {target}, which is not a directory"
    return None


LINK_FIX = ("Move the directory itself into the store (`mv TARGET {where}` after removing the link), "
            "or remove the link")


def existing_dir(path, what: str, error: type[LayerScopeError] = PathError, fix: str = "Check the path") -> Path:
    """The real path of a directory the user named, which must exist: a loop, a dangling link, a file or a
    missing path is `error`, one line."""
    p = Path(path).expanduser()
    target = real(p, what, error)
    if p.is_symlink() and not target.exists():
        raise error(f"{what} {path} is a symbolic link to {target}, which does not exist", fix)
    if not target.exists():
        raise error(f"{what} {path} does not exist", fix)
    if not target.is_dir():
        raise error(f"{what} {path} is a file, not a directory", fix)
    return target


NAME_MAX, PATH_MAX = 255, 4096        # Linux's limits, where the file system does not say its own


def _limits(path: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system holding `path`'s nearest existing ancestor."""
    for d in (path, *path.parents):
        try:
            if d.is_dir():
                return os.pathconf(d, "PC_NAME_MAX"), os.pathconf(d, "PC_PATH_MAX")
        except (OSError, ValueError):
            continue
    return NAME_MAX, PATH_MAX


def _shown(text: str, most: int = 60) -> str:
    return text if len(text) <= most else f"{text[:most // 2]}…{text[-most // 2:]}"


def length_problem(path: Path, room: int = 0) -> str | None:
    """Why the absolute `path` cannot be created for its length, or None: a name longer than the file system's
    NAME_MAX bytes, or the whole longer than PATH_MAX. `room`: bytes a temporary name made beside it adds."""
    name_max, path_max = _limits(path)
    names = path.parts[1:]
    for i, name in enumerate(names):
        n, extra = len(os.fsencode(name)), room if i == len(names) - 1 else 0
        if n + extra > name_max:
            allowed = f"{name_max - extra} (its temporary name beside it takes {extra} more)" if extra else f"{name_max}"
            return f"has a name of {n} bytes ({_shown(name)}); the file system allows {allowed}"
    n = len(os.fsencode(str(path))) + room
    if n >= path_max:
        return f"is {n} bytes long; the system allows paths under {path_max}"
    return None


def output_dir(path, what: str, error: type[LayerScopeError] = PathError, room: int = 0) -> Path:
    """The real path of a directory about to be written (replaced whole, or created with its parents):
    refused when it goes through a link loop, is a link to nothing, is a file, when the nearest existing
    ancestor is not a directory, or when a name or the whole is too long to create (`room`: bytes a temporary
    name beside it adds to its last name)."""
    p = Path(path).expanduser()
    target = real(p, what, error)
    too_long = length_problem(target, room)
    if too_long is not None:        # checked first: a stat of such a path fails (ENAMETOOLONG)
        raise error(f"{what} {_shown(str(path), 120)} {too_long}", "Give a shorter path")
    if p.is_symlink() and not target.exists():
        raise error(f"{what} {path} is a symbolic link to {target}, which does not exist",
                    "Give the real directory, or remove the dangling link")
    if target.exists() and not target.is_dir():
        raise error(f"{what} {path} is a file; a directory would replace it", "Give a directory path")
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise error(f"{what} {path} lies under {ancestor}, which is a file", "Give a path under a directory")
    return target
