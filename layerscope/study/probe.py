"""The probe: a closed-form ridge map of a draft's own inputs, scored by how often it gives the target's choice.

    report = probe.score_sets(cap, target, [[2, 15, 27], [29]])          # these sets
    report = probe.search(cap, target, k=3)                             # a search over layers 0..N-1
    sel = select.select(stats, "probe", 3, probe=probe.ProbeInput(cap, weights.TargetWeights.of(target)))

Signatures (ProbeOptions is the one source of defaults; `target` is a target.weights.TargetWeights or a LoadedModel):
    score_sets(cap: CaptureReader, target: TargetWeights | LoadedModel, sets: Sequence[Sequence[int]],
               options: ProbeOptions | None = None, *, store: Store | None = None,
               progress: Callable[[float, str], None] | None = None) -> ProbeReport
    search(cap: CaptureReader, target: TargetWeights | LoadedModel, k: int = 3, options: ProbeOptions | None = None,
           *, sets: Sequence[Sequence[int]] = (), store: Store | None = None,
           progress: Callable[[float, str], None] | None = None) -> ProbeReport
    ProbeReport: capture, sets [SetScore] (the given sets in their order, then the search's, best first),
                 seconds, tokens (the capture's), scored (distinct sets fitted), positions {fit, validation,
                 held_out}, conversations {...}, search {...} | None, options, cached;
                 .to_json() -> {"sets": [{"layers", "agreement", "explained_variance", "lambda", ...}], "seconds",
                 "tokens", "scored", ...}; .best() -> the search's result
    SetScore: layers, agreement, explained_variance, lam (JSON "lambda"), val_loss, val_agreement,
              source ("given" | "search"), hits and counts (held-out positions right / in all, per held-out
              conversation), agreement_ci (95% bootstrap interval over held-out conversations); .positions,
              .conversations (the sample behind the agreement)
With `store`, each given set's score and each search is cached (namespace "probe"); `cached` says so.

The map. A draft reading layer set S sees at row t the states h_l[t] (l in S) and the target's input embedding
of token t+1, and its first proposal is judged against the target's choice at p = t+1. For every counted
position p (draft training's rule, draft.training.data's `split_of(...).counted`: token p+1 exists and is a response
token of the same conversation; and p−1 lies in that conversation too):
    x_p = [h_l[p−1] for l in S] ++ embed(token_p) ++ [1]     [(|S| + 1)·d + 1]
    y_p = h_N[p]                                               [d], post-norm: what lm_head reads (predicts p+1)
    W(λ) = (XᵀX + λD)⁻¹ XᵀY                                    float64 normal equations, D = diag of the centred
                                                               Gram (each column's own spread), 0 for the bias
    agreement          = share of held-out p with argmax lm_head(x_p W) == argmax lm_head(y_p)  (the target's)
    explained_variance = 1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖²             over held-out p, ȳ their mean
Splits, by whole conversations: held-out = draft.training.data.split_conversations(conversation, val_fraction, seed),
the draft's own split with TrainOptions' defaults, so the agreement reads like a draft's held-out agreement at
position 1 (same conversations, same positions); on a small capture it holds out at least MIN_HELD_OUT (5)
conversations where a third of them allows (held_out_conversations: 5 of the default capture's 16, the draft's 2
among them), as fewer cannot tell sets apart. Of the other conversations, `lambda_fraction` (the same
function, seed + 1) is the validation split and the rest the fit split. The penalty of each column is λ
times its centred sum of squares on the fit split (ridge on standardised features: the map, and the λ chosen,
do not depend on the units of any block; one λ for all columns let the deep layers' massive activations set
the penalty, which then erased the embedding block, ~10⁴ times smaller in scale). λ comes from the `lambdas`
grid, the one with the best validation objective: for "loss" the mean squared logit error
‖(ŷ − y) lm_headᵀ‖² / vocab, computed as (ŷ − y) M (ŷ − y)ᵀ with M = lm_headᵀ lm_head / vocab (no logits
formed); for "agreement" the validation agreement (ties: the loss). The reported map is refitted on fit +
validation rows at that λ and scored on the held-out rows.

Streaming. One pass over the capture's chunks reads, per chunk, the candidate layers at the chunk's counted
rows (memory: one chunk's rows × blocks × d floats) and adds the fit rows to Gram blocks G[a, b] = X_aᵀX_b
(a ≤ b), X_aᵀY and column sums, in float64 (`Gram`; it and the ridge solve are layerscope/stats/ridge.py); any
set's normal equations are then assembled from its blocks without reading data again. The validation and
held-out rows (together ~30% of the counted rows) are kept in memory for the candidate blocks (float32, `Rows`),
so choosing λ, refitting and the held-out agreement need no second pass. Memory: Gram ≈ B(B+1)/2 · d² · 8 bytes
for B blocks (1.3 GB for 30 layers + the embedding at d = 576) plus the kept rows, checked against `max_memory_gb`
before anything is read.

Search. Greedy forward selection (each step adds the layer whose set has the lowest validation objective),
then with search="swap" a local search: at each position in turn, replace that layer by the best other
candidate while this improves the validation objective, until a pass over every position changes nothing
(or `max_passes`). A candidate is fitted at the λ of the set it modifies (one Cholesky solve); a set the
search keeps gets the whole λ grid, so the kept objective only improves. objective="agreement" compares the
validation agreement (ties: loss) instead of the loss; it forms logits over the validation rows per
candidate, so it is slower. `scored` counts the distinct layer sets fitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from layerscope import layerset
from layerscope.draft.training.data import split_conversations, split_of, target_argmax  # in draft/, above training: its splits
from layerscope.draft.training.fit import TrainOptions
from layerscope.errors import LayerScopeError
from layerscope.stats import bootstrap
from layerscope.stats.ridge import F64, Gram, block_columns, explained_variance, logit_loss, logit_metric, ridge, with_bias
from layerscope.store import make_key
from layerscope.target.config import available_memory
from layerscope.target.weights import TargetWeights
from layerscope.validate import check_number

FORMAT = 4                     # cache entries under the store's "probe" namespace (2: standardised penalty;
                               # 3: the held-out hits per conversation and their bootstrap interval;
                               # 4: at least MIN_HELD_OUT held-out conversations where a third of them allows)
MIN_HELD_OUT = 5               # held-out conversations the probe needs to tell sets apart (fewer: every set ties)
SEARCHES = ("greedy", "swap")
OBJECTIVES = ("loss", "agreement")


class ProbeError(LayerScopeError):
    """The probe cannot run on this capture with these options."""


@dataclass
class ProbeOptions:
    val_fraction: float = TrainOptions.val_fraction      # held-out conversations: draft training's split ...
    seed: int = TrainOptions.seed                         # ... and its seed, so the same conversations
    lambda_fraction: float = 0.2                          # of the other conversations, the share that chooses λ
    lambdas: tuple[float, ...] = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)   # λ grid: × each column's centred sum of squares
    search: str = "swap"                                  # "greedy" | "swap" (greedy, then local swaps)
    objective: str = "loss"                               # what λ and the search minimise on validation:
                                                          # "loss" (squared logit error) | "agreement"
    max_passes: int = 4                                   # swap passes over the set's positions at most
    candidates: tuple[int, ...] | None = None             # layers a search may pick (None: 0..N-1)
    top: int = 5                                          # sets a search reports, best first
    batch_rows: int = 1024                                # fit rows per Gram update
    max_memory_gb: float | None = None                    # refuse a probe that would hold more than this; None: three
                                                          # quarters of the memory available when it starts, at least
                                                          # MIN_MEMORY_GB

    def validate(self) -> None:
        def num(name, lo, hi, fix, **kw):
            check_number(name, getattr(self, name), minimum=lo, maximum=hi, fix=fix, error=ProbeError, **kw)
        num("val_fraction", 0, 0.9, "Use e.g. 0.1 (draft training's split)", above=True)
        num("lambda_fraction", 0, 0.9, "Use e.g. 0.2", above=True)
        num("seed", None, None, "Use e.g. 0", integer=True)
        num("max_passes", 0, 1000, "Use e.g. 4", integer=True)
        num("top", 1, 1000, "Use e.g. 5", integer=True)
        num("batch_rows", 1, 1 << 20, "Use e.g. 1024", integer=True)
        if self.max_memory_gb is not None:
            num("max_memory_gb", 0, None, "Use e.g. 6", above=True)
        if not self.lambdas:
            raise ProbeError("The λ grid is empty", "Give at least one value, e.g. --lambdas 0.001,0.01,0.1")
        for x in self.lambdas:
            check_number("a λ grid value", x, minimum=0, above=True, fix="Use values like 0.001,0.01,0.1", error=ProbeError)
        if self.search not in SEARCHES:
            raise ProbeError(f"Unknown probe search {self.search!r}", f"Use one of {', '.join(SEARCHES)}")
        if self.objective not in OBJECTIVES:
            raise ProbeError(f"Unknown probe objective {self.objective!r}", f"Use one of {', '.join(OBJECTIVES)}")

    def scoring(self) -> dict:
        """The options a set's score depends on (its cache key); the search's own options are not among them."""
        return {k: getattr(self, k) for k in ("val_fraction", "seed", "lambda_fraction", "lambdas")}


@dataclass
class SetScore:
    layers: list[int]
    agreement: float                  # held-out: argmax lm_head(ŷ) == the target's own argmax
    explained_variance: float         # held-out: 1 − SSE / SST of the final state
    lam: float                        # λ chosen on the validation split (a `lambdas` value)
    val_loss: float                   # validation mean squared logit error at that λ (fit split only)
    val_agreement: float | None = None   # validation agreement (objective "agreement" only)
    source: str = "given"             # "given" | "search"
    hits: list[int] | None = None     # held-out positions it got right, per held-out conversation ...
    counts: list[int] | None = None   # ... of these held-out positions per conversation (the same for every set)
    agreement_ci: list[float] | None = None   # 95% bootstrap interval of `agreement` over held-out conversations

    @property
    def positions(self) -> int | None:
        """Held-out positions behind `agreement`."""
        return None if self.counts is None else int(sum(self.counts))

    @property
    def conversations(self) -> int | None:
        """Held-out conversations behind `agreement` (the bootstrap's unit)."""
        return None if self.counts is None else len(self.counts)

    def to_json(self) -> dict:
        return {"layers": self.layers, "agreement": self.agreement, "explained_variance": self.explained_variance,
                "lambda": self.lam, "val_loss": self.val_loss,
                "val_agreement": self.val_agreement, "source": self.source, "hits": self.hits,
                "counts": self.counts, "agreement_ci": self.agreement_ci}

    @classmethod
    def from_json(cls, d: dict) -> "SetScore":
        return cls(list(d["layers"]), d["agreement"], d["explained_variance"], d["lambda"], d["val_loss"],
                   d.get("val_agreement"), d.get("source", "given"), d.get("hits"), d.get("counts"),
                   d.get("agreement_ci"))


@dataclass
class ProbeReport:
    capture: str
    sets: list[SetScore]
    seconds: float
    tokens: int                       # tokens of the capture
    scored: int                       # distinct layer sets fitted by this call (0 when all came from the store)
    positions: dict                   # counted positions per split: fit, validation, held_out
    conversations: dict               # conversations per split
    search: dict | None = None        # method, k, objective, candidates, passes, path [{move, layers, val_loss}]
    options: dict = field(default_factory=dict)
    cached: bool = False

    def best(self) -> SetScore:
        """The search's result (the best searched set), else the first set."""
        return next((s for s in self.sets if s.source == "search"), self.sets[0])

    def smaller_was_better(self) -> dict | None:
        """The smallest set on the search's greedy path whose validation loss is below the best k-set's
        ({move, layers, val_loss}), else None: then the k-th layer only added noise to the map at this data
        size. Loss objective only (the path records losses)."""
        r = self.search
        if not r or r.get("objective") != "loss":
            return None
        best = self.best().val_loss
        return next((m for m in r["path"] if len(m["layers"]) < r["k"] and m["val_loss"] < best), None)

    def to_json(self) -> dict:
        return {"sets": [s.to_json() for s in self.sets], "seconds": self.seconds, "tokens": self.tokens,
                "scored": self.scored, "positions": self.positions, "conversations": self.conversations,
                "search": self.search, "capture": self.capture, "options": self.options, "cached": self.cached}

    @classmethod
    def from_json(cls, d: dict) -> "ProbeReport":
        return cls(d["capture"], [SetScore.from_json(s) for s in d["sets"]], d["seconds"], d["tokens"], d["scored"],
                   d["positions"], d["conversations"], d.get("search"), d.get("options", {}), d.get("cached", False))


@dataclass
class ProbeInput:
    """What the `probe` selection strategy needs besides the statistics: select.select(..., probe=ProbeInput(...))."""
    cap: object                       # a store.CaptureReader
    target: TargetWeights
    options: ProbeOptions = field(default_factory=ProbeOptions)
    store: object | None = None       # a store.Store: cache the search

    def search(self, k: int) -> ProbeReport:
        return search(self.cap, self.target, k, self.options, store=self.store)


def agreement(pred: torch.Tensor, target_ids: torch.Tensor, lm_head: torch.Tensor) -> float:
    """Share of rows whose argmax lm_head(pred) is target_ids (the target's own choice)."""
    if pred.shape[0] == 0:
        return float("nan")
    return float((target_argmax(pred.float(), lm_head) == target_ids).double().mean())


def per_conversation(pred: torch.Tensor, target_ids: torch.Tensor, lm_head: torch.Tensor,
                     conversation: torch.Tensor) -> tuple[list[int], list[int]]:
    """(hits, counts) per conversation of the rows (in the order of their first row): how many rows' argmax
    lm_head(pred) is the target's choice, of how many rows."""
    _, first = torch.unique_consecutive(conversation, return_inverse=True)
    hit = (target_argmax(pred.float(), lm_head) == target_ids).long()
    n = int(first.max()) + 1 if len(first) else 0
    return (torch.bincount(first, weights=hit.double(), minlength=n).long().tolist(),
            torch.bincount(first, minlength=n).tolist())


def agreement_interval(hits, counts, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of Σ hits / Σ counts, resampling whole conversations (positions within one
    conversation are not independent); None with fewer than 2 conversations."""
    if counts is None or len(counts) < 2:
        return None
    idx = bootstrap.resample(len(counts), seed=seed)
    return bootstrap.interval(bootstrap.ratio_of_sums(torch.tensor(hits), torch.tensor(counts), idx))


# ----------------------------------------------------------------------------- the capture, read once

def held_out_conversations(conversations: int, val_fraction: float) -> int:
    """How many of a capture's conversations the probe holds out: the draft's own share (split_conversations'
    rounding), raised to MIN_HELD_OUT where a third of the conversations allows it. A bootstrap over fewer held-out
    conversations cannot tell two sets apart, so the default capture (16 prompts; 2 at the draft's 10%) would tie
    every set; from 15 conversations on it holds out 5, the draft's held-out conversations among them (the same
    seeded order, more of it)."""
    share = 0 if val_fraction == 0 or conversations < 2 else min(max(1, round(val_fraction * conversations)),
                                                                  conversations - 1)
    return max(share, min(MIN_HELD_OUT, conversations // 3))


def held_out_fraction(conversations: int, val_fraction: float) -> float:
    """The val_fraction that makes split_conversations hold out held_out_conversations(...) of them."""
    n = held_out_conversations(conversations, val_fraction)
    return n / conversations if conversations else val_fraction


@dataclass
class Positions:
    """Counted positions p (global token indices, ascending) of a capture, by split."""
    fit: torch.Tensor
    validation: torch.Tensor
    held_out: torch.Tensor
    conversations: dict

    def counts(self) -> dict:
        return {"fit": len(self.fit), "validation": len(self.validation), "held_out": len(self.held_out)}


def positions(cap, o: ProbeOptions) -> Positions:
    """The counted positions (draft.training.data's `split_of` rule; p − 1 in the same conversation) of each split."""
    cap.require_every_position("the probe", "Choose a strategy that reads the statistics only, or capture again "
                               "without --sample-positions")
    tok = cap.tokens()
    conv = tok["conversation"]
    n = len(conv)
    none = torch.empty(n, 0)      # split_of wants features; only its `counted` rule is used here
    counted = split_of(tok["token_id"], tok["position"], conv, tok["is_response"], none, none).counted
    prev_same = torch.zeros(n, dtype=torch.bool)
    prev_same[1:] = conv[1:] == conv[:-1]
    counted &= prev_same
    held = split_conversations(conv, held_out_fraction(int(torch.unique(conv).numel()), o.val_fraction), o.seed)
    val = torch.zeros(n, dtype=torch.bool)
    val[~held] = split_conversations(conv[~held], o.lambda_fraction, o.seed + 1)
    fit = ~held & ~val
    convs = {name: int(torch.unique(conv[m]).numel()) for name, m in
             (("fit", fit), ("validation", val), ("held_out", held))}
    out = Positions((counted & fit).nonzero().squeeze(1), (counted & val).nonzero().squeeze(1),
                    (counted & held).nonzero().squeeze(1), convs)
    for name, what in (("held_out", "held-out"), ("validation", "validation"), ("fit", "fit")):
        if len(getattr(out, name)) == 0:
            raise ProbeError(f"Capture {cap.key} has no {what} response positions ({out.conversations[name]} {what} "
                             f"conversations of {int(torch.unique(conv).numel())})",
                             "Probe a capture with more prompts and responses (e.g. --limit 64 --max-new-tokens 64)")
    return out


@dataclass
class Rows:
    """Kept rows: x [n, B·d] float32 (the candidate blocks), y [n, d] float32 (h_N), target [n] (its argmax)."""
    x: torch.Tensor
    y: torch.Tensor
    target: torch.Tensor

    def design(self, idx: Sequence[int], d: int) -> torch.Tensor:
        """[n, len(idx)·d + 1] float64: blocks idx, then the bias."""
        return with_bias(self.x[:, block_columns(idx, d)])


@dataclass
class Fit:
    """A set fitted on the fit split and judged on the validation split at its best λ of a grid."""
    layers: list[int]
    lam: float
    val_loss: float
    val_agreement: float | None


class Probe:
    """One capture read once for the candidate `layers` (0..N−1) plus the embedding: fits any set of them."""

    def __init__(self, cap, target, layers: Sequence[int], options: ProbeOptions, progress=None):
        o, w = options, weights_of(target)
        o.validate()
        check_target(cap, w)
        self.cap, self.o, self.d = cap, o, cap.hidden_size
        self.layers = layerset.check(list(layers), cap.num_layers)
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.embed_block = len(self.layers)                   # the block after the layers
        self.pos = positions(cap, o)
        check_memory(self.pos, len(self.layers) + 1, self.d, cap, o)
        self.lm_head = w.lm_head.detach().to("cpu", torch.float32)
        self.metric = logit_metric(self.lm_head)
        self.gram, self.val, self.held = self._read(w.embed.detach(), progress)
        self.held_conversation = cap.tokens()["conversation"][self.pos.held_out]   # the held-out rows' order
        self.memo: dict[tuple, Fit] = {}
        self.fits = 0

    def _read(self, embed: torch.Tensor, progress) -> tuple[Gram, Rows, Rows]:
        """One pass over the chunks: fit rows into the Gram, validation and held-out rows kept."""
        cap, d, N = self.cap, self.d, self.cap.num_layers
        token_id = cap.tokens()["token_id"]
        gram = Gram(len(self.layers) + 1, d)
        kept = {"validation": ([], []), "held_out": ([], [])}
        role = {"fit": self.pos.fit, **{k: getattr(self.pos, k) for k in kept}}
        offsets = cap.offsets.tolist()
        for c in range(len(cap.chunks)):
            lo, hi = offsets[c], offsets[c + 1]
            here = {name: p[(p >= lo) & (p < hi)] for name, p in role.items()}
            rows = torch.cat(list(here.values()))
            if len(rows):
                x = torch.cat([cap.layer(l, rows - 1) for l in self.layers]
                              + [embed[token_id[rows].to(embed.device)].to("cpu", torch.float32)], dim=1)
                y = cap.layer(N, rows)
                start = 0
                for name, p in here.items():
                    xs, ys = x[start:start + len(p)], y[start:start + len(p)]
                    start += len(p)
                    if name == "fit":
                        for i in range(0, len(p), self.o.batch_rows):
                            gram.add(xs[i:i + self.o.batch_rows], ys[i:i + self.o.batch_rows])
                    else:
                        kept[name][0].append(xs.clone())
                        kept[name][1].append(ys.clone())
                del x, y
            if progress is not None:
                progress((c + 1) / len(cap.chunks), f"probe: read chunk {c + 1}/{len(cap.chunks)}")
        out = []
        for name in kept:
            x, y = torch.cat(kept[name][0]), torch.cat(kept[name][1])
            out.append(Rows(x, y, target_argmax(y, self.lm_head)))
        return gram, out[0], out[1]

    def _idx(self, layers: Sequence[int]) -> list[int]:
        missing = [l for l in layers if l not in self.index]
        if missing:
            raise ProbeError(f"Layers {missing} were not read by this probe (it read {self.layers})",
                             "Build the probe with every layer of the sets it should score")
        return [self.index[l] for l in layers] + [self.embed_block]

    def system(self, layers: Sequence[int], refit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Normal equations (A, B) of a set on the fit split, or with `refit` on fit + validation."""
        idx = self._idx(layers)
        A, B = self.gram.system(idx)
        if refit:
            X = self.val.design(idx, self.d)
            A, B = A + X.T @ X, B + X.T @ self.val.y.to(F64)
        return A, B

    def solve(self, layers: Sequence[int], lam: float, refit: bool = False) -> torch.Tensor:
        """W [(|S|+1)·d + 1, d] float64 for a set at an absolute λ."""
        W = ridge(*self.system(layers, refit), lam)
        if W is None:
            raise ProbeError(f"The normal equations of {list(layers)} at λ={lam:g} are singular", "Use a larger λ")
        return W

    def validate(self, layers: Sequence[int], lams: Sequence[float]) -> Fit:
        """The set fitted on the fit split at each λ of `lams`; the one with the best validation objective
        (memoized)."""
        layers = sorted(layers)
        key = (tuple(layers), tuple(lams))
        if key in self.memo:
            return self.memo[key]
        idx = self._idx(layers)
        A, B = self.gram.system(idx)
        X, Y = self.val.design(idx, self.d), self.val.y.to(F64)
        best = None
        for lam in lams:
            W = ridge(A, B, lam)
            self.fits += 1
            if W is None:
                continue
            pred = X @ W
            fit = Fit(layers, float(lam), logit_loss(pred - Y, self.metric),
                      agreement(pred, self.val.target, self.lm_head) if self.o.objective == "agreement" else None)
            if best is None or self.objective(fit) < self.objective(best):
                best = fit
        if best is None:
            raise ProbeError(f"The normal equations of {layers} are singular at every λ of the grid",
                             "Use larger --lambdas values")
        self.memo[key] = best
        return best

    @property
    def scored(self) -> int:
        """Distinct layer sets fitted so far."""
        return len({layers for layers, _ in self.memo})

    def objective(self, fit: Fit) -> tuple:
        """Lower is better."""
        return (fit.val_loss,) if self.o.objective == "loss" else (-fit.val_agreement, fit.val_loss)

    def score(self, layers: Sequence[int], source: str = "given") -> SetScore:
        """λ from the grid on validation, refit on fit + validation, judged on the held-out rows."""
        fit = self.validate(layers, self.o.lambdas)
        W = self.solve(fit.layers, fit.lam, refit=True)
        pred = self.held.design(self._idx(fit.layers), self.d) @ W
        hits, counts = per_conversation(pred, self.held.target, self.lm_head, self.held_conversation)
        return SetScore(fit.layers, agreement(pred, self.held.target, self.lm_head),
                        explained_variance(pred, self.held.y.to(F64)), fit.lam, fit.val_loss, fit.val_agreement,
                        source, hits, counts, agreement_interval(hits, counts))

    def search(self, k: int, candidates: Sequence[int]) -> tuple[list[Fit], dict]:
        """Greedy forward selection, then (search="swap") one-layer swaps while the validation objective improves.
        Returns (the k-sets scored, best first by their tuned objective) and the search's record."""
        o, cand = self.o, sorted(candidates)
        check_k(k, len(cand))
        chosen, path = None, []
        for _ in range(k):
            have = chosen.layers if chosen else []
            lams = o.lambdas if chosen is None else (chosen.lam,)
            trials = [self.validate(have + [l], lams) for l in cand if l not in have]
            chosen = self.validate(min(trials, key=self.objective).layers, o.lambdas)
            path.append({"move": "add", "layers": chosen.layers, "val_loss": chosen.val_loss})
        passes = 0
        while o.search == "swap" and passes < o.max_passes:
            passes += 1
            changed = False
            for i in range(k):
                others = chosen.layers[:i] + chosen.layers[i + 1:]
                trials = [self.validate(others + [l], (chosen.lam,)) for l in cand if l not in chosen.layers]
                if not trials:
                    continue
                tuned = self.validate(min(trials, key=self.objective).layers, o.lambdas)
                if self.objective(tuned) < self.objective(chosen):
                    chosen, changed = tuned, True
                    path.append({"move": "swap", "layers": chosen.layers, "val_loss": chosen.val_loss})
            if not changed:
                break
        best_of = {}
        for (layers, _), fit in self.memo.items():
            if len(layers) == k and (layers not in best_of or self.objective(fit) < self.objective(best_of[layers])):
                best_of[layers] = fit
        ranked = sorted(best_of.values(), key=self.objective)[: o.top]
        ranked = sorted((self.validate(f.layers, o.lambdas) for f in ranked), key=self.objective)
        record = {"method": o.search, "k": k, "objective": o.objective, "candidates": cand, "passes": passes,
                  "path": path}
        return ranked, record


def weights_of(target) -> TargetWeights:
    return target if isinstance(target, TargetWeights) else TargetWeights.of(target)


def check_target(cap, w: TargetWeights) -> None:
    if cap.manifest.get("final_state", "post-norm") != "post-norm":
        raise ProbeError(f"Capture {cap.key} stores hidden_states[N] {cap.manifest.get('final_state')}",
                         "The probe needs the post-norm final state; capture again with this version")
    d = cap.hidden_size
    if w.embed.dim() != 2 or w.lm_head.dim() != 2 or w.embed.shape[1] != d or w.lm_head.shape[1] != d:
        raise ProbeError(f"Capture {cap.key} (d={d}) and the target weights (embedding {tuple(w.embed.shape)}, "
                         f"lm_head {tuple(w.lm_head.shape)}) do not fit", "Probe with the model the capture was made with")
    known = cap.manifest.get("fingerprint")
    if known is not None and w.fingerprint is not None and known != w.fingerprint:
        raise ProbeError(f"Capture {cap.key} was made with {cap.manifest.get('model')} ({known}), not the given "
                         f"target ({w.fingerprint})", "Probe with the model the capture was made with")
    top = int(cap.tokens()["token_id"].max())
    if top >= w.embed.shape[0]:
        raise ProbeError(f"Capture {cap.key} has token id {top}, beyond the target's {w.embed.shape[0]} embeddings",
                         "Probe with the model the capture was made with")


def check_k(k: int, n: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n:
        raise ProbeError(f"The probe search needs k in 1..{n} (got {k!r})", f"Ask for 1 to {n} layers, e.g. --k 3")


def check_memory(pos: Positions, blocks: int, d: int, cap, o: ProbeOptions) -> None:
    """Refuse before reading when the Gram, the kept rows and one chunk's rows would exceed max_memory_gb."""
    gram = (blocks * (blocks + 1) // 2 * d * d + blocks * d * d) * 8
    kept = (len(pos.validation) + len(pos.held_out)) * (blocks + 1) * d * 4
    chunk = max(n for _, n in cap.chunks) * (blocks + 1) * d * 4 + o.batch_rows * blocks * d * 8 * 2
    need = (gram + kept + chunk) / 2**30
    limit = memory_limit_gb(o)
    if need > limit:
        said = f"max_memory_gb={limit:g}" if o.max_memory_gb is not None else f"three quarters of the memory available now, {limit:.1f} GB"
        raise ProbeError(f"The probe over {blocks - 1} layers of capture {cap.key} would hold {need:.1f} GB (more than {said})",
                         "Probe fewer candidate layers (--candidates) or raise --max-memory-gb")


MIN_MEMORY_GB = 6.0


def memory_limit_gb(o: ProbeOptions) -> float:
    """What a probe may hold: o.max_memory_gb, else three quarters of the memory available now, at least MIN_MEMORY_GB
    (a 28-layer probe at d=1536 holds ~9.4 GB: more than a fixed 6 GB allowed on a machine with room for it). Not half:
    a study's probe runs beside its own loaded target and a busy machine's other work, and on 24 GB with the 1.5B
    loaded half the available memory (9.2 GB) refused that 9.4 GB probe, which the machine held with room to spare."""
    if o.max_memory_gb is not None:
        return o.max_memory_gb
    available = available_memory(cuda=False)
    return max(MIN_MEMORY_GB, available / 2**30 * 3 / 4) if available else MIN_MEMORY_GB


# ----------------------------------------------------------------------------- entry points

def _cache_key(cap, w: TargetWeights, what: dict) -> str:
    return make_key({"probe": FORMAT, "capture": cap.key, "target": w.fingerprint, **what})


def _report(cap, pos: Positions, sets, t0, scored, o: ProbeOptions, search_record=None, cached=False) -> ProbeReport:
    return ProbeReport(cap.key, sets, round(time.perf_counter() - t0, 3), cap.num_tokens, scored, pos.counts(),
                       pos.conversations, search_record, asdict(o), cached)


def _sets(cap, sets) -> list[list[int]]:
    """Each set checked and sorted (layerset.check); a set given twice is kept once, the first order kept."""
    out = []
    for s in sets:
        s = layerset.check(list(s), cap.num_layers)
        if s not in out:
            out.append(s)
    return out


def score_sets(cap, target, sets: Sequence[Sequence[int]], options: ProbeOptions | None = None, *, store=None,
               progress: Callable[[float, str], None] | None = None) -> ProbeReport:
    """The probe's held-out agreement and explained variance of each layer set (one pass for all of them)."""
    t0 = time.perf_counter()
    o, w = options or ProbeOptions(), weights_of(target)
    o.validate()
    sets = _sets(cap, sets)
    if not sets:
        raise ProbeError("No layer sets to probe", "Name them, e.g. --layers 2,15,27")
    pos = positions(cap, o)
    keys = [_cache_key(cap, w, {"layers": s, **o.scoring()}) for s in sets]
    found = {i: store.get_json("probe", key) for i, key in enumerate(keys)} if store is not None else {}
    todo = [s for i, s in enumerate(sets) if found.get(i) is None]
    scores, scored = {}, 0
    if todo:
        probe = Probe(cap, w, sorted({l for s in todo for l in s}), o, progress)
        for s in todo:
            scores[tuple(s)] = probe.score(s)
            if store is not None:
                store.put_json("probe", keys[sets.index(s)], scores[tuple(s)].to_json())
        scored = probe.scored
    out = [scores.get(tuple(s)) or SetScore.from_json(found[i]) for i, s in enumerate(sets)]
    return _report(cap, pos, out, t0, scored, o, cached=not todo)


def search(cap, target, k: int = 3, options: ProbeOptions | None = None, *, sets: Sequence[Sequence[int]] = (),
           store=None, progress: Callable[[float, str], None] | None = None) -> ProbeReport:
    """Search the candidate layers for the k-set with the best validation objective (greedy, then swaps);
    the report holds `sets` (scored too, first) and the search's `top` sets, best first."""
    t0 = time.perf_counter()
    o, w = options or ProbeOptions(), weights_of(target)
    o.validate()
    given = _sets(cap, sets)
    candidates = layerset.check(list(o.candidates), cap.num_layers, "--candidates") if o.candidates is not None \
        else list(range(cap.num_layers))
    check_k(k, len(candidates))
    key = _cache_key(cap, w, {"search": asdict(o), "k": k, "sets": given})
    cached = store.get_json("probe", key) if store is not None else None
    if cached is not None:
        return ProbeReport.from_json({**cached, "cached": True})
    probe = Probe(cap, w, sorted(set(candidates) | {l for s in given for l in s}), o, progress)
    out = [probe.score(s) for s in given]
    ranked, record = probe.search(k, candidates)
    out += [probe.score(f.layers, "search") for f in ranked]
    record["fits"] = probe.fits
    report = _report(cap, probe.pos, out, t0, probe.scored, o, record)
    if store is not None:
        store.put_json("probe", key, report.to_json())
    return report
