"""The artifact store: content-addressed captures, cached JSON results, drafts and sessions on disk.

Layout under the root (default ./cache, else $LAYERSCOPE_STORE, else the `root` argument):
    index/                    a diskcache.Cache holding JSON only (never pickle: a store can be shared)
    captures/<key>/           a finished capture: manifest.json + chunk-<start>-<end>.safetensors
    captures/<key>.partial/   chunks of a capture in progress; renamed to captures/<key>/ when complete
    models/<fingerprint>/     de-quantized model weights
    drafts/<key>/, sessions/<id>/ ...   other kinds, one directory per entry

Every file is written to a temporary name and renamed into place, so a run killed at any moment
leaves a complete entry or none. Each chunk covers a range of conversations and is complete on
its own: an interrupted capture resumes from the chunks it finished, and several processes can
write chunks of one capture side by side (the manifest merges them without copying tensors).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import diskcache
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from layerscope.errors import StoreError

ENTRY_KINDS = ("captures", "drafts", "models", "sessions")   # directory kinds the size limit evicts
DEFAULT_SIZE_LIMIT = 50 * 2**30


def default_root() -> Path:
    env = os.environ.get("LAYERSCOPE_STORE")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parent.parent / "cache"


def make_key(obj) -> str:
    """24 hex chars of sha256 over canonical JSON: the content address of whatever `obj` describes."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, default=str).encode())


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Store:
    """One store directory. Cheap to construct; safe to share between processes."""

    def __init__(self, root: str | os.PathLike | None = None, size_limit: int | None = None):
        self.root = Path(root).expanduser() if root else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.size_limit = size_limit or int(os.environ.get("LAYERSCOPE_STORE_LIMIT", DEFAULT_SIZE_LIMIT))
        self._index = None

    @property
    def index(self) -> diskcache.Cache:
        if self._index is None:
            self._index = diskcache.Cache(str(self.root / "index"), disk=diskcache.JSONDisk,
                                          eviction_policy="none", size_limit=2**40)
        return self._index

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None

    # ------------------------------------------------------------------ small JSON results
    def get_json(self, namespace: str, key: str):
        value = self.index.get(f"{namespace}/{key}")
        if value is not None:
            self.touch(namespace, key)
        return value

    def put_json(self, namespace: str, key: str, value) -> None:
        self.index.set(f"{namespace}/{key}", json.loads(json.dumps(value, default=float)))

    # ------------------------------------------------------------------ directory entries
    def path(self, kind: str, key: str) -> Path:
        """The directory for entry `key` of `kind` (not created)."""
        return self.root / kind / key

    def touch(self, kind: str, key: str) -> None:
        """Record a use, for least-recently-used eviction."""
        self.index.set(f"used/{kind}/{key}", time.time())

    def entry_size(self, kind: str, key: str) -> int:
        p = self.path(kind, key)
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0

    def total_size(self) -> int:
        return sum(self.entry_size(kind, p.name) for kind in ENTRY_KINDS
                   for p in (self.root / kind).glob("*") if p.is_dir())

    def evict(self, limit_bytes: int | None = None) -> list[str]:
        """Delete least recently used entries until the store is under `limit_bytes`; returns what went."""
        limit = self.size_limit if limit_bytes is None else limit_bytes
        entries = []
        for kind in ENTRY_KINDS:
            for p in (self.root / kind).glob("*"):
                if p.is_dir():
                    used = self.index.get(f"used/{kind}/{p.name}") or p.stat().st_mtime
                    entries.append((used, kind, p.name, self.entry_size(kind, p.name)))
        total = sum(e[3] for e in entries)
        removed = []
        for used, kind, key, size in sorted(entries):
            if total <= limit:
                break
            self.remove(kind, key)
            total -= size
            removed.append(f"{kind}/{key}")
        return removed

    def remove(self, kind: str, key: str) -> None:
        p = self.path(kind, key)
        if p.is_dir():
            trash = p.with_name(f".{p.name}.deleting")
            os.replace(p, trash)      # the entry vanishes at once; the files go after
            shutil.rmtree(trash, ignore_errors=True)
        self.index.pop(f"used/{kind}/{key}", None)
        if kind == "captures":
            self.index.pop(f"capture/{key}", None)

    # ------------------------------------------------------------------ captures
    def has_capture(self, key: str) -> bool:
        return (self.path("captures", key) / "manifest.json").is_file()

    def open_capture(self, key: str) -> "CaptureReader":
        path = self.path("captures", key)
        if not (path / "manifest.json").is_file():
            matches = [p.name for p in (self.root / "captures").glob(f"{key}*")
                       if (p / "manifest.json").is_file()] if key else []
            if len(matches) == 1:
                path, key = self.path("captures", matches[0]), matches[0]
            else:
                raise StoreError(f"No capture with key {key!r} in {self.root}",
                                 "Run `layerscope captures` to list the stored keys, or capture first")
        self.touch("captures", key)
        return CaptureReader(path)

    def partial_capture_dir(self, key: str) -> Path:
        return self.root / "captures" / f"{key}.partial"

    def finish_capture(self, key: str, manifest: dict) -> Path:
        """Write the manifest into the partial directory and rename it into place: the capture now exists."""
        partial = self.partial_capture_dir(key)
        atomic_write_json(partial / "manifest.json", manifest)
        final = self.path("captures", key)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        self.index.set(f"capture/{key}", summarize_manifest(manifest))
        self.touch("captures", key)
        self.evict()
        return final

    def list_captures(self) -> list[dict]:
        """Summaries of finished captures, newest first."""
        out = []
        for p in (self.root / "captures").glob("*"):
            if p.is_dir() and (p / "manifest.json").is_file():
                summary = self.index.get(f"capture/{p.name}")
                if summary is None:
                    summary = summarize_manifest(json.loads((p / "manifest.json").read_text()))
                summary["size_bytes"] = self.entry_size("captures", p.name)
                out.append(summary)
        return sorted(out, key=lambda s: s.get("created", ""), reverse=True)


def summarize_manifest(m: dict) -> dict:
    return {k: m.get(k) for k in ("key", "model", "num_layers", "hidden_size", "prompt_set", "tokens",
                                 "conversations", "created", "seconds")}


# ---------------------------------------------------------------------------- chunks and readers

def chunk_name(start: int, end: int) -> str:
    """File name of the chunk holding conversations [start, end)."""
    return f"chunk-{start:07d}-{end:07d}.safetensors"


def list_chunks(directory: Path) -> list[tuple[int, int, Path]]:
    """(start, end, path) of every complete chunk in `directory`, by conversation range."""
    out = []
    for p in directory.glob("chunk-*.safetensors"):
        _, start, end = p.stem.split("-")
        out.append((int(start), int(end), p))
    return sorted(out)


class CaptureReader:
    """Read a finished capture: token table, one layer or a token subset, without loading everything.

    Chunk tensors: `hidden.<l>` [n, d] float16 for l in 0..N, `prenorm_final` [n, d] float16,
    `token_id`, `position`, `conversation` int32 [n], `is_response` bool [n], `entropy` float32 [n].
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.manifest = json.loads((self.path / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"Capture manifest in {self.path} is unreadable ({e})",
                             "Delete that directory and capture again") from e
        self.key = self.manifest["key"]
        self.num_layers = int(self.manifest["num_layers"])
        self.hidden_size = int(self.manifest["hidden_size"])
        self.chunks = [(c["file"], int(c["tokens"])) for c in self.manifest["chunks"]]
        self.offsets = torch.tensor([0] + [n for _, n in self.chunks]).cumsum(0)
        self.num_tokens = int(self.offsets[-1])
        self._tokens = None

    def __repr__(self) -> str:
        return f"CaptureReader({self.key}, {self.num_tokens} tokens, layers 0..{self.num_layers})"

    def tokens(self) -> dict[str, torch.Tensor]:
        """The token table: token_id, position, conversation (int64), is_response (bool), entropy (float32)."""
        if self._tokens is None:
            parts = {name: [] for name in ("token_id", "position", "conversation", "is_response", "entropy")}
            for f, _ in self.chunks:
                with safe_open(str(self.path / f), framework="pt") as sf:
                    for name in parts:
                        parts[name].append(sf.get_tensor(name))
            table = {name: torch.cat(v) for name, v in parts.items()}
            for name in ("token_id", "position", "conversation"):
                table[name] = table[name].long()
            self._tokens = table
        return self._tokens

    def _read(self, name: str, index: torch.Tensor | None) -> torch.Tensor:
        """Tensor `name` over all chunks, or at the global token indices `index` (any order)."""
        if index is None:
            out = []
            for f, _ in self.chunks:
                with safe_open(str(self.path / f), framework="pt") as sf:
                    out.append(sf.get_tensor(name))
            return torch.cat(out).float()
        index = torch.as_tensor(index, dtype=torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= self.num_tokens):
            raise StoreError(f"Token index out of range 0..{self.num_tokens - 1}", "Pass indices from this capture")
        result = torch.empty(index.numel(), self.hidden_size, dtype=torch.float32)
        chunk_of = torch.searchsorted(self.offsets[1:], index, right=True)
        for c in chunk_of.unique().tolist():
            where = (chunk_of == c).nonzero().squeeze(1)
            f, _ = self.chunks[c]
            with safe_open(str(self.path / f), framework="pt") as sf:
                block = sf.get_tensor(name)
            result[where] = block[index[where] - self.offsets[c]].float()
        return result

    def layer(self, l: int, index: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states[l] for the capture's tokens (or those at `index`): [n, d] float32."""
        if not 0 <= l <= self.num_layers:
            raise StoreError(f"Layer {l} is not in this capture (layers 0..{self.num_layers})", "Pick a layer in range")
        return self._read(f"hidden.{l}", index)

    def layers(self, ls, index: torch.Tensor | None = None) -> torch.Tensor:
        """[len(ls), n, d] float32."""
        return torch.stack([self.layer(l, index) for l in ls])

    def prenorm_final(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Output of the last decoder layer before the final norm: [n, d] float32."""
        return self._read("prenorm_final", index)
