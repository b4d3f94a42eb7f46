"""The layer statistics a page draws: the session's snapshot, else a background analysis job.

`ensure_stats` and `ensure_extra_stats` may start a job (and `ensure_stats` takes finished jobs' results into the
session, saving it); `capture_available` and `layer_stats` only read.
"""

from __future__ import annotations

from layerscope.capture import stored
from layerscope.session.model import Session
from layerscope.stats.analysis import LayerStats
from layerscope.ui import tasks
from layerscope.ui.apply import collect
from layerscope.ui.jobs import StatsTag, get_manager


def capture_available(s: Session, store) -> bool:
    return bool(s.capture_key) and stored.has_capture(store, s.capture_key)


def layer_stats(stats: dict):
    """A LayerStats from a statistics dict (the session's snapshot)."""
    return LayerStats.from_dict(stats)


def ensure_stats(s: Session, store, options: dict | None = None):
    """The session's layer statistics for `options` (None: the session's current options), starting their analysis
    job when they are not there yet; it first takes finished jobs' results into the session (apply.collect: saves it).

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


def ensure_extra_stats(s: Session, store, options: dict, kind: str = "analysis-compare"):
    """Statistics for other options, beside the session's own (e.g. unfiltered, to compare curves), starting their
    job when they are not there yet.

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
