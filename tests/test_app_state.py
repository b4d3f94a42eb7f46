"""State that sticks, through streamlit.testing.v1.AppTest: controls keep their values on a return to their
page and in a new tab, nothing in the session changes without saying so, new results become the shown ones.

Uses the tiny capture of tests/test_app.py (one per module) and its helpers; each test opens its own copy of
that session through ``?session=ID``.
"""

from __future__ import annotations

import json
from pathlib import Path

from layerscope.draft import builtin
from layerscope.session import storage
from tests.test_app import captured, copy_of, new_app, no_exception, plain, settle, start_tiny_capture  # noqa: F401

ENTROPY, CKA, SPEC, SETS, CAPTURE = ("app_pages/entropy.py", "app_pages/cka.py", "app_pages/speculate.py",
                                     "app_pages/layer_sets.py", "app_pages/capture.py")


def entropy_controls(at) -> dict:
    return {"alpha": at.select_slider(key="ls_ent_alpha").value, "kernel": at.radio(key="ls_ent_kernel").value,
            "filter": at.toggle(key="ls_ent_filter").value, "threshold": at.slider(key="ls_ent_threshold").value,
            "response": at.toggle(key="ls_ent_response").value,
            "max_tokens": at.number_input(key="ls_ent_max_tokens").value}


def test_entropy_controls_keep_their_values_on_return_and_in_a_new_tab(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(ENTROPY).run()
    settle(at)
    applied = dict(at.session_state["ls_session"].analysis_options)
    at.select_slider(key="ls_ent_alpha").set_value(2.0)
    at.radio(key="ls_ent_kernel").set_value("cosine")
    at.slider(key="ls_ent_threshold").set_value(1.5)
    at.number_input(key="ls_ent_max_tokens").set_value(4096)
    at.run()
    edited = {"alpha": 2.0, "kernel": "cosine", "filter": True, "threshold": 1.5, "response": True, "max_tokens": 4096}
    assert entropy_controls(at) == edited
    # away and back: the controls show what was typed, not their minimums (α 0.5, filter off, threshold 0, 8 tokens)
    at.switch_page(CKA).run()
    at.switch_page(ENTROPY).run()
    no_exception(at)
    assert entropy_controls(at) == edited
    # a reload or a new tab on the same session shows them too
    other = new_app(copy_of).run()
    other.switch_page(ENTROPY).run()
    assert entropy_controls(other) == edited
    # nothing is applied without a confirm that lists every change
    assert at.session_state["ls_session"].analysis_options == applied
    at.button(key="ls_ent_recompute").click().run()
    no_exception(at)
    assert at.session_state["ls_session"].analysis_options == applied
    review = "\n".join(plain(m.value) for m in at.markdown)
    for change in ("α 1 → 2", "threshold 0.5 → 1.5", "max tokens 8192 → 4096", "kernel linear → cosine"):
        assert change in review, review
    at.button(key="ls_ent_confirm").click().run()
    settle(at)
    no_exception(at)
    opts = at.session_state["ls_session"].analysis_options
    assert (opts["alpha"], opts["kernel"], opts["min_entropy"], opts["max_tokens"]) == (2.0, "cosine", 1.5, 4096)
    assert {m.label: m.value for m in at.metric}["Threshold"] == "1.50 nats"
    at.switch_page(CKA).run()
    at.switch_page(ENTROPY).run()
    assert entropy_controls(at) == edited           # now the applied options, still as typed


def test_a_new_capture_keeps_the_sets_that_fit_and_says_which_did_not(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.capture_key, s.capture, s.stats, s.arrays = None, {}, {}, {}        # as if it came from a 30-layer model
    s.add_layer_set("fits", [1, 2])
    s.add_layer_set("deep", [1, 14, 28])
    s.manual_picks = [1, 14, 28]
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    start_tiny_capture(at, limit=3, new_tokens=6, batch=2)               # the module's capture: from the store
    settle(at)
    no_exception(at)
    s = at.session_state["ls_session"]
    assert s.capture_key and [x["layers"] for x in s.layer_sets] == [[1, 2]]
    assert s.manual_picks != [1], "a hand-picked set is never truncated"
    assert s.manual_picks in ([], [1, 14, 28])
    said = " ".join(plain(w.value) for w in at.warning)
    assert "deep [1, 14, 28]" in said and "hand-picked layers [1, 14, 28]" in said, said
    # the note stays until it is dismissed, on any page
    at.switch_page(SETS).run()
    assert any("deep [1, 14, 28]" in plain(w.value) for w in at.warning)
    at.button(key="ls_notes_dismiss").click().run()
    assert not any("deep [1, 14, 28]" in plain(w.value) for w in at.warning)


def test_training_options_stay_after_navigating_away(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    at.number_input(key="ls_w_spec_steps").set_value(7)
    at.number_input(key="ls_w_spec_seed").set_value(3)
    assert at.checkbox(key="ls_w_spec_fc_norm").value is False             # TrainOptions' default
    at.checkbox(key="ls_w_spec_fc_norm").check()
    at.run()
    at.switch_page(ENTROPY).run()
    at.switch_page(SPEC).run()
    no_exception(at)
    assert at.number_input(key="ls_w_spec_steps").value == 7
    assert at.number_input(key="ls_w_spec_seed").value == 3
    assert at.checkbox(key="ls_w_spec_fc_norm").value is True
    other = new_app(copy_of).run()
    other.switch_page(SPEC).run()
    assert other.number_input(key="ls_w_spec_steps").value == 7


def test_the_fc_norm_box_trains_a_draft_with_fc_norm(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    at.number_input(key="ls_w_spec_steps").set_value(2)
    at.checkbox(key="ls_w_spec_fc_norm").check().run()
    at.button(key="ls_spec_train").click().run()
    settle(at)
    no_exception(at)
    path = Path(at.session_state["ls_session"].drafts[0]["path"])
    assert json.loads((path / "config.json").read_text())["fc_norm"] is True
    assert json.loads((path / "layerscope.json").read_text())["options"]["fc_norm"] is True


def test_a_new_draft_joins_the_comparison_and_a_new_benchmark_is_shown(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.add_layer_set("pair", [1, 3])
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    at.number_input(key="ls_w_spec_steps").set_value(2).run()
    at.button(key="ls_spec_train").click().run()            # the first set: pair [1, 3]
    settle(at)
    no_exception(at)
    first = at.session_state["ls_session"].drafts[0]["path"]
    assert at.multiselect(key="ls_spec_bench_drafts").value == [first]
    at.selectbox(key="ls_w_spec_set").set_value(at.selectbox(key="ls_w_spec_set").options[-1]).run()   # default
    at.button(key="ls_spec_train").click().run()
    settle(at)
    no_exception(at)
    paths = [d["path"] for d in at.session_state["ls_session"].drafts]
    assert len(paths) == 2
    assert at.multiselect(key="ls_spec_bench_drafts").value == paths, "a newly trained draft is compared too"
    # a benchmark, then another: the new one is the one shown
    at.radio(key="ls_w_spec_bench_src").set_value("builtin")
    at.toggle(key="ls_w_spec_bench_auto").set_value(False)          # a fixed K: no calibration run
    at.number_input(key="ls_w_spec_bench_n").set_value(1)
    at.number_input(key="ls_w_spec_bench_new").set_value(4)
    at.run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    at.number_input(key="ls_w_spec_bench_n").set_value(2).run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    no_exception(at)
    runs = at.session_state["ls_session"].bench_results
    assert len(runs) == 2 and runs[-1]["prompts"] == 2
    assert at.selectbox(key="ls_spec_bench_run").value == 1, "the new benchmark is the one shown"
    assert any("over the 2 prompts" in plain(c.value) for c in at.caption)      # the table is the new run's


def test_letters_in_a_number_field_are_refused_not_turned_into_its_minimum(app_store, copy_of):
    """In the browser, letters typed into a number field reach the app as an empty field (input type=number), which
    Streamlit's own number input turns into its minimum (1 training step) without a word: set_value(None) is that."""
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    at.number_input(key="ls_w_spec_steps").set_value(40).run()
    at.number_input(key="ls_w_spec_steps").set_value(None).run()
    no_exception(at)
    assert at.number_input(key="ls_w_spec_steps").value == 40
    assert any("Training steps: that was not a number, so it was refused; the field keeps 40" in plain(w.value)
               for w in at.warning), [w.value for w in at.warning]
    assert storage.load(app_store, copy_of).view["spec_steps"] == 40
    at.switch_page(ENTROPY).run()
    settle(at)
    at.number_input(key="ls_ent_max_tokens").set_value(None).run()
    assert at.number_input(key="ls_ent_max_tokens").value == 8192
    assert at.button(key="ls_ent_recompute").disabled                  # nothing changed, nothing to apply
    assert any("Max tokens: that was not a number" in plain(w.value) for w in at.warning)


def test_a_new_session_meets_the_builtin_draft_preselected_and_its_k_choice_sticks(app_store):
    at = new_app().run()
    at.switch_page(SPEC).run()
    no_exception(at)
    path = str(builtin.builtin_path())
    s = at.session_state["ls_session"]
    assert [(d["name"], d["path"]) for d in s.drafts] == [("builtin", path)]
    assert at.multiselect(key="ls_spec_bench_drafts").value == [path]            # preselected for the benchmark
    assert any("needs a capture" in plain(i.value) for i in at.info)             # and training says what it needs
    assert at.toggle(key="ls_w_spec_bench_auto").value is True                   # the benchmark's default is auto
    at.toggle(key="ls_w_spec_bench_auto").set_value(False).run()
    at.number_input(key="ls_w_spec_bench_k").set_value(3).run()
    at.switch_page(CAPTURE).run()
    at.switch_page(SPEC).run()
    no_exception(at)
    assert at.toggle(key="ls_w_spec_bench_auto").value is False
    assert at.number_input(key="ls_w_spec_bench_k").value == 3                   # not reset to the default K
    at.number_input(key="ls_w_spec_bench_k").set_value(None).run()               # what letters become
    assert at.number_input(key="ls_w_spec_bench_k").value in (None, 3)
    assert any("was refused" in plain(w.value) for w in at.warning)
    at.switch_page(CAPTURE).run()
    at.switch_page(SPEC).run()
    assert at.number_input(key="ls_w_spec_bench_k").value == 3                   # the last good value stayed
    # taken out of the session, the builtin draft does not come back
    s = at.session_state["ls_session"]
    s.drafts = []
    storage.save(s, app_store)
    again = new_app(s.id).run()
    again.switch_page(SPEC).run()
    no_exception(again)
    assert again.session_state["ls_session"].drafts == []
