"""COMMANDS.md: what an engine reads from an export folder, and the command lines to serve, benchmark and
train the draft at scale with it (written into every folder layerscope/draft/export/engine_export.py exports).

    ENGINE_READS                the files and keys each engine reads there, and what it ignores
    commands_md(engine, ...)    the text: the target, `layerscope check-draft`, the engine's notes, then the
                                serve / benchmark / train-at-scale commands with the ids the engine needs

The ids in the commands come from layerscope/draft/engines.py (vllm_ids, sglang_ids, default_layers).
"""

from __future__ import annotations

import json
from pathlib import Path

from layerscope.draft import engines
from layerscope.draft.engines import TargetFacts

ENGINE_READS = {
    # engine: (what it reads from the export folder, what it ignores there); docs/drafts.md has the same table
    "vllm": ("config.json: `architectures` (LlamaForCausalLMEagle3), the top-level `eagle_aux_hidden_state_layer_ids`, "
             "`draft_vocab_size`, `target_hidden_size`, the layer shape, `eagle_config.use_aux_hidden_state`, `fc_norm`; "
             "model.safetensors: `fc`, `fc_norm.*` (when on), `midlayer.*` (as `layers.0.*`, q/k/v and gate/up stacked), `norm`, `lm_head`, "
             "`d2t` (as `draft_id_to_target_id`)",
             "`t2d`, the SGLang ids under `eagle_config`, layers.json, layerscope.json, COMMANDS.md; the checkpoint "
             "has no `embed_tokens`, so the draft shares the target's embedding"),
    "sglang": ("config.json: `architectures`, `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang ids), "
               "`draft_vocab_size`, the layer shape, `tie_word_embeddings` (false), `fc_norm`; model.safetensors: the same "
               "weights under `model.`, `d2t` (as `hot_token_id = d2t + arange`)",
               "`t2d`, the top-level vLLM ids, layers.json, layerscope.json, COMMANDS.md; the EAGLE worker gives the "
               "draft the target's embedding"),
    "specforge": ("specforge.yaml (`model.aux_hidden_state_layer_ids` first, `target_model_path`, `target_backend`, "
                  "`draft_checkpoint_path` = this folder), draft_config.json (its `eagle_config` ids when the run "
                  "config has none, `fc_norm`), vocab_mapping.pt (`d2t`, `t2d`)",
                  "config.json's top-level vLLM ids, layers.json, layerscope.json, COMMANDS.md"),
    "speculators": ("config.json: `speculators_config.verifier.name_or_path` (the verifier's config for its depth "
                    "and hidden size, and its `lm_head` and final norm for the training loss), "
                    "`transformer_layer_config`, `eagle_aux_hidden_state_layer_ids`, `draft_vocab_size`, "
                    "`target_hidden_size`, `norm_before_residual` and the other norm flags (`fc_norm` among them); "
                    "model.safetensors: `fc`, `fc_norm.*` (when on), `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` and "
                    "`embed_tokens` (the target's input embedding, which its forward embeds tokens with). vLLM "
                    "serving this folder reads the same "
                    "config and weights, loads `embed_tokens` and skips `t2d`",
                    "layers.json, layerscope.json, COMMANDS.md; the verifier's own embedding and `lm_head`, which "
                    "it copies in only when the checkpoint lacks them"),
}


def commands_md(engine: str, layers: list[int], facts: TargetFacts, dtype: str, target: str, out: Path,
                draft_vocab: int, note: str | None = None, check_as: str | None = None, fc_norm: bool = False) -> str:
    """COMMANDS.md: the command lines to train at scale, serve and benchmark this draft with `engine`.
    target: how the commands name the target; note: what to change on another machine (TargetName.note);
    check_as: the LayerScope model spec for `layerscope check-draft` (default `target`); fc_norm: the draft
    has the per-layer norm before fc (its engine notes)."""
    head = _head(engine, layers, facts, dtype, target, out, note, check_as, fc_norm)
    if engine == "vllm":
        body = _serve_vllm(layers, dtype, target, out) + _train_speculators(layers, facts, target, draft_vocab)
    elif engine == "speculators":
        body = _speculators(layers, facts, dtype, target, out, draft_vocab)
    elif engine == "sglang":
        body = _sglang(layers, facts, dtype, target, out)
    else:
        body = _specforge(layers, facts, dtype, target, out)
    return "\n".join(head + body)


def _head(engine: str, layers: list[int], facts: TargetFacts, dtype: str, target: str, out: Path,
          note: str | None, check_as: str | None, fc_norm: bool) -> list[str]:
    """The title, the target, `layerscope check-draft`, what the engine reads and ignores, its notes."""
    head = [f"# {engine}: LayerScope draft on layers {layers}",
            "",
            f"Target: `{target}` ({facts.model_type}, {facts.num_layers} decoder layers, {dtype}). The target must be "
            "the weights the draft was trained on. Layer l below is Hugging Face `hidden_states[l]`; `layers.json` "
            "has the set in every engine's ids. Check what an engine will read before serving:",
            "",
            "```bash",
            f"layerscope check-draft {out} --target {check_as or target}",
            "```",
            ""]
    if note:
        head += [f"**The target's name.** {note}", ""]
    reads, ignores = ENGINE_READS[engine]
    head += [f"**What {engine} reads here:** {reads}. **Ignored:** {ignores}.", ""]
    notes = engines.notes(engine, layers, facts, fc_norm=fc_norm)
    if notes:
        head += ["Notes:", *[f"- {n}" for n in notes], ""]
    return head


def _serve_vllm(layers: list[int], dtype: str, target: str, out: Path) -> list[str]:
    """Serve and benchmark with vLLM (the draft at `out`, vLLM's ids)."""
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    return ["## Serve (vLLM)", "", "```bash",
            f"vllm serve {target} --dtype {dtype} \\",
            f"  --speculative-config '{spec}'",
            "```", "",
            "## Benchmark (vLLM)", "", "```bash",
            f"vllm bench serve --model {target} --dataset-name sharegpt \\",
            "  --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 200",
            "# acceptance per position, offline (vLLM repository):",
            f"python examples/offline_inference/spec_decode.py --method eagle3 --model-dir {target} \\",
            f"  --eagle-dir {out} --num-spec-tokens 3 --dataset-name hf --dataset-path philschmid/mt-bench",
            "```", ""]


def _train_speculators(layers: list[int], facts: TargetFacts, target: str, draft_vocab: int) -> list[str]:
    """Train at scale with speculators (vLLM's trainer), passing vLLM's ids to the server and the trainer."""
    space = " ".join(str(i) for i in engines.vllm_ids(layers))
    return ["## Train at scale (speculators, vLLM's trainer; scripts/ of the speculators repository)", "",
            "```bash",
            f"python scripts/launch_vllm.py {target} --target-layer-ids {space} -- --port 8000 &",
            "torchrun --standalone --nproc_per_node 8 scripts/train.py \\",
            f"  --verifier-name-or-path {target} --data-path ./output --vllm-endpoint http://localhost:8000/v1 \\",
            f"  --save-path ./output/checkpoints --draft-vocab-size {draft_vocab} --target-layer-ids {space}",
            "```", "",
            "Both commands need the ids: without them the server captures and the trainer assumes "
            f"`[2, N//2, N-3]` = {engines.default_layers('speculators', facts.num_layers)}.", ""]


def _serve_sglang(dtype: str, target: str, out: Path | str) -> list[str]:
    """Serve and benchmark with SGLang (the draft at `out`)."""
    return ["## Serve (SGLang)", "", "```bash",
            f"python -m sglang.launch_server --model-path {target} --dtype {dtype} \\",
            f"  --speculative-algorithm EAGLE3 --speculative-draft-model-path {out} \\",
            "  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
            "```", "",
            "## Benchmark (SGLang)", "", "```bash",
            "python -m sglang.bench_serving --backend sglang --dataset-name sharegpt --num-prompts 200",
            "```", ""]


def _speculators(layers: list[int], facts: TargetFacts, dtype: str, target: str, out: Path, draft_vocab: int) -> list[str]:
    """The speculators folder: loading it in Python, converting with the speculators tool, then vLLM's sections."""
    vllm = engines.vllm_ids(layers)
    convert = json.dumps({"eagle_aux_hidden_state_layer_ids": vllm})
    return [f"`{out}` is already the converted checkpoint, with `eagle_aux_hidden_state_layer_ids` = {vllm} "
            "and the target's input embedding. Load it in Python (when its verifier is a relative path, run this "
            "from inside the folder and pass `\".\"` for the folder):", "",
            "```python",
            "from speculators import SpeculatorModel",
            f"draft = SpeculatorModel.from_pretrained(\"{out}\")   # target_layer_ids == {vllm}",
            "```", "",
            "To convert the LayerScope draft with the speculators tool instead, pass the ids, or it silently "
            f"falls back to {engines.default_layers('speculators', facts.num_layers)}; its output has the same "
            "tensors but no `embed_tokens` (the LayerScope draft has none), and the verifier's config.json must "
            "name its `architectures`:", "",
            "```bash",
            f"speculators convert DRAFT_DIR --algorithm eagle3 --verifier {target} \\",
            f"  --output-path {out} --algorithm-kwargs '{convert}'",
            "```", ""] + _serve_vllm(layers, dtype, target, out) + _train_speculators(layers, facts, target, draft_vocab)


def _sglang(layers: list[int], facts: TargetFacts, dtype: str, target: str, out: Path) -> list[str]:
    """The SGLang folder: serve and benchmark, then where SpecForge comes in to train at scale."""
    sgl = engines.sglang_ids(layers, facts.model_type)
    return _serve_sglang(dtype, target, out) + [
        "## Train at scale", "",
        f"SpecForge trains SGLang drafts: `layerscope export DRAFT --for specforge --out DIR` writes its inputs "
        f"with the SGLang ids {sgl}.", ""]


def _specforge(layers: list[int], facts: TargetFacts, dtype: str, target: str, out: Path) -> list[str]:
    """The SpecForge folder: hidden states and training, then serving SpecForge's SGLang export."""
    sgl = engines.sglang_ids(layers, facts.model_type)
    body = ["## Train at scale (SpecForge)", "",
            "Hidden states of the target for the layers in `draft_config.json` (its eagle_config ids "
            f"{sgl}), then training; `specforge.yaml` warm-starts from this draft:", "",
            "```bash",
            "torchrun --nproc_per_node 8 scripts/prepare_hidden_states.py \\",
            f"  --target-model-path {target} --data-path ./cache/dataset/sharegpt_train.jsonl \\",
            "  --output-path ./cache/hidden_states/layerscope --chat-template llama3 --max-length 4096 \\",
            f"  --strategy eagle3 --draft-model-config {out}/draft_config.json",
            f"specforge train --config {out}/specforge.yaml",
            "python -m specforge.export.to_sglang --checkpoint ./outputs/layerscope-eagle3 \\",
            f"  --draft-config {out}/draft_config.json --vocab-mapping {out}/vocab_mapping.pt \\",
            "  --output-dir ./outputs/layerscope-eagle3-sglang",
            "```", "",
            "`model.aux_hidden_state_layer_ids` in `specforge.yaml` and the draft config's eagle_config ids are "
            f"the same SGLang ids; SpecForge takes exactly three, and without them captures "
            f"`[1, N//2-1, N-4]` (SGLang ids) = {engines.default_layers('specforge', facts.num_layers)}.", ""]
    return body + [line.replace(str(out), "./outputs/layerscope-eagle3-sglang") if "speculative-draft-model-path" in line
                   else line for line in _serve_sglang(dtype, target, out)]
