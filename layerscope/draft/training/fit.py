"""The one training loop of LayerScope's drafts: both data sources feed it batches.

    drafters = build_drafters(target, sets, d2t, t2d, options)      one head + AdamW per layer set
    state = fit(drafters, source, options, evaluate=..., ...)       steps until the budget is spent

A `source` (draft/training/train.py: a stored capture; draft/training/online.py: the target in the loop) turns the loop's
state (epoch, cursor) into one batch per drafter (data.make_batch) and the rows they hold, and advances
the cursor. Every drafter gets a batch of the same rows, read from its own layers. Per step and drafter:
    lr      = schedule(step, fraction of the budget)          linear warm-up, then cosine to lr*min_lr_ratio
    loss    = loss.ttt_loss(head, batch, teacher)             (+ feature regression, + input noise)
    AdamW step after clipping the gradient norm to grad_clip
The budget is steps, tokens (rows through the draft) or seconds of training; `fraction` says how much is
spent. Held-out evaluation runs `eval_points` times over the budget (the last at the end) and gives the
learning curve [[tokens seen, [agreement per TTT step], coverage], ...] per set. Progress: a TrainProgress
after every step, its time left from this run's wall-clock rate through the budget (layerscope.eta), an
EvalProgress before each evaluation (draft/training/progress.py).

Warm start (`warm_start` > 0): the first `warm_start` steps' batches are not trained on but accumulated
into the normal equations of a ridge regression from the auxiliary hidden states at row t to the target's
final state at t+1 (what step 1 predicts); fc is set to its solution (in the draft norm's units), then
gradient training starts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from layerscope import distributed, eta
from layerscope.draft.model import DraftConfig, DraftHead
from layerscope.draft.training.loss import Teacher, simulated_acc_len, ttt_loss
from layerscope.draft.training.progress import EvalProgress, FitProgress, TrainProgress
from layerscope.errors import DraftError
from layerscope.validate import check_number

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
TRAIN_DTYPES = ("float32", "bfloat16")
TRAIN_FORMAT = 3                      # 3: one loop for capture and online training (recipe options below)


@dataclass
class TrainOptions:
    """The recipe and the budget of a draft's training: the one source of their defaults."""
    steps: int | None = None          # budget: optimizer steps ...
    tokens: int | None = None         # ... or rows through the draft ...
    time_s: float | None = None       # ... or seconds of training
    ttt_steps: int = 3                # unrolled draft steps (EAGLE-3 uses 7; 3 keeps CPU training cheap)
    lr: float = 1e-3
    batch_size: int = 8               # windows (capture) or conversations (online) per step
    seq_len: int = 512                # rows per draft window (longer conversations are split)
    warmup: int = 20                  # linear warm-up steps
    min_lr_ratio: float = 0.1         # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    val_fraction: float = 0.1         # capture training: held-out conversations, by a seeded split
    eval_points: int = 8              # held-out evaluations over the budget (the last one at the end)
    draft_vocab: int = 8192           # V = min(draft_vocab, target vocabulary)
    draft_intermediate: int | None = None  # the draft's MLP width; None: the target's (the EAGLE-3 default). A
                                      # narrower MLP makes a large target's draft smaller and cheaper to train
    init_lm_head: bool = True         # start lm_head from the target's rows for the draft vocabulary
    freeze_lm_head: bool = False      # keep lm_head at the target's rows and norm at the target's final norm
    feature_loss: float = 0.0         # weight of the feature regression toward hidden_states[N] (EAGLE-1)
    noise_std: float = 0.0            # Gaussian noise on the auxiliary hidden states in training
    warm_start: int = 0               # steps of data for the closed-form fc before gradient training
    train_dtype: str = "float32"      # the draft's forward and backward in training: float32, or bfloat16 (autocast:
                                      # the weights, Adam's moments, the teacher's logits and the held-out
                                      # evaluation stay float32); 2.4x faster for a Qwen2.5-1.5B draft on a CPU with
                                      # AMX, as GPU trainers (SpecForge, speculators) train in bf16
    clock: str = "wall"               # what a time budget counts: "wall" seconds, or "cpu" seconds of this process
    init_from: tuple[str, ...] = ()   # drafts to continue, one per layer set (draft/init_from.py); (): fresh heads
    fc_norm: bool = True              # an RMSNorm on each auxiliary state before fc (EAGLE-3.1): on, as measured on
                                      # both models (docs/results.md, issue 38.3: +0.02..+0.07 τ on SmolLM2,
                                      # +0.09..+0.26 on Gemma 3, whose deep layers' large states otherwise dominate fc)

    def __post_init__(self):
        if isinstance(self.init_from, list):        # read back from JSON (a draft's layerscope.json, the app)
            self.init_from = tuple(self.init_from)

    @staticmethod
    def default_steps(device) -> int:
        """The training budget when none is given: 300 optimizer steps on a CPU (20-25 min for a SmolLM2-135M
        draft on one core), 2000 on a GPU."""
        return 300 if torch.device(device).type == "cpu" else 2000

    def with_budget(self, device) -> TrainOptions:
        """These options, with the device's default steps when neither steps nor tokens are given."""
        if self.steps is None and self.tokens is None and self.time_s is None:
            return replace(self, steps=self.default_steps(device))
        return self

    def validate(self) -> None:
        """The budget (exactly one of steps, tokens, time_s, each above 0), then validate_draft."""
        budgets = [b for b in (self.steps, self.tokens, self.time_s) if b is not None]
        if len(budgets) != 1:
            raise DraftError("Give the training budget as one of steps, tokens or time",
                             "Pass --steps N, --tokens 2M or --time 45m")
        for name in ("steps", "tokens", "time_s"):
            check_number(name, getattr(self, name), minimum=0, above=True, optional=True, error=DraftError,
                         fix="Pass e.g. --steps 300, --tokens 2M or --time 45m")
        self.validate_draft()

    def validate_draft(self) -> None:
        """Everything but the budget: the draft's shape, TTT, the optimizer and the recipe. Numbers follow the
        one rule of numeric options (validate.check_number)."""
        check = partial(check_number, error=DraftError)
        check("ttt_steps", self.ttt_steps, minimum=1, maximum=7, integer=True,
              fix="EAGLE-3 unrolls up to 7 steps; 3 is the CPU default")
        check("batch_size", self.batch_size, minimum=1, integer=True, fix="Use the default: --batch-size 8")
        check("seq_len", self.seq_len, minimum=2, integer=True, fix="Use the default: --seq-len 512")
        check("draft_vocab", self.draft_vocab, minimum=2, integer=True, fix="Use the default: --draft-vocab 8192")
        check("draft_intermediate", self.draft_intermediate, minimum=1, integer=True, optional=True,
              fix="Pass --draft-intermediate N (the draft's MLP width, e.g. 1024), or leave it out for the target's")
        check("val_fraction", self.val_fraction, minimum=0, maximum=1, below=True, fix="Use e.g. 0.1")
        check("lr", self.lr, minimum=0, above=True, fix="Use e.g. 1e-3")
        for name in ("warmup", "warm_start"):
            check(name, getattr(self, name), minimum=0, integer=True, fix=f"Pass --{name.replace('_', '-')} 0 or more")
        check("eval_points", self.eval_points, minimum=1, integer=True, fix="Pass --eval-points 1 or more")
        for name in ("feature_loss", "noise_std", "weight_decay"):
            check(name, getattr(self, name), minimum=0, fix=f"Pass --{name.replace('_', '-')} 0 or more")
        if self.train_dtype not in TRAIN_DTYPES:
            raise DraftError(f"train_dtype must be one of {', '.join(TRAIN_DTYPES)} (got {self.train_dtype!r})",
                             "Pass --train-dtype float32 (exact) or --train-dtype bfloat16 (autocast, faster where the "
                             "CPU or GPU has bf16 units)")
        if self.clock not in CLOCKS:
            raise DraftError(f"clock must be one of {', '.join(CLOCKS)} (got {self.clock!r})",
                             "Use wall (seconds on the clock) or cpu (CPU seconds of this process: equal work on a busy machine)")
        if not isinstance(self.init_from, (tuple, list)) or not all(isinstance(p, str) and p for p in self.init_from):
            raise DraftError(f"init_from must be a list of draft directories (got {self.init_from!r})",
                             "Pass --init-from DRAFT once per layer set")
        if self.init_from and self.warm_start:
            raise DraftError("--warm-start fits fc from scratch; a continued draft (--init-from) already has one",
                             "Leave out --warm-start when continuing a draft")
        if not isinstance(self.fc_norm, bool):
            raise DraftError(f"fc_norm must be true or false (got {self.fc_norm!r})", "Pass --fc-norm or --no-fc-norm")
        if self.freeze_lm_head and not self.init_lm_head:
            raise DraftError("freeze_lm_head keeps the target's lm_head rows, so it needs init_lm_head",
                             "Leave init_lm_head on, or do not freeze")


    def key_fields(self) -> dict:
        """The options as they enter a store key: every field but init_from (where the starting drafts lie);
        a continued run's key adds their weights' identity instead (init_from.key_part). fc_norm enters only
        when on: a run without it (--no-fc-norm, the default before it was measured) keeps the key it had before
        the option existed."""
        d = asdict(self)
        d.pop("init_from")
        if not d["fc_norm"]:
            d.pop("fc_norm")
        if d["train_dtype"] == "float32":
            d.pop("train_dtype")            # float32: the key a run had before the option existed
        if d["draft_intermediate"] is None:
            d.pop("draft_intermediate")     # the target's width: the key a run had before the option existed
        return d


class TrainingCancelled(DraftError):
    """should_stop() returned True."""


# ----------------------------------------------------------------------------- the drafts being trained

@dataclass
class Drafter:
    """One draft in training: its head, optimizer and the target's logits on the draft vocabulary."""
    layers: list[int]
    head: DraftHead
    opt: torch.optim.Optimizer
    teacher: Teacher

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.head.parameters() if p.requires_grad]


def build_drafters(target_config, embed: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor | None,
                   sets: list[list[int]], d2t: torch.Tensor, t2d: torch.Tensor, o: TrainOptions, device,
                   start: list[DraftHead] | None = None) -> list[Drafter]:
    """A fresh head per layer set, each seeded with o.seed (so a set's start does not depend on the others),
    or with `start` (one loaded draft per set, draft/init_from.py) that draft's weights.
    embed, lm_head [vocab, d]: the target's (embed is the raw weight: Gemma's sqrt(d) normalizer is the target's
    forward's, never the draft's); final_norm [d]: its final norm's gain (the final_norm function; for
    freeze_lm_head). init_lm_head starts lm_head at the target's rows times its logit scale (Teacher.scale), so the
    draft's logits start in the target's units; no engine soft-caps a draft's logits, so the cap stays the teacher's."""
    V, vocab = len(d2t), int(embed.shape[0])
    teacher = Teacher.of(target_config, lm_head, d2t, device)
    out = []
    for i, s in enumerate(sets):
        torch.manual_seed(o.seed)
        config = DraftConfig.from_target(target_config, s, V, vocab_size=vocab, fc_norm=o.fc_norm,
                                         intermediate_size=o.draft_intermediate)
        head = DraftHead(config, embed.detach(), d2t, t2d).to(device)
        with torch.no_grad():
            if start is not None:
                try:
                    head.load_state_dict(start[i].state_dict())    # load_draft made them float32
                except RuntimeError as e:
                    raise DraftError(f"The starting draft for layers {s} does not have this target's draft shape "
                                     f"({str(e).splitlines()[0][:200]})", "Continue a draft LayerScope trained for this target") from None
            elif o.init_lm_head:
                head.lm_head.weight.copy_(teacher.rows * teacher.scale)
            if o.freeze_lm_head:
                if final_norm is None:
                    raise DraftError(f"freeze_lm_head keeps the draft's RMSNorm at the target's final norm, and this "
                                     f"{target_config.model_type} target's final norm is not an RMSNorm (or it has none)",
                                     "Train without --freeze-lm-head")
                head.norm.weight.copy_(final_norm.detach().float())
                head.lm_head.weight.requires_grad_(False)
                head.norm.weight.requires_grad_(False)
        head.train()
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay)
        out.append(Drafter(list(s), head, opt, teacher))
    return out


NORM_PROBE = 64.0     # |x_i| of the probe vector: rms(x) = 64 exactly, so a norm's eps does not show in float32


@torch.no_grad()
def final_norm(model) -> torch.Tensor | None:
    """The gain g [d] float32 of a causal LM's final norm read as the draft's norm reads its weight, g * x / rms(x):
    measured on the module itself, so Llama's w comes out as w and Gemma's (1 + w) as 1 + w. None when the model has
    no final norm or its norm is not of that form (a LayerNorm subtracts the mean: Cohere, Starcoder2)."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    weight = getattr(norm, "weight", None)
    if weight is None:
        return None
    g = torch.Generator().manual_seed(0)
    d = weight.shape[-1]
    signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
    gain = (norm((signs * NORM_PROBE).to(weight.device, weight.dtype)).float().cpu() * signs).to(weight.device)
    z = torch.randn(4, d, generator=g) + 1.0                    # off-centre: a mean-subtracting norm shows
    rms_form = gain.cpu() * z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True))
    seen = norm(z.to(weight.device, weight.dtype)).float().cpu()
    tol = 2e-2 if weight.dtype in (torch.float16, torch.bfloat16) else 1e-4
    if not torch.allclose(seen, rms_form, rtol=tol, atol=tol * float(rms_form.abs().max())):
        return None
    return gain


# ----------------------------------------------------------------------------- schedule and budget

def fraction(o: TrainOptions, step: int, tokens: int, elapsed: float) -> float:
    """How much of the budget is spent (>= 1: done)."""
    if o.steps is not None:
        return step / o.steps
    if o.tokens is not None:
        return tokens / o.tokens
    return elapsed / o.time_s


def lr_at(o: TrainOptions, step: int, frac: float) -> float:
    """Linear warm-up over the first o.warmup steps, then cosine over the budget down to lr * min_lr_ratio."""
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    f = min(1.0, frac)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * f)))


# ----------------------------------------------------------------------------- state

@dataclass
class FitState:
    """Everything a checkpoint needs besides tensors (plain JSON)."""
    sets: int
    step: int = 0
    tokens: int = 0                   # rows through the draft
    elapsed: float = 0.0              # seconds of training
    epoch: int = 0                    # the source's position in its data ...
    cursor: int = 0                   # ... (batches of the epoch done)
    curves: list = field(default_factory=list)        # per set [[tokens, [agreement per step], coverage], ...]
    loss_curves: list = field(default_factory=list)   # per set [[tokens, loss], ...]
    evals_done: int = 0
    last_eval: list | None = None     # per set (agreement, loss, positions, coverage) of the newest evaluation
    starts: list = field(default_factory=list)        # [unix time, step, tokens] each time fit() (re)started;
                                                      # [None, 0, 0] first: began before starts were recorded

    def __post_init__(self):
        self.curves = self.curves or [[] for _ in range(self.sets)]
        self.loss_curves = self.loss_curves or [[] for _ in range(self.sets)]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "FitState":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class Source(Protocol):
    def next_batches(self, state: FitState) -> tuple[list[dict | None], int]:
        """One batch per drafter (None: no rows for it on this rank) and the rows of this rank; advances
        state.epoch / state.cursor."""


class EpochSource:
    """A Source whose data comes in seeded epochs: subclasses give epoch(e) (the epoch's list of items) and
    batches(item) (one batch per drafter, rows); this walks state.epoch / state.cursor over them."""

    def __init__(self):
        self._epoch, self._items = None, []

    def epoch(self, e: int) -> list:
        raise NotImplementedError

    def batches(self, item) -> tuple[list[dict | None], int]:
        raise NotImplementedError

    def next_batches(self, state: FitState) -> tuple[list[dict | None], int]:
        if self._epoch != state.epoch:
            self._epoch, self._items = state.epoch, self.epoch(state.epoch)
        if state.cursor >= len(self._items):
            state.epoch, state.cursor = state.epoch + 1, 0
            return self.next_batches(state)
        item = self._items[state.cursor]
        state.cursor += 1
        return self.batches(item)


# ----------------------------------------------------------------------------- warm start

class WarmStart:
    """Normal equations of ridge regression g_t = W x_t, x_t = aux row t [k*d] as fc reads it (DraftHead.fc_input),
    toward y = final[t+1] [d]
    (divided by the draft norm's weight, so that norm(fc(x)) reproduces the target's final state)."""

    def __init__(self, drafters: list[Drafter]):
        self.xtx = [None] * len(drafters)
        self.xty = [None] * len(drafters)
        self.n = [0] * len(drafters)

    def add(self, drafters: list[Drafter], batches: list[dict | None]) -> None:
        for i, (d, b) in enumerate(zip(drafters, batches)):
            if b is None or b["targets"][0].shape[0] == 0:
                continue
            with torch.no_grad():                                                  # what fc reads (fc_norm applied)
                x = d.head.fc_input(b["aux"][b["masks"][0]]).double()              # [M, k*d]
            y = (b["targets"][0] / d.head.norm.weight.detach().float().clamp_min(1e-6)).double()   # [M, d]
            self.xtx[i] = x.T @ x if self.xtx[i] is None else self.xtx[i] + x.T @ x
            self.xty[i] = x.T @ y if self.xty[i] is None else self.xty[i] + x.T @ y
            self.n[i] += x.shape[0]

    def apply(self, drafters: list[Drafter], lam: float = 1e-2) -> None:
        """fc.weight = ((X^T X + lam * mean diag * I)^-1 X^T Y)^T for every drafter that saw data."""
        for i, d in enumerate(drafters):
            if self.xtx[i] is None:
                continue
            a, b = self.xtx[i], self.xty[i]
            if distributed.world() > 1:
                dist.all_reduce(a)
                dist.all_reduce(b)
            ridge = lam * float(a.diagonal().mean()) + 1e-8
            w = torch.linalg.solve(a + ridge * torch.eye(a.shape[0], dtype=a.dtype, device=a.device), b)   # [k*d, d]
            with torch.no_grad():
                d.head.fc.weight.copy_(w.T.to(d.head.fc.weight.dtype))


# ----------------------------------------------------------------------------- one step

def train_step(d: Drafter, batch: dict | None, o: TrainOptions, lr: float, J: int, device):
    """One AdamW step of drafter d on its batch (summed over ranks). Returns (loss, this rank's agreement per
    TTT step on the batch); loss None when no rank had a counted position (no step is taken)."""
    world = distributed.world()
    counts = torch.tensor([int(m.sum()) for m in batch["masks"]] if batch else [0] * J, device=device)
    if world > 1:
        dist.all_reduce(counts)                         # positions per TTT step, over every rank
    if int(counts.sum()) == 0:
        return None, [0.0] * J
    for g in d.opt.param_groups:
        g["lr"] = lr
    d.opt.zero_grad(set_to_none=True)
    loss, stats = torch.zeros((), device=device), []
    if batch is not None:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=o.train_dtype == "bfloat16"):
            loss, stats = ttt_loss(d.head, batch, d.teacher, denom=counts.tolist(), feature_weight=o.feature_loss,
                                   noise_std=o.noise_std)
        loss.backward()
    if world > 1:                                       # the sum of the ranks' gradients = the one-process one
        for p in d.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    torch.nn.utils.clip_grad_norm_(d.params, o.grad_clip)
    d.opt.step()
    return float(loss.detach()), [c / t if t else 0.0 for c, t in stats] or [0.0] * J


# ----------------------------------------------------------------------------- the loop

def fit(drafters: list[Drafter], source: Source, o: TrainOptions, *, state: FitState | None = None,
        evaluate: Callable[[], list[tuple]] | None = None, progress: Callable[[FitProgress], None] | None = None,
        should_stop: Callable[[], bool] | None = None, checkpoint: Callable[[FitState], None] | None = None,
        checkpoint_every_s: float = float("inf"), planned_steps: int | None = None, device="cpu") -> FitState:
    """Train every drafter until the budget is spent; returns the final state (curves, last evaluation).

    evaluate() -> per set (agreement per TTT step, loss, positions, coverage), run on rank 0 at the eval
    points. progress gets a TrainProgress after every step (steps = planned_steps) and an EvalProgress before
    an evaluation (draft/training/progress.py). checkpoint(state) is called every checkpoint_every_s seconds of training
    and on a stop (never inside the warm start, whose sums are not saved: a stop there starts it again)."""
    J = o.ttt_steps
    state = state or FitState(len(drafters))
    say = progress or (lambda p: None)
    rank, world = distributed.rank(), distributed.world()
    agree = distributed.agree if world > 1 else (lambda v: v)
    warm = WarmStart(drafters) if state.step < o.warm_start else None
    start = (state.tokens, state.elapsed, fraction(o, state.step, state.tokens, state.elapsed))
    timer = eta.PhaseClock(1.0, start[2])            # the time left: this run's rate through the budget
    note_start(state)
    clock = CLOCKS[o.clock]
    last_ckpt = time.perf_counter()
    while agree(fraction(o, state.step, state.tokens, state.elapsed) < 1.0):
        if agree(bool(should_stop and should_stop())):
            in_warm = state.step < o.warm_start
            if checkpoint is not None and rank == 0 and not in_warm:
                checkpoint(state)
            raise TrainingCancelled(f"Training stopped at step {state.step} ({state.tokens} tokens)",
                                    "The progress is saved; run the same command again to continue"
                                    if checkpoint is not None and not in_warm else "Nothing was saved; start it again")
        t_step = clock()
        batches, rows = source.next_batches(state)
        if world > 1:
            n = torch.tensor([rows], device=device)
            dist.all_reduce(n)
            rows = int(n)
        frac = fraction(o, state.step, state.tokens, state.elapsed)
        if warm is not None and state.step < o.warm_start:
            warm.add(drafters, batches)
            losses, accs = [], [[0.0] * J for _ in drafters]
            if state.step + 1 == o.warm_start:
                warm.apply(drafters)
        else:
            lr = lr_at(o, state.step - o.warm_start, frac)
            losses, accs = map(list, zip(*[train_step(d, b, o, lr, J, device) for d, b in zip(drafters, batches)]))
        state.step += 1
        state.tokens += rows
        state.elapsed += clock() - t_step
        frac = fraction(o, state.step, state.tokens, state.elapsed)
        if state.step % 10 == 1 or frac >= 1.0:
            for c, l in zip(state.loss_curves, losses):
                if l is not None:
                    c.append([state.tokens, round(l, 5)])
        due = min(o.eval_points, math.floor(frac * o.eval_points + 1e-9))
        if due > state.evals_done and rank == 0 and evaluate is not None:
            say(EvalProgress(state.step, state.tokens))
            state.last_eval = [list(e) for e in evaluate()]
            for i, (acc, _, _, cov) in enumerate(state.last_eval):
                state.curves[i].append([state.tokens, [round(a, 5) for a in acc], round(cov, 5)])
        if due > state.evals_done:
            state.evals_done = due
        spent = state.elapsed - start[1]
        f = min(1.0, frac)
        say(TrainProgress(step=state.step, steps=planned_steps, tokens=state.tokens, fraction=f,
                          tokens_per_s=(state.tokens - start[0]) / max(spent, 1e-9),
                          eta_s=timer.left(f),
                          loss=[l for l in losses if l is not None], acc=accs,
                          val=[c[-1][1] if c else None for c in state.curves], elapsed_s=state.elapsed,
                          sets=[list(d.layers) for d in drafters]))
        if (checkpoint is not None and rank == 0 and state.step >= o.warm_start
                and time.perf_counter() - last_ckpt >= checkpoint_every_s):
            checkpoint(state)
            last_ckpt = time.perf_counter()
    return state


# ----------------------------------------------------------------------------- what a draft records

def note_start(state: FitState) -> None:
    """Record that fit() (re)starts from `state`. A state resumed from a checkpoint made before starts were
    recorded (step > 0, no starts) first gets [None, 0, 0]: it began at least once, when is unknown."""
    if state.step > 0 and not state.starts:
        state.starts.append([None, 0, 0])
    state.starts.append([round(time.time(), 3), state.step, state.tokens])


def history(state: FitState) -> dict:
    """How the training went in wall time: its starts (the first and every resume, each with the step and
    tokens it started from), the wall seconds from the first start to now (pauses and the gaps between runs
    included) beside `seconds` (training only). A run resumed from a checkpoint made before starts were
    recorded counts that unknown first start (at least one): its first_start and wall_s are None, and
    recorded_wall_s counts from the oldest start whose time is known."""
    now = time.time()
    known = [t for t, _, _ in state.starts if t is not None] or [now]
    first = state.starts[0][0] if state.starts else now

    def stamp(t):
        return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
    return {"starts": len(state.starts), "resumed": max(len(state.starts) - 1, 0),
            "resumed_at": [{"step": s, "tokens": t} for _, s, t in state.starts[1:]],
            "first_start": stamp(first), "finished": stamp(now),
            "wall_s": None if first is None else round(now - first, 1), "recorded_wall_s": round(now - known[0], 1)}


def draft_meta(layers: list[int], o: TrainOptions, state: FitState, set_index: int, *, target, strategy=None,
               data: dict, vocab_size: int, started: dict | None = None) -> dict:
    """layerscope.json of a trained draft (both sources). data: where the rows came from
    ({"capture_key": ...} or {"online": {...}}) and train_tokens; started: the draft it continued
    (init_from.StartingPoint.records[set_index]), recorded with the tokens seen over both runs."""
    acc, loss, positions, cov = state.last_eval[set_index] if state.last_eval else ([], None, None, None)
    acc = [round(a, 5) for a in acc]
    return {"target_fingerprint": target.fingerprint, "target_model": target.spec,
            "capture_key": data.get("capture_key"), "layers": list(layers), "strategy": strategy,
            **({"online": data["online"]} if "online" in data else {}),
            "budget": {"steps": o.steps, "tokens": o.tokens, "time_s": o.time_s, "resolved_steps": state.step},
            "seed": o.seed, "options": asdict(o),
            "val_accuracy": acc, "val_loss": loss, "val_positions": positions,
            "simulated_acc_len": round(simulated_acc_len(acc), 5) if acc else None,     # SpecForge's; no bonus token
            "val_coverage": None if cov is None else round(cov, 5), "coverage": data.get("coverage"),
            "train_tokens": data["train_tokens"], "tokens_seen": state.tokens,
            "curve": [[c[0], c[1]] for c in state.curves[set_index]], "loss_curve": state.loss_curves[set_index],
            "seconds": round(state.elapsed, 3), "draft_vocab_size": vocab_size, "train_format": TRAIN_FORMAT,
            "history": history(state),
            **({"init_from": started, "tokens_seen_total": int(started.get("tokens_seen") or 0) + state.tokens}
               if started else {})}
