"""`layerscope recommend SESSION|KEY`: the layer set the app's Layer sets page recommends, and why.

For a saved session (its id or its name): the page as the session left it (set size k, λ, hand-picked set) with
the session's evidence (studies, benchmarks, drafts, probe scores) and its statistics. For a capture key: a new
session of that capture, the default analysis options and no evidence yet (the default rule, and what to measure).
The decision itself is layerscope.study.recommend's, the same the page and the HTML report show.
"""

from __future__ import annotations

from dataclasses import asdict

from layerscope import fmt
from layerscope.capture.stored import KIND, PREFIX_RE, has_capture, open_capture
from layerscope.commands.common import Progress, open_store, print_json
from layerscope.errors import LayerScopeError, SessionError
from layerscope.session import storage
from layerscope.session.model import Session
from layerscope.session.schema import valid_id
from layerscope.stats.analysis import AnalysisOptions
from layerscope.steps import workflow
from layerscope.study import recommend

NAME = "recommend"
HELP = "the layer set the app recommends for a saved session (its id or name) or a capture key, and why"


def add_arguments(p) -> None:
    p.add_argument("target", metavar="SESSION|KEY",
                   help="a saved session's id or name (the app's Sessions page), or a capture key (a unique prefix is "
                        "enough; see `layerscope captures`)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def find_session(store, target: str) -> Session | None:
    """The saved session whose id or name is `target`; None when there is none; a SessionError when several
    sessions have that name."""
    if valid_id(target) and storage.exists(store, target):
        return storage.load(store, target)
    named = [x for x in storage.list_sessions(store, include_unnamed=False) if x.get("name") == target]
    if len(named) > 1:
        raise SessionError(f"{len(named)} saved sessions are named {target!r}: {', '.join(x['id'] for x in named)}",
                           "Give the session's id instead of its name")
    return storage.load(store, named[0]["id"]) if named else None


def capture_session(store, target: str) -> Session | None:
    """A new session of the capture `target` (a key or a unique prefix); None when no capture entry starts so."""
    key = target.strip().lower()
    if not PREFIX_RE.fullmatch(key) or not any(p.name.startswith(key) for p in store.entry_names(KIND)):
        return None
    cap = open_capture(store, key)          # an ambiguous prefix or an unfinished capture says so itself
    return Session(capture_key=cap.key, model=cap.manifest.get("model"),
                   capture={"num_layers": cap.num_layers, "model": cap.manifest.get("model")})


def session_stats(store, s: Session) -> dict:
    """The statistics the page ranks with: the session's snapshot when it was computed with the session's analysis
    options (or its capture is not in this store), else those options' statistics of its capture (from the store's
    cache, or computed now, progress on stderr)."""
    snapshot = s.stats_dict()
    wanted = dict(s.analysis_options)
    if snapshot is not None and (snapshot.get("requested", {}) == wanted or not has_capture(store, s.capture_key or "")):
        return snapshot
    if not s.capture_key:
        raise SessionError(f"{s.title()} has no capture and no layer statistics yet",
                           "Capture on the app's Capture page first, or give a capture key")
    try:
        options = AnalysisOptions(**wanted)
    except TypeError as e:
        raise SessionError(f"{s.title()}'s analysis options {sorted(wanted)} are not understood ({e})",
                           "Reset the options on the app's Entropy page") from None
    with Progress("analyze", unit="%") as bar:
        return workflow.analyze(store, s.capture_key, options,
                                progress=lambda frac, msg="": bar.update(round(100 * frac), 100, step=msg)).to_json()


def run(args) -> int:
    store = open_store(args)
    s = find_session(store, args.target)
    what = f"session {s.title()} ({s.id})" if s is not None else None
    if s is None:
        s = capture_session(store, args.target)
        what = "a new session of it: default analysis options, nothing measured yet"
    if s is None:
        raise LayerScopeError(f"No saved session or capture {args.target!r} in {store.root}",
                              "Give a session's id or name (the app's Sessions page) or a capture key "
                              "(`layerscope captures` lists them)")
    rec = recommend.as_left(s, session_stats(store, s))
    if args.json:
        print_json({"session": s.id if what.startswith("session") else None, "capture_key": s.capture_key, "k": rec.k,
                    "recommended": None if rec.best is None else {"name": rec.best.name, "layers": rec.best.layers},
                    "basis": rec.basis, "source": rec.source, "text": rec.text, "disagreement": rec.disagreement,
                    "ranked": [asdict(r) for r in rec.ranked], "other_sizes": [asdict(r) for r in rec.other_sizes]})
        return 0
    print(report(rec, f"capture {s.capture_key}" + (f" ({s.model})" if s.model else "") + f", {what}"))
    return 0


def report(rec: recommend.Recommendation, heading: str) -> str:
    """The recommendation as the Layer sets page shows it, in plain text: the sentences, the recommended set's
    notes, then the sets of size k ranked (and those of other sizes, listed)."""
    ranked_by = f"{rec.basis} ({rec.source})" if rec.basis else "nothing yet: no evidence tells them apart"
    lines = [heading, "", rec.text]
    lines += [f"Note: {flag}." for flag in (rec.best.flags if rec.best else [])]
    lines += ["", f"Sets of {rec.k} layers, ranked by {ranked_by}:",
              fmt.table(HEAD, [row(r, rec) for r in rec.ranked], left=3, rule=True),
              "* recommended · ◆ the default rule [2, N//2, N−3] · rank: by the evidence named above, tied sets ranked "
              f"level; {fmt.MISSING} where that evidence did not measure the set"]
    if rec.other_sizes:
        lines += ["", f"{len(rec.other_sizes)} set(s) of another size (not ranked with sets of {rec.k} layers): "
                  + "; ".join(f"{r.name} {fmt.layers(r.layers)}" for r in rec.other_sizes)]
    return "\n".join(lines)


HEAD = ["rank", "set", "layers", "τ [95% CI]", "agreement", "trained on", "probe [95% CI]", "aggr. entropy",
        "mean entropy", "mean CKA", "flags"]


def row(r: recommend.Ranked, rec: recommend.Recommendation) -> list[str]:
    """One set's row, as the page's table has it (its draft column left out: `draft_text` is in the JSON)."""
    tau = fmt.interval(r.tau, r.tau_ci, "tau") if r.tau is not None else None
    if tau and rec.basis == "τ" and r.tau_source != rec.source:
        tau += f" ({r.tau_source})"
    marks = ("* " if r is rec.best else "") + r.name.replace(" = ", ", ") + (" ◆" if r.is_default else "")
    return [fmt.cell(r.rank), marks, fmt.layers(r.layers), fmt.cell(tau),
            fmt.cell(fmt.percent(r.agreement) if r.agreement is not None else None),
            fmt.cell(f"{fmt.count(r.budget)} tok" if r.budget else None),
            fmt.cell(fmt.interval(r.probe, r.probe_ci, "percent") if r.probe is not None else None),
            fmt.cell(r.aggregate_entropy), fmt.cell(r.mean_entropy),
            fmt.NOT_APPLICABLE if r.mean_cka is None else fmt.cell(r.mean_cka), "; ".join(f.split(":")[0] for f in r.flags)]
