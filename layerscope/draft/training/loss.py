"""The draft's training loss (EAGLE-3's training-time test) and its held-out evaluation.

For TTT step j (0-based) at a counted position p, with the target's logits on the draft vocabulary
z = Teacher.logits(hidden_states[N][p]) (its lm_head restricted to V, then its own logit transform: what its
forward returns), p_t = softmax(z), q = softmax(draft logits):
    kl_j      = mean over counted p of  sum_v p_t(v) (log p_t(v) - log q(v))     (0 = the draft matches)
    feature_j = mean over counted p of  smooth_l1(norm_draft(a_j), hidden_states[N][p])   (EAGLE-1's
                regression toward the feature the target's lm_head reads; weight `feature_weight`, 0 = off)
    loss      = sum_j 0.8^j (kl_j + feature_weight * feature_j)
Cross-entropy against p_t minus p_t's own entropy has the same gradient as cross-entropy, and reads as a KL.
Optional Gaussian noise of std `noise_std` on the auxiliary hidden states (training only, as speculators does).

The held-out evaluation (`evaluate`) gives the agreement per TTT step; `simulated_acc_len` sums its running
products, SpecForge's eval/simulated_acc_len (the number its evaluator picks checkpoints by).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layerscope.draft.model import DraftHead
from layerscope.draft.training.data import Split, make_batch
from layerscope.target.head import apply_head_transform, head_transform

LOSS_DECAY = 0.8


@dataclass
class Teacher:
    """The target's logits on the draft vocabulary from its final state, as the target's own forward computes
    them: softcap * tanh(scale * z / softcap) (softcap None: scale * z), z = final @ rows.T (head.head_transform:
    Gemma 2's final_logit_softcapping, Cohere's logit_scale, ...). `final` is hidden_states[N], already through
    the target's own final norm (Gemma's 1 + w, Cohere's LayerNorm), so these are the logits the verifier decides
    from. The transform is monotone: the target's argmax is that of z alone (data.target_argmax)."""
    rows: torch.Tensor                # [V, d] float32: the target's lm_head rows of the draft vocabulary
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, target_config, lm_head: torch.Tensor, d2t: torch.Tensor, device) -> "Teacher":
        """lm_head [vocab, d] of the target, d2t [V] of the draft vocabulary."""
        rows = lm_head.detach()[(d2t + torch.arange(len(d2t))).to(lm_head.device)].float().to(device)
        scale, softcap = head_transform(target_config)
        return cls(rows, scale, softcap)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """final [M, d] -> the target's logits [M, V] float32."""
        return apply_head_transform(final.float() @ self.rows.T, self.scale, self.softcap)


def ttt_loss(head: DraftHead, batch: dict, teacher: Teacher, denom: list[int] | None = None, *,
             feature_weight: float = 0.0, noise_std: float = 0.0):
    """Weighted TTT loss, and per step (correct, counted) top-1 agreement with the target's argmax on V.

    teacher: the target's logits on the draft vocabulary. denom[j]: divide step j's summed
    loss by this count instead of the batch's own (the global count when the batch is one rank's share of a
    larger one, so that summed gradients equal the one-process ones)."""
    aux = batch["aux"]
    if noise_std > 0:
        aux = aux + noise_std * torch.randn_like(aux)
    outs = head.unroll(batch["input_ids"], head.fuse(aux), batch["position_ids"], with_logits=False)
    loss = torch.zeros((), device=teacher.rows.device)
    stats = []
    for j, ((_, h), mask, final) in enumerate(zip(outs, batch["masks"], batch["targets"])):
        if final.shape[0] == 0:
            stats.append((0, 0))
            continue
        normed = head.norm(h[mask])
        logq = F.log_softmax(head.lm_head(normed).float(), dim=-1)
        with torch.no_grad(), torch.autocast(final.device.type, enabled=False):     # float32 under a bf16 autocast
            target = teacher.logits(final)                                 # [M, V] target logits on the draft vocab
            logp = F.log_softmax(target, dim=-1)
        per_row = (logp.exp() * (logp - logq)).sum(-1)
        if feature_weight > 0:
            per_row = per_row + feature_weight * F.smooth_l1_loss(normed.float(), final, reduction="none").mean(-1)
        loss = loss + LOSS_DECAY ** j * (per_row.mean() if denom is None else per_row.sum() / max(denom[j], 1))
        stats.append((int((logq.argmax(-1) == target.argmax(-1)).sum()), int(mask.sum())))
    return loss, stats


@torch.no_grad()
def evaluate(head: DraftHead, split: Split, windows, J, teacher: Teacher, batch_size, device):
    """Validation over every position of `split` whose next token is a response token (split.counted).

    Returns (agreement per TTT step, mean weighted KL, positions counted at step 1, coverage): agreement is
    draft argmax == target argmax (split.target_next, whole vocabulary), so an argmax outside the draft
    vocabulary is a miss; coverage is the share of step-1 positions whose target argmax the draft vocabulary holds."""
    assert split.target_next is not None, "evaluate needs split.target_next (target_argmax)"
    was_training = head.training
    head.eval()
    correct, total, loss_sum, n, covered = [0] * J, [0] * J, 0.0, 0, 0
    for i in range(0, len(windows), batch_size):
        batch = make_batch(split, windows[i: i + batch_size], J, split.counted, device)
        outs = head.unroll(batch["input_ids"], head.fuse(batch["aux"]), batch["position_ids"], with_logits=False)
        loss = torch.zeros((), device=device)
        for j, ((_, h), mask, final, want) in enumerate(zip(outs, batch["masks"], batch["targets"], batch["argmax"])):
            if final.shape[0] == 0:
                continue
            logq = F.log_softmax(head.logits(h[mask]).float(), dim=-1)
            logp = F.log_softmax(teacher.logits(final), dim=-1)
            loss = loss + LOSS_DECAY ** j * (logp.exp() * (logp - logq)).sum(-1).mean()
            correct[j] += int((head.to_target_ids(logq.argmax(-1)) == want).sum())
            total[j] += int(mask.sum())
            if j == 0:
                covered += int(head.t2d[want].sum())
        loss_sum, n = loss_sum + float(loss), n + 1
    head.train(was_training)
    acc = [c / t if t else 0.0 for c, t in zip(correct, total)]
    return acc, (loss_sum / n if n else None), total[0], (covered / total[0] if total[0] else 0.0)


def simulated_acc_len(agreement: Sequence[float]) -> float:
    """SpecForge's simulated acceptance length: sum over k of prod_{j<=k} acc_j, over the TTT steps given.

    acc_j is `evaluate`'s agreement at TTT step j: the share of every counted held-out position whose draft
    argmax at step j equals the target's greedy token, with steps 1..j-1 fed the true tokens (teacher-forced,
    the draft's own hidden states). It is unconditional: a position counts at step j whether or not steps < j
    agreed there. A chain of depth K accepts on average sum_k P(steps 1..k agree) = sum_k prod_{j<=k}
    P(acc_j | steps < j agreed) draft tokens per verification (where they agreed, decoding fed the draft exactly
    the tokens training did); this replaces each conditional share by the unconditional acc_j, so it is an
    estimate, below the chain's own when agreements go together (the usual case).

    Draft tokens only: it does NOT count the bonus token the target adds at every verification, so it is
    not τ (tokens per target forward, bonus included): τ ≈ 1 + simulated_acc_len for a chain of depth
    len(agreement). [0.5, 0.5, 0.5] -> 0.5 + 0.25 + 0.125 = 0.875; [] -> 0.0."""
    total, running = 0.0, 1.0
    for a in agreement:
        running *= float(a)
        total += running
    return total
