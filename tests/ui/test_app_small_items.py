"""Issue 51's smaller things, through streamlit.testing.v1.AppTest and the helpers the pages rest on: a typed layer
and Enter pick that one layer, a slider's value is the value applied, picks keep to the set size, Start capture waits
for a refused entry to be fixed, Compare keeps its captures, imports and read-only sessions read apart, one word for a
hand-picked set, whole numbers as whole numbers, a color per contender, each draft's own agreement.

Uses the tiny capture of tests/ui/test_app.py (one per module) and its helpers; each test opens its own copy of that
session through ``?session=ID``.
"""

from __future__ import annotations

import re

from streamlit.proto.SelectWidgetFilterMode_pb2 import SelectWidgetFilterMode

from layerscope import fmt
from layerscope.decoding import sanity
from layerscope.session import share, storage
from layerscope.session.model import Session, owner_hash
from layerscope.ui import plots
from layerscope.ui.access import OWNER_KEY
from layerscope.ui.picks import heatmap_picks, picks_over_limit
from layerscope.ui.report import _table
from layerscope.ui.speculate import run_warnings
from tests.ui.test_app import (  # noqa: F401
    captured,
    charts,
    copy_of,
    frame_with,
    new_app,
    no_exception,
    plain,
    set_number,
    settle,
    sidebar_text,
    start_tiny_capture,
)

SETS, CKA, ENTROPY, CAPTURE, COMPARE, SESSIONS = ("app_pages/layer_sets.py", "app_pages/cka.py", "app_pages/entropy.py",
                                                  "app_pages/capture.py", "app_pages/compare.py", "app_pages/sessions.py")


# ---------------------------------------------------------------------------- 1. a typed layer and Enter

def enter_picks(options: list[str], typed: str, *, select_all: int, filter_mode: int) -> list[str]:
    """What Enter picks in Streamlit's multiselect after typing `typed`, by its documented rule (st.multiselect's
    `select_all` and `filter_mode`, as its proto carries them): the dropdown's first row, which is "Select N matches"
    (all of them) when that row shows (two or more matches, at most `select_all` of them), else the first match.
    Fuzzy matches are in-order subsequences, the closest first."""
    if filter_mode == SelectWidgetFilterMode.FILTER_MODE_PREFIX:
        matches = [o for o in options if o.startswith(typed)]
    elif filter_mode == SelectWidgetFilterMode.FILTER_MODE_CONTAINS:
        matches = [o for o in options if typed in o]
    else:
        pattern = re.compile(".*".join(map(re.escape, typed)))
        matches = sorted((o for o in options if pattern.search(o)), key=lambda o: (o != typed, len(o)))
    bulk = len(matches) >= 2 and select_all != 0 and (select_all < 0 or len(matches) <= select_all)
    return matches if bulk else matches[:1]


def test_enter_on_a_typed_layer_picks_that_one_layer(app_store, copy_of):
    thirty = [str(i) for i in range(30)]
    # Streamlit's defaults (select_all=1000, fuzzy): the "8" then Enter picks 8, 18 and 28
    assert enter_picks(thirty, "8", select_all=1000, filter_mode=SelectWidgetFilterMode.FILTER_MODE_FUZZY) == \
        ["8", "18", "28"]
    at = new_app(copy_of).run()
    at.switch_page(SETS).run()
    settle(at)
    no_exception(at)
    for page, key in ((SETS, "ls_sets_manual"), (CKA, "ls_cka_picks")):
        at.switch_page(page).run()
        no_exception(at)
        proto = at.multiselect(key=key).proto
        assert proto.select_all == 0                       # no "Select N matches" row for Enter to take
        for typed in ("8", "2", "1"):
            assert enter_picks(thirty, typed, select_all=proto.select_all, filter_mode=proto.filter_mode) == [typed]
        assert enter_picks(list(proto.options), "3", select_all=proto.select_all, filter_mode=proto.filter_mode) == ["3"]


# ---------------------------------------------------------------------------- 2. the slider's value is the value applied

def test_a_slider_moved_by_the_user_is_not_set_back_by_the_page(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(ENTROPY).run()
    settle(at)
    at.slider(key="ls_ent_threshold").set_value(0.75).run()
    # the page sent no value of its own back over the user's: a run begun before the last arrow-key step would
    # have sent the step before it (shown 0.75, applied 0.70)
    assert not at.slider(key="ls_ent_threshold").proto.set_value
    at.radio(key="ls_w_ent_scale").set_value("normalized").run()        # another run, another widget
    assert not at.slider(key="ls_ent_threshold").proto.set_value and at.slider(key="ls_ent_threshold").value == 0.75
    assert not at.radio(key="ls_w_ent_scale").proto.set_value            # bind_view too
    assert any("threshold 0.5 → 0.75" in c.value for c in at.caption)
    at.button(key="ls_ent_recompute").click().run()
    at.button(key="ls_ent_confirm").click().run()
    settle(at)
    no_exception(at)
    assert at.session_state["ls_session"].analysis_options["min_entropy"] == 0.75
    assert {m.label: m.value for m in at.metric}["Threshold"] == "0.75 nats"
    at.switch_page(SETS).run()
    settle(at)
    at.slider(key="ls_w_sets_lam").set_value(0.75).run()
    assert not at.slider(key="ls_w_sets_lam").proto.set_value
    assert at.session_state["ls_session"].view["sets_lam"] == 0.75


# ---------------------------------------------------------------------------- 3. picks keep to the set size

def _cell(row, col):
    return {"curve_number": 1, "point_index": row * 9 + col, "x": col, "y": row, "customdata": [row, col, 0.5]}


def test_clicks_on_the_heatmap_keep_to_the_set_size_as_a_box_does():
    click = {"points": [_cell(1, 5)], "box": [], "lasso": []}
    assert heatmap_picks(click, [2], limit=3, num_layers=8) == ([1, 2, 5], None)
    picks, said = heatmap_picks(click, [2, 3], limit=3, num_layers=8)        # 4 layers: refused, and said
    assert picks == [2, 3] and said == ("The click would add [1, 5] to the 2 picked layer(s), [2, 3]: 4 layers, more "
                                        "than the set size k = 3 (Layer sets page), so it picked none. Unpick a layer "
                                        "first (click a picked cell again, or remove it under the heatmap), or raise k "
                                        "on the Layer sets page.")
    assert heatmap_picks(click, [1, 2, 3, 5], limit=3, num_layers=8) == ([2, 3], None)   # unpicking is always allowed
    box = {"points": [_cell(r, c) for r in (4, 5) for c in (4, 5)], "box": [{"type": "rect"}], "lasso": []}
    picks, said = heatmap_picks(box, [1, 2], limit=3, num_layers=8)           # a box within k, but 4 in all
    assert picks == [1, 2] and said.startswith("The box would add [4, 5] to the 2 picked layer(s)")
    assert picks_over_limit([1, 2, 3], 3) is None
    assert picks_over_limit([0, 1, 2, 3, 4], 3).startswith("5 layers picked, [0, 1, 2, 3, 4]: more than the set size k = 3")


def test_the_picked_layers_box_holds_at_most_k_and_says_when_more_came_from_elsewhere(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(CKA).run()
    settle(at)
    assert at.multiselect(key="ls_cka_picks").proto.max_selections == 2      # k: tiny-llama's default rule [1, 2]
    assert not any("more than the set size" in plain(w.value) for w in at.warning)
    at.switch_page(SETS).run()
    at.multiselect(key="ls_sets_manual").set_value([0, 1, 2]).run()           # a hand-picked set of 3 there
    at.switch_page(CKA).run()
    no_exception(at)
    assert any(plain(w.value).startswith("3 layers picked, [0, 1, 2]: more than the set size k = 2")
               for w in at.warning)
    assert at.multiselect(key="ls_cka_picks").proto.max_selections == 3      # no more; fewer is fine
    at.multiselect(key="ls_cka_picks").set_value([1, 2]).run()
    assert at.session_state["ls_session"].manual_picks == [1, 2]
    assert not any("more than the set size" in plain(w.value) for w in at.warning)


# ---------------------------------------------------------------------------- 8. Start capture and a refused entry

def test_start_capture_is_off_while_a_field_shows_a_refused_entry(app_store):
    at = new_app().run()
    at.switch_page(CAPTURE).run()
    at.text_input(key="ls_w_cap_model").set_value("tiny-llama").run()
    assert not at.button(key="ls_cap_start").disabled
    set_number(at, "ls_w_cap_limit", "1e3").run()
    assert at.error and at.button(key="ls_cap_start").disabled               # the field still keeps 16: not started
    assert any("entry it refused" in c.value for c in at.caption)
    set_number(at, "ls_w_cap_limit", "3").run()
    no_exception(at)
    assert not at.error and not at.button(key="ls_cap_start").disabled


# ---------------------------------------------------------------------------- 11. Compare keeps its captures

def test_compare_keeps_capture_a_and_b_across_page_switches(app_store, copy_of):
    other = new_app().run()
    start_tiny_capture(other, limit=2, new_tokens=4, batch=2)                # a second capture in the store
    settle(other)
    no_exception(other)
    second = other.session_state["ls_session"].capture_key
    at = new_app(copy_of).run()
    mine = at.session_state["ls_session"].capture_key
    assert second and second != mine
    at.switch_page(COMPARE).run()
    no_exception(at)
    assert (at.selectbox(key="ls_w_cmp_a").value, at.selectbox(key="ls_w_cmp_b").value) == (mine, second)
    at.selectbox(key="ls_w_cmp_a").set_value(second).run()
    at.selectbox(key="ls_w_cmp_b").set_value(mine).run()
    at.switch_page(CKA).run()                                                 # away, and Back
    at.switch_page(COMPARE).run()
    no_exception(at)
    assert (at.selectbox(key="ls_w_cmp_a").value, at.selectbox(key="ls_w_cmp_b").value) == (second, mine)


# ---------------------------------------------------------------------------- 6. a file imported twice

def test_a_session_file_imported_twice_gives_two_names(store):
    me = owner_hash("browser A")
    s = Session(name="first look", owner=me)
    storage.save(s, store)
    data = share.export_bytes(s)
    one, two = (share.import_bytes(data, store, owner=me) for _ in range(2))
    assert len({s.id, one.id, two.id}) == 3
    assert (one.name, two.name) == ("first look (imported)", "first look (imported) (2)")
    names = sorted(r["name"] for r in storage.list_sessions(store, owner=me))
    assert names == ["first look", "first look (imported)", "first look (imported) (2)"]
    assert share.import_bytes(data, store, owner=me).name == "first look (imported) (3)"
    assert share.distinct_name("x" * 120, store, owner=me, own_id="none") == "x" * 120        # not taken: as it is
    storage.save(Session(name="x" * 120, owner=me), store)
    longer = share.distinct_name("x" * 120, store, owner=me, own_id="none")
    assert longer.endswith(" (2)") and len(longer) == 120


# ---------------------------------------------------------------------------- 7. a shared link in the sidebar

def test_the_sidebar_says_read_only_until_make_my_copy(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.name = "A's look"
    storage.save(s, app_store)
    other = new_app(copy_of, browser="someone else").run()
    no_exception(other)
    said = sidebar_text(other)
    assert "read-only" in said and "A's look" in plain(said) and copy_of in said
    assert "saved as you work" not in said and "(copy)" not in plain(said)
    other.button(key="ls_make_copy").click().run()
    no_exception(other)
    said = plain(sidebar_text(other))
    assert "read-only" not in said and "saved as you work" in said and "A's look (copy)" in said
    assert owner_hash(other.session_state[OWNER_KEY]) == storage.load(app_store, other.session_state["ls_session"].id).owner


# ---------------------------------------------------------------------------- 10. one word: hand-picked

def test_a_hand_picked_set_reads_hand_picked_everywhere(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page(SETS).run()
    settle(at)
    at.multiselect(key="ls_sets_manual").set_value([0, 3]).run()
    options = at.multiselect(key="ls_sets_to_add").options
    assert "hand-picked [0, 3]" in options and not any(o.startswith("manual") for o in options)
    at.multiselect(key="ls_sets_to_add").set_value(["hand-picked [0, 3]"]).run()
    at.button(key="ls_sets_add").click().run()
    no_exception(at)
    assert at.session_state["ls_session"].layer_sets[-1]["strategy"] == "manual"      # stored as before
    shown = [str(v) for d in at.dataframe for c in d.value.columns for v in d.value[c]]
    assert "hand-picked" in shown and "manual" not in shown
    assert fmt.strategy("manual") == "hand-picked" and fmt.strategy("greedy") == "greedy"
    assert plots._study_set({"strategies": ["default", "manual"], "layers": [1, 2]}) == "default/hand-picked [1, 2]"


# ---------------------------------------------------------------------------- 9. whole numbers, heatmap height

def test_the_report_prints_whole_numbers_as_whole_numbers():
    page = _table([{"rank": 1, "set": "a", "held-out positions": 128, "training tokens": 1556, "mean CKA": 0.5},
                   {"rank": None, "set": "b", "held-out positions": None, "training tokens": None, "mean CKA": None},
                   {"rank": 2.0, "set": "c", "held-out positions": 64.0, "training tokens": float("nan"),
                    "mean CKA": fmt.NOT_APPLICABLE}])
    cells = re.findall(r"<td>(.*?)</td>", page)
    assert cells == ["1", "a", "128", "1,556", "0.500", "—", "b", "—", "—", "—", "2", "c", "64", "—", "n/a"]
    assert "1.000" not in page and "128.0" not in page


def test_a_heatmap_is_no_taller_than_the_square_matrix_at_1024_px():
    """At 1024 px the page's plot is about 460 px wide (1024 − the 336 px sidebar − padding − margins and the colour
    bar); the matrix is square, so a plot taller than that showed a blank band above the matrix."""
    for n in (5, 19, 31, 65):
        for fig in (plots.cka_heatmap([[1.0] * n] * n), plots.cka_difference_heatmap([[0.0] * n] * n)):
            plot_height = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
            assert plot_height <= 460, (n, fig.layout.height)


# ---------------------------------------------------------------------------- 5. a color per contender, legends

def test_each_contender_has_its_own_color_and_legends_keep_off_the_titles():
    default = [1, 2]
    colors = plots.palette([[1, 2], [2, 3]], default=default)
    acc = {"builtin": [0.5, 0.2], "default": [0.4, 0.1], "greedy": [0.3, 0.1], "mine": [0.2, 0.1]}
    layers = {"builtin": [1, 2], "default": [1, 2], "greedy": [2, 3], "mine": [2, 3]}
    fig = plots.acceptance_bars(acc, layers=layers, colors=colors)
    bars = [t.marker.color for t in fig.data]
    assert len(set(bars)) == 4 and bars[0] == colors[(1, 2)] and bars[2] == colors[(2, 3)]     # a set's own first
    assert [t.marker.color for t in plots.acceptance_bars(acc, layers=layers, colors=colors).data] == bars   # stable
    live = plots.acceptance_bars({"default [1, 2]": [0.5], "default [1, 2] (online)": [0.4]})   # no layers: by name
    assert len({t.marker.color for t in live.data}) == 2
    rows = [{"name": "autoregressive", "tau": 1.0}, {"name": "builtin", "layers": [1, 2], "tau": 1.2},
            {"name": "default", "layers": [1, 2], "tau": 1.1}]
    assert len(set(plots.bench_comparison(rows, colors=colors).data[0].marker.color)) == 3
    # every legend under the plot or right of it, never up beside the title
    figures = [fig, plots.tau_over_time([1, 2, 1]), plots.learning_curves({"a": [[10, [0.1]]], "b": [[10, [0.2]]]}),
               plots.entropy_overlay({"A": [1.0, 2.0], "B": [1.5, 2.5]}),
               plots.cost_curve([{"tokens": 1, "seconds": 1.0}, {"tokens": 2, "seconds": 1.1}],
                                steps=[{"name": "d", "verified_tokens": 2, "break_even_tau": 1.1}]),
               plots.runs_comparison({"#1": rows, "#2": rows}),
               plots.study_intervals([{"strategies": ["default"], "layers": [1, 2], "tau": 1.2, "seeds": [{"tau": 1.1}]}])]
    for f in figures:
        legend = f.layout.legend
        assert (legend.y < 0 and legend.yanchor == "top") or legend.x > 1, (f.layout.title.text, legend)


# ---------------------------------------------------------------------------- 4. each draft's own agreement

def test_the_warning_on_several_drafts_quotes_each_ones_agreement():
    drafts = [{"name": n, "layers": l, "val_accuracy": [a]}
              for n, l, a in [("a", [1], 0.004), ("b", [2], 0.009), ("c", [3], 0.012)]]
    said = sanity.collapse_warning(drafts)
    assert said.startswith("3 of 3 drafts may not have learned (a [1], b [2], c [3]): ")
    for name, share_ in (("a [1]", "0.4%"), ("b [2]", "0.9%"), ("c [3]", "1.2%")):
        assert f"{name}: held-out agreement {share_} ≈ 0" in said
    one = sanity.collapse_warning(drafts[:1] + [{"name": "good", "layers": [4], "val_accuracy": [0.4]}])
    assert one.startswith("1 of 2 drafts may not have learned (a [1]): held-out agreement 0.4% ≈ 0")



def test_outputs_that_differ_in_bfloat16_are_explained_and_in_float32_called_a_bug():
    """On a CPU where bfloat16 is faster the target runs in it, and a verification of several tokens rounds apart from a
    one-token step: a near-tie can flip. The page said "a bug in the decoder" even then (seen on SmolLM2, K=2)."""
    rows = [{"name": "autoregressive", "lossless": True}, {"name": "builtin auto chain k=2", "lossless": False}]
    bf16 = run_warnings({"results": rows, "dtype": "bfloat16", "prompts": 40}, [])
    fp32 = run_warnings({"results": rows, "dtype": "float32", "prompts": 40}, [])
    [(level, text)] = [w for w in bf16 if "Outputs differ" in w[1]]
    assert level == "warning" and "bfloat16" in text and "LAYERSCOPE_DTYPE=float32" in text and "bug" not in text
    [(level, text)] = [w for w in fp32 if "Outputs differ" in w[1]]
    assert level == "error" and "bug in the decoder" in text


def test_with_aligned_rows_a_bf16_difference_is_a_bug_except_in_transformers_decoders():
    """Since bf16 forwards are padded to aligned rows (specdec.row_alignment) LayerScope's decoders are exact in bf16:
    a difference is a bug again. transformers' assisted and lookup decoders are not padded: theirs is explained."""
    rows = [{"name": "autoregressive", "lossless": True}, {"name": "builtin auto chain k=2", "lossless": False},
            {"name": "hf-assisted", "lossless": False}]
    said = run_warnings({"results": rows, "dtype": "bfloat16", "row_align": 16, "prompts": 40}, [])
    [(level, text)] = [w for w in said if w[1].startswith("Outputs differ")]
    assert level == "error" and "builtin auto chain k=2" in text and "hf-assisted" not in text
    [(level, text)] = [w for w in said if w[1].startswith("Outputs of transformers")]
    assert level == "warning" and "hf-assisted" in text and "bug" not in text
    fp32 = run_warnings({"results": rows, "dtype": "float32", "prompts": 40}, [])
    [(level, text)] = [w for w in fp32 if "Outputs differ" in w[1]]
    assert level == "error" and "hf-assisted" in text                       # in float32 everyone must agree
