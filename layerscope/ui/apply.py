"""Applying backend results to the active session: a new capture (and what it keeps of the old one), statistics,
and every finished job's result (`collect`, on every run). Everything here changes the session.
"""

from __future__ import annotations

import streamlit as st

from layerscope import fmt, layerset
from layerscope.capture import stored
from layerscope.session.model import Session
from layerscope.study import recommend
from layerscope.ui import tasks
from layerscope.ui.jobs import get_manager
from layerscope.ui.state import add_note, commit

# ---------------------------------------------------------------------------- captures

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


# ---------------------------------------------------------------------------- finished jobs

# ---------------------------------------------------------------------------- finished jobs

def _apply_analysis(s: Session, result: dict) -> bool:
    if result.get("capture_key") != s.capture_key:
        return False        # computed for a capture the session has since left
    if dict(result["requested"]) != dict(s.analysis_options):
        return False        # options the user has since changed again (a kernel clicked twice): never put back;
                            # stats_access.ensure_stats starts the job of the options now chosen
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
