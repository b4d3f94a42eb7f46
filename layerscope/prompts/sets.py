"""Prompt sets: the builtin set, ShareGPT, and user files; rendering a prompt for a model.

load_prompts(spec) -> PromptSet, where spec is "builtin", "sharegpt", "sharegpt-heldout", or the path
of a .jsonl / .txt / .csv / .json file. The same spec, limit, seed and split always give the same
prompts in the same order, and `content_hash` names exactly those prompts (capture keys use it).

Sampling. Without a limit (or with one >= the set's size) a set is all of its prompts in file order.
With a smaller limit it is a seeded sample in draw order, so at one seed limit=10 is a prefix of
limit=20. The builtin sample is stratified: it takes categories in turn.

ShareGPT is read through the cached index of its records (layerscope/prompts/sharegpt.py; a hash of the
record id holds out 5%: split="heldout"). A ShareGPT draw can weight its records by kind (kind_weights,
prompts/kinds.py: train-draft --kinds): the records of the split, in kinds.weighted_order, which equal
weights make the plain draw's order; a kind of weight 0 is left out, and without a limit the records of
the other kinds come in file order. User files are read by layerscope/prompts/files.py, line by
line under size limits; a record becomes a Prompt as layerscope/prompts/record.py says. Their names
are importable from here too.

Turns. A prompt keeps up to `turns` user turns (default 1). Only user turns are known, so
chat_ids renders the first turn alone unless asked for more.
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
from dataclasses import dataclass, field
from pathlib import Path

from layerscope.errors import PromptSetError
from layerscope.prompts.files import (
    file_lines,
    read_jsonl,
    user_file,
    user_path,
)
from layerscope.prompts.kinds import weighted_order
from layerscope.prompts.record import Prompt, user_turns
from layerscope.prompts.sharegpt import (
    cache_dir,
    is_heldout,
    sharegpt_index,
    sharegpt_kinds,
    sharegpt_path,
)

BUILTIN_PATH = Path(__file__).resolve().parents[1] / "data" / "builtin_prompts.jsonl"
PREVIEW_CHARS = 200


class NoPromptFits(PromptSetError):
    """No prompt of the set fits the token limit (load_fitting_prompts): the caller may name what set the limit."""


@dataclass
class PromptSet:
    """An ordered list of prompts, with the hash that names them and what was skipped while loading."""

    name: str           # "builtin", "sharegpt", "sharegpt-heldout", or the file name
    prompts: list[Prompt]
    content_hash: str   # sha256 hex over ids, categories and turns of `prompts`, in order
    warnings: list[str] = field(default_factory=list)   # e.g. "line 7: not valid JSON: ..."

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        return iter(self.prompts)

    def __getitem__(self, i):
        return self.prompts[i]


def load_prompts(spec: str, *, limit: int | None = None, seed: int = 0, split: str = "train",
                 turns: int = 1, cache: Path | None = None, kind_weights: dict[str, float] | None = None) -> PromptSet:
    """Resolve a prompt-set spec into a PromptSet; raises PromptSetError on anything unusable.

    limit: at most this many prompts (a seeded sample when it cuts); None = all.
    split: "train" or "heldout" (ShareGPT only; "sharegpt-heldout" implies "heldout").
    turns: how many user turns each prompt keeps (ShareGPT and multi-turn file records).
    cache: where the ShareGPT index is kept (a store's prompts/ folder; default `cache_dir()`).
    kind_weights: ShareGPT only: {kind: weight} for every kind of kinds.KINDS (kinds.parse_weights).
    """
    limit, seed, turns = _check_options(limit, seed, split, turns)
    spec = str(spec).strip()
    warnings: list[str] = []
    if spec == "sharegpt-heldout":
        spec, split = "sharegpt", "heldout"
    if kind_weights is not None and spec != "sharegpt":
        raise PromptSetError(f"weights by kind draw ShareGPT conversations; {spec} is another prompt set",
                             "Use the ShareGPT set, or leave the weights by kind out")
    if spec == "sharegpt":
        name = "sharegpt" if split == "train" else "sharegpt-heldout"
        prompts = _sharegpt(limit, seed, split, turns, cache or cache_dir(), kind_weights)
    elif spec == "builtin":
        _no_split("the builtin set", split)
        name, prompts = "builtin", _builtin(limit, seed)
    else:
        path = user_path(spec)
        _no_split(path.name, split)
        name = path.name
        prompts, warnings = user_file(path, turns)
        prompts = _sample(prompts, limit, seed)
    return PromptSet(name, prompts, content_hash(prompts), warnings)


def check_spec(spec: str, split: str = "train") -> None:
    """The cheap part of load_prompts, for a command's preflight: the named set exists and opens (a file is
    a regular file of a known type under the size limit; ShareGPT's package is installed). Nothing is read."""
    spec = str(spec).strip()
    if spec in ("sharegpt", "sharegpt-heldout"):
        sharegpt_path()
    elif spec != "builtin":
        user_path(spec)


def content_hash(prompts: list[Prompt]) -> str:
    """sha256 hex of the canonical JSON of [{id, category, turns}] in order."""
    doc = [{"id": p.id, "category": p.category, "turns": list(p.turns)} for p in prompts]
    text = json.dumps(doc, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_options(limit, seed, split, turns) -> tuple[int | None, int, int]:
    def whole(name, value, fix):
        try:
            if isinstance(value, bool):
                raise TypeError
            return operator.index(value)
        except TypeError:
            raise PromptSetError(f"{name} {value!r} is not a whole number", fix) from None

    limit_fix = "Pass a limit of 1 or more, or none to use the whole set"
    if limit is not None:
        limit = whole("limit", limit, limit_fix)
        if limit < 1:
            raise PromptSetError(f"limit {limit} asks for no prompts", limit_fix)
    seed = whole("seed", seed, "Pass an integer seed, e.g. 0")
    turns = whole("turns", turns, "Pass turns=1 or more")
    if turns < 1:
        raise PromptSetError(f"turns {turns} keeps no user turn", "Pass turns=1 or more")
    if split not in ("train", "heldout"):
        raise PromptSetError(f"split {split!r} is unknown", "Use split='train' (the default) or 'heldout'")
    return limit, seed, turns


def _no_split(what: str, split: str) -> None:
    if split != "train":
        raise PromptSetError(f"{what} has no held-out split",
                             "Use split='heldout' (or the spec sharegpt-heldout) only with ShareGPT")


def _sample(items: list, limit: int | None, seed: int) -> list:
    """All items in order (no limit), or the first `limit` of a seeded shuffle: prefix-stable in limit,
    also past the set's size, so a larger limit only ever appends prompts."""
    if limit is None:
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[:limit]]


# -----------------------------------------------------------------------------
# builtin

def _builtin(limit: int | None, seed: int) -> list[Prompt]:
    """The project's own prompts, ids "builtin/<category>/<nn>" (nn counts from 01 per category)."""
    loaded, warnings = read_jsonl(file_lines(BUILTIN_PATH), turns=1)
    if warnings or not loaded:
        raise PromptSetError(f"the builtin prompt file {BUILTIN_PATH} is damaged ({(warnings or ['empty'])[0]})",
                             "Reinstall LayerScope")
    by_category: dict[str, list[Prompt]] = {}
    for p in loaded:
        same = by_category.setdefault(p.category, [])
        same.append(Prompt(f"builtin/{p.category}/{len(same) + 1:02d}", p.category, p.turns))
    prompts = [p for same in by_category.values() for p in same]
    if limit is None or limit >= len(prompts):
        return prompts
    rng = random.Random(seed)   # stratified: shuffle inside each category, then take categories in turn
    for same in by_category.values():
        rng.shuffle(same)
    rounds = max(len(same) for same in by_category.values())
    drawn = [same[i] for i in range(rounds) for same in by_category.values() if i < len(same)]
    return drawn[:limit]


# -----------------------------------------------------------------------------
# ShareGPT

def _sharegpt(limit: int | None, seed: int, split: str, turns: int, cache: Path,
              kind_weights: dict[str, float] | None = None) -> list[Prompt]:
    path = sharegpt_path()
    held = split == "heldout"
    entries = [e for e in sharegpt_index(path, cache)["records"] if is_heldout(e[0]) == held]
    if kind_weights is None:
        drawn = _sample(entries, limit, seed)
    else:                          # only the split's records are weighted: the held-out 5% stays out of training
        kind = sharegpt_kinds(path, cache)
        order = weighted_order([kind[e[0]] for e in entries], kind_weights, seed)
        drawn = [entries[i] for i in (sorted(order) if limit is None else order[:limit])]
    prompts = []
    with open(path, "rb") as f:
        for record_id, offset, length in drawn:
            f.seek(offset)
            user, problem = user_turns(json.loads(f.read(length)), turns)
            if user is None:
                raise PromptSetError(f"ShareGPT record {record_id} no longer reads as indexed ({problem})",
                                     f"Delete the cached index in {cache} and load again")
            prompts.append(Prompt(f"sharegpt/{record_id}", "sharegpt", user))
    return prompts


# -----------------------------------------------------------------------------
# rendering

def chat_ids(tokenizer, prompt: Prompt, *, turns: int = 1) -> list[int]:
    """Token ids [T] the model reads before it answers `prompt`.

    With a chat template: the first `turns` user turns as consecutive user messages plus the
    generation prompt (no replies are known; templates that insist on alternation need turns=1).
    Without one: the plain text of those turns joined by blank lines, with the special tokens
    (e.g. BOS) that the tokenizer itself adds.
    """
    texts = prompt.turns[:max(1, turns)]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": t} for t in texts]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out   # transformers 5 returns a BatchEncoding
    else:
        ids = tokenizer("\n\n".join(texts))["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):   # a batch of one
        ids = ids[0]
    return [int(i) for i in ids]


def load_fitting_prompts(spec: str, tokenizer, *, limit: int | None, max_tokens: int | None, seed: int = 0,
                         split: str = "train", turns: int = 1, cache: Path | None = None) -> PromptSet:
    """`limit` prompts of the seeded sample whose `chat_ids` fit in `max_tokens` tokens.

    A longer prompt is replaced by the next one of the same sample, so asking for 20 gives 20 while
    the set has them; `warnings` says how many were replaced, `content_hash` covers the prompts kept.
    """
    if max_tokens is None:
        return load_prompts(spec, limit=limit, seed=seed, split=split, turns=turns, cache=cache)
    want = limit
    while True:
        loaded = load_prompts(spec, limit=want, seed=seed, split=split, turns=turns, cache=cache)
        kept, skipped = [], 0
        for p in loaded.prompts:
            if limit is not None and len(kept) == limit:
                break
            if len(chat_ids(tokenizer, p, turns=turns)) <= max_tokens:
                kept.append(p)
            else:
                skipped += 1
        if want is None or len(loaded.prompts) < want or len(kept) == limit:
            break
        want += 2 * (limit - len(kept)) + 8
    if not kept:
        raise NoPromptFits(f"no prompt of {loaded.name} fits in {max_tokens} tokens",
                           "Raise the prompt-token limit or use another prompt set")
    warnings = list(loaded.warnings)
    if skipped:
        warnings.append(f"left out {skipped} prompts longer than {max_tokens} tokens"
                        + (", taking the next ones of the sample instead" if limit is not None else ""))
    if limit is not None and len(kept) < limit:
        warnings.append(f"only {len(kept)} prompts of {loaded.name} fit in {max_tokens} tokens")
    return PromptSet(loaded.name, kept, content_hash(kept), warnings)


def prompt_preview(prompt_set: PromptSet, n: int = 5) -> list[dict]:
    """The first n prompts as {id, category, text (<= 200 chars), turns} rows for a table."""
    rows = []
    for p in prompt_set.prompts[:n]:
        text = p.turns[0] if len(p.turns[0]) <= PREVIEW_CHARS else p.turns[0][:PREVIEW_CHARS - 1] + "…"
        rows.append({"id": p.id, "category": p.category, "text": text, "turns": len(p.turns)})
    return rows
