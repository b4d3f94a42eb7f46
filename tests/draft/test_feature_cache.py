"""Online training's feature cache (draft/training/feature_cache.py): a conversation's features read back exactly as
its first forward gave them, damaged or foreign files computed again, a run over two epochs forwarding each training
conversation once, and the cache turned off where asked or where the disk has no room."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from layerscope.commands.cli import main
from layerscope.draft.training.feature_cache import FIRST_EPOCH, FOLDER, FREE_AFTER, FeatureCache, cache_bytes, room
from layerscope.draft.training.online import (
    OnlineOptions,
    cached_features,
    conversation_rows,
    epoch_batches,
    target_features,
    train_online,
    within_first_epoch,
)
from layerscope.draft.training.responses import Conversations
from layerscope.store import Store
from tests.helpers import SMALL_ONLINE as SMALL


def conversations(n: int, vocab: int) -> Conversations:
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(n)]
    response = [torch.randint(3, vocab, (4 + (7 * i) % 5,), generator=g).tolist() for i in range(n)]
    return Conversations(prompt, response, [f"c{i}" for i in range(n)], "test")


def test_a_kept_conversation_reads_back_whole_and_a_damaged_or_foreign_file_is_computed_again(tmp_path):
    cache = FeatureCache(tmp_path / "f", [4, 1])
    batch = {1: torch.randn(9, 8).half(), 4: torch.randn(9, 8).half()}
    cache.put(3, {l: t[2:7] for l, t in batch.items()})           # a conversation's rows: views into its batch
    got = cache.get(3, 5, 8)
    assert list(got) == [1, 4] and all(torch.equal(got[l], batch[l][2:7]) and got[l].dtype == torch.float16 for l in got)
    wide = {1: torch.full((2, 8), 1e6, dtype=torch.bfloat16), 4: torch.zeros(2, 8, dtype=torch.bfloat16)}
    cache.put(5, wide)                                             # bfloat16 where float16 would overflow: kept so
    back = cache.get(5, 2, 8)
    assert all(torch.equal(back[l], wide[l]) and back[l].dtype == torch.bfloat16 for l in (1, 4))
    assert cache.get(0, 5, 8) is None                              # never kept
    path = tmp_path / "f" / "0000003.safetensors"
    assert cache.get(3, 6, 8) is None and not path.exists()         # another conversation's length: computed again
    cache.put(3, {l: t[2:7] for l, t in batch.items()})
    path.write_bytes(path.read_bytes()[:40])                       # cut short
    assert cache.get(3, 5, 8) is None and not path.exists()
    FeatureCache(tmp_path / "f", [1]).put(3, {1: batch[1][:5]})    # a run reading other layers
    assert cache.get(3, 5, 8) is None and not path.exists()
    cache.put(3, {l: t[2:7] for l, t in batch.items()})
    whole = path.read_bytes()
    n = int.from_bytes(whole[:8], "little")                        # the same tensors behind a header padded with
    head = whole[8:8 + n] + b" " * (2**16 + 8)                     # spaces (valid safetensors) past any bound a
    path.write_bytes(len(head).to_bytes(8, "little") + head + whole[8 + n:])   # conversation's features set
    assert load_file(str(path)).keys() == {"L1", "L4"}             # readable, but larger than it may be: not read
    assert cache.get(3, 5, 8) is None and not path.exists()
    assert (cache.read, cache.written, cache.off) == (2, 4, None)
    assert not [p for p in (tmp_path / "f").iterdir() if p.name.startswith(".")]   # no temporary files left


def test_a_full_disk_turns_the_cache_off_for_the_rest_of_the_run(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("a file where the folder would be")         # every write fails, as on a full disk
    cache = FeatureCache(blocker, [0])
    cache.put(0, {0: torch.zeros(2, 4).half()})
    assert cache.written == 0 and "could not be written" in cache.off and "runs again" in cache.off
    cache.put(1, {0: torch.zeros(2, 4).half()})                    # no second try
    assert cache.get(1, 2, 4) is None and cache.summary() == {"read": 0, "written": 0, "off": cache.off}
    kept = FeatureCache(tmp_path / "k", [0])                       # a cache that may not write still reads what it kept
    kept.put(0, {0: torch.ones(2, 4).half()})
    kept.off = room(2**40, 2**30)
    kept.put(1, {0: torch.ones(2, 4).half()})
    assert torch.equal(kept.get(0, 2, 4)[0], torch.ones(2, 4).half()) and kept.get(1, 2, 4) is None
    assert kept.summary() == {"read": 1, "written": 1, "off": kept.off}


def test_a_budget_within_the_first_epoch_keeps_nothing(tiny, tmp_path, one_thread):
    one = train_online(tiny, [[1, 3]], Store(tmp_path / "s"), steps=1, **SMALL)
    assert one.features == {"read": 0, "written": 0, "off": FIRST_EPOCH}
    o = OnlineOptions(steps=3, batch_size=3)
    assert within_first_epoch(o, 9, 500) and not within_first_epoch(o, 6, 500)      # 3 batches an epoch, or 2
    assert within_first_epoch(OnlineOptions(tokens=500), 9, 500) and not within_first_epoch(OnlineOptions(tokens=501), 9, 500)
    assert not within_first_epoch(OnlineOptions(time_s=60.0), 9, 500)


def test_room_keeps_the_disk_from_filling():
    need = cache_bytes(tokens=1000, layers=4, hidden=1536)
    assert need == 1000 * 4 * 1536 * 2
    assert room(need, need + FREE_AFTER) is None
    why = room(10 * 2**30, 11 * 2**30)
    assert "10.0 GiB more" in why and "11.0 GiB free" in why and "the target runs for what is not kept" in why


def test_cached_features_equal_the_batch_forward_and_run_the_target_only_on_what_is_missing(tiny, tmp_path, one_thread):
    convs, layers, N = conversations(6, tiny.model.config.vocab_size), [1, 3], tiny.num_layers
    cache = FeatureCache(tmp_path / "f", layers + [N])
    rows, feats = target_features(tiny, convs, [0, 1, 2, 3], layers)
    rows1, feats1 = cached_features(tiny, convs, [0, 1, 2, 3], layers, cache)    # the first epoch: the same forward
    assert all(torch.equal(rows[k], rows1[k]) for k in rows) and all(torch.equal(feats[l], feats1[l]) for l in feats)
    assert (cache.read, cache.written) == (0, 4)
    rows2, feats2 = cached_features(tiny, convs, [2, 0, 5], layers, cache)       # two kept, one new
    assert (cache.read, cache.written) == (2, 5)
    assert all(torch.equal(rows2[k], conversation_rows(convs, [2, 0, 5])[k]) for k in rows2)
    lengths = [len(convs.prompt[i]) + len(convs.response[i]) for i in range(6)]
    starts = [sum(lengths[:i]) for i in range(4)]                 # conversations 0..3 in the first batch's rows
    _, alone = target_features(tiny, convs, [5], layers)
    for l in (1, 3, N):
        expect = torch.cat([feats[l][starts[2]:starts[2] + lengths[2]], feats[l][:lengths[0]], alone[l]])
        assert feats2[l].dtype == feats[l].dtype and torch.equal(feats2[l], expect)


def test_a_two_epoch_run_forwards_each_conversation_once_and_leaves_no_features(tiny, tmp_path, one_thread):
    n = train_online(tiny, [[1, 3]], Store(tmp_path / "n"), steps=1, **SMALL).conversations
    steps = 2 * len(epoch_batches([1] * n, SMALL["batch_size"], 0, 0))   # two whole epochs
    store = Store(tmp_path / "s")
    result = train_online(tiny, [[1, 3]], store, steps=steps, **SMALL)
    assert result.features == {"read": n, "written": n, "off": None}
    run_dir = store.root / "runs" / result.run_key
    assert not (run_dir / FOLDER).exists()                               # gone with the run
    plain = train_online(tiny, [[1, 3]], Store(tmp_path / "p"), steps=steps, feature_cache=False, **SMALL)
    assert plain.run_key == result.run_key                               # the same run: only the source differs
    assert plain.features == {"read": 0, "written": 0, "off": "turned off (feature_cache=False)"}
    # what the cache changes is rounding: the second epoch's features come from the first epoch's batches
    a, b = (load_file(str(Path(r.drafts[0].path) / "model.safetensors")) for r in (result, plain))
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-3, rtol=1e-2), k


def test_cli_turns_the_cache_off_and_reports_what_it_read(tiny, tmp_path, capsys, one_thread):
    args = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10",
            "--layers", "1,3", "--steps", "8", "--batch-size", "3", "--seq-len", "64", "--draft-vocab", "64",
            "--val-conversations", "2", "--eval-points", "2"]
    assert main([*args, "--store", str(tmp_path / "a"), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    n, read = first["conversations"], first["features"]["read"]          # 8 steps of 3: two epochs and more
    assert first["features"]["written"] == n and n < read <= 8 * 3 - n
    assert main([*args, "--store", str(tmp_path / "b"), "--no-feature-cache"]) == 0
    out = capsys.readouterr().out
    assert "target features: every epoch ran the target (turned off (feature_cache=False))" in out
    assert main([*args, "--store", str(tmp_path / "c")]) == 0
    assert f"target features: {n} conversations forwarded once and kept, read back {read} times" in capsys.readouterr().out
