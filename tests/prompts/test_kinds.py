"""Kinds of conversation (prompts/kinds.py): the rules on fixed requests, the --kinds weights, and ShareGPT draws
weighted by kind (the packaged file)."""

from __future__ import annotations

import random

import pytest

from layerscope.draft.training.online import OnlineOptions
from layerscope.errors import DraftError, PromptSetError
from layerscope.prompts import sharegpt
from layerscope.prompts.kinds import KINDS, canonical, kind_of, parse_weights, weighted_order
from layerscope.prompts.sets import load_prompts

RULES = [
    ("Write a Python function that reverses a linked list.", "code"),
    ("Why does this crash?\n```\nint main() { return *p; }\n```", "code"),
    ("import pandas as pd\ndf = pd.read_csv('a.csv')\nwhat is wrong here", "code"),
    ("I get TypeError: __init__() takes 2 positional arguments", "code"),
    ("Translate this Python code to JavaScript", "code"),                      # a programming language, no natural one
    ("Translate the following into French: The cat sleeps on the sofa.", "translation"),
    ("Translate the comments of this code into Spanish:\n```python\n# add two numbers\ndef add(a, b):\n"
     "    return a + b\n```", "translation"),                                    # a translation request holding code
    ("How do you say 'good morning' in Japanese?", "translation"),
    ("请把这段话翻译成英文：今天天气很好。", "translation"),                          # non-English requests
    ("Traduce al inglés: me gusta la música.", "translation"),
    ("Summarize this code:\n```js\nconst f = x => x * 2;\n```", "summarization"),
    ("Can you give me a brief summary of the French Revolution?", "summarization"),
    ("tl;dr of the article below please", "summarization"),
    ("请总结一下这篇文章的主要观点。", "summarization"),
    ("Solve 2x + 3 = 11 for x.", "math"),
    ("What is 17 * 23?", "math"),
    ("Calculate the area of a circle with radius 4 cm.", "math"),
    ("Find the derivative of sin(x) * x^2", "math"),
    ("Write a poem about the sea.", "chat"),
    ("你好，请介绍一下你自己。", "chat"),                                           # Chinese, no rule: chat
    ("Wie spät ist es in Berlin?", "chat"),
    ("I have 3-4 years of experience in sales; write my cover letter.", "chat"),  # a range is no arithmetic
    ("Tell me about Japanese culture and food.", "chat"),                        # a language that closes no clause
    ("Write me a resume for a nurse", "chat"),
    ("Continue writing please\n\nPlease write in English language.지금 번역하기", "chat"),   # ShareGPT page residue
    ("please continue 1 / 1", "chat"),
]


@pytest.mark.parametrize("text,kind", RULES)
def test_the_first_rule_that_matches_decides_the_kind(text, kind):
    assert kind_of(text) == kind


def test_weights_name_every_kind_and_refuse_bad_specs_in_one_line():
    assert parse_weights("code=2") == {"code": 2, "translation": 1, "summarization": 1, "math": 1, "chat": 1}
    assert parse_weights(" code = 1 , *=0 ") == {"code": 1, "translation": 0, "summarization": 0, "math": 0, "chat": 0}
    assert canonical(parse_weights("chat=0,math=2.5")) == "code=1,translation=1,summarization=1,math=2.5,chat=0"
    for spec, says in [("code", "not KIND=WEIGHT"), ("prose=2", "not a kind"), ("code=2,code=3", "twice"),
                       ("code=-1", "at least 0"), ("code=nan", "finite"), ("code=two", "must be a number"),
                       ("*=0", "every kind out")]:
        with pytest.raises(DraftError, match=says) as e:
            OnlineOptions(prompts="sharegpt", steps=1, kinds=spec).validate()
        assert "\n" not in str(e.value) and e.value.fix
    with pytest.raises(DraftError, match="--prompts sharegpt"):
        OnlineOptions(prompts="builtin", steps=1, kinds="code=2").validate()
    with pytest.raises(PromptSetError, match="ShareGPT"):
        load_prompts("builtin", kind_weights=parse_weights("code=2"))


def test_weighted_order_draws_by_weight_and_keeps_the_plain_order_for_equal_weights():
    kinds = ["code", "chat"] * 5000
    plain = list(range(len(kinds)))
    random.Random(3).shuffle(plain)                           # the plain draw's order (prompts/sets._sample)
    even = {k: 2.0 for k in KINDS}
    assert weighted_order(kinds, even, 3) == plain
    only_code = weighted_order(kinds, {**even, "chat": 0}, 3)
    assert only_code == [i for i in plain if kinds[i] == "code"]     # weight 0 leaves out, the rest keep their order
    three = weighted_order(kinds, {**even, "code": 3.0, "chat": 1.0}, 3)
    assert three == weighted_order(kinds, {**even, "code": 3.0, "chat": 1.0}, 3) and sorted(three) == sorted(plain)
    share = sum(kinds[i] == "code" for i in three[:400]) / 400
    assert 0.70 < share < 0.80, share                           # code 3 times as likely as chat at every draw: 3/4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("prompts")


def test_sharegpt_kinds_are_worked_out_once_and_cached(cache):
    kinds = sharegpt.sharegpt_kinds(sharegpt.sharegpt_path(), cache)
    assert len(kinds) == sharegpt.sharegpt_index(sharegpt.sharegpt_path(), cache)["usable"]
    assert set(kinds.values()) == set(KINDS)
    assert len(list(cache.glob("sharegpt-kinds-*.json"))) == 1
    assert sharegpt.sharegpt_kinds(sharegpt.sharegpt_path(), cache) == kinds
    for p in load_prompts("sharegpt", limit=50, seed=0, cache=cache):
        assert kinds[p.id.removeprefix("sharegpt/")] == kind_of(p.text)


def test_a_sharegpt_draw_weighted_by_kind(cache):
    """Each draw of a record of kind k is k's weight times as likely; never a held-out record; seeded."""
    kinds = sharegpt.sharegpt_kinds(sharegpt.sharegpt_path(), cache)
    pool = {k: sum(v == k and not sharegpt.is_heldout(r) for r, v in kinds.items()) for k in KINDS}
    weights = parse_weights("translation=4,summarization=4,math=4")

    def share(prompts, of=("translation", "summarization", "math")):
        return sum(kinds[p.id.removeprefix("sharegpt/")] in of for p in prompts) / len(prompts)

    plain = load_prompts("sharegpt", limit=400, seed=0, cache=cache)
    drawn = load_prompts("sharegpt", limit=400, seed=0, cache=cache, kind_weights=weights)
    rare = sum(pool[k] for k in ("translation", "summarization", "math"))
    expected = 4 * rare / (4 * rare + pool["code"] + pool["chat"])        # 400 of ~16,500: draws barely deplete
    assert share(plain) < 0.07 and abs(share(drawn) - expected) < 0.04, (share(plain), share(drawn), expected)
    assert drawn.prompts == load_prompts("sharegpt", limit=400, seed=0, cache=cache, kind_weights=weights).prompts
    assert load_prompts("sharegpt", limit=100, seed=0, cache=cache, kind_weights=weights).prompts == drawn.prompts[:100]
    assert drawn.content_hash != plain.content_hash
    assert not any(sharegpt.is_heldout(p.id.removeprefix("sharegpt/")) for p in drawn)   # the held-out 5% stays out
    code = load_prompts("sharegpt", limit=30, seed=0, cache=cache, kind_weights=parse_weights("code=1,*=0"))
    assert code.prompts == [p for p in plain if kind_of(p.text) == "code"][:30]           # a selection keeps the order
    even = load_prompts("sharegpt", limit=400, seed=0, cache=cache, kind_weights=parse_weights("*=3"))
    assert even.prompts == plain.prompts
