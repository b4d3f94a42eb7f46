"""Token selection, the analysis of a real (tiny) capture, its cache, and the analyze/select CLI."""

import json

import pytest
import torch

from layerscope.commands import cli
from layerscope.errors import LayerScopeError
from layerscope.stats import cka as C
from layerscope.stats import entropy as E
from layerscope.stats.analysis import ARRAY_FIELDS, AnalysisOptions, LayerStats, analyze, join_arrays, split_arrays, token_index
from layerscope.stats.tokens import breakdown, select_tokens


def table(T=40, seed=0):
    """A token table: 4 conversations of 10 tokens, the last 6 of each are the response."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(T) % 10
    return {"token_id": torch.randint(0, 100, (T,), generator=g), "position": pos,
            "conversation": torch.arange(T) // 10, "is_response": pos >= 4,
            "entropy": torch.rand(T, generator=g) * 3}


# ---- token selection (pure) ----------------------------------------------------------------------

def test_response_only_sinks_and_entropy_threshold():
    t = table()
    t["entropy"][:] = 1.0
    t["entropy"][[5, 15]] = 0.1
    idx, rep = select_tokens(t, None, min_entropy=0.5, max_tokens=None)
    assert rep["tokens_total"] == 40 and rep["low_entropy_dropped"] == 2 and rep["tokens_kept"] == 22
    assert idx.tolist() == [i for i in range(40) if i % 10 >= 4 and i not in (5, 15)]
    idx, rep = select_tokens(t, None, response_only=False, min_entropy=None, max_tokens=None)
    assert rep["sink_dropped"] == 4 and rep["tokens_kept"] == 36 and 0 not in idx.tolist()


def test_every_captured_token_is_accounted_for():
    t = table()
    t["entropy"][:] = 1.0
    t["entropy"][[5, 15]] = 0.1
    norms = torch.ones(3, 40)
    norms[0, 6] = 50.0
    _, rep = select_tokens(t, norms, min_entropy=0.5, max_tokens=10)
    parts = dict(breakdown(rep))
    assert sum(parts.values()) == rep["tokens_total"] == 40
    assert parts["prompt tokens (response tokens only)"] == 16 and parts["massive activations"] == 1
    assert parts["below the entropy threshold"] == 2 and parts["over the token cap"] == 11 and parts["kept"] == 10
    # a report saved before prompt tokens were counted: they are the rest
    old = {k: v for k, v in rep.items() if k not in ("prompt_dropped", "capped")}
    assert breakdown(old) == breakdown(rep)


def test_massive_activations_are_dropped():
    t = table()
    norms = torch.ones(3, 40) + 0.1 * torch.rand(3, 40, generator=torch.Generator().manual_seed(1))
    norms[1, 7] = 50.0                                  # a massive activation at one layer only
    norms[2, 0] = 500.0                                 # position 0 is a sink anyway
    idx, rep = select_tokens(t, norms, response_only=False, min_entropy=None, max_tokens=None)
    assert rep["outliers_dropped"] == 1 and 7 not in idx.tolist() and rep["sink_dropped"] == 4
    _, rep = select_tokens(t, norms, response_only=False, min_entropy=None, outlier_factor=None, max_tokens=None)
    assert rep["outliers_dropped"] == 0


def test_quantile_and_seeded_cap():
    t = table()
    idx, rep = select_tokens(t, None, quantile=0.5, max_tokens=None)
    assert rep["threshold"] == pytest.approx(float(torch.quantile(t["entropy"][t["position"] >= 4].double(), 0.5)))
    assert (t["entropy"][idx] >= rep["threshold"]).all() and rep["tokens_kept"] == 12
    a, rep = select_tokens(t, None, min_entropy=0, max_tokens=10, seed=3)
    b, _ = select_tokens(t, None, min_entropy=0, max_tokens=10, seed=3)
    c, _ = select_tokens(t, None, min_entropy=0, max_tokens=10, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c) and rep["tokens_kept"] == 10 and rep["tokens_eligible"] == 24
    assert torch.equal(a, a.sort().values)


def test_one_massive_token_makes_unrelated_layers_look_identical():
    """A shared sink token ("tokens that lie") drives CKA to ~1 until it is dropped."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(200, 32, generator=g), torch.randn(200, 32, generator=g)
    x[10] = 300.0
    y[10] = 300.0
    assert C.cka(x, y, kernel="cosine") < 0.3          # the cosine `prepare` scales rows: one token has one vote
    raw = lambda a, b: float((a.T @ b).square().sum() / ((a.T @ a).square().sum() * (b.T @ b).square().sum()).sqrt())
    xc, yc = x - x.mean(0), y - y.mean(0)
    assert raw(xc, yc) > 0.95                          # plain linear CKA is fooled
    t = {"position": torch.arange(200) + 1, "is_response": torch.ones(200, dtype=torch.bool),
         "entropy": torch.ones(200)}
    idx, rep = select_tokens(t, torch.stack([x.norm(dim=1), y.norm(dim=1)]), min_entropy=0, max_tokens=None)
    assert rep["outliers_dropped"] == 1 and raw(xc[idx] - xc[idx].mean(0), yc[idx] - yc[idx].mean(0)) < 0.3


# ---- analysis of a capture -----------------------------------------------------------------------

ALL = AnalysisOptions(min_entropy=0.0, max_tokens=None)


def test_analysis_matches_the_metrics_on_the_kept_tokens(tiny_capture, store):
    cap = tiny_capture
    stats = analyze(cap, store, ALL)
    N = cap.num_layers
    assert stats.num_layers == N and len(stats.entropy) == N + 1 and len(stats.cka) == N + 1
    index, rep = token_index(cap, ALL)
    assert stats.tokens_kept == index.numel() == rep["tokens_kept"] and stats.tokens_total == cap.num_tokens
    assert stats.tokens_kept == int((cap.tokens()["is_response"] & (cap.tokens()["position"] > 0)).sum()) \
        - stats.outliers_dropped
    n, d = index.numel(), cap.hidden_size
    for l in (0, 2, N):
        z = cap.layer(l, index)
        assert stats.entropy[l] == pytest.approx(E.matrix_entropy(z, 1.0), abs=1e-9)
        assert stats.entropy2[l] == pytest.approx(E.matrix_entropy(z, 2.0), abs=1e-9)
        assert stats.entropy_normalized[l] == pytest.approx(E.normalized(stats.entropy[l], n, d))
    for i, j in ((0, 1), (1, N), (0, N)):
        x, y = cap.layer(i, index), cap.layer(j, index)
        assert stats.cka[i][j] == pytest.approx(C.cka(x, y), abs=1e-6)
        assert stats.cka_debiased[i][j] == pytest.approx(C.cka(x, y, debiased=True), abs=1e-6)
    conv = cap.tokens()["conversation"][index]
    groups = [index[conv == c] for c in conv.unique() if int((conv == c).sum()) >= 8]
    direct = sum(E.matrix_entropy(cap.layer(1, g)) for g in groups) / len(groups)
    assert stats.prompts_used == len(groups) >= 1 and stats.entropy_prompt[1] == pytest.approx(direct, abs=1e-9)
    assert len(stats.compartments) == min(3, N) and stats.compartments[0][0] == 0 and stats.compartments[-1][1] == N - 1


def test_stats_are_json_and_cached_by_options(tiny_capture, store):
    stats = analyze(tiny_capture, store, ALL)
    d = json.loads(json.dumps(stats.to_dict()))
    assert LayerStats.from_dict(d) == stats
    assert store.get_json("analysis", stats.key) == d
    again = analyze(tiny_capture, store, ALL)
    assert again == stats                                         # served from the store (same seconds too)
    other = analyze(tiny_capture, store, AnalysisOptions(min_entropy=0.0, max_tokens=None, alpha=2.0))
    assert other.key != stats.key and other.entropy == pytest.approx(stats.entropy2)


def test_kernel_is_named_cached_apart_and_matches_its_metrics(tiny_capture, store):
    linear = analyze(tiny_capture, store, ALL)
    cosine = analyze(tiny_capture, store, AnalysisOptions(min_entropy=0.0, max_tokens=None, kernel="cosine"))
    assert linear.kernel == "linear" == linear.options["kernel"] and cosine.kernel == "cosine"
    assert cosine.key != linear.key and store.get_json("analysis", cosine.key)["kernel"] == "cosine"
    index, _ = token_index(tiny_capture, ALL)
    x, y = tiny_capture.layer(0, index), tiny_capture.layer(3, index)
    assert cosine.cka[0][3] == pytest.approx(C.cka(x, y, kernel="cosine"), abs=1e-6)
    assert cosine.entropy[3] == pytest.approx(E.matrix_entropy(y, kernel="cosine"), abs=1e-9)
    assert linear.cka[0][3] == pytest.approx(C.cka(x, y, kernel="linear"), abs=1e-6)
    assert max(abs(a - b) for a, b in zip(linear.entropy, cosine.entropy)) > 1e-3
    with pytest.raises(LayerScopeError, match="kernel"):
        analyze(tiny_capture, None, AnalysisOptions(kernel="rbf"))


def test_layer_stats_arrays_round_trip_and_old_stats_read_as_cosine(tiny_capture):
    stats = analyze(tiny_capture, None, ALL)
    arrays, rest = stats.to_arrays()
    N = stats.num_layers
    assert set(arrays) == {f for f in ARRAY_FIELDS if getattr(stats, f) is not None}
    assert arrays["cka"].shape == (N + 1, N + 1) and arrays["entropy"].dtype == torch.float64
    assert not set(rest) & set(arrays) and rest["kernel"] == "linear"
    assert LayerStats.from_arrays(arrays, json.loads(json.dumps(rest))) == stats
    assert LayerStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats
    old = {k: v for k, v in stats.to_dict().items() if k != "kernel"}
    old["options"] = {k: v for k, v in old["options"].items() if k != "kernel"}
    assert LayerStats.from_dict(old).kernel == "cosine"          # before the option, CKA was row-normalised
    a, r = split_arrays({"entropy": [1.0, 2.0], "cka_bound": None, "alpha": 1.0})
    assert set(a) == {"entropy"} and r == {"cka_bound": None, "alpha": 1.0}
    assert join_arrays(a, r) == {"entropy": [1.0, 2.0], "cka_bound": None, "alpha": 1.0}
    with pytest.raises(ValueError):
        join_arrays({"nonsense": torch.zeros(2)}, {})


def test_lowrank_mode_reports_its_bound(tiny_capture):
    exact = analyze(tiny_capture, None, ALL)
    low = analyze(tiny_capture, None, AnalysisOptions(min_entropy=0.0, max_tokens=None, rank=4))
    assert low.cka_route == "lowrank-4" and low.cka_debiased is None
    err = (torch.tensor(low.cka) - torch.tensor(exact.cka)).abs()
    assert (err <= torch.tensor(low.cka_bound) + 1e-6).all() and err.max() > 0


def test_filters_that_leave_nothing_are_a_clear_error(tiny_capture):
    with pytest.raises(LayerScopeError, match="pass the filters"):
        analyze(tiny_capture, None, AnalysisOptions(min_entropy=100.0))
    with pytest.raises(LayerScopeError, match="quantile"):
        analyze(tiny_capture, None, AnalysisOptions(quantile=1.5))


@pytest.mark.parametrize("field,value,name", [("outlier_factor", float("nan"), "outlier_factor"),
                                              ("outlier_factor", float("inf"), "outlier_factor"),
                                              ("min_entropy", float("nan"), "min_entropy"),
                                              ("alpha", float("inf"), "alpha")])
def test_options_that_are_not_numbers_are_refused(tiny_capture, field, value, name):
    # NaN compares False with everything, so a check written as `x <= 1` would let it through
    with pytest.raises(LayerScopeError, match=name):
        analyze(tiny_capture, None, AnalysisOptions(**{field: value}))


# ---- CLI -----------------------------------------------------------------------------------------

def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_analyze_and_select_json(tiny_capture, session_store, capsys):
    base = [tiny_capture.key[:10], "--store", str(session_store.root), "--min-entropy", "0"]
    code, out, _ = run_cli(capsys, "analyze", *base, "--json")
    assert code == 0
    d = json.loads(out)
    N = tiny_capture.num_layers
    for k in ("num_layers", "entropy", "entropy_normalized", "cka", "tokens_total", "tokens_kept", "outliers_dropped"):
        assert k in d
    assert d["num_layers"] == N and len(d["entropy"]) == N + 1 and len(d["cka"][0]) == N + 1

    code, out, _ = run_cli(capsys, "select", *base, "--k", "2", "--strategy", "greedy", "--json")
    sel = json.loads(out)
    assert code == 0 and set(sel) == {"strategy", "layers", "score", "explanation"}
    assert sel["strategy"] == "greedy" and len(sel["layers"]) == 2

    code, out, _ = run_cli(capsys, "select", *base, "--compare", "--layers", "0,3", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["strategy"] for r in rows][-1] == "manual" and len(rows) == 6
    assert rows[-1]["layers"] == [0, 3]


def test_cli_text_and_errors(tiny_capture, session_store, capsys):
    base = [tiny_capture.key, "--store", str(session_store.root), "--min-entropy", "0"]
    code, out, _ = run_cli(capsys, "analyze", *base)
    assert code == 0 and "tokens:" in out and "compartments" in out and "linear CKA" in out
    assert "standard linear CKA" in out and "linear kernel" in out
    code, out, _ = run_cli(capsys, "analyze", *base, "--kernel", "cosine")
    assert code == 0 and "cosine-kernel CKA" in out
    code, out, _ = run_cli(capsys, "analyze", *base, "--kernel", "cosine", "--json")
    assert code == 0 and json.loads(out)["kernel"] == "cosine" and json.loads(out)["options"]["kernel"] == "cosine"
    code, out, _ = run_cli(capsys, "select", *base, "--compare")
    assert code == 0 and all(s in out for s in ("default", "entropy-topk", "greedy", "aggregate", "spread"))
    code, _, err = run_cli(capsys, "select", *base, "--layers", f"1,{tiny_capture.num_layers}")
    assert code == 2 and "outside" in err
    code, _, err = run_cli(capsys, "select", *base, "--k", "9")
    assert code == 2 and "exceeds" in err
    code, _, err = run_cli(capsys, "analyze", "abcdef012345", "--store", str(session_store.root))   # hex, absent
    assert code == 2 and "No capture" in err
    code, _, err = run_cli(capsys, "analyze", "nosuchkey", "--store", str(session_store.root))      # not a key
    assert code == 2 and "not a capture key" in err
