"""The EAGLE-3 draft head: shapes, vocabulary mapping, the TTT alignment, the engines' config keys."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from layerscope.draft.model import DraftCache, DraftConfig, DraftHead, build_draft_vocab
from layerscope.errors import DraftError

VOCAB, D = 50, 32


def target_config(**kw):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, rope_theta=500.0, **kw)


def make_head(layers=(1, 3, 5), draft_vocab=20, seed=0):
    torch.manual_seed(seed)
    d2t, t2d = build_draft_vocab(torch.randint(0, VOCAB, (500,)), draft_vocab, VOCAB)
    head = DraftHead(DraftConfig.from_target(target_config(), list(layers), draft_vocab), torch.randn(VOCAB, D), d2t, t2d)
    for p in head.parameters():          # norms start at 1; perturb them so no code path hides behind a constant
        torch.nn.init.normal_(p, std=0.2)
    return head.eval()


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_forward_shapes_for_k_layers(k):
    head = make_head(layers=list(range(1, k + 1)))
    B, T = 2, 7
    g = head.fuse(torch.randn(B, T, k * D))
    assert g.shape == (B, T, D)
    logits, hidden = head(torch.randint(0, VOCAB, (B, T)), g, torch.arange(T).expand(B, T))
    assert logits.shape == (B, T, 20) and hidden.shape == (B, T, D)
    outs = head.unroll([torch.randint(0, VOCAB, (B, T)) for _ in range(3)], g, torch.arange(T).expand(B, T))
    assert [tuple(l.shape) for l, _ in outs] == [(B, T, 20)] * 3 and [tuple(h.shape) for _, h in outs] == [(B, T, D)] * 3
    assert head.fc.weight.shape == (D, k * D)


def test_vocab_maps_every_draft_id_to_its_target_id():
    ids = torch.tensor([7] * 9 + [3] * 5 + [40] * 5 + [11] * 2 + [0])
    d2t, t2d = build_draft_vocab(ids, 4, VOCAB)
    chosen = [3, 7, 11, 40]                       # the 4 most frequent, 40 before 0 by count, ascending order
    assert (torch.arange(4) + d2t).tolist() == chosen
    assert t2d.nonzero().squeeze(1).tolist() == chosen and t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    head = make_head(draft_vocab=20)
    every = torch.arange(20)
    target = head.to_target_ids(every)
    assert head.t2d[target].all() and int(head.t2d.sum()) == 20
    assert target.unique().numel() == 20 and (target.sort().values == target).all()
    # every target id in the vocabulary maps back to its draft id
    back = torch.full((VOCAB,), -1)
    back[target] = every
    assert (back[target] == every).all() and (back[~head.t2d] == -1).all()


def test_vocab_fills_with_unseen_ids_when_few_tokens_occur():
    d2t, t2d = build_draft_vocab(torch.tensor([9, 9, 4]), 5, VOCAB)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 9]
    d2t, t2d = build_draft_vocab(torch.tensor([1]), 500, VOCAB)
    assert len(d2t) == VOCAB and t2d.all()


def test_ttt_steps_use_the_drafts_own_hidden_states():
    """Step j of unroll() equals decoding with a cache, where step j is fed the draft's step j-1 output;
    feeding the fused target feature again gives something else."""
    head = make_head()
    B, T, J = 2, 6, 3
    x = torch.randint(0, VOCAB, (B, T + J))
    g = head.fuse(torch.randn(B, T, 3 * D))
    pos = torch.arange(T).expand(B, T)
    outs = head.unroll([x[:, j: j + T] for j in range(1, J + 1)], g, pos)
    step1_logits, a1 = head(x[:, 1: T + 1], g, pos)
    assert torch.allclose(step1_logits, outs[0][0], atol=1e-5)
    for t in range(T):
        cache = DraftCache()
        head(x[:, 1: t + 2], g[:, : t + 1], pos[:, : t + 1], cache=cache)     # step-1 rows 0..t
        a = a1[:, t: t + 1]
        for j in range(2, J + 1):
            logits, a = head(x[:, t + j: t + j + 1], a, torch.full((B, 1), t + j - 1), cache=cache)
            assert torch.allclose(logits[:, 0], outs[j - 1][0][:, t], atol=1e-5)
            assert torch.allclose(a[:, 0], outs[j - 1][1][:, t], atol=1e-5)
    # the wrong alignment: step 2 fed g (the target feature of the next row) instead of a1
    cache = DraftCache()
    head(x[:, 1:2], g[:, :1], pos[:, :1], cache=cache)
    wrong, _ = head(x[:, 2:3], g[:, 1:2], torch.full((B, 1), 1), cache=cache)
    assert not torch.allclose(wrong[:, 0], outs[1][0][:, 0], atol=1e-3)


def test_cache_prefill_in_pieces_equals_one_pass_and_crop():
    head = make_head()
    B, T = 1, 8
    x, g, pos = torch.randint(0, VOCAB, (B, T)), head.fuse(torch.randn(B, T, 3 * D)), torch.arange(T)[None]
    full, _ = head(x, g, pos)
    cache = DraftCache()
    a, _ = head(x[:, :5], g[:, :5], pos[:, :5], cache=cache)
    b, _ = head(x[:, 5:], g[:, 5:], pos[:, 5:], cache=cache)
    assert cache.length == T and torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
    cache.crop(-3)
    assert cache.length == 5
    again, _ = head(x[:, 5:], g[:, 5:], pos[:, 5:], cache=cache)
    assert torch.allclose(again, b, atol=1e-5)
    cache.crop(2)
    assert cache.length == 2
    # an explicit mask: the new token sees only slot 0 and itself
    mask = torch.tensor([[True, False, True]])[None, None]
    only, _ = head(x[:, 2:3], g[:, 2:3], pos[:, 2:3], cache=cache, attention_mask=mask)
    ref_cache = DraftCache()
    head(x[:, :1], g[:, :1], pos[:, :1], cache=ref_cache)
    ref, _ = head(x[:, 2:3], g[:, 2:3], pos[:, 2:3], cache=ref_cache)
    assert torch.allclose(only, ref, atol=1e-5)


def test_rotary_is_the_targets():
    cfg = target_config(max_position_embeddings=4096)
    head = DraftHead(DraftConfig.from_target(cfg, [1, 2, 3], 20), torch.randn(VOCAB, D))
    pos = torch.arange(0, 4000, 37)[None]
    x = torch.zeros(1, pos.shape[1], D)
    cos, sin = head.rotary(x, pos)
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(x, pos)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert head.config.to_hf_config()["rope_theta"] == 500.0
    scaled = target_config(rope_scaling={"rope_type": "linear", "factor": 4.0})
    c = DraftConfig.from_target(scaled, [1], 20)
    hf = c.to_hf_config()
    assert hf["rope_scaling"]["rope_type"] == "linear" and hf["rope_scaling"]["factor"] == 4.0
    back = DraftConfig.from_hf_config(hf)
    h2 = DraftHead(back, torch.randn(VOCAB, D))
    assert torch.equal(h2.rotary(x, pos)[0], LlamaRotaryEmbedding(scaled)(x, pos)[0])


def test_engine_config_keys_and_layer_conventions():
    cfg = DraftConfig.from_target(target_config(), [1, 3, 5], 20)
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["draft_vocab_size"] == 20 and hf["vocab_size"] == VOCAB and hf["target_hidden_size"] == D
    assert hf["num_hidden_layers"] == 1 and hf["tie_word_embeddings"] is False
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]                     # vLLM: input of layer id
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]     # SGLang: output of layer id
    assert DraftConfig.from_hf_config(hf).aux_layers == [1, 3, 5]
    sglang_only = {k: v for k, v in hf.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert DraftConfig.from_hf_config(sglang_only).aux_layers == [1, 3, 5]
    assert DraftConfig.from_hf_config(hf) == DraftConfig(**{**cfg.to_dict(), "target_num_layers": None})


def test_bad_layer_sets_are_refused():
    base = DraftConfig.from_target(target_config(), [1], 20).to_dict()
    for layers in ([3, 1], [2, 2], []):                      # engines concatenate in ascending order
        with pytest.raises(DraftError):
            DraftConfig(**{**base, "aux_layers": layers})
    for layers in ([-1], [6]):                               # the target offers hidden_states 0..N-1 = 0..5
        with pytest.raises(DraftError, match="out of range"):
            DraftConfig.from_target(target_config(), layers, 20)


def test_forward_without_embedding_says_what_to_do():
    head = DraftHead(DraftConfig.from_target(target_config(), [1], 20))
    with pytest.raises(DraftError, match="load_draft"):
        head(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, D), torch.zeros(1, 1, dtype=torch.long))


def test_fc_norm_norms_each_layer_before_fc_and_nothing_else():
    """fc_norm (EAGLE-3.1): one RMSNorm per auxiliary layer, on its own d-wide chunk, before fc; a fresh draft with
    it has the same seeded weights as one without and gains of 1, so it differs only by the normalisation."""
    torch.manual_seed(0)
    plain = DraftHead(DraftConfig.from_target(target_config(), [1, 3, 5], 20))
    torch.manual_seed(0)
    normed = DraftHead(DraftConfig.from_target(target_config(), [1, 3, 5], 20, fc_norm=True))
    extra = {k: v for k, v in normed.state_dict().items() if k not in plain.state_dict()}
    assert sorted(extra) == ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]    # the engines' names
    assert all(torch.equal(v, torch.ones(D)) for v in extra.values())
    assert all(torch.equal(v, normed.state_dict()[k]) for k, v in plain.state_dict().items())
    # layers with very different scales, as a target's are: each chunk is brought to rms 1 on its own
    aux = torch.cat([torch.randn(2, 5, D) * s for s in (0.5, 8.0, 200.0)], dim=-1)
    with torch.no_grad():
        for norm in normed.fc_norm:                          # gains other than 1, one per layer
            norm.weight.copy_(torch.rand(D) + 0.5)
        chunks = aux.chunk(3, dim=-1)
        by_hand = torch.cat([n.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)
                             for n, c in zip(normed.fc_norm, chunks)], dim=-1)
        assert torch.allclose(normed.fuse(aux), by_hand @ normed.fc.weight.T, atol=1e-5)
        assert torch.allclose(plain.fuse(aux), aux @ plain.fc.weight.T, atol=1e-4)
        assert not torch.allclose(normed.fuse(aux), plain.fuse(aux), atol=1e-2)
    hf = normed.config.to_hf_config()
    assert hf["fc_norm"] is True and plain.config.to_hf_config()["fc_norm"] is False
    assert DraftConfig.from_hf_config(hf).fc_norm is True
    assert DraftConfig.from_hf_config({k: v for k, v in hf.items() if k != "fc_norm"}).fc_norm is False
    with pytest.raises(DraftError, match="fc_norm"):
        DraftConfig.from_hf_config({**hf, "fc_norm": "yes"})
