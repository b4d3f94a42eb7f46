"""The capture format: one finished capture is one directory of a manifest and safetensors chunks.

    captures/<key>/manifest.json                               what was captured, and every chunk's size and sha256
    captures/<key>/chunk-<start:07d>-<end:07d>.safetensors     conversations [start, end), n tokens
    captures/<key>.partial/chunk-...                           a capture in progress (same chunk names; no manifest)

manifest.json, a JSON object (capture.build_manifest writes it; `validate_manifest` is the schema):
    key               24 hex characters: the directory's name (store.make_key of what was captured: capture_key)
    format            a positive integer (capture.FORMAT_VERSION, 1 so far)
    model, fingerprint, prompt_set, prompt_set_hash, created (ISO time), seconds, options, final_state
    num_layers N, hidden_size d      the model's; states 0..N are kept (0 = embeddings, N = the final state)
    has_prenorm_final                whether the chunks hold `prenorm_final`
    sample_positions  null: every position of every conversation is kept (absent in older captures: the same);
                      an integer s (--sample-positions): each conversation of n tokens keeps min(s, n - 1) of its
                      positions 1..n-1 (position 0, the attention sink the statistics always drop, never), in
                      position order: a uniform sample of its response positions, or when it has fewer than s all
                      of them and a uniform sample of its prompt positions for the rest (the statistics read
                      response tokens by default), seeded by the capture's seed and the conversation's index.
                      `position` holds the true positions. Such a capture serves statistics only: what reads
                      neighbouring tokens (training a draft, the probe, a study) refuses it
                      (CaptureReader.require_every_position)
    layer_kinds       what each decoder layer 0..N-1 mixes tokens with (`LAYER_KINDS`: "attention", "sliding",
                      "chunked", "linear" (a gated delta-net), "ssm" (a Mamba or Mamba-2 mixer), "ssm+attention"
                      (both in one layer: Falcon-H1), "conv" (a short convolution: LFM2), else transformers' own
                      name); absent in captures made before it was recorded, whose layers show no kind.
                      `state_kinds` turns it into the kind of each hidden state 0..N
    prompts           [{id, category}] of the conversations, in order
    conversations     how many; the chunks cover [0, conversations) contiguously, in order
    tokens            how many; the sum of the chunks' tokens
    chunks            [{file, start, end, tokens, bytes, sha256}], file = chunk_name(start, end)

A chunk of n tokens holds (name: shape dtype):
    hidden.<l>        [n, d] float16, for l in 0..N (hidden_states[l] of the model); bfloat16 in a chunk whose
                      states would overflow float16 (|x| > 65504: Gemma 3's residual stream reaches 1e5), see
                      `state_dtype`
    prenorm_final     [n, d] the states' dtype, when has_prenorm_final: the last decoder layer's output before the
                      final norm
    token_id, position, conversation   [n] int32 (conversation counts from 0 over the whole capture)
    is_response       [n] bool: the token is part of the target's own answer, not the prompt
    entropy           [n] float32: predictive entropy (nats) of the next-token distribution

Checks, cheapest first: `read_manifest` (the schema), `check_chunk_files` (every chunk's size and its
header's names, shapes and dtypes; done by every open and listing), the sha256 of a chunk the first time
a `CaptureReader` reads it, and `verify_capture_files` (every check and every checksum). A failed check is
one StoreError naming the capture as damaged, never a wrong result. layerscope/capture/stored.py finds,
finishes and lists captures in a store (layerscope/store.py: the entry directories, write locks and eviction).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from layerscope import jsonsafe
from layerscope.errors import CaptureError, StoreError
from layerscope.store import file_sha256

MAX_MANIFEST_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 100 * 2**20
SHA256_RE = re.compile(r"[0-9a-f]{64}")
CHUNK_DTYPES = {"token_id": "I32", "position": "I32", "conversation": "I32", "is_response": "BOOL",
                "entropy": "F32"}
STATE_DTYPES = ("F16", "BF16")          # a chunk's hidden states: float16, or bfloat16 where float16 would overflow
FLOAT16_MAX = torch.finfo(torch.float16).max


def state_dtype(states) -> torch.dtype:
    """How hidden states are stored (a capture's chunk, online training's features): float16, unless a finite value
    would overflow it (|x| > 65504), then bfloat16, which has float32's range at a coarser step. `states`: tensors
    (or one), judged together so that one batch's layers share a dtype."""
    tensors = [states] if isinstance(states, torch.Tensor) else list(states)
    big = any(t.numel() and float(t.detach().abs().nan_to_num(posinf=0.0, neginf=0.0).amax()) > FLOAT16_MAX
              for t in tensors)
    return torch.bfloat16 if big else torch.float16


# ---------------------------------------------------------------------------- chunk names

def chunk_name(start: int, end: int) -> str:
    """File name of the chunk holding conversations [start, end)."""
    return f"chunk-{start:07d}-{end:07d}.safetensors"


CHUNK_RE = re.compile(r"chunk-(\d{7})-(\d{7})\.safetensors")


def list_chunks(directory: Path) -> list[tuple[int, int, Path]]:
    """(start, end, path) of every complete chunk in `directory`, by conversation range."""
    out = []
    if not Path(directory).is_dir():
        return out
    for p in Path(directory).iterdir():
        m = CHUNK_RE.fullmatch(p.name)
        if m and p.is_file() and not p.is_symlink():
            out.append((int(m[1]), int(m[2]), p))
    return sorted(out)


# ---------------------------------------------------------------------------- manifests

def damaged(path: Path, problem: str) -> StoreError:
    key = Path(path).name
    return StoreError(f"Capture {key} is damaged: {problem}",
                      f"Do not use it: run `layerscope verify {key} --delete` to remove it, then capture again")


DAMAGE_FILE = ".damaged.json"      # inside a capture found damaged by a checksum: what was wrong (never listed)


def mark_damaged(path: Path, problem: str) -> None:
    """Remember in the capture directory `path` that a check found it damaged, so that every listing and every
    later open says so at once (best effort: a read-only store only keeps saying it on each full read)."""
    try:
        (Path(path) / DAMAGE_FILE).write_text(json.dumps({"problem": problem}))
    except OSError:
        pass


def known_damage(path: Path) -> str | None:
    """The problem a check recorded in the capture directory `path` (mark_damaged), or None."""
    try:
        doc = jsonsafe.loads((Path(path) / DAMAGE_FILE).read_bytes()[:65536], what=DAMAGE_FILE, error=StoreError)
    except (OSError, StoreError):
        return None
    return str(doc.get("problem") or "a check found it damaged") if isinstance(doc, dict) else None


def clear_damage(path: Path) -> None:
    """Forget a damage mark (mark_damaged) once a full check finds every chunk whole again (a chunk restored);
    best effort, as the mark itself."""
    try:
        (Path(path) / DAMAGE_FILE).unlink(missing_ok=True)
    except OSError:
        pass


def read_manifest(path: Path, *, marked: bool = True) -> dict:
    """The manifest of the capture directory `path`, parsed and validated; StoreError naming the key if not.
    With `marked` (every open and listing) a damage mark (mark_damaged) is the answer at once; the full check
    (verify_capture_files) reads past it and decides afresh."""
    f = Path(path) / "manifest.json"
    if marked and (damage := known_damage(path)) is not None:
        raise damaged(path, damage)
    try:
        if f.stat().st_size > MAX_MANIFEST_BYTES:
            raise damaged(path, f"manifest.json is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        manifest = jsonsafe.loads(f.read_bytes(), what="manifest.json", error=StoreError)
    except OSError as e:
        raise damaged(path, f"manifest.json is unreadable ({e})") from None
    except StoreError as e:
        raise damaged(path, e.problem) from None
    validate_manifest(manifest, Path(path).name)
    return manifest


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_manifest(m, key: str) -> None:
    """The manifest schema: types, ranges, contiguous chunks named as chunk_name says (so inside the entry)."""
    where = Path(key)

    def need(cond, problem):
        if not cond:
            raise damaged(where, f"manifest.json: {problem}")

    need(isinstance(m, dict), "not a JSON object")
    need(m.get("key") == key, f"its key {m.get('key')!r} is not the directory's name")
    need(_is_int(m.get("format")) and m["format"] >= 1, "'format' must be a positive integer")
    for name, top in (("num_layers", 100_000), ("hidden_size", 1_000_000)):
        need(_is_int(m.get(name)) and 1 <= m[name] <= top, f"{name!r} must be an integer in 1..{top}")
    for name in ("model", "prompt_set", "created"):
        need(m.get(name) is None or isinstance(m[name], str), f"{name!r} must be a string")
    chunks = m.get("chunks")
    need(isinstance(chunks, list) and chunks, "'chunks' must be a non-empty list")
    start = 0
    for i, c in enumerate(chunks):
        need(isinstance(c, dict), f"chunk {i} is not an object")
        need(_is_int(c.get("start")) and _is_int(c.get("end")) and c["start"] == start and c["end"] > start,
             f"chunk {i} does not continue at conversation {start}")
        need(c.get("file") == chunk_name(c["start"], c["end"]), f"chunk {i} file name {c.get('file')!r} is not "
             f"{chunk_name(c['start'], c['end'])}")
        need(_is_int(c.get("tokens")) and c["tokens"] >= 1, f"chunk {i} 'tokens' must be a positive integer")
        need("bytes" not in c or (_is_int(c["bytes"]) and c["bytes"] > 8), f"chunk {i} 'bytes' must be an integer")
        need("sha256" not in c or (isinstance(c["sha256"], str) and SHA256_RE.fullmatch(c["sha256"])),
             f"chunk {i} 'sha256' must be 64 hex characters")
        start = c["end"]
    need(m.get("conversations") == start, f"'conversations' is {m.get('conversations')!r}, the chunks hold {start}")
    need(m.get("tokens") == sum(c["tokens"] for c in chunks),
         f"'tokens' is {m.get('tokens')!r}, the chunks hold {sum(c['tokens'] for c in chunks)}")
    sample = m.get("sample_positions")
    need(sample is None or (_is_int(sample) and sample >= 1), "'sample_positions' must be null or a positive integer")
    prompts = m.get("prompts", [])
    need(isinstance(prompts, list) and all(isinstance(p, dict) for p in prompts), "'prompts' must be a list of objects")
    kinds = m.get("layer_kinds")
    need(kinds is None or (isinstance(kinds, list) and len(kinds) == m["num_layers"]
                           and all(isinstance(k, str) and 0 < len(k) <= 64 for k in kinds)),
         f"'layer_kinds' must be null or {m['num_layers']} short strings, one per decoder layer")


# What a decoder layer mixes tokens with, as a capture records it (manifest "layer_kinds", capture.run.layer_kinds):
LAYER_KINDS = ("attention", "sliding", "chunked", "linear", "ssm", "ssm+attention", "conv")
EMBEDDING = "embedding"         # the kind of hidden state 0


def state_kinds(manifest: dict) -> list[str] | None:
    """The kind of each hidden state 0..N of a capture: "embedding" for 0, and for l >= 1 the kind of decoder layer
    l-1, whose output it is (state N too: that layer's output after the final norm). None for a capture that does
    not record its layers' kinds (made before they were recorded, or imported from an engine's dump)."""
    kinds = manifest.get("layer_kinds") if isinstance(manifest, dict) else None
    if not isinstance(kinds, list) or not kinds:
        return None
    return [EMBEDDING, *(str(k) for k in kinds)]


def capture_state_kinds(path: Path, num_layers: int | None = None) -> list[str] | None:
    """`state_kinds` of the capture directory `path`; None when it records none, cannot be read (a figure then
    shows no kinds: whatever is wrong with the capture is said where it is opened) or is not `num_layers` deep."""
    try:
        kinds = state_kinds(read_manifest(path))
    except (OSError, StoreError):
        return None
    return kinds if kinds is None or num_layers is None or len(kinds) == num_layers + 1 else None


SUMMARY_KEYS = ("key", "model", "num_layers", "hidden_size", "prompt_set", "tokens", "conversations", "created",
                "seconds")


def summarize_manifest(m: dict) -> dict:
    """The manifest fields a capture listing shows (capture.stored.list_captures)."""
    return {k: m.get(k) for k in SUMMARY_KEYS}


# ---------------------------------------------------------------------------- chunk files

def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}}; ValueError when malformed."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError("header length runs past the file")
        try:
            header = jsonsafe.loads(f.read(n), what="its header", error=StoreError)
        except StoreError as e:
            raise ValueError(e.problem) from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{size} bytes where the header describes {8 + n + end}")
    return header


def check_chunk_files(path: Path, manifest: dict) -> None:
    """The cheap check: every chunk is a regular file of its recorded size whose header has the tensors
    and shapes the manifest implies ([tokens] and [tokens, hidden_size] for layers 0..num_layers)."""
    N, d = manifest["num_layers"], manifest["hidden_size"]
    for c in manifest["chunks"]:
        f = Path(path) / c["file"]
        if f.is_symlink() or not f.is_file():
            raise damaged(path, f"chunk {c['file']} is missing")
        if "bytes" in c and f.stat().st_size != c["bytes"]:
            raise damaged(path, f"chunk {c['file']} is {f.stat().st_size} bytes, the manifest says {c['bytes']}")
        try:
            header = read_header(f)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise damaged(path, f"chunk {c['file']} is not a valid safetensors file ({e})") from None
        n = c["tokens"]
        first = header.get("hidden.0")
        states = first.get("dtype") if isinstance(first, dict) and first.get("dtype") in STATE_DTYPES else "F16"
        want = {f"hidden.{l}": ([n, d], states) for l in range(N + 1)}       # one dtype for a chunk's states
        want |= {name: ([n], dtype) for name, dtype in CHUNK_DTYPES.items()}
        if manifest.get("has_prenorm_final"):
            want["prenorm_final"] = ([n, d], states)
        for name, (shape, dtype) in want.items():
            got = header.get(name)
            if not isinstance(got, dict):
                raise damaged(path, f"chunk {c['file']} has no tensor {name}")
            if got.get("shape") != shape or got.get("dtype") != dtype:
                raise damaged(path, f"chunk {c['file']} tensor {name} is {got.get('dtype')} {got.get('shape')}, "
                              f"the manifest implies {dtype} {shape}")


def verify_capture_files(path: Path) -> list[str]:
    """Every problem of the capture directory `path` (full check: schema, sizes, headers and the sha256 of
    every chunk, whatever an earlier check marked); [] when it is sound. A chunk that does not match is marked
    (mark_damaged); every chunk whole again clears the mark."""
    try:
        manifest = read_manifest(path, marked=False)
        check_chunk_files(path, manifest)
    except StoreError as e:
        return [e.problem]
    problems = []
    for c in manifest["chunks"]:
        if "sha256" not in c:
            problems.append(f"chunk {c['file']} has no checksum (captured before checksums were recorded)")
        elif file_sha256(Path(path) / c["file"]) != c["sha256"]:
            problems.append(f"chunk {c['file']} does not match its checksum (its bytes changed)")
            mark_damaged(path, problems[-1])
    if not any("does not match" in p for p in problems):
        clear_damage(path)
    return problems


# ---------------------------------------------------------------------------- the reader

class CaptureReader:
    """Read a finished capture: token table, one layer or a token subset, without loading everything.

    Chunk tensors: `hidden.<l>` [n, d] float16 (bfloat16: state_dtype) for l in 0..N, `prenorm_final` alike,
    `token_id`, `position`, `conversation` int32 [n], `is_response` bool [n], `entropy` float32 [n].
    Opening checks the manifest schema, chunk sizes and headers; the first read of each chunk checks
    its sha256, so damaged bytes raise StoreError instead of reaching a result.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        check_chunk_files(self.path, self.manifest)
        self.key = self.manifest["key"]
        self.num_layers = int(self.manifest["num_layers"])
        self.hidden_size = int(self.manifest["hidden_size"])
        self.chunks = [(c["file"], int(c["tokens"])) for c in self.manifest["chunks"]]
        self._sha = {c["file"]: c.get("sha256") for c in self.manifest["chunks"]}
        self._verified: set[str] = set()
        self.offsets = torch.tensor([0] + [n for _, n in self.chunks]).cumsum(0)
        self.num_tokens = int(self.offsets[-1])
        self.sample_positions = self.manifest.get("sample_positions")     # None: every position is kept
        self._tokens = None

    def __repr__(self) -> str:
        return f"CaptureReader({self.key}, {self.num_tokens} tokens, layers 0..{self.num_layers})"

    def require_every_position(self, what: str, fix: str) -> None:
        """CaptureError (one line) when this capture keeps a sample of positions: `what` reads neighbouring tokens."""
        if self.sample_positions is not None:
            raise CaptureError(f"Capture {self.key} keeps a sample of {self.sample_positions} positions per "
                               f"conversation (--sample-positions); {what} needs every position", fix)

    def _chunk(self, f: str) -> str:
        """Path of chunk `f`, its checksum verified the first time this reader reads it."""
        if f not in self._verified:
            want = self._sha.get(f)
            try:
                got = file_sha256(self.path / f) if want else None
            except OSError as e:
                raise damaged(self.path, f"chunk {f} is unreadable ({e.strerror})") from None
            if want and got != want:
                mark_damaged(self.path, f"chunk {f} does not match its checksum (its bytes changed)")
                raise damaged(self.path, f"chunk {f} does not match its checksum (its bytes changed)")
            self._verified.add(f)
        return str(self.path / f)

    def tokens(self) -> dict[str, torch.Tensor]:
        """The token table: token_id, position, conversation (int64), is_response (bool), entropy (float32)."""
        if self._tokens is None:
            parts = {name: [] for name in ("token_id", "position", "conversation", "is_response", "entropy")}
            for f, _ in self.chunks:
                with safe_open(self._chunk(f), framework="pt") as sf:
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
                with safe_open(self._chunk(f), framework="pt") as sf:
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
            with safe_open(self._chunk(f), framework="pt") as sf:
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
        if not self.manifest.get("has_prenorm_final"):
            raise StoreError(f"Capture {self.key} has no pre-norm final states", "Capture again with this version")
        return self._read("prenorm_final", index)
