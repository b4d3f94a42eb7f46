"""Applying backend results to the active session, and reading what pages need from it.

Pages call these so they stay thin: a finished job's result goes into the session here; the layer
statistics a page draws come from here (the session's snapshot, else a background analysis job).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from layerscope import fmt, layerset, plots
from layerscope.capture import stored
from layerscope.session.model import Session
from layerscope.stats.analysis import AnalysisOptions, LayerStats
from layerscope.stats.entropy import KERNELS
from layerscope.ui import recommend, tasks
from layerscope.ui.jobs import StatsTag, get_manager
from layerscope.ui.state import add_note, commit

# ---------------------------------------------------------------------------- prompts

@st.cache_resource(show_spinner="Reading the prompt set…", max_entries=16)
def preview_prompts(spec: str, limit: int, seed: int):
    return tasks.load_prompt_set(spec, limit, seed)


# ---------------------------------------------------------------------------- captures

def _fit_sets_to(s: Session, num_layers: int | None) -> None:
    """Keep the layer sets that exist in a capture of `num_layers` layers (drafts read 0..N-1); the others, and
    hand-picked layers that do not all fit, are removed whole (never cut down to the layers that fit), and a
    note says which."""
    if num_layers is None:
        return
    n = int(num_layers)
    fits = [x for x in s.layer_sets if layerset.is_valid(x["layers"], n)]
    gone = [x for x in s.layer_sets if x not in fits]
    s.layer_sets = fits
    if gone:
        add_note(s, f"The new capture has {n} layers that drafts read (0..{n - 1}), so "
                    + ("this layer set did not fit and was removed: " if len(gone) == 1 else
                       "these layer sets did not fit and were removed: ")
                    + "; ".join(f"{x['name']} {fmt.layers(x['layers'])}" for x in gone)
                    + (f". Kept: {'; '.join(x['name'] + ' ' + fmt.layers(x['layers']) for x in fits)}." if fits else "."))
    if s.manual_picks and not layerset.is_valid(sorted(set(s.manual_picks)), n):
        add_note(s, f"Your hand-picked layers {fmt.layers(sorted(s.manual_picks))} do not fit the new capture "
                    f"(layers 0..{n - 1}): they were cleared, not cut down; pick again on the CKA heatmap.")
        s.manual_picks = []


def _set_capture(s: Session, key: str, summary: dict, model: str | None, prompt_set: str | None) -> None:
    changed = s.capture_key != key
    old_fp = (s.capture or {}).get("fingerprint")
    if changed and old_fp:
        for r in s.bench_results + s.study:     # results of the capture being left: say of which model they are
            if not r.get("target_fingerprint") and (r.get("capture_key") or r.get("capture")) in (None, s.capture_key):
                r["target_fingerprint"] = old_fp
    s.capture_key = key
    s.capture = summary
    s.model = model or summary.get("model") or s.model
    s.prompt_set = prompt_set or summary.get("prompt_set") or s.prompt_set
    if changed:
        s.stats, s.arrays = {}, {}
        if s.drafts or s.bench_results:
            # drafts were trained on another capture; keep them listed only when the model is the same, and say so
            fp = summary.get("fingerprint")
            other = [d for d in s.drafts if not (fp is None or d.get("target_fingerprint") in (None, fp))]
            s.drafts = [d for d in s.drafts if d not in other]
            if other:
                add_note(s, f"The new capture is of another model, so {len(other)} draft(s) trained for the previous "
                            "one left this session's list (they stay in the store): "
                            + "; ".join(f"{d['name']} {fmt.layers(d['layers'])}" for d in other) + ".")
        results = [r for r in s.bench_results + s.study if not recommend.same_target(s, r)]
        if results and old_fp != summary.get("fingerprint"):
            add_note(s, f"The new capture is of another model: {len(results)} benchmark or study result(s) of the "
                        "previous one stay listed, but no longer rank this model's layer sets.")
    _fit_sets_to(s, summary.get("num_layers"))


def capture_replaces(s: Session) -> list[str]:
    """What a new capture in `s` would replace or may remove (its capture; the layer sets, drafts and results made
    on it), as phrases; [] when the session has no capture yet. The Capture page asks before it does that."""
    if not s.capture_key:
        return []
    said = [f"its capture {s.capture_key}" + (f" of {s.model}" if s.model else "")]
    for n, what in ((len(s.layer_sets), "layer set"), (len(s.drafts), "draft"),
                    (len(s.bench_results) + len(s.study), "benchmark or study result")):
        if n:
            said.append(f"{n} {what}{'s' if n > 1 else ''}")
    return said


def capture_result(s: Session, result: dict) -> None:
    """A finished capture job: the session now analyses that capture (and has its statistics)."""
    _set_capture(s, result["key"], result["summary"], result.get("model"), result.get("prompt_set"))
    if result.get("stats"):
        set_stats(s, result["stats"], result.get("requested", s.analysis_options))


def open_capture(s: Session, store, key: str) -> None:
    cap = stored.open_capture(store, key)
    _set_capture(s, cap.key, tasks.capture_summary(cap.manifest), cap.manifest.get("model"),
                 cap.manifest.get("prompt_set"))


# ---------------------------------------------------------------------------- statistics

def set_stats(s: Session, stats: dict, requested: dict | None = None) -> None:
    """Keep a statistics snapshot in the session; `requested` are the options the user asked for."""
    s.set_stats({**stats, "requested": dict(requested if requested is not None else s.analysis_options)})


def capture_available(s: Session, store) -> bool:
    return bool(s.capture_key) and stored.has_capture(store, s.capture_key)


def stats_for(s: Session, store, options: dict | None = None):
    """The session's layer statistics for `options` (None: the session's current options).

    Returns (stats dict or None, job or None). A finished analysis job is applied to the session
    here. When the snapshot was computed with other options and the capture is in the store, an
    analysis job starts (or the running one is returned) and the old snapshot is returned meanwhile;
    a session imported without its capture shows its snapshot.
    """
    manager = get_manager()
    wanted = dict(s.analysis_options if options is None else options)
    collect(s)
    job = manager.latest(s.id, "analysis")
    snapshot = s.stats_dict()
    if snapshot is not None and snapshot.get("requested", {}) == wanted:
        return snapshot, None
    if not capture_available(s, store):
        return snapshot, None
    if job is not None:
        v = job.view()
        if v.running:
            return snapshot, job
        if v.state != "done" and job.tag == StatsTag(s.capture_key, wanted):
            return snapshot, job      # it failed for these options: show the error, do not retry in a loop
    key = s.capture_key
    job = manager.submit(s.id, "analysis", tasks.stats_job(store=store, capture_key=key, options=wanted),
                         title="Layer statistics", tag=StatsTag(key, wanted))
    return snapshot, job


# ---------------------------------------------------------------------------- finished jobs

def _apply_analysis(s: Session, result: dict) -> bool:
    if result.get("capture_key") != s.capture_key:
        return False        # computed for a capture the session has since left
    if dict(result["requested"]) != dict(s.analysis_options):
        return False        # options the user has since changed again (a kernel clicked twice): never put back;
                            # stats_for starts the job of the options now chosen
    set_stats(s, result["stats"], result["requested"])
    return True


def _apply_draft(s: Session, entry: dict) -> bool:
    """One draft (capture training) or {"drafts": [...]} (online training: one per set of the pass)."""
    for d in entry.get("drafts", [entry]):
        s.drafts = [x for x in s.drafts if x["path"] != d["path"]] + [d]
    return True


def _apply_bench(s: Session, result: dict) -> bool:
    # the capture the session had when the benchmark started (the result says), else now (Compare's runs table)
    s.bench_results.append({"capture_key": s.capture_key, **result})
    s.view["bench_run"] = len(s.bench_results) - 1       # the new result is the one shown
    return True


def _apply_capture(s: Session, result: dict) -> bool:
    capture_result(s, result)
    return True


def _apply_study(s: Session, result: dict) -> bool:
    s.study.append(result)
    s.view["study_run"] = len(s.study) - 1               # the new result is the one shown
    known = {d["path"] for d in s.drafts}
    steps = ((result.get("options") or {}).get("train") or {}).get("steps")
    for r in result["rows"]:     # the study's drafts become the session's drafts too
        if r["draft"] not in known:
            s.drafts.append({"name": "/".join(r["strategies"]), "path": r["draft"], "layers": r["layers"],
                             "strategy": r["strategies"][0], "val_accuracy": r.get("val_accuracy"), "steps": steps,
                             "capture_key": result.get("capture")})
    return True


def _apply_probe(s: Session, result: dict) -> bool:
    """Probe scores of the session's capture join those it holds (s.view["probe"]; recommend reads them)."""
    if result.get("capture_key") != s.capture_key:
        return False
    held = s.view.get("probe") if isinstance(s.view.get("probe"), dict) else {}
    known = {tuple(x["layers"]): x for x in held.get("sets") or []} if held.get("capture_key") == s.capture_key else {}
    for x in result["sets"]:
        known[tuple(x["layers"])] = {"layers": list(x["layers"]), "agreement": x["agreement"],
                                     "explained_variance": x.get("explained_variance"),
                                     **{k: x.get(k) for k in ("agreement_ci", "hits", "counts")}}
    s.view["probe"] = {"capture_key": s.capture_key, "sets": list(known.values())}
    return True


APPLIERS = {"capture": _apply_capture, "probe": _apply_probe, "analysis": _apply_analysis, "train": _apply_draft, "bench": _apply_bench,
            "study": _apply_study}


COLLECTED = "ls_collected"      # st.session_state: how many times collect took a result into the session


def collect(s: Session) -> bool:
    """Take the results of this session's finished jobs into it (once each) and save it.

    Called on every run (app.py), so a job that finished while its page was not open, or before a
    browser refresh, lands in the session all the same. Returns whether anything changed; a change
    also counts in st.session_state[COLLECTED], so app.py sees a result that landed while a page ran
    (a page that drew the session before it, and the job as done, polls no more: it reruns once).
    """
    changed = False
    for kind, apply_fn in APPLIERS.items():
        job = get_manager().latest(s.id, kind)
        if job is None:
            continue
        v = job.view()
        if v.finished_ok and not v.applied and isinstance(v.result, dict):
            job.mark_applied()
            changed = apply_fn(s, v.result) or changed
    if changed:
        commit(s)
        st.session_state[COLLECTED] = st.session_state.get(COLLECTED, 0) + 1
    return changed


# ---------------------------------------------------------------------------- how results are named

def draft_labels(drafts) -> dict[str, str]:
    """{path: "name [layers]"} for pickers and charts; two drafts that would read alike get their folder name too."""
    base = {d["path"]: f"{d['name']} {fmt.layers(d['layers'])}" for d in drafts}
    seen: dict[str, int] = {}
    for label in base.values():
        seen[label] = seen.get(label, 0) + 1
    return {p: label + (f" · {Path(p).name[:8]}" if seen[label] > 1 else "") for p, label in base.items()}


def colors(s: Session) -> dict:
    """The session's palette: one color per layer set (its sets, then its drafts', studies' and benchmarks'), the
    default rule grey; every figure takes it, so a set and the drafts reading it keep one color across charts."""
    n = s.num_layers
    sets = ([x["layers"] for x in s.layer_sets] + [d["layers"] for d in s.drafts]
            + [r["layers"] for study in s.study for r in study.get("rows") or []]
            + [r["layers"] for b in s.bench_results for r in b.get("results") or [] if r.get("layers")])
    return plots.palette(sets, default=layerset.default_layers(n)[0] if n else None)


def run_label(res: dict, i: int) -> str:
    """How a benchmark run reads in its picker: number, prompts, tokens, depth, device, when."""
    parts = [f"#{i + 1}", f"{res.get('prompts')} {res.get('prompt_set', '')} prompts".replace("  ", " "),
             f"{res.get('max_new_tokens')} new tokens"]
    if res.get("k") is not None:
        parts.append(f"K {res['k']}")
    parts += [str(res.get("device") or "?"), fmt.when(res.get("created"))]
    return " · ".join(parts)


# ---------------------------------------------------------------------------- layer sets

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


def kernel_of(stats: dict) -> str:
    """The CKA kernel the statistics were computed with (the session's choice when they were computed)."""
    return LayerStats.kernel_of(stats)


def session_kernel(s: Session) -> str:
    """The CKA kernel the session's statistics are (to be) computed with: its analysis options' (AnalysisOptions)."""
    kernel = s.analysis_options.get("kernel", AnalysisOptions().kernel)
    return kernel if kernel in KERNELS else AnalysisOptions().kernel


def set_kernel(s: Session, kernel: str) -> None:
    """Compute the session's statistics with CKA kernel `kernel` from now on: its analysis options change (the
    pages then recompute them through the cached analysis, stats_for) and the Entropy page's edited options, when
    it has some, take the same kernel, so they do not ask to change it back."""
    if kernel not in KERNELS or kernel == session_kernel(s):
        return
    s.analysis_options = {**s.analysis_options, "kernel": kernel}
    edited = s.view.get("entropy_controls")
    if isinstance(edited, dict) and "kernel" in edited:
        s.view["entropy_controls"] = {**edited, "kernel": kernel}
    commit(s)


def layer_stats(stats: dict):
    """A LayerStats from a statistics dict (the session's snapshot)."""
    return LayerStats.from_dict(stats)


def sets_for_display(s: Session, extra: list[tuple[str, list[int]]] = ()) -> list[tuple[str, list[int]]]:
    """The session's layer sets (plus `extra`), as (name, layers) pairs for the figures; no duplicates."""
    out, seen = [], set()
    for name, layers in [(x["name"], x["layers"]) for x in s.layer_sets] + list(extra):
        key = tuple(layers)
        if key and key not in seen:
            seen.add(key)
            out.append((name, list(layers)))
    return out


def extra_stats(s: Session, store, options: dict, kind: str = "analysis-compare"):
    """Statistics for other options, beside the session's own (e.g. unfiltered, to compare curves).

    Not kept in the session: returns (stats dict or None, job or None) from a job of `kind`.
    """
    if not capture_available(s, store):
        return None, None
    manager = get_manager()
    job = manager.latest(s.id, kind)
    if job is not None and job.tag == StatsTag(s.capture_key, dict(options)):
        v = job.view()
        if v.finished_ok:
            return v.result, None
        if v.running or v.state == "failed":
            return None, job
    if job is not None and job.view().running:
        return None, job
    job = manager.submit(s.id, kind, tasks.analysis_job(store=store, capture_key=s.capture_key, options=options),
                         title="Comparison statistics", tag=StatsTag(s.capture_key, dict(options)))
    return None, job
