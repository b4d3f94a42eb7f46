"""The conversations online training learns from, and the target's regenerated answers to them.

A conversation is token ids, its prompt (chat template + generation prompt) then a response:
  responses="regenerate"  the target's own greedy response (EAGLE-3's choice), generated once and kept in the
                          store as token ids only, reused by every later run and set:
                              responses/<key>/about.json                 the model and settings they were written with
                              responses/<key>/part-<start>-<end>.json    {"responses": [{"id", "prompt_hash", "response"}]}
                          one part per `gen_batch_size` prompts [start, end), written atomically;
  responses="own"         the conversation's own first assistant turn (ShareGPT records): a forward pass only.
Conversations holds them: prompt[i] and response[i] token ids, ids[i] the prompt's id, kinds[i] its kind
(prompts/kinds.py), key the content address of exactly these conversations.

`o` is the run's OnlineOptions (draft/training/online.py), read by its fields only: online.py imports this
module, never the other way round.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from layerscope import eta, jsonsafe
from layerscope.capture.run import CaptureOptions, generate_responses
from layerscope.draft.training.fit import TrainingCancelled
from layerscope.draft.training.progress import ResponsesProgress
from layerscope.errors import DraftError
from layerscope.prompts.kinds import canonical, kind_of
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.prompts.sharegpt import sharegpt_index, sharegpt_path
from layerscope.store import Store, atomic_write_json, make_key
from layerscope.target.load import LoadedModel

RESPONSES_FORMAT = 1


@dataclass
class Conversations:
    """Token-id conversations: prompt ids then response ids (the response is what the draft learns)."""
    prompt: list[list[int]]
    response: list[list[int]]
    ids: list[str]
    key: str                            # content address of exactly these conversations
    kinds: list[str] = field(default_factory=list)   # kind of each conversation (prompts/kinds.py, first user turn)

    def __len__(self) -> int:
        return len(self.prompt)

    @property
    def tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt, self.response))


def load_conversations(target: LoadedModel, o, store: Store, *, progress=None,
                       should_stop=None) -> Conversations:
    """The conversations of o.prompts (train split for ShareGPT; o.kinds weights its draw) that fit, with
    o.responses answers; `kinds` holds each one's kind."""
    prompt_set = load_prompts(o.prompts, limit=o.limit, seed=o.sample_seed, cache=store.root / "prompts",
                              kind_weights=o.kind_weights)
    prompts = [(p, chat_ids(target.tokenizer, p)) for p in prompt_set.prompts]
    target.check_room(o.max_prompt_tokens, o.max_new_tokens, "--max-prompt-tokens", "--max-new-tokens")
    room = target.context_length - o.max_new_tokens
    prompts = [(p, ids) for p, ids in prompts if len(ids) <= min(o.max_prompt_tokens, room)]
    if not prompts:
        raise DraftError(f"No prompt of {prompt_set.name} fits in {o.max_prompt_tokens} tokens",
                         "Raise --max-prompt-tokens or choose other prompts")
    if o.responses == "own":
        convs = own_responses(target, prompts, prompt_set.content_hash, o, store)
    else:
        convs = regenerated_responses(target, prompts, prompt_set.content_hash, o, store, progress=progress,
                                      should_stop=should_stop)
    kind = {p.id: kind_of(p.text) for p, _ in prompts}
    convs.kinds = [kind[i] for i in convs.ids]
    return convs


def own_responses(target, prompts, content_hash: str, o, store: Store) -> Conversations:
    """Each ShareGPT record's first assistant turn after its first user turn, tokenized, + end of turn."""
    if not o.prompts.startswith("sharegpt"):
        raise DraftError(f"--responses own needs conversations with assistant turns; {o.prompts} has none",
                         "Use --prompts sharegpt, or --responses regenerate to have the target answer")
    path = sharegpt_path()
    where = {f"sharegpt/{rid}": (off, n) for rid, off, n in sharegpt_index(path, cache=store.root / "prompts")["records"]}
    eos = target.tokenizer.eos_token_id
    out = Conversations([], [], [], make_key({"target": target.fingerprint, "prompts": content_hash, "mode": "own",
                                               "max_prompt_tokens": o.max_prompt_tokens, "format": RESPONSES_FORMAT}))
    with open(path, "rb") as f:
        for p, ids in prompts:
            off, n = where[p.id]
            f.seek(off)
            reply = first_reply(json.loads(f.read(n)))
            if not reply:
                continue
            resp = target.tokenizer(reply, add_special_tokens=False)["input_ids"][: o.max_new_tokens]
            out.prompt.append(ids)
            out.response.append(list(resp) + ([eos] if eos is not None else []))
            out.ids.append(p.id)
    return out


def first_reply(record: dict) -> str | None:
    """The text of the first assistant ("gpt") turn that follows a user turn, or None."""
    seen_user = False
    for m in record.get("conversations") or []:
        role = m.get("from", m.get("role"))
        if role in ("human", "user"):
            seen_user = True
        elif seen_user and role in ("gpt", "assistant") and isinstance(m.get("value"), str) and m["value"].strip():
            return m["value"]
    return None


ABOUT_MAX_BYTES = 2**20    # about.json: a few hundred bytes as LayerScope writes it
ABOUT = "about.json"      # responses/<key>/about.json: the model and settings the answers were written with


def regenerated_responses(target, prompts, content_hash: str, o, store: Store, *, progress=None,
                          should_stop=None) -> Conversations:
    """The target's greedy answers, generated once into responses/<key>/: one JSON part per `gen_batch_size`
    prompts, written atomically, each row carrying its prompt id and a hash of its prompt's token ids. The key
    leaves out the limit, so a larger --limit of the same (prefix-stable) sample reuses every finished part;
    a part whose prompts differ is generated again.

    A draw weighted by kind (`kinds`) keeps its own parts (its order differs), but first takes every answer the
    unweighted draw of the same settings already holds (responses/<that key>/, matched by prompt id and prompt
    hash): a weighted order merges the unweighted one with the heavier kinds (prompts/kinds.weighted_order), so
    `--limit 4000 --kinds ...` contains the unweighted first 2,000 and answers only the rest. A reused answer was
    generated in another batch: the target's greedy answer all the same, up to float rounding under padding."""
    about = {"target": target.fingerprint, **draw_settings(o)}   # a weighted draw has its own order: its own parts
    key = make_key(about)
    root = store.path("responses", key)
    parts = [(start, prompts[start: start + o.gen_batch_size]) for start in range(0, len(prompts), o.gen_batch_size)]
    if any(read_part(root, start, batch) is None for start, batch in parts):
        with store.lock("responses", key, should_stop=should_stop):
            unweighted = make_key({"target": target.fingerprint, **draw_settings(o, weighted=False)})
            reuse = stored_answers(store.path("responses", unweighted)) if unweighted != key else {}
            if not (root / ABOUT).is_file():      # whose answers these are, for a person who keeps or copies them
                root.mkdir(parents=True, exist_ok=True)
                atomic_write_json(root / ABOUT, {"model": target.spec, **about})
            note_fitting(root, o.limit, len(prompts))
            generate_parts(target, parts, o, root, progress=progress, should_stop=should_stop, reuse=reuse)
    else:
        note_fitting(root, o.limit, len(prompts))
    out = Conversations([], [], [], make_key({"responses": key, "prompts": content_hash}))
    for start, batch in parts:
        for (p, ids), response in zip(batch, read_part(root, start, batch)):
            if response:
                out.prompt.append(ids)
                out.response.append(response)
                out.ids.append(p.id)
    return out


def draw_settings(o, weighted: bool = True) -> dict:
    """What decides a draw's answers besides the target's weights, as about.json records them (the key of
    responses/<key>/ is these with the target's fingerprint); `weighted` adds the kinds of a weighted draw."""
    weights = o.kind_weights if weighted else None
    return {"prompts": o.prompts, "seed": o.sample_seed, "mode": "regenerate", "max_new_tokens": o.max_new_tokens,
            "max_prompt_tokens": o.max_prompt_tokens, "batch": o.gen_batch_size, "format": RESPONSES_FORMAT,
            **({"kinds": canonical(weights)} if weights is not None else {})}


def read_about(root: Path) -> dict | None:
    """responses/<key>/about.json as a dict (at most ABOUT_MAX_BYTES); None when it is missing, too large or damaged:
    the answers stand without it, an estimate only reads less."""
    path = root / ABOUT
    try:
        if path.stat().st_size > ABOUT_MAX_BYTES:
            return None
        about = jsonsafe.loads(path.read_bytes(), what=str(path), error=DraftError, max_bytes=ABOUT_MAX_BYTES)
    except (OSError, DraftError):
        return None
    return about if isinstance(about, dict) else None


def fitting_of(about: dict) -> dict:
    """about.json's {str(limit): prompts of that draw that fit} (note_fitting), its malformed entries left out."""
    fits = about.get("fitting")
    return {k: v for k, v in fits.items() if type(v) is int and v >= 0} if isinstance(fits, dict) else {}


def note_fitting(root: Path, limit: int | None, fitting: int) -> None:
    """Record in about.json how many of a `limit`-conversation draw fit (prompts too long are left out), once per
    limit: what an estimate reads to know that a stored draw is whole (stored_draw). Nothing without about.json."""
    about = read_about(root)
    if about is not None and fitting_of(about).get(str(limit)) != fitting:
        atomic_write_json(root / ABOUT, {**about, "fitting": {**fitting_of(about), str(limit): fitting}})


def stored_draw(store: Store, model: str, o, conversations: int) -> tuple[int, int]:
    """(answers a draw of OnlineOptions `o` still needs, at most; answers the store holds for it) for target
    `model` (its spec, as about.json names it), read from file names only: no model, no prompts. `conversations`
    is the draw's size at most (preflight.online_conversations); a draw whose about.json says how many of its
    prompts fit (note_fitting) needs no more than those. The folder of the same settings holding most answers
    counts (another fingerprint of the same spec is another folder). Entries the store may not use (a link
    leaving it) are not read."""
    want, spec, found = draw_settings(o), str(model).strip(), []
    for root in store.entry_names("responses"):
        about = None if store.entry_problem("responses", root.name) else read_about(root)
        if (about is None or about.get("model") != spec or {k: about.get(k) for k in want} != want
                or set(about) - set(want) - {"model", "target", "fitting"}):
            continue
        n = fitting_of(about).get(str(o.limit), conversations)
        held = set()
        for path in root.glob("part-*.json"):
            m = PART_RE.fullmatch(path.name)
            if m:
                held.update(range(int(m[1]), min(int(m[2]), n)))
        found.append((n - len(held), len(held)))
    return max(found, key=lambda f: (f[1], -f[0]), default=(conversations, 0))


def stored_answers(root: Path) -> dict[tuple[str, str], list[int]]:
    """Every answer in the finished parts of responses/<key>/ `root`: {(prompt id, prompt hash): token ids}
    (nothing when there is no such folder; a part that does not read is left out)."""
    out: dict[tuple[str, str], list[int]] = {}
    for path in sorted(root.glob("part-*.json")) if root.is_dir() else ():
        try:
            rows = jsonsafe.loads(path.read_bytes(), what=f"Response part {path}", error=DraftError)["responses"]
            out.update({(str(r["id"]), str(r["prompt_hash"])): [int(t) for t in r["response"]] for r in rows})
        except (OSError, ValueError, KeyError, TypeError, DraftError):
            continue
    return out


PART_RE = re.compile(r"part-(\d{6})-(\d{6})\.json")


def part_name(start: int, end: int) -> str:
    return f"part-{start:06d}-{end:06d}.json"


def prompt_hash(ids: list[int]) -> str:
    return make_key(ids)


def read_part(root: Path, start: int, batch) -> list[list[int]] | None:
    """The stored responses of `batch` (a list of (Prompt, ids)), or None when missing or made for other prompts."""
    path = root / part_name(start, start + len(batch))
    try:
        rows = jsonsafe.loads(path.read_bytes(), what=f"Response part {path}", error=DraftError)["responses"]
    except (OSError, ValueError, KeyError, TypeError, DraftError):
        return None
    if len(rows) != len(batch) or any(r.get("id") != p.id or r.get("prompt_hash") != prompt_hash(ids)
                                      for r, (p, ids) in zip(rows, batch)):
        return None
    return [[int(t) for t in r["response"]] for r in rows]


def generate_parts(target, parts, o, root: Path, *, progress=None, should_stop=None,
                   clock: Callable[[], float] = time.monotonic, reuse: dict | None = None) -> None:
    """The answers of every part not in `root` yet. Answers found in `reuse` ({(prompt id, prompt hash): token
    ids}, stored_answers) are taken as they are; the other prompts of those parts, in order, are answered in
    batches of `gen_batch_size`, and each part is written as soon as all its answers are known (without reuse
    every batch is one part). A ResponsesProgress after every decode step and every batch, its time left from
    the rate of this run's decode steps (max_new_tokens per batch, layerscope.eta; `clock`: its seconds)."""
    opts = CaptureOptions(max_new_tokens=o.max_new_tokens)
    reuse = reuse or {}
    total = sum(len(b) for _, b in parts)
    todo = [(start, batch) for start, batch in parts if read_part(root, start, batch) is None]
    known: dict[int, list[int]] = {}                 # place among all prompts -> answer
    queue = []                                        # (place, token ids) of the prompts to answer, in order
    for start, batch in todo:
        for i, (p, ids) in enumerate(batch):
            found = reuse.get((p.id, prompt_hash(ids)))
            if found is None:
                queue.append((start + i, ids))
            else:
                known[start + i] = found
    reused, waiting = len(known), list(todo)
    batches = [queue[i: i + o.gen_batch_size] for i in range(0, len(queue), o.gen_batch_size)]
    timer, made = eta.PhaseClock(len(batches) * o.max_new_tokens, clock=clock), 0

    def say(n, step=0):
        if progress is not None:
            elapsed = clock() - timer.t0
            progress(ResponsesProgress(done=n, total=len(batches), conversations=total,
                                       tokens_per_s=made / max(elapsed, 1e-9),
                                       eta_s=timer.left(n * o.max_new_tokens + step), step=step, elapsed_s=elapsed,
                                       prompts=len(queue), reused=reused))

    def write_complete():
        nonlocal waiting
        complete = [all(start + i in known for i in range(len(batch))) for start, batch in waiting]
        for (start, batch), done in zip(waiting, complete):
            if done:
                atomic_write_json(root / part_name(start, start + len(batch)),
                                  {"responses": [{"id": p.id, "prompt_hash": prompt_hash(ids),
                                                  "response": known[start + i]} for i, (p, ids) in enumerate(batch)]})
        waiting = [w for w, done in zip(waiting, complete) if not done]

    write_complete()                                  # parts answered entirely by `reuse`
    for n, chunk in enumerate(batches):
        if should_stop is not None and should_stop():
            raise TrainingCancelled(f"Stopped while generating responses ({n} of {len(batches)} batches done)",
                                    "Run the same command again to resume")
        responses = generate_responses(target, [ids for _, ids in chunk], opts, should_stop=should_stop,
                                       on_step=lambda step, n=n: say(n, min(step, o.max_new_tokens)))
        if should_stop is not None and should_stop():
            raise TrainingCancelled(f"Stopped while generating responses ({n} of {len(batches)} batches done)",
                                    "Run the same command again to resume")
        known.update({place: r for (place, _), r in zip(chunk, responses)})
        write_complete()
        made += sum(len(r) for r in responses)
        say(n + 1)
    if not batches:
        say(0)
