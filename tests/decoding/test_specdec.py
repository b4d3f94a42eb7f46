"""Speculative decoding: lossless greedy chain and tree, caches cut back, sampling keeps the target's law."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from layerscope.capture.run import capture
from layerscope.capture.stored import open_capture
from layerscope.decoding import specdec as sd
from layerscope.draft.checkpoint import load_draft
from layerscope.draft.training.train import draft_for
from layerscope.errors import DraftError, LayerScopeError
from layerscope.prompts.sets import chat_ids, load_prompts
from tests.helpers import LookupDraft, untrained_draft

PROMPTS = [[259, 72, 101, 108, 108, 111], [259, 50, 43, 50, 61], [259, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32]]


pytestmark = pytest.mark.usefixtures("one_thread")


def greedy_reference(model, ids, n) -> list[int]:
    """Plain greedy continuation by Hugging Face generate (independent of the engine)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def target(tiny):
    return tiny.model


@pytest.fixture(scope="module")
def refs(target):
    return [greedy_reference(target, ids, 30) for ids in PROMPTS]


# ----------------------------------------------------------------------------- target side


def test_autoregressive_equals_hf_greedy(target, refs):
    for ids, ref in zip(PROMPTS, refs):
        out, events = sd.collect(sd.autoregressive(target, ids, 30))
        assert out == ref
        assert [e.step for e in events] == list(range(30)) and all(e.drafted == 0 for e in events)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_mask_gives_the_logits_of_each_path(tiny, attn):
    """Tree forward with the 4-D mask and per-node positions == plain forwards over prefix + path."""
    model = LlamaForCausalLM(copy.deepcopy(tiny.model.config)).eval()   # a config of its own: the model shares the
    model.load_state_dict(tiny.model.state_dict())                       # object it is given, and setting attention
    model.config._attn_implementation = attn                             # on it would switch the session's tiny model
    prefix = PROMPTS[0]
    root, tokens, parents = 33, [40, 41, 42, 43, 44, 45], [-1, -1, 0, 0, 2, 1]
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    M, L = len(tokens), len(prefix)
    anc = torch.eye(M + 1, dtype=torch.bool)
    anc[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i + 1] |= anc[p + 1]
    with torch.no_grad():
        cache = sd.new_cache(model)
        model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        out = model(input_ids=torch.tensor([[root] + tokens]), cache=cache, use_cache=True,
                    position_ids=torch.tensor([[L] + [L + x for x in depths]]),
                    attention_mask=sd.tree_mask(L, anc, model.dtype)).logits[0]
        for i in range(M + 1):
            path, node = [], i - 1
            while node >= 0:
                path.insert(0, tokens[node])
                node = parents[node]
            plain = model(input_ids=torch.tensor([prefix + [root] + path])).logits[0, -1]
            torch.testing.assert_close(out[i], plain, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == L + M + 1


def test_crop_cache_keeps_a_prefix(target):
    ids = PROMPTS[2]
    with torch.no_grad():
        cache = sd.new_cache(target)
        target(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        sd.crop_cache(cache, 4)
        fresh = sd.new_cache(target)
        target(input_ids=torch.tensor([ids[:4]]), cache=fresh, use_cache=True)
    assert cache.get_seq_length() == 4
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


# ----------------------------------------------------------------------------- greedy is lossless


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_chain_is_lossless(target, refs, k):
    random_draft = untrained_draft(target)
    for ids, ref in zip(PROMPTS, refs):
        lookup = LookupDraft(ids + ref, target.config.vocab_size, wrong=range(len(ids) + 2, len(ids) + 40, 3))
        for draft in (random_draft, lookup):
            out, events = sd.collect(sd.speculative(target, draft, ids, 30, k=k))
            assert out == ref
            assert all(e.drafted <= k for e in events)
        assert 0 < sum(e.accepted for e in events) < sum(e.drafted for e in events)   # lookup: partial


@pytest.mark.parametrize("tree", [sd.TreeSpec(4, 2, 2), sd.TreeSpec(8, 2, 4), sd.TreeSpec(16, 4, 5),
                                  sd.TreeSpec(3, 3, 6)])
def test_greedy_tree_is_lossless(target, refs, tree):
    random_draft = untrained_draft(target)
    for ids, ref in zip(PROMPTS, refs):
        lookup = LookupDraft(ids + ref, target.config.vocab_size, wrong=range(len(ids) + 2, len(ids) + 40, 3))
        for draft in (random_draft, lookup):
            out, events = sd.collect(sd.speculative(target, draft, ids, 30, tree=tree))
            assert out == ref
            assert all(e.drafted <= tree.budget for e in events)


def test_tree_finds_the_second_choice_a_chain_misses(target, refs):
    """Every draft's first choice is wrong: the chain accepts nothing, a top-2 tree accepts a lot."""
    ids, ref = PROMPTS[0], refs[0]
    lookup = LookupDraft(ids + ref, target.config.vocab_size, wrong=range(len(ids) + 40))
    _, chain = sd.collect(sd.speculative(target, lookup, ids, 30, k=3))
    out, tree = sd.collect(sd.speculative(target, lookup, ids, 30, tree=sd.TreeSpec(12, 2, 3)))
    assert out == ref
    assert sum(e.accepted for e in chain) == 0
    assert sum(e.accepted for e in tree) >= 20


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_perfect_draft_is_always_accepted(target, refs, k):
    ids, ref = PROMPTS[1], refs[1]
    lookup = LookupDraft(ids + ref, target.config.vocab_size)
    out, events = sd.collect(sd.speculative(target, lookup, ids, 30, k=k))
    assert out == ref
    for e in events[1:]:
        assert e.accepted == e.drafted and all(e.accepted_mask) and len(e.tokens) == e.drafted + 1
    assert len(events) == 1 + math.ceil(29 / (k + 1))
    # the draft was fed in the documented alignment: step-1 row t reads x_{t+1} at position t
    seq = ids + ref
    assert all(x == seq[p + 1] for p, x in lookup.rows_seen)
    out, events = sd.collect(sd.speculative(target, lookup, ids, 30, tree=sd.TreeSpec(8, 1, 4)))
    assert out == ref and all(e.accepted == 4 for e in events[1:-1])


def test_draft_tree_nodes_see_only_their_ancestors(target):
    """Every tree node is a top-k child of its parent as the draft computes it along the parent's path
    alone (a plain chain run); a draft tree mask that let siblings or cousins in would break this."""
    draft = untrained_draft(target, seed=5)
    with torch.no_grad():
        draft.lm_head.weight.mul_(20)                        # clear rankings, no near-ties
    ids = PROMPTS[2]

    def fresh():
        cache, d, last = _prefill(target, draft, ids)
        return d

    spec = sd.TreeSpec(budget=100, top_k=2, depth=3)
    with torch.inference_mode():
        tokens, parents, depths = sd._grow_tree(fresh(), 3, spec)
        assert len(tokens) == 2 + 4 + 4
        for i, par in enumerate(parents):
            path, node = [], par
            while node >= 0:
                path.insert(0, tokens[node])
                node = parents[node]
            d = fresh()
            logits, hidden = d.feed()
            for j, tok in enumerate(path):                   # the chain along the parent's path
                lg, hd = d.step([tok], hidden[None], torch.tensor([d.rows - 1 + j + 1]))
                logits, hidden = lg[0], hd[0]
            top = draft.to_target_ids(logits.topk(2).indices).tolist()
            assert tokens[i] in top, (i, depths[i])


def _grow_tree_per_node(d, depth, spec):
    """The tree expansion written node by node (the engine's first version): the reference the vectorised
    _grow_tree must reproduce exactly."""
    logits, hidden = d.feed()
    L = d.rows
    logp = torch.log_softmax(logits, -1)
    top = logp.topk(min(spec.top_k, logp.shape[0]))
    tok, score = top.indices.tolist(), top.values.tolist()
    par, dep = [-1] * len(tok), [1] * len(tok)
    cache_row, parent_hidden = {}, {-1: hidden}
    frontier = list(range(len(tok)))
    for level in range(1, depth):
        C, F = d.cache.length, len(frontier)
        mask = torch.zeros(1, 1, F, C + F, dtype=torch.bool)
        mask[..., :L] = True
        for i, n in enumerate(frontier):
            mask[0, 0, i, C + i] = True
            a = par[n]
            while a >= 0:
                mask[0, 0, i, cache_row[a]] = True
                a = par[a]
        ids = d.head.to_target_ids(torch.tensor([tok[n] for n in frontier])).tolist()
        lg, out = d.step(ids, torch.stack([parent_hidden[par[n]] for n in frontier]),
                         torch.full((F,), L - 1 + level), mask)
        best = torch.log_softmax(lg, -1).topk(min(spec.top_k, lg.shape[-1]), -1)
        cand = []
        for i, n in enumerate(frontier):
            cache_row[n], parent_hidden[n] = C + i, out[i]
            for v, t in zip(best.values[i].tolist(), best.indices[i].tolist()):
                cand.append(len(tok))
                tok.append(t), par.append(n), dep.append(level + 1), score.append(score[n] + v)
        frontier = sorted(cand, key=lambda c: -score[c])[:spec.top_k]
    ranked = sorted(range(len(tok)), key=lambda n: (-score[n], dep[n], n))[:spec.budget]
    chosen = sorted(ranked, key=lambda n: (dep[n], n))
    index = {n: i for i, n in enumerate(chosen)}
    return (d.head.to_target_ids(torch.tensor([tok[n] for n in chosen])).tolist(),
            [index[par[n]] if par[n] >= 0 else -1 for n in chosen], [dep[n] for n in chosen])


@pytest.mark.parametrize("spec", [sd.TreeSpec(16, 4, 5), sd.TreeSpec(5, 3, 3), sd.TreeSpec(40, 3, 4),
                                  sd.TreeSpec(7, 1, 7), sd.TreeSpec(3, 8, 2)])
def test_vectorised_tree_equals_the_per_node_expansion(target, refs, spec):
    """Same nodes, parents and depths, and the draft cache ends the same, at several decoding states."""
    for seed, ids in ((2, PROMPTS[0]), (3, PROMPTS[2] + refs[2][:9])):
        draft = untrained_draft(target, seed=seed)
        with torch.no_grad():
            draft.lm_head.weight.mul_(10)
        with torch.inference_mode():
            (_, d1, _), (_, d2, _) = _prefill(target, draft, ids), _prefill(target, draft, ids)
            got = sd._grow_tree(d1, spec.depth, spec)
            want = _grow_tree_per_node(d2, spec.depth, spec)
        assert got == want
        assert len(got[0]) == min(spec.budget, spec.top_k + (spec.depth - 1) * spec.top_k ** 2)
        torch.testing.assert_close(d1.cache.k, d2.cache.k)


def test_accepted_rows_is_the_longest_matching_path():
    """Against a walk down the tree by the target's tokens, on random trees and random target tokens."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        M = int(torch.randint(1, 12, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(M)]
        tokens = [int(torch.randint(0, 3, (1,), generator=g)) for _ in range(M)]
        keep = [i for i in range(M) if all(tokens[j] != tokens[i] or parents[j] != parents[i] for j in range(i))]
        if len(keep) < M:                              # siblings carry distinct tokens
            continue
        depths = []
        for p in parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        parent_row = torch.tensor([0] + [p + 1 for p in parents])
        node_ids = torch.tensor([7] + tokens)
        target = torch.randint(0, 3, (M + 1,), generator=g)
        children = {}
        for i, (t, p) in enumerate(zip(tokens, parents)):
            children.setdefault(p, {})[t] = i
        path, node = [0], -1
        while int(target[node + 1]) in children.get(node, {}):
            node = children[node][int(target[node + 1])]
            path.append(node + 1)
        anc = sd.ancestors(parent_row, max(depths))
        assert sd.accepted_rows(node_ids, parent_row, anc, target) == path


# ----------------------------------------------------------------------------- caches are cut back


def _prefill(model, draft, ids):
    cache, d = sd.new_cache(model), sd._Draft(draft, model.device)
    with torch.inference_mode():
        logits, aux = sd._target_forward(model, ids, torch.arange(len(ids)), cache, draft.aux_layers)
    last = int(logits[-1].argmax())
    d.add_rows(ids[1:] + [last], aux)
    return cache, d, last


def _assert_cache_is_fresh(model, cache, tokens):
    """The cache holds exactly what a fresh forward over `tokens` would hold."""
    fresh = sd.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), cache=fresh, use_cache=True)
    assert cache.get_seq_length() == len(tokens)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)


def test_chain_cuts_both_caches_back_after_partial_acceptance(target, refs):
    ids, ref = PROMPTS[2], refs[2]
    n = len(ids)
    lookup = LookupDraft(ids + ref, target.config.vocab_size, wrong={n + 3})   # d_1, d_2 right, d_3 wrong
    cache, d, last = _prefill(target, lookup, ids)
    with torch.inference_mode():
        drafted, accepted, mask, new = sd._chain_step(target, d, cache, last, 5, lookup.aux_layers, 0.0, None)
    assert (drafted, accepted, mask) == (5, 2, (True, True, False, False, False))
    tokens = ids + [last] + new
    assert tokens == (ids + ref)[:len(tokens)]
    _assert_cache_is_fresh(target, cache, tokens[:-1])
    assert d.cache.length == d.rows == n and len(d.pending_ids) == 3          # step-1 rows only
    # the next step continues from the cut caches exactly as from fresh ones
    with torch.inference_mode():
        _, accepted, _, new2 = sd._chain_step(target, d, cache, tokens[-1], 4, lookup.aux_layers, 0.0, None)
    tokens += new2
    assert accepted == 4 and tokens == (ids + ref)[:len(tokens)]
    _assert_cache_is_fresh(target, cache, tokens[:-1])


def test_tree_keeps_only_the_accepted_path_in_the_cache(target, refs):
    """First choices wrong at depth 1 and 3: the accepted nodes are not the first rows of the tree, so
    the cache is right only if their entries are gathered next to the prefix before cropping."""
    ids, ref = PROMPTS[0], refs[0]
    n = len(ids)
    lookup = LookupDraft(ids + ref, target.config.vocab_size, wrong={n + 1, n + 3})
    cache, d, last = _prefill(target, lookup, ids)
    with torch.inference_mode():
        drafted, accepted, mask, new = sd._tree_step(target, d, cache, last, 4, sd.TreeSpec(10, 2, 4),
                                                     lookup.aux_layers, sd.attention_layout(target))
    assert drafted == 10 and accepted >= 3 and mask[:3] == (True, True, True)
    tokens = ids + [last] + new
    assert tokens == (ids + ref)[:len(tokens)]
    _assert_cache_is_fresh(target, cache, tokens[:-1])
    assert d.cache.length == d.rows == n


# ----------------------------------------------------------------------------- events


def test_event_counts_add_up(target, refs):
    ids, ref = PROMPTS[0], refs[0]
    lookup = LookupDraft(ids + ref, target.config.vocab_size, wrong={len(ids) + 4, len(ids) + 11})
    for decode in (lambda: sd.autoregressive(target, ids, 25),
                   lambda: sd.speculative(target, lookup, ids, 25, k=4),
                   lambda: sd.speculative(target, lookup, ids, 25, tree=sd.TreeSpec(8, 2, 4))):
        out, events = sd.collect(decode())
        assert len(out) == 25 == sum(len(e.tokens) for e in events)
        assert [e.step for e in events] == list(range(len(events)))
        for e in events:
            assert len(e.tokens) == e.accepted + 1 and e.tokens[-1] == e.bonus_token
            assert sum(e.accepted_mask) == e.accepted and e.elapsed_s > 0
            assert list(e.accepted_mask) == sorted(e.accepted_mask, reverse=True)   # a prefix is accepted


def test_generation_stops_after_eos(target, refs):
    ids, ref = PROMPTS[1], refs[1]
    eos = ref[9]
    stop = ref.index(eos) + 1
    lookup = LookupDraft(ids + ref, target.config.vocab_size)
    for decode in (sd.autoregressive(target, ids, 30, eos_token_id=eos),
                   sd.speculative(target, lookup, ids, 30, k=4, eos_token_id=[eos, 99999]),
                   sd.speculative(target, lookup, ids, 30, tree=sd.TreeSpec(6, 2, 3), eos_token_id=eos)):
        out, events = sd.collect(decode)
        assert out == ref[:stop] and sum(len(e.tokens) for e in events) == stop


def test_refusals(target, refs):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(DraftError, match="vocabulary"):
        list(sd.speculative(target, untrained_draft(other, layers=(1,), draft_vocab=50), PROMPTS[0], 5))
    with pytest.raises(DraftError, match="layers"):
        list(sd.speculative(other, untrained_draft(target), PROMPTS[0], 5))
    with pytest.raises(LayerScopeError, match="greedy only"):
        list(sd.speculative(target, untrained_draft(target), PROMPTS[0], 5, tree=sd.TreeSpec(), temperature=1.0))


# ----------------------------------------------------------------------------- sampling


def test_lookup_proposal_takes_the_latest_longest_match():
    """Closed-form cases: the 3-gram before the 2-gram, the latest occurrence, the cap, the tail itself skipped."""
    assert sd.lookup_proposal([5, 6, 7, 8, 9, 6, 7], 4) == [8, 9, 6, 7]          # 2-gram [6, 7] at 1
    assert sd.lookup_proposal([5, 6, 7, 8, 9, 6, 7], 2) == [8, 9]                # capped at n
    assert sd.lookup_proposal([1, 6, 7, 2, 5, 6, 7, 3, 5, 6, 7], 3) == [3, 5, 6]  # [5,6,7] at 4 beats the later [6,7]
    assert sd.lookup_proposal([6, 7, 1, 6, 7, 2, 6, 7], 1) == [2]                # the latest of two 2-gram matches
    assert sd.lookup_proposal([4, 4, 4], 3) == [4]                               # overlapping match, one token follows
    assert sd.lookup_proposal([1, 2, 3, 4], 3) == []                             # nothing recurs
    assert sd.lookup_proposal([1, 7, 2, 7], 3) == []                             # one recurring token is not enough
    assert sd.lookup_proposal([6, 7, 6, 7], 0) == []


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_decoding_with_prompt_lookup_is_lossless(target, refs, k):
    """Prompts that contain the target's own continuation: lookup proposes from them and is accepted,
    the draft proposes elsewhere, and the output is plain greedy's."""
    draft = untrained_draft(target)
    steps = {"lookup": 0, "draft": 0}
    accepted = 0
    for ids, ref in zip(PROMPTS, refs):
        prompt = ids + ref[:12] + ids                     # the continuation recurs once the prompt's end recurs
        expect, _ = sd.collect(sd.autoregressive(target, prompt, 30))
        out, events = sd.collect(sd.speculative(target, draft, prompt, 30, k=k, lookup=4))
        assert out == expect
        for e in events[1:]:
            steps[e.proposer] += 1
            assert e.drafted <= (4 if e.proposer == "lookup" else k)
            accepted += e.accepted if e.proposer == "lookup" else 0
    assert steps["lookup"] > 0 and steps["draft"] > 0 and accepted > 0, (steps, accepted)
    assert events[0].proposer == "none"
    with pytest.raises(LayerScopeError, match="lookup"):
        sd.collect(sd.speculative(target, draft, PROMPTS[0], 5, lookup=-1))


def test_lookup_span_grows_after_a_whole_accept_and_shrinks_after_a_rejection():
    """Closed form: +2 after a lookup accepted whole, up to the cap; -1 after a rejection, down to the start; a
    fixed span never moves; the labels are what --lookup takes; refusals name the option."""
    rule = sd.LookupSpan(2, 7)
    assert rule.adaptive and rule.label == "lookup 2..7"
    assert rule.next(2, 2, 2) == 4 and rule.next(4, 4, 4) == 6 and rule.next(6, 6, 6) == 7 and rule.next(7, 7, 7) == 7
    assert rule.next(7, 3, 3) == 7            # a proposal cut short (the match's end) and accepted whole also grows
    assert rule.next(7, 7, 6) == 6 and rule.next(3, 3, 0) == 2 and rule.next(2, 2, 1) == 2
    fixed = sd.LookupSpan.fixed(4)
    assert not fixed.adaptive and fixed.label == "lookup 4" and fixed.next(4, 4, 4) == 4 and fixed.next(4, 4, 0) == 4
    assert sd.lookup_span(0) is None and sd.lookup_span(3) == sd.LookupSpan(3, 3)
    for bad in (-1, sd.LookupSpan(4, 2), sd.LookupSpan(-2, 4)):
        with pytest.raises(LayerScopeError, match="--lookup"):
            sd.lookup_span(bad, "--lookup")


def test_greedy_decoding_with_adaptive_lookup_is_lossless(target, refs):
    """Prompts that hold the target's own continuation: lookups are accepted whole, so the span grows past its
    start (and never exceeds what the rule allows after the steps before), the output is plain greedy's, and it
    takes fewer target forwards than the fixed span it starts from."""
    draft = untrained_draft(target)
    rule = sd.LookupSpan(1, 9)
    grown = 0
    for ids, ref in zip(PROMPTS, refs):
        prompt = ids + ref[:12] + ids
        expect, _ = sd.collect(sd.autoregressive(target, prompt, 30))
        out, events = sd.collect(sd.speculative(target, draft, prompt, 30, k=2, lookup=rule))
        assert out == expect
        span = rule.start
        for e in events[1:]:
            if e.proposer == "lookup":
                assert 1 <= e.drafted <= span
                grown += e.drafted > rule.start
                span = rule.next(span, e.drafted, e.accepted)
        _, fixed = sd.collect(sd.speculative(target, draft, prompt, 30, k=2, lookup=rule.start))
        assert len(events) < len(fixed)
    assert grown >= 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0                          # nothing outside the support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_accept_reject_rule_reproduces_p():
    """The rule alone: draft tokens from q, target rows p. The first emitted token follows p[0], the
    second (when the first was accepted) p[1], though q is far from p and zero on two tokens."""
    g = torch.Generator().manual_seed(0)
    V, trials = 8, 4000
    logits = torch.randn(3, V, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q[:, :2] = 0
    q = q / q.sum(-1, keepdim=True)
    assert 0.5 * float((p[0] - q[0]).abs().sum()) > 0.3
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        accepted, bonus = sd._accept_sampled(logits, drafts, [q[0], q[1]], 1.0, g)
        out = drafts[:accepted] + [bonus]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert _chi2(first, p[0]) < 30.0                           # df = 7: P(chi2 > 30) < 1e-4
    assert _chi2(second, p[1]) < 30.0
    assert second.sum() > 0.2 * trials


@pytest.mark.parametrize("prompt,lookup,window", [([1, 2, 3], 0, None), ([t for x in range(12) for t in (1, x)] + [1], 3, None),
                                                  ([1, 2, 3, 4, 5, 6], 0, 3)])
def test_speculative_sampling_keeps_the_target_distribution(prompt, lookup, window):
    """End to end. Vocabulary 12, draft vocabulary 8 (4 tokens the draft never proposes). Tokens 2..4
    of each output pass through accept/reject or resampling; their marginals must match the target's,
    computed exactly by enumeration (chi-square), while drafts are both accepted and rejected often.
    With prompt lookup (a prompt holding the 2-gram [1, x] for every x, so the first step always looks up),
    its certain proposals (a one-hot q) go through the same rule and the marginals still match.
    With a window: the same Llama-shaped target as a Mistral whose every layer sees only the last 3 positions,
    so every sampled token reads a context longer than its window."""
    shape = dict(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = (MistralForCausalLM(MistralConfig(**shape, sliding_window=window)) if window
             else LlamaForCausalLM(LlamaConfig(**shape))).eval()
    draft = untrained_draft(model, layers=(0, 1), draft_vocab=8, seed=3)
    with torch.no_grad():
        draft.lm_head.weight.mul_(5)                         # a draft with opinions of its own
    T, trials = 0.8, 400
    samples, drafted, accepted, looked_up = [], 0, 0, 0
    for s in range(trials):
        out, events = sd.collect(sd.speculative(model, draft, prompt, 4, k=2, lookup=lookup, temperature=T, seed=s))
        samples.append(out)
        drafted += sum(e.drafted for e in events)
        accepted += sum(e.accepted for e in events)
        looked_up += sum(e.proposer == "lookup" for e in events)
    samples = torch.tensor(samples)
    assert (0.1 if lookup else 0.15) < accepted / drafted < 0.85     # lookup's second tokens are mostly wrong here
    assert (looked_up > trials // 4) if lookup else looked_up == 0
    marginals = _exact_marginals(model, prompt, 4, T)
    for pos in (1, 2, 3):
        chi2 = _chi2(torch.bincount(samples[:, pos], minlength=12).double(), marginals[pos])
        assert chi2 < 40.0, (pos, chi2)                      # df = 11: P(chi2 > 40) < 1e-4


def _exact_marginals(model, prompt: list[int], n: int, T: float) -> list[torch.Tensor]:
    """The target's exact marginal distribution [V] of each of its first n sampled tokens, by enumerating every
    sequence before the last."""
    V = model.config.vocab_size
    with torch.no_grad():
        seqs, joint, marginals = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64), []
        for i in range(n):
            p = torch.softmax(model(seqs).logits[:, -1].double() / T, -1)       # [S, V]
            j = joint[:, None] * p
            marginals.append(j.sum(0))
            if i < n - 1:
                seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
                joint = j.flatten()
    return marginals


def test_adaptive_lookup_sampling_keeps_the_target_distribution():
    """Adaptive lookup under speculative sampling: the span a step proposes depends on the samples before it, and
    each of the first 7 tokens still follows the target's exact marginal (vocabulary 6, enumerated). The prompt
    repeats the 0 3 0 3 the target likes, so lookups are accepted whole (the span then grows: steps proposing
    2 and 3 tokens) and rejected, often."""
    shape = dict(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    draft = untrained_draft(model, layers=(0, 1), draft_vocab=4, seed=3)
    with torch.no_grad():
        draft.lm_head.weight.mul_(5)
    prompt, T, trials, n = [2, 0, 3, 0, 3, 0, 3, 5, 0, 3, 0, 4, 0], 0.8, 500, 7
    samples, seen = [], {"whole": 0, "rejected": 0, "grown": 0}
    for s in range(trials):
        out, events = sd.collect(sd.speculative(model, draft, prompt, n, k=2, lookup=sd.LookupSpan(1, 3),
                                                temperature=T, seed=s))
        samples.append(out)
        for e in events:
            if e.proposer == "lookup":
                seen["whole" if e.accepted == e.drafted else "rejected"] += 1
                seen["grown"] += e.drafted > 1
    assert min(seen.values()) > trials // 5, seen
    samples = torch.tensor(samples)
    marginals = _exact_marginals(model, prompt, n, T)
    for pos in range(1, n):
        chi2 = _chi2(torch.bincount(samples[:, pos], minlength=6).double(), marginals[pos])
        assert chi2 < 30.0, (pos, chi2)                      # df = 5: P(chi2 > 30) < 2e-5


# ----------------------------------------------------------------------------- the real target


@pytest.mark.smollm2
def test_smollm2_chain_and_tree_are_lossless(smollm2):
    """SmolLM2-135M with a draft for the default layer set (untrained: lossless whatever it proposes)."""
    model = smollm2.model
    draft = untrained_draft(model, layers=(2, 15, 27), draft_vocab=2048).to(smollm2.device)
    eos = smollm2.tokenizer.eos_token_id
    for prompt in load_prompts("builtin", limit=2, seed=0).prompts:
        ids = chat_ids(smollm2.tokenizer, prompt)
        ref, _ = sd.collect(sd.autoregressive(model, ids, 16, eos_token_id=eos))
        for kw in ({"k": 4}, {"tree": sd.TreeSpec(8, 2, 4)}):
            out, events = sd.collect(sd.speculative(model, draft, ids, 16, eos_token_id=eos, **kw))
            assert out == ref, kw
            assert sum(len(e.tokens) for e in events) == len(out)


@pytest.fixture(scope="module")
def smollm2_trained(smollm2, session_store):
    """A real draft for [2, 15, 27], trained by `draft_for` on a small SmolLM2 capture of the 3 builtin prompts
    the test decodes (it learns those conversations by heart), with the prompts it was trained on."""
    prompts = load_prompts("builtin", limit=3, seed=0)
    result = capture(smollm2, prompts, session_store, max_new_tokens=32, batch_size=3)
    path = draft_for(open_capture(session_store, result.key), [2, 15, 27], smollm2, session_store, steps=60,
                     batch_size=3, seq_len=96, val_fraction=0.0, draft_vocab=2048, lr=3e-3)
    return load_draft(path, smollm2), prompts


@pytest.mark.smollm2
def test_smollm2_trained_draft_is_lossless_and_accepted(smollm2, smollm2_trained):
    """Train -> save -> load -> decode on the real target: output equals plain greedy, and on the conversations
    it was trained on the draft is mostly accepted (a layer-index or alignment slip between training and
    decoding would leave tau near 1)."""
    draft, prompts = smollm2_trained
    eos = smollm2.tokenizer.eos_token_id
    produced = {"chain": 0, "tree": 0}
    steps = {"chain": 0, "tree": 0}
    for prompt in prompts.prompts[:3]:
        ids = chat_ids(smollm2.tokenizer, prompt)
        ref, _ = sd.collect(sd.autoregressive(smollm2.model, ids, 32, eos_token_id=eos))
        for name, kw in (("chain", {"k": 4}), ("tree", {"tree": sd.TreeSpec(8, 2, 4)})):
            out, events = sd.collect(sd.speculative(smollm2.model, draft, ids, 32, eos_token_id=eos, **kw))
            assert out == ref, (prompt.id, name)
            assert sum(len(e.tokens) for e in events) == len(out)
            produced[name] += len(out)
            steps[name] += len(events)
    for name in produced:
        assert produced[name] / steps[name] > 2.0, (name, produced[name] / steps[name])

