"""Sliding-window and mixed-attention targets: every decoder equals greedy decoding on contexts longer than the window.

One tiny random model per family, built from transformers' own config classes, with a window of 8 positions: a
20-token prompt and 24 new tokens read up to 43 positions. The reference is greedy decoding by full forwards over
the whole sequence, no cache (the masks transformers builds from positions alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from layerscope.decoding import specdec as sd
from layerscope.errors import LayerScopeError
from tests.helpers import LookupDraft, untrained_draft

WINDOW, PROMPT, NEW = 8, 20, 24
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)   # 0.2: varied outputs

# name: config class, model class, config fields, each layer's kind (S sliding, F full)
FAMILIES = {
    "mistral": (MistralConfig, MistralForCausalLM, {}, "SSSS"),                       # one mask for every layer
    "starcoder2": (Starcoder2Config, Starcoder2ForCausalLM, {}, "SSSS"),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {}, "SFSF"),                          # eager, logit softcapping
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window_pattern": 2}, "SFSF"),   # rotary per kind
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}, "SFSF"),  # sinks
    "cohere2": (Cohere2Config, Cohere2ForCausalLM, {"sliding_window_pattern": 2}, "SFSF"),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "max_window_layers": 2}, "FFSS"),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": True, "max_window_layers": 2}, "FFSS"),
}
HEAD_TRANSFORMED = {"gemma2", "cohere2"}     # logits softcapped (final_logit_softcapping 30) or scaled (logit_scale)

pytestmark = pytest.mark.usefixtures("one_thread")


def build(name: str, window: int):
    config_class, model_class, fields, _ = FAMILIES[name]
    torch.manual_seed(0)
    return model_class(config_class(**SHAPE, **fields, sliding_window=window)).eval()


def greedy_without_cache(model, ids: list[int], n: int) -> list[int]:
    """The reference: n greedy tokens, each from a full forward over the whole sequence."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@dataclass
class Family:
    name: str
    model: object
    ids: list[int]
    ref: list[int]                  # greedy_without_cache(model, ids, NEW)
    draft: object                   # an untrained DraftHead (tests/families/test_draft_families.py trains them)


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request) -> Family:
    name = request.param
    model = build(name, WINDOW)
    ids = torch.randint(3, SHAPE["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    return Family(name, model, ids, greedy_without_cache(model, ids, NEW), untrained_draft(model, draft_vocab=64))


def drafts(fam: Family) -> list:
    """The untrained draft and a draft that knows the answer but ranks every third token wrong."""
    knowing = LookupDraft(fam.ids + fam.ref, SHAPE["vocab_size"], wrong=range(PROMPT + 2, PROMPT + NEW + 2, 3))
    return [fam.draft, knowing]


# ----------------------------------------------------------------------------- the target side


def test_every_layer_keeps_a_full_length_cache(fam):
    kinds = FAMILIES[fam.name][3]
    layout = sd.attention_layout(fam.model)
    assert layout == sd.AttentionLayout(tuple(sd.SLIDING if k == "S" else sd.FULL for k in kinds), WINDOW)
    own = DynamicCache(config=fam.model.config)             # transformers' own: the sliding layers keep window-1
    assert [type(layer) for layer in own.layers] == [DynamicSlidingWindowLayer if k == "S" else DynamicLayer
                                                     for k in kinds]
    cache = sd.new_cache(fam.model)
    with torch.inference_mode():
        fam.model(input_ids=torch.tensor([fam.ids]), cache=cache, use_cache=True)
    assert [type(layer) for layer in cache.layers] == [DynamicLayer] * len(kinds)
    assert all(layer.keys.shape[-2] == PROMPT > WINDOW for layer in cache.layers)


def test_plain_decoding_is_greedy_past_the_window(fam):
    """Equal to the reference and to HF generate (transformers' sliding caches), and the window matters: the
    same weights with a window wider than the context decode otherwise."""
    out, events = sd.collect(sd.autoregressive(fam.model, fam.ids, NEW))
    assert out == fam.ref and len(events) == NEW
    hf = fam.model.generate(torch.tensor([fam.ids]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                            max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf[0, PROMPT:].tolist() == fam.ref
    wide = build(fam.name, 1000)
    wide.load_state_dict(fam.model.state_dict())
    assert greedy_without_cache(wide, fam.ids, NEW) != fam.ref
    assert len(set(fam.ref)) >= 5                               # a varied continuation, not one repeated token


def test_tree_mask_gives_the_logits_of_each_path(fam):
    """One forward over a tree with `verification_mask` == plain forwards over prefix + path, for every node,
    on a prefix longer than the window; the full-attention mask alone gets some node wrong."""
    model, prefix = fam.model, fam.ids + fam.ref[:6]
    root, tokens, parents = 33, [40, 41, 42, 43, 44, 45], [-1, -1, 0, 0, 2, 1]
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    M, L = len(tokens), len(prefix)
    parent_row = torch.tensor([0] + [p + 1 for p in parents])
    anc = sd.ancestors(parent_row, max(depths))
    positions = torch.tensor([L] + [L + x for x in depths])

    def tree(mask):
        cache = sd.new_cache(model)
        model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        return model(input_ids=torch.tensor([[root] + tokens]), cache=cache, use_cache=True,
                     position_ids=positions[None], attention_mask=mask).logits[0]

    plain = []
    with torch.no_grad():
        for i in range(M + 1):
            path, node = [], i - 1
            while node >= 0:
                path.insert(0, tokens[node])
                node = parents[node]
            plain.append(model(input_ids=torch.tensor([prefix + [root] + path])).logits[0, -1])
        out = tree(sd.verification_mask(sd.attention_layout(model), L, anc, positions, model.dtype))
        unwindowed = tree(sd.tree_mask(L, anc, model.dtype))
    for i in range(M + 1):
        torch.testing.assert_close(out[i], plain[i], atol=1e-4, rtol=1e-4)
    assert any(not torch.allclose(unwindowed[i], plain[i], atol=1e-3) for i in range(M + 1))


# ----------------------------------------------------------------------------- greedy is lossless


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_chain_is_lossless(fam, k):
    for draft in drafts(fam):
        out, events = sd.collect(sd.speculative(fam.model, draft, fam.ids, NEW, k=k))
        assert out == fam.ref, type(draft).__name__
        assert all(e.drafted <= k for e in events)
    assert 0 < sum(e.accepted for e in events) < sum(e.drafted for e in events)        # the knowing draft: partial


@pytest.mark.parametrize("tree", [sd.TreeSpec(4, 2, 2), sd.TreeSpec(8, 2, 4)])
def test_greedy_tree_is_lossless(fam, tree):
    for draft in drafts(fam):
        out, events = sd.collect(sd.speculative(fam.model, draft, fam.ids, NEW, tree=tree))
        assert out == fam.ref, type(draft).__name__
        assert all(e.drafted <= tree.budget for e in events)
    assert sum(e.accepted for e in events) >= NEW // 2                 # the knowing draft: its second choices found


def test_a_head_that_transforms_its_logits_is_read_at_every_tree_row(fam):
    """Elsewhere the tree projects only the rows with children (and an accepted leaf from its final state with the
    output embedding alone, which could break a low-precision tie differently from a transformed head)."""
    seen = []                                        # (rows verified, rows projected) of each tree verification

    def spy(module, args, kwargs):
        if isinstance(kwargs["logits_to_keep"], torch.Tensor):
            seen.append((kwargs["input_ids"].shape[1], kwargs["logits_to_keep"].numel()))

    hook = fam.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        out, _ = sd.collect(sd.speculative(fam.model, drafts(fam)[-1], fam.ids, 12, tree=sd.TreeSpec(8, 2, 4)))
    finally:
        hook.remove()
    assert out == fam.ref[:12] and seen
    assert all((projected == rows) == (fam.name in HEAD_TRANSFORMED) for rows, projected in seen)


def test_greedy_decoding_with_prompt_lookup_is_lossless(fam):
    """Two prompts; the untrained draft proposes where lookup finds nothing. `repeat` holds the target's
    continuation between two copies of the prompt: where every layer slides, the last 8 positions decide the next
    token, so after the copy the continuation recurs and lookup is accepted (full-attention layers read the whole
    context, and there it may not recur). `pairs` holds the prompt's last token followed by every token: whatever
    the target produces first, lookup proposes after it."""
    repeat = fam.ids + fam.ref[:12] + fam.ids
    pairs = [t for x in range(SHAPE["vocab_size"]) for t in (fam.ids[-1], x)] + fam.ids
    draft = fam.draft
    events = {}
    for name, prompt in (("repeat", repeat), ("pairs", pairs)):
        out, events[name] = sd.collect(sd.speculative(fam.model, draft, prompt, NEW, k=2, lookup=4))
        assert out == greedy_without_cache(fam.model, prompt, NEW), name
    assert {e.proposer for e in events["pairs"]} == {"none", "lookup", "draft"}
    if sd.FULL not in sd.attention_layout(fam.model).kinds:
        assert sum(e.accepted for e in events["repeat"] if e.proposer == "lookup") >= 4


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config,problem", [
    (Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8), "chunked_attention"),
    # a layer with no cache of its own ("moe" -> transformers' "dummy"); linear attention decodes: test_hybrid_decoding.py
    (Qwen3NextConfig(num_hidden_layers=4, layer_types=["linear_attention", "moe", "linear_attention", "full_attention"]),
     "dummy"),
    (Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True), "bidirectionally"),
])
def test_what_cannot_be_kept_exact_is_refused_before_decoding(config, problem):
    """In one line naming the problem and the fix, before the target runs (the stand-in has no forward)."""
    target = SimpleNamespace(config=config, device=torch.device("cpu"))
    for decode in (lambda: sd.autoregressive(target, [5, 6, 7], 4),
                   lambda: sd.speculative(target, LookupDraft([], config.vocab_size), [5, 6, 7], 4)):
        with pytest.raises(LayerScopeError, match=problem) as err:
            next(decode())
        assert "\n" not in str(err.value) and err.value.fix
