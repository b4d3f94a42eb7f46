"""The study's statistics: bootstrap coverage, paired differences, seed spread, correlations, verdict."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerscope import fmt
from layerscope.decoding.bench import Tally, per_prompt_totals, prompt_runs
from layerscope.decoding.specdec import StepEvent
from layerscope.stats import bootstrap as B
from layerscope.stats.correlation import spearman, spearman_rows
from layerscope.stats.paired import PromptRuns, best_versions, compare_sets, correlate, significant, verdict
from layerscope.study.effect import effect_rows, format_effect, pair_folders
from layerscope.study.outcomes import Outcome, OutcomeError, OutcomeFolder
from layerscope.ui import plots


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_bootstrap_intervals_cover_the_known_mean_at_about_the_nominal_rate():
    """300 synthetic samples of 40 prompts from N(2, 1): the 95% interval of the mean (the study's
    ratio of sums with unit denominators) should hold 2.0 about 95% of the time (percentile
    intervals run a little short at n = 40: about 93%)."""
    trials, n = 300, 40
    x = 2.0 + torch.randn(trials, n, generator=gen(0), dtype=torch.float64)
    idx = B.resample(n, 1000, seed=1)
    boot = B.ratio_of_sums(x, torch.ones_like(x), idx)                  # [1000, trials]
    assert boot.shape == (1000, trials)
    assert torch.allclose(B.ratio_of_sums(x, torch.ones_like(x)), x.mean(1))
    cis = [B.interval(boot[:, t]) for t in range(trials)]
    coverage = sum(lo <= 2.0 <= hi for lo, hi in cis) / trials
    assert 0.90 <= coverage <= 0.98, coverage
    # and a 50% interval covers about half the time: the rate follows the level
    half = sum(lo <= 2.0 <= hi for lo, hi in (B.interval(boot[:, t], 0.5) for t in range(trials))) / trials
    assert 0.38 <= half <= 0.62, half


def test_ratio_of_sums_interval_covers_a_known_tau():
    """τ-like data: per-prompt forwards vary, tokens = forwards × 1.5 + noise, population τ = 1.5."""
    trials, n = 200, 40
    forwards = torch.randint(10, 60, (trials, n), generator=gen(2)).double()
    tokens = forwards * 1.5 + torch.randn(trials, n, generator=gen(3), dtype=torch.float64) * forwards.sqrt()
    boot = B.ratio_of_sums(tokens, forwards, B.resample(n, 1000, seed=4))
    coverage = sum(lo <= 1.5 <= hi for lo, hi in (B.interval(boot[:, t]) for t in range(trials))) / trials
    assert 0.88 <= coverage <= 0.99, coverage


def runs(tokens, forwards, seconds=None, drafted=None, accepted=None, base_tokens=None, base_seconds=None):
    p = len(tokens)
    return PromptRuns(tokens=list(tokens), forwards=list(forwards), seconds=list(seconds or [1.0] * p),
                      drafted=list(drafted or [2 * f for f in forwards]), accepted=list(accepted or [t - f for t, f in zip(tokens, forwards)]),
                      base_tokens=list(base_tokens or tokens), base_seconds=list(base_seconds or [1.2] * p))


def synthetic_sets(p=40, gain=0.05, seed=5):
    """Three sets on the same prompts: prompt difficulty shared (large), set B = A plus a small gain."""
    g = gen(seed)
    forwards = torch.randint(20, 40, (p,), generator=g).double()
    hard = 1.2 + 0.6 * torch.rand(p, generator=g, dtype=torch.float64)            # per-prompt τ of set A
    a = (forwards * hard).round()
    b = (forwards * (hard + gain)).round()
    noise = (forwards * (hard + 0.3 * (torch.rand(p, generator=g) - 0.5))).round()
    f = forwards.int().tolist()
    return runs(a.int().tolist(), f), runs(b.int().tolist(), f), runs(noise.int().tolist(), f)


def test_paired_difference_of_a_set_with_itself_is_exactly_zero():
    a, b, c = synthetic_sets()
    rows, tau_boot = compare_sets([[a], [a], [b], [c]], reference=0, draws=500)
    assert tau_boot.shape == (500, 4)
    for row in rows[:2]:
        assert row["delta_vs_default"] == 0.0 and row["delta_ci"] == [0.0, 0.0]
        for m in ("tau", "acceptance", "speedup"):
            assert row["paired"][m] == {"delta": 0.0, "ci": [0.0, 0.0]}
    assert rows[0]["tau"] == pytest.approx(sum(a.tokens) / sum(a.forwards), abs=1e-12)   # the pooled τ


def test_pairing_sees_a_small_gain_that_separate_intervals_miss():
    a, b, _ = synthetic_sets(gain=0.02)
    rows, _ = compare_sets([[a], [b]], reference=0)
    ra, rb = rows
    assert ra["tau_ci"][0] < rb["tau"] < ra["tau_ci"][1]            # B's τ lies inside A's own interval ...
    assert significant(rb["delta_ci"]) and rb["delta_ci"][0] > 0    # ... yet the paired difference is clear
    assert rb["delta_vs_default"] == pytest.approx(rb["tau"] - ra["tau"], abs=1e-12)
    assert rb["delta_ci"][1] - rb["delta_ci"][0] < (ra["tau_ci"][1] - ra["tau_ci"][0]) / 3


def test_seeds_average_and_spread():
    a, b, c = synthetic_sets()
    rows, _ = compare_sets([[a, b], [a, a]], reference=1, draws=300)
    two = rows[0]
    ta, tb = sum(a.tokens) / sum(a.forwards), sum(b.tokens) / sum(b.forwards)
    assert two["tau"] == pytest.approx((ta + tb) / 2, abs=1e-12)
    assert [s["tau"] for s in two["seeds"]] == pytest.approx([ta, tb], abs=1e-12)
    assert two["tau_seed_range"] == pytest.approx(tb - ta, abs=1e-12) and two["tau_seed_sd"] > 0
    assert rows[1]["tau_seed_range"] == 0.0 and rows[1]["delta_ci"] == [0.0, 0.0]
    assert two["speedup"] == pytest.approx((sum(a.tokens) / 40 + sum(b.tokens) / 40) / 2 / (sum(a.tokens) / 48), rel=0.05)
    with pytest.raises(ValueError, match="same prompts"):
        compare_sets([[a], [runs([1, 2], [1, 1])]])


def test_prompt_runs_from_bench_per_prompt_totals():
    """bench.run keeps a Tally per (contender, prompt); bench.prompt_runs turns an entry's into PromptRuns."""
    def ev(tokens, drafted, accepted):
        return StepEvent(0, drafted, accepted, (True,) * accepted + (False,) * (drafted - accepted), tokens[-1],
                         tuple(tokens), 0.5)

    events = {"autoregressive": [[ev([1], 0, 0), ev([2], 0, 0)], [ev([4], 0, 0)]],
              "d": [[ev([1], 0, 0), ev([2, 3], 2, 1)], [ev([4, 5, 6], 2, 2)]]}
    entries = {}
    for name, per_prompt in events.items():
        tallies = [Tally() for _ in per_prompt]
        for t, evs in zip(tallies, per_prompt):
            for e in evs:
                t.add_event(e)
        entries[name] = {"name": name, "per_prompt": per_prompt_totals(tallies)}
    r = prompt_runs(entries["d"], entries["autoregressive"])
    assert r.tokens == [3, 3] and r.forwards == [2, 1] and r.drafted == [2, 2] and r.accepted == [1, 2]
    assert r.base_tokens == [2, 1] and r.seconds == [1.0, 0.5] and r.base_seconds == [1.0, 0.5]
    assert PromptRuns.from_json(r.to_json()) == r


def test_batched_spearman_equals_the_reference():
    g = gen(6)
    a = torch.randint(0, 4, (50, 7), generator=g).double()          # many ties
    b = torch.randn(50, 7, generator=g, dtype=torch.float64)
    got = spearman_rows(a, b)
    for i in range(50):
        want = spearman(a[i].tolist(), b[i].tolist())
        assert (want is None and torch.isnan(got[i])) or got[i].item() == pytest.approx(want, abs=1e-12)


def test_correlations_intervals_and_best_version():
    taus = [1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]
    tau_boot = torch.tensor(taus, dtype=torch.float64).expand(400, 7) + \
        0.01 * torch.randn(400, 7, generator=gen(7), dtype=torch.float64)
    proxies = [{"linear, H≥0.5": {"aggregate_entropy": t * 2, "mean_cka": 1 - t},
                "cosine, H≥0.5": {"aggregate_entropy": [3, 1, 2, 5, 4, 7, 6][i], "mean_cka": 0.5}}
               for i, t in enumerate(taus)]
    corr = correlate(proxies, taus, tau_boot)
    by = {(c["version"], c["proxy"]): c for c in corr}
    top = by[("linear, H≥0.5", "aggregate_entropy")]
    assert top["rho"] == pytest.approx(1.0) and top["ci"][0] > 0.8 and top["sets"] == 7
    assert by[("linear, H≥0.5", "mean_cka")]["rho"] == pytest.approx(-1.0)
    assert by[("cosine, H≥0.5", "mean_cka")]["rho"] is None            # a constant proxy has no rank
    best = best_versions(corr)
    assert best["aggregate_entropy"]["version"] == "linear, H≥0.5"
    assert best["mean_cka"]["version"] == "linear, H≥0.5"               # expected sign: less redundancy


def row(strategies, layers, tau, ci, delta, dci, spread=0.0):
    return {"strategies": strategies, "layers": layers, "tau": tau, "tau_ci": ci, "delta_vs_default": delta,
            "delta_ci": dci, "tau_seed_range": spread}


def test_verdict_in_plain_words():
    ref = row(["default"], [2, 15, 27], 1.30, [1.27, 1.33], 0.0, [0.0, 0.0])
    win = row(["aggregate"], [3, 14, 28], 1.36, [1.33, 1.39], 0.06, [0.03, 0.09])
    rnd = row(["random#1"], [5, 9, 20], 1.25, [1.22, 1.28], -0.05, [-0.08, -0.02])
    corr = [{"proxy": "aggregate_entropy", "version": "linear, H≥0.5", "rho": 0.8, "ci": [0.3, 1.0], "sets": 3}]
    text = verdict([ref, win, rnd], 0, corr, prompts=40, seeds=2)
    assert text.startswith("aggregate [3, 14, 28] won: τ 1.360") and "significant" in text
    assert "Significantly below the default: random#1" in text and "Controls: random#1" in text
    assert "Best predictor of τ: aggregate_entropy (linear, H≥0.5)" in text
    noisy = verdict([ref, {**win, "tau_seed_range": 0.08}, rnd], 0, corr, prompts=40, seeds=2)
    assert "tentative" in noisy
    flat = verdict([ref, {**win, "delta_ci": [-0.01, 0.13]}], 0, [], prompts=40, seeds=2)
    assert flat.startswith("No difference at this budget") and "Too few distinct sets" in flat
    tie = row(["entropy-topk"], [18, 26, 27], 1.36, [1.33, 1.39], 0.06, [0.01, 0.11])
    also = row(["random#2"], [4, 6, 25], 1.33, [1.30, 1.36], 0.03, [0.005, 0.05])
    both = verdict([ref, win, tie, also], 0, corr, prompts=40, seeds=1)
    assert both.startswith("aggregate [3, 14, 28] won (tied with entropy-topk [18, 26, 27]): τ 1.360 [1.330, 1.390]")
    assert "Also significantly above the default: entropy-topk [18, 26, 27], random#2 [4, 6, 25]." in both
    lost = verdict([ref, rnd], 0, [{**corr[0], "ci": [-0.5, 1.0]}], prompts=40, seeds=1)
    assert lost.startswith("No set beat the default rule [2, 15, 27] (τ 1.300, 95% interval [1.270, 1.330])")
    assert "No proxy predicted τ reliably" in lost


def test_study_figures_show_intervals_seeds_and_proxies():
    rows = [{"strategies": ["default"], "layers": [2, 15, 27], "tau": 1.30, "tau_ci": [1.27, 1.33],
             "seeds": [{"tau": 1.29}, {"tau": 1.31}], "proxies": {"linear, H≥0.5": {"mean_entropy": 3.0,
                                                                                     "mean_cka": 0.4, "aggregate_entropy": 4.0}}},
            {"strategies": ["random#1"], "layers": [5, 9, 20], "tau": 1.25, "tau_ci": [1.20, 1.28],
             "seeds": [{"tau": 1.24}, {"tau": 1.26}], "proxies": {"linear, H≥0.5": {"mean_entropy": 2.5,
                                                                                     "mean_cka": 0.5, "aggregate_entropy": 3.5}}}]
    fig = plots.study_intervals(rows).to_dict()
    main, seeds = fig["data"]
    assert list(main["y"]) == [1.30, 1.25] and list(main["error_y"]["array"]) == pytest.approx([0.03, 0.03])
    assert list(main["error_y"]["arrayminus"]) == pytest.approx([0.03, 0.05]) and len(seeds["y"]) == 4
    assert any(s.get("y0") == 1.30 for s in fig["layout"]["shapes"])             # the default rule's line
    fig = plots.study_proxies(rows, "linear, H≥0.5").to_dict()
    assert [list(d["x"]) for d in fig["data"]] == [[3.0, 2.5], [0.4, 0.5], [4.0, 3.5]]
    assert all(list(d["y"]) == [1.30, 1.25] for d in fig["data"])
    # with the probe and the drafts' agreement: two more panels, each title with its rho and interval
    rows = [{**r, "probe": {"agreement": a}, "val_accuracy": [v, 0.1]} for r, a, v in zip(rows, (0.27, 0.25), (0.36, 0.33))]
    corr = [{"proxy": "mean_entropy", "version": "linear, H≥0.5", "rho": 0.5, "ci": [-0.2, 0.9]},
            {"proxy": "probe", "version": "held-out agreement", "rho": 1.0, "ci": [0.4, 1.0]},
            {"proxy": "mean_cka", "version": "linear, H≥0.5", "rho": None, "ci": None}]
    fig = plots.study_proxies(rows, "linear, H≥0.5", correlations=corr).to_dict()
    assert [list(d["x"]) for d in fig["data"]][3:] == [[0.27, 0.25], [0.36, 0.33]]
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles[0].endswith("ρ +0.500 [-0.200, +0.900]") and titles[1].endswith("ρ n/a")
    assert titles[3].endswith("ρ +1.000 [+0.400, +1.000]") and "ρ" not in titles[2] and "ρ" not in titles[4]


def test_one_interval_format_for_the_app_the_tables_and_the_verdict():
    """fmt.interval / fmt.ci are the only interval formatter: the bench table, the study table and the verdict
    print exactly what the app shows."""
    assert fmt.interval(1.1333, [1.0912, 1.16], "tau") == "1.133 [1.091, 1.160]"
    assert fmt.interval(1.42, [1.3, 1.55], "speedup") == "1.42× [1.30, 1.55]"       # the unit once, on the value
    assert fmt.interval(0.007, [-0.01, 0.02], "delta") == "+0.007 [-0.010, +0.020]"
    assert fmt.interval(1.2, None) == "1.200" and fmt.interval(None, [1, 2]) == fmt.MISSING
    assert fmt.ci(None) == "[n/a]" and fmt.ci([1.0, None]) == "[n/a]"
    rows = [{"strategies": ["default"], "layers": [2, 15, 27], "tau": 1.3, "tau_ci": [1.27, 1.33],
             "delta_vs_default": 0.0, "delta_ci": [0.0, 0.0], "tau_seed_range": None},
            {"strategies": ["spread"], "layers": [1, 2, 3], "tau": 1.31, "tau_ci": [1.25, 1.36],
             "delta_vs_default": 0.01, "delta_ci": [-0.02, 0.04], "tau_seed_range": None}]
    text = verdict(rows, 0, [], prompts=8, seeds=1)
    assert fmt.ci([-0.02, 0.04], "delta") in text                             # the difference's interval
    lost = verdict([rows[0], {**rows[1], "tau": 1.2, "delta_vs_default": -0.1, "delta_ci": [-0.2, -0.01]}], 0, [],
                   prompts=8, seeds=1)
    assert fmt.ci([1.27, 1.33], "tau") in lost                                  # the default's own τ interval


def test_two_outcome_folders_pair_by_set_seed_and_benchmark_and_give_a_paired_delta(tmp_path):
    """benchmarks/paired_outcomes.py's rule (issue 38.3, fc_norm on and off): outcomes pair when target, layers,
    seed and benchmark agree; Δτ is the paired difference over the prompts, exactly 0 for the same runs."""
    a, b, _ = synthetic_sets(gain=0.05)

    def identity(layers, fc_norm, bench="prompts-1"):
        online = {"tokens": 200000, **({"fc_norm": True} if fc_norm else {})}
        return {"target": "gguf-t", "layers": layers, "seed": 0, "training": {"online": online, "prompts": "p"},
                "bench": {"prompts": bench, "max_new_tokens": 32, "k": 2}, "format": 1}

    def outcome(layers, runs_, agreement):
        return Outcome(layers=layers, seed=0, draft="gone", meta={"val_accuracy": agreement, "tokens_seen": 200286},
                       result={"speedup": 0.6}, per_prompt=runs_, machine=None, baseline={})

    off, on = OutcomeFolder(tmp_path / "off"), OutcomeFolder(tmp_path / "on")
    off.put(identity([2, 9, 15], False), outcome([2, 9, 15], a, [0.29, 0.17, 0.13]))
    on.put(identity([2, 9, 15], True), outcome([2, 9, 15], b, [0.35, 0.35, 0.34]))
    off.put(identity([17], False), outcome([17], a, [0.3]))
    on.put(identity([17], True), outcome([17], a, [0.3]))
    off.put(identity([4, 7, 8], False), outcome([4, 7, 8], a, [0.3]))                       # another benchmark:
    on.put(identity([4, 7, 8], True, bench="prompts-2"), outcome([4, 7, 8], b, [0.3]))    # no partner
    off.put(identity([0, 13, 17], False), outcome([0, 13, 17], a, [0.3]))                 # in one folder only

    pairs = pair_folders(off, on)
    assert sorted(p.layers for p in pairs) == [[2, 9, 15], [17]]
    assert all(p.differs == {"online.fc_norm": (None, True)} for p in pairs)
    rows = {tuple(r["layers"]): r for r in effect_rows(pairs)}
    tau_a, tau_b = sum(a.tokens) / sum(a.forwards), sum(b.tokens) / sum(b.forwards)
    default = rows[(2, 9, 15)]
    assert default["a"]["tau"] == pytest.approx(tau_a, abs=1e-12) and default["b"]["tau"] == pytest.approx(tau_b, abs=1e-12)
    assert default["delta_tau"] == pytest.approx(tau_b - tau_a, abs=1e-12) and default["delta_ci"][0] > 0
    assert rows[(17,)]["delta_tau"] == 0.0 and rows[(17,)]["delta_ci"] == [0.0, 0.0]
    text = format_effect(list(rows.values()), "no fc_norm", "fc_norm")
    assert "| [2, 9, 15] | 0 | fc_norm | 0.350 / 0.350 / 0.340 |" in text
    assert f"{tau_b - tau_a:+.3f} [" in text and "online.fc_norm: None → True" in text
    with pytest.raises(OutcomeError, match="has a partner"):
        pair_folders(off, OutcomeFolder(tmp_path / "empty"))


def test_study_tables_prints_a_reports_numbers_as_markdown(tmp_path):
    """benchmarks/study_tables.py turns a study's --json report into docs/results.md's tables: each set's numbers as
    the report holds them, τ per seed in seed order, the seed spread's extremes, ρ in format_study's form, the
    verdict word for word; a file that is not a report is one line and exit code 2."""
    def row(strategies, layers, tau, taus, delta, ci, spread, agreement, probe):
        return {"strategies": strategies, "layers": layers, "val_accuracy": [agreement, 0.2], "probe": {"agreement": probe},
                "tau": tau, "tau_ci": [tau - 0.1, tau + 0.1], "delta_vs_default": delta, "delta_ci": ci, "speedup": 0.6,
                "tau_seed_range": spread, "seeds": [{"seed": 1, "tau": taus[1]}, {"seed": 0, "tau": taus[0]}]}
    report = {"rows": [row(["default"], [2, 9, 15], 1.49, (1.5, 1.48), 0.0, [0.0, 0.0], 0.02, 0.342, 0.374),
                       row(["probe"], [13, 15, 17], 1.52, (1.536, 1.504), 0.03, [0.004, 0.061], 0.032, 0.366, 0.405)],
              "correlations": [{"proxy": "mean_entropy", "version": "linear, H≥0.5", "rho": 0.4, "ci": [-0.5, 1.0]},
                               {"proxy": "mean_entropy", "version": "cosine, H≥1", "rho": 0.6, "ci": [-0.2, 1.0]}],
              "best_proxies": {"mean_entropy": {"version": "cosine, H≥1", "rho": 0.6, "ci": [-0.2, 1.0]},
                               "probe": {"version": "held-out agreement", "rho": 1.0, "ci": [1.0, 1.0]}},
              "verdict": "No difference at this budget: planted.", "prompts": 40}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(report))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "study_tables.py"
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True).stdout
    assert "| default [2, 9, 15] | 0.342 | 0.374 | 1.490 | [1.390, 1.590] | 1.500 / 1.480 | 0 |" in out
    assert "| probe [13, 15, 17] | 0.366 | 0.405 | 1.520 | [1.420, 1.620] | 1.536 / 1.504 | +0.030 | " \
           f"{fmt.ci([0.004, 0.061], 'delta')} | 0.60× |" in out
    assert "by 0.020 (default [2, 9, 15]) to 0.032 (probe [13, 15, 17])" in out
    assert f"| mean entropy | +0.40 {fmt.ci([-0.5, 1.0], 'delta')} | +0.60 {fmt.ci([-0.2, 1.0], 'delta')} (cosine, H≥1) |" in out
    assert f"| probe (held-out agreement, training-free) | +1.00 {fmt.ci([1.0, 1.0], 'delta')} | — |" in out
    assert '*"No difference at this budget: planted."*' in out
    path.write_text("{}")
    bad = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not a study's --json report" in bad.stderr
