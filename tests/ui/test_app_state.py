"""State that sticks, through streamlit.testing.v1.AppTest: controls keep their values on a return to their
page and in a new tab, nothing in the session changes without saying so, new results become the shown ones.

Uses the tiny capture of tests/ui/test_app.py (one per module) and its helpers; each test opens its own copy of
that session through ``?session=ID``.
"""

from __future__ import annotations

import json
from pathlib import Path

from layerscope.draft import builtin
from layerscope.session import storage
from layerscope.session.model import new_id
from layerscope.ui.widgets import text_key
from tests.ui.test_app import captured, copy_of, new_app, no_exception, number_shown, plain, set_number, settle, start_tiny_capture  # noqa: F401

ENTROPY, CKA, SPEC, SETS, CAPTURE = ("app_pages/entropy.py", "app_pages/cka.py", "app_pages/speculate.py",
                                     "app_pages/layer_sets.py", "app_pages/capture.py")


def entropy_controls(at) -> dict:
    return {"alpha": at.select_slider(key="ls_ent_alpha").value, "kernel": at.radio(key="ls_ent_kernel").value,
            "filter": at.toggle(key="ls_ent_filter").value, "threshold": at.slider(key="ls_ent_threshold").value,
            "response": at.toggle(key="ls_ent_response").value,
            "max_tokens": number_shown(at, "ls_ent_max_tokens")}


def test_entropy_controls_keep_their_values_on_return_and_in_a_new_tab(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(ENTROPY).run()
    settle(at)
    applied = dict(at.session_state["ls_session"].analysis_options)
    at.select_slider(key="ls_ent_alpha").set_value(2.0)
    at.radio(key="ls_ent_kernel").set_value("cosine")
    at.slider(key="ls_ent_threshold").set_value(1.5)
    set_number(at, "ls_ent_max_tokens", 4096)
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
    set_number(at, "ls_w_spec_steps", 7)
    set_number(at, "ls_w_spec_seed", 3)
    assert at.checkbox(key="ls_w_spec_fc_norm").value is True              # TrainOptions' default
    at.checkbox(key="ls_w_spec_fc_norm").uncheck()
    at.run()
    at.switch_page(ENTROPY).run()
    at.switch_page(SPEC).run()
    no_exception(at)
    assert number_shown(at, "ls_w_spec_steps") == 7
    assert number_shown(at, "ls_w_spec_seed") == 3
    assert at.checkbox(key="ls_w_spec_fc_norm").value is False
    other = new_app(copy_of).run()
    other.switch_page(SPEC).run()
    assert number_shown(other, "ls_w_spec_steps") == 7


def test_the_fc_norm_box_trains_a_draft_with_fc_norm_or_without(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    set_number(at, "ls_w_spec_steps", 2)
    seen = set()
    for on in (True, False):                                      # on by default, then unticked
        if not on:
            at.checkbox(key="ls_w_spec_fc_norm").uncheck().run()
        at.button(key="ls_spec_train").click().run()
        settle(at)
        no_exception(at)
        (path,) = {Path(d["path"]) for d in at.session_state["ls_session"].drafts} - seen    # the new draft
        seen.add(path)
        assert json.loads((path / "config.json").read_text())["fc_norm"] is on
        assert json.loads((path / "layerscope.json").read_text())["options"].get("fc_norm", False) is on


def test_a_new_draft_joins_the_comparison_and_a_new_benchmark_is_shown(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.add_layer_set("pair", [1, 3])
    storage.save(s, app_store)
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    set_number(at, "ls_w_spec_steps", 2).run()
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
    set_number(at, "ls_w_spec_bench_n", 1)
    set_number(at, "ls_w_spec_bench_new", 4)
    at.run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    set_number(at, "ls_w_spec_bench_n", 2).run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    no_exception(at)
    runs = at.session_state["ls_session"].bench_results
    assert len(runs) == 2 and runs[-1]["prompts"] == 2
    assert at.selectbox(key="ls_spec_bench_run").value == 1, "the new benchmark is the one shown"
    assert any("over the 2 prompts" in plain(c.value) for c in at.caption)      # the table is the new run's


def test_a_stored_draft_added_to_the_session_leaves_the_picker_which_then_offers_what_is_left(app_store, captured):
    """The store's picker offers the drafts for this model the session lacks, each under its own label. Once one is
    added it leaves the list, and the picker shows one still offered. (Twins once shared a label: the picker kept the
    added draft as its choice, and the next run failed on a choice that was no longer an option.)"""
    trainer = storage.load(app_store, captured)
    trainer.id = new_id()
    storage.save(trainer, app_store)
    at = new_app(trainer.id).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()
    set_number(at, "ls_w_spec_steps", 2)
    for seed in (11, 12):                   # two drafts of one set and length in the store: only their seeds differ
        set_number(at, "ls_w_spec_seed", seed).run()
        at.button(key="ls_spec_train").click().run()
        settle(at)
        no_exception(at)
    trained = [d["path"] for d in at.session_state["ls_session"].drafts]
    fresh = storage.load(app_store, captured)                     # another session on the same capture, no drafts
    fresh.id = new_id()
    storage.save(fresh, app_store)
    other = new_app(fresh.id).run()
    other.switch_page(SPEC).run()
    offered = len(other.selectbox(key="ls_spec_stored").options)
    assert offered >= 2
    other.selectbox(key="ls_spec_stored").set_value(trained[0]).run()
    other.button(key="ls_spec_add_stored").click().run()
    other.run()                                                   # the run after the add replays the picker
    no_exception(other)
    assert trained[0] in [d["path"] for d in other.session_state["ls_session"].drafts]
    picker = other.selectbox(key="ls_spec_stored")
    assert len(picker.options) == offered - 1
    assert picker.value != trained[0] and picker.index is not None      # a choice the picker offers


def refusals(at) -> list[str]:
    return [plain(e.value).replace("**", "") for e in at.error]


def test_a_typed_number_of_the_wrong_kind_is_refused_in_one_line_never_turned_into_another(app_store, copy_of):
    """What is typed reaches the app as typed (a browser's number input sent '1e3' as 1 and dropped letters): an entry
    that is not a whole number says what was wrong and what to type, and the field and the session keep their number."""
    at = new_app(copy_of).run()
    at.switch_page(SPEC).run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()     # the tiny capture starts online (small)
    set_number(at, "ls_w_spec_steps", 40).run()
    assert storage.load(app_store, copy_of).view["spec_steps"] == 40
    for typed, line in [("1e3", "'1e3' is not a whole number in digits. Type 1000; the field keeps 40."),
                        ("2.5", "'2.5' is not a whole number. Type 2 or 3; the field keeps 40."),
                        ("40abc", "'40abc' is not a number. Type a whole number from 1 to 1000000; the field keeps 40."),
                        ("", "Training steps is empty. Type a whole number from 1 to 1000000; the field keeps 40."),
                        ("0", "Training steps must be in [1, 1000000] (got 0). Type a whole number from 1 to 1000000; "
                              "the field keeps 40.")]:
        set_number(at, "ls_w_spec_steps", typed).run()
        no_exception(at)
        assert refusals(at) == [line]                                   # one line, under the field
        assert at.text_input(key=text_key("ls_w_spec_steps")).value == typed      # what was typed stays in view once
        assert at.session_state["ls_w_spec_steps"] == 40
        assert storage.load(app_store, copy_of).view["spec_steps"] == 40
    at.run()
    assert number_shown(at, "ls_w_spec_steps") == 40 and not refusals(at)   # then the field shows its number again
    set_number(at, "ls_w_spec_steps", " 1000 ").run()                 # digits are taken, spaces around them too
    assert not refusals(at) and storage.load(app_store, copy_of).view["spec_steps"] == 1000
    at.switch_page(ENTROPY).run()
    settle(at)
    set_number(at, "ls_ent_max_tokens", "4e3").run()
    assert refusals(at) == ["'4e3' is not a whole number in digits. Type 4000; the field keeps 8192."]
    assert at.button(key="ls_ent_recompute").disabled                  # nothing changed, nothing to apply
    set_number(at, "ls_ent_max_tokens", "4000").run()
    assert not at.button(key="ls_ent_recompute").disabled and not refusals(at)


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
    set_number(at, "ls_w_spec_bench_k", 3).run()
    at.switch_page(CAPTURE).run()
    at.switch_page(SPEC).run()
    no_exception(at)
    assert at.toggle(key="ls_w_spec_bench_auto").value is False
    assert number_shown(at, "ls_w_spec_bench_k") == 3                   # not reset to the default K
    set_number(at, "ls_w_spec_bench_k", "three").run()
    assert any("'three' is not a number" in line for line in refusals(at))
    at.switch_page(CAPTURE).run()
    at.switch_page(SPEC).run()
    assert number_shown(at, "ls_w_spec_bench_k") == 3                   # the last good value stayed
    # taken out of the session, the builtin draft does not come back
    s = at.session_state["ls_session"]
    s.drafts = []
    storage.save(s, app_store)
    again = new_app(s.id).run()
    again.switch_page(SPEC).run()
    no_exception(again)
    assert again.session_state["ls_session"].drafts == []
