"""The Compare page: two captures side by side and the session's runs; its logic and figures, then the page
through AppTest on three tiny captures (two of the 4-layer tiny model on different prompts, one of a 6-layer one)."""

from __future__ import annotations

import pytest
import torch

from layerscope.capture import stored
from layerscope.capture.run import capture
from layerscope.prompts.sets import load_prompts
from layerscope.session import storage
from layerscope.session.model import Session
from layerscope.stats.analysis import LayerStats, analyze
from layerscope.target.load import load_model
from layerscope.ui import apply, compare, plots
from tests.ui.test_app import charts, new_app, no_exception, settle

# ---------------------------------------------------------------------------- logic and figures

def cka_like(n, seed):
    """A symmetric [n, n] matrix with a unit diagonal and entries in [0, 1], like a CKA matrix."""
    x = torch.rand(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    m = (x + x.T) / 2
    m.fill_diagonal_(1.0)
    return m


def test_the_cka_difference_of_a_capture_with_itself_is_exactly_zero():
    a = cka_like(6, 0)
    d = compare.cka_difference(a.tolist(), a.clone())
    assert torch.equal(d.diff, torch.zeros(6, 6, dtype=torch.float64))
    assert d.mean_abs == 0.0 and d.max_abs == 0.0 and d.signed == 0.0


def test_the_cka_difference_summary_finds_the_pair_that_changed():
    a = cka_like(5, 1)
    b = a.clone()
    b[1, 3] = b[3, 1] = a[1, 3] - 0.4           # A's layers 1 and 3 are 0.4 more alike than B's
    b[0, 2] = b[2, 0] = a[0, 2] + 0.1
    d = compare.cka_difference(a, b)
    assert d.where == (1, 3) and d.signed == pytest.approx(0.4) and d.max_abs == pytest.approx(0.4)
    assert d.mean_abs == pytest.approx((0.4 + 0.1) / 10)          # 10 pairs i < j among 5 layers
    assert torch.allclose(d.diff, a - b)
    with pytest.raises(ValueError, match="one size"):
        compare.cka_difference(a, cka_like(4, 1))


def test_statistics_saved_without_a_kernel_read_as_cosine_as_layer_stats_reads_them():
    """Before the kernel option every statistic was computed on row-normalised tokens: cosine, not linear."""
    old = {"options": {"alpha": 1.0}}
    assert compare.kernel_of(old) == LayerStats.kernel_of(old) == "cosine"
    assert compare.kernel_of({"kernel": "linear", "options": {"kernel": "linear"}}) == "linear"
    assert compare.kernel_of({"options": {"kernel": "linear"}}) == "linear"


def test_a_difference_heatmap_only_for_equal_layer_counts():
    assert compare.no_difference_reason(4, 4) is None
    reason = compare.no_difference_reason(4, 6)
    assert "A has 4 layers and B has 6" in reason and "relative depth" in reason


def test_entropy_overlay_uses_layers_when_n_agrees_and_relative_depth_when_not():
    same = plots.entropy_overlay({"A": [1.0, 2.0, 3.0], "B": [1.5, 2.5, 2.0]}).to_plotly_json()
    assert [t["x"] for t in same["data"]] == [[0, 1, 2], [0, 1, 2]]
    assert same["layout"]["xaxis"]["title"]["text"].startswith("layer")
    fig = plots.entropy_overlay({"A": [1.0, 2.0, 3.0, 4.0, 5.0], "B": [1.0, 2.0, 3.0]}).to_plotly_json()
    assert list(fig["data"][0]["x"]) == compare.relative_depth(4) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert list(fig["data"][1]["x"]) == [0.0, 0.5, 1.0]
    assert "relative depth" in fig["layout"]["xaxis"]["title"]["text"]
    assert fig["data"][0]["customdata"][-1].startswith("4 (final") and fig["data"][1]["customdata"][1] == "1 of 2"
    with pytest.raises(ValueError):
        plots.entropy_overlay({})


def test_cka_difference_heatmap_is_diverging_centred_on_zero_and_names_the_kernel():
    a, b = cka_like(4, 2), cka_like(4, 3)
    d = compare.cka_difference(a, b)
    fig = plots.cka_difference_heatmap(d.diff, kernel="cosine", estimator="debiased").to_plotly_json()
    heat = fig["data"][0]
    assert heat["type"] == "heatmap" and heat["zmin"] == -heat["zmax"] == pytest.approx(-d.max_abs)
    assert "cosine kernel" in fig["layout"]["title"]["text"] and "debiased" in fig["layout"]["title"]["text"]
    zero = plots.cka_difference_heatmap(torch.zeros(3, 3)).to_plotly_json()["data"][0]    # A − A: a valid scale
    assert zero["zmax"] > 0 and zero["zmin"] == -zero["zmax"]


def test_default_pair_is_the_session_capture_and_the_newest_other():
    keys = ["c" * 24, "b" * 24, "a" * 24]                     # newest first
    assert compare.default_pair(keys, "b" * 24) == ("b" * 24, "c" * 24)
    assert compare.default_pair(keys, None) == ("c" * 24, "b" * 24)
    assert compare.default_pair(keys[:1], None) == ("c" * 24, None)


A_KEY, B_KEY, GONE = "a" * 24, "b" * 24, "f" * 24


def session_with_runs() -> Session:
    """A session with runs of two captures, an old benchmark that recorded none, and a draft of a capture no
    store holds."""
    s = Session(capture_key=A_KEY, capture={"key": A_KEY, "model": "tiny-llama", "num_layers": 4})
    s.drafts = [{"name": "greedy", "path": "/d/greedy", "layers": [1, 2], "val_accuracy": [0.4, 0.2],
                 "capture_key": B_KEY},
                {"name": "old", "path": "/d/old", "layers": [0, 3], "val_accuracy": 0.3, "capture_key": GONE},
                {"name": "nokey", "path": "/d/nokey", "layers": [1, 3]}]
    s.bench_results = [
        {"prompts": 4, "results": [{"name": "autoregressive", "tau": 1.0, "tokens_per_s": 10.0, "speedup": 1.0},
                                   {"name": "greedy", "layers": [1, 2], "tau": 1.3, "speedup": 1.1}],
         "drafts": [{"name": "greedy", "path": "/d/greedy", "layers": [1, 2]}]},                 # before capture keys
        {"prompts": 4, "capture_key": A_KEY, "created": "2026-11-30T10:00:00+0000",
         "results": [{"name": "autoregressive", "tau": 1.0, "speedup": 1.0},
                     {"name": "nokey", "layers": [1, 3], "tau": 1.6, "speedup": 1.2, "tau_ci": [1.5, 1.7],
                      "speedup_ci": [1.1, 1.3], "acceptance_by_position": [0.5, 0.25]}],
         "drafts": [{"name": "nokey", "path": "/d/nokey", "layers": [1, 3]}]},
    ]
    s.study = [{"capture": A_KEY, "prompts": 4, "rows": [
        {"strategies": ["default"], "layers": [0, 2], "draft": "/d/s1", "mean_entropy": 1.0, "mean_cka": 0.5,
         "aggregate_entropy": 2.0, "tau": 1.2, "tau_ci": [1.1, 1.3], "val_accuracy": [0.3]},
        {"strategies": ["greedy"], "layers": [1, 2], "draft": "/d/s2", "mean_entropy": 1.0, "mean_cka": 0.5,
         "aggregate_entropy": 2.0, "tau": 1.5, "tau_ci": [1.4, 1.6], "val_accuracy": [0.5]}]}]
    return s


def test_runs_table_names_each_runs_capture_and_tolerates_old_entries():
    s = session_with_runs()
    caps = {A_KEY: {"key": A_KEY, "model": "tiny-llama", "prompt_set": "builtin"},
            B_KEY: {"key": B_KEY, "model": "tiny-llama:layers=6", "prompt_set": "builtin"}}
    rows = compare.runs_table(s, caps)
    assert len(rows) == 2 + 2 + 2 + 3          # study rows, both benchmarks' contenders, drafts
    by = {(r["run"], r["name"]): r for r in rows}
    assert by[("study #1", "greedy")]["capture"] == A_KEY and by[("study #1", "greedy")]["tau_ci"] == [1.4, 1.6]
    # the old benchmark: its draft's row names the draft's capture; plain decoding has none recorded
    assert by[("bench #1", "greedy")]["capture"] == B_KEY and by[("bench #1", "greedy")]["model"] == "tiny-llama:layers=6"
    assert by[("bench #1", "autoregressive")]["capture"] is None
    # the new one: the draft has no capture key, so the capture the session had when the benchmark ran
    assert by[("bench #2", "nokey")]["capture"] == A_KEY and by[("bench #2", "nokey")]["accept1"] == 0.5
    assert by[("bench #2", "nokey")]["tau_ci"] == [1.5, 1.7] and by[("bench #2", "nokey")]["speedup_ci"] == [1.1, 1.3]
    assert by[("bench #1", "greedy")]["tau_ci"] is None         # a benchmark from before intervals
    assert by[("draft", "old")]["capture"] == GONE and by[("draft", "old")]["model"] is None
    assert by[("draft", "old")]["val_acc1"] == 0.3 and by[("draft", "greedy")]["val_acc1"] == 0.4
    # sorted: the session's capture first (study by τ, then the newest benchmark), other captures, then none
    assert [(r["run"], r["name"]) for r in rows[:4]] == [("study #1", "greedy"), ("study #1", "default"),
                                                        ("bench #2", "nokey"), ("bench #2", "autoregressive")]
    assert [r["capture"] for r in rows[-2:]] == [None, None]
    assert {r["name"] for r in compare.filter_runs(rows, capture=B_KEY)} == {"greedy"}
    assert len(compare.filter_runs(rows, capture=B_KEY)) == 2
    assert [r["name"] for r in compare.filter_runs(rows, capture=None)] == ["autoregressive", "nokey"]
    assert all(r["kind"] == "draft" for r in compare.filter_runs(rows, kinds=["draft"]))
    frame = compare.runs_frame(rows)
    assert list(frame.columns)[:3] == ["kind", "run", "set / contender"] and len(frame) == len(rows)
    assert list(frame["τ [95% interval]"])[0] == "1.500 [1.400, 1.600]"        # intervals one way, as everywhere


def test_new_benchmarks_and_study_drafts_record_their_capture():
    s = Session(capture_key=A_KEY)
    apply._apply_bench(s, {"results": [{"name": "autoregressive", "tau": 1.0}]})
    apply._apply_bench(s, {"capture_key": B_KEY, "results": []})
    assert [b["capture_key"] for b in s.bench_results] == [A_KEY, B_KEY]
    apply._apply_study(s, {"capture": B_KEY, "rows": [{"strategies": ["greedy"], "layers": [1], "draft": "/d/x"}]})
    assert s.drafts[-1]["capture_key"] == B_KEY


# ---------------------------------------------------------------------------- the page (AppTest)

@pytest.fixture(scope="module")
def three_captures(app_store, tiny):
    """Keys of three tiny captures in the app's store: A and B of the 4-layer model on different prompts,
    C of a 6-layer model."""
    six = load_model("tiny-llama:layers=6")
    keys = []
    for model, seed in ((tiny, 0), (tiny, 1), (six, 0)):
        prompts = load_prompts("builtin", limit=3, seed=seed)
        keys.append(capture(model, prompts, app_store, max_new_tokens=6, batch_size=2).key)
    assert len(set(keys)) == 3
    return keys


def session_on(store, key: str) -> str:
    """A saved session whose capture is `key` (no statistics yet: the page computes them in a job)."""
    s = Session()
    apply.open_capture(s, store, key)
    storage.save(s, store)
    return s.id


def test_compare_page_says_clearly_when_there_are_fewer_than_two_captures(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSCOPE_STORE", str(tmp_path / "empty-store"))
    at = new_app().run()
    at.switch_page("app_pages/compare.py").run()
    no_exception(at)
    assert at.title[0].value == "Compare captures and runs"
    assert any("Comparing needs two captures; this store holds 0" in i.value for i in at.info)
    assert not charts(at)
    assert any("No benchmark, study or draft" in c.value for c in at.caption)


def test_compare_page_overlays_entropy_and_differences_cka(app_store, three_captures):
    a, b, c = three_captures
    at = new_app(session_on(app_store, a)).run()
    at.switch_page("app_pages/compare.py").run()
    settle(at)
    no_exception(at)
    assert at.selectbox(key="ls_w_cmp_a").value == a           # the session's capture ...
    assert at.selectbox(key="ls_w_cmp_b").value == c           # ... and the newest other one
    at.selectbox(key="ls_w_cmp_b").set_value(b).run()
    settle(at)
    no_exception(at)
    overlay, diff = charts(at)[:2]
    assert [len(t["y"]) for t in overlay["data"]] == [5, 5] and overlay["data"][0]["x"] == [0, 1, 2, 3, 4]
    heat = diff["data"][0]
    assert heat["type"] == "heatmap" and len(heat["z"]) == 5 and "linear kernel" in diff["layout"]["title"]["text"]
    metrics = {m.label: m.value for m in at.metric}
    flat = [abs(v) for i, row in enumerate(heat["z"]) for j, v in enumerate(row) if i < j]
    assert float(metrics["Mean |ΔCKA|"]) == pytest.approx(sum(flat) / len(flat), abs=1e-4) and max(flat) > 0
    assert float(metrics["Max |ΔCKA|"]) == pytest.approx(max(flat), abs=1e-4)

    # two models of different depth: relative depth, and one line on why there is no difference heatmap
    at.selectbox(key="ls_w_cmp_b").set_value(c).run()
    settle(at)
    no_exception(at)
    figs = charts(at)
    assert figs[0]["data"][1]["x"][-1] == 1.0 and len(figs[0]["data"][1]["x"]) == 7
    assert "relative depth" in figs[0]["layout"]["xaxis"]["title"]["text"]
    assert any("No CKA difference heatmap: capture A has 4 layers and B has 6" in i.value for i in at.info)
    assert [len(f["data"][0]["z"]) for f in figs[1:3]] == [5, 7]       # the two heatmaps side by side ...
    assert figs[1]["layout"]["height"] == figs[2]["layout"]["height"]   # ... at one height

    # a capture with itself: exactly zero, and a warning that says so
    at.selectbox(key="ls_w_cmp_b").set_value(a).run()
    settle(at)
    no_exception(at)
    assert any("same capture" in w.value for w in at.warning)
    assert all(v == 0 for row in charts(at)[1]["data"][0]["z"] for v in row)
    assert {m.label: m.value for m in at.metric}["Mean |ΔCKA|"] == "0.0000"


def test_compare_page_warns_that_statistics_saved_without_a_kernel_are_not_linear(app_store, three_captures):
    """A session's statistics from before the kernel option (no kernel field) beside linear ones: the kernels
    differ (the old ones are cosine), and the page says their CKA values are not on one footing."""
    a, b, _ = three_captures
    old = analyze(stored.open_capture(app_store, a)).to_dict()
    del old["kernel"]
    del old["options"]["kernel"]
    s = Session()
    apply.open_capture(s, app_store, a)
    apply.set_stats(s, old, {})
    storage.save(s, app_store)
    at = new_app(s.id).run()
    at.switch_page("app_pages/compare.py").run()
    settle(at)
    at.selectbox(key="ls_w_cmp_b").set_value(b).run()
    settle(at)
    no_exception(at)
    assert any("A's statistics use the cosine kernel, B's the linear kernel" in w.value for w in at.warning)


def test_compare_page_runs_table_filters_by_capture(app_store, three_captures):
    a, b, _ = three_captures
    s = session_with_runs()
    apply.open_capture(s, app_store, a)
    for d in s.drafts[:1]:
        d["capture_key"] = b
    s.study[0]["capture"] = a
    s.bench_results[1]["capture_key"] = a
    storage.save(s, app_store)
    at = new_app(s.id).run()
    at.switch_page("app_pages/compare.py").run()
    settle(at)
    no_exception(at)
    runs = at.dataframe[-1].value
    assert len(runs) == 9 and list(runs["capture"][:4]) == [a] * 4
    assert "—" in list(runs["capture"])                       # the old benchmark's plain decoding
    assert set(runs.loc[runs["capture"] == a, "model"]) == {"tiny-llama"}
    at.selectbox(key="ls_w_cmp_runs_capture").set_value(b).run()
    runs = at.dataframe[-1].value
    assert list(runs["set / contender"]) == ["greedy", "greedy"] and set(runs["capture"]) == {b}
    at.selectbox(key="ls_w_cmp_runs_capture").set_value("all").run()
    at.pills(key="ls_w_cmp_runs_kinds").set_value(["study"]).run()
    assert list(at.dataframe[-1].value["run"]) == ["study #1", "study #1"]
