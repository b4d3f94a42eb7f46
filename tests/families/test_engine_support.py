"""Which engines serve an EAGLE-3 draft for each target family: check-draft over every family of
tests/families/test_families.py's matrix and the hybrid families transformers 5 has configs for, against a table written
from the engines' own rules (layerscope/draft/engines.py cites them):

    vllm         model_type contains one of aux_hidden_states_supported (vllm/config/speculative.py)
    sglang       the model file defines set_eagle3_layers_to_capture (python/sglang/srt/models/*.py)
    specforge    SGLang's verdict (its only target backend since July 2026)
    speculators  vLLM's verdict (vLLM serves its drafts)

A family no rule covers is "unknown: not in <list> as of <source>", never ok. The README's engine table is
support_table's rendering of the same rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig

from layerscope.draft import engines
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.engines import ENGINES, TargetFacts
from layerscope.draft.export.check import check_draft
from layerscope.draft.model import DraftConfig, DraftHead
from tests.families.test_families import FAMILIES

HYBRIDS = ("bamba", "lfm2", "granitemoehybrid", "jamba", "falcon_h1", "qwen3_next", "qwen3_5", "olmo_hybrid")
OK, NO, UNKNOWN = "ok", "refused", "unknown"
# model_type -> (vllm, sglang, specforge, speculators)
EXPECTED = {
    "llama": (OK, OK, OK, OK),
    "mistral": (NO, OK, OK, NO),              # not in vLLM's list; SGLang's MistralForCausalLM is its Llama
    "qwen2": (OK, OK, OK, OK),
    "qwen3": (OK, OK, OK, OK),
    "qwen3_moe": (OK, OK, OK, OK),            # "qwen" is a substring of it
    "gemma2": (NO, NO, NO, NO),
    "gemma3_text": (NO, NO, NO, NO),          # SGLang's capture misses the residual (PR #39286 open)
    "gpt_oss": (OK, OK, OK, OK),
    "cohere2": (NO, NO, NO, NO),
    "starcoder2": (NO, NO, NO, NO),
    "phi3": (UNKNOWN, OK, OK, UNKNOWN),       # SGLang's Phi3ForCausalLM is its Llama; vLLM's list has no phi3
    "olmo2": (UNKNOWN, NO, NO, UNKNOWN),
    "granite": (UNKNOWN, NO, NO, UNKNOWN),
    "deepseek_v3": (OK, OK, OK, OK),
    "exaone4": (UNKNOWN,) * 4,
    "glm4_moe": (UNKNOWN,) * 4,
    "hunyuan_v1_dense": (OK, UNKNOWN, UNKNOWN, OK),    # in vLLM's list
    "minimax_m2": (OK, UNKNOWN, UNKNOWN, OK),          # in vLLM's list
    "smollm3": (UNKNOWN,) * 4,
    "bamba": (NO, UNKNOWN, UNKNOWN, NO),      # and vLLM's BambaForCausalLM has no SupportsEagle3
    "lfm2": (UNKNOWN, NO, NO, UNKNOWN),
    "granitemoehybrid": (UNKNOWN,) * 4,
    "jamba": (UNKNOWN,) * 4,
    "falcon_h1": (UNKNOWN,) * 4,
    "qwen3_next": (OK, UNKNOWN, UNKNOWN, OK),
    "qwen3_5_text": (OK, UNKNOWN, UNKNOWN, OK),
    "olmo_hybrid": (UNKNOWN,) * 4,
}
LAYERS = [2, 4, 6]


def matrix_model_types() -> dict[str, str]:
    """family name -> the model_type of its config (the matrix's config classes, transformers' hybrid configs; a
    multimodal config by its text config, which is what vLLM tests)."""
    types = {name: config_class().model_type for name, (config_class, _) in FAMILIES.items()}
    types.update({name: AutoConfig.for_model(name).get_text_config().model_type for name in HYBRIDS})
    return types


MODEL_TYPES = matrix_model_types()


def test_every_family_of_the_matrix_has_an_expected_verdict():
    assert set(MODEL_TYPES.values()) == set(EXPECTED)
    assert set(EXPECTED) == set(engines.TABLE_FAMILIES)


@pytest.fixture(scope="module")
def head():
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2)
    return DraftHead(DraftConfig.from_target(config, LAYERS, 32)).eval()


@pytest.mark.parametrize("family", list(MODEL_TYPES))
def test_check_draft_gives_each_engines_own_verdict(family, head, tmp_path):
    model_type = MODEL_TYPES[family]
    facts = TargetFacts(model_type=model_type, num_layers=8, dtype="bfloat16")
    path = save_draft(tmp_path / family, head, {"layers": LAYERS, "aux_layers": LAYERS}, facts=facts)
    report = check_draft(path, facts)
    rows = {row["engine"]: row for row in report["rows"]}
    recorded = json.loads((path / "layers.json").read_text())["engines"]
    for engine, want in zip(ENGINES, EXPECTED[model_type]):
        support = engines.family_support(engine, model_type)
        assert support.status == want, (family, engine, support)
        assert "\n" not in support.reason and (support.reason == "") == (want == OK)
        if want == UNKNOWN:
            assert support.reason.startswith("unknown: ") and " not in " in support.reason and " as of " in support.reason
        assert recorded[engine]["ok"] is (want == OK), (family, engine, recorded[engine])
        if engine == "speculators":                # a LayerScope directory: speculators reads its converted form
            continue
        row = rows[engine]
        assert row["ok"] is (want == OK), (family, engine, row["status"])
        status = row["status"]
        if want == OK:
            assert status == "reads the trained layers", (family, engine, status)
        elif want == UNKNOWN:
            assert status.startswith("unknown: ") and status != "ok", (family, engine, status)
        else:
            assert status.startswith("cannot load it: "), (family, engine, status)
    assert report["ok"] is all(v == OK for v in EXPECTED[model_type][:3]), report["problems"]


def test_vllms_rule_is_a_substring_test_over_its_list():
    for model_type in ("qwen2_moe", "qwen3_vl_text", "llama4_text", "deepseek_v3", "minimax_m2", "gemma4_text"):
        assert engines.family_support("vllm", model_type).ok, model_type
    verdict = engines.family_support("vllm", "lfm2")
    assert verdict.status == UNKNOWN and "aux_hidden_states_supported" in verdict.reason and "speculative.py" in verdict.reason


def test_a_family_no_rule_covers_is_unknown_for_every_engine():
    for engine in ENGINES:
        reason = engines.family_refusal(engine, "made_up_family")
        assert reason.startswith("unknown: ") and "made_up_family" in reason and " as of " in reason, (engine, reason)
        refused = engines.refusal(engine, LAYERS, TargetFacts("made_up_family", 8, "bfloat16"))
        assert refused == reason


def test_the_readme_engine_table_is_the_rules_rendering():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    begin, end = "<!-- engine-support:begin (engines.support_table) -->\n", "<!-- engine-support:end -->"
    assert begin in readme and end in readme
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == engines.support_table(), "README.md's engine table drifted: paste engines.support_table()"
