"""The target's size before it loads: its config read without the weights (`target_shape`: tiny-llama, a model
directory's or the Hugging Face cache's config.json, the de-quantized copy of a GGUF in the store, else the GGUF's
header), and the size a forecast's rules take (`target`: a Target, P parameters and that config).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from huggingface_hub import try_to_load_from_cache

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError
from layerscope.store import Store
from layerscope.target import ggufhead
from layerscope.target.aliases import ALIASES, alias_gguf, gguf_files
from layerscope.target.config import param_count
from layerscope.target.load import load_model

MAX_CONFIG_BYTES = 4 * 2**20


def target_shape(spec: str, store: Store):
    """The target's config (hidden_size, num_hidden_layers, vocab_size, heads, ...) read without loading its
    weights, or None when that is not possible (a hub id not in the local cache). A GGUF not de-quantized yet: from its
    header (ggufhead: its file, or the parts an alias ships in, read as they lie)."""
    spec = (spec or "").strip()
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        return load_model(spec).model.config      # a random tiny model: built in milliseconds
    config = None
    if spec in ALIASES or spec.endswith(".gguf"):
        config = gguf_config(spec, store)
        if config is None or not config.is_file():
            return _gguf_header(spec, store)
    elif Path(spec).expanduser().is_dir():
        config = Path(spec).expanduser() / "config.json"
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        try:
            hit = try_to_load_from_cache(spec, "config.json")
            config = Path(hit) if isinstance(hit, str) else None
        except Exception:       # no cache, a malformed id: the model load says what is wrong
            config = None
    if config is None or not config.is_file() or config.stat().st_size > MAX_CONFIG_BYTES:
        return None
    try:
        cfg = jsonsafe.loads(config.read_bytes(), what=str(config))
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
        shape = SimpleNamespace(**cfg)
        int(shape.hidden_size), int(shape.num_hidden_layers), int(shape.vocab_size)
        int(shape.num_attention_heads), int(shape.intermediate_size)
        return shape
    except (LayerScopeError, OSError, AttributeError, TypeError, ValueError):
        return None       # the model load reports a broken config


def gguf_config(spec: str, store: Store) -> Path | None:
    """config.json of the GGUF's de-quantized copy in the store, found through the store's file-hash memo (an
    alias shipped in parts: once its file is assembled in the store; nothing is assembled here)."""
    try:
        path = alias_gguf(spec, store, assemble=False) if spec in ALIASES else Path(spec).expanduser()
        if path is None:
            return None
        st = path.stat()
        memo = jsonsafe.loads((store.root / "file-hashes.json").read_bytes(), what="file-hashes.json")
        digest = memo.get(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    except (LayerScopeError, OSError, AttributeError):
        return None
    return Path(store.path("models", f"gguf-{digest}")) / "config.json" if digest else None


def _gguf_header(spec: str, store: Store):
    """The config a GGUF's header implies (ggufhead.config), read once per file version in this process."""
    files = gguf_files(spec, store)
    if not files:
        return None
    try:
        ident = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except OSError:
        return None
    return _header_config(ident)


@functools.lru_cache(maxsize=8)
def _header_config(ident: tuple):
    return ggufhead.config([Path(f) for f, _, _ in ident])


@dataclass(frozen=True)
class Target:
    params: int                # P: the decoder's parameters (config.param_count)
    shape: object              # its config (target_shape)


def target(store: Store, model: str) -> Target | None:
    """The target's size from its config, read without the weights; None when it cannot be read before a load."""
    shape = target_shape(model, store)
    if shape is None:
        return None
    config = shape if hasattr(shape, "get_text_config") else SimpleNamespace(get_text_config=lambda decoder=True: shape)
    return Target(param_count(config), shape)
