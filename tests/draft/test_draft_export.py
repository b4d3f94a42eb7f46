"""Draft checkpoints: the engines' layout, exact round trip, refusal of foreign targets, no pickle."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from layerscope.draft import engines
from layerscope.draft.checkpoint import load_draft, save_draft
from layerscope.draft.export.check import check_draft
from layerscope.draft.export.engine_export import export_draft
from layerscope.draft.training.train import train_draft
from layerscope.errors import DraftError
from layerscope.store import Store
from layerscope.target.load import tiny_model
from layerscope.target.weights import target_weights
from layerscope.ui.tasks import stored_drafts

ENGINE_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
                "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}


@pytest.fixture(scope="module")
def trained(tiny, tiny_capture, tmp_path_factory):
    head, report = train_draft(tiny_capture, [1, 2, 3], *target_weights(tiny), steps=4, batch_size=2, seq_len=32,
                               draft_vocab=100, target=tiny, strategy="manual")
    path = save_draft(tmp_path_factory.mktemp("drafts") / "d", head, report.meta)
    return head, report, path


def logits_of(head, tiny, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny.model.config.vocab_size, (2, 9), generator=g)
    aux = torch.randn(2, 9, 3 * tiny.hidden_size, generator=g)
    with torch.no_grad():
        return head(ids, head.fuse(aux), torch.arange(9).expand(2, 9))


def test_checkpoint_has_the_engines_names_and_keys(trained, tiny):
    head, report, path = trained
    # layers.json (issue 13) gives the set in every engine's convention beside the engines' own files
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "layers.json", "layerscope.json", "model.safetensors"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == tiny.model.config.vocab_size
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == tiny.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        # no embed_tokens: engines share the target's; fc_norm (on by default) one gain per layer
        assert set(f.keys()) == ENGINE_NAMES | {f"fc_norm.{i}.weight" for i in range(3)}
        assert cfg["fc_norm"] is True
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("fc.weight").shape == (tiny.hidden_size, 3 * tiny.hidden_size)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * tiny.hidden_size
    meta = json.loads((path / "layerscope.json").read_text())
    assert meta["target_fingerprint"] == tiny.fingerprint and meta["layers"] == [1, 2, 3]
    assert meta["strategy"] == "manual" and meta["budget"]["steps"] == 4 and meta["seed"] == 0
    assert meta["val_accuracy"] == report.val_accuracy and meta["train_tokens"] == report.train_tokens
    assert meta["serving_notes"] == []


def test_save_then_load_gives_identical_logits(trained, tiny):
    head, _, path = trained
    loaded = load_draft(path, tiny)
    assert loaded.aux_layers == head.aux_layers and torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    (a, ha), (b, hb) = logits_of(head, tiny), logits_of(loaded, tiny)
    assert torch.equal(a, b) and torch.equal(ha, hb)


def test_loading_for_another_target_fails_naming_both(trained):
    _, _, path = trained
    other_weights = tiny_model(seed=1)                       # same shapes, other weights
    with pytest.raises(DraftError) as e:
        load_draft(path, other_weights)
    assert "fingerprint" in str(e.value) and other_weights.fingerprint in str(e.value)
    narrow = tiny_model(hidden_size=32)
    with pytest.raises(DraftError, match="hidden size 64 vs 32"):
        load_draft(path, narrow)
    shallow = tiny_model(num_layers=3)
    with pytest.raises(DraftError, match="decoder layers"):
        load_draft(path, shallow)


def test_loading_never_unpickles(trained, tiny, monkeypatch):
    _, _, path = trained

    def refuse(*a, **k):
        raise AssertionError("unpickling in a load path")
    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load"), (torch.serialization, "load")):
        monkeypatch.setattr(mod, name, refuse)
    assert load_draft(path, tiny).aux_layers == [1, 2, 3]


def test_a_pickled_checkpoint_is_refused(trained, tmp_path):
    head, _, _ = trained
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(head.config.to_hf_config()))
    torch.save(head.state_dict(), d / "pytorch_model.bin")
    with pytest.raises(DraftError, match="model.safetensors"):
        load_draft(d)


def test_damaged_checkpoints_are_refused(trained, tmp_path):
    head, _, path = trained
    bad = save_draft(tmp_path / "bad", head)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] + 1}))
    with pytest.raises(DraftError, match="does not match its config.json"):
        load_draft(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(DraftError, match="not valid JSON"):
        load_draft(bad)


def test_save_replaces_whole_or_not_at_all(trained, tmp_path):
    head, _, _ = trained
    path = save_draft(tmp_path / "d", head, {"note": "first"})
    with pytest.raises(TypeError):
        save_draft(path, head, {"note": object()})            # fails while writing layerscope.json
    assert json.loads((path / "layerscope.json").read_text())["note"] == "first"
    save_draft(path, head, {"note": "second"})
    assert json.loads((path / "layerscope.json").read_text())["note"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]          # no temporary directories left


def test_fc_norm_round_trips_through_training_save_load_and_the_engines_exports(tiny, tiny_capture, tmp_path):
    # trained with fc_norm (and the closed-form fc start, which reads fc's input through the norms)
    head, report = train_draft(tiny_capture, [1, 2, 3], *target_weights(tiny), steps=3, batch_size=2, seq_len=32,
                               draft_vocab=100, target=tiny, strategy="manual", fc_norm=True, warm_start=1)
    norms = {f"fc_norm.{i}.weight" for i in range(3)}
    assert report.meta["options"]["fc_norm"] is True
    path = save_draft(tmp_path / "d", head, report.meta, target=tiny)
    assert json.loads((path / "config.json").read_text())["fc_norm"] is True
    assert json.loads((path / "layerscope.json").read_text())["fc_norm"] is True
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == ENGINE_NAMES | norms
        saved = {k: f.get_tensor(k) for k in norms}
    back = load_draft(path, tiny)
    assert back.config.fc_norm and torch.equal(logits_of(back, tiny)[0], logits_of(head.to(back.fc.weight.device), tiny)[0])
    assert all(torch.equal(back.state_dict()[k], v) for k, v in saved.items())
    facts = engines.target_facts(tiny)
    for engine, config_files in (("vllm", ["config.json"]), ("sglang", ["config.json"]),
                                 ("specforge", ["config.json", "draft_config.json"])):
        out = export_draft(path, engine, tmp_path / engine, facts)
        assert all(json.loads((out / f).read_text())["fc_norm"] is True for f in config_files), engine
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert all(torch.equal(f.get_tensor(k), v) for k, v in saved.items()), engine
        assert "fc_norm needs a" in (out / "COMMANDS.md").read_text()                       # the engine's release
        checked = check_draft(out, facts)
        assert checked["ok"] and checked["fc_norm"]["config"] and checked["fc_norm"]["weights"] == 3, checked["problems"]
    # a config.json that no longer asks for the norms its weights hold: check-draft says so, load_draft refuses
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({**cfg, "fc_norm": False}))
    bad = check_draft(tmp_path / "vllm", facts)
    assert not bad["ok"] and any("does not ask for fc_norm" in p for p in bad["problems"])
    with pytest.raises(DraftError, match="fc_norm"):
        load_draft(tmp_path / "vllm")
    # the one engine that cannot build it: speculators sizes its norms by the draft's width, not the target's
    assert engines.refusal("speculators", [1, 2, 3], facts, (64, 32)).startswith("speculators builds fc_norm")
    assert engines.refusal("vllm", [1, 2, 3], facts, (64, 32)) is None


def test_serving_notes_flag_what_engines_cannot_load(tiny, tiny_capture, tmp_path):
    head, report = train_draft(tiny_capture, [0, 2], *target_weights(tiny), steps=1, batch_size=2, seq_len=32)
    meta = json.loads((save_draft(tmp_path / "d", head) / "layerscope.json").read_text())
    assert len(meta["serving_notes"]) == 2 and "exactly 3" in meta["serving_notes"][0]


KILLED_SAVE = """
import os, shutil, signal, sys, torch
from layerscope import store
from layerscope.draft import checkpoint as export
from layerscope.draft.model import DraftConfig, DraftHead
path, when = sys.argv[1], sys.argv[2]
cfg = DraftConfig(hidden_size=16, target_hidden_size=16, vocab_size=50, draft_vocab_size=50, aux_layers=[1, 2, 3],
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=32)
head = DraftHead(cfg)
export.save_draft(path, head, {"note": "old"})
print("old saved", flush=True)
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if when == "before-swap":            # the new directory is complete, the rename has not happened
    store.replace_dir = die
elif when == "after-swap":           # the new directory is in place, the old one not yet removed (replace_dir's last step)
    shutil.rmtree = die
elif when == "while-writing":        # killed in the middle of writing the weights
    export.save_file = die
export.save_draft(path, head, {"note": "new"})
"""


@pytest.mark.parametrize("when, expected", [("while-writing", "old"), ("before-swap", "old"), ("after-swap", "new")])
def test_a_killed_save_leaves_the_old_or_the_new_draft_and_nothing_listed(tmp_path, when, expected):
    """A real process killed with SIGKILL at each step of save_draft: the draft path holds one complete draft,
    and the store's draft listing (the app's) shows exactly that one."""
    store = Store(tmp_path / "store")
    path = store.path("drafts", "k")
    run = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path), when], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == -9 and "old saved" in run.stdout, run.stderr
    assert json.loads((path / "layerscope.json").read_text())["note"] == expected
    assert load_draft(path).aux_layers == [1, 2, 3]
    assert [d["path"] for d in stored_drafts(store)] == [str(path)]
    # the next save cleans up what the killed process left in the staging folder
    save_draft(path, load_draft(path), {"note": "after"})
    assert sorted(p.name for p in path.parent.iterdir()) == ["k"]
