"""The study's statistics: paired error bars over prompts, seed spread, proxy correlations, a verdict.

    runs = bench.prompt_runs(entry, baseline)      # per-prompt totals of a bench entry, one per (set, seed)
    sets = compare_sets(runs_by_set, reference=0)       # τ, acceptance, speedup with intervals, Δ vs reference
    corr = correlate(proxies_by_set, sets, PROXIES)    # Spearman ρ of every proxy version with τ, with intervals
    text = verdict(rows, reference, corr)              # plain words

Every set decodes the same prompts in the same benchmark run, so every comparison is paired: one set
of resampled prompt indices (`bootstrap.resample`) is applied to every set, and the interval
of a difference comes from the differences under the same resamples. A set's statistic is the mean
over its training seeds of that seed's ratio of sums over the prompts (so with one seed τ is exactly
the benchmark's τ). Intervals are 95% percentile intervals of 2000 resamples (`bootstrap.LEVEL`,
`bootstrap.DRAWS`). They cover prompt sampling, not training noise: that is what the seed spread
(`tau_seed_range`, the max − min of τ over seeds) shows.

A proxy's ρ with τ gets its interval by resampling the sets and the prompts together (so it covers
both which sets happened to be studied and the noise in their τ).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from layerscope import fmt
from layerscope.stats import bootstrap as B
from layerscope.stats.correlation import spearman, spearman_rows

METRICS = ("tau", "acceptance", "speedup")
# The direction in which each proxy is expected to predict τ: more information, less redundancy.
PROXY_SIGN = {"mean_entropy": 1, "mean_cka": -1, "aggregate_entropy": 1, "val_accuracy@1": 1, "probe": 1}


@dataclass
class PromptRuns:
    """Per-prompt totals of one draft and of plain decoding in the same benchmark run (lists of length P)."""

    tokens: list[int]           # tokens produced
    forwards: list[int]         # target forwards (prefill included)
    seconds: list[float]        # decoding time (engine step times)
    drafted: list[int]          # draft tokens verified
    accepted: list[int]         # ... of those accepted
    base_tokens: list[int]      # plain (autoregressive) decoding of the same prompt, same run
    base_seconds: list[float]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "PromptRuns":
        runs = cls(**{k: list(d[k]) for k in cls.__dataclass_fields__})
        assert len({len(v) for v in asdict(runs).values()}) == 1, "per-prompt lists of different lengths"
        return runs

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in asdict(self).items()}


def _per_seed(runs: list[PromptRuns]) -> dict[str, torch.Tensor]:
    """Stack one set's runs: each column [S, P]."""
    ts = [r.tensors() for r in runs]
    return {k: torch.stack([t[k] for t in ts]) for k in ts[0]}


def _metrics(t: dict[str, torch.Tensor], idx: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """τ, acceptance, speedup per seed: [S] (idx None) or [B, S] (resampled prompts)."""
    tps = B.ratio_of_sums(t["tokens"], t["seconds"], idx)
    base = B.ratio_of_sums(t["base_tokens"], t["base_seconds"], idx)
    return {"tau": B.ratio_of_sums(t["tokens"], t["forwards"], idx),
            "acceptance": B.ratio_of_sums(t["accepted"], t["drafted"], idx),
            "speedup": tps / base}


def _num(x) -> float | None:
    x = float(x)
    return x if x == x and abs(x) != float("inf") else None


def compare_sets(runs_by_set: list[list[PromptRuns]], reference: int = 0, *, draws: int = B.DRAWS,
                 level: float = B.LEVEL, seed: int = 0) -> tuple[list[dict], torch.Tensor]:
    """Statistics of every set (a list of PromptRuns per set, one per training seed, same prompts).

    Returns (one dict per set, τ under each resample [draws, sets]). Each dict has, for m in METRICS:
    m, m_ci [lo, hi]; delta_vs_default, delta_ci (τ minus the reference set's τ, paired);
    paired {m: {"delta", "ci"}} for all three metrics; seeds [{tau, acceptance, speedup}] per seed;
    tau_seed_range (max − min over seeds), tau_seed_sd (0 with one seed).
    """
    prompts = {len(r.tokens) for runs in runs_by_set for r in runs}
    if len(prompts) != 1:
        raise ValueError(f"every run must cover the same prompts, got lengths {sorted(prompts)}")
    if not 0 <= reference < len(runs_by_set):
        raise ValueError(f"reference {reference} is not one of the {len(runs_by_set)} sets")
    idx = B.resample(prompts.pop(), draws, seed)
    point, boot = [], []
    for runs in runs_by_set:
        t = _per_seed(runs)
        point.append(_metrics(t, None))                                   # m -> [S]
        boot.append({m: v.mean(-1) for m, v in _metrics(t, idx).items()})  # m -> [B], mean over seeds
    out = []
    for s, (p, b) in enumerate(zip(point, boot)):
        row = {}
        for m in METRICS:
            row[m] = _num(p[m].mean())
            row[f"{m}_ci"] = B.interval(b[m], level)
        paired = {}
        for m in METRICS:
            diff = b[m] - boot[reference][m]
            paired[m] = {"delta": _num(p[m].mean() - point[reference][m].mean()), "ci": B.interval(diff, level)}
        row["delta_vs_default"], row["delta_ci"] = paired["tau"]["delta"], paired["tau"]["ci"]
        row["paired"] = paired
        row["seeds"] = [{m: _num(p[m][i]) for m in METRICS} for i in range(p["tau"].numel())]
        taus = p["tau"]
        row["tau_seed_range"] = _num(taus.max() - taus.min())
        row["tau_seed_sd"] = _num(taus.std()) if taus.numel() > 1 else 0.0
        out.append(row)
    return out, torch.stack([b["tau"] for b in boot], dim=1)


def significant(ci: list[float] | None) -> bool:
    """An interval that excludes 0."""
    return ci is not None and (ci[0] > 0 or ci[1] < 0)


def correlate(proxies: list[dict[str, dict[str, float | None]]], taus: list[float], tau_boot: torch.Tensor,
              *, draws: int = B.DRAWS, level: float = B.LEVEL, seed: int = 1) -> list[dict]:
    """Spearman ρ between τ and every version of every proxy, with a bootstrap interval.

    proxies[s][version][proxy]: the value of a proxy for set s under one version of the statistics
    (e.g. version "linear, H≥0.5"). taus [S]: the sets' τ; tau_boot [draws, S]: their τ under the
    prompt resamples of `compare_sets`. The interval resamples the sets (with replacement) on top.
    Returns [{"proxy", "version", "rho", "ci", "sets"}], in the order the versions and proxies come.
    """
    n = len(taus)
    g = torch.Generator().manual_seed(int(seed))
    rows = torch.randint(0, n, (tau_boot.shape[0], n), generator=g)
    tb = tau_boot.gather(1, rows)
    out = []
    versions = list(proxies[0]) if proxies else []
    for version in versions:
        for proxy in proxies[0][version]:
            x = [p[version][proxy] for p in proxies]
            rho = spearman(x, taus)
            ci = None
            if rho is not None and None not in x:
                xb = torch.tensor(x, dtype=torch.float64)[rows]
                ci = B.interval(spearman_rows(xb, tb), level)
            out.append({"proxy": proxy, "version": version, "rho": rho, "ci": ci, "sets": n})
    return out


def best_versions(correlations: list[dict]) -> dict[str, dict]:
    """For each proxy, the version whose ρ with τ is strongest in the expected direction (PROXY_SIGN)."""
    best: dict[str, dict] = {}
    for c in correlations:
        if c["rho"] is None:
            continue
        sign = PROXY_SIGN.get(c["proxy"], 1)
        if c["proxy"] not in best or sign * c["rho"] > sign * best[c["proxy"]]["rho"]:
            best[c["proxy"]] = c
    return best


def _set_name(row: dict) -> str:
    return f"{'/'.join(row['strategies'])} {row['layers']}"


def verdict(rows: list[dict], reference: int, correlations: list[dict], *, prompts: int, seeds: int,
            level: float = B.LEVEL) -> str:
    """A few plain sentences: which set won and by how much, whether that beats the default rule
    beyond the paired interval and the seed spread, how the controls did, which proxy predicted τ.

    rows: the study rows (strategies, layers, tau, tau_ci, delta_vs_default, delta_ci, tau_seed_range).
    """
    pct = f"{level:.0%}"
    ref = rows[reference]
    scored = [r for r in rows if r.get("tau") is not None]
    if not scored:
        return "No set produced a τ; nothing to compare."
    best = max(scored, key=lambda r: r["tau"])
    spread = max((r.get("tau_seed_range") or 0.0) for r in scored)
    seed_note = f"{seeds} training seed{'s' if seeds != 1 else ''}"
    basis = f"paired {pct} bootstrap over {prompts} prompts, {seed_note}"
    lines = []
    if best is ref or best["delta_vs_default"] is None or best["delta_vs_default"] <= 0:
        others = [r for r in scored if r is not ref]
        runner = max(others, key=lambda r: r["tau"]) if others else None
        text = f"No set beat the default rule {ref['layers']} (τ {ref['tau']:.3f}, {pct} interval {fmt.ci(ref['tau_ci'], 'tau')})"
        if runner is not None:
            text += (f"; the closest, {_set_name(runner)}, was {abs(runner['delta_vs_default']):.3f} lower "
                     f"(difference {runner['delta_vs_default']:+.3f}, interval {fmt.ci(runner['delta_ci'], 'delta')})")
        lines.append(text + f" ({basis}).")
    elif significant(best["delta_ci"]):
        tied = [r for r in scored if r is not best and r["tau"] == best["tau"]]
        won = f"{_set_name(best)} won" + (f" (tied with {', '.join(_set_name(r) for r in tied)})" if tied else "")
        text = (f"{won}: τ {best['tau']:.3f} {fmt.ci(best['tau_ci'], 'tau')}, {best['delta_vs_default']:+.3f} "
                f"{fmt.ci(best['delta_ci'], 'delta')} against the default rule {ref['layers']} (τ {ref['tau']:.3f}); "
                f"the difference is significant ({basis})")
        if seeds > 1 and spread >= abs(best["delta_vs_default"]):
            text += (f", but retraining with another seed moves a set's τ by up to {spread:.3f}, as much as the "
                     f"difference, so treat it as tentative")
        elif seeds == 1:
            text += "; with one training seed, training noise is not measured"
        lines.append(text + ".")
    else:
        lines.append(f"No difference at this budget: the best set, {_set_name(best)} (τ {best['tau']:.3f}), is "
                     f"{best['delta_vs_default']:+.3f} {fmt.ci(best['delta_ci'], 'delta')} against the default rule "
                     f"{ref['layers']}, an interval that includes 0 ({basis}).")
    better = [r for r in scored if r is not ref and r is not best and r["delta_ci"] and r["delta_ci"][0] > 0]
    if better and significant(best["delta_ci"]):
        lines.append("Also significantly above the default: " + ", ".join(_set_name(r) for r in better) + ".")
    worse = [r for r in scored if r is not ref and r["delta_ci"] and r["delta_ci"][1] < 0]
    if worse:
        lines.append("Significantly below the default: " + ", ".join(_set_name(r) for r in worse) + ".")
    controls = [r for r in scored if any(s.split("#")[0] in ("random", "last-k", "single") for s in r["strategies"])]
    if controls:
        lines.append("Controls: " + "; ".join(f"{_set_name(r)} τ {r['tau']:.3f} ({r['delta_vs_default']:+.3f})"
                                             for r in controls) + ".")
    lines.extend(proxy_verdict(correlations, level))
    return " ".join(lines)


def proxy_verdict(correlations: list[dict], level: float = B.LEVEL) -> list[str]:
    """Which proxy predicts τ: the strongest ρ in the expected direction (PROXY_SIGN) among those whose
    interval excludes 0 on that side, named only then; otherwise it says that none does. A proxy whose
    interval excludes 0 on the other side is said apart."""
    usable = [c for c in correlations if c["rho"] is not None]
    if not usable:
        return ["Too few distinct sets to correlate the proxies with τ."]
    sign = lambda c: PROXY_SIGN.get(c["proxy"], 1)  # noqa: E731
    what = lambda c: f"{c['proxy']} ({c['version']}): ρ = {c['rho']:+.2f}, interval {fmt.ci(c['ci'], 'delta')}"  # noqa: E731
    side = lambda c: sorted(sign(c) * x for x in c["ci"])  # noqa: E731  (the interval, expected direction > 0)
    reliable = [c for c in usable if c["ci"] is not None and side(c)[0] > 0]
    against = [c for c in usable if c["ci"] is not None and side(c)[1] < 0]
    sets = max(c["sets"] for c in usable)
    if reliable:
        top = max(reliable, key=lambda c: sign(c) * c["rho"])
        out = [f"Best predictor of τ: {what(top)} over {top['sets']} sets."]
    else:
        out = [f"No proxy predicted τ reliably: none of the {len(usable)} correlations (proxy versions over {sets} "
               f"sets) has a {level:.0%} interval that excludes 0 in the expected direction."]
    if against:
        out.append("Against the expected direction beyond its interval: " + "; ".join(what(c) for c in against) + ".")
    return out
