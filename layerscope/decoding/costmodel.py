"""Hardware-aware decoding: what a step costs on this machine, what a draft gets accepted, which decoding pays.

    cost curve    seconds of one target forward over T = 1..T_max new tokens (mean over a few cache
                  lengths) and of one draft forward over T rows, measured on the loaded model's device,
                  dtype and thread count with the machine watched (layerscope.quietness); cached in the store
                  under (fingerprint, device, dtype, threads, draft shape, quiet): a quiet curve is read back;
                  a busy one too while the machine is still busy (it says so), and measured again once it is quiet
    profile       acceptance of a draft: chain[i-1] = P(draft tokens 1..i all accepted) and
                  rank[j-1][r] = P(the target's token at depth j is the draft's (r+1)-th choice | the
                  path above it matched), measured by a calibration run (Sequoia's acceptance vector)
    predict       tau, seconds per step, tokens/s and speedup over plain decoding of a chain of depth K
                  or an EAGLE-2 tree (budget, top_k, depth)
    choose        the chain depth or tree shape with the best predicted speedup
    lookup        a chain or a tree with prompt lookup first (fixed or adaptive span), replayed along the
                  calibration's texts; choose_lookup: the span with the best predicted speedup, or none when none
                  beats the draft alone

Step costs (specdec's decoders):
    plain           c(1)
    chain K         d(1) + (K-1) d(1) + c(K+1)               one feed, K-1 draft steps, one verification
    tree (B, k, D)  d(1) + (D-1) d(k) + c(B+1)               one feed, D-1 levels of k nodes, one verification
    lookup of n     c(n+1)                                   one verification; the draft is not run, its rows
                                                             wait for its next feed (d(rows) there)
with c the target curve and d the draft curve. tau (tokens per step): chain 1 + sum_{i<=K} chain[i-1];
tree 1 + the sum over the tree's nodes of the product of rank[j-1][r] along the node's path, the tree
being the one EAGLE-2 grows when each node's value is that product (the draft's own ranking decides which
children exist; the calibration says how often each rank is the target's token). Speedup over plain
decoding = tau * c(1) / step seconds; the break-even tau of a decoding is its step seconds / c(1).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from layerscope import blas, eta, layerset, quietness
from layerscope.decoding import specdec
from layerscope.decoding.specdec import LookupSpan, TreeSpec
from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab
from layerscope.draft.training.fit import TrainOptions
from layerscope.errors import LayerScopeError
from layerscope.quietness import MachineOptions, MachineState
from layerscope.store import make_key

MAX_TOKENS = 32                      # verification forwards measured over T = 1..MAX_TOKENS new tokens
DRAFT_ROWS = 8                       # draft forwards measured over 1..DRAFT_ROWS rows (tree levels: top_k rows)
CACHE_LENGTHS = (128, 512)           # prefix lengths the target curve is averaged over
MAX_TOKENS_LIMIT = 512               # the longest verification forward `profile --max-tokens` may measure
MAX_REPEATS = 50                     # timings per point `profile --repeats` may take
REPEATS = 2                          # timings per (T, cache length); the median is kept
CALIBRATION_DEPTH = 8                # draft depths a calibration measures
CALIBRATION_RANKS = 8                # draft ranks a calibration tells apart (deeper ranks count as misses)
AUTO_KS = tuple(range(1, 9))         # chain depths `auto` considers
AUTO_TREES = tuple(TreeSpec(b, k, d) for b in (2, 3, 4, 6, 8, 12, 16, 24, 31) for k in (1, 2, 3, 4, 6, 8)
                   for d in range(2, 9) if k <= b <= k + (d - 1) * k * k)   # shapes `auto` considers
AUTO_LOOKUPS = tuple(LookupSpan.fixed(n) for n in (1, 2, 3, 4, 6, 8, 10, 12, 16)) + tuple(
    LookupSpan(s, c) for s in (2, 4, 8) for c in (8, 16, 24) if c > s)   # prompt lookup spans `--lookup auto` considers
FORMAT = 3                           # of the cached curves (2: monotone fits; 3: the machine state, quiet in the key)


# ----------------------------------------------------------------------------- the cost curve


@dataclass(frozen=True)
class CostCurve:
    """Measured seconds: target[T-1] of a verification forward over T new tokens, draft[T-1] of a draft
    forward over T rows. Beyond the measured range both are extended linearly from their last two points."""

    device: str
    dtype: str
    threads: int
    target: tuple[float, ...]
    draft: tuple[float, ...]
    cache_lengths: tuple[int, ...] = CACHE_LENGTHS
    machine: MachineState | None = None          # the machine while it was measured (None: not watched)

    def target_s(self, T: int) -> float:
        return _at(self.target, T)

    def draft_s(self, T: int) -> float:
        return _at(self.draft, T)

    def to_json(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "threads": self.threads,
                "cost_curve": [{"tokens": i + 1, "seconds": s} for i, s in enumerate(self.target)],
                "draft_curve": [{"rows": i + 1, "seconds": s} for i, s in enumerate(self.draft)],
                "draft_step_seconds": self.draft[0], "cache_lengths": list(self.cache_lengths),
                "machine": self.machine.to_json() if self.machine is not None else None}

    @classmethod
    def from_json(cls, obj: dict) -> "CostCurve":
        target = [p["seconds"] for p in obj["cost_curve"]]
        draft = [p["seconds"] for p in obj["draft_curve"]]
        assert [p["tokens"] for p in obj["cost_curve"]] == list(range(1, len(target) + 1)), obj["cost_curve"]
        assert target and draft, "a cost curve needs at least one point of each kind"
        return cls(obj["device"], obj["dtype"], int(obj["threads"]), tuple(target), tuple(draft),
                   tuple(obj.get("cache_lengths", CACHE_LENGTHS)), quietness.state_of(obj.get("machine")))


def _at(points: Sequence[float], T: int) -> float:
    if T < 1:
        raise ValueError(f"a forward over {T} tokens")
    if T <= len(points):
        return float(points[T - 1])
    slope = points[-1] - points[-2] if len(points) > 1 else 0.0
    return float(points[-1] + max(slope, 0.0) * (T - len(points)))


def monotone(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): more tokens never cost less, so a dip
    in a measured curve is noise, and so is a lone spike; both are averaged with their neighbours."""
    blocks: list[list[float]] = []                   # [sum, count] of pooled runs
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def time_calls(run: Callable[[int], None], sizes: Sequence[int], repeats: int = REPEATS,
               clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = lambda: None,
               tick: Callable[[], None] | None = None) -> list[float]:
    """Median seconds of run(size) for each size; the sizes are interleaved so a load change hits all alike.
    `tick()` after each timed call (the cost curve's time left)."""
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            sync()
            t0 = clock()
            run(n)
            sync()
            times[i].append(clock() - t0)
            if tick is not None:
                tick()
    return [sorted(t)[len(t) // 2] if len(t) % 2 else sum(sorted(t)[len(t) // 2 - 1:len(t) // 2 + 1]) / 2
            for t in times]


def measure_target(model, *, max_tokens: int = MAX_TOKENS, cache_lengths: Sequence[int] = CACHE_LENGTHS,
                   repeats: int = REPEATS, aux_layers: Sequence[int] | None = None,
                   clock: Callable[[], float] = time.perf_counter, tick: Callable[[], None] | None = None) -> list[float]:
    """Seconds of a verification forward over T = 1..max_tokens new tokens after a prefix of each cache
    length, averaged over the cache lengths: [max_tokens]. The forward is specdec's, hidden states included."""
    device, V = model.device, model.config.vocab_size
    aux = list(aux_layers) if aux_layers is not None else [model.config.num_hidden_layers - 1]
    gen = torch.Generator().manual_seed(0)
    per_length = []
    with torch.inference_mode():
        for L in cache_lengths:
            L = min(L, _context(model) - max_tokens)
            cache = specdec.new_cache(model)
            prefix = torch.randint(0, V, (L,), generator=gen).tolist()
            specdec._target_forward(model, prefix, torch.arange(L, device=device), cache, last_only=True)
            specdec.record_states(cache)                     # recurrent layers: cut back as a verification's are
            new = torch.randint(0, V, (max_tokens,), generator=gen).tolist()

            def run(T):
                specdec._target_forward(model, new[:T], torch.arange(L, L + T, device=device), cache, aux)
                specdec.crop_cache(cache, L)

            run(max_tokens)                                  # warm-up: first calls pay one-time costs
            per_length.append(time_calls(run, range(1, max_tokens + 1), repeats, clock, lambda: quietness.sync(device),
                                         tick))
    return [sum(col) / len(col) for col in zip(*per_length)]


def measure_draft(model, draft, *, max_rows: int = DRAFT_ROWS, cache_length: int = 256,
                  repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter,
                  tick: Callable[[], None] | None = None) -> list[float]:
    """Seconds of one draft forward over T = 1..max_rows rows after `cache_length` step-1 rows: [max_rows]."""
    device, V = model.device, model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    L = min(cache_length, _context(model) - 2)
    width = len(draft.aux_layers) * model.config.hidden_size
    with torch.inference_mode():
        dr = specdec._Draft(draft, device)
        dr.add_rows(torch.randint(0, V, (L,), generator=gen).tolist(), torch.randn(L, width, generator=gen).to(device))
        dr.feed()
        ids = torch.randint(0, V, (max_rows,), generator=gen).to(device)
        h = draft.fuse(torch.randn(1, max_rows, width, generator=gen).to(device))[0]

        def run(T):
            dr.step(ids[:T], h[:T], torch.full((T,), L, device=device))
            dr.rewind()

        run(max_rows)
        return time_calls(run, range(1, max_rows + 1), repeats, clock, lambda: quietness.sync(device), tick)


def default_draft(loaded) -> DraftHead:
    """An untrained draft of the shape `train-draft` builds by default (the default rule's layers): it costs what
    a trained one costs."""
    cfg = loaded.model.config
    layers, _ = layerset.default_layers(cfg.num_hidden_layers)
    V = min(TrainOptions.draft_vocab, cfg.vocab_size)
    d2t, t2d = build_draft_vocab(torch.arange(cfg.vocab_size), V, cfg.vocab_size)       # the first V ids
    head = DraftHead(DraftConfig.from_target(cfg, layers, V), embed_weight=loaded.model.get_input_embeddings().weight,
                     d2t=d2t, t2d=t2d)
    return specdec.decoding_draft(head.to(loaded.device), loaded).eval()


def curve_key(loaded, draft=None, *, quiet: bool = True) -> str:
    """Store key of a cost curve: the target's weights, device, dtype and threads, the matrix library's code
    path (blas.path), the draft's shape, and whether the machine was quiet while it was measured
    (lookups ask for quiet=True only); and, where forwards are padded to aligned rows (specdec.row_alignment), the
    alignment and that rows attend alone (exact_attention): a curve measured before either priced other forwards;
    and a draft's dtype other than float32
    (specdec.decoding_draft: a float32 draft's curve priced other draft forwards)."""
    shape = None
    if draft is not None:
        c = draft.config
        shape = [c.hidden_size, c.draft_vocab_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads]
    dtype = str(draft.fc.weight.dtype) if draft is not None else "torch.float32"
    align = specdec.row_alignment(loaded.model)
    return make_key({"fingerprint": loaded.fingerprint, "device": str(loaded.device), "dtype": str(loaded.dtype),
                     "threads": torch.get_num_threads(), "blas": blas.path(), "draft": shape, "quiet": bool(quiet),
                     "format": FORMAT, **({"row_align": align, "attention": "rows alone"} if align else {}),
                     **({"draft_dtype": dtype} if dtype != "torch.float32" else {})})


def cost_curve(loaded, store=None, draft=None, *, fresh: bool = False, max_tokens: int = MAX_TOKENS,
               cache_lengths: Sequence[int] = CACHE_LENGTHS, repeats: int = REPEATS,
               machine_options: MachineOptions | None = None,
               progress: Callable[..., None] | None = None,
               measured: Callable[[float, bool], None] | None = None) -> CostCurve:
    """The cost curve of `loaded` (a LoadedModel) with `draft` (default: an untrained draft of the default
    shape), both curves as their monotone fits. Read from the store when a curve of the same (weights,
    device, dtype, threads, draft shape) was measured before: a quiet one always; a busy one while the machine
    is still busy (one short sample says; its `machine` says it was busy, and the report repeats it), for a
    curve measured again on a busy machine would be no better, and measuring it takes minutes on a small CPU.
    Else measured, with the machine watched before (quietness.settle: `machine_options.wait_s` waits for a quiet
    machine) and during (quietness.Monitor), and stored under its quiet flag: a busy curve never replaces a
    quiet one. `progress(message, eta_s)` hears what it is doing (the wait, the two measurements) and the
    seconds left of the measurement (layerscope.eta, over its timed forwards; None while estimating);
    `measured(seconds, quiet)` hears a measurement's seconds (not called when the curve is read back)."""
    draft = draft if draft is not None else default_draft(loaded)
    say = progress or (lambda message, eta_s=None: None)
    options = machine_options or MachineOptions()
    if store is not None and not fresh:
        for quiet in (True, False):
            cached = store.get_json("costcurve", curve_key(loaded, draft, quiet=quiet))
            if cached is None or len(cached["cost_curve"]) < max_tokens:
                continue
            if quiet or not options.wait_s and not quietness.sample(options.before_s, options).quiet:
                return CostCurve.from_json(cached)

    t0 = time.monotonic()
    total = len(cache_lengths) * repeats * max_tokens + repeats * DRAFT_ROWS     # timed forwards
    timer, done, what = [eta.PhaseClock(total)], [0], [""]

    def tick():
        done[0] += 1
        say(what[0], timer[0].left(done[0]))

    def measure():
        timer[0] = eta.PhaseClock(total)                     # the clock starts after the wait for a quiet machine
        what[0] = f"measuring the cost of a target forward over 1..{max_tokens} tokens"
        say(what[0], None)
        target = measure_target(loaded.model, max_tokens=max_tokens, cache_lengths=cache_lengths, repeats=repeats,
                                aux_layers=draft.aux_layers, tick=tick)
        what[0] = "measuring the cost of a draft step"
        say(what[0], timer[0].left(done[0]))
        return target, measure_draft(loaded.model, draft, repeats=repeats, tick=tick)

    (target, drafts), state = quietness.watch(measure, options, lambda s, left: say(quietness.wait_message(s, left), None))
    curve = CostCurve(str(loaded.device), loaded.dtype_name, torch.get_num_threads(),
                      tuple(monotone(target)), tuple(monotone(drafts)), tuple(cache_lengths), state)
    if store is not None:
        store.put_json("costcurve", curve_key(loaded, draft, quiet=state.quiet), curve.to_json())
    if measured is not None:
        measured(time.monotonic() - t0, state.quiet)
    return curve


def _context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048) or 2048)


# ----------------------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class AcceptanceProfile:
    """chain[i-1]: P(draft tokens 1..i of a chain all accepted); rank[j-1][r]: P(the target's token at
    depth j is the draft's (r+1)-th choice | the path above matched). rows: positions measured.
    sequences: per calibration prompt, the ranks of draft_ranks ([rows, depth] as lists), for `replay`:
    decoding visits only some of those states (after k accepted tokens it jumps k + 1 ahead), so the
    average over every state (chain, rank) overstates tau where easy tokens come in runs; a replay walks
    the states decoding visits. Empty for a profile built from averages alone (from_chain).
    texts: per calibration prompt (the same order), (its token ids, the target's greedy continuation), for
    `predict_lookup`, which replays prompt lookup along them; empty as `sequences` is."""

    chain: tuple[float, ...]
    rank: tuple[tuple[float, ...], ...]
    rows: int = 0
    sequences: tuple[tuple[tuple[int, ...], ...], ...] = field(default=(), repr=False)
    texts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = field(default=(), repr=False)

    def __post_init__(self):
        if len(self.rank) != len(self.chain) or any(not r for r in self.rank):
            raise ValueError("an acceptance profile needs one rank row per chain depth")

    def p(self, depth: int, r: int) -> float:
        """rank acceptance, 0 beyond what was measured."""
        if depth > len(self.rank) or r >= len(self.rank[depth - 1]):
            return 0.0
        return self.rank[depth - 1][r]

    def to_json(self) -> dict:
        return {"chain": list(self.chain), "rank": [list(r) for r in self.rank], "rows": self.rows}

    @classmethod
    def from_chain(cls, acceptance: Sequence[float]) -> "AcceptanceProfile":
        """From a chain's acceptance by position alone (e.g. a bench result): only first choices are known."""
        chain = tuple(float(a) for a in acceptance)
        cond = [chain[0]] + [chain[i] / chain[i - 1] if chain[i - 1] > 0 else 0.0 for i in range(1, len(chain))]
        return cls(chain, tuple((c,) for c in cond))


def draft_ranks(model, draft, ids: Sequence[int], start: int, depth: int = CALIBRATION_DEPTH) -> torch.Tensor:
    """Rank of the true token in the draft's prediction at each depth, teacher-forced along `ids`.

    ids: prompt + the target's own greedy continuation; start = the prompt's length. Row t (start-1 <= t)
    is the decoding state whose root is x_{t+1}; depth j predicts x_{t+j+1} from the true tokens above it,
    exactly as the decoder's draft does when the path matched (DraftHead.unroll, the training-time test).
    Returns int64 [rows, depth]: 0 = first choice; -1 where x_{t+j+1} is past the end; a token outside the
    draft vocabulary gets the draft vocabulary's size (never a choice).
    """
    n = len(ids)
    x = torch.tensor(ids, device=model.device)
    with torch.inference_mode():
        cache = specdec.new_cache(model)
        _, aux = specdec._target_forward(model, ids, torch.arange(n, device=model.device), cache, draft.aux_layers)
        g = draft.fuse(aux[None])                                            # [1, n, d]
        T = n - 1                                                            # rows 0..n-2 read x_{t+1}
        pad = torch.cat([x, x.new_zeros(depth)])
        inputs = [pad[j:j + T][None] for j in range(1, depth + 1)]          # step j reads x_{t+j}
        outs = draft.unroll(inputs, g[:, :T], torch.arange(T, device=model.device)[None])
        dmap = torch.cumsum(draft.t2d.long(), 0) - 1                         # target id -> draft id
        Vd = draft.config.draft_vocab_size
        ranks = []
        for j, (logits, _) in enumerate(outs, start=1):
            true = pad[j + 1:j + 1 + T]                                      # x_{t+j+1}
            lg = logits[0].float()
            inside = draft.t2d[true] & (dmap[true] < Vd)
            did = dmap[true].clamp(0, Vd - 1)
            r = (lg > lg.gather(1, did[:, None])).sum(1)
            r = torch.where(inside, r, torch.full_like(r, Vd))
            valid = torch.arange(T, device=model.device) + j + 1 < n
            ranks.append(torch.where(valid, r, torch.full_like(r, -1)))
    return torch.stack(ranks, 1)[start - 1:].cpu()


def profile_from_ranks(ranks: torch.Tensor, max_rank: int = CALIBRATION_RANKS) -> AcceptanceProfile:
    """ranks [rows, depth] from draft_ranks (several prompts stacked) -> AcceptanceProfile."""
    depth = ranks.shape[1]
    chain, rank = [], []
    for j in range(depth):
        seen = ranks[:, j] >= 0
        first = (ranks[:, :j + 1] == 0).all(1)
        chain.append(float(first[seen].float().mean()) if seen.any() else 0.0)
        above = seen & ((ranks[:, :j] >= 0) & (ranks[:, :j] < max_rank)).all(1)   # the path above is in a tree
        n = int(above.sum())
        rank.append(tuple(float(((ranks[above, j] == r).sum()) / n) if n else 0.0 for r in range(max_rank)))
    return AcceptanceProfile(tuple(chain), tuple(rank), int((ranks[:, 0] >= 0).sum()))


def calibrate(model, draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 48, eos_token_id=None,
              depth: int = CALIBRATION_DEPTH, progress: Callable[[int, int], None] | None = None) -> AcceptanceProfile:
    """Acceptance of `draft` on the target's own greedy continuations of `prompts` (token id lists);
    `progress(prompts done, prompts)` after each prompt."""
    if not prompts:
        raise LayerScopeError("a calibration needs at least one prompt", "Give one or more prompts")
    ranks, texts = [], []
    for i, ids in enumerate(prompts):
        out, _ = specdec.collect(specdec.autoregressive(model, ids, max_new_tokens, eos_token_id=eos_token_id))
        ranks.append(draft_ranks(model, draft, list(ids) + out, len(ids), depth))
        texts.append((tuple(int(t) for t in ids), tuple(out)))
        if progress is not None:
            progress(i + 1, len(prompts))
    profile = profile_from_ranks(torch.cat(ranks))
    return replace(profile, sequences=tuple(tuple(tuple(row) for row in r.tolist()) for r in ranks),
                   texts=tuple(texts))


# ----------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Prediction:
    decoding: str                    # "autoregressive", "chain k=K" or "tree budget=B top_k=k depth=D"
    k: int | None
    tree: TreeSpec | None
    tau: float                       # expected tokens per target forward
    step_seconds: float
    tokens_per_s: float
    speedup: float                   # over plain decoding on the same curve
    break_even_tau: float            # the tau at which this decoding matches plain decoding

    def to_json(self) -> dict:
        out = asdict(self)
        out["tree"] = asdict(self.tree) if self.tree else None
        return out


def tree_label(t: TreeSpec) -> str:
    return f"tree budget={t.budget} top_k={t.top_k} depth={t.depth}"


def tree_nodes(profile: AcceptanceProfile, spec: TreeSpec) -> list[tuple[tuple[int, ...], float]]:
    """The nodes of the tree EAGLE-2 grows (specdec._grow_tree) when a node's value is the product of rank
    acceptances along its path: level by level the top_k best nodes each get top_k children, the `budget`
    best nodes of the whole tree are verified. Each node: (its rank path (r1, ..., rj), its value)."""
    K = spec.top_k
    nodes = [((r,), profile.p(1, r)) for r in range(K)]          # every node so far
    front = list(nodes)
    for level in range(2, spec.depth + 1):
        cand = [(path + (r,), v * profile.p(level, r)) for path, v in front for r in range(K)]
        nodes += cand
        front = sorted(cand, key=lambda n: -n[1])[:K]
    return sorted(nodes, key=lambda n: -n[1])[:spec.budget]


def expected_tree_accepted(profile: AcceptanceProfile, spec: TreeSpec) -> float:
    """Expected accepted nodes of that tree, each accepted with probability its value."""
    return sum(v for _, v in tree_nodes(profile, spec))


def replay(sequences, accepted: Callable[[tuple[int, ...]], int]) -> float:
    """Tokens per verification step of a decoding replayed along calibration sequences: from the first state,
    a step at state t accepts a = accepted(ranks of t) draft tokens, emits a + 1 and moves to state t + a + 1
    (what lossless greedy decoding does along the target's own continuation); a state with nothing left to
    predict (rank -1 at depth 1) ends its sequence. Pooled over the sequences."""
    tokens = steps = 0
    for rows in sequences:
        t = 0
        while t < len(rows) and rows[t][0] >= 0:
            a = accepted(rows[t])
            tokens, steps, t = tokens + a + 1, steps + 1, t + a + 1
    return tokens / steps if steps else 1.0


def replayed_tau(profile: AcceptanceProfile, *, k: int | None = None, tree: TreeSpec | None = None) -> float:
    """Tau of a chain of depth k, or of `tree`, replayed along the profile's sequences. A chain accepts the
    first choices from depth 1 on, up to k; a tree accepts the deepest node of its rank paths that the
    target's path follows (rank -1: past the end, never accepted)."""
    rule = acceptance_rule(profile, k=k, tree=tree)
    return replay(profile.sequences, lambda row: rule(row, tree.depth if tree is not None else k))


def acceptance_rule(profile: AcceptanceProfile, *, k: int | None = None,
                    tree: TreeSpec | None = None) -> Callable[[Sequence[int], int], int]:
    """(ranks of a state, depth) -> draft tokens a step there accepts, at most `depth`: a chain of depth k accepts
    the first choices from depth 1 on; a tree the deepest of its nodes' rank paths (tree_nodes) that the target's
    path follows. A rank of -1 (past the calibration's end) is never accepted."""
    if tree is not None:
        paths = {path for path, _ in tree_nodes(profile, tree)}

        def accepted(row, depth):
            a = 0
            while a < min(depth, tree.depth, len(row)) and tuple(row[:a + 1]) in paths:
                a += 1
            return a
    else:
        def accepted(row, depth):
            a = 0
            while a < min(depth, k, len(row)) and row[a] == 0:
                a += 1
            return a
    return accepted


def step_seconds(curve: CostCurve, *, k: int | None = None, tree: TreeSpec | None = None, tau: float = 1.0) -> float:
    """Predicted seconds of one decoding step: plain (no k, no tree), a chain of depth k, or a tree.

    A step's first draft forward feeds the previous step's accepted tokens and its bonus token: `tau` rows on
    average (1 when nothing is accepted), priced between the measured whole-row costs around it."""
    feed = _feed_s(curve, tau)
    if tree is not None:
        return feed + (tree.depth - 1) * curve.draft_s(tree.top_k) + curve.target_s(tree.budget + 1)
    if k is not None:
        return feed + (k - 1) * curve.draft_s(1) + curve.target_s(k + 1)
    return curve.target_s(1)


def _feed_s(curve: CostCurve, rows: float) -> float:
    """Seconds of a draft forward over `rows` (>= 1, fractional: the mean of a step's feeds) rows."""
    lo = max(1, int(rows))
    return curve.draft_s(lo) + (rows - lo) * (curve.draft_s(lo + 1) - curve.draft_s(lo))


def predict(curve: CostCurve, profile: AcceptanceProfile | None, *, k: int | None = None,
            tree: TreeSpec | None = None) -> Prediction:
    """Predicted tau, step time, tokens/s and speedup of plain decoding (no k, no tree), a chain or a tree
    (`profile` None: nothing accepted, for the step time and break-even tau alone). Tau is replayed along the
    profile's calibration sequences when it has them (replayed_tau), else the average over states."""
    replayable = profile is not None and bool(profile.sequences)
    if tree is not None:                             # no profile: nothing is accepted
        tau = (replayed_tau(profile, tree=tree) if replayable else
               1.0 + (expected_tree_accepted(profile, tree) if profile else 0.0))
        label, k = tree_label(tree), None
    elif k is not None:                              # depths past the profile: never accepted
        tau = replayed_tau(profile, k=k) if replayable else 1.0 + (sum(profile.chain[:k]) if profile else 0.0)
        label = f"chain k={k}"
    else:
        tau, label = 1.0, "autoregressive"
    base, seconds = curve.target_s(1), step_seconds(curve, k=k, tree=tree, tau=tau)
    return Prediction(label, k, tree, tau, seconds, tau / seconds, tau * base / seconds,
                      break_even_tau(curve, k=k, tree=tree))


def break_even_tau(curve: CostCurve, *, k: int | None = None, tree: TreeSpec | None = None) -> float:
    """The tau at which a chain or tree matches plain decoding: tau = step_seconds(tau) / c(1). The step's
    cost grows with tau only by the feed's extra rows (a draft row costs far less than a target forward), so
    the fixed point is reached by iterating from tau = 1."""
    tau = 1.0
    for _ in range(50):
        tau, last = step_seconds(curve, k=k, tree=tree, tau=tau) / curve.target_s(1), tau
        if abs(tau - last) < 1e-12:
            break
    return tau


def draft_forwards(*, k: int | None = None, tree: TreeSpec | None = None) -> int:
    """Draft forwards in one step: a chain of depth k runs k (the feed and k - 1 steps), a tree its depth (the feed
    and one per level below the first); plain decoding none."""
    return tree.depth if tree is not None else (k or 0)


def verified_tokens(*, k: int | None = None, tree: TreeSpec | None = None) -> int:
    """Tokens one verification forward takes: the draft's tokens and the root (plain decoding: 1)."""
    return tree.budget + 1 if tree is not None else (k or 0) + 1


def with_draft_step(curve: CostCurve, seconds: float) -> CostCurve:
    """`curve` with every draft forward costing `seconds`, whatever its rows: the draft step a benchmark measured
    (run_draft_step) put in place of the one the curve timed alone. On it break_even_tau is closed-form:
    (draft_forwards * seconds + c(verified_tokens)) / c(1)."""
    return replace(curve, draft=(max(0.0, float(seconds)),))


def run_draft_step(curve: CostCurve, *, k: int | None = None, tree: TreeSpec | None = None, tau: float,
                   speedup: float) -> float:
    """Seconds of one draft forward that a benchmark's measurement implies on `curve`: a step of a run with `tau`
    tokens per step at `speedup` over plain decoding cost tau / speedup plain steps, i.e. tau * c(1) / speedup
    seconds; less the curve's verification c(verified_tokens), over the step's draft forwards (never below 0).
    Everything a step costs beyond the verification (the draft, and the decoder's own upkeep) counts as the draft's,
    so break_even_tau(with_draft_step(curve, this)) is tau / speedup: above tau exactly when the run lost."""
    n = draft_forwards(k=k, tree=tree)
    if n < 1 or speedup <= 0:
        raise ValueError("a run's draft step needs a chain or a tree and a positive speedup")
    step = tau * curve.target_s(1) / speedup
    return max(0.0, (step - curve.target_s(verified_tokens(k=k, tree=tree))) / n)


def choose(curve: CostCurve, profile: AcceptanceProfile, *, ks: Sequence[int] = (),
           trees: Sequence[TreeSpec] = ()) -> Prediction:
    """The contender with the best predicted speedup among chains of depth `ks` and `trees`
    (ties: the cheaper step)."""
    options = [predict(curve, profile, k=k) for k in ks] + [predict(curve, profile, tree=t) for t in trees]
    if not options:
        raise ValueError("nothing to choose from")
    return max(options, key=lambda p: (p.speedup, -p.step_seconds))


def best_chain(curve: CostCurve, profile: AcceptanceProfile, ks: Sequence[int] = AUTO_KS) -> Prediction:
    return choose(curve, profile, ks=[k for k in ks if k <= len(profile.chain)] or [1])


def best_tree(curve: CostCurve, profile: AcceptanceProfile, trees: Sequence[TreeSpec] = AUTO_TREES) -> Prediction:
    return choose(curve, profile, trees=[t for t in trees if t.depth <= len(profile.rank)] or [TreeSpec(2, 1, 2)])


def break_even_taus(curve: CostCurve, ks: Sequence[int] = AUTO_KS, trees: Sequence[TreeSpec] = (TreeSpec(),)) -> dict:
    """{decoding: the tau it needs to match plain decoding} on this curve."""
    return {p.decoding: p.break_even_tau for p in [predict(curve, None, k=k) for k in ks] +
            [predict(curve, None, tree=t) for t in trees]}


# ----------------------------------------------------------------------------- prompt lookup


@dataclass(frozen=True)
class LookupPrediction:
    """A chain of depth k, or a tree, with prompt lookup first (`lookup` None: the draft alone), replayed along a
    calibration."""

    k: int
    lookup: LookupSpan | None
    tau: float                       # tokens per target forward
    step_seconds: float              # mean seconds of a step
    speedup: float                   # over plain decoding on the same curve
    lookup_share: float              # the share of steps whose tokens prompt lookup proposed
    lookup_tau: float | None         # tokens per lookup step (accepted + bonus); None without lookup steps
    tree: TreeSpec | None = None     # the draft's steps grow this tree instead of the chain of depth k

    @property
    def label(self) -> str:
        """"lookup 4", "lookup 4..16" or "no lookup"."""
        return self.lookup.label if self.lookup else "no lookup"

    def to_json(self) -> dict:
        return {"k": self.k, "tree": asdict(self.tree) if self.tree else None,
                "lookup": self.lookup.to_json() if self.lookup else None, "label": self.label,
                "tau": self.tau, "step_seconds": self.step_seconds, "speedup": self.speedup,
                "lookup_share": self.lookup_share, "lookup_tau": self.lookup_tau}


def predict_lookup(curve: CostCurve, profile: AcceptanceProfile, k: int,
                   lookup: LookupSpan | None, tree: TreeSpec | None = None) -> LookupPrediction:
    """Replay decoding with a chain of depth k and prompt lookup first (specdec.speculative's `lookup`) along the
    profile's calibration texts, as the decoder walks them at temperature 0: at each state the context (prompt +
    continuation so far) is searched with specdec.lookup_proposal; a proposal is verified against the
    continuation (its tokens accepted while they match it) at c(n+1) for n proposed tokens, and the span adapts by
    LookupSpan.next; without one, the chain accepts the draft's first choices (the state's ranks) at the price of
    `step_seconds`, its feed over the rows that waited since the draft last ran. As in the decoder, no step
    proposes past the continuation's last token but one (the bonus). The prefill, and the prompt's rows fed at the
    first draft step, are left out as `predict` leaves them. With `tree`, the draft's steps grow it instead of the
    chain: they accept what acceptance_rule says of the tree, at the tree's step_seconds. Needs a profile from
    `calibrate` (texts)."""
    if not profile.texts or len(profile.texts) != len(profile.sequences):
        raise ValueError("predicting prompt lookup needs a calibration's texts")
    accepted = acceptance_rule(profile, k=k, tree=tree)
    tokens = steps = looked = looked_tokens = 0
    seconds = 0.0
    for (prompt, out), rows, proposals in zip(profile.texts, profile.sequences, _proposals(profile.texts)):
        span, waiting, t = lookup.start if lookup else 0, 1, 0
        while t < len(out) - 1:                                 # state t: out[:t+1] produced, out[t+1:] to come
            left = len(out) - t - 2                             # tokens a step may propose beyond its bonus
            found = proposals[t][:min(span, left)] if lookup else ()
            if found:
                a = 0
                while a < len(found) and found[a] == out[t + 1 + a]:
                    a += 1
                seconds += curve.target_s(len(found) + 1)
                span = lookup.next(span, len(found), a)
                looked, looked_tokens, waiting = looked + 1, looked_tokens + a + 1, waiting + a + 1
            else:
                depth = min(tree.depth if tree is not None else k, left)
                a = accepted(rows[t], depth)                        # deeper than calibrated: a miss
                if not depth:
                    seconds += curve.target_s(1)
                else:
                    seconds += step_seconds(curve, k=None if tree is not None else depth,
                                            tree=replace(tree, depth=depth) if tree is not None else None, tau=waiting)
                waiting = a + 1 if depth else waiting + 1
            tokens, steps, t = tokens + a + 1, steps + 1, t + a + 1
    if not steps:
        raise ValueError("the calibration's continuations are too short to replay")
    tau, step = tokens / steps, seconds / steps
    return LookupPrediction(k, lookup, tau, step, tau * curve.target_s(1) / step, looked / steps,
                            looked_tokens / looked if looked else None, tree)


def lookup_run_speedup(curve: CostCurve, k: int, *, lookup_sizes: dict[int, int], lookup_tokens: int,
                       draft_steps: int, draft_tokens: int, tree: TreeSpec | None = None) -> float | None:
    """The speedup `curve` predicts for a measured run of a chain of depth k with prompt lookup first, from what
    the run did rather than a calibration (so a benchmark checks the model of cost on it, as `predicted_speedup`
    does for a chain): each lookup step verified n proposed tokens at c(n+1) (`lookup_sizes`: {n: steps}); each
    of the `draft_steps` draft steps cost `step_seconds` at depth k, its first draft forward fed the rows produced
    since the draft last ran (every token the run produced, spread over the draft steps). `lookup_tokens` and
    `draft_tokens`: tokens the lookup and the draft steps produced (accepted + bonus). Plain decoding would make
    them all at c(1) each. With `tree`, the draft steps grew it instead of the chain. None when the run made no
    step."""
    steps = sum(lookup_sizes.values()) + draft_steps
    tokens = lookup_tokens + draft_tokens
    if not steps or not tokens:
        return None
    seconds = sum(count * curve.target_s(int(n) + 1) for n, count in lookup_sizes.items())
    if draft_steps:
        seconds += draft_steps * step_seconds(curve, k=None if tree is not None else k, tree=tree,
                                              tau=max(1.0, tokens / draft_steps))
    return tokens * curve.target_s(1) / seconds


@functools.lru_cache(maxsize=4)
def _proposals(texts) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per calibration text, per state t (out[:t+1] produced): everything specdec.lookup_proposal offers there.
    A shorter proposal is a prefix of it (where the match is does not depend on the length asked), so each
    state is searched once for every span `choose_lookup` tries."""
    return tuple(tuple(tuple(specdec.lookup_proposal(list(prompt) + list(out[:t + 1]), len(out)))
                       for t in range(len(out))) for prompt, out in texts)


@dataclass(frozen=True)
class LookupChoice:
    """`--lookup auto` for a chain of depth k: `chosen` (None: no lookup), the `best` lookup considered, and the
    chain `alone`."""

    chosen: LookupSpan | None
    best: LookupPrediction
    alone: LookupPrediction

    def to_json(self) -> dict:
        return {"k": self.alone.k, "tree": asdict(self.alone.tree) if self.alone.tree else None,
                "chosen": self.chosen.to_json() if self.chosen else None,
                "best": self.best.to_json(), "alone": self.alone.to_json()}


def choose_lookup(curve: CostCurve, profile: AcceptanceProfile, k: int,
                  lookups: Sequence[LookupSpan] = AUTO_LOOKUPS, tree: TreeSpec | None = None) -> LookupChoice:
    """The lookup span (fixed or adaptive) with the best predicted speedup for a chain of depth k, or for `tree`
    (ties: the first of `lookups`), chosen only when it beats the draft alone; else none."""
    if not lookups:
        raise ValueError("nothing to choose from")
    alone = predict_lookup(curve, profile, k, None, tree)
    options = [predict_lookup(curve, profile, k, span, tree) for span in lookups]
    best = max(options, key=lambda p: p.speedup)
    return LookupChoice(best.lookup if best.speedup > alone.speedup else None, best, alone)
