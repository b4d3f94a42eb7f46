"""What a capture writes, in bytes, before it is run: the estimate the free-space check, the budget and the user see.

    bytes_per_token(N, d)      (N + 1 + 1 pre-norm) x d x 2 (float16 states) + 17 (the token table)
    kept_positions(n, s)       tokens a conversation of n tokens stores: n, or with --sample-positions s, min(s, n - 1)
                               (position 0, the attention sink the statistics always drop, is never sampled)
    prompt_tokens_at_most(text, template)   a prompt's tokens before tokenizing, at most (the app's estimate before the
                               model loads): the UTF-8 bytes of the text and of its chat template, and a few special
                               tokens (a token covers a byte at least; issue 51: characters / 4 said 'at most 732
                               stored' of a capture that stored 902 with SmolLM2's template, 2,365 with tiny-llama's
                               byte tokenizer)
    estimate(lengths, ...)     an Estimate: bytes per token, tokens (prompts exact once tokenized, responses at most
                               max_new_tokens each: an upper bound), total bytes with every chunk's header
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from layerscope import fmt

TOKEN_TABLE_BYTES = 4 + 4 + 4 + 1 + 4      # token id, position, conversation (int32), is_response (bool), entropy (f32)
HEADER_BYTES_PER_TENSOR = 128              # a chunk's safetensors header, per tensor: name, dtype, shape, offsets
SPECIAL_TOKENS = 4                         # tokens a tokenizer may add beyond the text (BOS, a prefix space, ...)


def bytes_per_token(num_layers: int, hidden_size: int, prenorm: bool = True) -> int:
    """Bytes one stored token takes: float16 states of layers 0..N (and the pre-norm final state), plus its row of
    the token table."""
    return (int(num_layers) + 1 + int(prenorm)) * int(hidden_size) * 2 + TOKEN_TABLE_BYTES


def capture_bytes(tokens: int, num_layers: int, hidden_size: int, prenorm: bool = True) -> int:
    """Bytes of a capture of `tokens` tokens (the chunks' headers aside)."""
    return int(tokens) * bytes_per_token(num_layers, hidden_size, prenorm)


def header_bytes(num_layers: int, prenorm: bool = True) -> int:
    """At most the bytes of one chunk's safetensors header (its length field and JSON)."""
    return 8 + HEADER_BYTES_PER_TENSOR * (int(num_layers) + 1 + int(prenorm) + 5)


def prompt_tokens_at_most(text: str, template: str = "") -> int:
    """Tokens of a prompt before the tokenizer has run, at most: the UTF-8 bytes of its text and of the chat template
    that wraps it (its literal text, a system prompt included; one user turn renders each part once), plus
    SPECIAL_TOKENS. Byte-level and byte-fallback tokenizers never make more tokens than bytes."""
    return len(text.encode("utf-8")) + len((template or "").encode("utf-8")) + SPECIAL_TOKENS


def kept_positions(length: int, sample_positions: int | None) -> int:
    """Tokens a conversation of `length` tokens stores: all of them, or a sample of min(s, length - 1) positions
    (never position 0)."""
    if sample_positions is None:
        return int(length)
    return max(0, min(int(sample_positions), int(length) - 1))


@dataclass
class Estimate:
    """What a capture will write, known before it starts (every count an upper bound unless said otherwise)."""
    bytes_per_token: int
    states: int                      # hidden states stored per token (N + 1, and the pre-norm final state)
    hidden_size: int
    max_new_tokens: int
    conversations: int
    prompt_tokens: int               # exact once tokenized (`prompts_exact`), else at most (prompt_tokens_at_most)
    response_tokens: int             # at most: conversations x max_new_tokens (answers may end early)
    tokens: int                      # tokens stored at most: after --sample-positions and --max-tokens
    total: int                       # bytes at most: tokens x bytes_per_token + the chunks' headers
    prompts_exact: bool = True
    sample_positions: int | None = None
    free: int | None = None          # bytes free on the store's disk, when known
    budget: int | None = None        # --max-store-bytes, when given

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.total > self.budget

    def lines(self) -> list[str]:
        """What the user reads before the capture starts: three lines."""
        exact = "exact" if self.prompts_exact else "at most: the bytes of the text and its chat template, not tokenized yet"
        sampled = (f", a sample of at most {fmt.count(self.sample_positions)} positions per conversation kept"
                   if self.sample_positions is not None else "")
        budget = f", budget {fmt.size(self.budget)}" if self.budget is not None else ""
        free = f"; {fmt.size(self.free)} free on the store's disk" if self.free is not None else ""
        return [f"estimate: {fmt.count(self.bytes_per_token)} bytes per token ({self.states} states x "
                f"d={self.hidden_size} x 2 bytes + {TOKEN_TABLE_BYTES} for the token table)",
                f"tokens: {'' if self.prompts_exact else 'at most '}{fmt.count(self.prompt_tokens)} prompt ({exact}) + at most "
                f"{fmt.count(self.response_tokens)} response ({fmt.count(self.conversations)} conversations x "
                f"{fmt.count(self.max_new_tokens)} new tokens: an upper bound){sampled}; at most "
                f"{fmt.count(self.tokens)} stored",
                f"size: at most {fmt.size(self.total)}{budget}{free}"]


def estimate(lengths, max_new_tokens: int, num_layers: int, hidden_size: int, *, max_tokens: int | None = None,
             batch_size: int = 8, sample_positions: int | None = None, prompts_exact: bool = True) -> Estimate:
    """The Estimate of a capture of prompts of `lengths` tokens: every prompt with a full-length response (an upper
    bound: answers may end early), each conversation's tokens as kept_positions says, cut at max_tokens plus the
    largest batch (the capture starts no batch once max_tokens are recorded)."""
    lengths = [int(n) for n in lengths]
    per = [kept_positions(n + int(max_new_tokens), sample_positions) for n in lengths]
    tokens = sum(per)
    chunks = math.ceil(len(per) / max(int(batch_size), 1))
    if max_tokens is not None:     # the capture starts no batch once max_tokens are recorded: at most one more batch
        batches = [sum(per[i: i + int(batch_size)]) for i in range(0, len(per), int(batch_size))]
        tokens = min(tokens, int(max_tokens) + max(batches, default=0))
    bpt = bytes_per_token(num_layers, hidden_size)
    return Estimate(bpt, int(num_layers) + 2, int(hidden_size), int(max_new_tokens), len(lengths), sum(lengths),
                    len(lengths) * int(max_new_tokens), tokens,
                    tokens * bpt + chunks * header_bytes(num_layers), prompts_exact, sample_positions)


def capture_need(plan: Estimate, partial: Path | None = None) -> int:
    """Bytes a capture may still write: its Estimate's total less the chunks already in `partial`."""
    total = plan.total
    done = sum(f.stat().st_size for f in Path(partial).glob("chunk-*.safetensors")) if partial and Path(partial).is_dir() else 0
    return max(0, total - done)
