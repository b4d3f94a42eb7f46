"""Every architecture family the engines serve, end to end, as a user runs LayerScope on their own target.

One tiny random model per family, built from transformers' own config class (hidden 64, 8 layers, a window of
8 positions where the family slides; the hybrids' recurrent layers as tests/families/test_hybrid_decoding.py sizes them:
gated delta-nets, Mamba and Mamba-2 mixers, short convolutions, beside attention), saved as a model directory with a
byte-level tokenizer: the directory is the `--model` a user gives. Each goes through the command line in-process:

    capture -> analyze -> probe -> train-draft (from the capture) -> train-draft (online)
            -> bench (chain K=1,2, a tree, prompt lookup; every contender lossless) -> export (each engine)
            -> check-draft

Export and check-draft give each engine's own verdict (layerscope/draft/engines.py `refusal`): where it serves the
family and the set, the export checks ok; where it refuses the family ("refused") or no rule covers it ("unknown"), or
cannot express the set, export is that one line (exit 2, no traceback, no folder written).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    Cohere2Config,
    DeepseekV3Config,
    Exaone4Config,
    FalconH1Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeHybridConfig,
    HunYuanDenseV1Config,
    JambaConfig,
    Lfm2Config,
    LlamaConfig,
    MiniMaxM2Config,
    MistralConfig,
    Olmo2Config,
    OlmoHybridConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
    Starcoder2Config,
)

from layerscope import quietness
from layerscope.commands.cli import main
from layerscope.decoding import costmodel
from layerscope.draft import engines
from layerscope.draft.engines import ENGINES
from layerscope.target.load import byte_tokenizer

WINDOW = 8
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             tie_word_embeddings=False)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16)

# family: its config class and the fields that make it that family at this size
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": WINDOW}),
    "qwen2": (Qwen2Config, {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 4}),
    "qwen3": (Qwen3Config, {}),
    "qwen3_moe": (Qwen3MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gemma2": (Gemma2Config, {"sliding_window": WINDOW}),
    "gemma3": (Gemma3TextConfig, {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "gpt_oss": (GptOssConfig, {"sliding_window": WINDOW, **MOE}),
    "cohere2": (Cohere2Config, {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "starcoder2": (Starcoder2Config, {"sliding_window": WINDOW}),
    "phi3": (Phi3Config, {"pad_token_id": 0}),
    "olmo2": (Olmo2Config, {}),
    "granite": (GraniteConfig, {}),
    "deepseek_v3": (DeepseekV3Config, {"num_key_value_heads": 4, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "first_k_dense_replace": 2, "n_group": 1,
                                       "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                       "qk_nope_head_dim": 8, "v_head_dim": 16}),   # MLA: head_dim is the rotary part
    "exaone4": (Exaone4Config, {"sliding_window": WINDOW, "sliding_window_pattern": 4}),   # 3 sliding : 1 full
    "glm4_moe": (Glm4MoeConfig, {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),   # partial rotary
    "hunyuan_v1_dense": (HunYuanDenseV1Config, {}),
    "minimax_m2": (MiniMaxM2Config, MOE),
    "smollm3": (SmolLM3Config, {"no_rope_layer_interval": 4}),          # every 4th layer without rotary (NoPE)
    # hybrids: recurrent layers beside attention
    "qwen3_next": (Qwen3NextConfig, {**DELTA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32}),         # 3 delta-net : 1 attention
    "qwen3_5": (Qwen3_5TextConfig, DELTA),                                             # 3 : 1
    "olmo_hybrid": (OlmoHybridConfig, DELTA),                                          # 3 : 1
    "granitemoehybrid": (GraniteMoeHybridConfig, {**MAMBA2, "layer_types": ["mamba", "attention"] * 4, **MOE,
                                                  "shared_intermediate_size": 64}),   # Mamba-2, attention
    "falcon_h1": (FalconH1Config, {**MAMBA2, "mamba_d_ssm": 128}),                     # Mamba-2 beside attention, each layer
    "jamba": (JambaConfig, {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                            "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
                            "mamba_d_conv": 4, "mamba_dt_rank": 8}),                   # Mamba (1), attention
    "bamba": (BambaConfig, {**MAMBA2, "attn_layer_indices": [1, 3, 5, 7]}),            # Mamba-2, attention
    "lfm2": (Lfm2Config, {"full_attn_idxs": [1, 3, 5, 7], "conv_L_cache": 3}),         # short convolutions, attention
}
LAYERS = "1,4,6"                   # a three-layer set inside 0..7

pytestmark = pytest.mark.usefixtures("one_thread", "quick_bench")


@pytest.fixture
def quick_bench(monkeypatch):
    """bench measures the machine's cost curve for its predicted speedups before it decodes (1.6 of a family's
    ~6 s here, profiled), and samples the machine for half a second before the curve and again before the decoding;
    this test checks the decoding, not the predictions nor the timings, so the curve is a real one over fewer sizes
    (1..8 tokens, one prefix length, timed once) and each sample a real one over 20 ms."""
    monkeypatch.setattr(costmodel, "cost_curve",
                        functools.partial(costmodel.cost_curve, max_tokens=8, cache_lengths=(64,), repeats=1))
    monkeypatch.setattr(quietness, "settle", lambda options=quietness.MachineOptions(), progress=None:
                        quietness.sample(0.02, options))


def model_dir(root: Path, family: str) -> Path:
    """A saved tiny random model of `family` with a byte-level tokenizer: what a user passes as --model."""
    config_class, fields = FAMILIES[family]
    tok = byte_tokenizer()
    config = config_class(**{**SHAPE, **fields, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                             "pad_token_id": tok.pad_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = root / family
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys, *args):
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_goes_through_every_step(family, tmp_path, capsys):
    model = model_dir(tmp_path / "models", family)
    store = ["--store", tmp_path / "store"]

    cap = run_json(capsys, "capture", "--model", model, "--prompts", "builtin", "--limit", 4, "--max-new-tokens", 8,
                   *store)
    assert cap["num_layers"] == 8 and cap["tokens"] > 0

    stats = run_json(capsys, "analyze", cap["key"], *store)
    assert len(stats["entropy"]) == 9 and all(torch.isfinite(torch.tensor(stats["entropy"])))

    probe = run_json(capsys, "probe", cap["key"], "--layers", LAYERS, *store)
    assert probe["sets"][0]["layers"] == [1, 4, 6]

    from_capture = tmp_path / "draft"
    trained = run_json(capsys, "train-draft", cap["key"], "--layers", LAYERS, "--steps", 3, "--batch-size", 2,
                       "--seq-len", 32, "--draft-vocab", 64, "--out", from_capture, *store)
    assert trained

    online = run_json(capsys, "train-draft", "--model", model, "--prompts", "builtin", "--limit", 6,
                      "--max-new-tokens", 8, "--val-conversations", 2, "--eval-points", 1, "--layers", LAYERS,
                      "--steps", 3, "--batch-size", 2, "--seq-len", 32, "--draft-vocab", 64, *store)
    assert online

    report = run_json(capsys, "bench", "--model", model, "--draft", from_capture, "--prompts", "builtin",
                      "--limit", 2, "--max-new-tokens", 12, "--k", "1,2", "--tree", "--tree-budget", 6,
                      "--tree-top-k", 2, "--tree-depth", 3, "--lookup", 2, "--no-peers", *store)
    names = [r["name"] for r in report["results"]]
    assert len(names) >= 5, names            # plain decoding, K=1, K=2, the tree, the chain with lookup
    assert all(r["lossless"] for r in report["results"]), [(r["name"], r["lossless"]) for r in report["results"]]

    facts = engines.TargetFacts(model_type=FAMILIES[family][0]().model_type, num_layers=8, dtype="float32")
    for engine in ENGINES:
        verdict = engines.refusal(engine, [int(l) for l in LAYERS.split(",")], facts)   # the engine's own rule
        out = tmp_path / "exports" / engine
        code, text, err = run(capsys, "export", from_capture, "--for", engine, "--target", model, "--out", out,
                              *store)
        if verdict is None:
            assert code == 0, (engine, err)
            checked = run_json(capsys, "check-draft", out, "--target", model, *store)
            assert checked["ok"], (engine, checked)
        else:
            lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert code == 2 and "Traceback" not in err and len(lines) == 1, (engine, err)
            assert verdict in lines[0], (engine, verdict, lines[0])
            assert not out.exists()
