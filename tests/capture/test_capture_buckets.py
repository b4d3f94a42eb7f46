"""Length-bucketed capture batches: a long prompt pads only prompts of its own length, the stored capture is the one
each conversation alone would give, and a capture interrupted mid-window resumes to the same bytes."""

from __future__ import annotations

import json

import pytest
import torch

from layerscope.capture.run import BUCKET_BATCHES, capture
from layerscope.capture.stored import open_capture
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import Store

pytestmark = pytest.mark.usefixtures("one_thread")

# 20 prompts, short and long in turn (distinct lengths: a prompt's length names its conversation); at batch size 2
# the capture's batches pair each short prompt with a long one, and its 10 batches make two windows (8 and 2)
CHARS = [3, 150, 5, 140, 8, 130, 10, 120, 12, 110, 15, 100, 18, 90, 20, 80, 25, 70, 30, 60]
TEXT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
OPTIONS = dict(max_new_tokens=6, batch_size=2)


@pytest.fixture(scope="module")
def prompt_set(tmp_path_factory):
    path = tmp_path_factory.mktemp("bucket-prompts") / "mixed.jsonl"
    path.write_text("".join(json.dumps({"prompt": TEXT[:n]}) + "\n" for n in CHARS))
    return load_prompts(str(path))


class Forwards:
    """Every forward of the target's decoder stack while it is watched: (attention mask, a record pass or not)."""

    def __init__(self, loaded):
        self.loaded, self.calls = loaded, []

    def __enter__(self):
        self.handle = self.loaded.model.model.register_forward_pre_hook(self.seen, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def seen(self, module, args, kwargs):
        mask, ids = kwargs["attention_mask"], kwargs["input_ids"]
        self.calls.append((mask.detach().cpu().clone(), ids.shape[1] > 1, kwargs.get("use_cache") is False))

    def generation_batches(self) -> list[list[int]]:
        """The prompt lengths of each generated batch (its prefill: the forward over whole prompts), in order."""
        return [sorted(mask.sum(1).tolist()) for mask, whole, rec in self.calls if whole and not rec]

    def padding(self, records: bool) -> int:
        """Padding tokens of the generation prefills (records False) or of the record forwards (True)."""
        return sum(int((mask == 0).sum()) for mask, whole, rec in self.calls if whole and rec == records)


def assert_bucketed(batches: list[list[int]]) -> None:
    """Batches of neighbours by length: no two overlap in range."""
    spans = sorted((min(b), max(b)) for b in batches)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans


def contiguous_padding(lengths: list[int], batch_size: int) -> int:
    """Padding tokens of batches of `batch_size` consecutive conversations (the unbucketed rule)."""
    return sum(max(b) * len(b) - sum(b) for b in (lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)))


def conversation_lengths(cap) -> list[int]:
    conv = cap.tokens()["conversation"]
    return torch.bincount(conv).tolist()


def test_batches_are_bucketed_by_prompt_length_and_pad_far_less(tiny, prompt_set, store):
    prompt_lengths = [len(chat_ids(tiny.tokenizer, p)) for p in prompt_set.prompts]
    assert len(set(prompt_lengths)) == len(CHARS)
    with Forwards(tiny) as seen:
        result = capture(tiny, prompt_set, store, **OPTIONS)
    batches = seen.generation_batches()
    assert sorted(sum(batches, [])) == sorted(prompt_lengths)            # every conversation generated once
    windows = [prompt_lengths[:2 * BUCKET_BATCHES], prompt_lengths[2 * BUCKET_BATCHES:]]
    for window in windows:                       # each window's conversations, by prompt length, two by two
        mine = [b for b in batches if set(b) <= set(window)]
        assert_bucketed(mine)
        assert sorted(mine) == [sorted(window)[i:i + 2] for i in range(0, len(window), 2)]
    # the padding the unbucketed rule (consecutive conversations) gives, against what was padded
    total = conversation_lengths(open_capture(store, result.key))
    before = contiguous_padding(prompt_lengths, 2) + contiguous_padding(total, 2)
    after = seen.padding(records=False) + seen.padding(records=True)
    assert before > 1000 and after < before / 10, (before, after)
    # the stored capture keeps its conversations in the prompt set's order, chunk by chunk
    cap = open_capture(store, result.key)
    assert [c["start"] for c in cap.manifest["chunks"]] == list(range(0, 20, 2))
    assert [p["id"] for p in cap.manifest["prompts"]] == [p.id for p in prompt_set.prompts]


def test_bucketed_capture_equals_each_conversation_captured_alone(tiny, prompt_set, tmp_path):
    """Per conversation, the bucketed capture (batch size 2) holds what a capture of batch size 1 holds (no
    padding at all): the same tokens, and the same states and entropies within float16 storage."""
    bucketed, alone = Store(tmp_path / "bucketed"), Store(tmp_path / "alone")
    with Forwards(tiny) as seen:
        a = open_capture(bucketed, capture(tiny, prompt_set, bucketed, **OPTIONS).key)
    assert_bucketed(seen.generation_batches())
    b = open_capture(alone, capture(tiny, prompt_set, alone, max_new_tokens=6, batch_size=1).key)
    ta, tb = a.tokens(), b.tokens()
    for name in ("token_id", "position", "conversation", "is_response"):
        assert torch.equal(ta[name], tb[name]), name
    assert torch.allclose(ta["entropy"], tb["entropy"], atol=1e-4)
    for layer in range(tiny.num_layers + 1):
        assert torch.allclose(a.layer(layer), b.layer(layer), rtol=1e-2, atol=1e-2), layer
    assert torch.allclose(a.prenorm_final(), b.prenorm_final(), rtol=1e-2, atol=1e-2)
    bucketed.close()
    alone.close()


def test_capture_interrupted_mid_window_resumes_to_the_same_bytes(tiny, prompt_set, tmp_path):
    """Stopped after 5 of the first window's 8 chunks, the resumed capture generates again exactly the bucketed
    batches that hold a conversation of a missing chunk, and its chunks are the uninterrupted capture's, byte for
    byte."""
    whole, resumed = Store(tmp_path / "whole"), Store(tmp_path / "resumed")
    with Forwards(tiny) as seen:
        reference = capture(tiny, prompt_set, whole, **OPTIONS)
    every = seen.generation_batches()
    assert_bucketed(every[:BUCKET_BATCHES])
    records = []
    with pytest.raises(Exception, match="10 of 20 conversations are saved"):
        capture(tiny, prompt_set, resumed, should_stop=lambda: len(records) >= 5,
                progress=lambda p: p.phase == "record" and records.append(p.conversations_done), **OPTIONS)
    assert records == [0, 2, 4, 6, 8]
    with Forwards(tiny) as again:
        result = capture(tiny, prompt_set, resumed, progress=lambda p: p.phase == "record" and records.append(
            p.conversations_done), **OPTIONS)
    assert records[5:] == list(range(10, 20, 2))                       # only the missing chunks were recorded
    prompt_lengths = [len(chat_ids(tiny.tokenizer, p)) for p in prompt_set.prompts]
    missing = set(prompt_lengths[10:])
    assert again.generation_batches() == [b for b in every if missing.intersection(b)]
    assert result.key == reference.key and not result.cached
    assert result.manifest["chunks"] == reference.manifest["chunks"]     # names, sizes and sha256
    for c in reference.manifest["chunks"]:
        assert (result.path / c["file"]).read_bytes() == (reference.path / c["file"]).read_bytes(), c["file"]
    whole.close()
    resumed.close()
