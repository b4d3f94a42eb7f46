"""How numbers, names and times read on screen: the one formatter of the app, its figures and its report.

Plain functions, strings out; nothing here imports Streamlit. Every kind of number has one form:

    count        48,450                      (thousands separated, never 4.845e+04)
    number       5.548 · 0.123 · 1,234       (3 decimals below 100, 1 below 1000, none above)
    tau          1.133                       (tokens per target forward: 3 decimals)
    delta        +0.007                      (a signed τ difference)
    speedup      1.42×
    percent      24.5%                       (acceptance, agreement: a share of 1 as a percentage)
    duration     72 s · 20 min · 2.5 h       (seconds as words; one decimal below 10 s: 0.4 s)
    size         512 B · 3.4 KiB · 1.2 GiB   (bytes, in powers of 1024, one decimal)
    interval     1.133 [1.091, 1.160]        (every interval: the value, then [lo, hi] in the same form;
                 1.42× [1.30, 1.55]           a × unit once, on the value)

A missing value reads "—"; a value that does not exist for the thing (mean CKA of one layer) reads "n/a".
The command line's plain-text tables (the benchmark's, the study's) are laid out by `table`.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from datetime import datetime

MISSING = "—"
NOT_APPLICABLE = "n/a"

# Raw field names as people read them (tables, figure titles, correlations).
NAMES = {
    "mean_entropy": "mean entropy", "mean_entropy_normalized": "mean normalized entropy", "mean_cka": "mean CKA",
    "aggregate_entropy": "aggregate entropy", "val_accuracy@1": "held-out agreement @1",
    "val_accuracy": "held-out agreement", "objective": "own objective", "mrmr": "mRMR",
    "compartment_cohesion": "compartment cohesion", "tau": "τ", "speedup": "speedup", "probe": "probe agreement",
    "entropy-topk": "entropy-topk", "tokens_per_s": "tokens/s",
    "simulated_acc_len": "simulated_acc_len (SpecForge's Σ∏ agreement: draft tokens, no bonus token, not τ)",
}


def missing(x) -> bool:
    return x is None or (isinstance(x, float) and not math.isfinite(x))


def count(n) -> str:
    """A whole number: 48,450."""
    return MISSING if missing(n) else f"{int(round(float(n))):,}"


def plural(n, noun: str) -> str:
    """A count with its noun, singular for one: "1 thread", "2 threads", "1,024 cores"."""
    return f"{count(n)} {noun}{'' if int(round(float(n))) == 1 else 's'}"


def number(x, digits: int = 3) -> str:
    """Any other number: `digits` decimals below 100, one below 1000, none above; never an exponent cut short."""
    if missing(x):
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return count(x)
    x = float(x)
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if 0 < a < 10 ** -digits:
        return f"{x:.2g}"
    return f"{x:.{digits}f}"


def size(n) -> str:
    """Bytes as people read them: 512 B, 3.4 KiB, 340.0 MiB, 1.2 GiB, 2.0 TiB (powers of 1024, one decimal)."""
    if missing(n):
        return MISSING
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def tau(x) -> str:
    return MISSING if missing(x) else f"{float(x):.3f}"


def delta(x) -> str:
    return MISSING if missing(x) else f"{float(x):+.3f}"


def speedup(x) -> str:
    return MISSING if missing(x) else f"{float(x):.2f}×"


def percent(x, digits: int = 1) -> str:
    """A share of 1 as a percentage: 0.245 -> 24.5%."""
    return MISSING if missing(x) else f"{100 * float(x):.{digits}f}%"


KINDS = {"tau": tau, "delta": delta, "speedup": speedup, "percent": percent, "number": number, "count": count}


def has_ci(ci) -> bool:
    return bool(ci) and len(ci) == 2 and not any(missing(c) for c in ci)


def ci(bounds, kind: str = "tau") -> str:
    """An interval alone, in the form of `kind` without its unit: "[1.091, 1.160]"; "[n/a]" without one."""
    if not has_ci(bounds):
        return f"[{NOT_APPLICABLE}]"
    f = KINDS[kind]
    return f"[{f(bounds[0]).rstrip('×')}, {f(bounds[1]).rstrip('×')}]"


def interval(x, bounds, kind: str = "tau") -> str:
    """A value with its interval, both in the form of `kind`: "1.133 [1.091, 1.160]"; the value alone without one.
    The one interval format of the app, the command line's tables and the study's verdict."""
    f = KINDS[kind]
    if missing(x):
        return MISSING
    return f"{f(x)} {ci(bounds, kind)}" if has_ci(bounds) else f(x)     # the unit once, on the value


def layers(ls) -> str:
    """A layer list, always in full: [1, 14, 28]."""
    return MISSING if ls is None else "[" + ", ".join(str(int(l)) for l in ls) + "]"


def name(raw) -> str:
    """A raw field name as people read it: mean_entropy -> mean entropy."""
    if raw is None:
        return MISSING
    raw = str(raw)
    return NAMES.get(raw, raw.replace("_", " "))


STRATEGIES = {"manual": "hand-picked"}     # a layer set's strategy as people read it (stored as "manual")


def strategy(raw) -> str:
    """A layer set's strategy as people read it, one word everywhere: "hand-picked" for "manual", others as they are."""
    return MISSING if raw is None else STRATEGIES.get(str(raw), str(raw))


def escape(text) -> str:
    """User text (a set, draft, session or capture name, a model spec, a prompt's category) as plain text wherever
    HTML is read: the HTML report and every Plotly text (legend names, titles, axis and tick labels, hover text,
    annotations), where plotly.js renders <a href>, <span style>, <b>, <br> and entities. The one escaping rule:
    &, < and > become entities that plotly.js and browsers both show as the characters, and so does the { of
    "%{" (plotly.js fills in %{...} in trace names and hover text); quotes are left alone (plotly.js does not read
    &quot;, and no user text is put inside an attribute). User text never goes into a hovertemplate string itself:
    it goes in as data (customdata, a trace name)."""
    return html.escape("" if text is None else str(text), quote=False).replace("%{", "%&#123;")


_OFFSET = re.compile(r"([+-]\d\d)(\d\d)$")


def when(iso) -> str:
    """An ISO timestamp in this server's local time, to the minute: 2026-12-01 10:09."""
    if not iso:
        return MISSING
    text = _OFFSET.sub(r"\1:\2", str(iso).strip().replace("Z", "+00:00"))   # +0000 -> +00:00 (Python < 3.11)
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return str(iso)
    if t.tzinfo is not None:
        t = t.astimezone()
    return t.strftime("%Y-%m-%d %H:%M")


def duration(seconds) -> str:
    """Seconds as words, as precise as a person reads them: 0.4 s · 72 s · 20 min · 2.5 h (elapsed times and estimates)."""
    if missing(seconds):
        return MISSING
    s = max(0.0, float(seconds))
    if round(s, 1) < 10:
        return f"{s:.1f} s"
    if s < 90:
        return f"{s:.0f} s"
    m = s / 60
    return f"{m:.0f} min" if m < 90 else f"{m / 60:.1f} h"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def file_part(text, limit: int = 40) -> str:
    """User text (a session name) made safe inside a download's file name: letters, digits, '.', '_', '-'."""
    safe = _UNSAFE.sub("_", str(text or "")).strip("._-")[:limit].strip("._-")
    return safe or "session"


def cell(x) -> str:
    """A table cell: numbers by `number`, layer lists in full, missing values as a dash."""
    if isinstance(x, (list, tuple)):
        return layers(x) if all(isinstance(v, int) and not isinstance(v, bool) for v in x) else ", ".join(map(str, x))
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)) or x is None:
        return number(x)
    if hasattr(x, "item"):                          # numpy / pandas scalars
        return cell(x.item())
    return str(x)


def table(head: Sequence[str], rows: Sequence[Sequence[str]], *, left: int | None = None, rule: bool = False) -> str:
    """A plain-text table (the command line's): each column as wide as its widest cell, two spaces apart; the
    first `left` columns left-aligned, the rest right-aligned (None: all left-aligned); `rule`: a line of dashes
    under the head. Cells are strings already."""
    rows = [list(head), *map(list, rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if left is None or j < left else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
