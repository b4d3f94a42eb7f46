"""Layer-set strategies: known answers, brute force for `aggregate` and the compartments, errors."""

import itertools
import json
import math

import pytest
import torch

from layerscope.errors import SelectionError
from layerscope.stats import cka as C
from layerscope.stats import entropy as E
from layerscope.stats import select as S
from layerscope.stats.analysis import LayerStats
from tests.helpers import correlated_layers


def make_stats(entropy, cka, entropy2=None, d=64, n=1000) -> LayerStats:
    """LayerStats from numbers: layers 0..N with the given entropies (nats) and CKA matrix."""
    entropy = [float(v) for v in entropy]
    N = len(entropy) - 1
    top = math.log(min(n, d))
    return LayerStats(
        capture_key="test", num_layers=N, hidden_size=d, alpha=1.0, entropy=entropy,
        entropy_normalized=[v / top for v in entropy], entropy2=list(entropy2 or entropy),
        entropy_prompt=entropy, entropy_prompt_normalized=[v / top for v in entropy],
        cka=[[float(v) for v in row] for row in cka], cka_debiased=None, cka_bound=None, cka_route="test",
        compartments=[], compartments_by_k={}, tokens_total=n, tokens_kept=n, outliers_dropped=0,
        threshold=0.0, tokens={}, token_entropy=[], prompts_used=0)


def stats_from_layers(layers) -> LayerStats:
    """Real statistics of in-memory layers (layers[-1] plays the final state)."""
    h = [E.matrix_entropy(z, 1.0) for z in layers]
    h2 = [E.matrix_entropy(z, 2.0) for z in layers]
    cka = C.cka_matrix(layers, debiased=False).biased
    n, d = layers[0].shape
    return make_stats(h, cka, h2, d=d, n=n)


def blocky(N=12, blocks=((0, 3), (4, 7), (8, 12)), inside=0.9, across=0.2):
    """CKA with contiguous blocks of similar layers (layer N included in the last block)."""
    c = torch.full((N + 1, N + 1), across, dtype=torch.float64)
    for f, e in blocks:
        c[f:e + 1, f:e + 1] = inside
    c.fill_diagonal_(1.0)
    return c


def test_default_rule():
    st = make_stats([1.0] * 31, torch.eye(31))
    assert S.select(st, "default").layers == [2, 15, 27]
    tiny = S.select(make_stats([1.0] * 5, torch.eye(5)), "default")      # N=4: [2, 2, 1]
    assert tiny.layers == [1, 2] and "N=4" in tiny.explanation["note"]


def test_entropy_topk_and_deterministic_ties():
    h = [0.1, 3.0, 1.0, 2.5, 2.9, 0.5, 9.0]                              # layer 6 = N is never proposed
    st = make_stats(h, torch.eye(7))
    assert S.select(st, "entropy-topk", 3).layers == [1, 3, 4]
    flat = make_stats([1.0] * 7, torch.eye(7))
    assert S.select(flat, "entropy-topk", 3).layers == [0, 1, 2]
    assert S.select(flat, "greedy", 3).layers == [0, 1, 2]
    assert S.select(flat, "aggregate", 3).layers == [0, 1, 2]


def test_greedy_trades_information_for_redundancy():
    h = [2.0, 3.0, 2.95, 2.9, 1.0, 2.5]
    c = torch.eye(6, dtype=torch.float64)
    c[1:4, 1:4] = 0.95                                                   # 1, 2, 3 say the same thing
    c.fill_diagonal_(1.0)
    st = make_stats(h, c)
    assert S.select(st, "greedy", 3, lam=0.0).layers == [1, 2, 3]          # λ=0: entropy alone
    sel = S.select(st, "greedy", 3, lam=1.0)
    assert sel.layers == [0, 1, 4] and sel.explanation["order"] == [1, 0, 4]
    assert sel.explanation["objective"]["value"] == pytest.approx(sel.explanation["mrmr"])
    assert sel.explanation["mean_cka"] == pytest.approx(0.0)


def test_spread_finds_the_blocks_and_takes_the_best_of_each():
    h = [1, 2, 3, 1, 5, 1, 1, 1, 1, 1, 4, 1, 9]
    sel = S.select(make_stats(h, blocky()), "spread", 3)
    assert sel.explanation["compartments"] == [[0, 3], [4, 7], [8, 11]]
    assert sel.layers == [2, 4, 10]
    assert sel.explanation["compartment_mean_cka"] == pytest.approx([0.9, 0.9, 0.9])


def test_compartments_equal_brute_force():
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64).cumsum(0)
    x = x / x.norm(dim=1, keepdim=True)
    c = (x @ x.T).square()                                               # PSD, depth-structured
    for k in (1, 2, 3, 4):
        best, best_blocks = -1.0, None
        for cuts in itertools.combinations(range(1, 9), k - 1):
            edges = [0, *cuts, 9]
            blocks = [[edges[i], edges[i + 1] - 1] for i in range(k)]
            v = S.compartment_objective(c, blocks)
            if v > best + 1e-12:
                best, best_blocks = v, blocks
        assert S.compartments(c, k) == best_blocks
        assert S.compartment_objective(c, S.compartments(c, k)) == pytest.approx(best)


def test_aggregate_is_exhaustive_and_matches_direct_concatenation():
    layers = correlated_layers(8, 60, 6, seed=3)                         # N = 7, drafts read 0..6
    layers[4] = torch.randn(60, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    st = stats_from_layers(layers)
    ps = [E.prepare(z) for z in layers]
    for k in (1, 2, 3):
        direct = {s: E.aggregate_entropy([ps[i] for i in s], 2.0, prepared=True)
                  for s in itertools.combinations(range(7), k)}
        want = max(direct, key=lambda s: (direct[s], [-i for i in s]))
        sel = S.select(st, "aggregate", k)
        assert sel.layers == list(want)
        assert sel.score == pytest.approx(direct[want], abs=1e-6)
        for s, v in direct.items():                                    # every set scored right
            assert S.score_set(st, list(s))["aggregate_entropy"] == pytest.approx(v, abs=1e-6)
    big = S.select(st, "aggregate", 5)                                   # greedy beyond 3 keeps the best triple
    assert len(big.layers) == 5 and set(S.select(st, "aggregate", 3).layers) <= set(big.layers)


def test_manual_scored_on_the_same_scale():
    layers = correlated_layers(8, 50, 6, seed=4)
    st = stats_from_layers(layers)
    auto = S.select(st, "greedy", 3)
    manual = S.select(st, "manual", layers=list(reversed(auto.layers)))
    assert manual.layers == auto.layers and manual.score == auto.score
    for key in ("entropy", "cka", "mean_entropy", "mean_cka", "aggregate_entropy", "mrmr"):
        assert manual.explanation[key] == auto.explanation[key]
    assert manual.explanation["cka"][0][1] == pytest.approx(st.cka[auto.layers[0]][auto.layers[1]])


def test_compare_runs_every_strategy_and_is_json():
    st = stats_from_layers(correlated_layers(9, 50, 6, seed=5))
    out = S.compare(st, 3, layers=[0, 4, 7])
    assert [s.strategy for s in out] == list(S.STRATEGIES)
    assert all(len(s.layers) == 3 and all(0 <= l < 8 for l in s.layers) for s in out)
    agg = out[S.STRATEGIES.index("aggregate")]
    assert all(s.score <= agg.score + 1e-12 for s in out)                # aggregate maximises the score
    back = json.loads(json.dumps([s.to_dict() for s in out]))
    assert back[0].keys() == {"strategy", "layers", "score", "explanation"}
    assert S.compare(st, 3) == S.compare(st, 3)                          # deterministic


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="greedy", k=8), "exceeds the 7 layers"),
    (dict(strategy="aggregate", k=0), "positive integer"),
    (dict(strategy="manual", layers=[1, 2, 2]), "repeats"),
    (dict(strategy="manual", layers=[1, 7]), "outside 0..6"),
    (dict(strategy="manual", layers=[-1, 2]), "outside 0..6"),
    (dict(strategy="manual", layers=[]), "names no layer"),
    (dict(strategy="best"), "Unknown strategy"),
])
def test_errors(kwargs, match):
    st = make_stats([1.0] * 8, torch.eye(8))
    with pytest.raises(SelectionError, match=match):
        S.select(st, **kwargs)
