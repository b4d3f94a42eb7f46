"""The probe (layerscope/study/probe.py, its algebra layerscope/stats/ridge.py): closed form against lstsq,
streaming against in-memory, a planted layer found by the search, the `probe` strategy, the CLI's JSON and the
study's proxy verdict."""

import json

import pytest
import torch

from layerscope.capture.format import chunk_name, file_sha256
from layerscope.capture.stored import finish_capture, open_capture, partial_capture_dir
from layerscope.commands import cli
from layerscope.commands.probe import format_report
from layerscope.stats import ridge as R
from layerscope.stats import select as S
from layerscope.stats.analysis import AnalysisOptions, analyze
from layerscope.stats.paired import proxy_verdict
from layerscope.store import Store, atomic_save_tensors, make_key
from layerscope.study import probe as P
from layerscope.target.weights import TargetWeights
from tests.helpers import gen

N, D, V, PLANTED = 6, 16, 40, 3


def make_conversations(convs=24, prompt=4, response=20, seed=0):
    """Per conversation: hidden [N+1, L, D] float32 with h_N[p] = h_PLANTED[p−1] @ M (p ≥ 1), token ids, flags."""
    g = gen(seed)
    M = torch.randn(D, D, generator=g) / D ** 0.5
    out = []
    for _ in range(convs):
        L = prompt + response
        h = torch.randn(N + 1, L, D, generator=g)
        h[N, 1:] = h[PLANTED, :-1] @ M
        out.append({"hidden": h, "token_id": torch.randint(0, V, (L,), generator=g),
                    "is_response": torch.arange(L) >= prompt})
    return out


def write_capture(store, conversations, per_chunk: int, name: str = "synthetic"):
    """A capture written through the store's own writer (atomic chunks, finish_capture), `per_chunk` conversations
    per chunk file."""
    key = make_key({"synthetic-probe": name, "per_chunk": per_chunk, "convs": len(conversations)})
    partial = partial_capture_dir(store, key)
    chunks = []
    for start in range(0, len(conversations), per_chunk):
        part = conversations[start:start + per_chunk]
        tensors = {f"hidden.{l}": torch.cat([c["hidden"][l] for c in part]).half() for l in range(N + 1)}
        tensors |= {"token_id": torch.cat([c["token_id"] for c in part]).int(),
                    "position": torch.cat([torch.arange(len(c["token_id"])) for c in part]).int(),
                    "conversation": torch.cat([torch.full((len(c["token_id"]),), start + i)
                                               for i, c in enumerate(part)]).int(),
                    "is_response": torch.cat([c["is_response"] for c in part]),
                    "entropy": torch.ones(sum(len(c["token_id"]) for c in part))}
        end = start + len(part)
        path = partial / chunk_name(start, end)
        atomic_save_tensors(path, tensors)
        chunks.append({"file": path.name, "start": start, "end": end, "tokens": len(tensors["token_id"]),
                       "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    manifest = {"key": key, "format": 1, "model": "synthetic", "fingerprint": None, "num_layers": N, "hidden_size": D,
                "final_state": "post-norm", "has_prenorm_final": False, "prompt_set": "synthetic", "prompts": [],
                "conversations": len(conversations), "tokens": sum(c["tokens"] for c in chunks), "chunks": chunks,
                "created": "2024-01-01T00:00:00+00:00"}
    with store.lock("captures", key):
        finish_capture(store, key, manifest)
    return open_capture(store, key)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("probe-store"))
    convs = make_conversations()
    g = gen(7)
    weights = TargetWeights(torch.randn(V, D, generator=g), torch.randn(V, D, generator=g))
    yield store, write_capture(store, convs, per_chunk=3), write_capture(store, convs, per_chunk=24), weights
    store.close()


def lstsq_ridge(X, Y, lam):
    """The standardised ridge solution (each column penalised by λ × its centred sum of squares, the last
    column, the bias, not at all), by least squares on the augmented system."""
    p = X.shape[1]
    spread = ((X[:, :-1] - X[:, :-1].mean(0)) ** 2).sum(0)
    pen = torch.eye(p, dtype=torch.float64)[:-1] * (lam * spread)[:, None] ** 0.5
    return torch.linalg.lstsq(torch.cat([X, pen]), torch.cat([Y, torch.zeros(p - 1, Y.shape[1], dtype=torch.float64)]),
                              driver="gelsd").solution


def in_memory_rows(cap, weights, layers, p):
    """The probe's rows read the plain way: whole layers, then indexed (x at p−1, embedding of token p, y at p)."""
    tok = cap.tokens()["token_id"]
    X = torch.cat([cap.layer(l)[p - 1] for l in layers] + [weights.embed[tok[p]]], dim=1).double()
    return R.with_bias(X), cap.layer(cap.num_layers)[p].double()


def test_gram_blocks_give_the_lstsq_ridge_solution_in_any_block_order():
    g = gen(1)
    d, blocks, n = 5, 4, 300
    x = torch.randn(n, blocks * d, generator=g, dtype=torch.float64) + 0.3
    y = x[:, :d] @ torch.randn(d, d, generator=g, dtype=torch.float64) + torch.randn(n, d, generator=g, dtype=torch.float64)
    gram = R.Gram(blocks, d)
    for i in range(0, n, 77):                                     # accumulated in uneven batches
        gram.add(x[i:i + 77], y[i:i + 77])
    for idx in ([2, 0], [3], [1, 3, 0, 2]):
        A, B = gram.system(idx)
        X = R.with_bias(x[:, R.block_columns(idx, d)])
        assert torch.allclose(A, X.T @ X, rtol=0, atol=1e-9) and torch.allclose(B, X.T @ y, rtol=0, atol=1e-9)
        for lam in (1e-3, 0.3, 5.0):
            W = R.ridge(A, B, lam)
            ref = lstsq_ridge(X, y, lam)
            assert (W - ref).abs().max() < 1e-8 * max(1.0, float(ref.abs().max())), (idx, lam)


def test_the_map_does_not_depend_on_the_scale_of_a_block():
    """A block 10⁴ times larger (a deep layer's massive activations) beside a small one (the embedding): the
    standardised penalty gives the same predictions, so the large block cannot set the penalty of the small
    one. One λ for every column (the old rule, D = I scaled by the mean diagonal) does not."""
    g = gen(3)
    d, n = 4, 400
    x = torch.randn(n, 2 * d, generator=g, dtype=torch.float64)
    y = x[:, d:] @ torch.randn(d, d, generator=g, dtype=torch.float64) + 0.1 * torch.randn(n, d, generator=g, dtype=torch.float64)
    big = x.clone()
    big[:, :d] *= 1e4                                              # block 0 in other units; block 1 carries y
    preds = []
    for rows in (x, big):
        X = R.with_bias(rows)
        W = R.ridge(X.T @ X, X.T @ y, 0.1)
        preds.append(X @ W)
    assert torch.allclose(preds[0], preds[1], rtol=0, atol=1e-8)
    X = R.with_bias(big)
    A = X.T @ X
    old_lam = 0.1 * float((A.diagonal()[:-1] - A[-1, :-1] ** 2 / n).mean())   # one λ for all, from the mean
    old = X @ torch.linalg.solve(A + old_lam * torch.diag(torch.cat([torch.ones(2 * d), torch.zeros(1)]).double()), X.T @ y)
    assert (old - y).pow(2).mean() > 5 * (preds[1] - y).pow(2).mean()    # the small block was erased


def test_streamed_capture_equals_in_memory_and_lstsq(synthetic):
    store, cap, _, weights = synthetic
    o = P.ProbeOptions()
    probe = P.Probe(cap, weights, [1, PLANTED, 5], o)
    assert probe.pos.counts() == {k: len(getattr(probe.pos, k)) for k in ("fit", "validation", "held_out")}
    for layers, lam, refit in (([1, PLANTED], 0.05, False), ([5], 0.3, True), ([1, PLANTED, 5], 0.001, True)):
        rows = torch.cat([probe.pos.fit, probe.pos.validation]) if refit else probe.pos.fit
        X, Y = in_memory_rows(cap, weights, layers, rows)
        A, B = probe.system(layers, refit)
        assert torch.allclose(A, X.T @ X, rtol=1e-12, atol=1e-9) and torch.allclose(B, X.T @ Y, rtol=1e-12, atol=1e-9)
        W, ref = probe.solve(layers, lam, refit), lstsq_ridge(X, Y, lam)
        assert (W - ref).abs().max() < 1e-8 * max(1.0, float(ref.abs().max())), (layers, lam)
    # the held-out rows it keeps are the capture's own
    Xh, Yh = in_memory_rows(cap, weights, [1, PLANTED, 5], probe.pos.held_out)
    assert torch.equal(probe.held.design([0, 1, 2, 3], D), Xh) and torch.equal(probe.held.y.double(), Yh)


def test_chunking_does_not_change_the_result(synthetic):
    store, small_chunks, one_chunk, weights = synthetic
    assert len(small_chunks.chunks) == 8 and len(one_chunk.chunks) == 1
    sets = [[0, 2], [PLANTED], [1, 4, 5]]
    a = P.score_sets(small_chunks, weights, sets)
    b = P.score_sets(one_chunk, weights, sets)
    assert a.positions == b.positions and a.scored == b.scored == 3
    for x, y in zip(a.sets, b.sets):
        assert x.layers == y.layers and x.agreement == y.agreement and x.lam == y.lam
        assert x.explained_variance == pytest.approx(y.explained_variance, abs=1e-10)
        assert x.val_loss == pytest.approx(y.val_loss, rel=1e-10)


def test_search_finds_the_planted_layer(synthetic):
    store, cap, _, weights = synthetic
    for method in P.SEARCHES:
        report = P.search(cap, weights, 2, P.ProbeOptions(search=method, top=3))
        best = report.best()
        assert PLANTED in best.layers and best.source == "search"
        assert report.search["path"][0] == {"move": "add", "layers": [PLANTED], "val_loss": report.search["path"][0]["val_loss"]}
        assert best.agreement > 0.9 and best.explained_variance > 0.99
        assert [s.val_loss for s in report.sets] == sorted(s.val_loss for s in report.sets) and len(report.sets) == 3
        assert report.scored >= N + (N - 1) and report.search["fits"] >= report.scored
    alone = P.search(cap, weights, 1).best()
    assert alone.layers == [PLANTED]
    without = P.score_sets(cap, weights, [[0, 1, 2]]).sets[0]
    assert without.agreement < 0.5 < alone.agreement and without.explained_variance < 0.2


def test_agreement_search_objective_and_given_sets_come_first(synthetic):
    store, cap, _, weights = synthetic
    report = P.search(cap, weights, 1, P.ProbeOptions(objective="agreement", search="greedy", top=2), sets=[[0, 5]])
    assert [s.source for s in report.sets] == ["given", "search", "search"]
    assert report.sets[0].layers == [0, 5] and report.best().layers == [PLANTED]
    assert report.best().val_agreement > 0.9
    out = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert P.ProbeReport.from_json(out).to_json() == out


def test_results_are_cached_per_set(synthetic):
    store, cap, _, weights = synthetic
    first = P.score_sets(cap, weights, [[PLANTED], [2]], store=store)
    assert not first.cached and first.scored == 2
    again = P.score_sets(cap, weights, [[2], [PLANTED], [4]], store=store)    # one new set
    assert not again.cached and again.scored == 1
    assert again.sets[1].to_json() == first.sets[0].to_json() and again.sets[0].to_json() == first.sets[1].to_json()
    assert P.score_sets(cap, weights, [[4]], store=store).cached


def test_bad_input_is_one_clear_error(synthetic):
    store, cap, _, weights = synthetic
    with pytest.raises(P.ProbeError, match="would hold"):
        P.score_sets(cap, weights, [[1]], P.ProbeOptions(max_memory_gb=1e-6))
    with pytest.raises(P.ProbeError, match="objective"):
        P.score_sets(cap, weights, [[1]], P.ProbeOptions(objective="best"))
    with pytest.raises(P.ProbeError, match="do not fit"):
        P.score_sets(cap, TargetWeights(torch.zeros(V, D + 1), torch.zeros(V, D + 1)), [[1]])
    with pytest.raises(P.ProbeError, match="k in 1..2"):
        P.search(cap, weights, 3, P.ProbeOptions(candidates=(1, 2)))
    with pytest.raises(S.SelectionError, match="outside 0..5"):
        P.score_sets(cap, weights, [[1, N]])


def test_probe_strategy_in_select(tiny, tiny_capture, session_store, one_thread):
    stats = analyze(tiny_capture, session_store, AnalysisOptions())
    with pytest.raises(S.SelectionError, match="needs the capture and the target"):
        S.select(stats, "probe", 2)
    source = P.ProbeInput(tiny_capture, TargetWeights.of(tiny), P.ProbeOptions(search="greedy"), session_store)
    sel = S.select(stats, "probe", 2, probe=source)
    report = P.search(tiny_capture, tiny, 2, P.ProbeOptions(search="greedy"), store=session_store)
    assert report.cached and sel.layers == report.best().layers and len(sel.layers) == 2
    assert sel.explanation["objective"] == {"name": "probe agreement (held-out)", "value": report.best().agreement,
                                            "search": "greedy", "scored": report.scored}
    assert sel.score == S.score_set(stats, sel.layers)["aggregate_entropy"]
    assert "probe" in dict(S.describe()) and set(S.STRATEGIES + S.CONTROLS) < set(S.REGISTRY)


def test_cli_probe_json(tiny_capture, session_store, capsys, one_thread):
    base = ["probe", tiny_capture.key, "--store", str(session_store.root)]
    assert cli.main(base + ["--layers", "1,2", "--layers", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"sets", "seconds", "tokens", "scored"} <= set(out) and out["tokens"] == tiny_capture.num_tokens
    assert [s["layers"] for s in out["sets"]] == [[1, 2], [3]] and out["search"] is None
    for s in out["sets"]:
        assert {"layers", "agreement", "explained_variance", "lambda"} <= set(s)
        assert 0 <= s["agreement"] <= 1 and s["lambda"] > 0 and s["source"] == "given"
    assert cli.main(base + ["--search", "swap", "--k", "2", "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["source"] for s in out["sets"]] == ["search", "search"] and out["scored"] >= 4
    assert out["search"]["method"] == "swap" and out["search"]["candidates"] == list(range(tiny_capture.num_layers))
    assert cli.main(base + ["--layers", "3"]) == 0
    text = capsys.readouterr().out
    assert "agreement" in text and "[3]" in text and "from the store" in text
    assert cli.main(base + ["--layers", "1,9"]) == 2
    assert "outside 0..3" in capsys.readouterr().err
    assert cli.main(base + ["--lambdas", "0,1"]) == 2
    assert "λ grid value" in capsys.readouterr().err
    # the strategy through `layerscope select`: the probe's search, the common score beside it
    assert cli.main(["select", tiny_capture.key, "--store", str(session_store.root), "--strategy", "probe", "--k", "2",
                     "--json"]) == 0
    sel = json.loads(capsys.readouterr().out)
    assert sel["strategy"] == "probe" and sel["layers"] == out["sets"][0]["layers"]
    assert sel["explanation"]["objective"]["value"] == out["sets"][0]["agreement"]


def test_a_smaller_set_with_lower_validation_loss_is_named():
    def report(path, best_loss, objective="loss"):
        score = P.SetScore([0, 21, 27], 0.25, 0.5, 0.3, best_loss, source="search")
        return P.ProbeReport("c", [score], 1.0, 100, 3, {"fit": 1, "validation": 1, "held_out": 1},
                             {"fit": 1, "validation": 1, "held_out": 1},
                             {"method": "greedy", "k": 3, "objective": objective, "candidates": [0, 21, 27],
                              "passes": 0, "path": path})
    path = [{"move": "add", "layers": [27], "val_loss": 25.0}, {"move": "add", "layers": [0, 27], "val_loss": 23.11},
            {"move": "add", "layers": [0, 21, 27], "val_loss": 23.43}]
    worse = report(path, 23.43)
    assert worse.smaller_was_better() == path[1]
    assert "[0, 27] (2 layers) had a lower validation loss (23.11) than the best 3-layer set (23.43)" \
        in format_report(worse)
    assert report(path, 23.0).smaller_was_better() is None                    # the third layer helped
    assert "note:" not in format_report(report(path, 23.0))
    assert report(path, 23.43, objective="agreement").smaller_was_better() is None


def test_verdict_names_a_proxy_only_when_its_interval_excludes_zero():
    probe = {"proxy": "probe", "version": "held-out agreement", "rho": 0.7, "ci": [0.2, 0.95], "sets": 9}
    cka = {"proxy": "mean_cka", "version": "linear, no filter", "rho": -0.9, "ci": [-1.0, 0.1], "sets": 9}
    entropy = {"proxy": "mean_entropy", "version": "linear, no filter", "rho": -0.8, "ci": [-0.95, -0.3], "sets": 9}
    text = " ".join(proxy_verdict([probe, cka]))
    assert text.startswith("Best predictor of τ: probe (held-out agreement): ρ = +0.70") and "mean_cka" not in text
    none = " ".join(proxy_verdict([{**probe, "ci": [-0.1, 0.9]}, cka]))
    assert none.startswith("No proxy predicted τ reliably: none of the 2 correlations") and "probe" not in none
    against = " ".join(proxy_verdict([cka, entropy]))
    assert "No proxy predicted τ reliably" in against and "Against the expected direction" in against
    assert "mean_entropy (linear, no filter): ρ = -0.80" in against
    assert proxy_verdict([{**probe, "rho": None, "ci": None}]) == ["Too few distinct sets to correlate the proxies with τ."]


def test_each_score_states_its_sample_and_a_bootstrap_interval_over_conversations(synthetic):
    store, cap, _, weights = synthetic
    report = P.score_sets(cap, weights, [[PLANTED], [2]])
    for s in report.sets:
        assert s.positions == report.positions["held_out"] and s.conversations == report.conversations["held_out"]
        assert len(s.hits) == len(s.counts) == s.conversations and all(0 <= h <= n for h, n in zip(s.hits, s.counts))
        assert sum(s.hits) / sum(s.counts) == pytest.approx(s.agreement)
        lo, hi = s.agreement_ci
        assert lo <= s.agreement <= hi
    # the interval resamples whole conversations: one conversation all right, one all wrong -> wide
    assert P.agreement_interval([10, 0], [10, 10]) == pytest.approx([0.0, 1.0])
    assert P.agreement_interval([5], [10]) is None                  # one conversation: no interval
    out = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert P.ProbeReport.from_json(out).to_json() == out


def test_the_default_capture_leaves_the_probe_enough_held_out_conversations(tmp_path):
    """Issue 51 (4): the default capture (16 prompts) held out 2 conversations at the draft's 10%, and the probe
    needs 5 to tell sets apart, so every set tied. It now holds out 5 (the draft's 2 among them) wherever a third
    of the conversations allows; a smaller capture is said before the run (recommend.probe_note)."""
    from layerscope.draft.training.data import split_conversations
    from layerscope.study import recommend
    assert [P.held_out_conversations(n, 0.1) for n in (2, 8, 14, 15, 16, 100)] == [1, 2, 4, 5, 5, 10]
    store = Store(tmp_path / "store")
    cap = write_capture(store, make_conversations(convs=16), per_chunk=8, name="default-size")
    pos = P.positions(cap, P.ProbeOptions())
    assert pos.conversations["held_out"] == 5 >= recommend.MIN_CONVERSATIONS
    assert pos.conversations["validation"] >= 1 and pos.conversations["fit"] >= 1
    conv = cap.tokens()["conversation"]
    o = P.ProbeOptions()
    drafts = set(torch.unique(conv[split_conversations(conv, o.val_fraction, o.seed)]).tolist())
    assert len(drafts) == 2 and drafts <= set(torch.unique(conv[pos.held_out]).tolist())
    assert recommend.probe_note(16) is None
    note = recommend.probe_note(8)
    assert "holds out 2, fewer than 5" in note and "at least 15 prompts" in note
    store.close()
