"""The two ends of a target, without its decoder layers: the embedding output and the final norm + lm_head.

An engine's hidden-state dump (capture/engine_dumps.py) holds the states of the layers it was asked for, and
LayerScope derives the rest from the target's own modules, loaded alone:

    layer 0       the embedding output, hidden_states[0]: the family's own forward up to the first decoder layer
                  (scaled embeddings, absolute positions where a family has them), stopped there by a hook
    layer N       final_norm(pre-norm last state): the family's final norm module
    entropy       predictive entropy (nats) of softmax(transform(lm_head(layer N))) (head.head_transform)

`TargetEnds.load(spec, store)` builds the family's causal LM with one decoder layer (it never runs: the
forward stops before it) and loads only the embedding, final norm and head tensors from the model's safetensors
(weights.model_weights). Memory: those tensors, not the model. A tiny random model is built whole (it is tiny).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open

from layerscope.errors import CaptureError
from layerscope.target.head import head_transform, predictive_entropy
from layerscope.target.weights import ModelWeights, model_weights

WINDOW = 8192          # tokens per embedding forward (bounds the masks a family builds before its first layer)


class _Stop(Exception):
    """Raised by the hook on the first decoder layer: everything needed has been computed."""


class TargetEnds:
    """embedding(ids [L]) -> [L, d]; final(prenorm [L, d]) -> [L, d]; entropy(final [L, d]) -> [L] float32."""

    def __init__(self, weights: ModelWeights, model: torch.nn.Module):
        self.weights, self.model = weights, model
        self.config = model.config
        self.num_layers = int(weights.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.scale, self.softcap = head_transform(self.config)
        self.norm = getattr(model.model, "norm", None)
        if self.norm is None:
            raise CaptureError(f"{weights.spec}'s model has no final norm at model.norm",
                               "Import supports the decoder families LayerScope captures (Llama-like model.norm)")

    @classmethod
    def load(cls, spec: str, store=None) -> "TargetEnds":
        weights = model_weights(spec, store)
        if weights.loaded is not None:
            return cls(weights, weights.loaded.model.float().eval())
        return cls(weights, _one_layer_model(weights))

    @torch.no_grad()
    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """hidden_states[0] of token ids [L]: [L, d] float32, `WINDOW` tokens per forward."""
        got = {}

        def grab(_module, args, kwargs):
            got["h"] = args[0] if args else kwargs["hidden_states"]
            raise _Stop

        hook = self.model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
        out = []
        try:
            for start in range(0, ids.numel(), WINDOW):
                part = ids[start:start + WINDOW].long()
                try:
                    self.model.model(input_ids=part[None], position_ids=torch.arange(start, start + part.numel())[None],
                                     use_cache=False)
                except _Stop:
                    pass
                out.append(got.pop("h")[0].float())
        finally:
            hook.remove()
        return torch.cat(out) if out else torch.zeros(0, self.hidden_size)

    @torch.no_grad()
    def final(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The final norm of pre-norm last states [L, d] -> [L, d] float32."""
        return self.norm(prenorm.float()).float()

    @torch.no_grad()
    def entropy(self, final: torch.Tensor) -> torch.Tensor:
        """Predictive entropy (nats) of the next token from post-norm final states [L, d] -> [L] float32."""
        return predictive_entropy(self.model.get_output_embeddings(), final.float(), self.scale, self.softcap).float()


def _one_layer_model(weights: ModelWeights) -> torch.nn.Module:
    """The family's causal LM with one (never run) decoder layer, float32, its other parameters read from the
    weight files: the embedding, the final norm, the head (tied to the embedding where the config says so)."""
    from transformers import AutoModelForCausalLM  # heavy: target/load.py's docstring

    config = copy.deepcopy(weights.config)
    n = int(config.num_hidden_layers)
    for name, value in list(vars(config).items()):      # per-layer lists (layer_types, ...) cut to the one layer
        if isinstance(value, list) and len(value) == n and n > 1:
            setattr(config, name, value[:1])
    config.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    wanted = {k for k, _ in model.named_parameters() if ".layers." not in k}
    found = _read_tensors(Path(weights.directory), wanted)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = sorted(wanted - set(found) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise CaptureError(f"{weights.spec}'s weight files lack {', '.join(missing[:4])}",
                           "Import needs the target's embedding, final norm and lm_head as transformers names them")
    for k, v in found.items():
        target = model.get_parameter(k)
        if tuple(v.shape) != tuple(target.shape):
            raise CaptureError(f"{weights.spec}'s tensor {k} is {list(v.shape)}, its config implies "
                               f"{list(target.shape)}", "Check that the directory's config.json matches its weights")
        target.data.copy_(v.float())
    if tied:
        model.tie_weights()
    return model


def _read_tensors(directory: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` from the safetensors files of a model directory (its index's weight map, or every
    *.safetensors file), each file opened once."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name in weight_map:
                by_file.setdefault(weight_map[name], []).append(name)
    else:
        by_file = {p.name: sorted(names) for p in sorted(directory.glob("*.safetensors"))}
    if not by_file:
        raise CaptureError(f"{directory} holds no safetensors weights", "Import reads the target's weights from "
                           "safetensors files (a .bin-only model: save it with save_pretrained first)")
    out = {}
    for file, wanted in by_file.items():
        with safe_open(str(directory / file), framework="pt") as f:
            have = set(f.keys())
            for name in wanted:
                if name in have and name not in out:
                    out[name] = f.get_tensor(name)
    return out
