"""Exports for the engines: a draft directory rewritten as the folder vLLM, SGLang, SpecForge or speculators
trains at scale, serves and benchmarks from, with a COMMANDS.md that says how (layerscope/draft/export/commands_md.py).

    export_draft(draft, engine, out, facts)   the folder for `engine`, replaced whole or not at all; refuses
                                              (naming the engine and why) a layer set the engine cannot take
    export_zip(draft, engine)                 the same for the target layers.json records, as a zip (the app)
    engine_verdict(draft, engine)             what `engine` makes of the draft's set, without writing anything
    target_name(spec, folder, out)            how an export names its target (TargetName), so the commands
                                              resolve where they run

What each engine's folder holds:

    vllm, sglang   the draft directory itself (layerscope/draft/checkpoint.py): both read its config.json
    specforge      the draft directory + draft_config.json, vocab_mapping.pt and specforge.yaml (write_specforge)
    speculators    a converted checkpoint (write_speculators): speculators' config.json, its weight names and
                   the target's input embedding

The engines' layer-id rules and refusals are layerscope/draft/engines.py's; this module only writes what they say.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from layerscope.draft import engines
from layerscope.draft.checkpoint import (
    FORMAT,
    TORCH_DTYPES,
    check_fits,
    draft_tensors,
    engine_config,
    fc_norm_widths,
    layers_record,
    load_draft,
    read_config,
    read_layers_record,
    read_meta,
    recorded_facts,
    serving_notes,
    write_draft,
)
from layerscope.draft.engines import TargetFacts
from layerscope.draft.export.commands_md import commands_md
from layerscope.draft.model import DraftHead
from layerscope.errors import DraftError, ModelSpecError
from layerscope.store import staged
from layerscope.target.aliases import ALIASES, public_id
from layerscope.target.load import load_model

# ----------------------------------------------------------------------------------------- exports for engines

def export_draft(draft_dir, engine: str, out, facts: TargetFacts, *, dtype: str | None = None,
                 target_path: str | None = None, named=None, target=None, store=None) -> Path:
    """Write what `engine` needs to train at scale, serve and benchmark the draft in `draft_dir` into `out`
    (replaced whole or not at all). Refuses, naming the engine and the reason, a set the engine cannot take.
    target: the LoadedModel the draft was trained for, checked against it (for speculators, default: the
    draft's target_model loaded from `store`): a speculators export carries its input embedding.
    target_path: how the export names the target (default: target_name's rule). named: how COMMANDS.md and
    specforge.yaml name the folder (default `out`; a zip's `./<folder>`, which also says the folder moves)."""
    engine = engine.lower()
    if engine not in engines.ENGINES:
        raise DraftError(f"Unknown engine {engine!r}", f"Use --for {' | '.join(engines.ENGINES)}")
    head = load_draft(draft_dir)
    layers = head.aux_layers
    if facts.num_layers <= layers[-1]:
        raise DraftError(f"Draft reads layers {layers} but the target has {facts.num_layers} decoder layers",
                         "Export with the target the draft was trained for (--target)")
    reason = engines.refusal(engine, layers, facts, head.config.fc_norm_widths)
    if reason:
        fix = ("Export for another engine (layers.json lists every engine's verdict for this target); LayerScope's "
               "own decoder (bench) runs the draft" + (f"; if your {engine} release serves this family, report it"
                                                       if reason.startswith("unknown:") else "")
               if engines.family_refusal(engine, facts.model_type) else
               f"Train a draft on a layer set {engine} takes (layers.json lists every engine's verdict), or export "
               "for another engine")
        raise DraftError(f"Cannot export for {engine}: {reason}", fix)
    dtype = engines.dtype_name(dtype or facts.dtype)
    trained = read_meta(draft_dir)
    if engine == "speculators" and target is None:
        target = trained_target(draft_dir, store)
    if target is not None:
        check_fits(head.config, trained, target, draft_dir)
    meta = {**trained, "exported_for": engine, "exported_from": str(draft_dir), "dtype": dtype}
    out = Path(out)
    if target_path:
        name = TargetName(target_path, target_path, None)
    else:
        spec = target.spec if target is not None else trained.get("target_model")
        name = target_name(spec, model_folder(target), out if named is None else None)
    named = named if named is not None else out      # a str keeps "./" (a bare name could read as a hub id)
    commands = name.in_commands(named)
    with staged(out) as tmp:
        if engine == "speculators":
            write_speculators(tmp, head, meta, facts, dtype, name.verifier, target.model.get_input_embeddings().weight)
        else:
            write_draft(tmp, head, meta, facts, dtype)
        if engine == "specforge":
            write_specforge(tmp, head, facts, dtype, commands, named)
        (tmp / "COMMANDS.md").write_text(commands_md(engine, layers, facts, dtype, commands, named,
                                                     head.config.draft_vocab_size, name.note,
                                                     target.spec if target is not None else trained.get("target_model"),
                                                     fc_norm=head.config.fc_norm))
    return out


def trained_target(draft_dir, store=None):
    """The target a draft was trained for, loaded from the spec its layerscope.json records."""
    spec = read_meta(draft_dir).get("target_model")
    if not spec:
        raise DraftError(f"{draft_dir}/layerscope.json does not name the target model, whose input embedding a "
                         "speculators export carries", "Pass --target MODEL (the model the draft was trained for)")
    try:
        return load_model(spec, store=store)
    except ModelSpecError as e:
        raise DraftError(f"A speculators export carries the target's input embedding, and the draft's target "
                         f"{spec!r} does not load here ({e.problem})",
                         "Pass --target MODEL (the model the draft was trained for)") from e


def engine_verdict(draft_dir, engine: str) -> dict:
    """What `engine` makes of the draft in `draft_dir` for the target layers.json records: {"engine", "layers",
    "target" (TargetFacts), "refusal" (why it cannot take the set, or None), "notes" (what to know when it can)}.
    A draft whose layers.json records no target is a DraftError (the CLI's `export --target` handles those)."""
    engine = str(engine).lower()
    if engine not in engines.ENGINES:
        raise DraftError(f"Unknown engine {engine!r}", f"Use one of {', '.join(engines.ENGINES)}")
    if not (Path(draft_dir) / "model.safetensors").is_file():
        raise DraftError(f"Draft {draft_dir} is not in this store",
                         "Train it again here, or import the session archive with its drafts")
    meta = read_meta(draft_dir)
    facts = recorded_facts(draft_dir)
    if facts is None:
        raise DraftError(f"{draft_dir}/layers.json does not record the target's family, depth and dtype",
                         f"Export it with `layerscope export {draft_dir} --for {engine} --out DIR --target MODEL`")
    layers = meta.get("aux_layers") or meta.get("layers") or read_layers_record(draft_dir).get("hf_hidden_states")
    layers = [int(l) for l in layers or []]
    if not layers:
        raise DraftError(f"{draft_dir} has no record of the layers it was trained on (layerscope.json)",
                         "Export a draft LayerScope trained")
    widths = fc_norm_widths(read_config(draft_dir))
    return {"engine": engine, "layers": layers, "target": facts, "refusal": engines.refusal(engine, layers, facts, widths),
            "notes": engines.notes(engine, layers, facts, fc_norm=widths is not None)}


def export_zip(draft_dir, engine: str, *, dtype: str | None = None, target_path: str | None = None) -> tuple[str, bytes]:
    """`export_draft` for the target layers.json records, into a temporary folder, zipped: (file name, bytes).
    The zip holds one folder `<draft>-<engine>/`; its COMMANDS.md names it `./<draft>-<engine>` (where it is
    unpacked) and the target by target_name's rule for the draft's target_model (or as `target_path`).
    Refusals as export_draft's."""
    verdict = engine_verdict(draft_dir, engine)
    engine = verdict["engine"]
    name = f"{Path(draft_dir).resolve().name or 'draft'}-{engine}"
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="layerscope-export-") as tmp:
        out = export_draft(draft_dir, engine, Path(tmp) / name, verdict["target"], dtype=dtype,
                           target_path=target_path, named=f"./{name}")
        with zipfile.ZipFile(buf, "w") as z:
            for f in sorted(out.iterdir()):
                z.write(f, f"{name}/{f.name}",
                        compress_type=zipfile.ZIP_STORED if f.suffix in (".safetensors", ".pt") else zipfile.ZIP_DEFLATED)
    return f"{name}.zip", buf.getvalue()


# ----------------------------------------------------------------------------------------- naming the target

class TargetName:
    """How an export names its target: `verifier` in speculators' config.json (relative to the export folder
    when `relative`), `commands` in COMMANDS.md and specforge.yaml, and `note`, the COMMANDS.md line saying
    what to put in its place on another machine (None when the name resolves anywhere)."""

    def __init__(self, verifier: str, commands: str, note: str | None, relative: bool = False):
        self.verifier, self.commands, self.note, self.relative = verifier, commands, note, relative

    def in_commands(self, named) -> str:
        """The name in commands that name the export folder `named`: a relative verifier is joined to it."""
        return os.path.normpath(os.path.join(str(named), self.verifier)) if self.relative else self.commands


def model_folder(target) -> Path | None:
    """The local folder a LoadedModel was read from (None for a hub id or an in-memory model)."""
    if target is None:
        return None
    source = str(getattr(target.model.config, "_name_or_path", "") or "")
    return Path(source).resolve() if source and (Path(source) / "config.json").is_file() else None


def target_name(spec: str | None, folder: Path | None, out: Path | None) -> TargetName:
    """The rule: an alias (smollm2-135m) is named by its public Hugging Face id (aliases.ALIASES); a local
    `folder` relative to the export folder `out` when both lie under one directory below the root (out None:
    the export moves, as a zip does), else by its absolute path; anything else (a hub id, tiny-llama) as given."""
    hf = public_id(spec)
    if hf:
        alias = ALIASES[spec.strip()]
        where = f"`{folder}`" if folder else "the store's `models/gguf-*/` folder"
        return TargetName(hf, hf, f"`{hf}` is the public repository of `{spec}`. The draft was trained on "
                          f"LayerScope's float32 de-quantization of {alias.file}, stored in {where}; the "
                          "repository's original weights differ from it by the quantization error. To serve exactly "
                          "the trained-on weights, put that folder in place of the repository id.")
    if folder is not None:
        if out is not None and len(Path(os.path.commonpath([folder, out.resolve()])).parts) > 1:
            rel = os.path.relpath(folder, out.resolve())
            return TargetName(rel, rel, f"`config.json` names the verifier `{rel}`, the target's folder relative to "
                              "this folder; speculators and vLLM resolve it from the working directory, so load this "
                              "folder from inside it, or write the target's absolute path there. The commands name it "
                              "from where the export was written. On another machine put the path or Hugging Face id "
                              "of the same weights in both places.", relative=True)
        return TargetName(str(folder), str(folder), f"`{folder}` is the target's folder on the machine that exported "
                          "this draft: on another machine put the path or Hugging Face id of the same weights in its "
                          "place (in the commands below, and in config.json's verifier where there is one).")
    if not spec:
        return TargetName("TARGET", "TARGET", "`TARGET` stands for the target model: put its folder or Hugging Face "
                          "id in its place (or export with --target MODEL).")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return TargetName(spec, spec, None)
    return TargetName(spec, spec, f"`{spec}` is LayerScope's name for the target, which other tools cannot resolve: "
                      "put the target's folder or Hugging Face id in its place.")


# ----------------------------------------------------------------------------------------- the engines' own files

def write_specforge(directory: Path, head: DraftHead, facts: TargetFacts, dtype: str, target_path: str, out: Path) -> None:
    """SpecForge's inputs: the draft config (model.draft_model_config; its eagle_config ids are the capture
    layers resolve_eagle_capture_layers reads), the vocabulary mapping load_vocab_mapping reads
    (specforge/modeling/draft/base.py: torch.load -> {"d2t", "t2d"}, the layout generate_vocab_mapping_file
    writes in specforge/data/preprocessing.py) and a run config in SpecForge's schema (specforge/config/schema.py)."""
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "draft_config.json").write_text(json.dumps(cfg, indent=2))
    # written with torch.save because that is the format SpecForge reads; LayerScope itself never loads it
    torch.save({"d2t": head.d2t.detach().cpu().long(), "t2d": head.t2d.detach().cpu().bool()}, directory / "vocab_mapping.pt")
    ids = engines.sglang_ids(head.aux_layers, facts.model_type)
    # SpecForge captures through SGLang only (engines.specforge_backend): its data are the offline hidden states
    # prepare_hidden_states.py writes by running SGLang
    (directory / "specforge.yaml").write_text(SPECFORGE_YAML.format(
        target=target_path, out=out, ids=json.dumps(ids), dtype=dtype, backend=engines.specforge_backend(facts.model_type),
        data=SPECFORGE_OFFLINE))


SPECFORGE_OFFLINE = ('  # offline EAGLE-3: first write the target\'s hidden states with scripts/prepare_hidden_states.py '
                     '(COMMANDS.md)\n  hidden_states_path: "./cache/hidden_states/layerscope"')


SPECFORGE_YAML = """\
# SpecForge run config for the LayerScope draft in {out} (fields: specforge/config/schema.py).
model:
  target_model_path: "{target}"
  draft_model_config: "{out}/draft_config.json"
  vocab_mapping_path: "{out}/vocab_mapping.pt"
  # SGLang ids (SpecForge hands them to the target's set_eagle3_layers_to_capture); exactly three
  aux_hidden_state_layer_ids: {ids}
  # start from the LayerScope draft instead of a random one (drop this line to train from scratch)
  draft_checkpoint_path: "{out}"
  target_backend: "{backend}"
  torch_dtype: "{dtype}"
data:
{data}
  max_length: 4096
  chat_template: "llama3"     # the target's chat template name in SpecForge (qwen, llama3, ...)
  cache_dir: "./cache"
training:
  strategy: "eagle3"
  num_epochs: 10
  batch_size: 1
  learning_rate: 1.0e-4
  max_grad_norm: 0.5
  ttt_length: 7
  attention_backend: "sdpa"
  save_interval: 1000
  log_interval: 50
  seed: 0
run_id: "layerscope-eagle3"
output_dir: "./outputs/layerscope-eagle3"
deployment:
  mode: local_colocated
  trainer:
    nnodes: 1
    nproc_per_node: 8
"""


def speculators_config(head: DraftHead, facts: TargetFacts, dtype: str, verifier: str) -> dict:
    """The config.json `speculators convert --algorithm eagle3` writes (Eagle3SpeculatorConfig,
    src/speculators/models/eagle3/config.py, built by src/speculators/convert/eagle/eagle3_converter.py),
    with eagle_aux_hidden_state_layer_ids set: the converter would leave it null and the draft would read the
    default layers. norm_before_residual is false: vLLM's speculators reader defaults a missing one to true
    (vllm/transformers_utils/configs/speculators/algos.py), which is not how LayerScope drafts are trained."""
    hf = engine_config(head.config, facts, dtype)
    layer = {k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                "rope_theta", "rope_scaling", "max_position_embeddings", "attention_bias", "mlp_bias",
                                "tie_word_embeddings", "use_sliding_window", "sliding_window")}
    # the one flat rotary setting as transformers 5 names it too (speculators' train/cli.py writes rope_parameters;
    # a per-layer-type one would be collapsed to its sliding entry: src/speculators/models/utils.py), and full
    # attention: speculators slides a draft layer whose layer_types entry says so (models/eagle3/core.py)
    layer.update({"rope_parameters": dict(head.config.rope_parameters), "layer_types": ["full_attention"],
                  "model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": dtype, "dtype": dtype})
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier,
                         "architectures": list(facts.architectures) or ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": head.config.draft_vocab_size,
        "target_hidden_size": head.config.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        # Eagle3SpeculatorConfig.fc_norm (models/eagle3/config.py; exclusive with norm_before_fc), read back by
        # vLLM's speculators reader since PR #46488 (vllm/transformers_utils/configs/speculators/algos.py)
        "fc_norm": head.config.fc_norm,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": engines.vllm_ids(head.aux_layers),
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def write_speculators(directory: Path, head: DraftHead, meta: dict, facts: TargetFacts, dtype: str, verifier: str,
                      embedding: torch.Tensor) -> None:
    """A converted speculators checkpoint: the converter's config (ids set) and its weight names
    (midlayer.* -> layers.0.*, Eagle3Speculator in src/speculators/convert/eagle/eagle3_legacy_model.py), plus
    the target's input embedding [vocab, d] as embed_tokens.weight in `dtype`. speculators' own forward embeds
    tokens with the checkpoint's embed_tokens; without one, from_pretrained initializes the missing weight,
    which replaces the NaN placeholder load_verifier_weights looks for before it copies the verifier's
    (src/speculators/model.py), so the draft would run on a wrong embedding. vLLM loads it when present
    (llama_eagle3.py load_weights: includes_embed_tokens); it is the target's own, so nothing changes there."""
    if tuple(embedding.shape) != (head.config.vocab_size, head.config.hidden_size):
        raise DraftError(f"The target's embedding has shape {tuple(embedding.shape)}, the draft needs "
                         f"({head.config.vocab_size}, {head.config.hidden_size})",
                         "Export with the target the draft was trained for")
    (directory / "config.json").write_text(json.dumps(speculators_config(head, facts, dtype, verifier), indent=2))
    tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in draft_tensors(head, dtype).items()}
    tensors["embed_tokens.weight"] = embedding.detach().to("cpu", TORCH_DTYPES[dtype]).contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "layers.json").write_text(json.dumps(layers_record(head.aux_layers, facts, head.config.fc_norm_widths), indent=2))
    info = {"format": FORMAT, "aux_layers": head.aux_layers, "draft_vocab_size": head.config.draft_vocab_size,
            "serving_notes": serving_notes(head.config), **meta, "fc_norm": head.config.fc_norm}
    (directory / "layerscope.json").write_text(json.dumps(info, indent=2, default=float))
