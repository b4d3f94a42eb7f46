"""Exports for vLLM, SGLang, SpecForge and speculators, read back the way each engine's loader reads them.

The reading rules below are written out again here from the engines' sources (not taken from
layerscope/draft/engines.py), so an export is checked against the engines, not against itself:
  vLLM        vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config: the
              draft hf_config's top-level eagle_aux_hidden_state_layer_ids when a non-empty list, else the
              target's (2, N//2, N-3) (vllm/model_executor/models/llama.py); the target appends the state
              entering decoder layer idx, i.e. hidden_states[idx]. llama_eagle3.py: fc is 3 x target_hidden_size.
  SGLang      model_runner.py passes eagle_config["eagle_aux_hidden_state_layer_ids"] to the target's
              set_eagle3_layers_to_capture: llama.py/qwen3.py capture [id + 1]; deepseek_v2.py and
              glm4_moe_lite.py capture [id + 1] only when ids[0] == 1, else the ids; None -> [2, N//2, N-3].
              The capture at index i is the input of layer i = hidden_states[i].
  SpecForge   specforge/algorithms/model_providers.py resolve_eagle_capture_layers: run config
              model.aux_hidden_state_layer_ids, else the draft config's eagle_config ids, else
              [1, N//2-1, N-4]; exactly three non-negative ids; handed to SGLang's capture above.
              specforge/modeling/draft/base.py load_vocab_mapping: torch.load(path)["t2d"/"d2t"] copied into
              buffers of the draft's shapes.
  speculators vllm/transformers_utils/configs/speculators/{base,algos}.py: transformer_layer_config, updated
              with draft_vocab_size, target_hidden_size, norm_before_residual (default True) and the
              top-level eagle_aux_hidden_state_layer_ids when truthy; weights midlayer.* are layers.0.*.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from layerscope.commands.cli import main as cli
from layerscope.draft.checkpoint import load_draft, save_draft
from layerscope.draft.engines import TargetFacts, family_refusal, target_facts
from layerscope.draft.export.check import check_draft
from layerscope.draft.export.engine_export import export_draft
from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab
from layerscope.errors import DraftError
from layerscope.target.load import tiny_model

# ------------------------------------------------------------------ the engines' reading rules, restated

def vllm_reads(cfg: dict, n: int) -> list[int]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids and isinstance(ids, (list, tuple)) else [2, n // 2, n - 3]


def sglang_capture(ids, model_type: str, n: int) -> list[int]:
    if ids is None:
        return [2, n // 2, n - 3]
    if model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    return [i + 1 for i in ids]


def sglang_reads(cfg: dict, model_type: str, n: int) -> list[int]:
    return sglang_capture((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), model_type, n)


def specforge_reads(run: dict, draft_cfg: dict, model_type: str, n: int) -> list[int]:
    ids = run["model"].get("aux_hidden_state_layer_ids")
    if ids is None:
        ids = (draft_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [1, n // 2 - 1, n - 4]
    assert len(ids) == 3 and all(isinstance(i, int) and i >= 0 for i in ids), "SpecForge refuses these ids"
    return sglang_capture(ids, model_type, n)


def speculators_vllm_config(cfg: dict) -> dict:
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert cfg["speculators_config"]["verifier"]["name_or_path"]
    out = dict(cfg["transformer_layer_config"])
    out["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    out["norm_before_residual"] = cfg.get("norm_before_residual", True)
    out["architectures"] = ["Eagle3LlamaForCausalLM"]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return out


# ------------------------------------------------------------------ fixtures

def make_draft(tiny, layers, tmp_path, name="d", facts=None, seed=0):
    cfg = DraftConfig.from_target(tiny.model.config, layers, 100,
                                  vocab_size=tiny.model.get_input_embeddings().weight.shape[0])
    torch.manual_seed(seed)
    d2t, t2d = build_draft_vocab(torch.randint(0, cfg.vocab_size, (2000,)), 100, cfg.vocab_size)
    head = DraftHead(cfg, d2t=d2t, t2d=t2d)
    meta = {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec, "layers": list(layers)}
    return head, save_draft(tmp_path / name, head, meta, target=None if facts else tiny, facts=facts)


def read(path, name="config.json"):
    return json.loads((path / name).read_text())


LLAMA = TargetFacts("llama", 4, "bfloat16", ("LlamaForCausalLM",))
DEEPSEEK = TargetFacts("deepseek_v3", 4, "bfloat16", ("DeepseekV3ForCausalLM",))
GLM_LITE = TargetFacts("glm4_moe_lite", 4, "bfloat16", ("Glm4MoeLiteForCausalLM",))


# ------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def deep():
    return tiny_model(num_layers=6)


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", "glm4_moe_lite"])
@pytest.mark.parametrize("layers", [[1, 3, 5], [2, 3, 5], [3, 4, 5]], ids=str)
def test_every_engine_reads_the_trained_layers_of_its_export(deep, tmp_path, model_type, layers):
    facts = TargetFacts(model_type, 6, "bfloat16", ("X",))
    head, draft = make_draft(deep, layers, tmp_path, facts=facts)
    n = facts.num_layers
    for engine in ("vllm", "sglang", "specforge", "speculators"):
        if model_type != "llama" and engine in ("sglang", "specforge") and layers[0] == 1:
            with pytest.raises(DraftError, match=f"Cannot export for {engine}.*starting at layer 1"):
                export_draft(draft, engine, tmp_path / engine, facts)
            continue
        if family_refusal(engine, model_type):      # glm4_moe_lite: not in vLLM's list, so unknown there
            with pytest.raises(DraftError, match=f"Cannot export for {engine}: unknown"):
                export_draft(draft, engine, tmp_path / engine, facts)
            continue
        out = export_draft(draft, engine, tmp_path / engine, facts, target_path="org/target", target=deep)
        cfg = read(out)
        if engine == "vllm":
            assert vllm_reads(cfg, n) == layers
        elif engine == "sglang":
            assert sglang_reads(cfg, model_type, n) == layers
        elif engine == "specforge":
            run = yaml.safe_load((out / "specforge.yaml").read_text())
            assert specforge_reads(run, read(out, "draft_config.json"), model_type, n) == layers
            # the draft config alone (no run override) gives the same set
            assert specforge_reads({"model": {}}, read(out, "draft_config.json"), model_type, n) == layers
            mapping = torch.load(out / "vocab_mapping.pt", weights_only=True)
            assert torch.equal(mapping["d2t"], head.d2t) and torch.equal(mapping["t2d"], head.t2d)
            d2t, t2d = torch.zeros(100, dtype=torch.long), torch.zeros(head.config.vocab_size, dtype=torch.bool)
            d2t.copy_(mapping["d2t"]), t2d.copy_(mapping["t2d"])         # load_vocab_mapping's copy_ into buffers
            used = torch.nonzero(t2d).flatten()                           # process_token_dict_to_mappings' layout
            assert torch.equal(d2t, used - torch.arange(len(used)))
        else:
            vcfg = speculators_vllm_config(cfg)
            assert vllm_reads(vcfg, n) == layers and vcfg["norm_before_residual"] is False
            with safe_open(str(out / "model.safetensors"), framework="pt") as f:
                names = set(f.keys())
            assert "layers.0.self_attn.q_proj.weight" in names and not any(k.startswith("midlayer.") for k in names)
        assert "COMMANDS.md" in {p.name for p in out.iterdir()}
        assert check_draft(out, facts)["ok"]


def test_sglang_ids_follow_the_target_family(deep, tmp_path):
    layers = [3, 5]
    llama_facts, ds_facts = TargetFacts("llama", 6, "bfloat16"), TargetFacts("deepseek_v3", 6, "bfloat16")
    head, draft = make_draft(deep, layers, tmp_path, name="two", facts=llama_facts)
    llama = read(export_draft(draft, "sglang", tmp_path / "l", llama_facts))
    ds = read(export_draft(draft, "sglang", tmp_path / "ds", ds_facts))
    assert llama["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4]      # +1 added back by SGLang
    assert ds["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 5]         # taken as written
    assert sglang_reads(llama, "llama", 6) == sglang_reads(ds, "deepseek_v3", 6) == layers
    assert sglang_reads(llama, "deepseek_v3", 6) == [2, 4]     # a Llama-convention draft on DeepSeek: one layer off
    assert not check_draft(tmp_path / "l", ds_facts)["ok"] and check_draft(tmp_path / "ds", ds_facts)["ok"]
    assert llama["eagle_aux_hidden_state_layer_ids"] == ds["eagle_aux_hidden_state_layer_ids"] == layers


def test_the_written_dtype_is_the_targets_or_the_chosen_one(tiny, tmp_path):
    head, draft = make_draft(tiny, [1, 2, 3], tmp_path)
    assert target_facts(tiny).dtype == "float32"
    assert read(draft)["torch_dtype"] == read(draft)["dtype"] == "float32"
    for facts, dtype, want in ((LLAMA, None, torch.bfloat16), (LLAMA, "float16", torch.float16)):
        out = export_draft(draft, "sglang", tmp_path / str(want), facts, dtype=dtype)
        name = str(want).replace("torch.", "")
        assert read(out)["torch_dtype"] == name and read(out, "layerscope.json")["dtype"] == name
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert f.get_tensor("fc.weight").dtype == want and f.get_tensor("d2t").dtype == torch.int64
            assert f.get_tensor("t2d").dtype == torch.bool
        loaded = load_draft(out)                  # LayerScope still loads it (as float32)
        assert torch.allclose(loaded.fc.weight, head.fc.weight.to(want).float())


def test_layers_json_gives_the_set_three_ways(tiny, tmp_path):
    _, draft = make_draft(tiny, [1, 2, 3], tmp_path)
    rec = read(draft, "layers.json")
    assert rec["hf_hidden_states"] == [1, 2, 3] and rec["vllm_speculators_ids"] == [1, 2, 3]
    assert rec["sglang_specforge_ids"] == [0, 1, 2] and rec["target"]["model_type"] == "llama"
    assert all(v["ok"] for v in rec["engines"].values())
    _, ds = make_draft(tiny, [1, 2, 3], tmp_path, name="ds", facts=DEEPSEEK)
    rec = read(ds, "layers.json")
    assert rec["sglang_specforge_ids"] is None and not rec["engines"]["sglang"]["ok"]
    assert "starting at layer 1" in rec["engines"]["sglang"]["reason"] and rec["engines"]["vllm"]["ok"]


def test_refusals_name_the_engine_and_the_reason(tiny, tmp_path):
    _, two = make_draft(tiny, [1, 3], tmp_path, name="two", facts=LLAMA)
    for engine in ("vllm", "specforge", "speculators"):
        with pytest.raises(DraftError, match=f"Cannot export for {engine}: .*exactly 3.*reads 2"):
            export_draft(two, engine, tmp_path / engine, LLAMA)
    assert sglang_reads(read(export_draft(two, "sglang", tmp_path / "s2", LLAMA)), "llama", 4) == [1, 3]
    _, zero = make_draft(tiny, [0, 2, 3], tmp_path, name="zero", facts=LLAMA)
    for engine in ("sglang", "specforge"):
        with pytest.raises(DraftError, match=f"Cannot export for {engine}: .*layer 0"):
            export_draft(zero, engine, tmp_path / engine, LLAMA)
    out = export_draft(zero, "vllm", tmp_path / "v0", LLAMA)          # recent vLLM captures the embedding output
    assert vllm_reads(read(out), 4) == [0, 2, 3] and "EagleModelMixin" in (out / "COMMANDS.md").read_text()
    # deepseek-family SGLang targets capture layer 0 through LayerCommunicator: ids taken as written
    assert sglang_reads(read(export_draft(zero, "sglang", tmp_path / "d0", DEEPSEEK)), "deepseek_v3", 4) == [0, 2, 3]
    assert not (tmp_path / "vllm").exists() and not (tmp_path / "sglang").exists()


def test_check_draft_catches_edited_ids(tiny, tmp_path, capsys):
    _, draft = make_draft(tiny, [1, 2, 3], tmp_path)
    assert check_draft(draft, LLAMA)["ok"]
    out = export_draft(draft, "vllm", tmp_path / "v", LLAMA)
    cfg = read(out)
    (out / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [1, 2, 2]}))
    report = check_draft(out, LLAMA)
    assert not report["ok"] and "vllm" in report["problems"][0] and "[1, 2, 2]" in report["problems"][0]
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}))
    report = check_draft(out, LLAMA)
    assert not report["ok"] and "SILENT FALLBACK" in report["problems"][0]
    # the nested SGLang list edited to the vLLM convention: SGLang would read one layer deeper
    cfg["eagle_config"] = {**cfg["eagle_config"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    (draft / "config.json").write_text(json.dumps(cfg))
    report = check_draft(draft, LLAMA)
    assert not report["ok"] and {p.split(":")[0] for p in report["problems"]} == {"sglang", "specforge"}
    # the same through the command line: exit 2, the table on stdout
    assert cli(["check-draft", str(draft), "--target", "tiny-llama"]) == 2
    printed = capsys.readouterr()
    assert "FAIL sglang" in printed.out and "reads [2, 3, 4]" in printed.out and "error:" in printed.err
    assert cli(["check-draft", str(tmp_path / "v"), "--target", "tiny-llama", "--json"]) == 2


def test_check_draft_reads_a_converted_speculators_directory(tiny, tmp_path):
    _, draft = make_draft(tiny, [1, 2, 3], tmp_path)
    out = export_draft(draft, "speculators", tmp_path / "s", LLAMA)
    assert check_draft(out, LLAMA)["ok"]
    cfg = read(out)
    (out / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": None}))
    report = check_draft(out, LLAMA)
    assert not report["ok"] and "SILENT FALLBACK to [2, 2, 1]" in report["problems"][0]
    # an unconverted draft given to speculators convert without the ids falls back the same way
    report = check_draft(draft, LLAMA, only=["speculators"])
    assert not report["ok"] and "speculators" in report["problems"][0]


def test_export_command_writes_and_refuses(tiny, tmp_path, capsys):
    _, draft = make_draft(tiny, [1, 2, 3], tmp_path)
    assert cli(["export", str(draft), "--for", "specforge", "--out", str(tmp_path / "sf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sglang_specforge_ids"] == [0, 1, 2] and "vocab_mapping.pt" in result["files"]
    _, two = make_draft(tiny, [1, 3], tmp_path, name="two")
    assert cli(["export", str(two), "--for", "vllm", "--out", str(tmp_path / "v")]) == 2
    assert "Cannot export for vllm" in capsys.readouterr().err and not (tmp_path / "v").exists()


def test_export_needs_the_target_when_the_draft_does_not_record_it(tiny, tmp_path, capsys):
    cfg = DraftConfig.from_target(tiny.model.config, [1, 2, 3], 100, vocab_size=tiny.model.get_input_embeddings().weight.shape[0])
    draft = save_draft(tmp_path / "bare", DraftHead(cfg), {"target_fingerprint": tiny.fingerprint})
    assert read(draft, "layers.json")["target_assumed"] and read(draft)["torch_dtype"] == "float32"
    assert cli(["export", str(draft), "--for", "sglang", "--out", str(tmp_path / "s")]) == 2
    assert "--target" in capsys.readouterr().err
    assert cli(["export", str(draft), "--for", "sglang", "--out", str(tmp_path / "s"), "--target", "tiny-llama"]) == 0
    assert read(tmp_path / "s", "layers.json")["target"]["model_type"] == "llama"
    assert cli(["export", str(draft), "--for", "sglang", "--out", str(tmp_path / "x"), "--target", "tiny-llama:seed=1"]) == 2
    assert "fingerprint" in capsys.readouterr().err            # another target's weights: refused, naming both
    (draft / "layerscope.json").unlink()
    with pytest.raises(DraftError, match="no record of the layers"):
        check_draft(draft, LLAMA)
