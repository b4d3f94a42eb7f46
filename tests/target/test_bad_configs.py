"""Bad model configs are one line (exit 2 from the CLI), never a traceback: config.check_config runs before a model
is built. Each case is a config.json alone in a directory, made with transformers' own config classes (a valid
config, then the bad field written into its JSON, since the classes refuse some bad values themselves)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GPT2Config,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    MixtralConfig,
    ViTConfig,
)

from layerscope.commands import cli
from layerscope.target.config import param_count
from layerscope.target.load import byte_tokenizer

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DEEPSEEK = dict(SMALL, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                first_k_dense_replace=1)
GPT2 = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=256, bos_token_id=1, eos_token_id=2)

# name: (the config, the fields written over its JSON, what the one line says)
CASES = {
    "kv-heads": (LlamaConfig(**SMALL), {"num_key_value_heads": 3}, "num_key_value_heads = 3, which does not divide num_attention_heads = 4"),
    "no-kv-heads": (LlamaConfig(**SMALL), {"num_key_value_heads": 0}, "num_key_value_heads = 0; it must be a whole number >= 1"),
    "deepseek-v3-mla": (DeepseekV3Config(**DEEPSEEK), {"num_key_value_heads": 2}, "latent attention (kv_lora_rank) makes one key/value head"),
    "gpt2-hidden": (GPT2Config(**GPT2), {"n_embd": 66}, "hidden_size = 66, not a multiple of num_attention_heads = 4"),
    "llama-hidden": (LlamaConfig(**SMALL), {"hidden_size": 66}, "is invalid: Class validation error"),   # transformers' own check
    "no-layers": (LlamaConfig(**SMALL), {"num_hidden_layers": 0}, "num_hidden_layers = 0; it must be a whole number >= 1"),
    "unknown-layer-kind": (LlamaConfig(**SMALL), {"layer_types": ["full_attention", "lightning_attention"]}, "layer_types"),
    "not-a-causal-lm": (ViTConfig(), {}, "'vit' model, which transformers has no causal language model for"),
    "too-big-moe": (MixtralConfig(**dict(SMALL, hidden_size=8192, intermediate_size=32768, num_hidden_layers=64,
                                         num_attention_heads=64, num_key_value_heads=8, num_local_experts=512)), {},
                    "GiB of memory is available"),
}


def config_dir(tmp_path, name: str):
    config, patch, _ = CASES[name]
    folder = tmp_path / name
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text()) | patch
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def capture_args(folder, store) -> list[str]:
    return ["capture", "--model", str(folder), "--prompts", "builtin", "--limit", "1", "--max-new-tokens", "2", "--store", str(store)]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_config_is_one_line_from_capture(name, tmp_path, capsys):
    """In the CLI's own process (main() catches only LayerScopeError and disk errors: anything else would raise here)."""
    assert cli.main(capture_args(config_dir(tmp_path, name), tmp_path / "store")) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and CASES[name][2] in lines[0], lines
    assert not (tmp_path / "store" / "captures").exists() or not any((tmp_path / "store" / "captures").iterdir())


def test_a_deepseek_config_with_fewer_kv_heads_exits_2_with_one_line_and_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "layerscope.commands.cli", *capture_args(config_dir(tmp_path, "deepseek-v3-mla"),
                                                                                    tmp_path / "store")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(error_lines(result.stderr)) == 1 and "Set num_key_value_heads to 4" in result.stderr


def test_the_memory_estimate_counts_experts_and_latent_attention():
    mixtral = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8)
    assert abs(param_count(mixtral) / 46.70e9 - 1) < 0.01         # Mixtral 8x7B: 46.7B parameters
    small_moe = MixtralConfig(**dict(SMALL, num_local_experts=4))
    for config in (LlamaConfig(**SMALL), DeepseekV3Config(**DEEPSEEK), small_moe):
        with torch.device("meta"):                                 # built without memory: the exact count
            model = AutoModelForCausalLM.from_config(config)
        exact = sum(p.numel() for p in model.parameters())
        assert abs(param_count(config) / exact - 1) < 0.02, (type(config).__name__, param_count(config), exact)


def test_a_layer_kind_the_decoder_cannot_keep_exact_is_one_line(tmp_path, capsys):
    """Chunked attention loads and captures (generate runs it); decoding (profile, bench) refuses it in one line."""
    tok = byte_tokenizer()
    config = Llama4TextConfig(**dict(SMALL, vocab_size=len(tok), hidden_size=32, intermediate_size=64, head_dim=8),
                              intermediate_size_mlp=64, attention_chunk_size=8, num_local_experts=2)
    torch.manual_seed(0)
    Llama4ForCausalLM(config).save_pretrained(tmp_path / "llama4")
    tok.save_pretrained(tmp_path / "llama4")
    assert cli.main(["profile", "--model", str(tmp_path / "llama4"), "--store", str(tmp_path / "store")]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "chunked_attention" in lines[0], lines
