"""What draft training reports while it runs: one frozen dataclass per phase, its `phase` the name a
consumer may switch on (as capture.CaptureProgress and bench.BenchProgress).

    ResponsesProgress   online: the target answers the training prompts (draft/training/responses.py, regenerate)
    FeaturesProgress    online: the held-out conversations go through the target, once
    TrainProgress       after every training step (draft/training/fit.py): capture training (one set) and online (k sets)
    EvalProgress        before a held-out evaluation (draft/training/fit.py)
    DoneProgress        online: every draft is saved

Capture training (draft/training/train.py) reports only TrainProgress; online training (draft/training/online.py) all of them,
in the order above. Plain fields only, so they pickle (the app's worker process turns them into job
metrics; the study passes them on as StudyProgress.detail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar


@dataclass(frozen=True)
class ResponsesProgress:
    """After each decode step of the batch being answered, and after each batch (stored as token ids,
    responses/<key>/)."""
    phase: ClassVar[str] = "responses"
    done: int                         # batches generated in this run
    total: int                        # batches this run generates (those not in the store yet)
    conversations: int                # prompts in the data, stored answers included
    tokens_per_s: float               # generated tokens per second of this run (its finished batches)
    eta_s: float | None               # seconds left (layerscope.eta: the rate of this run's decode steps); None: estimating
    step: int = 0                     # decode steps done of the batch being answered (of max_new_tokens)
    elapsed_s: float = 0.0            # seconds this run has spent answering
    prompts: int = 0                  # prompts this run answers (those of its `total` batches)
    reused: int = 0                   # answers taken from the unweighted draw's store instead (responses.stored_answers)


@dataclass(frozen=True)
class FeaturesProgress:
    """The held-out conversations through the target: `done` of `total` (0 of them first)."""
    phase: ClassVar[str] = "features"
    done: int
    total: int


@dataclass(frozen=True)
class TrainProgress:
    """After every training step. Lists are per layer set, in the order of `sets` (one set for capture training).

    Budget: `fraction` of it spent; `steps` is the planned number of optimizer steps where it is known
    (a steps budget, or capture training's batches of a tokens budget), else None (a time budget, online tokens).
    In the warm start (TrainOptions.warm_start) nothing trains: loss is [] and acc is zeros."""
    phase: ClassVar[str] = "train"
    step: int                         # optimizer steps done (warm-start steps included)
    steps: int | None                 # planned steps, or None
    tokens: int                       # rows through the draft so far
    fraction: float                   # of the budget spent, 0..1
    tokens_per_s: float               # rows per second of training in this run (a resumed run counts from its start)
    eta_s: float | None               # seconds of training left (layerscope.eta: the rate of this run); None: estimating
    loss: list[float]                 # this step's loss of every set that had a counted position ([] in the warm start)
    acc: list[list[float]]            # per set [J]: this batch's agreement per TTT step
    val: list[list[float] | None]     # per set [J]: the newest held-out agreement per TTT step, None before the first
    elapsed_s: float                  # seconds of training, over every run of a resumed training
    sets: list[list[int]]             # the layer sets, one per draft

    @property
    def mean_loss(self) -> float:
        """The loss averaged over the sets that trained this step (nan when none did: the warm start)."""
        return sum(self.loss) / len(self.loss) if self.loss else float("nan")


@dataclass(frozen=True)
class EvalProgress:
    """A held-out evaluation starts, at `step`, after `tokens` rows."""
    phase: ClassVar[str] = "eval"
    step: int
    tokens: int


@dataclass(frozen=True)
class DoneProgress:
    """Online training finished: every draft and the run's result.json are written."""
    phase: ClassVar[str] = "done"
    step: int
    tokens: int


FitProgress = TrainProgress | EvalProgress                      # what draft/training/fit.py's loop reports
OnlineProgress = ResponsesProgress | FeaturesProgress | TrainProgress | EvalProgress | DoneProgress


def last_of(progress: Callable | None, *kinds) -> tuple[Callable, dict]:
    """A progress callback passing every update on to `progress`, and a dict that keeps the last of each class in
    `kinds` (the run's own measurements, for its pace: forecast.online_measured)."""
    last = {}

    def watch(p):
        if isinstance(p, kinds):
            last[type(p)] = p
        if progress is not None:
            progress(p)
    return watch, last
