"""Exact in bfloat16: every target forward padded to aligned rows (specdec.row_alignment), so a token's logits are the
same bits whichever forward computes them, and speculative decoding equals plain decoding token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from layerscope.decoding import specdec as sd
from tests.families.test_draft_families import build_model
from tests.helpers import LookupDraft

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36],
           [1, 41, 42, 13, 56, 23, 73, 9, 93, 99, 37, 51, 5, 82, 9, 74, 94, 45, 92, 30]]


def _bf16(window: int | None = None):
    torch.manual_seed(0)
    model = (MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)) if window
             else LlamaForCausalLM(LlamaConfig(**SHAPE)))
    return model.to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def llama():
    return _bf16()


def test_padding_rows_closed_form():
    assert sd.padding_rows(0, 1, 16) == 15             # 16 rows ending at 16
    assert sd.padding_rows(96, 16, 16) == 0            # already 16 rows ending at 112
    assert sd.padding_rows(5, 1, 16) == 26             # 11 rows would end at 16; fewer than 16: one more block
    assert sd.padding_rows(100, 17, 16) == 11          # 28 rows ending at 128
    assert sd.padding_rows(0, 40, 16) == 8
    for start in range(0, 40):
        for rows in range(1, 40):
            pad = sd.padding_rows(start, rows, 16)
            assert (start + rows + pad) % 16 == 0 and rows + pad >= 16 and pad < 32
    assert sd.padding_rows(5, 3, 0) == 0


def test_only_16_bit_attention_targets_are_aligned(llama):
    assert sd.row_alignment(llama) == sd.ROW_ALIGN == 16
    assert sd.row_alignment(LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()) == 0           # float32: exact as it is
    assert sd.row_alignment(_bf16(window=4)) == 16                                        # sliding windows too


def _forward(model, prefix: list[int], new: list[int], **kw):
    cache = sd.new_cache(model)
    with torch.inference_mode():
        sd._target_forward(model, prefix, torch.arange(len(prefix)), cache)
        logits, aux = sd._target_forward(model, new, torch.arange(len(prefix), len(prefix) + len(new)), cache,
                                         aux_layers=[1, 2], **kw)
    return logits, aux, cache


@pytest.mark.parametrize("window", [None, 4])
def test_a_tokens_logits_are_the_same_bits_in_any_forward(window):
    """Position p's logits and hidden states: as a one-token step after p tokens, or as the 4th row of a 6-row
    verification after p - 3 tokens: bit for bit equal; the cache holds exactly the real rows afterwards."""
    model = _bf16(window)
    seq = PROMPTS[2]
    p = 14
    one, one_aux, c1 = _forward(model, seq[:p], [seq[p]])
    six, six_aux, c6 = _forward(model, seq[:p - 3], seq[p - 3:p + 3])
    assert torch.equal(one[0], six[3]) and torch.equal(one_aux[0], six_aux[3])
    assert sd.cache_length(c1) == p + 1 and sd.cache_length(c6) == p + 3
    last, _, _ = _forward(model, seq[:p], [seq[p]], last_only=True)
    assert torch.equal(last[0], one[0]) and last.shape == (1, SHAPE["vocab_size"])


def test_the_padding_leaves_what_an_unpadded_forward_computes_within_rounding(llama):
    """The padding rows change no real row beyond bf16 rounding (they come after it and are masked from it)."""
    seq = PROMPTS[0]
    padded, _, _ = _forward(llama, seq[:8], seq[8:12])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sd, "row_alignment", lambda model: 0)
        plain, _, _ = _forward(llama, seq[:8], seq[8:12])
    assert torch.allclose(padded, plain, atol=0.1, rtol=0.05)
    assert (padded.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("window", [None, 4])
def test_speculative_decoding_in_bf16_equals_plain_decoding(window):
    """Chains of depth 1 and 3, a tree and prompt lookup, with a draft right at most positions and wrong at every
    fifth (so verifications of every length happen): the same tokens as plain decoding, in bfloat16."""
    model = _bf16(window)
    for ids in PROMPTS:
        plain, _ = sd.collect(sd.autoregressive(model, ids, 40))
        draft = LookupDraft(ids + plain, SHAPE["vocab_size"], aux_layers=(1,),
                            wrong=range(len(ids) + 2, len(ids) + 60, 5))
        for kw in (dict(k=1), dict(k=3), dict(tree=sd.TreeSpec(6, 2, 3)), dict(k=2, lookup=4)):
            out, events = sd.collect(sd.speculative(model, draft, ids, 40, **kw))
            assert out == plain, (ids, kw)
            assert sum(e.accepted for e in events) > 0


def test_a_mixed_sliding_and_full_target_in_bf16_decodes_exactly():
    """Gemma 3's layers of two kinds take a tree's mask as a dict per kind (verification_mask): both are padded."""
    model = build_model("gemma3", SHAPE["vocab_size"]).to(torch.bfloat16)
    assert sd.row_alignment(model) == 16 and len(set(sd.attention_layout(model).kinds)) == 2
    for ids in PROMPTS:
        plain, _ = sd.collect(sd.autoregressive(model, ids, 30))
        draft = LookupDraft(ids + plain, SHAPE["vocab_size"], aux_layers=(1,),
                            wrong=range(len(ids) + 2, len(ids) + 60, 5))
        for kw in (dict(k=3), dict(tree=sd.TreeSpec(6, 2, 3))):
            out, _ = sd.collect(sd.speculative(model, draft, ids, 30, **kw))
            assert out == plain, (ids, kw)
