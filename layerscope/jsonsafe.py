"""Bounded JSON: the one way user data in JSON enters LayerScope (sessions, archives, stored index entries,
manifests, draft files, prompt files).

    loads(data, what="session.json", error=SessionError, max_bytes=16 * 2**20)   # dict, list, ... or error(...)
    depth(text)                                                                   # nesting depth, without parsing

Python's json module recurses once per nesting level and raises RecursionError (not ValueError) past
about a thousand levels, and every recursive walker after it (schema checks, NaN scrubbing) would too.
So the text is measured first: its size against `max_bytes`, its nesting (brackets outside strings)
against `max_depth`, and only then parsed. Every failure is `error(problem, fix)`: one line naming `what`.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

from layerscope.errors import LayerScopeError

MAX_DEPTH = 64                     # LayerScope's own files nest at most ~8 levels
STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)   # a complete JSON string (escapes included)
BRACKET = re.compile(r"[\[\]{}]")


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text` (0 for a scalar), brackets inside strings ignored.
    Linear time; for malformed text an upper bound of what a parser would reach before failing."""
    opens = [1 if b in "[{" else -1 for b in BRACKET.findall(STRING.sub("", text))]
    return max(accumulate(opens), default=0)


def loads(data: str | bytes, *, what: str, error: type[LayerScopeError] = LayerScopeError,
          max_bytes: int | None = None, max_depth: int = MAX_DEPTH, fix: str = "", allow_nan: bool = True):
    """`data` parsed as JSON when it is UTF-8, at most `max_bytes` long and `max_depth` deep; otherwise
    `error(problem, fix)` naming `what`. allow_nan=False also refuses NaN and infinities (not JSON)."""
    size = len(data)
    if max_bytes is not None and size > max_bytes:
        raise error(f"{what} is larger than {_size(max_bytes)} ({_size(size)})",
                    fix or "Use a smaller file; LayerScope never writes one this large")
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise error(f"{what} is not UTF-8 text", fix or "Re-save it with UTF-8 encoding") from None
    levels = depth(data)
    if levels > max_depth:
        raise error(f"{what} is nested {levels} levels deep, more than the {max_depth} LayerScope reads",
                    fix or "It was not written by LayerScope; use a file LayerScope wrote")
    try:
        return json.loads(data) if allow_nan else json.loads(data, parse_constant=_no_constant)
    except _Constant as e:
        raise error(f"{what} holds {e.args[0]}, which is not JSON", fix or "Write null for a missing number") from None
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                    fix or "The file is damaged; write it again") from None
    except RecursionError:     # cannot happen below max_depth; kept so no caller ever sees one
        raise error(f"{what} is nested too deeply to read", fix or "Use a file LayerScope wrote") from None


class _Constant(ValueError):
    pass


def _no_constant(name: str):
    raise _Constant(name)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
