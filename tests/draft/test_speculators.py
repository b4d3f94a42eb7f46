"""The real speculators library (PyPI speculators==0.9.0) on LayerScope's exports, as a user of it would run them.

speculators is a test extra: `scripts/dev.sh test` installs it with --no-deps plus the few packages its code
imports (requirements-speculators.txt); its own requirements would bring a second torch. Where it cannot be
imported, the tests that need it are skipped with that reason; under `scripts/dev.sh test`, which installed it
(LAYERSCOPE_REQUIRE_EXTRAS=1), they fail instead. What they hold, per target (a tiny Llama saved
as a model folder, and SmolLM2-135M from its stored de-quantization):
  - `SpeculatorModel.from_pretrained(export)` loads every weight of the checkpoint and needs nothing else from
    it (the verifier-owned verifier_lm_head/verifier_norm come from the verifier), the embedding included;
  - its forward (hidden_states = the target's layers concatenated, teacher-forced TTT) gives the draft
    vocabulary logits of LayerScope's DraftHead, one step and a 3-step unroll, to 1e-4 with the same argmax;
  - it reads the trained layer ids (Eagle3DraftModel.target_layer_ids);
  - `speculators convert` on the LayerScope draft with the ids writes the export's tensors (without the
    embedding, which the LayerScope draft does not have), and falls back to [2, N//2, N-3] without them.
speculators' forward, read from its source (src/speculators/models/eagle3/core.py): fc(hidden_states), then per
TTT step cat([embed_tokens(input_ids), h]) through the layer with a DynamicCache, logits = lm_head(norm(h));
step j feeds the ground-truth ids shifted left by j and its own previous h, positions + 1 per step. Logits are
not returned, so a forward hook on its lm_head records them. Its flex attention extends the mask in blocks of
128, so sequences are 128 tokens.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from layerscope.commands.cli import main as cli
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.engines import target_facts
from layerscope.draft.export.check import check_draft
from layerscope.draft.export.engine_export import export_draft, export_zip, target_name
from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab
from layerscope.store import Store
from layerscope.target.aliases import ALIASES
from layerscope.target.load import load_model, tiny_model

T = 128                  # tokens per test sequence: a whole flex-attention block
VERIFIER_ONLY = {"verifier_lm_head.weight", "verifier_norm.weight"}   # speculators never saves these


REQUIRE = "LAYERSCOPE_REQUIRE_EXTRAS"   # set by `scripts/dev.sh test` (and so .ci/run), which installs it
MISSING = ("speculators (or a package its model path imports) is not importable here: "
           "`scripts/dev.sh setup` installs it with `pip install --no-deps -r requirements-speculators.txt`")


@pytest.fixture(scope="module")
def speculators():
    """The library; skipped with the reason where it is not installed, a failure where the test command
    installed it (a broken install must not pass CI as a skip)."""
    if os.environ.get(REQUIRE) == "1":
        try:
            import speculators as module
        except ImportError as e:
            pytest.fail(f"{MISSING} ({type(e).__name__}: {e})")
        return module
    return pytest.importorskip("speculators", reason=MISSING)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """tiny-llama saved as a model folder (what speculators needs as a verifier) and loaded back from it."""
    folder = tmp_path_factory.mktemp("tiny-target") / "target"
    tiny = tiny_model()
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return load_model(str(folder))


def built_draft(target, layers, draft_vocab, path, seed=0, fc_norm=False, intermediate=None):
    """A DraftHead for `target` with every weight random (norm gains too, so no two tensors can be swapped
    unnoticed), saved as LayerScope saves a trained draft."""
    emb = target.model.get_input_embeddings().weight
    cfg = DraftConfig.from_target(target.model.config, layers, draft_vocab, vocab_size=emb.shape[0], fc_norm=fc_norm,
                                  intermediate_size=intermediate)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_draft_vocab(torch.randint(0, cfg.vocab_size, (20 * cfg.vocab_size,), generator=g),
                                 draft_vocab, cfg.vocab_size)
    head = DraftHead(cfg, d2t=d2t, t2d=t2d)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.05 * torch.randn(p.shape, generator=g))
    meta = {"target_fingerprint": target.fingerprint, "target_model": target.spec, "layers": list(layers)}
    path = save_draft(path, head, meta, target=target)
    head.set_embedding(emb)
    return head.eval(), path


def target_inputs(target, layers, seed=1):
    """A real sequence through the target: ids [1, T] (row t holds x_{t+1}) and the hidden states of `layers`
    at rows 0..T-1, concatenated in ascending order [1, T, k*d]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, target.model.get_input_embeddings().weight.shape[0], (1, T + 1), generator=g)
    with torch.no_grad():
        hs = target.model(x, output_hidden_states=True).hidden_states
    return x[:, 1:], torch.cat([hs[l][:, :T] for l in layers], dim=-1)


def speculators_logits(model, ids, aux, steps):
    """speculators' own forward with its defaults; the logits of each TTT step, from a hook on its lm_head."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
    finally:
        hook.remove()
    return seen


def draft_head_logits(head, ids, aux, steps):
    """LayerScope's DraftHead: one step as decoding runs it (forward), and the training-time unroll."""
    pos = torch.arange(T).unsqueeze(0)
    with torch.no_grad():
        g = head.fuse(aux)
        one, _ = head(ids, g, pos)
        shifted = [torch.cat([ids[:, j:], ids.new_zeros(1, j)], dim=1) for j in range(steps)]
        unrolled = [logits for logits, _ in head.unroll(shifted, g, pos)]
    return one, unrolled


def assert_speculators_runs_it_as_layerscope(speculators, out, head, target, layers):
    """The export at `out` loaded and run by speculators, against `head` (see the module docstring)."""
    model = speculators.SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "Eagle3DraftModel"
    ckpt = load_file(str(out / "model.safetensors"))
    state = model.state_dict()
    assert set(ckpt) == set(state) - VERIFIER_ONLY, "missing or unexpected checkpoint keys"
    for k, v in ckpt.items():
        assert torch.equal(state[k], v), f"{k} was not loaded as saved"
    assert torch.equal(model.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert model.target_layer_ids == layers
    ids, aux = target_inputs(target, layers)
    # speculators numbers positions from 1, DraftHead from 0: rotary attention depends only on differences
    theirs = speculators_logits(model.eval(), ids, aux, steps=3)
    one, ours = draft_head_logits(head, ids, aux, steps=3)
    assert len(theirs) == 3
    pairs = [("one step (DraftHead.forward)", one, theirs[0])] + [
        (f"TTT step {j + 1} (DraftHead.unroll)", a, b) for j, (a, b) in enumerate(zip(ours, theirs))]
    for what, a, b in pairs:
        assert (a - b).abs().max() < 1e-4, f"{what}: max |diff| {(a - b).abs().max():.2e}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{what}: argmax differs"


def convert_with_cli(draft, verifier, out, ids=None):
    """`speculators convert` as a user runs it (its command line, in a child process)."""
    cmd = [sys.executable, "-m", "speculators", "convert", str(draft), "--algorithm", "eagle3", "--verifier",
           str(verifier), "--output-path", str(out)]
    if ids is not None:
        cmd += ["--algorithm-kwargs", json.dumps({"eagle_aux_hidden_state_layer_ids": ids})]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "config.json").read_text())


def assert_converted_matches_export(converted_dir, export_dir):
    """The converter's tensors are the export's, which has the target's embedding besides."""
    ours, theirs = load_file(str(export_dir / "model.safetensors")), load_file(str(converted_dir / "model.safetensors"))
    assert set(ours) - set(theirs) == {"embed_tokens.weight"} and set(theirs) <= set(ours)
    for k, v in theirs.items():
        assert v.dtype == ours[k].dtype and torch.equal(v, ours[k]), k
    a, b = (json.loads((d / "config.json").read_text()) for d in (converted_dir, export_dir))
    for key in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
                "norm_before_fc", "fc_norm", "norm_output"):
        assert a[key] == b[key], key
    assert a["speculators_config"]["verifier"]["architectures"] == b["speculators_config"]["verifier"]["architectures"]


# ------------------------------------------------------------------ a tiny Llama target

def test_speculators_loads_and_runs_a_tiny_llama_export_as_layerscope(speculators, tiny_target, tmp_path, monkeypatch):
    layers = [1, 2, 3]                          # speculators' default for 4 layers would be [2, 2, 1]
    head, draft = built_draft(tiny_target, layers, 100, tmp_path / "draft")
    out = export_draft(draft, "speculators", tmp_path / "export", target_facts(tiny_target), target=tiny_target)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    folder = Path(tiny_target.model.config._name_or_path).resolve()
    assert verifier == os.path.relpath(folder, out) and not Path(verifier).is_absolute()
    assert check_draft(out, target_facts(tiny_target))["warnings"]          # relative: not from here
    monkeypatch.chdir(out)                      # speculators resolves the verifier from the working directory
    assert check_draft(out, target_facts(tiny_target))["warnings"] == []
    assert_speculators_runs_it_as_layerscope(speculators, out, head, tiny_target, layers)


def test_speculators_loads_and_runs_a_fc_norm_export_as_layerscope(speculators, tiny_target, tmp_path, monkeypatch):
    """fc_norm (EAGLE-3.1): the export says so in Eagle3SpeculatorConfig.fc_norm, speculators builds one RMSNorm per
    layer and loads the draft's fc_norm.{i}.weight into them (the key check), and its forward, which norms each
    layer's chunk before fc, gives DraftHead's logits. The gains are random, so a norm left out or swapped shows."""
    layers = [1, 2, 3]
    head, draft = built_draft(tiny_target, layers, 100, tmp_path / "draft", fc_norm=True)
    out = export_draft(draft, "speculators", tmp_path / "export", target_facts(tiny_target), target=tiny_target)
    assert json.loads((out / "config.json").read_text())["fc_norm"] is True
    assert check_draft(out, target_facts(tiny_target))["fc_norm"]["weights"] == 3
    monkeypatch.chdir(out)                      # speculators resolves the verifier from the working directory
    assert_speculators_runs_it_as_layerscope(speculators, out, head, tiny_target, layers)
    model = speculators.SpeculatorModel.from_pretrained(str(out))
    assert model.fc_norm is not None and len(model.fc_norm) == 3


def test_speculators_loads_and_runs_a_narrow_mlp_export_as_layerscope(speculators, tiny_target, tmp_path, monkeypatch):
    """--draft-intermediate: a draft whose MLP is narrower than its target's (the 1.5B's shipped width, 1024 of 8960)
    exports with its own intermediate_size, and speculators builds and runs it as LayerScope does."""
    layers, width = [1, 2, 3], 24
    assert tiny_target.model.config.intermediate_size != width
    head, draft = built_draft(tiny_target, layers, 100, tmp_path / "draft", fc_norm=True, intermediate=width)
    out = export_draft(draft, "speculators", tmp_path / "export", target_facts(tiny_target), target=tiny_target)
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["intermediate_size"] == width
    monkeypatch.chdir(out)
    assert_speculators_runs_it_as_layerscope(speculators, out, head, tiny_target, layers)


def test_speculators_convert_cli_writes_the_export_tensors(speculators, tiny_target, tmp_path):
    from speculators.convert import convert_model

    layers = [1, 2, 3]
    _, draft = built_draft(tiny_target, layers, 100, tmp_path / "draft")
    folder = Path(tiny_target.model.config._name_or_path)
    out = export_draft(draft, "speculators", tmp_path / "export", target_facts(tiny_target), target=tiny_target)
    converted = convert_with_cli(draft, folder, tmp_path / "converted", ids=layers)
    assert converted["speculators_config"]["verifier"]["name_or_path"] == str(folder)
    assert_converted_matches_export(tmp_path / "converted", out)
    # without the ids the converter writes none, and speculators falls back to [2, N//2, N-3]
    convert_model(model=str(draft), verifier=str(folder), algorithm="eagle3", output_path=str(tmp_path / "bare"))
    bare = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert bare.get("eagle_aux_hidden_state_layer_ids") is None
    shutil.copy(draft / "layerscope.json", tmp_path / "bare")    # check-draft needs the trained set; the converter keeps none
    report = check_draft(tmp_path / "bare", target_facts(tiny_target), only=["speculators"])
    row = next(r for r in report["rows"] if r["engine"] == "speculators")
    assert row["library_reads"] == [2, 2, 1] and not report["ok"]
    assert any("embed_tokens" in w for w in report["warnings"])              # the converter's output has none


# ------------------------------------------------------------------ naming the target and check-draft (no speculators needed)

def test_export_names_a_verifier_other_tools_resolve(tiny_target, tmp_path, capsys, monkeypatch):
    _, draft = built_draft(tiny_target, [1, 2, 3], 100, tmp_path / "draft")
    folder = Path(tiny_target.model.config._name_or_path).resolve()
    facts = target_facts(tiny_target)
    # the CLI without --target loads the model layerscope.json names (a folder here): its embedding, its name
    store = ["--store", str(tmp_path / "store")]
    assert cli(["export", str(draft), "--for", "speculators", "--out", str(tmp_path / "s"), *store]) == 0
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == os.path.relpath(folder, tmp_path / "s")
    with safe_open(str(tmp_path / "s" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), tiny_target.model.get_input_embeddings().weight)
    commands = (tmp_path / "s" / "COMMANDS.md").read_text()
    assert "relative to this folder" in commands and "What speculators reads here" in commands
    assert f"vllm serve {folder} " in commands           # the commands name it from where the export was written
    # a zip moves: the folder is named by its absolute path, and COMMANDS.md says what to change elsewhere
    name, data = export_zip(draft, "speculators")
    z = zipfile.ZipFile(io.BytesIO(data))
    zcfg = json.loads(z.read(f"{name[:-4]}/config.json"))
    assert zcfg["speculators_config"]["verifier"]["name_or_path"] == str(folder)
    assert "on the machine that exported this draft" in z.read(f"{name[:-4]}/COMMANDS.md").decode()
    # check-draft, from elsewhere: the relative verifier does not resolve; from inside the folder it does
    capsys.readouterr()
    assert cli(["check-draft", str(tmp_path / "s"), "--target", str(folder), *store]) == 0
    printed = capsys.readouterr().out
    assert "warn the verifier" in printed and "working directory" in printed
    assert "speculators' own from_pretrained reads [1, 2, 3]" in printed
    monkeypatch.chdir(tmp_path / "s")
    assert cli(["check-draft", ".", "--target", str(folder), *store]) == 0
    assert "resolves from here" in capsys.readouterr().out
    # a hub id that is not in the local cache, and a checkpoint without the embedding, are warned about
    (tmp_path / "s" / "config.json").write_text(json.dumps(
        {**cfg, "speculators_config": {**cfg["speculators_config"],
                                       "verifier": {"name_or_path": "layerscope-tests/not-a-model"}}}))
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    del tensors["embed_tokens.weight"]
    save_file(tensors, str(tmp_path / "s" / "model.safetensors"))
    report = check_draft(tmp_path / "s", facts)
    assert report["ok"] and len(report["warnings"]) == 2
    assert "not in this machine's Hugging Face cache" in report["warnings"][0]
    assert "no embed_tokens.weight" in report["warnings"][1]


def test_an_alias_is_exported_as_its_public_repository(tmp_path):
    """Without speculators or SmolLM2 here: the default model's alias names the repository any machine resolves."""
    name = target_name("smollm2-135m", None, tmp_path / "out")
    assert name.verifier == name.commands == "HuggingFaceTB/SmolLM2-135M-Instruct" == ALIASES["smollm2-135m"].hf_id
    assert not name.relative and "public repository" in name.note


# ------------------------------------------------------------------ SmolLM2 from its stored de-quantization

@pytest.fixture(scope="module")
def smollm2_folder(smollm2, session_store):
    return Path(session_store.path("models", smollm2.fingerprint))


@pytest.mark.smollm2
def test_the_stored_smollm2_is_a_model_folder_other_tools_load(smollm2, smollm2_folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((smollm2_folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg
    plain = AutoModelForCausalLM.from_pretrained(str(smollm2_folder)).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    text = "The quick brown fox jumps over the lazy dog."
    assert tok(text)["input_ids"] == smollm2.tokenizer(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, smollm2.model(ids).logits)
    assert plain.dtype == torch.float32
    # a copy stored before the config was complete (architectures null, no dtype) is completed on its next load
    store = Store(tmp_path / "store")
    old = Path(store.path("models", smollm2.fingerprint))
    shutil.copytree(smollm2_folder, old)
    (old / "config.json").write_text(json.dumps({**{k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype")},
                                                 "architectures": None}))
    again = load_model("smollm2-135m", store=store)
    assert again.fingerprint == smollm2.fingerprint
    assert json.loads((old / "config.json").read_text()) == cfg
    store.close()


@pytest.mark.smollm2
def test_speculators_loads_and_runs_a_smollm2_export_as_layerscope(speculators, smollm2, smollm2_folder, tmp_path):
    layers = [1, 10, 20]                        # not speculators' default [2, 15, 27] for 30 layers
    head, draft = built_draft(smollm2, layers, 512, tmp_path / "draft")
    facts = target_facts(smollm2)
    # by default the alias is named by its public repository, which any machine with network resolves
    public = export_draft(draft, "speculators", tmp_path / "public", facts, target=smollm2)
    cfg = json.loads((public / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == ALIASES["smollm2-135m"].hf_id
    assert str(smollm2_folder.resolve()) in (public / "COMMANDS.md").read_text()     # where the trained-on weights are
    # offline here: the stored folder as the verifier, as `--target-path` writes it
    out = export_draft(draft, "speculators", tmp_path / "export", facts, target=smollm2,
                       target_path=str(smollm2_folder))
    assert check_draft(out, facts)["ok"] and check_draft(out, facts)["warnings"] == []
    assert_speculators_runs_it_as_layerscope(speculators, out, head, smollm2, layers)
    # speculators' own converter takes the stored folder as the verifier and writes the export's tensors
    convert_with_cli(draft, smollm2_folder, tmp_path / "converted", ids=layers)
    assert_converted_matches_export(tmp_path / "converted", out)
