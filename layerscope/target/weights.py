"""The target's weights without running it: where they lie (`model_weights`: a safetensors directory and the
fingerprint `load_model` gives, without building the model) and the matrices a draft or the probe reads from a
loaded target (`target_weights`: its config, input embedding and lm_head; `TargetWeights`: the probe's two, with
the fingerprint).

transformers is imported inside the functions that use it (target/load.py's docstring says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from layerscope.errors import ModelSpecError
from layerscope.target.aliases import ALIASES, DEFAULT_MODEL, alias_gguf
from layerscope.target.config import _read_config, _short, check_config
from layerscope.target.files import _cached_file_hash, _model_cache_dir, _store_root
from layerscope.target.load import LoadedModel, _fingerprint_pretrained, load_model


@dataclass
class ModelWeights:
    """Where a model's weights lie, without building the model: a safetensors directory (an alias or GGUF file:
    its de-quantized copy in the store; a directory; a hub id: its local cache) and the model's fingerprint, the
    one `load_model` gives it. A tiny random model has no directory: `loaded` holds it (building it is cheap)."""
    spec: str
    fingerprint: str
    config: object
    directory: Path | None
    loaded: LoadedModel | None = None


def model_weights(spec: str = DEFAULT_MODEL, store=None) -> ModelWeights:
    """The ModelWeights of `spec` (the specs `load_model` takes). An alias or GGUF file not yet de-quantized is
    loaded once to write its copy (a GGUF file holds quantized blocks no tensor can be read from alone)."""
    from transformers import AutoConfig  # heavy: see the module docstring

    spec = (spec or "").strip()
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        loaded = load_model(spec, store)
        return ModelWeights(spec, loaded.fingerprint, loaded.model.config, None, loaded)
    if spec in ALIASES or spec.endswith(".gguf"):
        path = alias_gguf(spec, store) if spec in ALIASES else Path(spec).expanduser()
        if not path.is_file():
            raise ModelSpecError(f"GGUF file {spec} does not exist", "Check the path, or use 'smollm2-135m'")
        fingerprint = "gguf-" + _cached_file_hash(path, _store_root(store))
        directory = _model_cache_dir(store, fingerprint)
        if not (directory / "model.safetensors").is_file():
            load_model(spec, store)
        return ModelWeights(spec, fingerprint, AutoConfig.from_pretrained(str(directory)), directory)
    path = Path(spec).expanduser()
    if path.is_dir():
        config, _ = _read_config(str(path), True)
        check_config(config, str(path), torch.float32.itemsize)
        return ModelWeights(spec, _fingerprint_pretrained(str(path), config), config, path)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download  # only for hub ids
        try:
            directory = Path(snapshot_download(spec, local_files_only=True))
        except Exception as e:  # huggingface_hub raises several kinds for an id not in the cache
            raise ModelSpecError(f"Model {spec!r} is not in the local Hugging Face cache ({_short(e)})",
                                 "Download it first (huggingface-cli download), or give its directory") from e
        config, _ = _read_config(spec, True)
        check_config(config, spec, torch.float32.itemsize)
        return ModelWeights(spec, _fingerprint_pretrained(spec, config), config, directory)
    load_model(spec, store)        # every other spec: load_model's one-line refusal
    raise ModelSpecError(f"Unknown model spec {spec!r}", "Use an alias, a directory, a .gguf file or a hub id")


def target_weights(loaded):
    """(config, input embedding [vocab, d], lm_head weight [vocab, d]) of a LoadedModel."""
    return loaded.model.config, loaded.model.get_input_embeddings().weight, loaded.model.get_output_embeddings().weight


@dataclass
class TargetWeights:
    """The two target matrices the probe needs besides the capture."""
    embed: torch.Tensor               # [vocab, d] input embedding
    lm_head: torch.Tensor             # [vocab, d]
    fingerprint: str | None = None    # the model's; checked against the capture's when both are known

    @classmethod
    def of(cls, loaded) -> "TargetWeights":
        """From a LoadedModel."""
        _, embed, lm_head = target_weights(loaded)
        return cls(embed.detach(), lm_head.detach(), loaded.fingerprint)
