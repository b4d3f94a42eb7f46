"""The study end to end on the tiny model, the rank correlation, and its caching."""

import itertools
import json
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch

from layerscope.commands import cli
from layerscope.commands.cli import build_parser
from layerscope.commands.study import options_from_args
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.errors import LayerScopeError, SelectionError
from layerscope.stats.analysis import analyze
from layerscope.stats.correlation import ranks, spearman
from layerscope.store import Store
from layerscope.study import probe
from layerscope.study.outcomes import OutcomeFolder
from layerscope.study.run import STUDY_STRATEGIES, StudyOptions, budget_text, format_study, propose_sets, run_study
from layerscope.target.weights import TargetWeights


def test_ranks_average_ties():
    assert ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_spearman_known_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert spearman([1, 2], [1, 2]) is None            # too few pairs
    assert spearman([1, 1, 1], [1, 2, 3]) is None      # no spread
    assert spearman([1, None, 2, 3], [1, 5, 2, 3]) == pytest.approx(1.0)


def test_study_runs_end_to_end_and_caches(tiny, tiny_capture, session_store):
    options = StudyOptions(strategies=("default", "greedy", "entropy-topk"), extra_sets=((0, 3),), k=2,
                           train=TrainOptions(steps=3, batch_size=2, seq_len=32), prompts="builtin", limit=2,
                           max_new_tokens=6, depth=2)
    phases = []
    report = run_study(tiny_capture, tiny, session_store, options, progress=lambda p: phases.append(p.phase))
    assert {"analyze", "train", "bench", "done"} <= set(phases)
    assert report.rows and all(r.lossless for r in report.rows)
    assert any(r.strategies == ["manual"] and r.layers == [0, 3] for r in report.rows)
    assert len({tuple(r.layers) for r in report.rows}) == len(report.rows)
    for r in report.rows:
        assert r.tau is not None and r.tau >= 1.0 and len(r.val_accuracy) == 3
    assert set(report.spearman) == {"mean_entropy", "mean_cka", "aggregate_entropy", "val_accuracy@1", "probe"}
    text = format_study(report)
    assert text.startswith(f"capture {tiny_capture.key}: 2 builtin prompts, 6 new tokens, chain K=2, 3 training steps")
    assert all(",".join(map(str, r.layers)) in text for r in report.rows)
    # a re-run with one more set trains and benchmarks only that one
    again = []
    fresh = next(p for p in itertools.combinations(range(4), 2) if list(p) not in [r.layers for r in report.rows])
    bigger = StudyOptions(**{**options.__dict__, "extra_sets": ((0, 3), fresh)})
    report2 = run_study(tiny_capture, tiny, session_store, bigger, progress=again.append)
    trained = {p.set_index for p in again if p.phase == "train" and p.detail is not None}
    new_index = next(i for i, r in enumerate(report2.rows) if r.layers == list(fresh))
    assert trained == {new_index}
    benched = {p.detail.contender for p in again if p.phase == "bench"}
    assert benched == {"autoregressive", report2.rows[new_index].draft}


STUDY_ALL = dict(k=2, train=TrainOptions(steps=2, batch_size=2, seq_len=32), prompts="builtin", limit=3,
                 max_new_tokens=6, depth=2, seeds=(0, 1), random_sets=2)


def test_study_with_controls_seeds_intervals_and_proxy_versions(tiny, tiny_capture, session_store, one_thread):
    """Every strategy and control, two training seeds: paired intervals, the proxies under both kernels
    and three token-entropy filters, correlations with intervals and a verdict, all strict JSON."""
    assert {"random", "last-k", "single"} <= set(STUDY_STRATEGIES)
    report = run_study(tiny_capture, tiny, session_store, StudyOptions(**STUDY_ALL))
    rows, N = report.rows, tiny_capture.num_layers
    ref = rows[report.reference]
    assert "default" in ref.strategies and ref.delta_vs_default == 0.0 and ref.delta_ci == [0.0, 0.0]
    labels = [s for r in rows for s in r.strategies]
    assert {"default", "greedy", "aggregate", "entropy-topk", "spread", "random#1", "random#2", "last-k",
            "single"} <= set(labels)
    assert next(r for r in rows if "single" in r.strategies).layers == [N - 1]
    assert next(r for r in rows if "last-k" in r.strategies).layers == [N - 2, N - 1]
    assert len({tuple(r.layers) for r in rows}) == len(rows)
    versions = {f"{k}, {f}" for k in ("linear", "cosine") for f in ("no filter", "H≥0.5", "H≥1")}
    for r in rows:
        assert r.lossless and len(r.seeds) == 2 and len(set(r.drafts)) == 2 and r.draft == r.drafts[0]
        assert [s["seed"] for s in r.seeds] == [0, 1]
        assert r.tau == pytest.approx(sum(s["tau"] for s in r.seeds) / 2)
        assert r.tau_ci[0] <= r.tau <= r.tau_ci[1] and r.speedup_ci[0] <= r.speedup <= r.speedup_ci[1]
        assert r.tau_seed_range == pytest.approx(max(s["tau"] for s in r.seeds) - min(s["tau"] for s in r.seeds))
        assert r.delta_vs_default == pytest.approx(r.tau - ref.tau, abs=1e-12)
        assert set(r.proxies) == versions and all(set(v) == {"mean_entropy", "mean_cka", "aggregate_entropy"}
                                                   for v in r.proxies.values())
        assert r.proxies["linear, H≥0.5"]["aggregate_entropy"] == pytest.approx(r.aggregate_entropy)
        for x in [r, *(SimpleNamespace(**s) for s in r.seeds)]:   # SpecForge's Σ∏ of the reported agreement
            a1, a2, a3 = x.val_accuracy
            assert x.simulated_acc_len == pytest.approx(a1 + a1 * a2 + a1 * a2 * a3)
        assert r.val_accuracy[0] == pytest.approx(sum(s["val_accuracy"][0] for s in r.seeds) / 2)
    assert rows[0].proxies["linear, H≥0.5"] != rows[0].proxies["cosine, H≥0.5"]
    assert {(c["proxy"], c["version"]) for c in report.correlations} == \
        {(p, v) for p in ("mean_entropy", "mean_cka", "aggregate_entropy") for v in versions} | \
        {("val_accuracy@1", "training"), ("probe", "held-out agreement")}
    assert all(c["sets"] == len(rows) for c in report.correlations)
    assert set(report.best_proxies) <= {"mean_entropy", "mean_cka", "aggregate_entropy", "val_accuracy@1", "probe"}
    assert all(0 <= r.probe["agreement"] <= 1 and r.probe["layers"] == r.layers for r in rows)   # the probe proxy
    assert "probe" in report.spearman and report.options["probe_skipped"] is None
    assert report.verdict and "default rule" in report.verdict and "Controls:" in report.verdict
    out = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert {"rows", "verdict", "correlations", "options"} <= set(out)
    assert out["options"]["seeds"] == [0, 1] and out["options"]["kernel"] == "linear"
    for key in ("tau", "tau_ci", "delta_vs_default", "delta_ci", "seeds", "proxies", "simulated_acc_len"):
        assert key in out["rows"][0]
    text = format_study(report)
    assert report.verdict in text and "tau 95% CI" in text and "cosine, no filter" in text
    assert "sim.acc.len" in text and f"{rows[0].simulated_acc_len:.3f}" in text and "no bonus token" in text


def test_study_rerun_is_served_from_the_store_and_skips_a_proxy_version_that_keeps_no_tokens(
        tiny, tiny_capture, session_store, one_thread):
    seen = []
    report = run_study(tiny_capture, tiny, session_store, StudyOptions(**{**STUDY_ALL, "filters": (0.0, 100.0)}),
                       progress=seen.append)
    assert not [p for p in seen if p.phase == "bench" or (p.phase == "train" and p.detail is not None)]
    skipped = report.options["proxy_versions_skipped"]
    assert set(skipped) == {"linear, H≥100", "cosine, H≥100"} and "pass the filters" in skipped["linear, H≥100"]
    assert report.options["proxy_versions"] == ["linear, H≥0.5", "linear, no filter", "cosine, no filter"]
    assert all(set(r.proxies) == set(report.options["proxy_versions"]) for r in report.rows)
    assert all(r.tau_ci is not None and len(r.seeds) == 2 for r in report.rows)


def test_cli_study_json_with_controls_and_seeds(tiny_capture, session_store, capsys, one_thread):
    """The lead's command on the tiny model: every strategy and control, two seeds, one JSON object."""
    argv = ["study", tiny_capture.key, "--store", str(session_store.root), "--model", "tiny-llama",
            "--strategies", "default,greedy,aggregate,entropy-topk,spread,random,last-k,single", "--random-sets", "2",
            "--seeds", "0,1", "--prompts", "builtin", "--limit", "3", "--k", "2", "--steps", "2", "--batch-size", "2",
            "--seq-len", "32", "--max-new-tokens", "6", "--depth", "2"]
    assert cli.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"rows", "verdict", "correlations", "options"} <= set(out) and out["verdict"]
    assert out["options"]["seeds"] == [0, 1] and out["options"]["kernel"] == "linear"
    labels = {s for r in out["rows"] for s in r["strategies"]}
    assert {"random#1", "random#2", "last-k", "single", "default"} <= labels
    for r in out["rows"]:
        assert len(r["tau_ci"]) == 2 and len(r["delta_ci"]) == 2 and len(r["seeds"]) == 2
        assert {"linear, H≥0.5", "cosine, H≥0.5", "linear, no filter"} <= set(r["proxies"])
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert out["verdict"] in text and "tau 95% CI" in text
    assert cli.main(argv + ["--seeds", "0,x"]) == 2 and "--seeds" in capsys.readouterr().err


def test_default_train_steps_is_the_cpu_and_gpu_budget():
    assert TrainOptions.default_steps("cpu") == 300 and TrainOptions.default_steps(torch.device("cpu")) == 300
    assert TrainOptions.default_steps("cuda") == 2000 and TrainOptions.default_steps("cuda:1") == 2000


def test_typed_study_options_train_the_same_drafts_and_say_the_same_budget():
    """The study command's options as objects: the drafts' options (so their store keys) are the ones its
    dicts made, and the budget line of an online study reads as before."""
    parse = lambda *a: options_from_args(build_parser().parse_args(["study", "KEY", *a]))
    capture = parse("--steps", "5", "--seed", "2")
    was = {"ttt_steps": 3, "batch_size": 8, "seq_len": 512, "lr": 1e-3, "seed": 2, "steps": 5}   # `train`, as a dict
    assert replace(capture.train, seed=1) == TrainOptions(**{**was, "seed": 1})
    assert capture.online is None and budget_text(asdict(capture)) == "5 training steps per draft"
    online = parse("--online", "--tokens", "2M", "--responses", "own")
    before = {"prompts": "sharegpt", "limit": None, "responses": "own", "ttt_steps": 3, "lr": 1e-3, "seed": 0,
              "steps": None, "tokens": 2_000_000, "time_s": None}        # what `online` was, as a dict
    assert online.online == OnlineOptions(**before)
    line = "online training (prompts=sharegpt, responses=own, ttt_steps=3, lr=0.001, tokens=2000000)"
    assert budget_text(asdict(online)) == budget_text({"online": before}) == line
    assert budget_text({"online": asdict(replace(online.online, batch_size=4))}) == line[:-1] + ", batch_size=4)"
    weighted = parse("--online", "--tokens", "2M", "--train-kinds", "code=2,chat=0")    # as train-draft --kinds
    assert weighted.online.kinds == "code=2,chat=0" and weighted.online.kind_weights["code"] == 2
    with pytest.raises(LayerScopeError, match="--train-kinds weights the conversations of online training"):
        parse("--train-kinds", "code=2")
    with pytest.raises(LayerScopeError, match="--train-kinds weights ShareGPT's conversations; --train-prompts builtin"):
        parse("--online", "--tokens", "2M", "--train-prompts", "builtin", "--train-kinds", "code=2")


def test_cli_study_refuses_a_bad_pass_size_and_an_outcomes_file_before_the_model_loads(tiny_capture, session_store,
                                                                                        tmp_path, capsys):
    argv = ["study", tiny_capture.key, "--store", str(session_store.root), "--model", "no-such-model", "--online",
            "--tokens", "1k"]
    assert cli.main(argv + ["--sets-per-pass", "0"]) == 2
    err = capsys.readouterr().err
    assert "--sets-per-pass must be at least 1" in err and "Traceback" not in err
    a_file = tmp_path / "outcomes.json"
    a_file.write_text("{}")
    assert cli.main(argv + ["--outcomes", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and "Traceback" not in err


def test_a_capture_study_with_outcomes_reruns_from_them_on_an_empty_store(tiny, tiny_capture, tmp_path, one_thread):
    """The same folder for a study trained from the capture: its drafts' outcomes carry it to a new store."""
    options = StudyOptions(strategies=("default", "entropy-topk"), k=2, train=TrainOptions(steps=2, batch_size=2,
                           seq_len=32), prompts="builtin", limit=2, max_new_tokens=6, depth=2, kernels=("linear",),
                           filters=(0.0,), probe=None, outcomes=str(tmp_path / "kept"))
    first, fresh = Store(tmp_path / "a"), Store(tmp_path / "b")
    report = run_study(tiny_capture, tiny, first, options)
    assert len(OutcomeFolder(tmp_path / "kept")) == len(report.rows)
    seen = []
    again = run_study(tiny_capture, tiny, fresh, options, progress=seen.append)
    assert not [p for p in seen if p.phase == "bench" or (p.phase == "train" and p.detail is not None)]
    assert [(r.layers, r.tau, r.tau_ci, r.val_accuracy) for r in again.rows] == \
        [(r.layers, r.tau, r.tau_ci, r.val_accuracy) for r in report.rows]
    first.close(), fresh.close()


def test_the_probe_strategy_adds_the_probe_searchs_best_set(tiny, tiny_capture, tmp_path, one_thread):
    """`probe` among the strategies: the study trains the set the probe's search ranks first (as `select
    --strategy probe` picks it); without the capture and target behind it, proposing that set is one clear
    error."""
    store = Store(tmp_path / "s")
    options = StudyOptions(strategies=("default", "probe"), k=2, train=TrainOptions(steps=2, batch_size=2,
                           seq_len=32), prompts="builtin", limit=2, max_new_tokens=6, depth=2, kernels=("linear",),
                           filters=(0.0,), probe=None)
    best = probe.search(tiny_capture, TargetWeights.of(tiny), 2, probe.ProbeOptions()).best().layers
    report = run_study(tiny_capture, tiny, store, options)
    assert [r.layers for r in report.rows if "probe" in r.strategies] == [best]
    with pytest.raises(SelectionError, match="needs the capture and the target"):
        propose_sets(analyze(tiny_capture, store), options)
    store.close()
