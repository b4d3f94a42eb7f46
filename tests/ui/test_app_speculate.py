"""The Speculative decoding page's logic without Streamlit (layerscope.ui.speculate): the sets a draft trains for,
the tables of drafts, benchmark runs and studies, and the lines the page shows."""

from __future__ import annotations

import subprocess
import sys

from layerscope import fmt
from layerscope.decoding import specdec
from layerscope.decoding.bench import parse_lookup
from layerscope.ui import speculate


def test_the_page_logic_needs_no_streamlit():
    code = "import sys, layerscope.ui.speculate; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_train_sets_add_the_default_rule_once():
    mine = [{"name": "mine", "layers": [1, 3], "strategy": "manual"}]
    sets = speculate.train_sets(mine, 6)
    assert sets[0] == ("mine", [1, 3], "manual") and [x[0] for x in sets] == ["mine", "default"]
    assert speculate.train_sets([{"name": "d", "layers": sets[1][1], "strategy": "default"}], 6) == [("d", sets[1][1], "default")]
    assert speculate.train_sets([], 0) == []


def test_a_small_capture_is_named_and_a_big_one_is_not():
    assert "holds 1,200 tokens" in speculate.small_capture_warning({"tokens": 1200})
    assert speculate.small_capture_warning({"tokens": speculate.SMALL_CAPTURE_TOKENS}) is None
    assert "holds 0 tokens" in speculate.small_capture_warning(None)


def test_drafts_table_and_the_store_picker():
    drafts = [{"name": "a", "layers": [1, 2], "steps": 300, "train_tokens": 5000, "val_accuracy": [0.25, 0.125],
               "seconds": 72.0, "path": "/store/drafts/abc"}]
    row = speculate.drafts_frame(drafts).iloc[0]
    assert row["layers"] == "[1, 2]" and row["tokens seen"] == 5000 and row["trained in"] == "72 s"
    assert row["held-out agreement per step"] == "25.0%, 12.5%" and row["stored as"] == "abc" and row["flag"] == ""
    assert row["simulated_acc_len"] == "0.281"                         # 0.25 + 0.25 * 0.125, no bonus token
    assert speculate.simulated_of(0.25) is None and speculate.simulated_of(None) is None   # older: position 1 alone
    older = {**drafts[0], "val_accuracy": 0.25, "curve": [[100, 0.25]]}      # an older record: position 1 alone
    row = speculate.drafts_frame([older]).iloc[0]
    assert row["held-out agreement per step"] == "25.0%" and row["simulated_acc_len"] == fmt.MISSING
    learned = speculate.learning_frame([older, {**drafts[0], "curve": [[100, [0.25, 0.125]]]}],
                                       {"/store/drafts/abc": "a"}).to_dict("records")
    assert [r["simulated_acc_len"] for r in learned] == [fmt.MISSING, "0.281"]
    assert learned[0]["held-out agreement per step"] == "25.0%"
    stored = [drafts[0], {"name": "b", "layers": [3], "steps": 50, "capture_key": "k2", "path": "/store/drafts/b"}]
    choices = speculate.stored_choices(stored, drafts, "k1")
    assert list(choices) == ["/store/drafts/b"] and choices["/store/drafts/b"][1] == "b [3] · 50 steps · capture k2 · b"
    twins = [{**stored[1], "path": "/store/drafts/b2", "saved": "2026-12-01T10:09:00+00:00"}, stored[1]]
    labels = [label for _, label in speculate.stored_choices(twins, drafts, "k1").values()]
    assert len(set(labels)) == 2 and labels[0].endswith(" · b2") and " · saved " in labels[0]   # apart
    assert speculate.broken_text([{"key": "x", "problem": "no weights", "fix": "retrain"}]) == \
        "1 draft(s) in the store cannot be used:\n  x: no weights. retrain"


def test_bench_choice_and_live_acceptance():
    drafts = [{"path": "p1"}, {"path": "p2"}, {"path": "p3"}]
    assert speculate.bench_kept(drafts, ["p2", "gone"]) == ["p1", "p3"]
    assert speculate.bench_skipped(drafts, ["p1"]) == ["p2", "p3"]
    live = speculate.live_acceptance({"acceptance": {"a": {"accepted": [3, 1], "drafted": [4, 0]},
                                                     "b": {"accepted": [], "drafted": []}}})
    assert live == {"a": [0.75, 0.0]}
    assert speculate.is_online({"phase": "eval"}) and not speculate.is_online({"phase": "train", "loss": 1.0})
    assert speculate.online_curves({"curve": [{"set": "a", "tokens": 10, "accuracy": 0.1},
                                              {"set": "a", "tokens": 20, "accuracy": 0.2}]}) == {"a": [[10, 0.1], [20, 0.2]]}


def test_a_benchmark_run_as_a_table():
    res = {"results": [{"name": "autoregressive", "tau": 1.0, "tokens_per_s": 20.0, "lossless": True},
                       {"name": "d", "layers": [1, 2], "tau": 1.5, "tau_ci": [1.4, 1.6], "speedup": 1.2,
                        "acceptance_by_position": [0.5, 0.25], "lossless": False,
                        "by_category": {"qa": {"tau": 1.5}, "code": {"tau": 1.4}}}],
           "drafts": [{"name": "d", "path": "p"}]}
    df, collapsed = speculate.bench_frame(res, [{"path": "p", "val_accuracy": [0.3]}])
    assert list(df["τ"]) == ["1.000", "1.500 [1.400, 1.600]"] and list(df["acc@2"]) == [fmt.MISSING, "25.0%"]
    assert "chosen K" not in df.columns and "predicted" not in df.columns and collapsed is None
    assert speculate.not_lossless(res["results"]) == ["d"]
    acc, layers = speculate.acceptance_of(res["results"])
    assert acc == {"d": [0.5, 0.25]} and layers == {"autoregressive": None, "d": [1, 2]}
    assert list(speculate.category_frame(res["results"])["category"]) == ["code", "qa"]
    assert speculate.category_frame(res["results"][:1]) is None


def test_a_study_as_a_table_and_its_lines():
    rows = [{"strategies": ["default"], "layers": [1, 2], "tau": 1.3, "mean_entropy": 1.0, "mean_cka": 0.5,
             "aggregate_entropy": 2.0, "seeds": [{"curve": [[10, 0.1]]}], "val_accuracy": [0.5, 0.5, 0.5]},
            {"strategies": ["manual"], "layers": [3], "tau": 1.4, "mean_entropy": 1.1, "mean_cka": 0.0,
             "aggregate_entropy": 1.5}]
    mine = [{"name": "mine", "layers": [3]}]
    res = {"rows": rows, "prompts": 8, "device": "cpu", "options": {"train": {"steps": 300}, "prompts": "builtin",
                                                                      "max_new_tokens": 48, "depth": 3}}
    df = speculate.study_frame(rows, mine)
    assert list(df["set"]) == ["default", "mine"] and list(df["mean CKA"]) == ["0.500", fmt.NOT_APPLICABLE]
    assert list(df["simulated_acc_len"]) == ["0.875", fmt.MISSING]     # 0.5 + 0.25 + 0.125; no agreement recorded
    assert speculate.study_heading(res, 1, 2) == ("Latest study: 2 sets · 300 training steps each · 8 builtin prompts × "
                                                  "48 tokens · K = 3 · cpu")
    assert speculate.study_heading(res, 0, 2).startswith("Study #1: ")
    assert speculate.study_label([res], 0).startswith("#1 · 2 sets · 8 prompts · ")
    curves, layers = speculate.study_curves(rows, mine)
    assert curves == {"default": [[10, 0.1]]} and layers == {"default": [1, 2], "mine": [3]}
    assert speculate.spearman_text({"mean_entropy": 0.4, "mean_cka": None}) == "mean entropy +0.400 · mean CKA n/a"
    assert speculate.correlations_frame(res) is None
    assert [r["name"] for r in speculate.study_bench_rows(rows, mine)] == ["default", "mine"]


def test_the_benchmarks_lookup_choices_are_what_bench_takes():
    parsed = [parse_lookup(v) for v in speculate.LOOKUP_CHOICES]
    assert parsed == [(0, False), (specdec.DEFAULT_LOOKUP, False),
                      (specdec.LookupSpan(specdec.DEFAULT_LOOKUP, specdec.DEFAULT_ADAPTIVE_CAP), False), (0, True)]
    assert list(speculate.LOOKUP_CHOICES.values())[0] == "off"
