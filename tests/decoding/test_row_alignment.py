"""Exact in bfloat16: every target forward padded to aligned rows (specdec.row_alignment), so a token's logits are the
same bits whichever forward computes them, and speculative decoding equals plain decoding token for token."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from layerscope.decoding import bench, costmodel, tree_attention
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


def test_a_tree_plan_lays_out_each_root_to_leaf_path():
    """Rows 0 (root) -> 1, 2; 1 -> 3; 2 -> 4, 5: three paths, each row's output from the first path through it."""
    parent = torch.tensor([0, 0, 0, 1, 2, 2])
    plan = tree_attention.path_plan(parent, sd.ancestors(parent, 2), prefix=7, align=16)
    assert plan.rows.tolist() == [[0, 1, 3], [0, 2, 4], [0, 2, 5]]
    assert plan.source.tolist() == [0, 1, 3 + 1, 2, 3 + 2, 6 + 2]
    assert plan.keys == 16                                   # 7 + 3 keys, rounded up as a padded chain's forward ends
    assert plan.cols[1].tolist() == list(range(7)) + [7 + 0, 7 + 2, 7 + 4] + [0] * 6
    assert plan.seen[1].tolist() == [True] * 10 + [False] * 6
    root = tree_attention.path_plan(torch.tensor([0]), sd.ancestors(torch.tensor([0]), 1), prefix=16, align=16)
    assert root.rows.tolist() == [[0, -1]] and root.keys == 32          # two query rows at least


def _random_tree(rng: random.Random, n: int) -> torch.Tensor:
    parent = [0] + [rng.randrange(i) for i in range(1, n)]
    return torch.tensor(parent)


def test_path_attention_gives_each_node_its_chains_bits():
    """The attention itself, Qwen2.5-1.5B's heads (12 query heads over 2 key heads of 128, bf16): over random trees
    and prefixes (up to 1,100 keys: the kernel reduces them in blocks of 512), each node's output under `tree_attention.attention` equals, bit
    for bit, what transformers' sdpa gives it in the forward of the chain verifying its path (its rows, padded as
    specdec pads a chain, key heads repeated). The flattened tree under its mask, the layout before, differs for some
    nodes: the check can fail."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    H, Hkv, D = 12, 2, 128
    module = type("Attn", (), {"num_key_value_groups": H // Hkv, "is_causal": True, "training": False})()
    checked = flattened_differ = 0
    for _ in range(40):
        L, T = rng.randrange(1, 1100), rng.randrange(1, 32)
        parent = _random_tree(rng, T)
        anc = sd.ancestors(parent, T)
        pad = sd.padding_rows(L, T, 16)
        Q = T + pad
        q = torch.randn(1, H, Q, D, generator=gen).bfloat16()
        k = (3 * torch.randn(1, Hkv, L + Q, D, generator=gen)).bfloat16()
        v = torch.randn(1, Hkv, L + Q, D, generator=gen).bfloat16()
        mask = sd._padded_mask(sd.tree_mask(L, anc, torch.bfloat16), L, T, pad)
        with tree_attention.paths(tree_attention.path_plan(parent, anc, L, 16)):
            out, _ = tree_attention.attention(module, q, k, v, mask)                # [1, Q, H, D]
        flat, _ = tree_attention.attention(module, q, k, v, mask)                   # outside a plan: sdpa itself
        for leaf in set(range(T)) - set(parent[1:].tolist()):
            rows = anc[leaf].nonzero().flatten()                                    # the path, root first
            c = rows.shape[0]
            R = c + sd.padding_rows(L, c, 16)
            extra = torch.randn(1, H, R - c, D, generator=gen).bfloat16()
            qc = torch.cat([q[:, :, rows], extra], 2)
            kc = torch.cat([k[:, :, :L], k[:, :, L + rows], k[:, :, :R - c]], 2)      # padding keys: any values
            vc = torch.cat([v[:, :, :L], v[:, :, L + rows], v[:, :, :R - c]], 2)
            causal = torch.ones(R, L + R, dtype=torch.bool)
            causal[:, L:] = torch.ones(R, R, dtype=torch.bool).tril()
            chain, _ = tree_attention.sdpa_attention_forward(module, qc, kc, vc, causal[None, None])
            assert torch.equal(out[0, rows], chain[0, :c]), (L, T, leaf)
            flattened_differ += int(not torch.equal(flat[0, rows], chain[0, :c]))
            checked += c
    assert checked > 400 and flattened_differ > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_tree_node_has_plain_decodings_bits(family):
    """bf16, head dim 128 (where rounding shows): random trees with the true continuation's nodes among cousins,
    verified with the path layout (tree_attention); every true node's logits equal plain decoding's one-token step
    bit for bit, and the padding rows leave the cache as plain decoding does."""
    rng = random.Random(0)
    if family == "llama":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 512, "max_position_embeddings": 1024}))
        model = model.to(torch.bfloat16).eval()
    else:
        model = build_model("gemma3", SHAPE["vocab_size"]).to(torch.bfloat16)
    assert tree_attention.install(model) and tree_attention.install(model)               # idempotent
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
            plan = tree_attention.path_plan(pr, anc, L, 16)
            with tree_attention.paths(plan):
                tree, _ = sd._target_forward(model, ids, pos, cache, None,
                                             sd.verification_mask(layout, L, anc, pos, model.dtype),
                                             keep=torch.arange(n))
            assert sd.cache_length(cache) == L + n
            plain = sd.new_cache(model)
            sd._target_forward(model, seq[:L], torch.arange(L), plain)
            for k, row in enumerate(true_rows):
                one, _ = sd._target_forward(model, [seq[L + k]], torch.tensor([L + k]), plain)
                assert torch.equal(one[0], tree[row]), (L, k)
                checked += 1
    assert checked >= 20


def test_outside_a_tree_the_installed_attention_is_sdpa(llama):
    """Plain decoding's bits are the same before and after the switch (tree_attention.attention is sdpa itself)."""
    model = _bf16()
    ids = PROMPTS[0]
    before, _ = sd.collect(sd.autoregressive(model, ids, 12))
    logits_before, _, _ = _forward(model, ids[:8], ids[8:12])
    assert tree_attention.install(model) and model.config._attn_implementation == tree_attention.ATTENTION
    after, _ = sd.collect(sd.autoregressive(model, ids, 12))
    logits_after, _, _ = _forward(model, ids[:8], ids[8:12])
    assert before == after and torch.equal(logits_before, logits_after)
    eager = _bf16()
    eager.set_attn_implementation("eager")
    assert not tree_attention.install(eager) and eager.config._attn_implementation == "eager"


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
