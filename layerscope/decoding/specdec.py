"""Speculative decoding with an EAGLE-3 draft head, and the plain decoder it is measured against.

Three decoders share one KV-cache machinery and one event stream:

    autoregressive(model, ids, n)               one target forward per token: the baseline
    speculative(model, draft, ids, n, k=4)      a chain of k draft tokens, verified in one target forward
    speculative(..., tree=TreeSpec(16, 4, 5))   an EAGLE-2 dynamic tree, verified in one target forward
    speculative(..., lookup=4)                  prompt lookup first: where the context's last tokens occurred
                                                before, up to 4 tokens that followed them; the draft elsewhere
    speculative(..., lookup=LookupSpan(4, 16))  adaptive prompt lookup: 4 tokens first, more after a lookup
                                                accepted whole (up to 16), fewer after a rejection

Each is a generator of `StepEvent`, one per target forward (step 0 is the prompt's prefill);
the output is the concatenation of the events' `tokens` (see `collect`). Nothing here prints.

Greedy decoding (temperature 0) is lossless: the tokens are those of plain greedy decoding with
the target. At temperature > 0 the chain uses speculative sampling (accept a draft token d with
probability min(1, p(d)/q(d)), else resample from max(0, p - q)), so every token is distributed
exactly as the target's own sample would be.

Caches. The target keeps a `transformers.DynamicCache` holding every token but the last one
produced; after verification the rejected entries are cut off with `DynamicCache.crop(-n)` (tree:
the accepted nodes' entries are first gathered next to the prefix). The draft keeps its own
cache of "step-1 rows" (see docs/internals.md, Draft head); the deeper draft steps appended while
drafting are cropped away after each verification. Nothing is recomputed.

Sliding-window and mixed targets (Mistral with a window, Gemma 2/3, gpt-oss, Cohere2, Starcoder2, ...):
every layer keeps a full-length cache (a `DynamicLayer`, which crops exactly; transformers' own
`DynamicSlidingWindowLayer` keeps only the last window-1 positions and cannot be cut back past them), and
the window is applied by the masks alone: the target builds its sliding masks from the cache length
when no mask is passed, and the tree passes a windowed version of its mask to the sliding layers
(`AttentionLayout`, `verification_mask`).

Exact in bfloat16 (`row_alignment`, `exact_attention`): a bf16 forward's numbers for one token depend on the forward's
shape (matrix kernels and blockings chosen by the row count; attention kernels that reduce a row by the rows beside
it and the keys' length), so a verification of k+1 tokens and a one-token step can round a near-tie differently.
Every target forward of these decoders is therefore padded with throwaway rows to the fewest rows that keep this
machine's matrix products alike (measured: `row_invariance`; 2 on an AMD EPYC with AVX-512 BF16, 16 on a CPU with
AMX), and the padding is cut from the cache at once; and each real row of a decoding forward or a tree attends alone
over exactly its visible keys (`exact_attention.row_attention`), so a tree node attends as the chain through it would.
Measured on SmolLM2-135M, bf16, 16 prompts x 48 tokens, chains K=1 and K=3: 14 of 32 outputs differed from plain
decoding without padding on a Xeon with AMX, 0 with it; on the EPYC 16-row padding with torch's attention left 24 of
260 rows apart from the one-token step and 1 of 48 outputs (a tree's), 2-row padding with rows attending alone 0 of
260 (docs/internals.md, "bfloat16 and lossless").

Targets with recurrent state beside attention (gated delta-nets, Mamba/Mamba-2 mixers, short convolutions: Qwen3-Next,
Qwen3.5, OLMo-Hybrid, Jamba, Bamba, GraniteMoeHybrid, Falcon-H1, LFM2): after the prefill their layers record the state
after each token of a verification forward (`record_states`), and the crop takes back the state after the accepted
ones. A tree is verified one root-to-leaf path per batch row from a copy of the cache, then the accepted path is
replayed on the cache itself (`_tree_step_by_paths`). docs/internals.md, "Targets with recurrent state".
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from layerscope import layerset
from layerscope.decoding import exact_attention, row_invariance
from layerscope.draft.model import DraftCache
from layerscope.errors import DraftError, LayerScopeError
from layerscope.target.head import HEAD_TRANSFORMS
from layerscope.validate import check_number

# Draft depth of the chain, chosen by measurement on 2 CPU cores with SmolLM2-135M and drafts trained on
# CPU budgets (first-position acceptance 0.23-0.27): K=2 gave 0.657x/0.667x of plain decoding, K=4
# 0.645x/0.647x, on 20 held-out prompts (docs/internals.md, "Choosing K"). Positions 3-4 accepted <4%.
# A stronger draft moves the best K up: `layerscope bench --draft D --k 2,3,4,5,6` measures it.
DEFAULT_K = 2

# Prompt lookup inside speculative decoding (`lookup`): the n-gram sizes matched against the context, longest
# first. Two tokens at least: a single recurring token is too weak a cue to take the step from the draft.
LOOKUP_NGRAMS = (3, 2)
# Tokens a lookup proposes at most, where nothing else is asked (the app): on this 2-core CPU a 5-token verify
# of SmolLM2-135M costs about what a 3-token one does (1.24x a 1-token forward), a 7-token one 1.67x.
DEFAULT_LOOKUP = 4
# Adaptive prompt lookup (`LookupSpan` with cap > start): after a lookup whose every token was accepted the next one
# proposes LOOKUP_GROW more tokens, up to the cap; after a rejection LOOKUP_SHRINK fewer, down to the start. The rule
# of transformers' "heuristic" schedule for assistant models (+2 when every candidate was accepted, else -1:
# generation/candidate_generator.py, AssistedCandidateGenerator.update_candidate_strategy); its prompt lookup
# (PromptLookupCandidateGenerator) keeps a fixed span, prompt_lookup_num_tokens (10 by default).
LOOKUP_GROW, LOOKUP_SHRINK = 2, 1
DEFAULT_ADAPTIVE_CAP = 16          # the app's adaptive span: DEFAULT_LOOKUP..DEFAULT_ADAPTIVE_CAP

# The most rows a target forward in 16-bit floats is padded to at least, and the multiple its last position is padded
# to (`row_alignment` measures the fewest this machine needs: row_invariance.CANDIDATES, this the largest). 16 is one
# AMX tile of rows; on a CPU with AMX a 16-row forward of Qwen2.5-Coder-1.5B costs what a one-row step does
# (verification 16 / step 0.98, docs/results.md), where on an AMD EPYC with AVX-512 BF16 it cost 2.2-2.4x (2026-12-07).
ROW_ALIGN = row_invariance.CANDIDATES[-1]
# A padded forward of at most this many real rows (a decoding step, a verification) attends one real row at a time
# (exact_attention.row_attention): torch's CPU attention kernels reduce a row differently by the rows beside it
EXACT_ROWS = 64

clock = time.perf_counter    # StepEvent.elapsed_s; tests of the cost model read a thread's CPU time instead


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 dynamic tree: expand the `top_k` most probable nodes of each depth by their `top_k`
    best children, down to `depth`; verify the `budget` most probable nodes of the whole tree."""

    budget: int = 16
    top_k: int = 4
    depth: int = 5


@dataclass(frozen=True)
class LookupSpan:
    """How many tokens prompt lookup proposes: `start` at first; with cap > start adaptive, growing by
    LOOKUP_GROW after a lookup accepted whole, up to `cap`, and shrinking by LOOKUP_SHRINK after a rejection,
    down to `start`; cap == start: always `start` (a fixed span, `speculative(lookup=N)`)."""

    start: int
    cap: int

    @classmethod
    def fixed(cls, n: int) -> "LookupSpan":
        return cls(n, n)

    @property
    def adaptive(self) -> bool:
        return self.cap > self.start

    @property
    def label(self) -> str:
        """"lookup 4" (fixed) or "lookup 4..16" (adaptive), as `--lookup` takes it."""
        return f"lookup {self.start}..{self.cap}" if self.adaptive else f"lookup {self.start}"

    def next(self, span: int, drafted: int, accepted: int) -> int:
        """The span after a lookup step that verified `drafted` tokens of a `span`-token proposal and accepted
        `accepted` of them."""
        if accepted >= drafted:
            return min(self.cap, span + LOOKUP_GROW)
        return max(self.start, span - LOOKUP_SHRINK)

    def to_json(self) -> dict:
        return {"start": self.start, "cap": self.cap}


def lookup_span(lookup: int | LookupSpan, name: str = "the prompt lookup span") -> LookupSpan | None:
    """speculative's `lookup` as a LookupSpan (None: off), refused in one line naming `name` when it cannot be one."""
    span = lookup if isinstance(lookup, LookupSpan) else LookupSpan.fixed(lookup)
    fix = "Pass --lookup 4 (a fixed span), --lookup 4..16 (adaptive) or 0 (off)"
    check_number(name, span.start, minimum=0, integer=True, fix=fix)
    check_number(f"{name}'s cap", span.cap, minimum=span.start, integer=True, fix=fix)
    return span if span.start else None


@dataclass(frozen=True)
class StepEvent:
    """One target forward."""

    step: int                          # 0 = the prefill over the prompt
    drafted: int                       # draft tokens verified (chain: depth, tree: nodes, autoregressive: 0)
    accepted: int                      # draft tokens the target accepted
    accepted_mask: tuple[bool, ...]    # per draft position (tree: per depth) 1..: was it accepted
    bonus_token: int                   # the target's own token after the accepted ones
    tokens: tuple[int, ...]            # tokens added to the output: accepted + bonus, cut after EOS
    elapsed_s: float                   # wall time of the step: drafting, verification, cache upkeep
    proposer: str = "draft"            # who proposed the verified tokens: "draft" | "lookup" (the context) |
                                       # "none" (plain decoding, the prefill)


def collect(events: Iterable[StepEvent]) -> tuple[list[int], list[StepEvent]]:
    """Drain a decoder: (generated tokens, events)."""
    events = list(events)
    return [t for e in events for t in e.tokens], events


# ----------------------------------------------------------------------------- caches


FULL, SLIDING = "full_attention", "sliding_attention"      # transformers' layer kinds (config.layer_types)
# Layer kinds that keep a recurrent state (transformers' LinearAttentionLayer): gated delta-nets and Mamba/Mamba-2 mixers
# ("linear_attention": a short convolution and a recurrent or SSM state), short convolutions alone ("conv", LFM2),
# and a Mamba mixer beside full attention in the same layer ("hybrid", Falcon-H1).
LINEAR, CONV, HYBRID = "linear_attention", "conv", "hybrid"
RECURRENT = (LINEAR, CONV, HYBRID)


@dataclass(frozen=True)
class AttentionLayout:
    """How the target's layers attend, as transformers builds their masks.

    kinds: each layer's kind, FULL, SLIDING or one of RECURRENT. window: the sliding layers' window (None without
    them): a query at position q sees the keys at positions p with q - window < p <= q, the rule of transformers'
    `sliding_window_overlay` (masking_utils.py), which every sliding mask is built from.
    """

    kinds: tuple[str, ...]
    window: int | None

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (conv, SSM or delta-net), which a crop cannot cut back by itself
        (docs/internals.md, "Targets with recurrent state")."""
        return any(kind in RECURRENT for kind in self.kinds)


def attention_layout(model) -> AttentionLayout:
    """The target's `AttentionLayout`; refuses, before anything is decoded, what this decoder cannot keep exact.

    The kinds are those transformers' caches are built from (cache_utils.get_layer_types_and_kwargs: the
    config's layer_types, else each layer's sliding_window / attention_chunk_size); the window is the one the
    masks use (masking_utils.create_sliding_window_causal_mask reads config.sliding_window).
    """
    config = model.config.get_text_config(decoder=True)
    kinds, kwargs = get_layer_types_and_kwargs(config)
    odd = sorted(set(kinds) - {FULL, SLIDING, *RECURRENT})
    if odd:
        raise LayerScopeError(f"the target has layers of kind {odd}, whose cache or mask this decoder cannot keep exact "
                              f"(it handles {FULL}, {SLIDING} and the recurrent kinds {list(RECURRENT)})",
                              "Use a target whose layers all use full or sliding-window attention, "
                              "or linear attention, Mamba or short convolutions beside them")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise LayerScopeError("the target attends bidirectionally, so its tokens cannot be decoded one after another",
                              "Use a causal language model")
    window = getattr(config, "sliding_window", None) if SLIDING in kinds else None
    windows = {kw["sliding_window"] for kind, kw in zip(kinds, kwargs) if kind == SLIDING}
    if SLIDING in kinds and (window is None or windows != {window}):
        raise LayerScopeError(f"the target's sliding layers do not share one window (layers: {windows}, "
                              f"masks: {window})", "Use a target with one sliding window")
    return AttentionLayout(tuple(kinds), window)


def new_cache(model) -> DynamicCache:
    """An empty DynamicCache for `model` whose every attention layer is a full-length `DynamicLayer`, which can be cut
    back exactly (sliding layers too: their window is applied by the masks); a recurrent layer gets transformers' own
    `LinearAttentionLayer` (a Falcon-H1 "hybrid" layer: `LinearAttentionAndFullAttentionLayer`, full-length too), which
    cuts back only while it records its states (`record_states`). Refuses what `attention_layout` refuses."""
    config = model.config.get_text_config(decoder=True)
    _, kwargs = get_layer_types_and_kwargs(config)
    layers = {LINEAR: LinearAttentionLayer, CONV: LinearAttentionLayer, HYBRID: LinearAttentionAndFullAttentionLayer}
    cache = DynamicCache()
    cache.layers = [layers[kind](**kw) if kind in layers else DynamicLayer()
                    for kind, kw in zip(attention_layout(model).kinds, kwargs)]
    return cache


def _recurrent_layers(cache: DynamicCache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def record_states(cache: DynamicCache) -> None:
    """From now on, let the recurrent layers of `cache` be cut back: each keeps, until the next `crop_cache`, its
    convolution inputs of the forward and the recurrent state after each of the forward's tokens (transformers'
    `activate_past_recording`; `_target_forward` asks for one state per token). No-op for attention-only caches.

    Called after the prefill, so the prompt runs through the model's chunked kernels exactly as in `generate` and
    nothing of it is kept twice."""
    for layer in _recurrent_layers(cache):
        layer.activate_past_recording()
        # one list per state: activate_past_recording's dict.fromkeys would share one list between a layer's states
        layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}


def _records(cache: DynamicCache) -> bool:
    return any(layer.record_past for layer in _recurrent_layers(cache))


def cache_length(cache: DynamicCache) -> int:
    """Positions held by the cache, read from an attention layer where there is one (a recurrent layer counts its
    tokens in a tensor, `cumulative_length_linear`)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            return int(layer.get_seq_length())
    return int(cache.get_seq_length())


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions. (DynamicCache.crop takes minus the number to drop.) A recording recurrent
    layer takes back its state after `length` tokens and drops its record, so it is cropped even when nothing is cut."""
    extra = cache_length(cache) - length
    if extra > 0 or _records(cache):
        cache.crop(-extra)


def compact_cache(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep positions [0, start) followed by positions `keep` (ascending, all >= start); drop the rest."""
    if keep != list(range(start, start + len(keep))):
        idx = torch.tensor(keep, device=cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys[..., start:start + len(keep), :] = layer.keys[..., idx, :]
            layer.values[..., start:start + len(keep), :] = layer.values[..., idx, :]
    crop_cache(cache, start + len(keep))


# ----------------------------------------------------------------------------- the target side


def row_alignment(model) -> int:
    """The rows a target forward is padded to at least, for a target whose weights are 16-bit floats and whose every
    layer attends (full or sliding window): the fewest that keep a row's matrix products alike wherever it sits,
    measured on this machine with the model's own forwards (`row_invariance.alignment`: 1, no padding, up to
    ROW_ALIGN; once per process). 0 (forwards as they are, attention as transformers runs it) in float32, where the
    decoders are exact without it, and for targets with recurrent layers, whose state a padding row would advance (a
    recording layer could take it back, plain decoding's does not record)."""
    if model.dtype not in (torch.bfloat16, torch.float16) or attention_layout(model).recurrent:
        return 0

    def forward(ids, positions, cache, align):
        return _target_forward(model, ids, positions, cache, align=align)[0]

    return row_invariance.alignment(model, forward, lambda: new_cache(model), crop_cache)


def padding_rows(start: int, rows: int, align: int) -> int:
    """Throwaway rows after `rows` real ones starting at position `start`: the fewest that make the forward at least
    `align` rows long and end at a multiple of `align` (0 when align is 0)."""
    if not align:
        return 0
    pad = -(start + rows) % align
    return pad + align * max(0, -(-(align - rows - pad) // align))


def _padded_mask(mask, prefix: int, rows: int, pad: int):
    """A 4-D additive mask [1, 1, rows, prefix+rows] (or a dict of them, `verification_mask`) for `pad` more rows:
    the real rows never see the padding; a padding row sees everything up to itself (never an empty row)."""
    if isinstance(mask, dict):
        return {kind: _padded_mask(m, prefix, rows, pad) for kind, m in mask.items()}
    low = torch.finfo(mask.dtype).min
    out = torch.full((1, 1, rows + pad, prefix + rows + pad), low, dtype=mask.dtype, device=mask.device)
    out[..., :rows, :prefix + rows] = mask
    out[..., rows:, :prefix + rows] = 0
    out[..., rows:, prefix + rows:] = torch.where(
        torch.ones(pad, pad, dtype=torch.bool, device=mask.device).tril(), 0.0, low).to(mask.dtype)
    return out


def _target_forward(model, ids: Sequence[int], positions: torch.Tensor, cache, aux_layers=None, mask=None,
                    last_only: bool = False, keep: torch.Tensor | None = None, align: int | None = None):
    """Append `ids` at `positions` [T] to the cache: logits [T, V] ([1, V] with last_only, [len(keep), V] for
    the rows `keep`), aux [T, k*d] or None.

    In 16-bit floats the forward is padded to `padding_rows` more rows (`row_alignment`: the module docstring says
    why), their logits computed with the real rows' and every padding entry cut from the cache before returning, and
    a decoding forward (at most EXACT_ROWS rows) or a tree's attends one real row at a time
    (`exact_attention.rows_alone`). `align`: pad to that many rows instead of `row_alignment`'s (its own probe).
    A recurrent layer that records (`record_states`) keeps its state after each of the T tokens, so `crop_cache` can
    go back to any of them: the model then runs all T tokens through its one-token recurrent kernel, the one plain
    decoding runs, instead of the chunked one."""
    dev, T = positions.device, len(ids)
    start = cache_length(cache)
    align = row_alignment(model) if align is None else align
    pad = padding_rows(start, T, align)
    # a decoding forward's and a tree's real rows attend one at a time (exact_attention.row_attention); a longer
    # forward without a mask is a prompt's prefill, which every decoder runs alike
    alone = bool(align) and (T <= EXACT_ROWS or mask is not None) and exact_attention.install(model)
    ids = list(ids) + [int(ids[-1])] * pad
    if pad:
        positions = torch.cat([positions, positions.max() + 1 + torch.arange(pad, device=dev)])
        mask = None if mask is None else _padded_mask(mask, start, T, pad)
    for layer in _recurrent_layers(cache):
        layer.recurrent_states_to_keep = len(ids) if layer.record_past else 0
    # padded, the vocabulary projection runs over `align` rows at least (fewer would round apart), and over the
    # last rows only where only the last real row is wanted (a long prompt's prefill)
    tail = min(len(ids), pad + align) if pad and last_only and keep is None else 0
    with exact_attention.rows_alone(T) if alone else nullcontext():
        out = model(input_ids=torch.tensor([ids], device=dev), position_ids=positions[None], cache=cache,
                    attention_mask=mask, use_cache=True, output_hidden_states=aux_layers is not None,
                    logits_to_keep=tail if pad else keep if keep is not None else 1 if last_only else 0)
    aux = torch.cat([out.hidden_states[l][0, :T] for l in aux_layers], -1) if aux_layers is not None else None
    logits = out.logits[0]
    if pad:
        crop_cache(cache, start + T)
        logits = (logits[keep] if keep is not None else logits[-pad - 1:-pad] if last_only else logits[:T])
    return logits.float(), aux


def tree_mask(prefix: int, ancestors: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor | None = None,
              window: int | None = None) -> torch.Tensor:
    """Additive 4-D mask [1, 1, T, prefix+T]: every row sees the cached prefix and its ancestors-or-self.

    ancestors: bool [T, T], ancestors[i, j] = row j is row i or one of its ancestors.
    window: also hide the keys `window` or more positions back (AttentionLayout.window); positions [T] are the
    rows' positions, cache entry j < prefix holds position j.
    transformers passes a 4-D mask through untouched (masking_utils), and a float mask is added to
    the scores by both the sdpa and eager attention paths.
    """
    T = ancestors.shape[0]
    allowed = torch.cat([torch.ones(T, prefix, dtype=torch.bool, device=ancestors.device), ancestors], 1)
    if window is not None:
        keys = torch.cat([torch.arange(prefix, device=positions.device), positions])          # [prefix+T]
        allowed &= positions[:, None] - keys[None] < window
    zero = torch.zeros((), dtype=dtype, device=ancestors.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def verification_mask(layout: AttentionLayout, prefix: int, ancestors: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype):
    """The tree's mask as the target takes it (arguments as `tree_mask`).

    A 4-D mask reaches every layer as it is, so one tensor serves a target whose layers are all of one kind;
    a mixed one (Gemma 2/3, gpt-oss, Cohere2, Qwen2/3 with a window) takes a dict {kind: mask}, which its
    model forward uses in place of the masks it would build (`causal_mask_mapping` in modeling_gemma3.py,
    modeling_gpt_oss.py, modeling_cohere2.py, modeling_qwen2.py).
    """
    masks = {}
    if FULL in layout.kinds:
        masks[FULL] = tree_mask(prefix, ancestors, dtype)
    if SLIDING in layout.kinds:
        masks[SLIDING] = tree_mask(prefix, ancestors, dtype, positions, layout.window)
    return masks if len(masks) > 1 else next(iter(masks.values()))


def _pick(logits: torch.Tensor, temperature: float, gen) -> int:
    """Greedy (temperature 0) or sampled next token from logits [V]."""
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))


def _generator(device, seed: int):
    return torch.Generator(device=device).manual_seed(seed)


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _cut(tokens: list[int], eos: set[int]) -> tuple[int, ...]:
    """Tokens up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tuple(tokens[:i + 1])
    return tuple(tokens)


def _prompt(input_ids) -> list[int]:
    ids = input_ids.flatten().tolist() if isinstance(input_ids, torch.Tensor) else [int(t) for t in input_ids]
    if not ids:
        raise LayerScopeError("the prompt is empty", "Give at least one token")
    return ids


def decoding_draft(head, loaded):
    """`head` (a DraftHead) as the decoders run it beside `loaded` (a LoadedModel): in the target's dtype, as serving
    engines load an EAGLE-3 draft in the model's dtype. So where precision.choose gave the target bfloat16 (its matrix
    products are faster there), the draft's are too; a float32 target keeps a float32 draft. Training never calls
    this: it keeps float32 weights (bf16 only under autocast). Returns the same module, moved."""
    return head.to(dtype=loaded.dtype)


# ----------------------------------------------------------------------------- autoregressive


def autoregressive(model, input_ids, max_new_tokens: int, *, eos_token_id=None, temperature: float = 0.0,
                   seed: int = 0) -> Iterator[StepEvent]:
    """Plain decoding, one target forward per token, with the same cache as `speculative`."""
    ids, eos = _prompt(input_ids), _eos_set(eos_token_id)
    device = model.device
    gen = _generator(device, seed) if temperature > 0 else None
    cache = new_cache(model)
    feed, produced, step = ids, 0, 0
    while produced < max_new_tokens:
        t0 = clock()
        with torch.inference_mode():
            start = cache_length(cache)
            logits, _ = _target_forward(model, feed, torch.arange(start, start + len(feed), device=device), cache,
                                        last_only=True)
            tok = _pick(logits[-1], temperature, gen)
        produced += 1
        yield StepEvent(step, 0, 0, (), tok, (tok,), clock() - t0, "none")
        if tok in eos:
            return
        feed, step = [tok], step + 1


# ----------------------------------------------------------------------------- speculative


class _Draft:
    """The draft head with its cache of step-1 rows, and the rows it has not been fed yet.

    Step-1 row t reads (embed(x_{t+1}), g_t) at position t, where g_t fuses the target's states at
    the draft's aux layers at position t; its output predicts x_{t+2} (docs/internals.md).
    """

    def __init__(self, head, device):
        self.head = head
        self.cache = DraftCache()
        self.rows = 0                                    # step-1 rows in the cache
        self.pending_ids: list[int] = []                 # x_{t+1} of rows not yet fed
        self.pending_g: list[torch.Tensor] = []          # fused g_t [r, d] of those rows
        self.device = device

    def add_rows(self, next_ids: list[int], aux: torch.Tensor) -> None:
        """Queue step-1 rows: next_ids[i] = x_{t+1}, aux [r, k*d] the target's states at t."""
        self.pending_ids += next_ids
        self.pending_g.append(self.head.fuse(aux[None])[0])

    def feed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the queued rows; the last row's (logits [V_draft], hidden [d]) predict the next token."""
        r = len(self.pending_ids)
        pos = torch.arange(self.rows, self.rows + r, device=self.device)
        logits, hidden = self.head(torch.tensor([self.pending_ids], device=self.device),
                                   torch.cat(self.pending_g)[None], pos[None], self.cache)
        self.rows += r
        self.pending_ids, self.pending_g = [], []
        return logits[0, -1].float(), hidden[0, -1]

    def step(self, ids, hidden: torch.Tensor, positions: torch.Tensor, mask=None):
        """Deeper draft steps (appended to the cache): ids [T] (list or tensor), hidden [T, d]
        -> logits [T, V_draft], hidden [T, d]."""
        ids = torch.as_tensor(ids, device=self.device).reshape(1, -1)
        logits, out = self.head(ids, hidden[None], positions[None], self.cache, attention_mask=mask)
        return logits[0].float(), out[0]

    def rewind(self) -> None:
        """Drop the deeper steps: keep only the step-1 rows."""
        self.cache.crop(self.rows)


def _check_draft(model, draft) -> None:
    layerset.check(list(draft.aux_layers), model.config.num_hidden_layers, "The draft's layers", DraftError)
    if int(draft.t2d.numel()) != model.config.vocab_size:
        raise DraftError(f"the draft maps a vocabulary of {draft.t2d.numel()} tokens, the target has "
                         f"{model.config.vocab_size}", "Use a draft trained for this target")


def speculative(model, draft, input_ids, max_new_tokens: int, *, k: int = DEFAULT_K, tree: TreeSpec | None = None,
                lookup: int | LookupSpan = 0, eos_token_id=None, temperature: float = 0.0,
                seed: int = 0) -> Iterator[StepEvent]:
    """Decode with `draft` proposing and `model` verifying: a chain of depth `k`, or a `tree`.

    draft: a DraftHead (layerscope.draft.model). Greedy at temperature 0; sampling needs the chain.
    lookup > 0: before each step, `lookup_proposal` searches the prompt and the output so far; where it finds
    a continuation, up to `lookup` of its tokens are verified as a chain instead of the draft's (events with
    proposer "lookup"). A LookupSpan with cap > start adapts that number to how the previous lookups fared.
    Lossless either way: a proposal, and its length, only decide what is verified, and both are fixed by what
    happened before the step (at temperature > 0 too: each step's tokens follow the target's law given the
    tokens before them, whatever was proposed).
    """
    if tree is not None and temperature > 0:
        raise LayerScopeError("tree drafting is greedy only", "Use the chain (no tree) for temperature > 0")
    if k < 1 or (tree is not None and min(tree.budget, tree.top_k, tree.depth) < 1):
        raise LayerScopeError("the draft depth, tree budget, top-k and depth must be at least 1", "")
    span_rule = lookup_span(lookup)
    layout = attention_layout(model)
    if tree is not None and not layout.recurrent and model.config._attn_implementation not in (
            "sdpa", "eager", exact_attention.ATTENTION):
        raise LayerScopeError(f"tree verification needs a 4-D attention mask, which the "
                              f"{model.config._attn_implementation} attention of the target cannot take",
                              "Load the target with attn_implementation='sdpa', or use the chain")
    _check_draft(model, draft)
    ids, eos = _prompt(input_ids), _eos_set(eos_token_id)
    if max_new_tokens < 1:
        return
    device = model.device
    gen = _generator(device, seed) if temperature > 0 else None
    cache, d = new_cache(model), _Draft(draft, device)
    aux_layers = list(draft.aux_layers)

    # step 0: prefill the target; the draft's rows 0..n-1 are queued
    t0 = clock()
    with torch.inference_mode():
        logits, aux = _target_forward(model, ids, torch.arange(len(ids), device=device), cache, aux_layers,
                                      last_only=True)
        last = _pick(logits[-1], temperature, gen)
        d.add_rows(ids[1:] + [last], aux)
        record_states(cache)                                 # recurrent layers: from now on, states per token
    yield StepEvent(0, 0, 0, (), last, (last,), clock() - t0, "none")
    produced, step, context = 1, 1, ids + [last]
    span = span_rule.start if span_rule else 0               # tokens the next lookup proposes at most
    while produced < max_new_tokens and last not in eos:
        t0 = clock()
        left = max_new_tokens - produced - 1                  # draft tokens beyond this step's bonus token
        found = lookup_proposal(context, min(span, left)) if span_rule else []
        depth = min(tree.depth if tree else k, left)
        with torch.inference_mode():
            if found:
                qs = [_one_hot(t, model.config.vocab_size, device) for t in found] if temperature > 0 else []
                drafted, accepted, mask, new = _verify_chain(model, d, cache, last, found, qs, aux_layers,
                                                             temperature, gen)
            elif tree is not None and depth > 0 and layout.recurrent:
                drafted, accepted, mask, new = _tree_step_by_paths(model, d, cache, last, depth, tree, aux_layers)
            elif tree is not None and depth > 0:
                drafted, accepted, mask, new = _tree_step(model, d, cache, last, depth, tree, aux_layers, layout)
            else:
                drafted, accepted, mask, new = _chain_step(model, d, cache, last, depth, aux_layers, temperature, gen)
        if found:
            span = span_rule.next(span, drafted, accepted)
        tokens = _cut(new, eos)
        produced, last = produced + len(tokens), tokens[-1]
        context += tokens
        yield StepEvent(step, drafted, accepted, mask, new[-1], tokens, clock() - t0,
                        "lookup" if found else "draft")
        step += 1


def lookup_proposal(context: Sequence[int], n: int) -> list[int]:
    """Prompt lookup: the up-to-`n` tokens that followed the latest earlier occurrence of the context's last
    3 tokens (else its last 2, LOOKUP_NGRAMS); [] when neither recurs or n < 1.

    context: the prompt and every token produced so far, the newest last. A match ending at the context's
    last token is the tail itself and is skipped, so a proposal is never empty when a match is found.
    """
    if n < 1:
        return []
    end = len(context)
    for g in LOOKUP_NGRAMS:
        if end <= g:
            continue
        tail, last = list(context[-g:]), context[-1]
        for start in range(end - g - 1, -1, -1):            # latest first; start + g < end: a token follows
            if context[start + g - 1] == last and list(context[start:start + g]) == tail:
                return [int(t) for t in context[start + g:start + g + n]]
    return []


def _one_hot(token: int, vocab: int, device) -> torch.Tensor:
    """A deterministic proposal's distribution [V]: speculative sampling accepts it with probability p(token)."""
    return torch.zeros(vocab, device=device).index_fill_(0, torch.tensor([token], device=device), 1.0)


def _draft_distribution(draft, logits: torch.Tensor, temperature: float, vocab: int) -> torch.Tensor:
    """The draft's sampling distribution over the target vocabulary [V_target] from logits [V_draft]."""
    p = torch.softmax(logits / temperature, -1)
    ids = draft.to_target_ids(torch.arange(p.shape[0], device=p.device))
    return torch.zeros(vocab, device=p.device).index_add_(0, ids, p)


def _chain_step(model, d: _Draft, cache, last: int, depth: int, aux_layers, temperature: float, gen):
    """Draft `depth` tokens one after another, verify them in one forward, cut both caches back."""
    L = cache_length(cache)                          # positions of everything but `last`
    drafts, qs = [], []
    if depth > 0:
        logits, hidden = d.feed()                    # row L-1: predicts the token after `last`
        for j in range(1, depth + 1):
            if temperature > 0:
                q = _draft_distribution(d.head, logits, temperature, model.config.vocab_size)
                tok = int(torch.multinomial(q, 1, generator=gen))
                qs.append(q)
            else:
                tok = int(d.head.to_target_ids(logits.argmax()[None])[0])
            drafts.append(tok)
            if j < depth:                            # step j+1 at row L-1 reads d_j at position L-1+j
                lg, hd = d.step([tok], hidden[None], torch.tensor([L - 1 + j], device=d.device))
                logits, hidden = lg[0], hd[0]
    return _verify_chain(model, d, cache, last, drafts, qs, aux_layers, temperature, gen)


def _verify_chain(model, d: _Draft, cache, last: int, drafts: list[int], qs: list[torch.Tensor], aux_layers,
                  temperature: float, gen):
    """Verify the proposed tokens `drafts` (each with its proposal distribution in `qs` when sampling) after
    `last` in one target forward; keep the accepted ones and the bonus token in both caches."""
    L, depth = cache_length(cache), len(drafts)
    logits, aux = _target_forward(model, [last] + drafts, torch.arange(L, L + depth + 1, device=d.device), cache,
                                  aux_layers)
    if temperature > 0:
        accepted, bonus = _accept_sampled(logits, drafts, qs, temperature, gen)
    else:
        target = logits.argmax(-1).tolist()          # target[i]: its token after last, d_1..d_i
        accepted = 0
        while accepted < depth and drafts[accepted] == target[accepted]:
            accepted += 1
        bonus = target[accepted]
    crop_cache(cache, L + 1 + accepted)
    d.rewind()
    new = drafts[:accepted] + [bonus]
    d.add_rows(new, aux[:accepted + 1])
    return depth, accepted, tuple(i < accepted for i in range(depth)), new


def _accept_sampled(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor], temperature: float, gen):
    """Speculative sampling: accept d_i with prob min(1, p_i(d_i)/q_i(d_i)); on the first rejection
    resample from max(0, p_i - q_i); if all pass, the bonus is sampled from p after the last."""
    p = torch.softmax(logits / temperature, -1)      # [depth+1, V]
    for i, (tok, q) in enumerate(zip(drafts, qs)):
        u = float(torch.rand((), generator=gen, device=p.device))
        if u * float(q[tok]) < float(p[i, tok]):     # u < p/q without dividing by a tiny q
            continue
        residual = (p[i] - q).clamp_min(0)
        residual = residual if float(residual.sum()) > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


@dataclass(frozen=True)
class TreeForward:
    """One tree verification's input, `tree_forward`'s: the grown tree as rows of a forward after the cache's L."""
    node_ids: torch.Tensor          # [M+1] the root (`last`), then the tree's nodes, parents before children
    parent_row: torch.Tensor        # [M+1] each row's parent row (the root is its own)
    anc: torch.Tensor               # [M+1, M+1] bool: anc[i, j], row j is row i or one of its ancestors
    positions: torch.Tensor         # [M+1] L + depth
    inner: torch.Tensor             # rows whose logits the forward computes (sorted)
    mask: object                    # verification_mask's additive mask(s) for the forward
    depth: int                      # the deepest node's depth

    def run(self, model, cache, aux_layers):
        """The forward: logits [len(inner), V] and aux [M+1, k*d + d] (the draft's layers, then the final norm's
        output), the M+1 rows appended to the cache."""
        return _target_forward(model, self.node_ids.tolist(), self.positions, cache,
                               list(aux_layers) + [model.config.num_hidden_layers], self.mask, keep=self.inner)


def tree_forward(model, d: _Draft, cache, last: int, depth: int, spec: TreeSpec, layout: AttentionLayout) -> TreeForward:
    """Grow an EAGLE-2 tree from the draft and lay it out for one verification forward after the cache.

    Rows of the verified input: 0 is `last` (the root), 1..M the tree's nodes, parents before children.
    The target's logits are computed only at the root and the nodes with children (its vocabulary
    projection is a fifth of a small model's forward); when the accepted path ends at a leaf, that one
    row is projected afterwards from the final hidden state. A target whose head transforms the logits
    (`HEAD_TRANSFORMS`), or whose forwards are padded (`row_alignment`), gets its logits at every row instead.
    A padded target's nodes attend one at a time over their visible keys (`_target_forward`, `exact_attention`), so
    every node's numbers are those of the chain through it, and of plain decoding.
    """
    L = cache_length(cache)
    tokens, parents, depths = _grow_tree(d, depth, spec)
    dev = d.device
    node_ids = torch.tensor([last] + tokens, device=dev)
    parent_row = torch.tensor([0] + [p + 1 for p in parents], device=dev)
    anc = ancestors(parent_row, max(depths))
    positions = L + torch.tensor([0] + depths, device=dev)
    aligned = row_alignment(model) > 0                                           # every row's logits: a leaf's
    inner = (torch.unique(parent_row) if _plain_head(model.config) and not aligned      # one-row projection would
             else torch.arange(len(node_ids), device=dev))                       # round apart (sorted)
    mask = verification_mask(layout, L, anc, positions, model.dtype)
    return TreeForward(node_ids, parent_row, anc, positions, inner, mask, max(depths))


def _tree_step(model, d: _Draft, cache, last: int, depth: int, spec: TreeSpec, aux_layers, layout: AttentionLayout):
    """Grow an EAGLE-2 tree, verify it in one forward (`tree_forward`), keep the accepted path's cache entries."""
    L = cache_length(cache)
    t = tree_forward(model, d, cache, last, depth, spec, layout)
    M, hd = len(t.node_ids) - 1, model.config.hidden_size
    logits, aux = t.run(model, cache, aux_layers)
    aux, final = aux[:, :-hd], aux[:, -hd:]                                      # final: post-norm states [M+1, d]
    target = torch.full((M + 1,), -1, dtype=torch.long, device=d.device)
    target[t.inner] = logits.argmax(-1)                                          # the target's next token
    rows = accepted_rows(t.node_ids, t.parent_row, t.anc, target)                # root, then the accepted path
    if target[rows[-1]] < 0:                                                     # a leaf: project its row
        target[rows[-1]] = model.get_output_embeddings()(final[rows[-1]]).float().argmax()
    bonus = int(target[rows[-1]])
    compact_cache(cache, L, [L + r for r in rows])
    d.rewind()
    new = t.node_ids[rows[1:]].tolist() + [bonus]
    d.add_rows(new, aux[rows])
    a = len(rows) - 1
    return M, a, tuple(i < a for i in range(t.depth)), new


def _tree_step_by_paths(model, d: _Draft, cache, last: int, depth: int, spec: TreeSpec, aux_layers):
    """`_tree_step` for a target with recurrent layers: grow the same EAGLE-2 tree, verify each root-to-leaf path as
    one row of a batch, then replay the accepted path on the target's own cache.

    A recurrent layer reads its input as one sequence, so a tree flattened into one (as `_tree_step` verifies it under
    a tree mask) would hand each node the state after its siblings and cousins. Here row b of the batch is
    [last, path b's tokens, padding] [P, D+1] (P leaves, D the deepest), run from a copy of the cache repeated P times
    (`_batch_copy`): every row is the forward a chain verifying that path would run. The accepted path is the longest
    prefix of a path that matches the target's own tokens (siblings carry distinct tokens, so it is one path whatever
    row shows it), and the bonus is the target's token after it. The copy is then dropped and [last, accepted tokens]
    run on the cache itself: its recurrent states become exactly those after the accepted tokens, and the draft gets
    their aux states from that replay.
    Cost: P*(D+1) rows against `_tree_step`'s M+1, the attention layers' cache repeated P times for that forward,
    and a replay of a+1 tokens (docs/internals.md, "Targets with recurrent state").
    """
    L = cache_length(cache)
    tokens, parents, depths = _grow_tree(d, depth, spec)
    M, dev = len(tokens), d.device
    children = set(parents)
    paths = []                                                       # each leaf's node indices, root side first
    for leaf in (i for i in range(M) if i not in children):
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        paths.append(path)
    D = max(len(path) for path in paths)
    rows = torch.tensor([[last] + [tokens[n] for n in path] + [last] * (D - len(path)) for path in paths],
                        device=dev)                                  # [P, D+1]; padding is never read back
    P = rows.shape[0]
    positions = torch.arange(L, L + D + 1, device=dev).expand(P, -1)
    out = model(input_ids=rows, position_ids=positions, cache=_batch_copy(cache, P, D + 1), use_cache=True)
    target = out.logits.argmax(-1)                                   # [P, D+1]: the target's token after each row
    lengths = torch.tensor([len(path) for path in paths], device=dev)
    match = (rows[:, 1:] == target[:, :-1]) & (torch.arange(D, device=dev)[None] < lengths[:, None])   # [P, D]
    accepted = match.long().cumprod(1).sum(1)                        # [P] matching prefix of each path
    b = int(accepted.argmax())
    a = int(accepted[b])
    new = rows[b, 1:a + 1].tolist() + [int(target[b, a])]
    _, aux = _target_forward(model, [last] + new[:-1], torch.arange(L, L + a + 1, device=dev), cache, aux_layers)
    crop_cache(cache, L + a + 1)                                     # nothing to cut: drops the replay's record
    d.rewind()
    d.add_rows(new, aux)
    return M, a, tuple(i < a for i in range(max(depths))), new


def _batch_copy(cache: DynamicCache, rows: int, tokens: int) -> DynamicCache:
    """A cache holding what `cache` holds, `rows` times over in the batch dimension, that a forward of `tokens` tokens
    can extend without touching `cache`: attention entries are expanded views (a forward concatenates to them into new
    tensors), the recurrent and convolution states, which a forward overwrites in place, are copied. Its recurrent
    layers record, as the chain's verification does (`_target_forward`), so every token goes through the one-token
    kernel: plain decoding's, and the only one some models apply to a cache that is not empty (transformers' Jamba
    scans a multi-token forward from a zero state, `mamba_scan_forward`)."""
    out = DynamicCache()
    out.layers = []
    for layer in cache.layers:
        twin = copy.copy(layer)
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            twin.keys = layer.keys.expand(rows, *layer.keys.shape[1:])
            twin.values = layer.values.expand(rows, *layer.values.shape[1:])
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for name in ("conv_states", "recurrent_states"):
                setattr(twin, name, {i: None if t is None else t.repeat(rows, *[1] * (t.dim() - 1))
                                     for i, t in getattr(layer, name).items()})
            twin.has_previous_state = dict(layer.has_previous_state)
            twin.cumulative_length_linear = layer.cumulative_length_linear.clone()
            twin.record_past, twin.recurrent_states_to_keep = True, tokens
            twin.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}
        out.layers.append(twin)
    return out


def _plain_head(config) -> bool:
    """Whether the target's logits are its output embedding of the final hidden state and nothing more (no
    `HEAD_TRANSFORMS`, layerscope/target/head.py). The transforms are monotone, so they keep the argmax, but in low precision
    they can round two near-equal logits into a tie the output embedding alone would not show, and break it
    differently."""
    text = config.get_text_config(decoder=True)
    return all(getattr(text, name, None) is None for name in HEAD_TRANSFORMS)


def ancestors(parent_row: torch.Tensor, depth: int) -> torch.Tensor:
    """bool [T, T]: anc[i, j] = row j is row i or one of its ancestors. parent_row [T]: each row's parent
    (row 0, the root, is its own); `depth` bounds the longest path below the root."""
    eye = torch.eye(parent_row.shape[0], dtype=torch.bool, device=parent_row.device)
    anc = eye
    for _ in range(depth):
        anc = eye | anc[parent_row]
    return anc


def accepted_rows(node_ids: torch.Tensor, parent_row: torch.Tensor, anc: torch.Tensor,
                  target: torch.Tensor) -> list[int]:
    """Rows of the longest root path whose every node is the target's own next token after its parent.

    node_ids, parent_row, target [T]; anc [T, T] from `ancestors`. Siblings carry distinct tokens, so the
    matching nodes whose ancestors all match form one path; it is returned root first.
    """
    match = node_ids == target[parent_row]
    match[0] = True                                                              # the root is given
    on_path = ~(anc & ~match[None]).any(1)                                       # [T] self and ancestors match
    depth = anc.sum(1)
    deepest = int(torch.where(on_path, depth, 0).argmax())
    return anc[deepest].nonzero().flatten().tolist()                             # ancestors precede children


def _grow_tree(d: _Draft, depth: int, spec: TreeSpec) -> tuple[list[int], list[int], list[int]]:
    """EAGLE-2 expansion from the draft's root distribution; returns the `budget` best nodes, parents
    before children: target token ids, parent index (-1 = root), depth (1-based).

    Every level is a handful of tensor operations whatever the number of nodes: the `top_k` best nodes of
    the level (the frontier) are fed in one draft step, each seeing the prefix, its expanded ancestors and
    itself; each gets `top_k` children scored by cumulative log-probability (float64, so rankings do not
    hinge on rounding); the next frontier is the `top_k` best children. Nodes are numbered in creation
    order, which is also by depth.
    """
    logits, hidden = d.feed()
    L, dev = d.rows, d.device                        # step-1 rows = target positions before `last`
    K = min(spec.top_k, logits.shape[-1])
    top = torch.log_softmax(logits, -1).topk(K)
    score = top.values.double()                      # every node so far: cumulative log-prob [n]
    tok = top.indices                                # draft token id [n]
    par = torch.full((K,), -1, dtype=torch.long, device=dev)    # parent node [n], -1 = root
    dep = torch.ones(K, dtype=torch.long, device=dev)           # depth [n]
    front = torch.arange(K, device=dev)              # frontier nodes [F]
    front_hidden = hidden[None].expand(K, -1)        # the draft state that predicts each of them [F, d]
    anc = torch.zeros(K, 0, dtype=torch.bool, device=dev)       # [F, rows past L]: expanded ancestors' rows
    for level in range(1, depth):
        F = front.shape[0]
        eye = torch.eye(F, dtype=torch.bool, device=dev)
        mask = torch.cat([torch.ones(F, L, dtype=torch.bool, device=dev), anc, eye], 1)[None, None]
        lg, out = d.step(d.head.to_target_ids(tok[front]), front_hidden,
                         torch.full((F,), L - 1 + level, device=dev), mask)
        best = torch.log_softmax(lg, -1).topk(K, -1)                            # [F, K]
        cand = (score[front][:, None] + best.values.double()).flatten()         # [F*K]
        first = score.shape[0]
        score, tok = torch.cat([score, cand]), torch.cat([tok, best.indices.flatten()])
        par = torch.cat([par, front.repeat_interleave(K)])
        dep = torch.cat([dep, torch.full((F * K,), level + 1, device=dev)])
        pick = torch.sort(-cand, stable=True).indices[:K]                       # the next frontier
        front, front_hidden = first + pick, out[pick // K]
        anc = torch.cat([anc[pick // K], eye[pick // K]], 1)
    # rank all nodes by score, then creation order: a parent scores >= its children and is older, so any
    # top-N is closed under parents
    chosen = torch.sort(-score, stable=True).indices[:spec.budget].sort().values
    index = torch.full_like(par, -1)
    index[chosen] = torch.arange(chosen.shape[0], device=dev)
    cpar = par[chosen]
    parents = torch.where(cpar >= 0, index[cpar.clamp_min(0)], -1)
    return d.head.to_target_ids(tok[chosen]).tolist(), parents.tolist(), dep[chosen].tolist()
