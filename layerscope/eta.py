"""How long the rest of a phase will take: from the measured rate of the current phase only. The one rule of
every time-left estimate (capture, online training's answer writing and its training, the benchmark's
calibration and decoding, the study), in the command line's bars and the app alike.

A job goes through phases of very different speed (a model load, a calibration, the decoding; the target
writing its answers, then training). A rate taken over the whole job, or over a window that reaches back into
the phase before, is wrong by the ratio of the two speeds for as long as it does: the benchmark said "about
3 h 50 min left" 41 s in (its calibration had moved the job's progress bar by 1 %) and finished at 1 min 54 s.
So the rate is the current phase's own, counted in units of work that are alike across the phase:

    remaining(done, total, seconds, start=0)   the rule: (total - done) / ((done - start) / seconds), or None
                                               ("estimating…") until MIN_SHARE of the phase's work and
                                               MIN_SECONDS of its time are measured, or ENOUGH_SECONDS of
                                               it (a long phase: 5 % of a 5-hour training is 15 min)
    PhaseClock(total, done=0, clock=...)       the clock of one phase, started when the phase starts:
                                               .left(done, total=None) -> seconds left or None
    text(seconds)                              "about 3 min left" | "under a second left" | "estimating time left…"

Units, each phase's own: a capture's decode steps (max_new_tokens + 1 per batch), the answers' decode steps
(max_new_tokens per batch), a share of the training budget, the benchmark's token budget (max_new_tokens
per prompt and contender, whether or not the answer ends sooner), calibration prompts, a study's drafts
(one budget each). Never runs of very different length.

Pure: no I/O; `clock` is any function returning seconds (time.monotonic; a test's own clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from layerscope import fmt

MIN_SHARE = 0.05          # of a phase's work measured before its first estimate ...
MIN_SECONDS = 2.0         # ... and at least this long (a phase that ends sooner needs none)
ENOUGH_SECONDS = 60.0     # a minute of a phase's own work measures its rate whatever share it is (a long training
                          # said "estimating time left…" for its first 15 min)
ESTIMATING = "estimating time left…"


def remaining(done: float, total: float, seconds: float, start: float = 0.0) -> float | None:
    """Seconds left of a phase of `total` units that went from `start` to `done` units in `seconds`: the
    rest at the phase's own rate. None while too little is measured (MIN_SHARE of the work from `start`
    on and MIN_SECONDS, or ENOUGH_SECONDS) or nothing moved."""
    todo, measured = float(total) - float(start), float(done) - float(start)
    if todo <= 0 or float(done) >= float(total):
        return 0.0
    if measured <= 0 or seconds < MIN_SECONDS or (measured < MIN_SHARE * todo and seconds < ENOUGH_SECONDS):
        return None
    return (float(total) - float(done)) * float(seconds) / measured


class PhaseClock:
    """The clock of one phase of `total` units, started now with `done` of them already done (a resumed
    phase: only the work of this run measures the rate)."""

    def __init__(self, total: float, done: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.total, self.start, self.clock = float(total), float(done), clock
        self.t0 = clock()

    def left(self, done: float, total: float | None = None) -> float | None:
        """Seconds left once `done` units of the phase are done (`total`: a new total, e.g. when part of the
        work turned out to be done already); None while estimating."""
        if total is not None:
            self.total = float(total)
        return remaining(done, self.total, self.clock() - self.t0, self.start)


def text(seconds: float | None) -> str:
    """How a time-left estimate reads: "about 3 min left", "under a second left" (never "about 0.0 s"), or
    "estimating time left…" while there is none."""
    if seconds is None:
        return ESTIMATING
    return "under a second left" if seconds < 1 else f"about {fmt.duration(seconds)} left"
