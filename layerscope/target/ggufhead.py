"""A GGUF file's header read without its tensors: the target's config before its first load (issue 51: the first
capture of each model showed no estimate, exactly when a newcomer needs one).

    read(files)      {key: value} of the header's metadata (an array: its length), and "tensors": the tensor names;
                     `files` are the file, or the parts it ships in, in order (read as one stream, nothing assembled)
    config(files)    a transformers-like config (SimpleNamespace: hidden_size, num_hidden_layers, vocab_size, heads,
                     intermediate_size, head_dim, tie_word_embeddings, chat_template, ...), None when it lacks one

The GGUF layout (v2, v3): magic "GGUF", version u32, tensor count u64, metadata count u64; each metadata entry a
string key, a u32 type and its value; then each tensor's name, dimensions, type and offset. A string is a u64 length
and its bytes. Only the header is read: a few MB for a vocabulary of 150k tokens, skipped string by string.
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_STRING = 1 << 24            # a longer string is a damaged header


class _Stream:
    """The files as one byte stream, read forward."""

    def __init__(self, files):
        self.files, self.f = [Path(p) for p in files], None

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            if self.f is None:
                if not self.files:
                    raise ValueError("the GGUF header ends early")
                self.f = open(self.files.pop(0), "rb", buffering=1 << 20)
            got = self.f.read(n - len(out))
            if not got:
                self.f.close()
                self.f = None
            out += got
        return out

    def close(self):
        if self.f is not None:
            self.f.close()

    def value(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self, keep: bool = True) -> str:
        n = self.value("<Q")
        if n > MAX_STRING:
            raise ValueError("a GGUF string is too long")
        data = self.read(n)
        return data.decode("utf-8", "replace") if keep else ""


def read(files) -> dict:
    """The header's metadata ({key: value}; an array: its length) and "tensors": the set of tensor names."""
    s = _Stream(files)
    try:
        if s.read(4) != b"GGUF" or s.value("<I") < 2:
            raise ValueError("not a GGUF file of version 2 or later")
        tensors, entries = s.value("<Q"), s.value("<Q")
        out: dict = {}
        for _ in range(entries):
            key, kind = s.string(), s.value("<I")
            if kind == STRING:
                out[key] = s.string()
            elif kind in FIXED:
                out[key] = s.value(FIXED[kind])
            elif kind == ARRAY:
                item, n = s.value("<I"), s.value("<Q")
                if item == STRING:
                    for _ in range(n):
                        s.string(keep=False)
                elif item in FIXED:
                    s.read(n * struct.calcsize(FIXED[item]))
                else:
                    raise ValueError(f"a GGUF array of type {item}")
                out[key] = n
            else:
                raise ValueError(f"a GGUF value of type {kind}")
        names = set()
        for _ in range(tensors):
            names.add(s.string())
            s.read(8 * s.value("<I") + 4 + 8)            # dimensions, type, offset
        out["tensors"] = names
        return out
    finally:
        s.close()


MODEL_TYPES = {"gemma3": "gemma3_text"}        # GGUF architectures transformers names otherwise


def config(files) -> SimpleNamespace | None:
    """The config the header implies (what shape.target_shape reads from a config.json), or None."""
    try:
        h = read(files)
    except (OSError, ValueError, struct.error):
        return None
    arch = h.get("general.architecture")

    def get(name, default=None):
        return h.get(f"{arch}.{name}", default)
    heads = get("attention.head_count")
    values = {"model_type": MODEL_TYPES.get(arch, arch), "hidden_size": get("embedding_length"),
              "num_hidden_layers": get("block_count"), "intermediate_size": get("feed_forward_length"),
              "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
              "vocab_size": get("vocab_size") or h.get("tokenizer.ggml.tokens"),
              "max_position_embeddings": get("context_length"), "head_dim": get("attention.key_length"),
              "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
              "tie_word_embeddings": "output.weight" not in h["tensors"],
              "chat_template": h.get("tokenizer.chat_template") or ""}
    if not all(isinstance(values[k], int) and values[k] > 0 for k in
               ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")):
        return None
    return SimpleNamespace(**{k: v for k, v in values.items() if v is not None})
