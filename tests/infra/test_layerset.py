"""Layer sets are read and checked in one place: the same one line from the command line, selection and training."""

from __future__ import annotations

import pytest

from layerscope import layerset
from layerscope.errors import DraftError, SelectionError, SessionError
from layerscope.session.model import Session
from layerscope.stats import select
from layerscope.stats.analysis import analyze


@pytest.mark.parametrize("text, layers", [("2,15,27", [2, 15, 27]), (" 27, 2 ,15 ", [27, 2, 15]), ("0", [0]),
                                          ("3,", [3])])
def test_parse_reads_integers_in_the_order_given(text, layers):
    assert layerset.parse(text) == layers


@pytest.mark.parametrize("text, said", [("", "names no layer"), (" , ", "names no layer"),
                                        ("2,x", "not a comma-separated list of integers"),
                                        ("2,-1", "negative layer"), ("2,2,3", "repeats [2]")])
def test_parse_refuses_with_one_line_naming_the_flag(text, said):
    with pytest.raises(SelectionError) as e:
        layerset.parse(text, "--candidates")
    assert said in str(e.value) and "--candidates" in str(e.value)


def test_check_sorts_and_names_what_is_out_of_range_against_the_targets_depth():
    assert layerset.check([27, 2, 15], 30) == [2, 15, 27]
    with pytest.raises(DraftError) as e:
        layerset.check([1, 9, 30], 4, "--layers", DraftError)
    line = str(e.value)
    assert "--layers 1,9,30: layers [9, 30] are out of range: outside 0..3 of this target (4 decoder layers)" in line
    with pytest.raises(SelectionError, match="repeats \\[1\\]"):
        layerset.check([1, 1], 4)
    with pytest.raises(SelectionError, match="names no layer"):
        layerset.check([], 4)


def test_check_sets_refuses_a_set_given_twice_in_any_order():
    assert layerset.check_sets([[3, 1], [2]], 4) == [[1, 3], [2]]
    with pytest.raises(SelectionError, match="1,3 is given twice"):
        layerset.check_sets([[1, 3], [3, 1]], 4)
    with pytest.raises(SelectionError, match="No layer set"):
        layerset.check_sets([], 4)


def test_selection_and_online_training_use_the_same_wording(tiny_capture):
    with pytest.raises(SelectionError) as a:
        select.select(tiny_capture_stats(tiny_capture), strategy="manual", layers=[1, 9])
    with pytest.raises(DraftError) as b:
        layerset.check_sets([[1, 9]], tiny_capture.num_layers, "Layer set", DraftError)
    assert str(a.value).split(":")[1] == str(b.value).split(":")[1]      # " layers [9] are out of range"


def tiny_capture_stats(cap):
    return analyze(cap)


def test_is_valid_is_the_same_rule_as_a_yes_or_no():
    assert layerset.is_valid([0, 3], 4) and layerset.is_valid([7]) and not layerset.is_valid([4], 4)
    assert not layerset.is_valid([1, 1], 4) and not layerset.is_valid([], 4) and not layerset.is_valid([-1])
    assert not layerset.is_valid([True, 2], 4) and not layerset.is_valid("1,2", 4)


def test_a_session_refuses_a_bad_set_in_the_same_words(tiny_capture):
    s = Session(capture={"num_layers": 4})
    assert s.add_layer_set("mine", [3, 1])["layers"] == [1, 3]
    with pytest.raises(SessionError, match="layers \\[9\\] are out of range: outside 0..3"):
        s.add_layer_set("bad", [1, 9])
    with pytest.raises(SessionError, match="names no layer"):
        s.add_layer_set("empty", [])
