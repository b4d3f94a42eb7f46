"""The Compare page's logic: two captures side by side, and the session's runs in one table.

Nothing here draws: app_pages/compare.py lays out the widgets and charts. A capture's statistics
come from the store's analysis cache under the session's analysis options, through a background
job like every page's statistics (`stats_of`); the rest are pure functions on plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from layerscope import fmt
from layerscope.capture.stored import has_capture, list_captures
from layerscope.session.model import Session
from layerscope.stats.analysis import LayerStats
from layerscope.ui import tasks
from layerscope.ui.jobs import StatsTag, get_manager
from layerscope.ui.worker import CANCELLED, FAILED

SLOTS = ("A", "B")
KIND_ORDER = {"study": 0, "bench": 1, "draft": 2}


# ---------------------------------------------------------------------------- which captures

def capture_choices(s: Session, store) -> list[dict]:
    """The captures to compare, newest first: the store's finished ones (damaged ones left out: the page
    says which, with damaged_captures), plus the session's own capture when the store lacks it but the
    session holds its statistics."""
    caps = [c for c in list_captures(store) if not c.get("problem")]
    if s.capture_key and s.has_stats and all(c.get("key") != s.capture_key for c in caps):
        caps.append({**s.capture, "key": s.capture_key, "model": s.capture.get("model") or s.model,
                     "prompt_set": s.capture.get("prompt_set") or s.prompt_set, "saved_with_session": True})
    return caps


def damaged_captures(store) -> list[dict]:
    """The store's captures that cannot be compared, each with its problem and fix."""
    return [c for c in list_captures(store) if c.get("problem")]


def capture_label(c: Mapping | None, key: str | None = None) -> str:
    """How a capture reads in a picker or a table: model · prompt set · tokens · key."""
    if not c:
        return "—" if key is None else f"{key} (not in this store)"
    tokens = c.get("tokens")
    parts = [str(c.get("model") or "?"), str(c.get("prompt_set") or "?"),
             f"{tokens:,} tokens" if isinstance(tokens, int) else "? tokens", str(c.get("key"))]
    return " · ".join(parts) + (" · saved with the session" if c.get("saved_with_session") else "")


def default_pair(keys: Sequence[str], session_key: str | None) -> tuple[str | None, str | None]:
    """A: the session's capture (else the newest); B: the newest other one. `keys` newest first."""
    a = session_key if session_key in keys else (keys[0] if keys else None)
    b = next((k for k in keys if k != a), None)
    return a, b


# ---------------------------------------------------------------------------- statistics

def job_kind(slot: str) -> str:
    """The job kind that computes slot A's or B's statistics (its cancel button reads 'Cancel comparison A')."""
    return f"comparison {slot}"


def stats_of(s: Session, store, slot: str, key: str, options: dict):
    """Layer statistics of capture `key` under `options` (the session's analysis options), for slot A or B.

    Returns (stats dict or None, job or None). The session's snapshot serves its own capture when it
    was computed with these options (or when the store lacks that capture: then the snapshot is all
    there is, whatever its options); any other capture is analysed by a job of kind `job_kind(slot)`,
    which the store's analysis cache answers at once when the statistics were computed before. While
    that job runs, or after it failed or was cancelled, stats is None and the job says why. A job still
    running for a capture no longer picked in this slot is cancelled.
    """
    wanted = dict(options)
    if key == s.capture_key:
        snapshot = s.stats_dict()
        if snapshot is not None and (snapshot.get("requested", {}) == wanted or not has_capture(store, key)):
            return snapshot, None
    if not has_capture(store, key):
        return None, None
    manager = get_manager()
    tag = StatsTag(key, wanted)
    job = manager.latest(s.id, job_kind(slot))
    if job is not None:
        v = job.view()
        if job.tag == tag:
            if v.finished_ok:
                return v.result, None
            if v.running or v.state in (FAILED, CANCELLED):
                return None, job      # failed: show why, do not retry in a loop (`compute` retries)
        elif v.running:
            job.cancel()
            return None, job
    return None, compute(s, store, slot, key, wanted)


def compute(s: Session, store, slot: str, key: str, options: dict):
    """Start the statistics job of `slot` for capture `key` (also: try again after a failure or cancel)."""
    return get_manager().submit(s.id, job_kind(slot), tasks.analysis_job(store=store, capture_key=key,
                                                                         options=dict(options)),
                                title=f"Statistics of capture {slot}", tag=StatsTag(key, dict(options)))


def entropy_of(stats: Mapping, normalized: bool) -> list[float]:
    """[N+1] dataset-level entropy per layer (raw nats or normalized by log min(n, d))."""
    return [float(v) for v in stats["entropy_normalized" if normalized else "entropy"]]


def cka_of(stats: Mapping, estimator: str) -> list[list[float]]:
    """[N+1][N+1] CKA matrix of one estimator ("biased" or "debiased"; biased when debiased is missing)."""
    m = stats.get("cka_debiased") if estimator == "debiased" else None
    return m if m is not None else stats["cka"]


def kernel_of(stats: Mapping) -> str:
    """The CKA kernel the statistics were computed with, by LayerStats' rule (no kernel recorded: "cosine")."""
    return LayerStats.kernel_of(stats)


def relative_depth(num_layers: int) -> list[float]:
    """[N+1] layer l / N for l = 0..N: 0 is the embeddings, 1 the final state, whatever the depth."""
    if num_layers < 1:
        raise ValueError(f"a capture has at least one layer after the embeddings (got N = {num_layers})")
    return [l / num_layers for l in range(num_layers + 1)]


# ---------------------------------------------------------------------------- the CKA difference

@dataclass(frozen=True)
class CkaDifference:
    diff: torch.Tensor          # [N+1, N+1] CKA(A) − CKA(B)
    mean_abs: float             # mean |ΔCKA| over the layer pairs i < j (the diagonal is 1 − 1 = 0 by definition)
    max_abs: float              # the largest |ΔCKA| over those pairs
    where: tuple[int, int]      # (i, j), i < j: the pair where it is
    signed: float               # ΔCKA at that pair (> 0: A's two layers are more alike than B's)


def cka_difference(a, b) -> CkaDifference:
    """A − B of two [N+1, N+1] CKA matrices of the same N (lists or tensors), with a one-number summary."""
    ta, tb = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if ta.ndim != 2 or ta.shape != tb.shape or ta.shape[0] != ta.shape[1] or ta.shape[0] < 2:
        raise ValueError(f"cka_difference needs two square matrices of one size, got {tuple(ta.shape)} and {tuple(tb.shape)}")
    diff = ta - tb
    i, j = torch.triu_indices(diff.shape[0], diff.shape[1], offset=1)
    pairs = diff[i, j]
    k = int(pairs.abs().argmax())
    return CkaDifference(diff=diff, mean_abs=float(pairs.abs().mean()), max_abs=float(pairs[k].abs()),
                         where=(int(i[k]), int(j[k])), signed=float(pairs[k]))


def no_difference_reason(n_a: int, n_b: int) -> str | None:
    """Why there is no CKA difference heatmap for captures of N_A and N_B layers (None: there is one)."""
    if n_a == n_b:
        return None
    return (f"No CKA difference heatmap: capture A has {n_a} layers and B has {n_b}, and a CKA cell pairs two "
            f"layers of one model, so there is no cell of B to subtract from a cell of A (resampling the matrices "
            f"on relative depth would invent layers that do not exist). The entropy curves above are on relative "
            f"depth; the two heatmaps are side by side below.")


# ---------------------------------------------------------------------------- the runs table

def _first(v):
    """The first value of a per-step list (accuracy at draft step 1), or the number itself."""
    if isinstance(v, (list, tuple)):
        return v[0] if v else None
    return v


def _ci(v) -> list | None:
    """A [lo, hi] interval (study rows; benchmarks since they bootstrap over prompts), or None."""
    return list(v) if isinstance(v, (list, tuple)) and len(v) == 2 and None not in v else None


def runs_table(s: Session, captures: Mapping[str, Mapping]) -> list[dict]:
    """Every benchmark contender, study row and draft of session `s`, each with the capture it came from.

    captures: key -> capture summary (model, prompt_set), e.g. from `capture_choices`; a key it lacks
    keeps its key with no model or prompt set. Entries saved before they carried a capture key have
    capture None (shown "—"). A benchmark's draft row names the capture its draft was trained on (from
    the session's drafts), else the capture the session had when the benchmark ran; the baselines the
    latter. Rows are in `sort_runs` order.
    """
    drafts_by_path = {d.get("path"): d for d in s.drafts}
    rows = []

    def row(kind, run, capture, **fields):
        c = captures.get(capture) if capture else None
        rows.append({"kind": kind, "run": run, "capture": capture or None,
                     "model": (c or {}).get("model"), "prompt set": (c or {}).get("prompt_set"), **fields})

    for n, res in enumerate(s.study, 1):
        for r in res.get("rows") or []:
            row("study", f"study #{n}", res.get("capture") or res.get("capture_key"),
                name="/".join(r.get("strategies") or []), layers=list(r.get("layers") or []), tau=r.get("tau"),
                tau_ci=_ci(r.get("tau_ci")), speedup=r.get("speedup"), speedup_ci=_ci(r.get("speedup_ci")),
                tokens_per_s=r.get("tokens_per_s"), accept1=None, val_acc1=_first(r.get("val_accuracy")), lossless=r.get("lossless"),
                prompts=res.get("prompts"), created=res.get("created"), device=res.get("device"), index=n)
    for n, res in enumerate(s.bench_results, 1):
        contenders = res.get("results") if isinstance(res.get("results"), list) else [res]   # old flat entries
        paths = {d.get("name"): d.get("path") for d in res.get("drafts") or []}
        for r in contenders:
            draft = drafts_by_path.get(paths.get(r.get("name")))
            row("bench", f"bench #{n}", (draft or {}).get("capture_key") or res.get("capture_key"),
                name=r.get("name"), layers=list(r.get("layers") or []), tau=r.get("tau"), tau_ci=_ci(r.get("tau_ci")),
                speedup=r.get("speedup"), speedup_ci=_ci(r.get("speedup_ci")), tokens_per_s=r.get("tokens_per_s"),
                accept1=_first(r.get("acceptance_by_position")), val_acc1=None, lossless=r.get("lossless"),
                prompts=res.get("prompts"), created=res.get("created"), device=res.get("device"), index=n)
    for n, d in enumerate(s.drafts, 1):
        row("draft", "draft", d.get("capture_key"), name=d.get("name"), layers=list(d.get("layers") or []),
            tau=None, tau_ci=None, speedup=None, speedup_ci=None, tokens_per_s=None, accept1=None,
            val_acc1=_first(d.get("val_accuracy")), lossless=None, prompts=None, created=d.get("saved"), device=None, index=n)
    return sort_runs(rows, s.capture_key)


def sort_runs(rows: list[dict], session_key: str | None) -> list[dict]:
    """The session's capture first, then other captures, then runs with no capture; within one capture
    studies, benchmarks, drafts; newest run first; within a run the highest τ (or accuracy) first."""
    def key(r):
        cap = r["capture"]
        group = 0 if cap is not None and cap == session_key else (1 if cap is not None else 2)
        score = r["tau"] if r["tau"] is not None else r.get("val_acc1")
        return (group, cap or "", KIND_ORDER.get(r["kind"], 9), -r["index"],
                score is None, -(score or 0.0))

    return sorted(rows, key=key)


def filter_runs(rows: Sequence[dict], *, capture: str | None = "all", kinds: Sequence[str] | None = None) -> list[dict]:
    """Rows of one capture ("all": every capture; None: the rows with no capture recorded) and of `kinds`."""
    return [r for r in rows if (capture == "all" or r["capture"] == capture) and (kinds is None or r["kind"] in kinds)]


COLUMNS = ["kind", "run", "set / contender", "layers", "τ [95% interval]", "speedup [95% interval]", "tokens/s",
           "acceptance@1", "held-out agreement @1", "lossless", "prompts", "capture", "model", "prompt set",
           "created", "device"]         # what was measured first: at 1024 px the first seven columns show


def runs_frame(rows: Sequence[dict]):
    """The rows as a DataFrame for the screen: every number in the one form (layerscope.fmt), intervals as
    "value [lo, hi]", times to the minute (missing values stay None: tables show "—")."""
    def shown(r):
        return [r["kind"], r["run"], r.get("name"), fmt.layers(r["layers"]) if r.get("layers") else None,
                None if r.get("tau") is None else fmt.interval(r["tau"], r.get("tau_ci"), "tau"),
                None if r.get("speedup") is None else fmt.interval(r["speedup"], r.get("speedup_ci"), "speedup"),
                r.get("tokens_per_s"), None if r.get("accept1") is None else fmt.percent(r["accept1"]),
                None if r.get("val_acc1") is None else fmt.percent(r["val_acc1"]), r.get("lossless"), r.get("prompts"),
                r["capture"], r.get("model"), r.get("prompt set"),
                fmt.when(r["created"]) if r.get("created") else None, r.get("device")]

    return pd.DataFrame([shown(r) for r in rows], columns=COLUMNS)


# ---------------------------------------------------------------------------- benchmark runs side by side

def run_options(runs: Sequence[tuple[str, Mapping]]) -> pd.DataFrame:
    """The options of benchmark runs side by side: one row per option, one column per run (label, result)."""
    def machine(b):
        m = b.get("machine") or {}
        return None if not m else ("quiet" if m.get("quiet") else "busy")

    options = {"prompt set": lambda b: b.get("prompt_set"), "prompts": lambda b: b.get("prompts"),
               "new tokens": lambda b: b.get("max_new_tokens"), "draft depth K": lambda b: b.get("k"),
               "contenders": lambda b: ", ".join(str(r.get("name")) for r in b.get("results") or []),
               "device": lambda b: b.get("device"), "machine": machine,
               "capture": lambda b: b.get("capture_key"), "when": lambda b: fmt.when(b.get("created"))}
    return pd.DataFrame({"option": list(options)} | {label: [f(b) for f in options.values()] for label, b in runs})


def run_contenders(runs: Sequence[tuple[str, Mapping]]) -> dict[str, list[dict]]:
    """{run label: its contenders' result rows} for plots.runs_comparison."""
    return {label: list(b.get("results") or []) for label, b in runs}
