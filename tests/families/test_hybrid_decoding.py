"""Lossless decoding for targets with recurrent state beside attention: gated delta-nets (Qwen3-Next, Qwen3.5,
OLMo-Hybrid), Mamba and Mamba-2 mixers (Jamba; Bamba, GraniteMoeHybrid, Falcon-H1) and short convolutions (LFM2).

One tiny random model per family, built from transformers' own config class (hidden 64, 4 layers, attention and
recurrent layers mixed; Mamba-2 chunks of 16 tokens, convolution windows of 3-4). Prompts are 96 and 635 tokens:
longer than every window and chunk, the gated delta-net's 64-token chunk included, so the prefill runs the chunked
kernels and decoding continues from their states. Each family goes through the bench (chains K=1,2, a tree, prompt lookup; a
random draft and one that knows the answer, so drafts are rejected, partly accepted and accepted whole) and every
contender must equal plain decoding, which must equal the model's own greedy `generate`. After a step that accepted
some of its drafted tokens, the cache holds the states plain decoding would hold. Speculative sampling keeps the
target's law on a Mamba-2 hybrid (exact enumeration).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    FalconH1Config,
    GraniteMoeHybridConfig,
    JambaConfig,
    Lfm2Config,
    OlmoHybridConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from layerscope.decoding import bench
from layerscope.decoding import specdec as sd
from layerscope.errors import LayerScopeError
from tests.decoding.test_specdec import _chi2, _exact_marginals
from tests.helpers import LookupDraft, untrained_draft

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16)
ALTERNATE = ["linear_attention", "full_attention"] * 2

# family: its config class and the fields that make it that family at this size (recurrent and attention layers mixed)
FAMILIES = {
    "qwen3_next": (Qwen3NextConfig, {**DELTA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32}),         # 3 delta-net : 1 attention
    "qwen3_5": (Qwen3_5TextConfig, DELTA),                                             # 3 : 1
    "olmo_hybrid": (OlmoHybridConfig, {**DELTA, "layer_types": ALTERNATE}),
    "granitemoehybrid": (GraniteMoeHybridConfig, {**MAMBA2, "layer_types": ["mamba", "attention"] * 2,
                                                  "num_local_experts": 4, "num_experts_per_tok": 2,
                                                  "shared_intermediate_size": 64}),
    "falcon_h1": (FalconH1Config, {**MAMBA2, "mamba_d_ssm": 128}),                     # Mamba-2 beside attention, each layer
    "jamba": (JambaConfig, {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                            "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
                            "mamba_d_conv": 4, "mamba_dt_rank": 8}),                   # Mamba (1)
    "bamba": (BambaConfig, {**MAMBA2, "attn_layer_indices": [1, 3]}),
    "lfm2": (Lfm2Config, {"full_attn_idxs": [1, 3], "conv_L_cache": 3}),               # short convolutions
}
NEW = 24                                   # tokens decoded per prompt
TREE = sd.TreeSpec(6, 2, 3)

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def target(family: str):
    config_class, fields = FAMILIES[family]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_class(**SHAPE, **fields)).eval()


def generate(model, ids: list[int], n: int) -> list[int]:
    """The model's own greedy decoding (transformers' generate, its own cache and kernels)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@functools.cache
def prompts(family: str) -> tuple[list[int], list[int]]:
    """Two prompts longer than every window and chunk: 96 random tokens, and the token 7 followed by every other
    token, and 7 again (635 tokens): whatever the target decodes next, the context ends in a 2-gram seen before, so
    the first step looks up (the random targets here do not repeat themselves otherwise)."""
    first = torch.randint(3, 320, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    return first, [t for x in range(3, 320) if x != 7 for t in (7, x)] + [7]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_decoding_is_lossless(family):
    """Plain decoding == generate; chains K=1,2, a tree and a chain with prompt lookup == plain decoding, through the
    bench, with a random draft and a draft that knows the answer but is wrong at every third position."""
    model = target(family)
    assert sd.attention_layout(model).recurrent
    for i, ids in enumerate(prompts(family)):
        plain, _ = sd.collect(sd.autoregressive(model, ids, NEW))
        assert plain == generate(model, ids, NEW), (family, i)
        knows = LookupDraft(ids + plain, model.config.vocab_size, wrong=range(len(ids) + 2, len(ids) + NEW + 2, 3))
        contenders = bench.build_contenders([("random", untrained_draft(model, layers=(0, 1, 3))), ("knows", knows)],
                                            ks=(1, 2), trees=(TREE,), peers=False, draft_lookup=2)
        report = list(bench.run(model, [bench.EncodedPrompt(str(i), "test", ids)], contenders, max_new_tokens=NEW,
                                warmup=False))[-1].report.to_json()
        results = {r["name"]: r for r in report["results"]}
        assert len(results) == 1 + 2 * 6, list(results)     # per draft: K=1, 2, tree, K=1, 2 and tree + lookup
        assert all(r["lossless"] for r in results.values()), [(n, r["lossless"]) for n, r in results.items()]
        for name in ("knows chain k=2", f"knows tree budget={TREE.budget} top_k={TREE.top_k} depth={TREE.depth}"):
            accepted, drafted = results[name]["per_prompt"]["accepted"][0], results[name]["per_prompt"]["drafted"][0]
            assert 0 < accepted < drafted, (name, accepted, drafted)       # accepted in part: the states were cut back
        if i == 1:
            assert all(results[f"{d} chain k={k} + lookup 2"]["lookup"]["steps"] > 0 for d in ("random", "knows") for k in (1, 2))
            assert all(results[f"{d} {bench.draft_label(1, TREE)} + lookup 2"]["lookup"]["steps"] > 0
                       for d in ("random", "knows"))


def _states(cache) -> list[torch.Tensor]:
    """Every tensor a cache carries from one step to the next: keys, values, convolution and recurrent states."""
    out = []
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            out += [layer.keys, layer.values]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            out += [t for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_partly_accepted_step_leaves_plain_decodings_states(family):
    """A chain of 5 whose third token is wrong, then a tree whose first choices are wrong at depth 1: after each, the
    cache (keys, values, convolution windows, recurrent states) is the cache plain decoding builds over the same
    tokens, one token at a time, to float32 rounding (the kernels differ: several tokens at once against one);
    the states of a step that was not cut back differ by far more."""
    model = target(family)
    ids = prompts(family)[0]
    plain, _ = sd.collect(sd.autoregressive(model, ids, 16))
    n = len(ids)
    knows = LookupDraft(ids + plain, model.config.vocab_size, wrong={n + 3, n + 5})
    with torch.inference_mode():
        cache, d = sd.new_cache(model), sd._Draft(knows, model.device)
        logits, aux = sd._target_forward(model, ids, torch.arange(n), cache, knows.aux_layers, last_only=True)
        last = int(logits[-1].argmax())
        d.add_rows(ids[1:] + [last], aux)
        sd.record_states(cache)
        _, accepted, _, new = sd._chain_step(model, d, cache, last, 5, knows.aux_layers, 0.0, None)
        assert accepted == 2
        _, accepted2, _, new2 = sd._tree_step_by_paths(model, d, cache, new[-1], 3, sd.TreeSpec(6, 2, 3),
                                                       knows.aux_layers)
        assert accepted2 >= 1
        tokens = ids + [last] + new + new2
        assert tokens == (ids + plain)[:len(tokens)]
        reference = sd.new_cache(model)
        sd._target_forward(model, ids, torch.arange(n), reference, last_only=True)
        for p in range(n, len(tokens) - 1):
            sd._target_forward(model, [tokens[p]], torch.tensor([p]), reference, last_only=True)
        assert sd.cache_length(cache) == sd.cache_length(reference) == len(tokens) - 1
        for got, want in zip(_states(cache), _states(reference), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # one token further, as a step that was not cut back would leave it: the comparison above would see it
        sd._target_forward(model, [tokens[-1]], torch.tensor([len(tokens) - 1]), reference, last_only=True)
        recurrent = [(a, b) for a, b in zip(_states(cache), _states(reference)) if a.shape == b.shape]
        assert max(float((a - b).abs().max()) for a, b in recurrent) > 1e-2


def test_speculative_sampling_keeps_the_target_distribution_on_a_mamba2_hybrid():
    """Bamba (Mamba-2, attention) with vocabulary 12, a 4-token convolution and 2-token SSM chunks, behind a 6-token
    prompt: tokens 2..4 of each sampled output pass through accept/reject, resampling and cut-back states, and their
    marginals must match the target's, computed exactly by enumeration (chi-square)."""
    config = BambaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5,
                         tie_word_embeddings=False, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8,
                         mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    draft = untrained_draft(model, layers=(0, 1), draft_vocab=8, seed=3)
    with torch.no_grad():
        draft.lm_head.weight.mul_(5)                         # a draft with opinions of its own
    prompt, T, trials = [1, 2, 3, 4, 5, 6], 0.8, 400
    samples, drafted, accepted = [], 0, 0
    for s in range(trials):
        out, events = sd.collect(sd.speculative(model, draft, prompt, 4, k=2, temperature=T, seed=s))
        samples.append(out)
        drafted += sum(e.drafted for e in events)
        accepted += sum(e.accepted for e in events)
    assert 0.15 < accepted / drafted < 0.85, accepted / drafted
    samples = torch.tensor(samples)
    marginals = _exact_marginals(model, prompt, 4, T)
    for pos in (1, 2, 3):
        chi2 = _chi2(torch.bincount(samples[:, pos], minlength=12).double(), marginals[pos])
        assert chi2 < 40.0, (pos, chi2)                      # df = 11: P(chi2 > 40) < 1e-4


def test_layer_kinds_it_cannot_keep_exact_are_refused_in_one_line():
    """A layer without a cache of its own (transformers' "dummy" kind: KV-shared layers, or an "mlp" layer as here)
    stays refused before anything is decoded."""
    model = target("lfm2")
    kinds = list(model.config.layer_types)
    try:
        model.config.layer_types = ["mlp"] + kinds[1:]
        with pytest.raises(LayerScopeError, match=r"kind \['dummy'\]"):
            sd.attention_layout(model)
    finally:
        model.config.layer_types = kinds
