"""Honest numbers for the Speculative decoding page: warnings when results cannot mean what they seem to,
and a study's cost before it starts. Plain data in, sentences out; no Streamlit here."""

from __future__ import annotations

import statistics

FEW_PROMPTS = 10          # below this τ and speedup move a lot from one prompt set to the next
FEW_SETS = 5              # a Spearman correlation over fewer sets is anecdote


def _fmt_seconds(s: float) -> str:
    s = max(0.0, float(s))
    if s < 90:
        return f"{s:.0f} s"
    m = s / 60
    return f"{m:.0f} min" if m < 90 else f"{m / 60:.1f} h"


def implausible_speedups(rows) -> list[str]:
    """Drafts whose speedup exceeds their τ: a speculative step costs at least one target forward, so the
    speedup over plain decoding is at most τ; more is timing noise."""
    out = []
    for r in rows:
        tau, speed = r.get("tau"), r.get("speedup")
        if r.get("layers") and tau and speed and speed > 1.05 * tau:
            out.append(f"{r['name']}: speedup {speed:.2f}× with τ {tau:.2f}")
    return out


def bench_warnings(rows, prompts: int) -> list[str]:
    out = []
    bad = implausible_speedups(rows)
    if bad:
        out.append("Speedup above τ is not possible (each step still runs the target once): "
                   + "; ".join(bad) + ". The timings were disturbed by other work on this machine; rerun on a quiet "
                   "machine or with more prompts.")
    if 0 < prompts < FEW_PROMPTS:
        out.append(f"Only {prompts} prompt(s): τ and speedup change a lot from one prompt to the next; compare drafts "
                   f"on at least {2 * FEW_PROMPTS} held-out prompts before drawing a conclusion.")
    return out


def study_warnings(rows, prompts: int) -> list[str]:
    out = []
    taus = [round(r["tau"], 3) for r in rows if r.get("tau") is not None]
    if len(rows) < FEW_SETS:
        out.append(f"The correlations are over {len(rows)} sets: with fewer than {FEW_SETS}, a Spearman value says "
                   "almost nothing (any order of 3 sets has a 1 in 6 chance).")
    elif len(set(taus)) <= 2:
        out.append(f"Only {len(set(taus))} distinct τ value(s) among {len(taus)} sets: the ranks are mostly ties and the "
                   "correlations are not meaningful. Train longer or benchmark more prompts.")
    out += bench_warnings(rows, prompts)
    return out


def study_cost(plan, options, stored_drafts, bench_results) -> str:
    """One sentence: what the study will run and, from timings measured on this machine, about how long."""
    n = len(plan)
    steps = int((options.train or {}).get("steps") or 0)
    contenders = n + 1
    work = (f"{n} drafts × {steps} training steps, then {options.limit} prompts × {options.max_new_tokens} tokens "
            f"× {contenders} decoders (plain decoding and one per draft)")
    rates = [d["seconds"] / d["steps"] for d in stored_drafts if d.get("seconds") and d.get("steps")]
    plain = [r.get("tokens_per_s") for b in bench_results for r in (b.get("results") or [])
             if r.get("name") == "autoregressive" and r.get("tokens_per_s")]
    if not rates:
        return (f"Estimated cost: {work}. No draft has been trained for this model on this machine yet, so there is "
                "no time estimate: train one draft above first. Sets already trained with these options come from the "
                "store at no cost.")
    per_step = statistics.median(rates)
    train_s = n * steps * per_step
    text = (f"Estimated cost: {work}; training about {_fmt_seconds(train_s)} ({per_step:.2f} s a step, the median of "
            f"{len(rates)} draft(s) trained for this model here)")
    if plain:
        bench_s = options.limit * options.max_new_tokens * contenders / plain[-1]
        text += f", the benchmark about {_fmt_seconds(bench_s)} (at {plain[-1]:.0f} tokens/s, the last plain decoding)"
    return text + ". Sets already trained with these options come from the store at no cost."
