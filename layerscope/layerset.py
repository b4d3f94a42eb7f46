"""Layer sets: the one home of how a set of layers is read and checked.

A layer set names hidden_states indices of a target with N decoder layers: 0 is the embedding output,
N-1 the input of the last decoder layer; N itself is the final state, which the draft predicts and never
reads. The command line, selection, the probe, training and the app all read and check sets here, so a bad
set gets the same one line wherever it is typed.

    parse(text, name, error)        '2,15,27' -> [2, 15, 27]: integers >= 0, each once, at least one
    check(layers, n, name, error)   -> the set sorted; one line for an empty set, a repeat, a layer outside 0..N-1
                                    (n None: the depth is not known yet, only layers >= 0)
    check_sets(sets, n, name, error) every set checked and sorted; a set given twice is refused
    is_valid(layers, bound)         the same rule as a yes/no, for files being validated (sessions)
    default_rule(n)                 [2, N//2, N-3] as written: the set vLLM, SGLang, EAGLE and speculators default to
    default_layers(n)               that rule as a layer set (shallow models: only the distinct layers in 0..N-1)
                                    and a note saying what was dropped

`name` is how the message names the set ("--layers" on the command line, "Layer set" elsewhere); `error`
the LayerScopeError subclass the caller raises (SelectionError, DraftError).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from layerscope.errors import LayerScopeError, SelectionError

EXAMPLE = "2,15,27"


def parse(text, name: str = "--layers", error: type[LayerScopeError] = SelectionError) -> list[int]:
    """'2,15,27' -> [2, 15, 27] in the order given; `error` naming `name` for anything else."""
    parts = [x.strip() for x in str(text).split(",")]
    if not any(parts):
        raise error(f"{name} {text!r} names no layer", f"List the layers, e.g. {name} {EXAMPLE}")
    try:
        layers = [int(x) for x in parts if x]
    except ValueError:
        raise error(f"{name} {text!r} is not a comma-separated list of integers",
                    f"Write it like {name} {EXAMPLE}") from None
    if min(layers) < 0:
        raise error(f"{name} {text!r} has a negative layer", "Layers are hidden_states indices 0..N-1")
    _no_repeats(layers, f"{name} {text!r}", error)
    return layers


def check(layers: Sequence[int] | None, n: int | None, name: str = "Layer set",
          error: type[LayerScopeError] = SelectionError) -> list[int]:
    """A set for a target of `n` decoder layers -> sorted list of ints."""
    if layers is None or len(layers) == 0:
        raise error(f"{name} names no layer", f"Name the layers, e.g. {EXAMPLE}")
    layers = [int(x) for x in layers]
    shown = f"{name} {','.join(map(str, layers))}"
    _no_repeats(layers, shown, error)
    bad = [x for x in layers if x < 0 or (n is not None and x >= n)]
    if bad and n is None:
        raise error(f"{shown}: layers {bad} are negative", "Layers are hidden_states indices 0..N-1")
    if bad:
        raise error(f"{shown}: layers {bad} are out of range: outside 0..{n - 1} of this target ({n} decoder layers)",
                    f"A draft reads hidden_states 0..{n - 1}; {n} is the model's final state, which the draft predicts")
    return sorted(layers)


def check_sets(sets: Iterable[Sequence[int]], n: int, name: str = "Layer set",
               error: type[LayerScopeError] = SelectionError) -> list[list[int]]:
    """Every set checked and sorted, in the order given; at least one; none twice."""
    out: list[list[int]] = []
    for s in sets:
        s = check(s, n, name, error)
        if s in out:
            raise error(f"{name} {','.join(map(str, s))} is given twice", "Give each set once")
        out.append(s)
    if not out:
        raise error("No layer set given", f"Name one, e.g. --layers {EXAMPLE} (repeat --layers for more sets)")
    return out


def is_valid(layers, bound: int | None = None) -> bool:
    """A list of distinct integers in 0..bound-1 (any >= 0 when bound is None), at least one."""
    if not isinstance(layers, list) or not layers or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        return False
    return len(set(layers)) == len(layers) and all(0 <= x and (bound is None or x < bound) for x in layers)


def default_rule(n: int) -> list[int]:
    """[2, N//2, N-3] for a target of `n` decoder layers, as written (for a very shallow model some are repeats
    or outside 0..N-1): the set the serving engines read when a draft names none (draft/engines.py)."""
    n = int(n)
    return [2, n // 2, n - 3]


def default_layers(n: int) -> tuple[list[int], str]:
    """(the default rule as a layer set, a note): [2, N//2, N-3] with layers outside 0..N-1 and repeats dropped
    for very shallow models; the note says so ("" when nothing was dropped)."""
    rule = default_rule(n)
    layers = sorted({l for l in rule if 0 <= l < n})
    note = "" if len(layers) == 3 else f"rule gives {rule} for N={n}; kept the distinct layers in 0..{n - 1}"
    return layers, note


def _no_repeats(layers: list[int], shown: str, error) -> None:
    dupes = sorted({x for x in layers if layers.count(x) > 1})
    if dupes:
        raise error(f"{shown} repeats {dupes}", "List each layer once")
