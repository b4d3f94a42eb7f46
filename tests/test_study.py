"""The study end to end on the tiny model, the rank correlation, and its caching."""

import pytest

from layerscope.metrics.correlation import ranks, spearman


def test_ranks_average_ties():
    import torch

    assert ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_spearman_known_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert spearman([1, 2], [1, 2]) is None            # too few pairs
    assert spearman([1, 1, 1], [1, 2, 3]) is None      # no spread
    assert spearman([1, None, 2, 3], [1, 5, 2, 3]) == pytest.approx(1.0)


def test_study_runs_end_to_end_and_caches(tiny, tiny_capture, session_store):
    from layerscope.study import StudyOptions, format_study, run_study

    options = StudyOptions(strategies=("default", "greedy", "entropy-topk"), extra_sets=((0, 3),), k=2,
                           train={"steps": 3, "batch_size": 2, "seq_len": 32}, prompts="builtin", limit=2,
                           max_new_tokens=6, depth=2)
    phases = []
    report = run_study(tiny_capture, tiny, session_store, options, progress=lambda p: phases.append(p.phase))
    assert {"analyze", "train", "bench", "done"} <= set(phases)
    assert report.rows and all(r.lossless for r in report.rows)
    assert any(r.strategies == ["manual"] and r.layers == [0, 3] for r in report.rows)
    assert len({tuple(r.layers) for r in report.rows}) == len(report.rows)
    for r in report.rows:
        assert r.tau is not None and r.tau >= 1.0 and len(r.val_accuracy) == 3
    assert set(report.spearman) == {"mean_entropy", "mean_cka", "aggregate_entropy", "val_accuracy@1"}
    text = format_study(report)
    assert text.startswith(f"capture {tiny_capture.key}: 2 builtin prompts, 6 new tokens, chain K=2, 3 training steps")
    assert all(",".join(map(str, r.layers)) in text for r in report.rows)
    # a re-run with one more set trains and benchmarks only that one
    again = []
    import itertools
    fresh = next(p for p in itertools.combinations(range(4), 2) if list(p) not in [r.layers for r in report.rows])
    bigger = StudyOptions(**{**options.__dict__, "extra_sets": ((0, 3), fresh)})
    report2 = run_study(tiny_capture, tiny, session_store, bigger, progress=again.append)
    trained = {p.set_index for p in again if p.phase == "train" and p.detail is not None}
    new_index = next(i for i, r in enumerate(report2.rows) if r.layers == list(fresh))
    assert trained == {new_index}
    benched = {p.detail.contender for p in again if p.phase == "bench"}
    assert benched == {"autoregressive", report2.rows[new_index].draft}
