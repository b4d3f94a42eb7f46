"""Results at a glance and a recommendation from evidence: the formatter, the recommendation, collapsed-draft flags,
the Home page, tables and charts as the pages draw them (AppTest on the tiny capture of tests/ui/test_app.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from layerscope import fmt
from layerscope.decoding import sanity
from layerscope.session import storage
from layerscope.study import recommend
from layerscope.study.recommend import Evidence, Ranked
from layerscope.ui import apply, tasks
from layerscope.ui.report import session_report
from tests.ui.test_app import captured, copy_of, frame_with, new_app, no_exception, plain, set_number, settle  # noqa: F401

SETS, SPEC, CKA = "app_pages/layer_sets.py", "app_pages/speculate.py", "app_pages/cka.py"


# ---------------------------------------------------------------------------- one formatter

def test_one_formatter_for_every_number():
    assert fmt.count(48450) == "48,450" and fmt.number(48450.0) == "48,450" and fmt.number(4.845e4) == "48,450"
    assert fmt.number(5.54791) == "5.548" and fmt.number(123.45) == "123.5" and fmt.number(None) == "—"
    assert fmt.number(float("nan")) == "—" and fmt.number(0.00012) == "0.00012"
    assert fmt.tau(1.13341) == "1.133" and fmt.delta(-0.1301) == "-0.130" and fmt.speedup(1.4234) == "1.42×"
    assert fmt.percent(0.245) == "24.5%"             # acceptance: one form (bars and tables alike)
    assert fmt.interval(1.2201, [1.18, 1.26]) == "1.220 [1.180, 1.260]"
    assert fmt.interval(-0.13, [-0.19, -0.08], "delta") == "-0.130 [-0.190, -0.080]"
    assert fmt.interval(1.42, [1.3, 1.55], "speedup") == "1.42× [1.30, 1.55]"
    assert fmt.interval(1.1, None) == "1.100" and fmt.interval(None, [1, 2]) == "—"
    assert fmt.layers([1, 14, 28]) == "[1, 14, 28]" and fmt.cell([1, 14, 28]) == "[1, 14, 28]"
    assert fmt.name("mean_entropy") == "mean entropy" and fmt.name("val_accuracy@1") == "held-out agreement @1"
    assert fmt.when("2026-12-01T10:09:40+00:00") != "2026-12-01T10:09:40+00:00"
    assert len(fmt.when("2026-12-01T10:09:40+0000")) == len("2026-12-01 10:09") and "T" not in fmt.when("2026-12-01T10:09:40Z")
    assert fmt.when("not a time") == "not a time" and fmt.when(None) == "—"
    for raw in ("../../etc/passwd", 'a "b"\nc', "<script>", "  ", "名前"):
        safe = fmt.file_part(raw)
        assert safe and all(c.isalnum() and c.isascii() or c in "._-" for c in safe) and ".." not in safe, (raw, safe)


# ---------------------------------------------------------------------------- the recommendation

def rows():
    """The issue's case: `aggregate` has the highest aggregate entropy (it maximises it), then lost its benchmark."""
    return [Ranked("aggregate", [1, 14, 27], 5.0, 3.0, 0.4), Ranked("default", [2, 15, 27], 4.5, 2.9, 0.5, is_default=True),
            Ranked("greedy", [1, 9, 20], 4.8, 3.1, 0.45), Ranked("all layers", list(range(30)), 6.0, 2.5, 0.6)]


def study(**taus):
    """Evidence of one study: name -> (τ, τ interval, Δ vs default, Δ interval)."""
    layers = {r.name: tuple(r.layers) for r in rows()}
    return Evidence(measured=[("study #1", {layers[n]: {"tau": t, "tau_ci": ci, "delta": d, "delta_ci": dci}
                                            for n, (t, ci, d, dci) in taus.items()})])


def test_the_recommendation_follows_measurements_within_one_size_and_says_why():
    # nothing measured: no proxy ranks the strategies; the default rule is the prior; other sizes apart
    rec = recommend.recommend(rows(), 3)
    assert rec.basis is None and rec.best.name == "default" and all(r.rank is None for r in rec.ranked)
    assert [r.name for r in rec.other_sizes] == ["all layers"] and all(len(r.layers) == 3 for r in rec.ranked)
    assert "every strategy maximises one of them" in rec.text
    # the study: aggregate lost to the default (Δ −0.13 [−0.19, −0.08]): the default is recommended, and why
    ev = study(aggregate=(1.22, [1.18, 1.26], -0.13, [-0.19, -0.08]), default=(1.36, [1.31, 1.40], 0.0, [0.0, 0.0]),
               greedy=(1.30, [1.25, 1.35], -0.06, [-0.10, -0.01]))
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.basis == "τ" and rec.source == "study #1" and rec.best.name == "default"
    assert [r.name for r in rec.ranked] == ["default", "greedy", "aggregate"] and [r.rank for r in rec.ranked] == [1, 2, 3]
    assert "1.360 [1.310, 1.400]" in rec.text
    assert rec.disagreement and "aggregate [1, 14, 27]" in rec.disagreement
    assert "1.220 [1.180, 1.260]" in rec.disagreement and "-0.130 [-0.190, -0.080]" in rec.disagreement
    # a set measured best but not beyond the interval: the default rule stays
    ev = study(greedy=(1.40, [1.33, 1.47], 0.04, [-0.02, 0.10]), default=(1.36, [1.31, 1.40], 0.0, [0.0, 0.0]))
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.best.name == "default" and "no set beat it beyond the interval" in rec.text and "+0.040 [-0.020, +0.100]" in rec.text
    # ... and beyond it: that set
    ev = study(greedy=(1.46, [1.40, 1.52], 0.10, [0.04, 0.16]), default=(1.36, [1.31, 1.40], 0.0, [0.0, 0.0]))
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.best.name == "greedy" and "above the default rule beyond the interval" in rec.text
    # no measured τ, trained drafts: their held-out agreement ranks, and the text says it is an estimate
    ev = Evidence(agreement={(1, 14, 27): 0.31, (1, 9, 20): 0.36})
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.basis == "held-out agreement" and rec.best.name == "greedy" and "36.0%" in rec.text
    assert "not a measurement of τ" in rec.text
    # evidence from drafts that did not learn is said to be doubtful
    ev = Evidence(agreement={(1, 14, 27): 0.004, (1, 9, 20): 0.36})
    rec = recommend.recommend(rows(), 3, ev)
    assert "Caution: the drafts behind aggregate [1, 14, 27] may not have learned" in rec.text
    # the probe alone ranks when nothing else does
    ev = Evidence(probe={(2, 15, 27): 0.12, (1, 14, 27): 0.10})
    assert recommend.recommend(rows(), 3, ev).best.name == "default"


def test_drafts_of_different_budgets_are_not_ranked_against_each_other():
    layers = {r.name: tuple(r.layers) for r in rows()}
    # the case: the shipped draft (1.25M tokens) against a 20-step draft (17k tokens)
    ev = Evidence(agreement={layers["default"]: 0.496, layers["greedy"]: 0.042},
                  drafts={layers["default"]: {"positions": 4000, "tokens": 1_250_000},
                          layers["greedy"]: {"positions": 4000, "tokens": 17_000}})
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.basis is None and "different budgets" in rec.text
    assert "1,250,000" in rec.text and "17,000" in rec.text and "highest held-out agreement" not in rec.text
    # two drafts of one budget rank; the third, of another budget, is named and left out
    ev.agreement[layers["aggregate"]] = 0.03
    ev.drafts[layers["aggregate"]] = {"positions": 4000, "tokens": 18_000}
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.basis == "held-out agreement" and rec.best.name == "greedy"
    assert {r.name: r.rank for r in rec.ranked}["default"] is None
    assert "Left out of the ranking: default [2, 15, 27] 1,250,000" in rec.text
    assert "over 4,000 held-out positions, 17,000 training tokens" in rec.text
    # a session's drafts carry their sample and budget (a continued draft: the tokens of both runs) into the evidence
    entry = tasks.draft_entry("/d", {"layers": [1, 9, 20], "val_accuracy": [0.4], "val_positions": 96,
                                     "tokens_seen": 17_000, "tokens_seen_total": 1_267_000})
    got = recommend.evidence_of(SimpleNamespace(study=[], bench_results=[], drafts=[entry], view={}, capture_key=None))
    assert got.drafts == {(1, 9, 20): {"positions": 96, "tokens": 1_267_000}}


def test_a_row_shows_one_drafts_figures():
    """Issue 51 (3): the shipped draft's τ (measured with lookup too) and a new 1k-token draft of the same set's
    agreement and budget shared one row. Now each draft of the set is its own row, labelled; τ is the run's first
    decoding of that draft (not its lookup row)."""
    shipped = {"name": "builtin", "path": "builtin", "layers": [2, 15, 27], "val_accuracy": 0.52,
               "tokens_seen": 3_750_000, "val_positions": 9000}
    fresh = {"name": "default-1k", "path": "/store/drafts/ab12", "layers": [2, 15, 27], "val_accuracy": 0.086,
             "tokens_seen": 1_556, "val_positions": 120}
    run = {"drafts": [{"name": "builtin", "path": "builtin", "layers": [2, 15, 27]},
                      {"name": "greedy", "path": "/store/drafts/cd34", "layers": [1, 9, 20]}],
           "results": [{"name": "autoregressive", "tau": 1.0},
                       {"name": "builtin chain k=2", "layers": [2, 15, 27], "decoding": "chain k=2", "tau": 1.61},
                       {"name": "builtin chain k=2 + lookup 4", "layers": [2, 15, 27],
                        "decoding": "chain k=2 + lookup 4", "tau": 1.803},
                       {"name": "greedy chain k=2", "layers": [1, 9, 20], "decoding": "chain k=2", "tau": 1.4}]}
    session = SimpleNamespace(study=[], bench_results=[run], drafts=[shipped, fresh], view={}, capture_key=None)
    rec = recommend.recommend(rows(), 3, recommend.evidence_of(session))
    default = [r for r in rec.ranked if r.layers == [2, 15, 27]]
    assert len(default) == 2
    measured, new = default
    assert (measured.tau, measured.agreement, measured.budget, measured.draft) == (1.61, 0.52, 3_750_000, "builtin")
    assert (new.tau, new.agreement, new.budget, new.draft) == (None, 0.086, 1_556, "default-1k")
    assert recommend.draft_text(measured) == "builtin · 3,750,000 tok · benchmark #1, chain k=2"
    assert recommend.draft_text(new) == "default-1k · 1,556 tok"
    assert "(draft builtin)" in measured.name and "(draft default-1k)" in new.name
    assert rec.basis == "τ" and not any(r.tau == 1.803 for r in rec.ranked)
    # the same draft behind τ and agreement: one row, as before
    session.drafts = [shipped]
    rec = recommend.recommend(rows(), 3, recommend.evidence_of(session))
    (one,) = [r for r in rec.ranked if r.layers == [2, 15, 27]]
    assert (one.tau, one.agreement, one.budget, one.draft, one.name) == (1.61, 0.52, 3_750_000, "builtin", "default")


def test_a_session_that_moved_to_another_model_is_not_told_the_first_models_verdict():
    """A session studied SmolLM2, then captured Gemma 3 in place ("Replace here"): SmolLM2's study, benchmark and
    drafts measured another model's layers, so none ranks Gemma's sets; the text says what was left out and why.
    Entries older than the fingerprint record count when their capture is the session's, and not otherwise."""
    layers = {r.name: tuple(r.layers) for r in rows()}
    smol_study = {"target_fingerprint": "gguf-smol", "rows": [
        {"layers": list(layers["greedy"]), "tau": 1.5, "tau_ci": [1.45, 1.55], "delta_vs_default": 0.2,
         "delta_ci": [0.1, 0.3]},
        {"layers": list(layers["default"]), "tau": 1.3, "tau_ci": [1.25, 1.35], "delta_vs_default": 0.0,
         "delta_ci": [0.0, 0.0]}]}
    smol_bench = {"target_fingerprint": "gguf-smol", "results": [
        {"name": "g", "layers": list(layers["greedy"]), "tau": 1.5}, {"name": "d", "layers": list(layers["default"]), "tau": 1.3}]}
    smol_draft = {"name": "g", "path": "/d", "layers": list(layers["greedy"]), "val_accuracy": 0.4,
                  "target_fingerprint": "gguf-smol"}

    def session(fingerprint, key="cc" * 12, study=(smol_study,), bench=(smol_bench,), drafts=(smol_draft,)):
        return SimpleNamespace(capture={"fingerprint": fingerprint}, capture_key=key, study=list(study),
                               bench_results=list(bench), drafts=list(drafts), view={})

    same = recommend.evidence_of(session("gguf-smol"))
    assert [src for src, _ in same.measured] == ["study #1", "benchmark #1"] and same.agreement and not same.other_target
    assert recommend.recommend(rows(), 3, same).best.name == "greedy"
    moved = recommend.evidence_of(session("gguf-gemma"))
    assert not moved.measured and not moved.agreement and moved.other_target == ["study #1", "benchmark #1"]
    rec = recommend.recommend(rows(), 3, moved)
    assert rec.basis is None and rec.best.name == "default"
    assert "Not used: study #1, benchmark #1, measured on another model" in rec.text
    # a later study of the new model is used; the earlier one of the other model is still named as left out
    gemma_study = {**smol_study, "target_fingerprint": "gguf-gemma"}
    ev = recommend.evidence_of(session("gguf-gemma", study=(smol_study, gemma_study), bench=()))
    assert [src for src, _ in ev.measured] == ["study #2"] and ev.other_target == []
    # older entries (no fingerprint): their capture decides
    old = {k: v for k, v in smol_bench.items() if k != "target_fingerprint"}
    ev = recommend.evidence_of(session("gguf-gemma", study=(), bench=({**old, "capture_key": "cc" * 12},), drafts=()))
    assert [src for src, _ in ev.measured] == ["benchmark #1"]
    ev = recommend.evidence_of(session("gguf-gemma", study=(), bench=({**old, "capture_key": "ab" * 12},), drafts=()))
    assert not ev.measured and ev.other_target == ["benchmark #1"]


def test_a_new_capture_of_another_model_marks_the_results_it_leaves_and_says_so():
    """The session's results name no model (made before results recorded one): when a capture of another model
    replaces the session's, they are marked as the previous model's, rank nothing for the new one, and a note
    says so; a new capture of the same model keeps them as evidence and says nothing."""
    from layerscope.session.model import Session
    from layerscope.ui.state import notes

    def session():
        s = Session(model="smollm2-135m", capture_key="ab" * 12,
                    capture={"num_layers": 30, "fingerprint": "gguf-smol", "hidden_size": 576})
        s.bench_results.append({"capture_key": "ab" * 12, "results": [
            {"name": "a", "layers": [1, 9, 20], "tau": 1.5}, {"name": "b", "layers": [2, 15, 27], "tau": 1.3}]})
        return s

    s = session()
    apply.capture_result(s, {"key": "cd" * 12, "summary": {"num_layers": 30, "fingerprint": "gguf-smol",
                                                            "hidden_size": 576}, "model": "smollm2-135m"})
    assert s.bench_results[0]["target_fingerprint"] == "gguf-smol" and not notes(s)
    assert [src for src, _ in recommend.evidence_of(s).measured] == ["benchmark #1"]
    s = session()
    apply.capture_result(s, {"key": "ef" * 12, "summary": {"num_layers": 18, "fingerprint": "gguf-gemma",
                                                            "hidden_size": 640}, "model": "gemma3-270m"})
    assert s.bench_results[0]["target_fingerprint"] == "gguf-smol"
    assert not recommend.evidence_of(s).measured and recommend.evidence_of(s).other_target == ["benchmark #1"]
    assert any("1 benchmark or study result(s) of the previous one stay listed, but no longer rank" in n
               for n in notes(s))


def test_statistics_of_options_changed_since_never_put_those_options_back():
    """The kernel clicked to cosine, then back to linear while cosine's statistics were computed: cosine's result,
    arriving last, is not applied (it would switch the session back to cosine); linear's is."""
    from layerscope.session.model import Session
    s = Session(model="tiny-llama", capture_key="ab" * 12, analysis_options={"kernel": "linear"})
    stats = {"entropy": [0.5, 0.6, 0.7], "cka": [[1.0, 0.5, 0.2], [0.5, 1.0, 0.4], [0.2, 0.4, 1.0]],
             "tokens_total": 10, "tokens_kept": 8}
    stale = {"capture_key": "ab" * 12, "requested": {"kernel": "cosine"}, "stats": stats}
    assert not apply.APPLIERS["analysis"](s, stale)
    assert s.analysis_options == {"kernel": "linear"} and not s.has_stats
    assert apply.APPLIERS["analysis"](s, {**stale, "requested": {"kernel": "linear"}})
    assert s.analysis_options == {"kernel": "linear"} and s.stats_dict()["requested"] == {"kernel": "linear"}


def test_every_ranking_states_its_sample_and_ties_are_called_ties():
    layers = {r.name: tuple(r.layers) for r in rows()}
    # the probe: 15 vs 13 of 96 positions from 2 held-out conversations is a tie, said with the sample
    probe = {layers["aggregate"]: ([8, 7], [48, 48]), layers["greedy"]: ([7, 6], [48, 48])}
    ev = Evidence(probe={k: sum(h) / 96 for k, (h, _) in probe.items()},
                  probe_sample={k: {"hits": h, "counts": c, "ci": [0.05, 0.3]} for k, (h, c) in probe.items()})
    rec = recommend.recommend(rows(), 3, ev)
    assert rec.basis == "probe agreement" and "A tie" in rec.text
    assert "96 held-out positions of 2 conversation(s)" in rec.text and "15.6% [5.0%, 30.0%]" in rec.text
    assert [r.rank for r in rec.ranked if r.probe is not None] == [1, 1] and all(r.tied for r in rec.ranked[:2])
    # many conversations and a clear difference: no tie, the runner-up said with its sample
    probe = {layers["aggregate"]: ([9] * 40, [10] * 40), layers["greedy"]: ([2] * 40, [10] * 40)}
    ev = Evidence(probe={k: sum(h) / 400 for k, (h, _) in probe.items()},
                  probe_sample={k: {"hits": h, "counts": c} for k, (h, c) in probe.items()})
    rec = recommend.recommend(rows(), 3, ev)
    assert "A tie" not in rec.text and rec.best.name == "aggregate" and [r.rank for r in rec.ranked[:2]] == [1, 2]
    assert "next, greedy [1, 9, 20]: 20.0%" in rec.text
    # drafts' agreement over few positions: a tie; over many: not
    few = Evidence(agreement={layers["aggregate"]: 0.36, layers["greedy"]: 0.31},
                   drafts={layers["aggregate"]: {"positions": 50}, layers["greedy"]: {"positions": 50}})
    assert "A tie" in recommend.recommend(rows(), 3, few).text
    many = Evidence(agreement=few.agreement, drafts={k: {"positions": 50_000} for k in few.agreement})
    assert "A tie" not in recommend.recommend(rows(), 3, many).text


def test_a_tie_over_too_few_conversations_says_so_once():
    """Issue 51 (4): six sets probed over the same 2 held-out conversations tie; the reason is one sentence in the
    paragraph, not one per set."""
    sets = [Ranked(f"s{i}", [1 + i, 10 + i, 20 + i], 4.0, 3.0, 0.4) for i in range(6)]
    ev = Evidence(probe={tuple(r.layers): 0.15 - 0.01 * i for i, r in enumerate(sets)},
                  probe_sample={tuple(r.layers): {"hits": [8 - i, 7], "counts": [48, 48], "ci": [0.05, 0.3]}
                                for i, r in enumerate(sets)})
    text = recommend.recommend(sets, 3, ev).text
    assert "A tie" in text and [r.rank for r in recommend.recommend(sets, 3, ev).ranked] == [1] * 6
    assert text.count("too few to tell sets apart") == 1 and text.count("held-out positions of 2 conversation(s)") == 1
    assert "no interval" not in text and "s5 [6, 15, 25] 10.0% [5.0%, 30.0%]" in text


def test_a_set_reading_the_embedding_is_never_recommended_on_a_tie():
    # the 64-layer model: every set at 100.0%, the best-ordered one reading layer 0
    sets = [Ranked("aggregate", [0, 32, 61], 5.0, 3.0, 0.4, flags=recommend.flags([0, 32, 61], 64)),
            Ranked("greedy", [1, 30, 60], 4.8, 3.1, 0.45), Ranked("entropy-topk", [3, 31, 62], 4.7, 3.2, 0.4)]
    same = {"hits": [24, 24, 24], "counts": [24, 24, 24]}
    ev = Evidence(probe={tuple(r.layers): 1.0 for r in sets}, probe_sample={tuple(r.layers): same for r in sets})
    rec = recommend.recommend(sets, 3, ev)
    assert [r.rank for r in rec.ranked] == [1, 1, 1] and "A tie" in rec.text
    assert rec.ranked[0].name == "aggregate" and rec.best.name == "greedy" and not rec.best.flags
    # with the default rule in the tie, the default rule
    sets.append(Ranked("default", [2, 32, 61], 4.5, 2.9, 0.5, is_default=True))
    ev.probe[(2, 32, 61)], ev.probe_sample[(2, 32, 61)] = 1.0, same
    assert recommend.recommend(sets, 3, ev).best.name == "default"


def tiny_study(s, measured: dict) -> dict:
    """A study result for the tiny session: {layers tuple: (τ, Δ vs default, Δ interval)}."""
    return {"rows": [{"strategies": ["default" if list(l) == [1, 2] else "manual"], "layers": list(l),
                      "draft": f"/nowhere/{i}", "mean_entropy": 1.0, "mean_cka": 0.5, "aggregate_entropy": 1.0,
                      "tau": t, "tau_ci": [t - 0.02, t + 0.02], "delta_vs_default": d, "delta_ci": dci,
                      "val_accuracy": [0.3, 0.1]}
                     for i, (l, (t, d, dci)) in enumerate(measured.items())],
            "prompts": 20, "options": {"train": {"steps": 300}, "prompts": "builtin", "max_new_tokens": 48, "depth": 3}}


def test_the_page_and_the_report_change_when_a_study_measures_otherwise(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    before = session_report(s)
    assert "Recommended: the default rule [1, 2]" in before and "nothing measured" in before
    s.study.append(tiny_study(s, {(1, 2): (1.36, 0.0, [0.0, 0.0]), (2, 3): (1.50, 0.14, [0.08, 0.20]),
                                  (1, 3): (1.20, -0.16, [-0.22, -0.10])}))
    storage.save(s, app_store)
    after = session_report(s)
    verdict = after[after.index("Verdict."):after.index("</div>", after.index("Verdict."))]
    assert "[2, 3]" in verdict.split(".")[1], verdict
    assert "ranked by τ (study #1)" in after and "1.500 [1.480, 1.520]" in after
    at = new_app(copy_of).run()
    at.switch_page(SETS).run()
    settle(at)
    no_exception(at)
    ranked = frame_with(at, "τ [95% CI]")
    assert list(ranked["layers"])[:3] == ["[2, 3]", "[1, 2]", "[1, 3]"] and list(ranked["rank"])[:3] == ["1", "2", "3"]
    assert any("ranked by τ (study #1)" in plain(m.value) for m in at.markdown)      # where the ranking's τ comes from
    text = plain(next(m.value for m in at.markdown if plain(m.value).startswith("Recommended: ")))
    assert "[2, 3]" in text and "+0.140 [+0.080, +0.200]" in text


# ---------------------------------------------------------------------------- collapsed drafts

def test_collapsed_or_untrained_drafts_are_flagged_with_the_reason():
    five = [{"name": n, "layers": l, "tau": 1.455, "val_accuracy": [0.21, 0.05]}
            for n, l in [("default", [2, 15, 27]), ("greedy", [1, 9, 20]), ("single", [29]), ("random", [4, 11, 22]),
                         ("last-k", [27, 28, 29])]]
    reasons = sanity.collapse_reasons(five)
    assert all("τ exactly 1.455" in r and "collapsed" in r for r in reasons)
    assert all("same held-out agreement" in r for r in reasons)
    said = sanity.collapse_warning(five, "sets")
    assert said.startswith("5 of 5 sets may not have learned") and "single [29]" in said
    assert sanity.collapse_reasons([{"layers": [1], "val_accuracy": [0.004]}])[0].startswith("held-out agreement 0.4% ≈ 0")
    assert "accepted none" in sanity.collapse_reasons([{"layers": [1, 2], "tau": 1.0}])[0]
    learned = [{"layers": [1, 2], "tau": 1.41, "val_accuracy": [0.33]}, {"layers": [2, 3], "tau": 1.37, "val_accuracy": [0.29]},
               {"layers": [1, 3], "tau": 1.41, "val_accuracy": [0.31]}]
    assert sanity.collapse_reasons(learned) == [None, None, None] and sanity.collapse_warning(learned) is None
    assert any("may not have learned" in w for w in sanity.study_warnings(five, prompts=40))


def test_a_draft_far_below_the_others_or_below_the_floor_is_flagged():
    # the 20-step draft: 4.2% against the shipped draft's 49.6%
    drafts = [{"name": "shipped", "layers": [2, 15, 27], "val_accuracy": [0.496]},
              {"name": "quick", "layers": [1, 9, 20], "val_accuracy": [0.042]}]
    shipped, quick = sanity.collapse_reasons(drafts)
    assert shipped is None and "far below the best other draft's 49.6%" in quick
    assert "quick [1, 9, 20]" in sanity.collapse_warning(drafts)
    assert "below 5.0%" in sanity.collapse_reasons([{"layers": [1], "val_accuracy": [0.04]}])[0]   # alone: the floor
    close = [{"layers": [1, 2], "val_accuracy": [0.30]}, {"layers": [2, 3], "val_accuracy": [0.12]}]
    assert sanity.collapse_reasons(close) == [None, None]                # behind, not far behind


def test_the_speculate_page_flags_drafts_that_did_not_learn(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.drafts = [{"name": "flat", "path": "/nowhere/flat", "layers": [1, 2], "val_accuracy": [0.003, 0.0], "steps": 300},
                {"name": "deep", "path": "/nowhere/deep", "layers": [1, 2, 3], "val_accuracy": [0.31, 0.12],
                 "steps": 300, "tokens_seen": 48450}]
    s.study.append(tiny_study(s, {l: (1.455, 0.0, [0.0, 0.0]) for l in [(1, 2), (2, 3), (1, 3), (3,)]}))
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    no_exception(at)
    drafts = frame_with(at, "held-out agreement per step")
    assert list(drafts["layers"]) == ["[1, 2]", "[1, 2, 3]"]             # in full, as text: no hidden third pill
    assert list(drafts["tokens seen"]) == ["—", "48,450"]               # never 4.845e+04
    assert list(drafts["simulated_acc_len"]) == ["0.003", "0.347"]       # 0.31 + 0.31 * 0.12: SpecForge's, no bonus
    assert drafts["flag"][0].startswith("held-out agreement 0.3% ≈ 0") and drafts["flag"][1] == ""
    warnings = [plain(w.value) for w in at.warning]
    assert any(w.startswith("1 of 2 drafts may not have learned (flat [1, 2])") for w in warnings), warnings
    assert any(w.startswith("4 of 4 sets may not have learned") and "τ exactly 1.455" in w for w in warnings), warnings
    studied = frame_with(at, "Δτ vs default")
    assert list(studied["τ"])[0] == "1.455 [1.435, 1.475]" and list(studied["mean CKA"])[-1] == "n/a"
    assert "τ low" not in studied.columns                                # intervals one way: value [lo, hi]
    corr = [m.value for m in at.markdown if m.value.startswith("**Spearman")]
    assert not corr or "mean_entropy" not in corr[0]                     # names as people read them


# ---------------------------------------------------------------------------- pages at a glance

def test_home_page_shows_the_workflow_progress_and_break_even(app_store, copy_of):
    at = new_app(copy_of).run()
    no_exception(at)
    assert at.title[0].value == "LayerScope"
    steps = [plain(m.value) for m in at.main.markdown if " · " in m.value and "**" in m.value]
    names = [x.split("**")[1] for x in steps]
    assert names == ["1 · Capture", "2 · Analyse", "3 · Layer sets", "4 · Drafts", "5 · Benchmark", "6 · Study"]
    assert "check_circle" in steps[0] and "check_circle" in steps[1] and "next" in steps[2]
    assert any("not measured yet" in c.value for c in at.caption)
    s = storage.load(app_store, copy_of)
    s.bench_results.append({"prompts": 4, "prompt_set": "builtin", "device": "cpu", "created": "2026-12-01T10:09:40+0000",
                            "cost_curve": [{"tokens": t, "seconds": 0.01 + 0.001 * (t - 1)} for t in range(1, 17)],
                            "draft_step_seconds": 0.002,
                            "results": [{"name": "autoregressive", "tau": 1.0}, {"name": "d", "layers": [1, 2], "tau": 1.3}]})
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    line = next(plain(m.value) for m in at.markdown if "Break-even τ on this machine" in m.value)
    # chain of depth K: (K draft steps + a target forward over K + 1 tokens) / one plain forward
    assert f"K = 1: {fmt.tau((0.002 + 0.011) / 0.01)}" in line and f"K = 3: {fmt.tau((3 * 0.002 + 0.013) / 0.01)}" in line
    assert "2026-12-01T" not in line


def test_tables_charts_and_names_read_at_a_glance(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.name = 'my/../"run" 1'
    s.add_layer_set("one", [3])
    s.analysis_options = {**s.analysis_options, "kernel": "cosine"}
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page(CKA).run()
    settle(at)
    no_exception(at)
    title = json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["title"]["text"]
    assert "cosine kernel" in title and "Linear" not in title               # the title names the kernel chosen
    charts = at.get("plotly_chart")
    buttons = [b for b in at.get("download_button") if b.proto.label.startswith("Download ")]
    assert len(buttons) == len(charts) and all(b.proto.label == "Download PNG" for b in buttons)   # one per chart
    assert all("toImage" in json.loads(c.proto.config)["modeBarButtonsToRemove"] for c in charts)   # no second one
    at.switch_page(SETS).run()
    session_sets = frame_with(at, "problem")
    assert list(session_sets["mean CKA"]) == ["n/a"] and list(session_sets["layers"]) == ["[3]"]
    side = "\n".join(m.value for m in at.sidebar.markdown)
    assert "unsaved" not in side and "saved as you work" in side       # (the browser test reads the file names)


def test_the_probe_scores_the_sets_and_then_ranks_them(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(SETS).run()
    settle(at)
    at.button(key="ls_sets_probe").click().run()
    settle(at)
    no_exception(at)
    s = at.session_state["ls_session"]
    scores = {tuple(x["layers"]): x["agreement"] for x in s.view["probe"]["sets"]}
    assert s.view["probe"]["capture_key"] == s.capture_key and len(scores) >= 3
    assert all(0.0 <= a <= 1.0 for a in scores.values())
    ranked = frame_with(at, "τ [95% CI]")
    held = {tuple(x["layers"]): x for x in s.view["probe"]["sets"]}
    assert list(ranked["probe [95% CI]"]) == [fmt.interval(scores[tuple(json.loads(l))],
                                                           held[tuple(json.loads(l))]["agreement_ci"], "percent")
                                              for l in ranked["layers"]]
    assert all(x["counts"] and len(x["hits"]) == len(x["counts"]) for x in held.values())    # the sample is kept
    measured = [scores[tuple(json.loads(l))] for l in ranked["layers"]]
    assert measured == sorted(measured, reverse=True) and list(ranked["rank"])[0] == "1"
    text = plain(next(m.value for m in at.markdown if plain(m.value).startswith("Recommended: ")))
    assert "probe agreement" in text and "confirm it with drafts" in text
    assert "held-out positions of" in text and "conversation" in text          # the sample behind the ranking
    assert at.button(key="ls_sets_probe").disabled                  # every set has its score
    assert any(m.value.startswith("Probe of") for m in at.success)
    set_number(at, "ls_w_sets_k", 1).run()            # another size: its sets are not scored ...
    no_exception(at)
    assert not any(m.value.startswith("Probe of") for m in at.success)   # ... so no stale "done"
    assert not at.button(key="ls_sets_probe").disabled


def test_the_compare_page_sets_benchmark_runs_side_by_side(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    for i, (k, tau) in enumerate([(2, 1.21), (3, 1.34)]):
        s.bench_results.append({"prompts": 8, "prompt_set": "builtin", "max_new_tokens": 48, "k": k, "device": "cpu",
                                "created": f"2026-12-0{i + 1}T10:00:00+0000",
                                "results": [{"name": "autoregressive", "tau": 1.0, "speedup": 1.0},
                                            {"name": "d", "layers": [1, 2], "tau": tau, "tau_ci": [tau - 0.05, tau + 0.05],
                                             "speedup": 0.8, "speedup_ci": [0.7, 0.9]}]})
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page("app_pages/compare.py").run()
    no_exception(at)
    options = frame_with(at, "option")
    assert list(options.columns) == ["option", "#1", "#2"]
    row = dict(zip(options["option"], zip(options["#1"], options["#2"])))
    assert row["draft depth K"] == ("2", "3") and row["prompts"] == ("8", "8") and "T" not in row["when"][0]
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    tau = next(f for f in specs if f["layout"]["title"]["text"].startswith("τ of each contender"))
    assert [t["name"] for t in tau["data"]] == ["#1", "#2"] and tau["data"][1]["y"] == [1.0, 1.34]
    assert tau["data"][1]["error_y"]["array"][1] == pytest.approx(0.05)
    runs = frame_with(at, "τ [95% interval]")
    assert "1.340 [1.290, 1.390]" in list(runs["τ [95% interval]"])


def test_a_new_study_becomes_the_shown_one(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.study = [tiny_study(s, {(1, 2): (1.30, 0.0, [0.0, 0.0]), (2, 3): (1.31, 0.01, [-0.02, 0.04])}),
               tiny_study(s, {(1, 2): (1.32, 0.0, [0.0, 0.0]), (1, 3): (1.33, 0.01, [-0.02, 0.04])})]
    s.view["study_run"] = 0                     # the user was looking at the first one
    apply._apply_study(s, tiny_study(s, {(1, 2): (1.40, 0.0, [0.0, 0.0]), (2, 3): (1.50, 0.10, [0.05, 0.15])}))
    assert s.view["study_run"] == 2
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    no_exception(at)
    assert at.selectbox(key="ls_spec_study_run").value == 2
    assert any(plain(m.value).startswith("Latest study: 2 sets") for m in at.markdown)
    assert "1.500 [1.480, 1.520]" in list(frame_with(at, "Δτ vs default")["τ"])


def test_a_set_keeps_its_colour_from_one_chart_to_the_next(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.add_layer_set("mine", [1, 3])
    s.add_layer_set("theirs", [2, 3])
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page("app_pages/entropy.py").run()
    settle(at)

    def colours(chart):
        out = {}
        for trace in json.loads(chart.proto.spec)["data"]:
            marker = trace.get("marker") or {}
            colour = (marker.get("line") or {}).get("color") if marker.get("color") == "rgba(0,0,0,0)" else marker.get("color")
            if trace.get("name", "").startswith(("mine", "theirs", "default")):
                out[trace["name"].split(" ")[0]] = colour
        return out

    on_curve = colours(at.get("plotly_chart")[0])
    at.switch_page(CKA).run()
    on_heatmap = colours(at.get("plotly_chart")[0])
    assert on_heatmap == {k: on_curve[k] for k in ("mine", "theirs")}, (on_curve, on_heatmap)
    assert len(set(on_curve.values())) == 3
    assert on_curve["default"] == "#555555"              # the default rule is grey everywhere
