"""What a capture writes, in bytes, before it is run: the estimate the free-space check and the user see."""

from __future__ import annotations

from pathlib import Path


def capture_bytes(tokens: int, num_layers: int, hidden_size: int, prenorm: bool = True) -> int:
    """Bytes of a capture of `tokens` tokens: float16 states of layers 0..N (and the pre-norm final state),
    plus the token table (token id, position, conversation: int32; is_response: bool; entropy: float32)."""
    states = (num_layers + 1 + int(prenorm)) * hidden_size * 2
    return int(tokens) * (states + 4 + 4 + 4 + 1 + 4)


def capture_need(encoded, max_new_tokens: int, max_tokens: int | None, batch_size: int, num_layers: int,
                 hidden_size: int, partial: Path | None = None) -> int:
    """Bytes a capture of the prompts `encoded` (token ids) may still write: every prompt with a full-length
    response (an upper bound: answers may end early), cut at max_tokens plus one batch, less the chunks
    already in `partial`."""
    lengths = [len(ids) + int(max_new_tokens) for ids in encoded]
    tokens = sum(lengths)
    if max_tokens is not None:
        tokens = min(tokens, int(max_tokens) + sum(sorted(lengths)[-int(batch_size):]))
    done = sum(f.stat().st_size for f in Path(partial).glob("chunk-*.safetensors")) if partial and Path(partial).is_dir() else 0
    return max(0, capture_bytes(tokens, num_layers, hidden_size) - done)
