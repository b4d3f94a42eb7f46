"""Honest numbers for the Speculative decoding page: warnings when results cannot mean what they seem to (a
step's cost before it starts is layerscope/steps/forecast.py's). Plain data in, sentences out; no Streamlit here."""

from __future__ import annotations

from layerscope import fmt

FEW_PROMPTS = 10          # below this τ and speedup move a lot from one prompt set to the next
ENOUGH_PROMPTS = 2 * FEW_PROMPTS   # what a comparison of drafts should use (BenchOptions.limit's default)
FEW_SETS = 5              # a Spearman correlation over fewer sets is anecdote
BUDGET_RATIO = 1.5        # drafts whose training tokens differ by more than this factor compare budgets, not layers
UNTRAINED_AGREEMENT = 0.02   # held-out agreement at draft position 1 below this: the draft predicts next to nothing
LOW_AGREEMENT = 0.05      # below this floor a draft has barely learned, whatever the others reach
FAR_BELOW = 0.25          # ... and below this share of the best other draft's agreement it is far behind them
SAME_TAU = 3              # this many drafts reading different layers at exactly one τ: they ignore their layers


def implausible_speedups(rows) -> list[str]:
    """Drafts whose speedup exceeds their τ: a speculative step costs at least one target forward, so the
    speedup over plain decoding is at most τ; more is timing noise."""
    out = []
    for r in rows:
        tau, speed = r.get("tau"), r.get("speedup")
        if r.get("layers") and tau and speed and speed > 1.05 * tau:
            out.append(f"{r['name']}: speedup {speed:.2f}× with τ {tau:.2f}")
    return out


def per_step(val_accuracy) -> list[float]:
    """A draft's held-out agreement per TTT step as a list, from its val_accuracy: a list per step, or one number
    (older records: position 1 alone), or nothing ([])."""
    if isinstance(val_accuracy, (list, tuple)):
        return [float(a) for a in val_accuracy if not fmt.missing(a)]
    return [] if fmt.missing(val_accuracy) else [float(val_accuracy)]


def agreement(val_accuracy) -> float | None:
    """Held-out agreement at the first draft position, from a draft's val_accuracy (a list per TTT step, or one number)."""
    steps = per_step(val_accuracy)
    return steps[0] if steps else None


def _same(values) -> dict:
    """{value: [row indices]} for values shared by rows (None left out)."""
    groups: dict = {}
    for i, v in enumerate(values):
        if v is not None:
            groups.setdefault(v, []).append(i)
    return groups


def collapse_reasons(rows) -> list[str | None]:
    """Why each draft may not have learned, or None. rows: [{"layers", "tau"?, "val_accuracy"?}] (drafts, benchmark
    rows of drafts, study rows). A draft is flagged when its held-out agreement is about 0, below LOW_AGREEMENT, or
    below FAR_BELOW of the best other draft's, when it accepted no draft
    token at all (τ exactly 1), when SAME_TAU or more drafts reading different layers reach exactly the same τ, or
    when drafts reading different layers have exactly the same held-out agreement: a draft that uses its layers
    differs from one that reads others, so exact ties say the drafts ignore their layers (collapsed to one answer)."""
    out: list[list[str]] = [[] for _ in rows]
    accs = [agreement(r.get("val_accuracy")) for r in rows]
    for i, r in enumerate(rows):
        a = accs[i]
        best_other = max((x for j, x in enumerate(accs) if j != i and x is not None), default=None)
        if a is not None and a < UNTRAINED_AGREEMENT:
            out[i].append(f"held-out agreement {fmt.percent(a)} ≈ 0: it has not learned to predict the target")
        elif a is not None and best_other is not None and a < FAR_BELOW * best_other:
            out[i].append(f"held-out agreement {fmt.percent(a)}, far below the best other draft's "
                          f"{fmt.percent(best_other)}: it is undertrained (a smaller budget?) or broken")
        elif a is not None and a < LOW_AGREEMENT:
            out[i].append(f"held-out agreement {fmt.percent(a)}, below {fmt.percent(LOW_AGREEMENT)}: it has barely "
                          "learned to predict the target")
        if r.get("tau") is not None and round(float(r["tau"]), 6) == 1.0:
            out[i].append("τ exactly 1: the target accepted none of its tokens")
    taus = [round(float(r["tau"]), 4) if r.get("tau") is not None and r.get("layers") else None for r in rows]
    for tau, idx in _same(taus).items():
        if len(idx) >= SAME_TAU and tau != 1.0 and len({tuple(rows[i]["layers"]) for i in idx}) == len(idx):
            for i in idx:
                out[i].append(f"τ exactly {fmt.tau(tau)}, as {len(idx) - 1} other drafts reading other layers: "
                              "they probably ignore their layers (collapsed)")
    accs = [tuple(round(float(v), 4) for v in r["val_accuracy"]) if isinstance(r.get("val_accuracy"), (list, tuple))
            and r["val_accuracy"] and all(not fmt.missing(v) for v in r["val_accuracy"]) else None for r in rows]
    for acc, idx in _same(accs).items():
        if len(idx) >= 2 and acc[0] >= UNTRAINED_AGREEMENT and len({tuple(rows[i]["layers"]) for i in idx}) == len(idx):
            for i in idx:
                out[i].append(f"exactly the same held-out agreement ({fmt.percent(acc[0])}) as {len(idx) - 1} "
                              "draft(s) reading other layers: they probably ignore their layers (collapsed)")
    return ["; ".join(x) if x else None for x in out]


def collapse_warning(rows, what: str = "drafts") -> str | None:
    """One sentence for the page when any of `rows` is flagged by `collapse_reasons`, naming them."""
    reasons = collapse_reasons(rows)
    flagged = [(r, why) for r, why in zip(rows, reasons) if why]
    if not flagged:
        return None
    labels = [f"{r.get('name') or '/'.join(r.get('strategies') or []) or 'draft'} {fmt.layers(r.get('layers'))}"
              for r, _ in flagged]
    # each one's own reason (its own agreement), not the first one's for all of them
    said = flagged[0][1] if len(flagged) == 1 else "; ".join(f"{label}: {why}" for label, (_, why) in zip(labels, flagged))
    return (f"{len(flagged)} of {len(rows)} {what} may not have learned ({', '.join(labels)}): "
            + said + ". Their τ says nothing about their layer sets; train longer or on more data "
            "(online training), then compare again.")


def different_budgets(rows) -> bool:
    """Whether the drafts `rows` ([{"tokens", ...}]; unknown tokens left out) were trained on budgets more than
    BUDGET_RATIO apart."""
    known = [int(r["tokens"]) for r in rows if r.get("tokens")]
    return len(known) >= 2 and max(known) > BUDGET_RATIO * min(known)


def budgets_text(rows) -> str:
    """'default [2, 15, 27] 1,250,000, greedy [1, 9, 20] 17,000' (training tokens) of the drafts with a known budget."""
    return ", ".join(f"{r.get('name') or 'draft'} {fmt.layers(r.get('layers'))} {fmt.count(r['tokens'])}"
                     for r in rows if r.get("tokens"))


def budget_warning(rows) -> str | None:
    """A sentence when the drafts `rows` ([{"name", "layers", "tokens"}]) were trained on different budgets."""
    if not different_budgets(rows):
        return None
    return (f"The drafts compared were trained on different budgets ({budgets_text(rows)} training tokens): a "
            "difference in τ or agreement may be the budget's, not the layers'. Train them on one budget (the study "
            "does) to compare layer sets.")


def bench_warnings(rows, prompts: int) -> list[str]:
    out = []
    bad = implausible_speedups(rows)
    if bad:
        out.append("Speedup above τ is not possible (each step still runs the target once): "
                   + "; ".join(bad) + ". The timings were disturbed by other work on this machine; rerun on a quiet "
                   "machine or with more prompts.")
    if 0 < prompts < FEW_PROMPTS:
        out.append(f"Only {prompts} prompt(s): τ and speedup change a lot from one prompt to the next; compare drafts "
                   f"on at least {ENOUGH_PROMPTS} held-out prompts before drawing a conclusion.")
    return out


def study_warnings(rows, prompts: int) -> list[str]:
    out = []
    collapsed = collapse_warning(rows, "sets")
    if collapsed:
        out.append(collapsed)
    taus = [round(r["tau"], 3) for r in rows if r.get("tau") is not None]
    if len(rows) < FEW_SETS:
        out.append(f"The correlations are over {len(rows)} sets: with fewer than {FEW_SETS}, a Spearman value says "
                   "almost nothing (any order of 3 sets has a 1 in 6 chance).")
    elif len(set(taus)) <= 2:
        out.append(f"Only {len(set(taus))} distinct τ value(s) among {len(taus)} sets: the ranks are mostly ties and the "
                   "correlations are not meaningful. Train longer or benchmark more prompts.")
    out += bench_warnings(rows, prompts)
    return out
