"""Draft checkpoints: a directory other engines load, and LayerScope loads back without pickle.

    config.json         DraftConfig.to_hf_config(): the EAGLE-3 Llama draft config vLLM and SGLang read,
                        with the auxiliary layer ids written for each engine (docs/drafts.md)
    model.safetensors   fc, midlayer.*, norm, lm_head (float32), d2t (int64), t2d (bool); no embed_tokens:
                        both engines share the target's embedding when the checkpoint has none
    layerscope.json     what produced it: target fingerprint, capture key, layers, strategy, budget,
                        seed, validation accuracy per TTT step, tokens, seconds

The directory is written under a temporary name beside the destination and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from layerscope.draft.model import ARCHITECTURE, DraftConfig, DraftHead
from layerscope.errors import DraftError

FORMAT = 1
FILES = ("config.json", "model.safetensors", "layerscope.json")


def serving_notes(config: DraftConfig) -> list[str]:
    """What keeps a draft from being served as-is by vLLM / SGLang (empty when nothing does)."""
    notes = []
    if config.k != 3:
        notes.append(f"reads {config.k} layers: vLLM's and SGLang's Llama EAGLE-3 loaders build fc for exactly 3 "
                     "layers (3 x target_hidden_size), so only LayerScope can run it")
    if 0 in config.aux_layers:
        notes.append("reads layer 0 (the embedding output): the engines' Llama capture loops add a residual that "
                     "is still None before the first decoder layer, so they cannot supply it")
    return notes


def save_draft(path, head: DraftHead, meta: dict | None = None) -> Path:
    """Write `head` to directory `path` (replacing it whole); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    info = {"format": FORMAT, "aux_layers": head.aux_layers, "draft_vocab_size": head.config.draft_vocab_size,
            "serving_notes": serving_notes(head.config), "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(meta or {})}
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        (tmp / "config.json").write_text(json.dumps(head.config.to_hf_config(), indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "layerscope.json").write_text(json.dumps(info, indent=2, default=float))
        if path.exists():
            trash = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, trash)
            os.replace(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_meta(path) -> dict:
    """layerscope.json of a draft directory ({} when the draft came from elsewhere)."""
    f = Path(path) / "layerscope.json"
    return _read_json(f) if f.is_file() else {}


def load_draft(path, target=None) -> DraftHead:
    """Load a draft directory (JSON + safetensors only). With `target` (a LoadedModel) the draft is checked
    against it, gets its embedding and moves to its device; a draft for another target raises DraftError."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise DraftError(f"{path} is not a draft directory (config.json and model.safetensors are needed)",
                         "Give the directory `layerscope train-draft --out` wrote")
    cfg = _read_json(path / "config.json")
    meta = read_meta(path)
    if ARCHITECTURE not in (cfg.get("architectures") or []) and "Eagle3LlamaForCausalLM" not in (cfg.get("architectures") or []):
        raise DraftError(f"{path}/config.json describes {cfg.get('architectures')}, not an EAGLE-3 Llama draft",
                         f"LayerScope loads drafts with architectures [\"{ARCHITECTURE}\"]")
    config = DraftConfig.from_hf_config(cfg, meta.get("aux_layers"))
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise DraftError(f"{path}/model.safetensors is unreadable ({e})", "Train or copy the draft again") from e
    tensors.pop("embed_tokens.weight", None)   # a foreign checkpoint may carry the target's embedding
    if target is not None:
        check_fits(config, meta, target, path)
        config.target_num_layers = int(target.num_layers)
    head = DraftHead(config, d2t=tensors.get("d2t"), t2d=tensors.get("t2d"))
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if expected != found:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
        raise DraftError(f"{path}/model.safetensors does not match its config.json (missing {missing}, unexpected "
                         f"{extra}, wrong shape {[(k, found[k], expected[k]) for k in wrong]})",
                         "The checkpoint is damaged or from another architecture; train it again")
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()})
    if int((head.d2t + torch.arange(config.draft_vocab_size)).max()) >= config.vocab_size:
        raise DraftError(f"{path}: d2t maps draft ids past the target vocabulary of {config.vocab_size}",
                         "The checkpoint is damaged; train it again")
    if target is not None:
        head.set_embedding(target.model.get_input_embeddings().weight)
        head.to(target.device)
    return head.eval()


def check_fits(config: DraftConfig, meta: dict, target, path) -> None:
    """Refuse a draft whose target is not `target`, naming both."""
    name = getattr(target, "spec", "the target")
    vocab = int(target.model.get_input_embeddings().weight.shape[0])
    problems = []
    if config.target_hidden_size != target.hidden_size or config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.target_hidden_size} vs {target.hidden_size}")
    if config.vocab_size != vocab:
        problems.append(f"vocabulary {config.vocab_size} vs {vocab}")
    if config.aux_layers[-1] >= target.num_layers:
        problems.append(f"layers {config.aux_layers} vs {target.num_layers} decoder layers")
    trained_for = meta.get("target_fingerprint")
    if trained_for and trained_for != target.fingerprint:
        problems.append(f"weights fingerprint {trained_for} vs {target.fingerprint}")
    if problems:
        raise DraftError(f"Draft {path} was trained for {meta.get('target_model', 'another target')} and does not fit "
                         f"{name} ({'; '.join(problems)}; draft vs target)",
                         f"Load it with the target it was trained for, or train a draft for {name} with `layerscope train-draft`")


def _read_json(f: Path) -> dict:
    try:
        value = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DraftError(f"{f} is not valid JSON ({e})", "The draft is damaged; train or copy it again") from e
    if not isinstance(value, dict):
        raise DraftError(f"{f} does not hold a JSON object", "The draft is damaged; train or copy it again")
    return value
