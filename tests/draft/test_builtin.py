"""The draft that ships inside the package: shipping in bfloat16, `--draft builtin` resolution, the real one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from layerscope.commands import cli
from layerscope.draft import builtin
from layerscope.draft.checkpoint import load_draft, read_meta, save_draft
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.train import draft_for, train_draft
from layerscope.errors import DraftError
from layerscope.store import Store
from layerscope.target.weights import target_weights

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_draft(tiny, tiny_capture, tmp_path_factory):
    head, report = train_draft(tiny_capture, [1, 2, 3], *target_weights(tiny), steps=3, batch_size=2, seq_len=32,
                               draft_vocab=100, target=tiny, strategy="manual")
    return save_draft(tmp_path_factory.mktemp("drafts") / "d", head, report.meta, target=tiny)


@pytest.fixture
def tiny_slot(monkeypatch, tmp_path):
    """A builtin slot for tiny-llama under tmp_path (the package's own folder is left alone)."""
    monkeypatch.setitem(builtin.SHIPPED, "tiny-llama", "tiny-1-2-3")
    monkeypatch.setattr(builtin, "ROOT", tmp_path / "shipped")
    return tmp_path / "shipped" / "tiny-1-2-3"


def test_ship_writes_bfloat16_weights_that_load_and_a_trained_md(tiny, tiny_draft, tiny_slot):
    out = builtin.ship(tiny_draft, "tiny-llama", "layerscope train-draft --model tiny-llama --layers 1,2,3", target=tiny)
    assert out == tiny_slot and builtin.builtin_path("tiny-llama") == tiny_slot
    meta = read_meta(out)
    assert meta["dtype"] == "bfloat16" and meta["layers"] == [1, 2, 3]
    assert meta["shipped"]["command"].startswith("layerscope train-draft")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    original, shipped = load_draft(tiny_draft, tiny), load_draft(out, tiny)
    for (name, a), (_, b) in zip(original.state_dict().items(), shipped.state_dict().items()):
        want = a.to(torch.bfloat16).float() if a.is_floating_point() else a
        assert torch.equal(want, b), name                # exactly the bf16 rounding of the trained weights
    text = (out / "TRAINED.md").read_text()
    assert "layerscope train-draft --model tiny-llama" in text and "tokens seen" in text
    a1, a2, a3 = meta["val_accuracy"]
    assert f"simulated_acc_len (SpecForge's Σ∏ of that agreement: draft tokens per verification, no bonus token, " \
           f"not τ): {a1 + a1 * a2 + a1 * a2 * a3:.3f}" in text
    assert (out / "model.safetensors").stat().st_size < (Path(tiny_draft) / "model.safetensors").stat().st_size


def test_a_continued_draft_ships_with_the_history_of_the_draft_it_replaces(tiny, tiny_capture, tiny_slot, tmp_path):
    """Shipping a draft trained on from the builtin (--init-from builtin) replaces the builtin; its TRAINED.md and
    layerscope.json keep the starting draft's command, tokens and learning curve (found by the weights' sha256
    in the slot, where the recorded path is gone), and the curve counts every token."""
    store, o = Store(tmp_path / "s"), TrainOptions(steps=3, batch_size=2, seq_len=32, draft_vocab=64, eval_points=2)
    first = draft_for(tiny_capture, [1, 2], tiny, store, options=o)
    slot = builtin.ship(first, "tiny-llama", "layerscope train-draft --first", target=tiny)
    moved = tmp_path / "elsewhere"                       # what the run recorded: a path that is gone by the ship
    slot.rename(moved)
    second = draft_for(tiny_capture, [1, 2], tiny, store, options=replace(o, init_from=(str(moved),)))
    moved.rename(slot)
    started = read_meta(slot)
    builtin.ship(second, "tiny-llama", "layerscope train-draft --init-from builtin", target=tiny)
    shipped = read_meta(slot)["shipped"]
    start = shipped["continued_from"]
    assert start["command"] == "layerscope train-draft --first" and start["curve"] == started["curve"]
    assert start["tokens_seen"] == started["tokens_seen"] and start["run_tokens"] == started["tokens_seen"]
    text = (slot / "TRAINED.md").read_text()
    before, after = started["tokens_seen"], read_meta(slot)["tokens_seen"]
    assert "layerscope train-draft --first" in text and start["sha256"] in text
    assert f"continuing a draft that had seen {before:,} ({before + after:,} in all)" in text
    rows = [int(line.split("|")[1].replace(",", "")) for line in text.splitlines() if re.match(r"\| [\d,]+ \|", line)]
    assert rows == [t for t, _ in started["curve"]] + [t + before for t, _ in read_meta(slot)["curve"]]
    # a starting draft that cannot be found any more: its sha256 and tokens, and the command said to be unknown
    (slot / "model.safetensors").write_bytes(b"other weights")
    gone = builtin.continued_from(read_meta(second), slot)
    assert gone["command"] is None and gone["tokens_seen"] == before and gone["sha256"] == start["sha256"]
    assert "whose command was not recorded" in builtin.trained_md("tiny-llama", [1, 2], {"shipped": {"continued_from": gone}}, "c")
    assert builtin.continued_from(read_meta(first), slot) is None            # a fresh draft continued nothing


def test_builtin_for_a_model_without_one_names_the_model_and_what_to_do():
    with pytest.raises(DraftError) as e:
        builtin.resolve("builtin", "tiny-llama")
    assert "no draft ships for tiny-llama" in str(e.value) and "train-draft" in str(e.value)


def test_resolve_reads_store_keys_and_leaves_paths_alone(tiny_draft, store, tmp_path):
    assert builtin.resolve(tiny_draft) == Path(tiny_draft)
    key_dir = Path(store.path("drafts", "abc123"))
    key_dir.mkdir(parents=True)
    assert builtin.resolve("abc123", store=store) == key_dir
    assert builtin.resolve(tmp_path / "nowhere", store=store) == tmp_path / "nowhere"   # the caller's check names it
    # a key's prefix, as captures take one: unique, it is that draft; shared, one line lists the matches
    assert builtin.resolve("abc1", store=store) == key_dir
    Path(store.path("drafts", "abc1ff")).mkdir(parents=True)
    assert builtin.resolve("abc12", store=store) == key_dir
    with pytest.raises(DraftError, match=r"The prefix 'abc1' matches 2 stored drafts: abc123, abc1ff"):
        builtin.resolve("abc1", store=store)
    assert builtin.resolve("abc", store=store) == Path("abc")        # under 4 characters: not taken as a prefix


def test_bench_with_draft_builtin_decodes_losslessly_under_that_name(tiny, tiny_draft, tiny_slot, tmp_path, capsys):
    builtin.ship(tiny_draft, "tiny-llama", "layerscope train-draft ...", target=tiny)
    code = cli.main(["bench", "--draft", "builtin", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "1",
                     "--max-new-tokens", "6", "--k", "1", "--no-peers", "--store", str(tmp_path / "s"), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in doc["results"]}
    assert any(name.startswith("builtin") for name in rows)
    assert all(r["lossless"] in (True, None) for r in rows.values())


def test_the_package_carries_the_shipped_draft(tmp_path):
    """`pip install .` (a wheel) holds every file of each builtin draft."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("layerscope-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(builtin.SHIPPED) == {"smollm2-135m", "qwen2.5-coder-1.5b"}
    for folder in builtin.SHIPPED.values():
        for f in ("config.json", "model.safetensors", "layers.json", "layerscope.json", "TRAINED.md"):
            assert f"layerscope/data/drafts/{folder}/{f}" in names


@pytest.mark.smollm2
def test_the_shipped_smollm2_draft_loads_against_smollm2_and_says_how_it_was_trained(smollm2):
    path = builtin.builtin_path("smollm2-135m")
    head = load_draft(path, smollm2)
    meta = read_meta(path)
    assert list(head.aux_layers) == [2, 15, 27] and meta["dtype"] == "bfloat16"
    assert meta["shipped"]["command"].startswith("layerscope train-draft --model smollm2-135m")
    assert meta["val_accuracy"][0] > 0.2 and meta["curve"]
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 32 * 2**20                            # small enough to ship: no embedding, bfloat16
