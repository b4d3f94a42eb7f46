"""One prompt, and how a JSON record (a ShareGPT record, a line of a .jsonl file) becomes one.

A record is one of
    {"prompt": str}
    {"turns": [str, ...]}
    {"conversations" | "messages": [{"from" | "role": "human" | "user" | ..., "value" | "content": str}, ...]}
with an optional "category" string. Only the user's turns are kept; empty and non-text turns are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

USER_ROLES = ("human", "user")


@dataclass(frozen=True)
class Prompt:
    """One prompt. `turns` are the user's turns in order; turns[0] is the prompt."""

    id: str             # stable within its set: "builtin/math/03", "sharegpt/<record id>", "file/12"
    category: str       # "writing", "coding", ...; "sharegpt" / "file" when unknown
    turns: tuple[str, ...]

    @property
    def text(self) -> str:
        return self.turns[0]


def user_turns(record, turns: int) -> tuple[tuple[str, ...] | None, str]:
    """The first `turns` non-empty text user turns of a record -> (turns, "") or (None, problem)."""
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if "prompt" in record:
        where, texts = "'prompt'", [record["prompt"]]
    elif "turns" in record:
        where, texts = "'turns'", record["turns"] if isinstance(record["turns"], list) else []
    elif "conversations" in record or "messages" in record:
        where = "'conversations'" if "conversations" in record else "'messages'"
        messages = record.get("conversations", record.get("messages"))
        messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        texts = [m.get("value", m.get("content")) for m in messages if m.get("from", m.get("role")) in USER_ROLES]
    else:
        return None, "no 'prompt', 'turns' or 'conversations' field"
    kept = tuple(t.strip() for t in texts if isinstance(t, str) and t.strip())
    if not kept:
        return None, f"{where} holds no non-empty text user turn"
    return kept[:turns], ""


def record_category(record: dict, default: str = "file") -> str:
    """The record's "category" string, stripped, else `default`."""
    category = record.get("category")
    return category.strip() if isinstance(category, str) and category.strip() else default
