"""Hand-picked layers and set sizes: what a click or box on the CKA heatmap does to the picks, the set size k of
the Layer sets page, the sets the figures show. Read-only: each returns the picks or sizes; the page saves them."""

from __future__ import annotations

from layerscope import fmt, layerset
from layerscope.session.model import Session
from layerscope.ui import plots


def manual_layers(s: Session) -> list[int]:
    return sorted(set(s.manual_picks))


def toggle_picks(picks, chosen) -> list[int]:
    """Hand-picked layers after a click or box on the heatmap: if every chosen layer is picked already,
    they are unpicked; otherwise the chosen layers are added."""
    picks, chosen = set(int(p) for p in picks), set(int(c) for c in chosen)
    return sorted(picks - chosen if chosen and chosen <= picks else picks | chosen)


def heatmap_picks(selection: dict, picks, *, limit: int, num_layers: int) -> tuple[list[int], str | None]:
    """What a selection on the CKA heatmap does to the hand-picked layers `picks`: (the picks after it, a line to
    show or None). A click picks its cell's row and column layer; a box or lasso the layers whose diagonal cells it
    covers, at most `limit` of them (the set size: a larger box changes nothing and says so); neither leaves more
    than `limit` layers picked (it changes nothing and says so, _within_limit). Either way, picking
    picked layers again unpicks them (toggle_picks); layer `num_layers`, the final state, is never picked (drafts
    read 0..N-1)."""
    picks = sorted(set(int(p) for p in picks))
    points = selection.get("points") or []
    if not (selection.get("box") or selection.get("lasso")):          # a click
        chosen = [layer for layer in plots.cells_to_layers(points) if layer < num_layers]
        return _within_limit(picks, toggle_picks(picks, chosen) if chosen else picks, limit, "The click")
    diagonal = plots.diagonal_layers(points)
    chosen = [layer for layer in diagonal if layer < num_layers]
    if not chosen:
        return picks, ((f"The box covers only layer {num_layers}, the final state, which drafts do not read. " if diagonal
                        else "The box covers no cell on the diagonal: a box picks the layers whose own cells (on the "
                             "diagonal) it covers. ")
                       + "Drag along the diagonal, or click a cell to pick its row and column layer.")
    if len(chosen) > limit and not set(chosen) <= set(picks):
        return picks, (f"The box covers {len(chosen)} layers on the diagonal, {fmt.layers(chosen)}: more than the "
                       f"set size k = {limit} (Layer sets page), so it picked none. Drag a smaller box, or click cells.")
    return _within_limit(picks, toggle_picks(picks, chosen), limit, "The box")


def _within_limit(picks: list[int], after: list[int], limit: int, what: str) -> tuple[list[int], str | None]:
    """`after` when it keeps the picks within the set size `limit` (or picks nothing new); else `picks` unchanged and
    the line that says why. A click and a box are held to the same size as the picked-layers box on the CKA page."""
    if len(after) <= limit or set(after) <= set(picks):
        return after, None
    added = sorted(set(after) - set(picks))
    return picks, (f"{what} would add {fmt.layers(added)} to the {len(picks)} picked layer(s), {fmt.layers(picks)}: "
                   f"{len(after)} layers, more than the set size k = {limit} (Layer sets page), so it picked none. "
                   "Unpick a layer first (click a picked cell again, or remove it under the heatmap), or raise k on the "
                   "Layer sets page.")


def picks_over_limit(picks, limit: int) -> str | None:
    """The line the CKA page shows when more layers are picked than the set size `limit` (picked on the Layer sets
    page, or before k was lowered), or None."""
    picks = sorted(set(int(p) for p in picks))
    if len(picks) <= limit:
        return None
    return (f"{len(picks)} layers picked, {fmt.layers(picks)}: more than the set size k = {limit} (Layer sets page). "
            "No more can be picked here; unpick some, or raise k on the Layer sets page.")


def default_set_size(n: int) -> int:
    """The set size the Layer sets page starts from: the default rule's, for a capture of `n` layers."""
    return len(layerset.default_layers(n)[0])


def set_size(s: Session, n: int) -> int:
    """The set size k chosen on the Layer sets page (s.view["sets_k"]), inside 1..n; the default rule's until chosen."""
    k = s.view.get("sets_k")
    if not isinstance(k, int) or isinstance(k, bool):
        k = default_set_size(n)
    return max(1, min(int(k), max(1, n)))


def sets_for_display(s: Session, extra: list[tuple[str, list[int]]] = ()) -> list[tuple[str, list[int]]]:
    """The session's layer sets (plus `extra`), as (name, layers) pairs for the figures; no duplicates."""
    out, seen = [], set()
    for name, layers in [(x["name"], x["layers"]) for x in s.layer_sets] + list(extra):
        key = tuple(layers)
        if key and key not in seen:
            seen.add(key)
            out.append((name, list(layers)))
    return out
