"""One rule for every numeric option: a number of the right kind, finite, inside its range.

    check_number("temperature", t, minimum=0, maximum=100, fix="Use 0 for greedy responses")
    parse_count("500k"), parse_duration("1h30m")   # numbers as people write them: 500_000 tokens, 5400 seconds
    parse_size("500M"), parse_size("1.5GiB")       # bytes: 500_000_000, 1_610_612_736 (k/M/G/T: 1000s, KiB..: 1024s)
    read_number("1e3", "Prompts", integer=True)   # a typed field, read strictly: "'1e3' is not a whole number: type 1000"
    OneLineParser(...)       # argparse: every `type=float` is finite_float; an error is one line, exit 2

Options dataclasses call `check_number` in their `validate()` (the one source of their limits); the CLI's
parser turns NaN and infinities away before any option reaches them, and prints its errors as one
"error: ..." line like every other user-facing failure.
"""

from __future__ import annotations

import argparse
import math
import operator
import re
import sys

from layerscope.errors import LayerScopeError


def check_number(name: str, value, *, minimum=None, maximum=None, integer: bool = False, optional: bool = False,
                 above: bool = False, below: bool = False, fix: str = "", error: type[LayerScopeError] = LayerScopeError):
    """`value` when it is a finite number (an integer if `integer`) in [minimum, maximum] (minimum excluded
    with `above`, maximum with `below`); None passes when `optional`. Raises `error(problem, fix)` otherwise."""
    if value is None and optional:
        return value
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if integer and not bad:
        try:
            operator.index(value)
        except TypeError:
            bad = True
    kind = "a whole number" if integer else "a finite number"
    bounds = _range(minimum, maximum, above, below)
    fix = fix or (f"Pass a {name} {bounds}" if bounds else f"Pass {kind} as {name}")
    if bad or not math.isfinite(value):
        raise error(f"{name} must be {kind} (got {value!r})", fix)
    low_bad = minimum is not None and (value <= minimum if above else value < minimum)
    high_bad = maximum is not None and (value >= maximum if below else value > maximum)
    if low_bad or high_bad:
        raise error(f"{name} must be {bounds} (got {value!r})", fix)
    return value


def _range(minimum, maximum, above: bool, below: bool) -> str:
    """The allowed range in words: 'in [1, 5]', 'in [0, 1)', 'at least 1', 'greater than 0', 'at most 9' ('': any)."""
    if minimum is not None and maximum is not None:
        return f"in {'(' if above else '['}{minimum}, {maximum}{')' if below else ']'}"
    if minimum is not None:
        return f"{'greater than' if above else 'at least'} {minimum}"
    if maximum is not None:
        return f"{'less than' if below else 'at most'} {maximum}"
    return ""


# ---------------------------------------------------------------------------- numbers people write

COUNT_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*")     # 2M, 500k, 120000
SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?\s*b?\s*", re.IGNORECASE)   # 500M, 2GB, 1.5GiB
DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([hms]?)")        # one part of 1h30m, 45m, 600s, 90


def parse_count(text: str) -> int:
    """A token count: '2M' -> 2_000_000, '500k' -> 500_000, '12000' -> 12000 (k, M, G; at least 1)."""
    m = COUNT_RE.fullmatch(str(text))
    if not m:
        raise LayerScopeError(f"{text!r} is not a token count", "Write it like 2M, 500k or 120000")
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if not 1 <= n < 1e15:
        raise LayerScopeError(f"{text!r} is not a positive token count", "Write it like 2M, 500k or 120000")
    return int(n)


def parse_size(text: str) -> int:
    """Bytes: '500M' / '500MB' -> 500_000_000, '2G' -> 2_000_000_000, '1.5GiB' -> 1_610_612_736, '4096' -> 4096
    (k, M, G, T in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024; a trailing B is optional; at least 1)."""
    fix = "Write it like 500M, 2G, 1.5GiB or 750000000 (bytes)"
    m = SIZE_RE.fullmatch(str(text))
    if not m:
        raise LayerScopeError(f"{text!r} is not a size", fix)
    unit = (m.group(2) or "").lower()
    base = 1024 if m.group(3) else 1000
    n = float(m.group(1)) * base ** ("kmgt".index(unit) + 1 if unit else 0)
    if not 1 <= n < 2**63:
        raise LayerScopeError(f"{text!r} is not a positive size", fix)
    return int(n)


def parse_duration(text: str) -> float:
    """Seconds: '45m' -> 2700, '1h30m' -> 5400, '90s' / '90' -> 90 (h, m, s; a bare number is seconds)."""
    parts = DURATION_PART_RE.findall(str(text).strip())
    if not parts or DURATION_PART_RE.sub("", str(text)).strip():
        raise LayerScopeError(f"{text!r} is not a duration", "Write it like 45m, 2h, 1h30m or 600s")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1, "": 1}[u] for n, u in parts)
    if not 0 < seconds < 1e8:
        raise LayerScopeError(f"{text!r} is not a positive duration", "Write it like 45m, 2h, 1h30m or 600s")
    return seconds


# ---------------------------------------------------------------------------- numbers typed into a field

WHOLE_RE = re.compile(r"[+-]?[0-9]+")
TYPED_MAX = 40          # characters of a refused entry quoted back
LONGEST_NUMBER = 64     # characters: longer is no number a field takes (int() of 4300+ digits raises)


def _between(minimum, maximum) -> str:
    """The allowed range as a field says it: 'from 1 to 4096', 'of at least 0', 'of at most 9' ('': any)."""
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" of at least {minimum}"
    return f" of at most {maximum}" if maximum is not None else ""


def read_number(text, name: str, *, integer: bool = True, minimum=None, maximum=None, error: type[LayerScopeError] = LayerScopeError):
    """The number typed into a field called `name`, read strictly, never turned into another number: a whole-number
    field takes digits only ('1e3' is refused, 'type 1000'; '1.5' is refused, 'type 1 or 2'), a decimal field any
    finite decimal or exponent form ('1e3' is 1000.0); then `check_number` for the range. Raises
    `error(problem, fix)`, one line saying what was wrong and what to type."""
    typed = str(text if text is not None else "").strip()
    shown = typed if len(typed) <= TYPED_MAX else typed[:TYPED_MAX] + "…"
    kind = "a whole number" if integer else "a number"
    fix = f"Type {kind}{_between(minimum, maximum)}"
    if not typed:
        raise error(f"{name} is empty", fix)
    if len(typed) > LONGEST_NUMBER:
        raise error(f"'{shown}' is too long for a number", fix)
    if integer and WHOLE_RE.fullmatch(typed):
        value = int(typed)
    else:
        try:
            value = float(typed)
        except ValueError:
            raise error(f"'{shown}' is not a number", fix) from None
        if not math.isfinite(value):
            raise error(f"'{shown}' is not a {'' if integer else 'finite '}number", fix)
        if integer:
            if value.is_integer():
                raise error(f"'{shown}' is not a whole number in digits", f"Type {int(value)}")
            low, high = math.floor(value), math.ceil(value)
            raise error(f"'{shown}' is not a whole number", f"Type {low} or {high}")
    return check_number(name, value, minimum=minimum, maximum=maximum, integer=integer, fix=fix, error=error)


# ---------------------------------------------------------------------------- the command line

def finite_float(text: str) -> float:
    """argparse type for every float option: a number, not NaN or an infinity."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose `type=float` options are finite and whose errors are one line (exit 2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)

    def error(self, message: str):
        sys.stderr.write(f"error: {message}. Run `{self.prog} --help` for the options\n")
        sys.exit(2)
