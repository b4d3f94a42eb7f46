"""Exact in bfloat16: every target forward padded to the rows this machine's products need (specdec.row_alignment,
measured by row_invariance's probe) and each real row attending alone (exact_attention), so a token's logits are the
same bits whichever forward computes them, and speculative decoding equals plain decoding token for token."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from layerscope.decoding import bench, costmodel, exact_attention, row_invariance
from layerscope.decoding import specdec as sd
from layerscope.draft.checkpoint import save_draft
from layerscope.target.load import tiny_model
from tests.families.test_draft_families import build_model
from tests.helpers import LookupDraft, untrained_draft

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
    assert sd.row_alignment(llama) in row_invariance.CANDIDATES                          # measured on this machine
    assert sd.row_alignment(LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()) == 0           # float32: exact as it is
    assert sd.row_alignment(_bf16(window=4)) in row_invariance.CANDIDATES                # sliding windows too


def test_the_alignment_is_the_fewest_rows_whose_probe_finds_no_row_apart(llama, monkeypatch):
    """row_invariance.alignment takes the smallest candidate whose probe finds no row apart, falls back to the largest
    when none does, and measures once per shapes, dtype, device and threads."""
    assert row_invariance.shapes(llama) == ((128, 256), (256, 256), (256, 512), (300, 256), (512, 256))
    asked = []

    def fake(model, forward, align, new_cache, crop):
        asked.append(align)
        return {1: 5, 2: 3}.get(align, 0)

    monkeypatch.setattr(row_invariance, "rows_apart", fake)
    monkeypatch.setattr(row_invariance, "_CACHE", {})
    assert sd.row_alignment(llama) == 4 and asked == [1, 2, 4]
    assert sd.row_alignment(llama) == 4 and asked == [1, 2, 4]                           # measured once
    monkeypatch.setattr(row_invariance, "rows_apart", lambda *a: 1)
    monkeypatch.setattr(row_invariance, "_CACHE", {})
    assert sd.row_alignment(llama) == sd.ROW_ALIGN == 16


def test_the_probe_finds_a_forward_that_rounds_a_row_otherwise_alone(llama):
    """rows_apart with the decoders' own forward finds no row apart at the measured alignment; a forward whose
    one-row products round otherwise (as a one-row kernel summing in another order would: emulated on the logits)
    is caught at alignment 1 and passes at 2, where no forward has one row."""
    def forward(ids, positions, cache, align):
        return sd._target_forward(llama, ids, positions, cache, align=align)[0]

    def rounds_alone(ids, positions, cache, align):
        logits = forward(ids, positions, cache, align)
        return logits * (1 + 2 ** -6) if len(ids) + sd.padding_rows(positions[0].item(), len(ids), align) == 1 else logits

    new, crop = (lambda: sd.new_cache(llama)), sd.crop_cache
    assert row_invariance.rows_apart(llama, forward, sd.row_alignment(llama), new, crop) == 0
    assert row_invariance.rows_apart(llama, rounds_alone, 1, new, crop) > 0
    assert row_invariance.rows_apart(llama, rounds_alone, 2, new, crop) == 0


def test_row_attention_gives_a_row_the_same_bits_whatever_rows_and_keys_surround_it():
    """One query row's output from `row_attention` depends only on its query and visible keys: the same bits as the
    row alone, as row 5 of 7 under a causal mask with more keys behind, and as a tree node among masked cousins; and
    within rounding of sdpa's."""
    torch.manual_seed(0)
    H, Hkv, D, N = 4, 2, 32, 40
    q, k, v = (torch.randn(1, h, N, D).to(torch.bfloat16) for h in (H, Hkv, Hkv))
    # row at position 30: alone (one query, keys 0..30, no mask)
    alone = exact_attention.row_attention(q[:, :, 30:31], k[:, :, :31], v[:, :, :31], None, 1)[0, 0]
    # as row 5 of 7 queries (positions 25..31) over keys 0..39 with a causal mask hiding the rest, two padding rows
    qs = q[:, :, 25:32]
    mask = torch.zeros(1, 1, 7, N, dtype=torch.bool)
    for i in range(7):
        mask[0, 0, i, :26 + i] = True
    seven = exact_attention.row_attention(qs, k, v, mask, 6)
    assert torch.equal(seven[0, 5], alone) and not seven[0, 6:].any()
    # as a tree node: keys 0..28 and then 30 (its ancestors and itself), with 29 and 31.. hidden (a cousin, others)
    tree_keys = torch.cat([k[:, :, :29], k[:, :, 30:31]], 2)
    tree_vals = torch.cat([v[:, :, :29], v[:, :, 30:31]], 2)
    node = exact_attention.row_attention(q[:, :, 30:31], tree_keys, tree_vals, None, 1)[0, 0]
    mask = torch.zeros(1, 1, 1, 32, dtype=torch.bool)
    mask[0, 0, 0, :29] = True
    mask[0, 0, 0, 30] = True
    among = exact_attention.row_attention(q[:, :, 30:31], k[:, :, :32], v[:, :, :32], mask, 1)[0, 0]
    assert torch.equal(among, node)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, 30:31].float(), k[:, :, :31].float().repeat_interleave(2, 1),
                                                           v[:, :, :31].float().repeat_interleave(2, 1))[0, :, 0]
    assert torch.allclose(alone.float(), ref, atol=0.02)


def _forward(model, prefix: list[int], new: list[int], **kw):
    cache = sd.new_cache(model)
    with torch.inference_mode():
        sd._target_forward(model, prefix, torch.arange(len(prefix)), cache)
        logits, aux = sd._target_forward(model, new, torch.arange(len(prefix), len(prefix) + len(new)), cache,
                                         aux_layers=[1, 2], **kw)
    return logits, aux, cache


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("align", ["measured", 16])
def test_a_tokens_logits_are_the_same_bits_in_any_forward(window, align, monkeypatch):
    """Position p's logits and hidden states: as a one-token step after p tokens, or as the 4th row of a 6-row
    verification after p - 3 tokens: bit for bit equal; the cache holds exactly the real rows afterwards."""
    if align != "measured":
        monkeypatch.setattr(row_invariance, "alignment", lambda *args: align)
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
@pytest.mark.parametrize("align", ["measured", 16])
def test_speculative_decoding_in_bf16_equals_plain_decoding(window, align, monkeypatch):
    """Chains of depth 1 and 3, a tree and prompt lookup, with a draft right at most positions and wrong at every
    fifth (so verifications of every length happen): the same tokens as plain decoding, in bfloat16, with this
    machine's alignment and with every forward padded to 16 rows (an AMX CPU's)."""
    if align != "measured":
        monkeypatch.setattr(row_invariance, "alignment", lambda *args: align)
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
    assert sd.row_alignment(model) > 0 and len(set(sd.attention_layout(model).kinds)) == 2
    for ids in PROMPTS:
        plain, _ = sd.collect(sd.autoregressive(model, ids, 30))
        draft = LookupDraft(ids + plain, SHAPE["vocab_size"], aux_layers=(1,),
                            wrong=range(len(ids) + 2, len(ids) + 60, 5))
        for kw in (dict(k=3), dict(tree=sd.TreeSpec(6, 2, 3))):
            out, _ = sd.collect(sd.speculative(model, draft, ids, 30, **kw))
            assert out == plain, (ids, kw)


def _random_tree(rng: random.Random, n: int) -> torch.Tensor:
    parent = [0] + [rng.randrange(i) for i in range(1, n)]
    return torch.tensor(parent)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_tree_node_has_plain_decodings_bits(family):
    """bf16, head dim 128 (where rounding shows): random trees with the true continuation's nodes among cousins,
    verified in one forward (each node attending alone: exact_attention); every true node's logits equal plain decoding's one-token step
    bit for bit, and the padding rows leave the cache as plain decoding does."""
    rng = random.Random(0)
    if family == "llama":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 512, "max_position_embeddings": 1024}))
        model = model.to(torch.bfloat16).eval()
    else:
        model = build_model("gemma3", SHAPE["vocab_size"]).to(torch.bfloat16)
    assert exact_attention.install(model) and exact_attention.install(model)               # idempotent
    seq = [rng.randrange(SHAPE["vocab_size"]) for _ in range(620)]
    layout, checked = sd.attention_layout(model), 0
    for _ in range(12):
        L, n = rng.choice([rng.randrange(5, 300), rng.randrange(490, 600)]), rng.randrange(2, 12)
        parent, depth, ids, true_rows = [0], [0], [seq[L]], [0]
        for i in range(1, n):
            if len(true_rows) < 4 and rng.random() < 0.4:
                parent.append(true_rows[-1])
                true_rows.append(i)
                ids.append(seq[L + len(true_rows) - 1])
            else:
                parent.append(rng.randrange(i))
                ids.append(rng.randrange(SHAPE["vocab_size"]))
            depth.append(depth[parent[-1]] + 1)
        pr, dep = torch.tensor(parent), torch.tensor(depth)
        anc, pos = sd.ancestors(pr, max(depth)), L + dep
        with torch.inference_mode():
            cache = sd.new_cache(model)
            sd._target_forward(model, seq[:L], torch.arange(L), cache)
            tree, _ = sd._target_forward(model, ids, pos, cache, None,
                                         sd.verification_mask(layout, L, anc, pos, model.dtype), keep=torch.arange(n))
            assert sd.cache_length(cache) == L + n
            plain = sd.new_cache(model)
            sd._target_forward(model, seq[:L], torch.arange(L), plain)
            for k, row in enumerate(true_rows):
                one, _ = sd._target_forward(model, [seq[L + k]], torch.tensor([L + k]), plain)
                assert torch.equal(one[0], tree[row]), (L, k)
                checked += 1
    assert checked >= 20


def test_outside_rows_alone_the_installed_attention_is_sdpa():
    """A forward outside `rows_alone` (a prompt's prefill) has the same bits before and after the switch
    (exact_attention.attention is transformers' sdpa there); decoding installs it; eager targets keep theirs."""
    model = _bf16()
    ids = torch.tensor([list(range(3, 3 + 2 * sd.EXACT_ROWS))])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert exact_attention.install(model) and model.config._attn_implementation == exact_attention.ATTENTION
        assert torch.equal(model(input_ids=ids).logits, before)
    fresh = _bf16()
    sd.collect(sd.autoregressive(fresh, PROMPTS[0], 3))
    assert fresh.config._attn_implementation == exact_attention.ATTENTION
    eager = _bf16()
    eager.set_attn_implementation("eager")
    assert not exact_attention.install(eager) and eager.config._attn_implementation == "eager"


def test_a_draft_decodes_in_its_targets_dtype_and_the_output_stays_exact(tmp_path):
    """bench.load_drafts (the CLI's, the app's and the study's drafts) casts a float32 draft to a bf16 target's dtype
    (specdec.decoding_draft), its cost curve is stored apart from a float32 draft's, and chains, trees and lookup with
    it still give plain decoding's tokens; a float32 target keeps a float32 draft."""
    f32 = tiny_model(hidden_size=128)
    path = save_draft(tmp_path / "d", untrained_draft(f32.model, layers=(1, 2)),
                      {"target_fingerprint": f32.fingerprint, "target_model": f32.spec}, dtype="float32")
    [(_, kept)] = bench.load_drafts(f32, [("d", path)])
    assert kept.fc.weight.dtype == torch.float32
    bf16 = replace(tiny_model(hidden_size=128), dtype=torch.bfloat16)
    bf16.model.to(torch.bfloat16)
    [(_, head)] = bench.load_drafts(bf16, [("d", path)])
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}
    assert costmodel.curve_key(bf16, head) != costmodel.curve_key(bf16, copy.deepcopy(head).float())
    assert costmodel.default_draft(bf16).fc.weight.dtype == torch.bfloat16
    for ids in PROMPTS:
        plain, _ = sd.collect(sd.autoregressive(bf16.model, ids, 24))
        for kw in (dict(k=3), dict(tree=sd.TreeSpec(6, 2, 3)), dict(k=2, lookup=4)):
            out, events = sd.collect(sd.speculative(bf16.model, head, ids, 24, **kw))
            assert out == plain, (ids, kw)
            assert len(events) > 1
