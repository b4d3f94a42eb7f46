"""Train a draft head from a stored capture: the capture is the data source of the one loop (draft/training/fit.py).

The target is not run again: the capture holds hidden_states[l] for every token, and layer N (post-norm)
gives the target's next-token distribution, softmax(lm_head(h_N[p])). A seeded choice of conversations
(val_fraction) is held out; the rest are cut into windows (data.windows_of) and batches of windows, a
seeded reshuffle per epoch (data.epoch_windows). Batches depend only on the capture, the budget and the
seed, never on the layer set, so two layer sets trained with the same options see exactly the same data in
the same order. Validation (loss.evaluate) counts EVERY held-out position whose next token is a response
token: an argmax outside the draft vocabulary is a miss, so step-1 agreement estimates decoding acceptance
at the first draft position.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from layerscope.capture.format import state_dtype
from layerscope.draft import init_from
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.model import build_draft_vocab
from layerscope.draft.training.data import (
    Split,
    batch_plan,
    epoch_windows,
    make_batch,
    split_conversations,
    split_of,
    target_argmax,
    trainable,
    windows_of,
)
from layerscope.draft.training.fit import EpochSource, TrainOptions, build_drafters, draft_meta, final_norm, fit
from layerscope.draft.training.loss import evaluate
from layerscope.draft.training.progress import TrainProgress
from layerscope.errors import DraftError
from layerscope.store import make_key
from layerscope.target.weights import target_weights


@dataclass
class TrainReport:
    layers: list[int]
    steps: int
    tokens_seen: int                  # sequence rows processed over all steps
    train_tokens: int                 # tokens of the training conversations
    train_conversations: int
    val_tokens: int
    val_conversations: int
    val_positions: int                # counted positions of the held-out conversations
    val_accuracy: list[float]         # per TTT step
    val_loss: float | None
    coverage: float                   # share of generated next tokens inside the draft vocabulary (training)
    loss_first: float
    loss_last: float
    loss_curve: list[list[float]]     # [step, loss] samples
    seconds: float
    tokens_per_s: float
    draft_vocab_size: int
    options: dict = field(default_factory=dict)
    val_coverage: float | None = None  # share of held-out positions whose target argmax is in the draft vocabulary
    curve: list = field(default_factory=list)   # [[tokens seen, [held-out agreement per TTT step]], ...]
    meta: dict = field(default_factory=dict)    # layerscope.json (fit.draft_meta), without the store key


# ----------------------------------------------------------------------------- the capture as a source

def load_splits(cap, held_out: torch.Tensor, layers: list[int]) -> tuple[Split, Split]:
    """(train, val) splits with their features preloaded as float16 (bfloat16 when a layer would overflow float16:
    capture.format.state_dtype, then every layer, so the features concatenate); each layer is read once."""
    index = {"train": (~held_out).nonzero().squeeze(1), "val": held_out.nonzero().squeeze(1)}
    feats = {name: [] for name in index}
    dtype = torch.float16
    for l in layers + [cap.num_layers]:
        full = cap.layer(l)
        if state_dtype(full) == torch.bfloat16 and dtype != torch.bfloat16:
            dtype = torch.bfloat16
            feats = {name: [f.to(dtype) for f in fs] for name, fs in feats.items()}
        for name, idx in index.items():
            feats[name].append(full[idx].to(dtype))
        del full
    tok = cap.tokens()
    return tuple(split_of(tok["token_id"][index[name]], tok["position"][index[name]], tok["conversation"][index[name]],
                          tok["is_response"][index[name]], torch.cat(feats[name][:-1], dim=1), feats[name][-1])
                 for name in ("train", "val"))


class CaptureSource(EpochSource):
    """Batches of windows of the capture's training split, a seeded reshuffle per epoch (fit.Source)."""

    def __init__(self, split: Split, ok: torch.Tensor, windows: list, o: TrainOptions, device):
        super().__init__()
        self.split, self.ok, self.windows, self.o, self.device = split, ok, windows, o, device

    def epoch(self, e: int) -> list:
        return epoch_windows(self.windows, self.o.batch_size, self.o.seed, e)

    def batches(self, wins):
        return [make_batch(self.split, wins, self.o.ttt_steps, self.ok, self.device)], sum(w for _, w in wins)


def train_draft(cap, layers, target_config, target_embed: torch.Tensor, target_lm_head: torch.Tensor, *,
                final_norm_weight: torch.Tensor | None = None, options: TrainOptions | None = None,
                progress: Callable[[TrainProgress], None] | None = None, should_stop: Callable[[], bool] | None = None,
                device=None, target=None, strategy: str | None = None, **fields) -> tuple:
    """Train a draft reading `layers` of the capture's target (options: a TrainOptions, or its fields).
    progress gets a TrainProgress (draft/training/progress.py: one set; steps = the planned steps, or None for a time
    budget) after every step. `target` (a LoadedModel), when given, names the target in the report's metadata."""
    o = options if options is not None else TrainOptions(**fields)
    o.validate()
    t0 = time.perf_counter()
    layers = sorted(int(l) for l in layers)
    if cap.manifest.get("final_state", "post-norm") != "post-norm":
        raise DraftError(f"Capture {cap.key} stores hidden_states[N] {cap.manifest.get('final_state')}",
                         "Training needs the post-norm final state; capture again with this version")
    vocab = int(target_embed.shape[0])
    if cap.hidden_size != target_config.hidden_size or tuple(target_lm_head.shape) != (vocab, cap.hidden_size):
        raise DraftError(f"Capture {cap.key} (d={cap.hidden_size}) and the given target weights "
                         f"(embedding {tuple(target_embed.shape)}, lm_head {tuple(target_lm_head.shape)}) do not fit",
                         "Train with the model the capture was made with")
    device = torch.device(device) if device is not None else target_embed.device
    J = o.ttt_steps

    cap.require_every_position("training a draft", "Train online, or capture again without --sample-positions")
    held_out = split_conversations(cap.tokens()["conversation"], o.val_fraction, o.seed)
    train, val = load_splits(cap, held_out, layers)
    val.target_next = target_argmax(val.final, target_lm_head)
    start = init_from.starting_point(o.init_from, [layers], target, o.draft_vocab, o.fc_norm, o.draft_intermediate)
    d2t, t2d = (start.d2t, start.t2d) if start else build_draft_vocab(train.token_id[train.is_response], o.draft_vocab, vocab)
    train_ok = trainable(train, t2d)
    coverage = float(train_ok.sum()) / max(1, int(train.counted.sum()))
    train_windows = windows_of(train, o.seq_len, train_ok, J)
    val_windows = windows_of(val, o.seq_len, val.counted, J)
    if not train_windows:
        raise DraftError(f"Capture {cap.key} has no response tokens to train on in its training conversations",
                         "Capture with responses (--max-new-tokens > 0) and more prompts")
    planned = (o.steps if o.steps is not None else
               len(batch_plan(train_windows, o.batch_size, o.seed, tokens=o.tokens)) if o.tokens is not None else None)

    drafters = build_drafters(target_config, target_embed, target_lm_head, final_norm_weight, [layers], d2t, t2d, o, device,
                              start=start.heads if start else None)
    head = drafters[0].head
    curve, losses = [], []

    def on_step(p):
        if not isinstance(p, TrainProgress):
            return                          # the held-out evaluations are not reported
        loss = p.mean_loss                  # the one set's loss (nan in the warm start)
        losses.append(loss)
        every = max(1, (planned or 100) // 100)
        if (p.step - 1) % every == 0 or p.fraction >= 1.0:
            curve.append([p.step, round(loss, 5)])
        if progress is not None:
            progress(p)

    def run_eval():
        return [evaluate(head, val, val_windows, J, drafters[0].teacher, o.batch_size, device)]

    state = fit(drafters, CaptureSource(train, train_ok, train_windows, o, device), o, evaluate=run_eval,
                progress=on_step, should_stop=should_stop, planned_steps=planned, device=device)
    head.eval()
    val_acc, val_loss, val_positions, val_coverage = state.last_eval[0]
    data = {"capture_key": cap.key, "train_tokens": len(train.token_id), "coverage": round(coverage, 5)}
    label = init_from.strategy_label(strategy, start, 0)
    meta = (draft_meta(layers, o, state, 0, target=target, strategy=label, data=data, vocab_size=len(d2t),
                       started=start.summary(0) if start else None)
            if target is not None else {})
    finite = [l for l in losses if l == l]
    report = TrainReport(
        layers=layers, steps=state.step, tokens_seen=state.tokens, train_tokens=len(train.token_id),
        train_conversations=train.conversations, val_tokens=len(val.token_id), val_conversations=val.conversations,
        val_positions=val_positions, val_accuracy=[round(a, 5) for a in val_acc], val_loss=val_loss,
        coverage=round(coverage, 5), loss_first=finite[0] if finite else float("nan"),
        loss_last=finite[-1] if finite else float("nan"), loss_curve=curve,
        seconds=round(time.perf_counter() - t0, 3), tokens_per_s=round(state.tokens / max(state.elapsed, 1e-9), 1),
        draft_vocab_size=len(d2t), options=asdict(o), val_coverage=round(val_coverage, 5),
        curve=[[c[0], c[1]] for c in state.curves[0]], meta=meta)
    return head, report


def draft_for(cap, layers, target, store, *, strategy: str | None = None, progress=None, should_stop=None,
              options: TrainOptions | None = None, **fields):
    """The directory of a draft for (capture, layers, options): trained once, then served from the store
    under drafts/<key>, the key covering capture, target, layers and every training option (seed included)."""
    if cap.manifest.get("fingerprint") not in (None, target.fingerprint):
        raise DraftError(f"Capture {cap.key} was made with {cap.manifest.get('model')} ({cap.manifest.get('fingerprint')}), "
                         f"not with {target.spec} ({target.fingerprint})", "Load the model the capture was made with")
    o = options if options is not None else TrainOptions(**fields)
    o.validate()
    layers = sorted(int(l) for l in layers)
    key = make_key({"capture": cap.key, "target": target.fingerprint, "layers": layers, "options": o.key_fields(),
                    "format": TRAIN_KEY_FORMAT, **init_from.key_part(o.init_from)})
    path = store.path("drafts", key)
    if (path / "layerscope.json").is_file() and (path / "model.safetensors").is_file():
        store.touch("drafts", key)
        return path
    head, report = train_capture_draft(cap, layers, target, options=o, strategy=strategy, progress=progress,
                                       should_stop=should_stop)
    save_draft(path, head, {**report.meta, "key": key}, target=target)
    store.touch("drafts", key)
    return path


TRAIN_KEY_FORMAT = 3                  # part of a capture draft's store key: 3 = trained by the one loop (fit.py)


def train_capture_draft(cap, layers, target, *, options: TrainOptions, strategy: str | None = None, progress=None,
                        should_stop=None):
    """train_draft with the weights of a LoadedModel `target` (its final norm included) and its metadata."""
    config, embed, lm_head = target_weights(target)
    return train_draft(cap, layers, config, embed, lm_head, final_norm_weight=final_norm(target.model), options=options,
                       progress=progress, should_stop=should_stop, target=target, strategy=strategy)
