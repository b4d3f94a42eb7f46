"""How each production engine names, limits and reads the auxiliary layers of an EAGLE-3 draft.

LayerScope layer l is Hugging Face `hidden_states[l]`: 0 is the embedding output, l in 1..N-1 the residual
stream entering decoder layer l (= the output of decoder layer l-1). Each engine writes and reads its own ids:

    engine        id of layer l                 where the id is read                     layers    layer 0
    vllm          l                             draft config.json, top-level key         exactly 3  yes (*)
    speculators   l                             converted config.json, top-level key     exactly 3  yes (*)
    sglang        l-1 (Llama/Qwen/most)         draft config.json, eagle_config key      any (**)   no
                  l   (deepseek_v2/v3, glm4_moe_lite; a set starting at 1 cannot be written)         yes
                  l   (gpt_oss: hidden-state boundaries since PR #32334, July 2026)                  no
    specforge     the SGLang id                 run config, else draft eagle_config      exactly 3  no (ids >= 0)

(*) vLLM releases whose decoder loops capture through EagleModelMixin._maybe_add_hidden_state (2026) take
    the embedding output; older Llama loops add a residual that is still None before layer 0 and fail.
(**) SGLang sizes fc from the length of the id list since PR #24663 (May 2026); older releases take 3.

fc_norm (EAGLE-3.1: an RMSNorm on each auxiliary state before fc, the top-level config key `fc_norm`, weights
`fc_norm.{i}.weight`) is read by every engine in its 2026 releases (`fc_norm_notes` says which and what older
ones do); `refusal` takes the draft's fc_norm widths for the one case an engine cannot build.

Some engines run no EAGLE-3 draft at all for some target families, whatever the layers (`family_support`, each
engine's own rule: vLLM's aux_hidden_states_supported substring test, SGLang's per-model-file
set_eagle3_layers_to_capture, SpecForge through SGLang, speculators through vLLM); a family no rule covers is
"unknown", never "ok". `support_table` renders the README's engine table from the same rule.

Every reading rule below is reproduced from the engines' sources (paths in the comments; none of their code
is copied). When the ids are missing, every engine silently falls back to a default set, so `read_layers`
returns where the ids came from as well as the layers an engine will actually read.

This module only knows the rules (it reads no draft). They are applied by layerscope/draft/checkpoint.py (the
ids a draft directory records), engine_export.py and commands_md.py (each engine's folder and its commands)
and check.py (what each engine would read from a directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layerscope import layerset
from layerscope.errors import DraftError

ENGINES = ("vllm", "sglang", "specforge", "speculators")

# SGLang targets whose set_eagle3_layers_to_capture adds 1 only when the first id is 1 and otherwise captures
# the ids as given (sglang python/sglang/srt/models/deepseek_v2.py and glm4_moe_lite.py, the "TODO
# (Qiaolin-Yu)" branch; DeepseekV3ForCausalLM subclasses DeepseekV2ForCausalLM). Their layers capture the
# input of layer i through LayerCommunicator (python/sglang/srt/layers/communicator.py), which also works
# before layer 0, where the residual is still None.
SGLANG_FIRST_ID_ONE = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite"})

# SGLang targets whose ids are hidden-state boundaries, id = hidden_states index, without the +1: gpt-oss since
# PR #32334 (merged July 2026, python/sglang/srt/models/gpt_oss.py: "Interpret GPT-OSS EAGLE3 layer IDs as
# hidden-state boundary indices"); releases before it add 1 (notes() says so).
SGLANG_BOUNDARY = frozenset({"gpt_oss"})

# Which target families each engine runs an EAGLE-3 draft for, decided by the engine's own rule (family_support).
# Every list below is read from the engine's source (files and dates in the comments; none of their code is copied).
# A family no rule covers is "unknown: not in <list> as of <source>", never "ok".
#
# vLLM: SpeculativeConfig refuses method eagle3 unless the target's hf_text_config.model_type CONTAINS one of
# aux_hidden_states_supported (a substring test: "qwen3_moe" and "qwen3_5_text" pass through "qwen"), vllm/config/
# speculative.py, in every release until PR #42536 (merged 2026-05-13) removed the list; since then the target's model
# class must implement SupportsEagle3 (vllm/v1/worker/gpu_model_runner.py, eagle3_utils.py: "Model does not support
# EAGLE3 interface"), which every class the list named does. The list below is the last one vLLM shipped.
VLLM_SOURCE = "vllm/config/speculative.py (before PR #42536, May 2026)"
VLLM_AUX_HIDDEN_STATES_SUPPORTED = ("llama", "qwen", "minicpm", "gpt_oss", "hunyuan_vl", "hunyuan_v1_dense", "afmoe",
                                    "nemotron_h", "deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "minimax_m2",
                                    "gemma4")
# Families checked outside the list, so refused rather than unknown (model_type -> what else was checked): vLLM's
# BambaForCausalLM (vllm/model_executor/models/bamba.py) does not implement SupportsEagle3 either.
VLLM_CHECKED_REFUSALS = {"gemma2": "", "gemma3": "", "gemma3_text": "", "cohere": "", "cohere2": "", "starcoder2": "",
                         "mistral": "", "bamba": "; its BambaForCausalLM (bamba.py) has no SupportsEagle3 either"}
# SGLang calls set_eagle3_layers_to_capture on the target (python/sglang/srt/model_executor/model_runner.py): the
# families whose model file defines it, directly or through the class it subclasses (model_type -> file).
SGLANG_SOURCE = "python/sglang/srt/models/*.py (sglang main, 2026)"
SGLANG_EAGLE3_TARGETS = {
    "llama": "llama.py", "phi3": "llama.py (Phi3ForCausalLM subclasses LlamaForCausalLM)",
    "mistral": "mistral.py (MistralForCausalLM subclasses LlamaForCausalLM)", "qwen2": "qwen2.py", "qwen3": "qwen3.py",
    "qwen3_moe": "qwen3_moe.py", "gpt_oss": "gpt_oss.py", "deepseek_v2": "deepseek_v2.py",
    "deepseek_v3": "deepseek_v2.py", "kimi_k2": "deepseek_v2.py", "glm4_moe_lite": "glm4_moe_lite.py"}
# Targets whose model file has no set_eagle3_layers_to_capture and whose decoder loop captures nothing: gemma2.py
# Gemma2ForCausalLM, commandr.py CohereForCausalLM (cohere2.py's Cohere2ForCausalLM subclasses it), starcoder2.py,
# granite.py GraniteForCausalLM, olmo2.py Olmo2ForCausalLM, lfm2.py Lfm2ForCausalLM.
SGLANG_WITHOUT_EAGLE3 = {"gemma2": "gemma2.py", "cohere": "commandr.py", "cohere2": "cohere2.py and commandr.py",
                         "starcoder2": "starcoder2.py", "granite": "granite.py", "olmo2": "olmo2.py", "lfm2": "lfm2.py"}
# SGLang's Gemma 3 target captures the branch output, not the residual stream a draft reads: the decoder keeps the
# residual apart and python/sglang/srt/models/gemma3_causal.py appends hidden_states, not hidden_states + residual
# (gpt_oss.py adds it); the fix, "Fix Gemma auxiliary hidden-state captures", is open (sglang PR #39286).
SGLANG_BROKEN_CAPTURE = frozenset({"gemma3", "gemma3_text"})
# SpecForge captures the target through SGLang only: model.target_backend accepts "sglang" alone
# (specforge/config/schema.py since commit 97d7880d, 2026-07-15); the in-process HF and custom target backends were
# removed with the server-only cutover (commit 7d1fbf08, 2026-07-14), and its capture calls the target's
# set_eagle3_layers_to_capture (specforge/offline_capture/sglang_backend/capture.py). So SpecForge trains what SGLang
# captures. speculators: its drafts are served by vLLM and trained on hidden states vLLM generates, so vLLM's rule.
SPECFORGE_SOURCE = "specforge/config/schema.py (main, 2026-08-08)"


@dataclass(frozen=True)
class Support:
    """An engine's verdict on a target family: status "ok" | "refused" | "unknown", and why (one line; "" for ok)."""
    status: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def family_support(engine: str, model_type: str) -> Support:
    """Whether `engine` runs an EAGLE-3 draft for a target of this family, by the engine's own rule (the lists above)."""
    _check_engine(engine)
    if engine in ("vllm", "speculators"):
        return _vllm_support(engine, model_type)
    sglang = _sglang_support(model_type)
    if engine == "sglang" or sglang.ok:
        return sglang
    if sglang.status == "unknown":
        return Support("unknown", f"unknown: specforge captures through SGLang only ({SPECFORGE_SOURCE}), and "
                                  + sglang.reason.removeprefix("unknown: "))
    return Support("refused", "specforge captures through SGLang only (model.target_backend: sglang, "
                              f"{SPECFORGE_SOURCE}; its HF backend was removed 2026-07-14), and " + sglang.reason)


def _vllm_support(engine: str, model_type: str) -> Support:
    if any(name in model_type for name in VLLM_AUX_HIDDEN_STATES_SUPPORTED):
        return Support("ok")
    served = "" if engine == "vllm" else "speculators drafts are served by vLLM, and "
    listed = ", ".join(VLLM_AUX_HIDDEN_STATES_SUPPORTED)
    if model_type in VLLM_CHECKED_REFUSALS:
        return Support("refused", f"{served}vllm runs EAGLE-3 only for targets whose model_type contains one of "
                                  f"aux_hidden_states_supported ({VLLM_SOURCE}), and {model_type} contains none"
                                  + VLLM_CHECKED_REFUSALS[model_type])
    return Support("unknown", f"unknown: {served}{model_type} is not in vllm's aux_hidden_states_supported ({listed}) "
                              f"as of {VLLM_SOURCE}; newer vLLM serves it only if its model class implements "
                              "SupportsEagle3")


def _sglang_support(model_type: str) -> Support:
    if model_type in SGLANG_EAGLE3_TARGETS:
        return Support("ok")
    if model_type in SGLANG_WITHOUT_EAGLE3:
        return Support("refused", f"SGLang's {model_type} target (python/sglang/srt/models/"
                                  f"{SGLANG_WITHOUT_EAGLE3[model_type]}) has no set_eagle3_layers_to_capture, which "
                                  "EAGLE-3 calls on the target")
    if model_type in SGLANG_BROKEN_CAPTURE:
        return Support("refused", "SGLang's Gemma 3 target captures the layers' branch output without the residual "
                                  "stream the draft was trained on (python/sglang/srt/models/gemma3_causal.py; the "
                                  "fix, PR #39286, is not merged)")
    listed = ", ".join(sorted(SGLANG_EAGLE3_TARGETS))
    return Support("unknown", f"unknown: {model_type} is not in SGLang's targets with set_eagle3_layers_to_capture "
                              f"({listed}) as of {SGLANG_SOURCE}")


@dataclass(frozen=True)
class TargetFacts:
    """What the engines need to know about the target: its family, depth and weight dtype."""
    model_type: str          # the target's config.json model_type ("llama", "qwen3", "deepseek_v3", ...)
    num_layers: int          # N decoder layers
    dtype: str               # "bfloat16" | "float16" | "float32": the dtype of the target's weights
    architectures: tuple = ()   # the target's config.json architectures

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "num_layers": self.num_layers, "dtype": self.dtype,
                "architectures": list(self.architectures)}

    @classmethod
    def from_dict(cls, d: dict) -> "TargetFacts":
        return cls(model_type=str(d["model_type"]), num_layers=int(d["num_layers"]), dtype=str(d["dtype"]),
                   architectures=tuple(d.get("architectures") or ()))


def sglang_rule(model_type: str) -> str:
    """"always": SGLang adds 1 to every id (Llama, Qwen, Mistral, ... : python/sglang/srt/models/llama.py,
    qwen2.py, qwen3.py set_eagle3_layers_to_capture); "first-is-one": it adds 1 only when the first id is 1;
    "boundary": the ids are hidden_states indices (gpt-oss)."""
    if model_type in SGLANG_BOUNDARY:
        return "boundary"
    return "first-is-one" if model_type in SGLANG_FIRST_ID_ONE else "always"


# The families the README's engine table lists (tests/families/test_families.py's matrix, the hybrids included), in its order;
# qwen3_5_text is the text model_type vLLM tests (hf_text_config).
TABLE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "mistral", "phi3", "olmo2",
                  "granite", "gemma2", "gemma3_text", "cohere2", "starcoder2", "exaone4", "glm4_moe",
                  "hunyuan_v1_dense", "minimax_m2", "smollm3", "bamba", "lfm2", "granitemoehybrid", "jamba",
                  "falcon_h1", "qwen3_next", "qwen3_5_text", "olmo_hybrid")
ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang", "specforge": "SpecForge", "speculators": "speculators"}
CELLS = {"ok": "✓", "refused": "refused", "unknown": "unknown"}


def support_table(families=TABLE_FAMILIES) -> str:
    """The README's engine support table (Markdown), one row per target model_type, from family_support."""
    lines = ["| target `model_type` | " + " | ".join(ENGINE_TITLES[e] for e in ENGINES) + " |",
             "|---" * (len(ENGINES) + 1) + "|"]
    for model_type in families:
        cells = [CELLS[family_support(e, model_type).status] for e in ENGINES]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def family_refusal(engine: str, model_type: str) -> str | None:
    """Why `engine` runs no EAGLE-3 draft for a target of this family, whatever its layers (None: it does). A family
    no rule covers gets its "unknown: not in <list> as of <source>" line: never served on a guess."""
    support = family_support(engine, model_type)
    return None if support.ok else support.reason


def specforge_backend(model_type: str) -> str:
    """The target backend SpecForge captures this family with: "sglang", the only one model.target_backend takes
    since the server-only cutover (specforge/config/schema.py, 2026-07-15; the HF backend, which hooked
    model.layers[id] of any transformers causal LM, was removed 2026-07-14). A family SGLang cannot capture is
    refused for SpecForge by family_support."""
    return "sglang"


def default_layers(engine: str, num_layers: int) -> list[int]:
    """The set an engine reads when no ids reach it, as LayerScope layers (hidden_states indices).
    vLLM: get_eagle3_default_aux_hidden_state_layers = (2, N//2, N-3) (vllm/model_executor/models/llama.py),
    used by set_eagle3_aux_hidden_state_layers when the draft config has no ids
    (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); SGLang: [2, N//2, N-3] captured without the +1
    (set_eagle3_layers_to_capture(None)); SpecForge: [1, N//2-1, N-4] in SGLang ids
    (specforge/algorithms/model_providers.py resolve_eagle_capture_layers), i.e. the same layers;
    speculators: resolve_target_layer_ids -> [2, N//2, N-3] (src/speculators/models/utils.py)."""
    _check_engine(engine)
    return layerset.default_rule(num_layers)


def refusal(engine: str, layers: list[int], facts: TargetFacts, fc_norm: tuple[int, int] | None = None) -> str | None:
    """Why `engine` cannot serve or train a draft on `layers` of this target (None when it can).
    fc_norm: the draft's (hidden_size, target_hidden_size) when it has the per-layer norm before fc, else None."""
    family = family_refusal(engine, facts.model_type)
    if family:
        return family
    if fc_norm is not None and engine == "speculators" and fc_norm[0] != fc_norm[1]:
        # Eagle3DraftModel builds each fc_norm RMSNorm at the draft's hidden size (`norm_class(self.hidden_size)`,
        # src/speculators/models/eagle3/core.py) while the chunks it norms are target_hidden_size wide; vLLM, SGLang
        # and SpecForge size theirs by target_hidden_size
        return (f"speculators builds fc_norm at the draft's hidden size {fc_norm[0]}, and this draft's auxiliary "
                f"states are {fc_norm[1]} wide")
    k = len(layers)
    if engine in ("vllm", "speculators") and k != 3:
        # vllm/model_executor/models/llama_eagle3.py: fc = ReplicatedLinear(target_hidden_size * 3, hidden_size);
        # a speculators checkpoint is served by the same Eagle3LlamaForCausalLM
        # (vllm/transformers_utils/configs/speculators/algos.py update_eagle3)
        return (f"{engine} reads exactly 3 layers (its Llama EAGLE-3 draft builds fc for 3 x target_hidden_size); "
                f"this draft reads {k}")
    if engine == "specforge" and k != 3:
        # specforge/application/planning.py and algorithms/model_providers.py: "exactly three" non-negative ids
        return f"specforge trains EAGLE-3 drafts on exactly 3 layers (model.aux_hidden_state_layer_ids); this draft reads {k}"
    if engine in ("sglang", "specforge"):
        try:
            ids = sglang_ids(layers, facts.model_type)
        except DraftError as e:
            return e.problem if engine == "sglang" else f"specforge captures through SGLang, and {e.problem}"
        if engine == "specforge" and min(ids) < 0:
            return (f"specforge needs non-negative SGLang ids, and layer 0 (the embedding output) would be id -1 "
                    f"for a {facts.model_type} target")
    return None


def notes(engine: str, layers: list[int], facts: TargetFacts, fc_norm: bool = False) -> list[str]:
    """What the user must know to serve `layers` on `engine` even when the engine takes them (fc_norm: the draft
    has the per-layer norm before fc)."""
    out = fc_norm_notes(engine) if fc_norm else []
    if engine in ("vllm", "speculators") and 0 in layers:
        out.append("layer 0 (the embedding output) needs a vLLM whose decoder loop captures through "
                   "EagleModelMixin._maybe_add_hidden_state (vllm/model_executor/models/interfaces.py, 2026); "
                   "older Llama loops add a None residual before layer 0 and fail")
    if engine == "sglang" and len(layers) != 3:
        out.append(f"{len(layers)} layers need an SGLang whose EAGLE-3 draft sizes fc from the length of "
                   "eagle_config.eagle_aux_hidden_state_layer_ids (PR #24663, May 2026); older releases take 3")
    if engine in ("sglang", "specforge") and sglang_rule(facts.model_type) == "boundary":
        out.append(f"SGLang reads {facts.model_type} ids as hidden-state boundaries since PR #32334 (July 2026); "
                   "older releases add 1 to every id and would read the layers after these: serve with a newer one")
    if engine == "speculators":
        out.append("speculators convert ignores the ids in the draft's config.json and falls back to "
                   f"{default_layers('speculators', facts.num_layers)} unless they are passed in --algorithm-kwargs")
    return out


def fc_norm_notes(engine: str) -> list[str]:
    """Which releases of `engine` build the per-layer norm before fc from the top-level `fc_norm` key of the
    draft's config and load `fc_norm.{i}.weight`, and what an older one does with such a draft."""
    _check_engine(engine)
    if engine == "vllm":
        # vllm/model_executor/models/llama_eagle3.py: fc_norm (one RMSNorm per auxiliary state) built from the
        # draft config and applied in combine_hidden_states, PR #42764 (May 2026)
        return ["fc_norm needs a vLLM with PR #42764 (May 2026), whose llama_eagle3.py builds and applies it; an "
                "older vLLM has no fc_norm.* parameters and does not load this checkpoint"]
    if engine == "speculators":
        # speculators: Eagle3SpeculatorConfig.fc_norm (src/speculators/models/eagle3/config.py, 0.9);
        # vLLM's speculators reader copies it to the draft config since PR #46488 (June 2026,
        # vllm/transformers_utils/configs/speculators/algos.py update_eagle3)
        return ["fc_norm needs speculators 0.9 (Eagle3SpeculatorConfig.fc_norm) and, to serve, a vLLM whose "
                "speculators reader passes the key on (PR #46488, June 2026); an older vLLM drops it and serves the "
                "draft without the norms, without a word"]
    if engine == "sglang":
        # python/sglang/srt/models/llama_eagle3.py (2026): fc_norm = ModuleList of RMSNorm(target_hidden_size), one
        # per auxiliary state, when getattr(config, "fc_norm") (or the older use_aux_norm); its load_weights skips
        # names it has no parameter for, so an older release loads the draft and leaves the norms out
        return ["fc_norm needs an SGLang whose llama_eagle3.py reads it (2026); an older release skips the "
                "fc_norm.* weights without a word and serves the draft without the norms"]
    # specforge/modeling/draft/llama3_eagle.py: fc_norm from the draft config (draft_config.json), applied in
    # project_hidden_states; EAGLE-3.1 support, SpecForge PR #568 (May 2026)
    return ["fc_norm needs a SpecForge with EAGLE-3.1 support (PR #568, May 2026), which builds it from "
            "draft_config.json's fc_norm"]


# ----------------------------------------------------------------------------------------- writing ids

def vllm_ids(layers: list[int]) -> list[int]:
    """vLLM and speculators ids: id l = the input of decoder layer l = hidden_states[l] (the target's decoder
    loop appends hidden_states + residual before running layer idx, or through _maybe_add_hidden_state(idx)
    after layer idx-1: vllm/model_executor/models/llama.py, interfaces.py)."""
    return [int(l) for l in layers]


def sglang_ids(layers: list[int], model_type: str) -> list[int]:
    """The ids to write under eagle_config for SGLang (and SpecForge) so that it reads `layers` of this target."""
    layers = [int(l) for l in layers]
    if sglang_rule(model_type) == "boundary":
        # gpt_oss.py captures hidden_states + residual before layer id; the residual is still None before layer 0
        if 0 in layers:
            raise DraftError(f"sglang cannot read layer 0 (the embedding output) of a {model_type} target: its "
                             "decoder loop adds a residual that is still None before the first layer",
                             "Choose a layer set without layer 0 for SGLang")
        return layers
    if sglang_rule(model_type) == "always":
        # llama.py set_eagle3_layers_to_capture: layers_to_capture = [val + 1 for val in layer_ids], and the
        # decoder loop captures hidden_states + residual before layer i, i.e. hidden_states[i]
        if 0 in layers:
            raise DraftError(f"sglang cannot read layer 0 (the embedding output) of a {model_type} target: its "
                             "decoder loop adds a residual that is still None before the first layer (id -1)",
                             "Choose a layer set without layer 0 for SGLang")
        return [l - 1 for l in layers]
    # first-is-one: [id + 1 ...] when ids[0] == 1, else the ids as written. Writing the layers themselves reads
    # them unless the set starts at 1; a set starting at 2 may be written either way, a set starting at 1 not at all
    if layers[0] == 1:
        raise DraftError(f"sglang cannot read a set starting at layer 1 of a {model_type} target: it adds 1 to "
                         "every id when the first id is 1, and takes the ids as written otherwise",
                         "Start the layer set at another layer for this target")
    return list(layers)


# ----------------------------------------------------------------------------------------- reading ids

def read_layers(engine: str, config: dict, facts: TargetFacts, run_ids: list[int] | None = None) -> tuple[list[int], str]:
    """The layers (hidden_states indices) `engine` actually reads from a draft `config` (config.json as a
    dict) for this target, and where they came from: "config" or "default (...)" for a silent fallback.
    run_ids: ids given outside the draft (SpecForge model.aux_hidden_state_layer_ids, speculators
    --algorithm-kwargs), which take precedence the way each engine applies them."""
    _check_engine(engine)
    n = facts.num_layers
    if engine == "vllm":
        # eagle3_utils.get_eagle3_aux_layers_from_config: hf_config.eagle_aux_hidden_state_layer_ids if it is a
        # non-empty list or tuple, else the target's default
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if ids and isinstance(ids, (list, tuple)):
            return vllm_ids(ids), "config"
        return default_layers("vllm", n), "default (no top-level eagle_aux_hidden_state_layer_ids)"
    if engine == "speculators":
        if "speculators_model_type" in config:
            # a converted checkpoint: vLLM's speculators reader copies the top-level ids when they are truthy
            # (vllm/transformers_utils/configs/speculators/algos.py); speculators itself resolves None to the default
            ids = config.get("eagle_aux_hidden_state_layer_ids")
            if ids:
                return vllm_ids(ids), "config"
            return default_layers("speculators", n), "default (converted without eagle_aux_hidden_state_layer_ids)"
        # an unconverted draft: Eagle3Converter.convert takes the ids only from its argument
        # (src/speculators/convert/eagle/eagle3_converter.py), never from the input config.json
        if run_ids:
            return vllm_ids(run_ids), "--algorithm-kwargs"
        return default_layers("speculators", n), "default (speculators convert ignores the ids in config.json)"
    # sglang and specforge read the nested eagle_config list (sglang model_runner.py; SpecForge
    # resolve_eagle_capture_layers, where model.aux_hidden_state_layer_ids of the run config comes first)
    ids = run_ids if (engine == "specforge" and run_ids is not None) else (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_layers(engine, n), "default (no eagle_config.eagle_aux_hidden_state_layer_ids)"
    ids = [int(i) for i in ids]
    rule = sglang_rule(facts.model_type)
    if rule == "always" or (rule == "first-is-one" and ids and ids[0] == 1):
        return [i + 1 for i in ids], "config"
    return ids, "config"


def speculators_reads(config: dict, facts: TargetFacts) -> tuple[list[int] | None, str]:
    """The layers the speculators library itself reads from a converted config.json, and where from:
    Eagle3DraftModel.from_pretrained hands the top-level eagle_aux_hidden_state_layer_ids to
    resolve_target_layer_ids with the verifier's depth N (src/speculators/models/eagle3/core.py,
    src/speculators/models/utils.py): null -> [2, N//2, N-3] with a warning, else the ids as written, refused
    (None) unless distinct and within 0..N. vLLM's reader of the same file is read_layers("speculators")."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    n = facts.num_layers
    if ids is None:
        return default_layers("speculators", n), "default (eagle_aux_hidden_state_layer_ids is null)"
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids) \
            or min(ids) < 0 or max(ids) > n or len(set(ids)) != len(ids):
        return None, f"refused: the ids {ids} must be distinct and within [0, {n}]"
    return vllm_ids(ids), "config"


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise DraftError(f"Unknown engine {engine!r}", f"Use one of {', '.join(ENGINES)}")


def target_facts(target) -> TargetFacts:
    """TargetFacts of a LoadedModel. The dtype is the one its checkpoint's config.json declares (what an engine
    loads it in under --dtype auto), not the dtype LayerScope happened to load it in on this machine."""
    config = target.model.config
    declared = None
    source = Path(str(getattr(config, "_name_or_path", "") or ""))
    if (source / "config.json").is_file():
        try:
            on_disk = json.loads((source / "config.json").read_text())
            declared = on_disk.get("dtype") or on_disk.get("torch_dtype")
        except (OSError, ValueError):
            declared = None
    if declared is None:
        declared = getattr(config, "dtype", None) or target.dtype    # transformers 5 names it dtype
    return TargetFacts(model_type=str(config.model_type), num_layers=int(target.num_layers), dtype=dtype_name(declared),
                       architectures=tuple(getattr(config, "architectures", None) or ()))


DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32"}


def dtype_name(value) -> str:
    """'bfloat16' | 'float16' | 'float32' for a torch dtype or a name such as 'bf16' or 'torch.float16'."""
    name = str(value).replace("torch.", "").strip().lower()
    if name not in DTYPES:
        raise DraftError(f"Unsupported dtype {value!r} for a draft", "Use bfloat16, float16 or float32")
    return DTYPES[name]
