"""The Speculative decoding page's logic: the sets a draft can train for, and its tables, labels and lines.

Nothing here draws, and nothing imports Streamlit: app_pages/speculate.py lays out the widgets, charts and live
panels and takes from here what it shows. Plain data in (the session's drafts, benchmark results and studies),
DataFrames and plain text out; the page escapes the text for Markdown where it shows it as Markdown.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from layerscope import fmt, layerset, quietness
from layerscope.decoding import sanity, specdec
from layerscope.draft.training.loss import simulated_acc_len
from layerscope.study.recommend import set_label
from layerscope.study.run import online_settings

SMALL_CAPTURE_TOKENS = 20_000     # below this a draft memorises its training prompts (README: 63k tokens took 21 min)
ONLINE_PHASES = ("responses", "features", "eval")     # phases only an online training run has
# The benchmark's prompt lookup choices, as `bench --lookup` takes them (tasks.bench_job's `lookup`), and their labels
LOOKUP_CHOICES = {"0": "off", str(specdec.DEFAULT_LOOKUP): f"{specdec.DEFAULT_LOOKUP} tokens",
                  f"{specdec.DEFAULT_LOOKUP}..{specdec.DEFAULT_ADAPTIVE_CAP}":
                      f"adaptive {specdec.DEFAULT_LOOKUP}..{specdec.DEFAULT_ADAPTIVE_CAP}",
                  "auto": "auto"}


# ---------------------------------------------------------------------------- drafts

def train_sets(layer_sets, num_layers: int) -> list[tuple[str, list[int], str]]:
    """(name, layers, strategy) of every set a draft can be trained for: the session's sets, then the default
    rule's set when none of them is it."""
    sets = [(x["name"], x["layers"], x["strategy"]) for x in layer_sets]
    if num_layers and not any(tuple(x[1]) == tuple(layerset.default_layers(num_layers)[0]) for x in sets):
        sets.append(("default", layerset.default_layers(num_layers)[0], "default"))
    return sets


def small_capture_warning(capture: dict | None) -> str | None:
    """Why a capture of this size trains no useful draft, or None when it holds enough tokens."""
    tokens = int((capture or {}).get("tokens") or 0)
    if tokens >= SMALL_CAPTURE_TOKENS:
        return None
    return (f"This capture holds {tokens:,} tokens: far too few to train a useful draft (it will learn "
            f"the training prompts by heart: high training accuracy, low held-out acceptance). Capture at "
            f"least {SMALL_CAPTURE_TOKENS:,} tokens, or train online.")


def default_training_mode(capture: dict | None) -> str:
    """Where the training widgets start: "online" when the capture is too small to train a useful draft
    (small_capture_warning), else "capture"."""
    return "online" if small_capture_warning(capture) else "capture"


def is_online(metrics: dict) -> bool:
    """Whether a training job's metrics are an online run's (the target in the loop) rather than a capture's."""
    return "val" in metrics or metrics.get("phase") in ONLINE_PHASES


def online_curves(series: dict) -> dict[str, list[list[float]]]:
    """{set: [[tokens, held-out agreement], ...]} from an online training job's "curve" series."""
    curves: dict[str, list[list[float]]] = {}
    for p in series.get("curve", []):
        curves.setdefault(p["set"], []).append([p["tokens"], p["accuracy"]])
    return curves


SIMULATED_NOTE = ("simulated_acc_len: SpecForge's Σ over draft positions k of the product of the held-out "
                  "agreement at positions 1..k (teacher-forced, so an estimate): the draft tokens a chain of that "
                  "depth would accept per verification. No bonus token, so it is not τ: τ ≈ 1 + simulated_acc_len.")


def simulated_of(val_accuracy) -> float | None:
    """simulated_acc_len of a draft's or a study row's held-out agreement per TTT step; None without that list
    (older records keep one number, position 1 alone)."""
    return simulated_acc_len(val_accuracy) if isinstance(val_accuracy, list) and val_accuracy else None


def learning_frame(drafts, names: dict[str, str]) -> pd.DataFrame:
    """The Compare page's table of the drafts with a learning curve: budget, held-out agreement per step,
    simulated_acc_len, and where each came from."""
    return pd.DataFrame([{"draft": names[d["path"]], "steps": d.get("steps"),
                          "tokens seen": d.get("tokens_seen") or d.get("train_tokens"),
                          "held-out agreement per step": ", ".join(fmt.percent(a) for a in sanity.per_step(d.get("val_accuracy"))),
                          "simulated_acc_len": fmt.number(simulated_of(d.get("val_accuracy"))),
                          "capture": d.get("capture_key"), "stored as": d["path"].rsplit("/", 1)[-1]}
                         for d in drafts if d.get("curve")])


def drafts_frame(drafts) -> pd.DataFrame:
    """The session's drafts as the page lists them, each with its collapse flag (sanity.collapse_reasons)."""
    flags = sanity.collapse_reasons(drafts)
    return pd.DataFrame([{"name": d["name"], "layers": fmt.layers(d["layers"]), "steps": d.get("steps"),
                          "tokens seen": d.get("tokens_seen") or d.get("train_tokens"),
                          "held-out agreement per step": ", ".join(fmt.percent(a) for a in sanity.per_step(d.get("val_accuracy"))),
                          "simulated_acc_len": fmt.number(simulated_of(d.get("val_accuracy"))),
                          "trained in": fmt.duration(d["seconds"]) if d.get("seconds") else None,
                          "stored as": Path(d["path"]).name, "flag": flag or ""} for d, flag in zip(drafts, flags)])


def draft_curves(drafts, labels: dict[str, str]) -> tuple[dict, dict]:
    """The learning curves of the drafts that have one, and every draft's layers, both keyed by its label."""
    curves = {labels[d["path"]]: d["curve"] for d in drafts if d.get("curve")}
    return curves, {labels[d["path"]]: d["layers"] for d in drafts}


def stored_choices(stored, session_drafts, capture_key: str | None) -> dict[str, tuple[dict, str]]:
    """{path: (draft, label)} of the store's drafts this session does not hold yet, for the picker that adds one.
    Each label ends with the draft's store key, so two drafts of one set and length (another seed, fc_norm off) read
    apart and a choice is never taken for its twin."""
    held = {x["path"] for x in session_drafts}
    return {d["path"]: (d, f"{d['name']} {d['layers']} · {d.get('steps')} steps · "
                           + ("this capture" if d.get("capture_key") == capture_key else f"capture {d.get('capture_key')}")
                           + (f" · saved {fmt.when(d['saved'])}" if d.get("saved") else "") + f" · {Path(d['path']).name}")
            for d in stored if d["path"] not in held}


def broken_text(broken) -> str:
    """The store's unusable drafts, one line each with what is wrong and the fix (plain text: keys and paths)."""
    return (f"{len(broken)} draft(s) in the store cannot be used:\n"
            + "\n".join(f"  {b['key']}: {b['problem']}. {b['fix']}" for b in broken))


# ---------------------------------------------------------------------------- benchmark

def bench_kept(drafts, skipped) -> list[str]:
    """The paths of the drafts in the comparison: every draft of the session but those left out."""
    return [p for p in dict.fromkeys(d["path"] for d in drafts) if p not in set(skipped)]


def bench_skipped(drafts, kept) -> list[str]:
    """The paths of the drafts left out of the comparison, kept in the session so a new draft joins it at once."""
    return [d["path"] for d in drafts if d["path"] not in kept]


def live_acceptance(metrics: dict) -> dict[str, list[float]]:
    """{contender: acceptance per draft position} of a running benchmark, from its accepted/drafted counts."""
    return {name: [a / d if d else 0.0 for a, d in zip(x["accepted"], x["drafted"])]
            for name, x in (metrics.get("acceptance") or {}).items() if x["drafted"]}


def bench_frame(res: dict, drafts) -> tuple[pd.DataFrame, str | None]:
    """A benchmark run's table (one row per contender, flagged when a draft may not have learned) and the warning
    about such drafts, or None. `drafts`: the session's, for each draft's held-out agreement."""
    rows = res.get("results", [])
    depth_max = max((len(r.get("acceptance_by_position") or []) for r in rows), default=0)
    paired = any(r.get("paired") for r in rows)
    measured = _measured(res, drafts)
    flags = sanity.collapse_reasons(measured)
    df = pd.DataFrame([{
        "contender": r["name"], "layers": fmt.layers(r["layers"]) if r.get("layers") else "",
        "τ": fmt.interval(r.get("tau"), r.get("tau_ci"), "tau"),
        **({"break-even τ": fmt.tau(r.get("break_even_tau")) if r.get("break_even_tau") else ""}
           if res.get("cost_curve") else {}),
        "speedup": fmt.interval(r.get("speedup"), r.get("speedup_ci"), "speedup"),     # what was measured first
        **{f"acc@{i + 1}": fmt.percent(((r.get("acceptance_by_position") or []) + [None] * depth_max)[i])
           for i in range(depth_max)},
        "tokens/s": fmt.number(r.get("tokens_per_s"), 1), "decoding": r.get("decoding", ""),
        **({"chosen K": "plain" if (r.get("chosen") or {}).get("plain") else (r.get("chosen") or {}).get("k"),
            "calibration predicted": fmt.speedup((r.get("calibrated") or {}).get("speedup"))}
           if any(x.get("chosen") for x in rows) else {}),
        **({"Δτ vs reference": fmt.interval((r.get("paired") or {}).get("tau", {}).get("delta"),
                                            (r.get("paired") or {}).get("tau", {}).get("ci"), "delta")} if paired else {}),
        **({"predicted": fmt.speedup(r.get("predicted_speedup"))} if res.get("cost_curve") else {}),
        "lossless": r.get("lossless"), "flag": flag or "",
    } for r, flag in zip(rows, flags)])
    return df, sanity.collapse_warning([m for m in measured if m])   # (run_warnings says it too)


def _measured(res: dict, drafts) -> list[dict]:
    """A benchmark run's rows, each draft's with its held-out agreement and training tokens (from the session's
    `drafts`); {} for plain decoding."""
    by_path = {d["path"]: d for d in drafts}
    draft_of = {d["name"]: by_path[d["path"]] for d in res.get("drafts") or [] if d.get("path") in by_path}
    return [{**r, "val_accuracy": (draft_of.get(r["name"]) or {}).get("val_accuracy"),
             "tokens": (draft_of.get(r["name"]) or {}).get("tokens_seen")} if r.get("layers") else {}
            for r in res.get("results", [])]


def run_warnings(res: dict, drafts) -> list[tuple[str, str]]:
    """Everything a benchmark run's view warns of or notes, as (level, text), level "error", "warning" or "note":
    drafts that may not have learned, drafts of different budgets, a busy machine, the run's own notes, few
    prompts, speedups above τ, outputs that differ from plain decoding. The page and the HTML report both say
    these."""
    rows = res.get("results", [])
    measured = [m for m in _measured(res, drafts) if m]
    out = []
    bad = not_lossless(rows)
    half = res.get("dtype") in ("bfloat16", "float16")
    theirs = [n for n in bad if n.startswith("hf-")] if half else []          # transformers' decoders
    ours = [n for n in bad if n not in theirs]
    if ours and half and not res.get("row_align"):
        out.append(("warning", f"Outputs differ from plain greedy decoding for {', '.join(ours)}. The target runs in "
                               f"{res['dtype']} here (faster on this machine) and its forwards were not padded to "
                               "aligned rows with each row attending alone (a target with recurrent layers, or a run "
                               "before that): a "
                               "verification of several tokens rounds differently from a one-token step, so where two "
                               "tokens nearly tie the pick can flip (docs/internals.md, bf16 and lossless). For "
                               "token-exact output run the target in float32: LAYERSCOPE_DTYPE=float32."))
    elif ours:
        out.append(("error", f"Outputs differ from plain greedy decoding for {', '.join(ours)}. This is a bug in the "
                             "decoder; please report it with the session file."))
    if theirs:
        out.append(("warning", f"Outputs of transformers' decoders differ from plain greedy decoding for "
                               f"{', '.join(theirs)}. In {res['dtype']} transformers computes a verification of "
                               "several tokens and a one-token step with different kernels, so a near-tie can flip; "
                               "LayerScope's decoders pad every forward to aligned rows and stay exact "
                               "(docs/internals.md, bf16 and lossless)."))
    for w in (sanity.collapse_warning(measured), sanity.budget_warning(measured)):
        if w:
            out.append(("warning", w))
    if res.get("machine"):
        out.append(("note" if res["machine"].get("quiet") else "warning", quietness.line(res["machine"])))
    out += [("note", f"Note: {w}.") for w in res.get("warnings") or []]
    out += [("warning", w) for w in sanity.bench_warnings(rows, int(res.get("prompts") or 0))]
    return out


def not_lossless(rows) -> list[str]:
    """The contenders whose output differed from plain greedy decoding (in float32 a decoder bug; in bfloat16 a near-tie
    can flip: run_warnings says which)."""
    return [r["name"] for r in rows if r.get("lossless") is False]


def acceptance_of(rows) -> tuple[dict, dict]:
    """{contender: acceptance per draft position} of the contenders that have it, and every contender's layers."""
    return ({r["name"]: r["acceptance_by_position"] for r in rows if r.get("acceptance_by_position")},
            {r["name"]: r.get("layers") for r in rows})


def category_frame(rows) -> pd.DataFrame | None:
    """τ, tokens/s and speedup per prompt category and contender; None unless the run had several categories."""
    cats = sorted({c for r in rows for c in (r.get("by_category") or {})})
    if len(cats) <= 1:
        return None
    return pd.DataFrame([{"category": c, "contender": r["name"], "τ": fmt.tau(r["by_category"][c].get("tau")),
                          "tokens/s": fmt.number(r["by_category"][c].get("tokens_per_s"), 1),
                          "speedup": fmt.speedup(r["by_category"][c].get("speedup"))}
                         for c in cats for r in rows if c in (r.get("by_category") or {})])


# ---------------------------------------------------------------------------- the study

def study_label(study: list[dict], i: int) -> str:
    """How study `i` of the session reads in its picker: number, sets, prompts, when."""
    return f"#{i + 1} · {len(study[i]['rows'])} sets · {study[i].get('prompts')} prompts · {fmt.when(study[i].get('created'))}"


def study_heading(res: dict, i: int, total: int) -> str:
    """One line on what study `i` of `total` ran: sets, training budget, prompts, depth, device, when (plain text)."""
    rows, o = res["rows"], res.get("options") or {}
    budget = (f"online training, {', '.join(f'{k} {v}' for k, v in online_settings(o['online']).items())}"
              if o.get("online") else f"{(o.get('train') or {}).get('steps')} training steps each")
    return (f"{'Latest study' if i == total - 1 else f'Study #{i + 1}'}: {len(rows)} sets · "
            f"{budget} · {res['prompts']} {o.get('prompts', '')} prompts × {o.get('max_new_tokens')} "
            f"tokens · K = {o.get('depth')} · {res.get('device', '')}"
            + (f" · {fmt.when(res['created'])}" if res.get("created") else ""))


def study_frame(rows, layer_sets) -> pd.DataFrame:
    """A study's table: one row per set with τ, its difference to the default rule, the proxies and a collapse flag."""
    flags = sanity.collapse_reasons(rows)
    return pd.DataFrame([{"set": set_label(r["strategies"], r["layers"], layer_sets), "layers": fmt.layers(r["layers"]),
                          "τ": fmt.interval(r.get("tau"), r.get("tau_ci"), "tau"),
                          "Δτ vs default": fmt.interval(r.get("delta_vs_default"), r.get("delta_ci"), "delta"),
                          "seed range": fmt.tau(r.get("tau_seed_range")) if len(r.get("seeds") or []) > 1 else "",
                          "speedup": fmt.interval(r.get("speedup"), r.get("speedup_ci"), "speedup"),
                          "held-out agreement @1": fmt.percent(sanity.agreement(r.get("val_accuracy"))),
                          "simulated_acc_len": fmt.number(simulated_of(r.get("val_accuracy"))),
                          "mean entropy": fmt.number(r["mean_entropy"]),
                          "mean CKA": fmt.number(r["mean_cka"]) if len(r["layers"]) > 1 else fmt.NOT_APPLICABLE,
                          "aggregate entropy": fmt.number(r["aggregate_entropy"]),
                          "lossless": r.get("lossless"), "flag": flag or ""} for r, flag in zip(rows, flags)])


def correlations_frame(res: dict) -> pd.DataFrame | None:
    """Each proxy version's Spearman ρ with τ and whether it is the proxy's best version; None without any."""
    if not res.get("correlations"):
        return None
    best = {p: c.get("version") for p, c in (res.get("best_proxies") or {}).items()}
    return pd.DataFrame([{"proxy": fmt.name(c["proxy"]), "version": c["version"],
                          "Spearman ρ with τ": fmt.interval(c["rho"], c.get("ci"), "delta"),
                          "best version": best.get(c["proxy"]) == c["version"]}
                         for c in res["correlations"]])


def study_curves(rows, layer_sets) -> tuple[dict, dict]:
    """The first training seed's learning curve of every set that has one, and every set's layers, by set label."""
    curves = {set_label(r["strategies"], r["layers"], layer_sets): (r.get("seeds") or [{}])[0].get("curve") for r in rows}
    return ({name: c for name, c in curves.items() if c},
            {set_label(r["strategies"], r["layers"], layer_sets): r["layers"] for r in rows})


def spearman_text(corr: dict) -> str:
    """The study's Spearman correlations with τ over the sets, "mean entropy +0.400 · ..." (plain text)."""
    return " · ".join(f"{fmt.name(name)} {'n/a' if v is None else fmt.delta(v)}" for name, v in corr.items())


def study_bench_rows(rows, layer_sets) -> list[dict]:
    """A study's sets as contenders of the τ and speedup chart (plots.bench_comparison)."""
    return [{"name": set_label(r["strategies"], r["layers"], layer_sets), "layers": r["layers"], "tau": r.get("tau"),
             "tau_ci": r.get("tau_ci"), "speedup": r.get("speedup"), "speedup_ci": r.get("speedup_ci")} for r in rows]
