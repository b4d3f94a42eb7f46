"""A target's files in the store: the sha256 of a model file, remembered keyed by its path, size and mtime
(file-hashes.json: a GGUF file is hashed once, its fingerprint read back after), and the folder of a stored model
(`models/<fingerprint>/`: a de-quantized GGUF; `models/assembled-<sha>/`: an alias's file assembled from its parts).
"""

from __future__ import annotations

import json
from pathlib import Path

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError
from layerscope.store import StoreWriteError, atomic_write_bytes, default_root, file_sha256

MEMO_BYTES = 4 * 2**20          # file-hashes.json: ~100 bytes per file hashed


def _cached_file_hash(path: Path, store_root: Path, known: str | None = None) -> str:
    """sha256 of a file, remembered keyed by (path, size, mtime) in a small JSON file in the store; `known`: the
    full digest the caller has just computed, remembered instead of reading the file again."""
    st = path.stat()
    memo_path = store_root / "file-hashes.json"
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:      # a cache: unreadable, damaged or planted (too deep, too large) reads as empty
        memo = jsonsafe.loads(memo_path.read_bytes(), what=str(memo_path), max_bytes=MEMO_BYTES)
    except (OSError, LayerScopeError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if ident not in memo:
        memo[ident] = (known or file_sha256(path))[:24]
        try:
            atomic_write_bytes(memo_path, json.dumps(memo).encode())
        except (OSError, StoreWriteError):     # a read-only or full store: the hash is not remembered
            pass
    return memo[ident]


def _store_root(store) -> Path:
    return default_root() if store is None else Path(store.root)


def _model_cache_dir(store, fingerprint: str) -> Path:
    return default_root() / "models" / fingerprint if store is None else store.path("models", fingerprint)
