"""A target's config, read and checked before anything is built: `_read_config` (a directory or a hub id: the local
cache first, the hub briefly after), `check_config` (the one check: a causal LM, whole sizes, head counts that fit,
parameters that fit in memory), `param_count` (the parameters a config implies), `check_memory` and
`available_memory` (the one memory check before something large is built, a model or a draft).

transformers is imported inside the functions that use it (target/load.py's docstring says why).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from layerscope.errors import LayerScopeError, ModelSpecError
from layerscope.validate import check_number


def _read_config(source: str, local_only: bool):
    """(the config of a model directory or hub id, whether it was found locally). One that transformers finds but
    refuses (its validation of the fields: a hidden size its heads do not divide, ...; a directory's config.json
    of an unknown model type) is one line naming why, never a download attempt; a hub id not in the local cache
    is tried on the hub (_download_config)."""
    from transformers import AutoConfig  # heavy: target/load.py's docstring

    try:
        return AutoConfig.from_pretrained(source, local_files_only=True), True
    except Exception as e:
        # found and refused: transformers' validation of its fields, or a ValueError about a config.json that is there
        if isinstance(e, StrictDataclassError) or (isinstance(e, ValueError) and (Path(source) / "config.json").is_file()):
            raise ModelSpecError(f"The config of {source} is invalid: {_one_line(e)}",
                                 "Correct its config.json, or use another model") from e
        if local_only:
            raise ModelSpecError(f"{source} is not a loadable model directory ({_short(e)})",
                                 "It needs config.json and weights (safetensors) as save_pretrained writes them") from e
        return _download_config(source, e), False


def _download_config(model_id: str, local_error: Exception):
    """Try the hub briefly; no network gives a clear error, not a hang."""
    from transformers import AutoConfig  # heavy: target/load.py's docstring

    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            # huggingface_hub reads this once at import; a later setting must still mean "do not try"
            raise OSError("HF_HUB_OFFLINE is set")
        return AutoConfig.from_pretrained(model_id)
    except Exception as e:
        raise ModelSpecError(
            f"Model {model_id!r} is not in the local Hugging Face cache and could not be downloaded ({_short(e)})",
            "Download it on a machine with network access (huggingface-cli download) and copy the cache, "
            "or give a local directory or .gguf file") from e

# ----------------------------------------------------------------------------- the one check of a config

MEMORY_SHARE = 0.9          # of the available memory a model may take
# Beyond its parameters each decoder layer costs its module objects (~35-50 KiB measured for a Llama layer in
# transformers 5) and milliseconds to build: 10^5 small layers fit the parameter estimate, then take minutes
# and gigabytes to build. The deepest real decoders have ~130 layers.
LAYER_OVERHEAD = 64 * 2**10
MAX_LAYERS = 1024


def check_config(config, source: str, bytes_per_param: int) -> None:
    """The one check of a model's config before the model is built (a directory, a hub id, a GGUF file's
    metadata): a causal language model, sizes that are whole numbers >= 1, head counts that fit together (key/value
    heads dividing the attention heads; as many as the attention heads for DeepSeek's latent attention; the
    hidden size a multiple of the heads where the config sets no head_dim), and parameters (`param_count`) that
    fit in the available memory. Each problem is one ModelSpecError naming it and the fix, never a traceback
    from inside the model. (Layer kinds a step cannot run, chunked or linear attention, are refused by the step
    that needs them: decoding.specdec.attention_layout, before anything is decoded; a capture runs them.)"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: module docstring

    model_type = getattr(config, "model_type", None)
    fix = f"Correct the config of {source}, or use another model"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSpecError(f"{source} is a {model_type!r} model, which transformers has no causal language model for",
                             "Use a decoder-only (causal) language model")
    text = config.get_text_config(decoder=True)
    for name in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if _size(text, name) < 1:
            raise ModelSpecError(f"The config of {source} gives {name} = {getattr(text, name, None)!r}; it must be a whole number >= 1",
                                 fix)
    d, heads, kv = _size(text, "hidden_size"), getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if heads is not None:           # attention-free models (state-space layers) have none
        if _size(text, "num_attention_heads") < 1:
            raise ModelSpecError(f"The config of {source} gives num_attention_heads = {heads!r}; it must be a whole number >= 1", fix)
        if kv is not None and _size(text, "num_key_value_heads") < 1:
            raise ModelSpecError(f"The config of {source} gives num_key_value_heads = {kv!r}; it must be a whole number >= 1", fix)
        if kv is not None and heads % kv:
            raise ModelSpecError(f"The config of {source} gives num_key_value_heads = {kv!r}, which does not divide "
                                 f"num_attention_heads = {heads} (each key/value head serves a whole group of query heads)", fix)
        if _size(text, "kv_lora_rank") and kv is not None and kv != heads:
            raise ModelSpecError(f"The config of {source} gives num_key_value_heads = {kv} for {heads} attention heads, but "
                                 f"{model_type}'s latent attention (kv_lora_rank) makes one key/value head per attention head",
                                 f"Set num_key_value_heads to {heads} in the config of {source}, or use another model")
        if getattr(text, "head_dim", None) is None and not _size(text, "kv_lora_rank") and d % heads:
            raise ModelSpecError(f"The config of {source} gives hidden_size = {d}, not a multiple of num_attention_heads = "
                                 f"{heads}, and no head_dim", fix)
    layers = _size(text, "num_hidden_layers")
    check_number(f"num_hidden_layers in the config of {source}", layers, maximum=MAX_LAYERS, error=ModelSpecError,
                 fix=f"{fix} (the deepest real decoders have ~130 layers)")
    params = param_count(config)
    check_memory(params * bytes_per_param + layers * LAYER_OVERHEAD, "The model",
                 "Choose a smaller model, close other programs, or run on a machine with more memory",
                 detail=f"{params / 1e9:.2f} billion parameters estimated from its config, {bytes_per_param} bytes each, "
                        f"and {layers} layers at {LAYER_OVERHEAD >> 10} KiB each")


def check_memory(need: int, what: str, fix: str, *, detail: str = "", cuda: bool | None = None,
                 error: type[LayerScopeError] = ModelSpecError) -> None:
    """The one memory check before something large is built (a model, a draft): `error` in one line when `need`
    bytes exceed MEMORY_SHARE of the memory available (the GPU's when `cuda`, default: when there is one)."""
    available = available_memory(torch.cuda.is_available() if cuda is None else cuda)
    if available is not None and need > MEMORY_SHARE * available:
        raise error(f"{what} needs about {need / 2**30:.1f} GiB{f' ({detail})' if detail else ''} but only "
                    f"{available / 2**30:.1f} GiB of memory is available ({MEMORY_SHARE:.0%} of it may be taken)", fix)


def param_count(config) -> int:
    """A decoder's parameters estimated from its config, before anything is built: the embedding and the LM head
    (one matrix when tied) + per layer its attention (grouped-query: q and o of the attention heads, k and v of
    the key/value heads; DeepSeek's latent attention: its low-rank projections) and its gated MLP (3 d x ff),
    a mixture-of-experts layer's MLP once per routed and shared expert (DeepSeek's first_k_dense_replace layers
    dense). Attention-free layers are counted as 4 d^2."""
    t = config.get_text_config(decoder=True)
    d, n, v = _size(t, "hidden_size"), _size(t, "num_hidden_layers"), _size(t, "vocab_size")
    heads, rank = _size(t, "num_attention_heads"), _size(t, "kv_lora_rank")
    kv, head_dim = _size(t, "num_key_value_heads") or heads, _size(t, "head_dim") or d // max(heads, 1)
    if rank:
        q_rank, rope, nope, vd = (_size(t, k) for k in ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
        q = (d * q_rank + q_rank * heads * (nope + rope)) if q_rank else d * heads * (nope + rope)
        attention = q + d * (rank + rope) + rank * heads * (nope + vd) + heads * vd * d
    else:
        attention = 2 * d * head_dim * (heads + kv) if heads else 4 * d * d
    ff = _size(t, "intermediate_size") or 4 * d
    experts = _size(t, "n_routed_experts") or _size(t, "num_local_experts") or _size(t, "num_experts")
    dense_layers = min(_size(t, "first_k_dense_replace"), n) if experts else n
    expert_ff = _size(t, "moe_intermediate_size") or ff
    shared_ff = _size(t, "n_shared_experts") * expert_ff + _size(t, "shared_expert_intermediate_size")
    mlp = dense_layers * 3 * d * ff + (n - dense_layers) * (3 * d * (experts * expert_ff + shared_ff) + experts * d)
    embeddings = v * d * (1 if getattr(t, "tie_word_embeddings", False) else 2)
    return embeddings + n * attention + mlp


def _size(config, name: str) -> int:
    """A config's whole-number size `name`, 0 where it is missing, not a whole number or below 1."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def available_memory(cuda: bool = True) -> int | None:
    """Bytes free on the GPU (`cuda` and there is one), else the system's available memory (None: unknown)."""
    if cuda and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

def _one_line(e: Exception) -> str:
    """Every line of an error's message joined into one (transformers' config validation names the problem on
    its second line)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= 800 else text[:800] + " ..."


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
