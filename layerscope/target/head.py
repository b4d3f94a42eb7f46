"""How a causal LM's logits come from its final hidden state: z = lm_head(final), then the family's transform.

    softcap * tanh(scale * z / softcap)      (softcap None: scale * z)

The transform is monotone, so the argmax is z's; but probabilities (a capture's token entropy, a draft's teacher)
must take it. Read from the text config (composite configs hold it there); every module that turns a target's final
state into logits applies it from here: capture/run.py (token entropy: predictive_entropy), draft/training/loss.py (the teacher),
decoding/specdec.py (which heads must be read at every tree row).
"""

from __future__ import annotations

import torch

from layerscope.errors import DraftError

HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
LOGITS_SCALING_MULTIPLIES = frozenset({"hyperclovax"})   # modeling_hyperclovax.py: logits * logits_scaling


def head_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) of a causal LM's head: its logits are softcap * tanh(scale * z / softcap) (softcap None:
    scale * z), z = lm_head(final hidden state). From the text config (composite configs hold it there):
      final_logit_softcapping  Gemma 2 (30.0), Gemma 3 (null): modeling_gemma2.py, applied last
      logit_scale              Cohere, Cohere2: modeling_cohere2.py logits * logit_scale
      logits_scaling           Granite, MiniCPM3: divided (modeling_granite.py; MiniCPM3 divides the hidden state);
                               HyperCLOVA X multiplies
      output_multiplier        MuseSpark, MuseGlimmer: multiplied before the soft cap"""
    text = config.get_text_config(decoder=True)
    values = {name: getattr(text, name, None) for name in HEAD_TRANSFORMS}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise DraftError(f"The target's {name} is {value!r}, not a positive number",
                             "Draft training reads the target's logit transform from its config; fix the config")
    scale = float(values["logit_scale"] or 1.0) * float(values["output_multiplier"] or 1.0)
    if values["logits_scaling"] is not None:
        by = float(values["logits_scaling"])
        scale = scale * by if getattr(text, "model_type", None) in LOGITS_SCALING_MULTIPLIES else scale / by
    cap = values["final_logit_softcapping"]
    return scale, None if cap is None else float(cap)


def apply_head_transform(z: torch.Tensor, scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """z [..., V] (lm_head's output) -> the model's logits [..., V] (scale, softcap: head_transform)."""
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def predictive_entropy(lm_head, final: torch.Tensor, scale: float = 1.0, softcap: float | None = None,
                       block: int = 1024) -> torch.Tensor:
    """Entropy (nats) of the model's next-token distribution per row, [n, d] -> [n] float32: softmax of lm_head(final)
    through the family's transform (scale, softcap: head_transform); logits made `block` rows at a time."""
    out = []
    for i in range(0, final.shape[0], block):
        logp = torch.log_softmax(apply_head_transform(lm_head(final[i: i + block]).float(), scale, softcap), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1).cpu())
    return torch.cat(out) if out else torch.zeros(0)
