"""Continuing a draft (--init-from) on tiny-llama: it starts from the draft's weights and vocabulary, records
where it started, keys its run by the starting weights' content, and refuses a draft that does not fit the run."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerscope.commands.cli import main
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions, run_key, train_online
from layerscope.draft.training.responses import load_conversations
from layerscope.draft.training.train import draft_for
from layerscope.errors import DraftError
from layerscope.store import Store
from tests.helpers import SMALL_ONLINE as SMALL


def weights(path) -> dict:
    return load_file(str(Path(path) / "model.safetensors"))


def meta(path) -> dict:
    return json.loads((Path(path) / "layerscope.json").read_text())


@pytest.fixture
def started(tiny, tmp_path, one_thread):
    """A store and a 3-step online draft on layers [1, 2] to continue."""
    store = Store(tmp_path / "s")
    first = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=3)).drafts[0]
    return store, first


def test_a_continued_draft_starts_from_the_drafts_weights(tiny, started, one_thread):
    store, first = started
    # a learning rate of 1e-30 leaves every weight where it started: the start is the draft, not a fresh head
    still = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, lr=1e-30,
                                                                      init_from=(first.path,))).drafts[0]
    a, b = weights(first.path), weights(still.path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, lr=1e-30)).drafts[0]
    assert not torch.equal(weights(fresh.path)["fc.weight"], a["fc.weight"])
    # trained on, it moves; its record says where it started and how many tokens both runs saw
    more = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=3, init_from=(first.path,))).drafts[0]
    assert not torch.equal(weights(more.path)["fc.weight"], a["fc.weight"])
    assert torch.equal(weights(more.path)["d2t"], a["d2t"])                 # the vocabulary is kept
    m = meta(more.path)
    assert m["init_from"]["path"] == first.path and m["init_from"]["tokens_seen"] == first.tokens_seen
    assert len(m["init_from"]["sha256"]) == 64
    assert m["tokens_seen_total"] == first.tokens_seen + more.tokens_seen == more.tokens_seen_total
    assert m["options"]["init_from"] == [first.path]


def test_a_continued_draft_keeps_its_starting_drafts_strategy_label_unless_the_run_names_one(tiny, tmp_path, one_thread):
    store = Store(tmp_path / "s")
    first = train_online(tiny, [[1, 2]], store, strategy=["probe"], options=OnlineOptions(**SMALL, steps=1)).drafts[0]
    assert meta(first.path)["strategy"] == "probe"
    kept = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, init_from=(first.path,))).drafts[0]
    assert meta(kept.path)["strategy"] == "probe"
    named = train_online(tiny, [[1, 2]], store, strategy=["manual"],
                         options=OnlineOptions(**SMALL, steps=2, init_from=(first.path,))).drafts[0]
    assert meta(named.path)["strategy"] == "manual"
    unlabelled = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=2)).drafts[0]
    assert meta(unlabelled.path)["strategy"] is None


def test_the_run_is_keyed_by_the_starting_weights_not_their_path(tiny, started, tmp_path, one_thread):
    store, first = started
    copy = tmp_path / "copy"
    shutil.copytree(first.path, copy)
    convs = load_conversations(tiny, OnlineOptions(**SMALL, steps=1), store)
    key = lambda o: run_key(tiny, convs, [[1, 2]], o)                                   # noqa: E731
    here, there = (OnlineOptions(**SMALL, steps=1, init_from=(p,)) for p in (first.path, str(copy)))
    assert key(here) != key(OnlineOptions(**SMALL, steps=1))
    assert key(here) == key(there)                                                       # the same weights elsewhere
    w = weights(copy)
    w["fc.weight"] = w["fc.weight"] + 1
    save_file(w, str(copy / "model.safetensors"))
    assert key(there) != key(here)                                                       # other weights: another run


def test_a_draft_that_does_not_fit_the_run_is_refused_in_one_line(tiny, started, one_thread):
    store, first = started
    cases = [([[0, 3]], {}, "no starting draft for"),                          # other layers
             ([[1, 2], [0, 3]], {}, "no starting draft for [[0, 3]]"),         # a set without one
             ([[1, 2]], {"draft_vocab": 32}, "Pass --draft-vocab 64")]          # another vocabulary size
    for sets, extra, message in cases:
        with pytest.raises(DraftError, match=message.replace("[", r"\[").replace("]", r"\]")):
            train_online(tiny, sets, store, options=OnlineOptions(**{**SMALL, **extra}, steps=1, init_from=(first.path,)))
    with pytest.raises(DraftError, match="Two --init-from drafts read layers"):
        train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, init_from=(first.path, first.path)))
    with pytest.raises(DraftError, match="Leave out --warm-start"):
        OnlineOptions(**SMALL, steps=1, warm_start=2, init_from=(first.path,)).validate()


def test_capture_training_continues_a_draft_too(tiny, tiny_capture, tmp_path, one_thread):
    store = Store(tmp_path / "s")
    o = TrainOptions(steps=3, batch_size=2, seq_len=32, draft_vocab=64, eval_points=1)
    first = draft_for(tiny_capture, [0, 3], tiny, store, options=o)
    still = draft_for(tiny_capture, [0, 3], tiny, store, options=replace(o, steps=1, lr=1e-30, init_from=(str(first),)))
    assert still != first
    a, b = weights(first), weights(still)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert meta(still)["tokens_seen_total"] == meta(first)["tokens_seen"] + meta(still)["tokens_seen"]


def test_cli_continues_a_draft_and_names_a_missing_one(tiny, started, capsys, one_thread):
    store, first = started
    base = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10",
            "--layers", "1,2", "--steps", "2", "--batch-size", "3", "--seq-len", "64", "--draft-vocab", "64",
            "--val-conversations", "2", "--eval-points", "2", "--store", str(store.root)]
    key = Path(first.path).name                     # a stored draft's key works like its directory
    assert main(base + ["--init-from", key]) == 0
    seen = re.search(r"(\d+) tokens seen \((\d+) with the draft it continued\)", capsys.readouterr().out)
    assert seen and int(seen[2]) == first.tokens_seen + int(seen[1])
    assert main(base + ["--init-from", str(store.root / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(base + ["--init-from", "builtin"]) == 2                 # the shipped draft is SmolLM2-135M's
    assert "builtin" in capsys.readouterr().err


def test_a_continued_run_holds_out_what_its_starting_draft_held_out(tiny, started, one_thread):
    """More conversations (a larger --limit) would give another seeded split, one that may hold out conversations
    the starting draft trained on; the continued run keeps the starting draft's held-out conversations instead,
    recorded (val_ids) or, for a draft from before they were recorded, recomputed from its options."""
    store, first = started
    held = meta(first.path)["online"]["val_ids"]
    assert len(held) == 2 and meta(first.path)["online"]["held_out_from"] == "own"
    wider = dict(SMALL, limit=20)
    own = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**wider, steps=1)).drafts[0]
    assert set(meta(own.path)["online"]["val_ids"]) != set(held)          # the split a larger sample draws itself
    more = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**wider, steps=1, init_from=(first.path,))).drafts[0]
    m = meta(more.path)["online"]
    assert set(m["val_ids"]) == set(held) and m["held_out_from"] == "init_from"
    # an older draft without val_ids: the same conversations, from its recorded options
    old = json.loads((Path(first.path) / "layerscope.json").read_text())
    del old["online"]["val_ids"]
    (Path(first.path) / "layerscope.json").write_text(json.dumps(old))
    again = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**wider, steps=2, init_from=(first.path,))).drafts[0]
    assert set(meta(again.path)["online"]["val_ids"]) == set(held)


def test_fc_norm_is_trained_recorded_and_kept_by_a_continued_draft(tiny, started, capsys, one_thread):
    store, _ = started
    plain = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, fc_norm=False)).drafts[0]
    args = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10",
            "--layers", "1,2", "--steps", "2", "--batch-size", "3", "--seq-len", "64", "--draft-vocab", "64",
            "--val-conversations", "2", "--eval-points", "2", "--store", str(store.root), "--json"]
    assert main(args) == 0                                             # fc_norm is on by default
    path = json.loads(capsys.readouterr().out)["drafts"][0]["path"]
    assert json.loads((Path(path) / "config.json").read_text())["fc_norm"] is True
    assert meta(path)["fc_norm"] is True and meta(path)["options"]["fc_norm"] is True
    w = weights(path)
    assert sorted(k for k in w if k.startswith("fc_norm.")) == ["fc_norm.0.weight", "fc_norm.1.weight"]
    assert not torch.equal(w["fc_norm.0.weight"], torch.ones_like(w["fc_norm.0.weight"]))   # trained, not left at 1
    # continued with fc_norm, the draft starts from its own norms; a run that differs is refused, naming the option
    still = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, lr=1e-30, fc_norm=True,
                                                                      init_from=(path,))).drafts[0]
    assert all(torch.equal(w[k], weights(still.path)[k]) for k in w)
    with pytest.raises(DraftError, match="Pass --fc-norm"):
        train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, fc_norm=False, init_from=(path,)))
    with pytest.raises(DraftError, match="Pass --no-fc-norm"):                 # the default run continuing a plain draft
        train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, init_from=(plain.path,)))
    assert main(args + ["--init-from", plain.path]) == 2 and "Pass --no-fc-norm" in capsys.readouterr().err
    # off, the option leaves a run's store key as it was before it existed; on (the default), it is another run
    assert "fc_norm" not in OnlineOptions(**SMALL, steps=1, fc_norm=False).run_fields()
    assert OnlineOptions(**SMALL, steps=1).run_fields()["fc_norm"] is True


def test_a_narrower_mlp_is_trained_sized_saved_and_kept_by_a_continued_draft(tiny, started, capsys, one_thread):
    """--draft-intermediate: the draft's MLP width (a large target's draft at the target's width is over 100 MB)."""
    from layerscope.draft.size import draft_params

    store, wide = started
    narrow = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, draft_intermediate=24)).drafts[0]
    w = weights(narrow.path)
    d = tiny.model.config.hidden_size
    assert w["midlayer.mlp.gate_proj.weight"].shape == (24, d) and w["midlayer.mlp.down_proj.weight"].shape == (d, 24)
    assert json.loads((Path(narrow.path) / "config.json").read_text())["intermediate_size"] == 24
    assert weights(wide.path)["midlayer.mlp.up_proj.weight"].shape == (tiny.model.config.intermediate_size, d)
    # the size the forecast and the disk checks use is the file's, exactly
    assert draft_params(tiny.model.config, [1, 2], 64, 24) == sum(t.numel() for t in w.values())
    # left out, the option leaves every stored run's key as it was; given, it is another run
    assert "draft_intermediate" not in OnlineOptions(**SMALL, steps=1).run_fields()
    assert OnlineOptions(**SMALL, steps=1, draft_intermediate=24).run_fields()["draft_intermediate"] == 24
    # continued, the draft keeps its width: a run of another width is refused naming the width to pass
    with pytest.raises(DraftError, match="Pass --draft-intermediate 24"):
        train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, init_from=(narrow.path,)))
    still = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**SMALL, steps=1, lr=1e-30, draft_intermediate=24,
                                                                      init_from=(narrow.path,))).drafts[0]
    assert all(torch.equal(w[k], weights(still.path)[k]) for k in w)
    args = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--layers", "1,2",
            "--steps", "1", "--draft-vocab", "64", "--store", str(store.root)]
    assert main(args + ["--draft-intermediate", "0"]) == 2
    assert "draft_intermediate" in capsys.readouterr().err


def test_bfloat16_training_is_another_run_whose_draft_learns_and_stays_float32(tiny, started, capsys, one_thread):
    """--train-dtype bfloat16: the draft's forward and backward under autocast, its weights and held-out evaluation in
    float32; a run without it keeps the key it had before the option existed."""
    store, _ = started
    o = dict(SMALL, steps=4, lr=3e-3)
    exact = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**o)).drafts[0]
    fast = train_online(tiny, [[1, 2]], store, options=OnlineOptions(**o, train_dtype="bfloat16")).drafts[0]
    assert fast.path != exact.path
    a, b = weights(exact.path), weights(fast.path)
    assert b["fc.weight"].dtype == torch.float32 and not torch.equal(a["fc.weight"], b["fc.weight"])
    assert meta(fast.path)["options"]["train_dtype"] == "bfloat16"
    assert all(0.0 <= x <= 1.0 for x in meta(fast.path)["val_accuracy"])
    assert "train_dtype" not in OnlineOptions(**o).run_fields()
    with pytest.raises(DraftError, match="Pass --train-dtype float32"):
        OnlineOptions(**o, train_dtype="float16").validate()
    args = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--layers", "1,2",
            "--steps", "1", "--draft-vocab", "64", "--store", str(store.root), "--train-dtype", "float16"]
    with pytest.raises(SystemExit):
        main(args)
    assert "invalid choice: 'float16'" in capsys.readouterr().err
