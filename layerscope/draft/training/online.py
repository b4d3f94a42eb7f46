"""Online draft training: the target runs inside the loop and k layer sets train from one target pass.

Data: conversations as token ids, prompt (chat template + generation prompt) then a response
(draft/training/responses.py):
  responses="regenerate"  the target's own greedy response (EAGLE-3's choice), generated once and kept in
                          the store as token ids only (responses/<key>/), reused by every later run and set;
  responses="own"         the conversation's own first assistant turn (ShareGPT records): a forward pass only.
A seeded choice of `val_conversations` conversations is held out; the rest are the training stream.
`kinds` weights ShareGPT's records by kind of conversation in the draw (prompts/kinds.py: "code=2,chat=0");
the held-out conversations are then a seeded choice among the weighted draw's, like the training ones. Every
run reports its training conversations by kind (kind_mix) and each draft's held-out agreement by kind
(val_by_kind, evaluated once more at the end).

Per step, `batch_size` conversations (a seeded order, bucketed by length) go through ONE target forward
with output_hidden_states, and every layer set s gets the same rows:
    aux_s = cat(hidden_states[l] for l in s)      [n, k*d]  float16 (or bfloat16), exactly as a capture stores it
    final = hidden_states[N]                      [n, d]    post-norm: teacher = softmax(lm_head(final)) on V
then its own draft takes one AdamW step on train.ttt_loss. Each training conversation's features are kept in the run's
folder after its first forward, and later epochs read them instead of running the target again (feature_cache.py;
nothing is kept with `feature_cache=False`, a budget within the first epoch, or a disk without room); the folder goes
when the run ends.
The held-out conversations are forwarded once; their features stay in memory and every draft is
evaluated on them `eval_points` times over the budget (train.evaluate: every position counts), which
gives the learning curve [[tokens seen, [agreement per TTT step]], ...] per set.

Budgets: steps, tokens (rows through the draft, as in train.py) or seconds of training; the learning
rate follows warm-up + cosine over the fraction of the budget used. Checkpoints (weights, optimizer
moments, step, data cursor, curve, elapsed seconds, RNG) are written every `checkpoint_every_s` to
runs/<key>/ckpt-<step>/ through a temporary folder and one rename (draft/training/checkpoints.py); the same
command resumes from the newest complete checkpoint and, for a steps or tokens budget, ends with the same
drafts as an uninterrupted run. When the run is finished, runs/<key>/result.json names one stored draft per set.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from layerscope import distributed, jsonsafe, layerset
from layerscope.capture.format import state_dtype
from layerscope.draft import init_from
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.model import build_draft_vocab
from layerscope.draft.training import feature_cache
from layerscope.draft.training.checkpoints import FORMAT, complete_checkpoints, load_checkpoint, save_checkpoint
from layerscope.draft.training.data import make_batch, split_of, target_argmax, trainable, windows_of
from layerscope.draft.training.feature_cache import FeatureCache
from layerscope.draft.training.fit import (
    EpochSource,
    FitState,
    TrainOptions,
    build_drafters,
    draft_meta,
    final_norm,
    fit,
)
from layerscope.draft.training.loss import evaluate, simulated_acc_len
from layerscope.draft.training.progress import DoneProgress, FeaturesProgress, OnlineProgress
from layerscope.draft.training.responses import Conversations, load_conversations
from layerscope.errors import DraftError, LayerScopeError
from layerscope.prompts.kinds import KINDS, canonical, parse_weights
from layerscope.store import Store, atomic_write_json, make_key
from layerscope.target.load import LoadedModel
from layerscope.validate import check_number

MODES = ("regenerate", "own")


@dataclass
class OnlineOptions(TrainOptions):
    """TrainOptions (recipe and budget: steps, tokens or time) plus the online data and run.
    batch_size counts conversations per step; seq_len caps the rows of one draft window (a longer
    conversation is split as in train.py)."""
    prompts: str = "sharegpt"           # builtin | sharegpt | a prompt file
    limit: int | None = None            # conversations drawn from the set (None: all of it)
    kinds: str | None = None            # ShareGPT: weights by kind in the draw, e.g. "code=2,math=2,chat=0"
                                        # (prompts/kinds.py); None, or every weight equal: a plain draw
    responses: str = "regenerate"       # regenerate | own
    max_new_tokens: int = 128           # response cap for regenerate
    max_prompt_tokens: int = 256        # longer prompts are left out
    gen_batch_size: int = 32            # prompts per generate() call when regenerating
    val_conversations: int = 32         # held out, evaluated for the learning curve
    data_seed: int | None = None        # draws the conversations and the held-out split; None: seed (which
                                        # then also draws them); the draft's init and batch order follow seed
    checkpoint_every_s: float = 300.0   # seconds of training between checkpoints
    feature_cache: bool = True          # keep each training conversation's target features after its first forward,
                                        # so later epochs read them (feature_cache.py); off: every epoch runs the target

    def validate(self) -> None:
        """TrainOptions.validate, then the online fields (numbers: validate.check_number)."""
        super().validate()
        if self.responses not in MODES:
            raise DraftError(f"responses must be one of {', '.join(MODES)} (got {self.responses!r})",
                             "Pass --responses regenerate (the target's own answers) or --responses own")
        for name in ("max_new_tokens", "max_prompt_tokens", "gen_batch_size", "val_conversations"):
            check_number(name, getattr(self, name), minimum=1, integer=True, error=DraftError,
                         fix=f"Pass --{name.replace('_', '-')} 1 or more")
        check_number("data_seed", self.data_seed, integer=True, optional=True, error=DraftError, fix="Use e.g. 0")
        check_number("checkpoint_every_s", self.checkpoint_every_s, minimum=0, above=True, error=DraftError,
                     fix="Use e.g. 300")
        if self.kinds is not None:
            if str(self.prompts).strip() != "sharegpt":
                raise DraftError(f"--kinds weights ShareGPT's conversations; --prompts {self.prompts} is another set",
                                 "Use --prompts sharegpt, or leave --kinds out")
            parse_weights(self.kinds, error=DraftError)

    @property
    def kind_weights(self) -> dict[str, float] | None:
        """{kind: weight} of `kinds`; None without it or when every weight is the same (the plain draw)."""
        if self.kinds is None:
            return None
        weights = parse_weights(self.kinds, error=DraftError)
        return None if len(set(weights.values())) == 1 else weights

    def run_fields(self) -> dict:
        """What decides the drafts: every field but where and how often progress is saved."""
        d = self.key_fields()
        d.pop("checkpoint_every_s")
        d.pop("feature_cache")          # where the features come from in later epochs: rounding, not data
        if d["data_seed"] is None or d["data_seed"] == d["seed"]:
            d.pop("data_seed")          # the same run as before data_seed existed: its stored key stays
        weights = self.kind_weights
        d.pop("kinds")                  # the same run as before kinds existed, unless the draw is weighted
        if weights is not None:
            d["kinds"] = canonical(weights)
        return d

    @property
    def sample_seed(self) -> int:
        """The seed that draws the conversations and the held-out split."""
        return self.seed if self.data_seed is None else self.data_seed


@dataclass
class DraftResult:
    layers: list[int]
    path: str
    tokens_seen: int
    val_accuracy: list[float]
    val_coverage: float
    curve: list                          # [[tokens seen, [agreement per TTT step]], ...]
    tokens_seen_total: int | None = None  # a continued draft (--init-from): its tokens before + tokens_seen
    simulated_acc_len: float | None = None  # of val_accuracy (loss.simulated_acc_len; set here, whatever is passed)
    val_by_kind: dict | None = None      # {kind: {"conversations", "positions", "val_accuracy"}}: val_by_kind()
    val_by_kind_start: dict | None = None  # a continued draft: its starting draft's, on the same held-out split

    def __post_init__(self):
        self.simulated_acc_len = round(simulated_acc_len(self.val_accuracy), 5) if self.val_accuracy else None


@dataclass
class OnlineResult:
    drafts: list[DraftResult]
    seconds: float                       # training seconds over all runs of this key
    tokens_per_s: float
    resumed: bool
    cached: bool
    run_key: str
    conversations: int                   # training conversations
    data_tokens: int                     # tokens in the training conversations
    kind_mix: dict = field(default_factory=dict)   # training conversations per kind, every kind of KINDS
    kinds: str | None = None             # the draw's weights by kind (kinds.canonical), None: a plain draw
    features: dict | None = None         # this process's feature cache: {"read", "written", "off"} (off: why not, or
                                         # None), None when the run came from the store

    def to_json(self) -> dict:
        return {"drafts": [asdict(d) for d in self.drafts], "seconds": round(self.seconds, 1),
                "tokens_per_s": round(self.tokens_per_s, 1), "resumed": self.resumed, "cached": self.cached,
                "run_key": self.run_key, "conversations": self.conversations, "data_tokens": self.data_tokens,
                "kind_mix": self.kind_mix, "kinds": self.kinds, "features": self.features}


# ----------------------------------------------------------------------------- data

def held_out(n: int, count: int, seed: int) -> torch.Tensor:
    """Bool [n]: a seeded choice of min(count, n // 5) conversations held out (at least one when n >= 2)."""
    k = min(count, max(1, n // 5)) if n >= 2 else 0
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919))[:k]] = True
    return mask


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of batches of conversation indices: a seeded shuffle, sorted by length inside groups of
    16 batches (less padding), the batches then shuffled again. Depends on (lengths, seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    group = batch_size * 16
    batches = []
    for i in range(0, len(order), group):
        chunk = sorted(order[i: i + group], key=lambda c: lengths[c])
        batches += [chunk[j: j + batch_size] for j in range(0, len(chunk), batch_size)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[p] for p in perm]


# ----------------------------------------------------------------------------- the target's side

@torch.no_grad()
def target_features(target: LoadedModel, convs: Conversations, index: list[int], layers: list[int]):
    """One right-padded target forward over conversations `index`.

    Returns rows {token_id, position, conversation, is_response} [n] and feats {l: [n, d] float16 (bfloat16 where
    float16 would overflow: capture.format.state_dtype)} for each l in
    `layers` and for N (post-norm), n = the conversations' total length, rows of a conversation contiguous."""
    seqs = [convs.prompt[i] + convs.response[i] for i in index]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), target.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = True
    out = target.model.model(input_ids=ids.to(target.device), attention_mask=mask.long().to(target.device),
                             output_hidden_states=True, use_cache=False)
    valid = mask.to(target.device)
    N = target.num_layers
    states = {l: out.hidden_states[l][valid] for l in sorted(set(layers) | {N})}
    dtype = state_dtype(states.values())                     # as a capture stores them: float16 unless it overflows
    feats = {l: h.to(dtype).cpu() for l, h in states.items()}
    return conversation_rows(convs, index), feats


def conversation_rows(convs: Conversations, index: list[int]) -> dict:
    """Rows {token_id, position, conversation, is_response} [n] of conversations `index`, each one's rows contiguous."""
    seqs = [convs.prompt[i] + convs.response[i] for i in index]
    return {"token_id": torch.tensor([t for s in seqs for t in s], dtype=torch.long),
            "position": torch.cat([torch.arange(len(s)) for s in seqs]),
            "conversation": torch.cat([torch.full((len(s),), i) for i, s in zip(index, seqs)]),
            "is_response": torch.cat([torch.arange(len(s)) >= len(convs.prompt[i]) for i, s in zip(index, seqs)])}


def cached_features(target: LoadedModel, convs: Conversations, index: list[int], layers: list[int],
                    cache: FeatureCache):
    """target_features(target, convs, index, layers), reading what `cache` keeps and running the target only over
    the other conversations (then kept). One dtype for the batch: bfloat16 when any conversation's came in it."""
    N, hidden = target.num_layers, target.model.config.hidden_size
    got = {i: cache.get(i, len(convs.prompt[i]) + len(convs.response[i]), hidden) for i in index}
    missing = [i for i in index if got[i] is None]
    if len(missing) == len(index):                          # the first epoch: the batch exactly as without the cache
        rows, feats = target_features(target, convs, index, layers)
        _keep(cache, convs, index, feats)
        return rows, feats
    if missing:
        _, fresh = target_features(target, convs, missing, layers)
        got.update(_keep(cache, convs, missing, fresh))
    dtype = torch.bfloat16 if any(got[i][N].dtype == torch.bfloat16 for i in index) else torch.float16
    feats = {l: torch.cat([got[i][l].to(dtype) for i in index]) for l in cache.layers}
    return conversation_rows(convs, index), feats


def _keep(cache: FeatureCache, convs: Conversations, index: list[int], feats: dict) -> dict:
    """Each conversation's rows of a batch's features {l: [n, d]}, kept in `cache`: {i: {l: [n_i, d]}}."""
    out, start = {}, 0
    for i in index:
        end = start + len(convs.prompt[i]) + len(convs.response[i])
        out[i] = {l: f[start:end] for l, f in feats.items()}
        cache.put(i, out[i])
        start = end
    return out


def split_for(rows, feats, layers: list[int], N: int):
    return split_of(rows["token_id"], rows["position"], rows["conversation"], rows["is_response"],
                    torch.cat([feats[l] for l in layers], dim=1), feats[N])


# ----------------------------------------------------------------------------- the run

def run_key(target: LoadedModel, convs: Conversations, sets: list[list[int]], o: OnlineOptions) -> str:
    return make_key({"target": target.fingerprint, "data": convs.key, "sets": sets, "options": o.run_fields(),
                     "format": FORMAT, **init_from.key_part(o.init_from)})


def train_online(target: LoadedModel, layer_sets, store: Store, *,
                 progress: Callable[[OnlineProgress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, strategy: list[str] | None = None,
                 options: OnlineOptions | None = None, **fields) -> OnlineResult:
    """Train one draft per layer set from one target pass per step; resumable; finished runs come from the store.

    progress gets, in this order, ResponsesProgress (regenerated answers not yet stored), FeaturesProgress
    (the held-out conversations), a TrainProgress per step and an EvalProgress per evaluation, DoneProgress
    (draft/training/progress.py)."""
    o = options if options is not None else OnlineOptions(**fields)
    o.validate()
    sets = layerset.check_sets(layer_sets, target.num_layers, "Layer set", DraftError)
    say = progress or (lambda p: None)
    convs = load_conversations(target, o, store, progress=say, should_stop=should_stop)
    key = run_key(target, convs, sets, o)
    run_dir = store.path("runs", key)
    result_file = run_dir / "result.json"
    start = init_from.starting_point(o.init_from, sets, target, o.draft_vocab, o.fc_norm, o.draft_intermediate)
    val_mask = continued_held_out(start, convs, target, store) if start else None
    held_from = "init_from" if val_mask is not None else "own"
    if val_mask is None:
        val_mask = held_out(len(convs), o.val_conversations, o.sample_seed)
    train_idx = [i for i in range(len(convs)) if not val_mask[i]]
    val_idx = [i for i in range(len(convs)) if val_mask[i]]
    data_tokens = sum(len(convs.prompt[i]) + len(convs.response[i]) for i in train_idx)
    mix = kind_mix(convs, train_idx)
    if result_file.is_file():
        cached = cached_result(result_file, key, len(train_idx), data_tokens, mix, o)
        if cached is not None:
            return cached
    if len(train_idx) < 1:
        raise DraftError(f"Only {len(convs)} conversation(s): nothing is left to train on after the held-out ones",
                         "Use more prompts (--limit)")
    with (store.lock("runs", key, should_stop=should_stop) if distributed.rank() == 0 else contextlib.nullcontext()):
        if result_file.is_file() and distributed.rank() == 0:
            cached = cached_result(result_file, key, len(train_idx), data_tokens, mix, o)
            if cached is not None:
                return cached
        run_dir.mkdir(parents=True, exist_ok=True)
        with interrupt_flag() as interrupted:
            stop = (lambda: interrupted() or bool(should_stop and should_stop()))
            return _train(target, convs, sets, o, store, key, run_dir, train_idx, val_idx, data_tokens, say,
                          stop, strategy, start, held_from)


@contextlib.contextmanager
def interrupt_flag():
    """In the main thread, Ctrl-C (SIGINT) only raises a flag, read between steps: the run then saves a
    checkpoint and stops cleanly instead of dying mid-step. A second Ctrl-C interrupts at once. The CLI sends
    SIGTERM here too (cli.interrupts)."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit.is_set
        return

    def handler(signum, frame):
        if hit.is_set():
            raise KeyboardInterrupt
        hit.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def cached_result(result_file: Path, key: str, conversations: int, data_tokens: int, mix: dict,
                  o: OnlineOptions) -> OnlineResult | None:
    r = jsonsafe.loads(result_file.read_bytes(), what=f"Run result {result_file}", error=DraftError,
                       fix=f"Remove {result_file} and run the same command again")
    drafts = [DraftResult(**d) for d in r["drafts"]]
    if not all((Path(d.path) / "layerscope.json").is_file() for d in drafts):
        return None                      # a draft was evicted or removed: train again
    return OnlineResult(drafts, r["seconds"], r["tokens_per_s"], False, True, key, conversations, data_tokens, mix,
                        weights_name(o))


def kind_mix(convs: Conversations, index: list[int]) -> dict[str, int]:
    """{kind: conversations of `index` of that kind} for every kind of KINDS, in that order."""
    return {k: sum(convs.kinds[i] == k for i in index) for k in KINDS}


def weights_name(o: OnlineOptions) -> str | None:
    """The run's weights by kind in their one spelling (kinds.canonical), None for a plain draw."""
    weights = o.kind_weights
    return None if weights is None else canonical(weights)


def val_by_kind(d, split, kinds: list[str], o: OnlineOptions, device) -> dict:
    """Held-out agreement by kind: {kind: {"conversations", "positions", "val_accuracy"}} for each kind of KINDS
    among the held-out conversations (kinds[j]: the kind of the split's conversation j), by loss.evaluate over
    the windows of that kind's conversations, as the run's own evaluation reads them. Each window lies in one
    conversation, so the conversations add up to the split's and the positions to the run's val_positions."""
    J = o.ttt_steps
    windows = windows_of(split, o.seq_len, split.counted, J)
    of = [kinds[bisect_right(split.starts, start) - 1] for start, _ in windows]
    out = {}
    for k in KINDS:
        if k in kinds:
            mine = [w for w, kind in zip(windows, of) if kind == k]
            acc, _, n, _ = evaluate(d.head, split, mine, J, d.teacher, o.batch_size, device)
            out[k] = {"conversations": kinds.count(k), "positions": n, "val_accuracy": [round(a, 5) for a in acc]}
    return out


def held_out_splits(target, convs, val_idx, sets, union, o: OnlineOptions, say) -> list:
    N = target.num_layers
    say(FeaturesProgress(0, len(val_idx)))
    parts = []
    for i in range(0, len(val_idx), o.batch_size):
        parts.append(target_features(target, convs, val_idx[i: i + o.batch_size], union))
        say(FeaturesProgress(min(i + o.batch_size, len(val_idx)), len(val_idx)))
    rows = {k: torch.cat([r[k] for r, _ in parts]) for k in parts[0][0]}
    feats = {l: torch.cat([f[l] for _, f in parts]) for l in parts[0][1]}
    argmax = target_argmax(feats[N], target.model.get_output_embeddings().weight)
    splits = [split_for(rows, feats, s, N) for s in sets]
    for sp in splits:
        sp.target_next = argmax
    return splits


class OnlineSource(EpochSource):
    """Batches of training conversations run through the target, one forward per step (fit.Source): every
    set's batch holds the same rows, read from its own layers; under torchrun each rank forwards its share."""

    def __init__(self, target, convs: Conversations, train_idx: list[int], sets, o: OnlineOptions, t2d,
                 cache: FeatureCache | None = None):
        super().__init__()
        self.target, self.convs, self.train_idx, self.sets, self.o, self.t2d = target, convs, train_idx, sets, o, t2d
        self.cache = cache
        self.union = sorted({l for s in sets for l in s})
        self.lengths = [len(convs.prompt[i]) + len(convs.response[i]) for i in train_idx]

    def epoch(self, e: int) -> list:
        return epoch_batches(self.lengths, self.o.batch_size, self.o.seed, e)

    def batches(self, conversations):
        index = distributed.shard([self.train_idx[c] for c in conversations], distributed.rank(), distributed.world())
        if not index:
            return [None] * len(self.sets), 0
        rows, feats = (target_features(self.target, self.convs, index, self.union) if self.cache is None
                       else cached_features(self.target, self.convs, index, self.union, self.cache))
        N, J, out, n_rows = self.target.num_layers, self.o.ttt_steps, [], 0
        for s in self.sets:
            sp = split_for(rows, feats, s, N)
            ok = trainable(sp, self.t2d)
            wins = windows_of(sp, self.o.seq_len, ok, J)
            out.append(make_batch(sp, wins, J, ok, self.target.device) if wins else None)
            n_rows = max(n_rows, sum(w for _, w in wins))
        return out, n_rows


def continued_held_out(start: init_from.StartingPoint, convs: Conversations, target, store: Store) -> torch.Tensor | None:
    """Bool [len(convs)]: a continued run holds out what its starting drafts held out (so its learning curve
    never scores a conversation they trained on): their recorded val_ids, or for an online draft from before
    they were recorded, its held-out split recomputed from its options (its answers come from the store; the
    same prompt set and seed make them a prefix of this run's). None when a starting draft was not trained
    online, or none of those conversations is in this run's data: the run then uses its own split."""
    ids: set[str] = set()
    for rec in start.records:
        val = rec.get("val_ids")
        if val is None and rec.get("online_options"):
            names = {f.name for f in dataclass_fields(OnlineOptions)}
            then = OnlineOptions(**{k: v for k, v in rec["online_options"].items() if k in names})
            before = load_conversations(target, then, store)
            mask = held_out(len(before), then.val_conversations, then.sample_seed)
            val = [before.ids[i] for i in range(len(before)) if mask[i]]
        if val is None:
            return None
        ids |= set(val)
    mask = torch.tensor([c in ids for c in convs.ids], dtype=torch.bool)
    return mask if bool(mask.any()) else None


def _train(target, convs, sets, o: OnlineOptions, store, key, run_dir, train_idx, val_idx, data_tokens, say,
           should_stop, strategy, start: init_from.StartingPoint | None = None, held_from: str = "own") -> OnlineResult:
    device = target.device
    J = o.ttt_steps
    embed = target.model.get_input_embeddings().weight
    lm_head = target.model.get_output_embeddings().weight
    vocab = int(embed.shape[0])
    resp_ids = torch.tensor([t for i in train_idx for t in convs.response[i]], dtype=torch.long)
    d2t, t2d = (start.d2t, start.t2d) if start else build_draft_vocab(resp_ids, o.draft_vocab, vocab)
    union = sorted({l for s in sets for l in s})
    drafters = build_drafters(target.model.config, embed, lm_head, final_norm(target.model), sets, d2t, t2d, o, device,
                              start=start.heads if start else None)
    if start:
        start.heads.clear()                                 # their weights are the drafters' now

    # held-out features, once: one split per set over all held-out conversations (rank 0 evaluates)
    val_splits = held_out_splits(target, convs, val_idx, sets, union, o, say) if distributed.rank() == 0 else None

    # a continued run: its starting drafts' held-out agreement by kind on this run's held-out split, before any
    # training (the drafters hold the starting weights until a checkpoint is loaded below); kept in the run folder
    kinds_val = [convs.kinds[i] for i in val_idx]
    by_kind_start = None
    if start is not None and distributed.rank() == 0:
        before = run_dir / "start-by-kind.json"
        with contextlib.suppress(OSError, LayerScopeError):             # missing or damaged: evaluated again
            by_kind_start = jsonsafe.loads(before.read_bytes(), what=str(before))
        if not isinstance(by_kind_start, list) or len(by_kind_start) != len(sets):
            by_kind_start = [val_by_kind(d, sp, kinds_val, o, device) for d, sp in zip(drafters, val_splits)]
            atomic_write_json(before, by_kind_start)

    state = FitState(len(sets))
    ckpts = complete_checkpoints(run_dir)
    resumed = bool(ckpts)
    if ckpts:
        try:
            state = load_checkpoint(ckpts[-1], drafters)
        except (OSError, ValueError, KeyError, TypeError, AssertionError, RuntimeError, SafetensorError, DraftError) as e:
            raise DraftError(f"Checkpoint {ckpts[-1]} cannot be read ({str(e)[:200]})",
                             f"Remove that folder to resume from scratch (or the whole {run_dir} to start over)") from None

    def run_eval():
        return [evaluate(d.head, sp, windows_of(sp, o.seq_len, sp.counted, J), J, d.teacher, o.batch_size, device)
                for d, sp in zip(drafters, val_splits)]

    cache, cache_off = None, "turned off (feature_cache=False)"
    if o.feature_cache and within_first_epoch(o, len(train_idx), data_tokens):
        cache_off = feature_cache.FIRST_EPOCH
    elif o.feature_cache:                   # what a resumed run kept is read even where no more fits
        cache = FeatureCache(run_dir / feature_cache.FOLDER, union + [target.num_layers])
        need = feature_cache.cache_bytes(data_tokens, len(union) + 1, target.model.config.hidden_size)
        cache.off = feature_cache.room(need - _kept_bytes(run_dir), shutil.disk_usage(run_dir).free)
    state = fit(drafters, OnlineSource(target, convs, train_idx, sets, o, t2d, cache), o, state=state, evaluate=run_eval,
                progress=say, should_stop=should_stop, checkpoint=lambda st: save_checkpoint(run_dir, st, drafters),
                checkpoint_every_s=o.checkpoint_every_s, planned_steps=o.steps, device=device)

    # the drafts, then result.json (the run counts as finished only once every draft is in place)
    mix = kind_mix(convs, train_idx)
    if distributed.rank() != 0:
        dist.barrier()                                      # rank 0 writes them
        return cached_result(run_dir / "result.json", key, len(train_idx), data_tokens, mix, o)
    by_kind = [val_by_kind(d, sp, kinds_val, o, device) for d, sp in zip(drafters, val_splits)]
    starts = by_kind_start or [None] * len(sets)          # the starting drafts' by kind (continued runs)
    drafts = []
    data = {"online": {"prompts": o.prompts, "responses": o.responses, "data_key": convs.key,
                       "conversations": len(train_idx), "data_tokens": data_tokens,
                       "val_ids": [convs.ids[i] for i in val_idx], "held_out_from": held_from,
                       "kinds": weights_name(o), "kind_mix": mix},
            "train_tokens": data_tokens}
    for s_i, (d, s) in enumerate(zip(drafters, sets)):
        d.head.eval()
        dkey = make_key({"run": key, "layers": s})
        path = store.path("drafts", dkey)
        label = init_from.strategy_label(strategy[s_i] if strategy else None, start, s_i)
        meta = {**draft_meta(s, o, state, s_i, target=target, strategy=label, data=data,
                             vocab_size=len(d2t), started=start.summary(s_i) if start else None),
                "key": dkey, "run_key": key, "val_by_kind": by_kind[s_i], "val_by_kind_start": starts[s_i]}
        save_draft(path, d.head, meta, target=target)
        store.touch("drafts", dkey)
        drafts.append(DraftResult(s, str(path), state.tokens, meta["val_accuracy"], meta["val_coverage"], meta["curve"],
                                  meta.get("tokens_seen_total"), val_by_kind=by_kind[s_i],
                                  val_by_kind_start=starts[s_i]))
    rate = state.tokens / max(state.elapsed, 1e-9)
    atomic_write_json(run_dir / "result.json", {"drafts": [asdict(d) for d in drafts], "seconds": state.elapsed,
                                                "tokens_per_s": rate, "sets": sets})
    for old in complete_checkpoints(run_dir):
        shutil.rmtree(old, ignore_errors=True)
    feature_cache.remove(run_dir)
    say(DoneProgress(state.step, state.tokens))
    if distributed.world() > 1:
        dist.barrier()
    features = cache.summary() if cache is not None else {"read": 0, "written": 0, "off": cache_off}
    return OnlineResult(drafts, state.elapsed, rate, resumed, False, key, len(train_idx), data_tokens, mix,
                        weights_name(o), features)


def within_first_epoch(o: OnlineOptions, conversations: int, data_tokens: int) -> bool:
    """Whether a steps or tokens budget ends within the first epoch over `conversations` training conversations of
    `data_tokens` tokens (a time budget: not known, False), so that no kept feature would be read back."""
    batches = -(-conversations // o.batch_size)                          # epoch_batches' count
    return (o.steps is not None and o.steps <= batches) or (o.tokens is not None and o.tokens <= data_tokens)


def _kept_bytes(run_dir: Path) -> int:
    """Bytes of features a resumed run's cache holds already (they count against what it still needs)."""
    folder = run_dir / feature_cache.FOLDER
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.is_dir() else 0
