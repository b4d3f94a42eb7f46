"""Draft checkpoints: a directory the engines load as it is, and LayerScope loads back without pickle.

    config.json         DraftConfig.to_hf_config() with the engines' ids for this target (layerscope/draft/engines.py)
                        and "torch_dtype"/"dtype" = the dtype the weights are saved in (the target's by default)
    model.safetensors   fc, midlayer.*, norm, lm_head (in that dtype), d2t (int64), t2d (bool); no embed_tokens:
                        every engine shares the target's embedding when the checkpoint has none (a speculators
                        export carries it: speculators' own forward reads the checkpoint's, see
                        layerscope/draft/export/engine_export.py write_speculators)
    layers.json         the layer set three ways (hidden_states index, vLLM/speculators id, SGLang/SpecForge id),
                        the target facts they were computed for, and what each engine can or cannot do with it
    layerscope.json     what produced it: target fingerprint, capture key, layers, strategy, budget, seed,
                        validation accuracy per TTT step, tokens, seconds

Crash safety: the directory is written in a staging folder beside the destination (`.layerscope-staging/`,
which no draft listing looks into) and put in place whole (layerscope/store.py: `staged`, `replace_dir`: one
atomic exchange where the kernel has renameat2). A process killed at any point leaves `path` either the
complete old draft or the complete new one, never half-written.

Reading back: load_draft checks the files against each other (draft_layers: every file's record of the layers,
in the engines' conventions, must name one set) and, given the target, against it (check_fits).
The folders written for an engine (COMMANDS.md, speculators, SpecForge) are layerscope/draft/export/engine_export.py's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from layerscope import jsonsafe
from layerscope.draft import engines
from layerscope.draft.engines import TargetFacts
from layerscope.draft.model import ARCHITECTURE, DraftConfig, DraftHead, fc_norm_of
from layerscope.errors import DraftError
from layerscope.store import as_write_error, staged

FORMAT = 1
FILES = ("config.json", "model.safetensors", "layers.json", "layerscope.json")
MAX_JSON_BYTES = 16 * 2**20       # any JSON file of a draft
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def serving_notes(config: DraftConfig) -> list[str]:
    """What keeps a draft from being served by some engine, for any target (empty when nothing does);
    layers.json has the per-engine verdicts for the actual target."""
    notes = []
    if config.k != 3:
        notes.append(f"reads {config.k} layers: vLLM, speculators and SpecForge take exactly 3 (vLLM's Llama EAGLE-3 "
                     "draft builds fc for 3 x target_hidden_size); SGLang takes any number since May 2026")
    if 0 in config.aux_layers:
        notes.append("reads layer 0 (the embedding output): SGLang's and SpecForge's Llama/Qwen targets cannot "
                     "supply it (their capture loop adds a residual that is still None before the first layer)")
    return notes


# ----------------------------------------------------------------------------------------- contents

def layers_record(layers: list[int], facts: TargetFacts | None, fc_norm: tuple[int, int] | None = None) -> dict:
    """layers.json: the set three ways and each engine's verdict for this target (None: target unknown,
    the Llama/Qwen SGLang convention is assumed and said so); fc_norm: DraftConfig.fc_norm_widths."""
    assumed = facts is None
    facts = facts or TargetFacts(model_type="llama", num_layers=max(layers) + 1, dtype="float32")
    try:
        sgl = engines.sglang_ids(layers, facts.model_type)
    except DraftError:
        sgl = None
    verdicts = {}
    for engine in engines.ENGINES:
        reason = engines.refusal(engine, layers, facts, fc_norm=fc_norm)
        verdicts[engine] = {"ok": reason is None, "reason": reason,
                            "notes": engines.notes(engine, layers, facts, fc_norm=fc_norm is not None)}
    return {
        "hf_hidden_states": list(layers),
        "vllm_speculators_ids": engines.vllm_ids(layers),
        "sglang_specforge_ids": sgl,
        "sglang_rule": engines.sglang_rule(facts.model_type),
        "target": None if assumed else facts.to_dict(),
        "target_assumed": assumed,
        "engines": verdicts,
    }


def engine_config(config: DraftConfig, facts: TargetFacts | None, dtype: str) -> dict:
    """config.json: the draft config with the dtype and the SGLang ids for this target's family."""
    cfg = config.to_hf_config()
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    cfg["eagle_aux_hidden_state_layer_ids"] = engines.vllm_ids(config.aux_layers)
    if facts is not None:
        try:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = engines.sglang_ids(config.aux_layers, facts.model_type)
        except DraftError:
            pass    # no SGLang id list reads this set; layers.json says so and check-draft reports it
    return cfg


def draft_tensors(head: DraftHead, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors: floating point ones in `dtype`, d2t int64, t2d bool, all on the CPU."""
    want = TORCH_DTYPES[engines.dtype_name(dtype)]
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    return {k: (v.to(want) if v.is_floating_point() else v) for k, v in tensors.items()}


def write_draft(directory: Path, head: DraftHead, meta: dict | None, facts: TargetFacts | None, dtype: str) -> None:
    """Write the four files of a draft into an existing empty `directory` (not atomic: see save_draft)."""
    dtype = engines.dtype_name(dtype)
    info = {"format": FORMAT, "aux_layers": head.aux_layers, "draft_vocab_size": head.config.draft_vocab_size,
            "serving_notes": serving_notes(head.config), "dtype": dtype,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(meta or {}), "fc_norm": head.config.fc_norm}
    (directory / "config.json").write_text(json.dumps(engine_config(head.config, facts, dtype), indent=2))
    save_file(draft_tensors(head, dtype), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "layers.json").write_text(json.dumps(layers_record(head.aux_layers, facts, head.config.fc_norm_widths), indent=2))
    (directory / "layerscope.json").write_text(json.dumps(info, indent=2, default=float))


def save_draft(path, head: DraftHead, meta: dict | None = None, *, target=None, facts: TargetFacts | None = None,
               dtype: str | None = None) -> Path:
    """Write `head` to directory `path`, replacing it whole or not at all; returns the path.
    target (a LoadedModel) or facts: the target's family, depth and dtype, for the SGLang ids and the dtype.
    dtype: of the saved weights and config.json (default: the target's; float32 when the target is unknown)."""
    path = Path(path)
    if facts is None and target is not None:
        facts = engines.target_facts(target)
    dtype = engines.dtype_name(dtype or (facts.dtype if facts else "float32"))
    try:
        with staged(path) as tmp:
            write_draft(tmp, head, meta, facts, dtype)
    except (OSError, SafetensorError) as e:      # the old draft at `path` (if any) is untouched
        error = as_write_error(e, path)
        if error is None and isinstance(e, OSError):
            error = DraftError(f"Cannot write the draft to {path} ({e.strerror or e})",
                               "Give another directory; nothing was replaced")
        if error is None:
            raise
        kept = rescue(head, meta, facts, dtype, path)
        if kept is not None:                     # the training is not lost: say where it is
            error = type(error)(error.problem, f"The trained draft was written to {kept} instead: benchmark it with "
                                               f"--draft {kept}, or move it to {path} once there is room. {error.fix}")
        raise error from None
    return path


def rescue(head: DraftHead, meta: dict | None, facts, dtype: str, path: Path) -> Path | None:
    """After a save to `path` failed on a full or read-only disk: the same draft written whole into the
    system's temporary directory (most often another disk), so the training is not lost. None when that
    fails too (nothing half-written is left there either)."""
    try:
        where = Path(tempfile.mkdtemp(prefix=f"layerscope-unsaved-{Path(path).name}-"))
    except OSError:
        return None
    try:
        write_draft(where, head, meta, facts, dtype)
    except (OSError, SafetensorError):
        shutil.rmtree(where, ignore_errors=True)
        return None
    return where


# ----------------------------------------------------------------------------------------- reading back

def read_config(path) -> dict:
    """config.json of a draft directory."""
    return _read_json(Path(path) / "config.json")


def fc_norm_widths(cfg: dict) -> tuple[int, int] | None:
    """DraftConfig.fc_norm_widths read from a config.json, LayerScope's or a converted speculators one (whose
    hidden_size is under transformer_layer_config): None when it has no fc_norm."""
    if not fc_norm_of(cfg):
        return None
    hidden = cfg.get("hidden_size") or (cfg.get("transformer_layer_config") or {}).get("hidden_size")
    try:
        return int(hidden), int(cfg.get("target_hidden_size") or hidden)
    except (TypeError, ValueError):
        raise DraftError("The draft's config.json has fc_norm but no hidden size to size it by",
                         "Re-export the draft with `layerscope export`, or train it again") from None


def read_meta(path) -> dict:
    """layerscope.json of a draft directory ({} when the draft came from elsewhere)."""
    f = Path(path) / "layerscope.json"
    return _read_json(f) if f.is_file() else {}


def read_layers_record(path) -> dict:
    """layers.json of a draft directory ({} for drafts saved before it existed or made elsewhere)."""
    f = Path(path) / "layers.json"
    return _read_json(f) if f.is_file() else {}


def recorded_facts(path) -> TargetFacts | None:
    """The target facts layers.json was written for (None when not recorded)."""
    target = read_layers_record(path).get("target")
    return TargetFacts.from_dict(target) if target else None


def load_draft(path, target=None) -> DraftHead:
    """Load a draft directory (JSON + safetensors only). With `target` (a LoadedModel) the draft is checked
    against it, gets its embedding and moves to its device; a draft for another target raises DraftError."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise DraftError(f"{path} is not a draft directory (config.json and model.safetensors are needed)",
                         "Give the directory `layerscope train-draft --out` wrote")
    cfg = _read_json(path / "config.json")
    meta = read_meta(path)
    if ARCHITECTURE not in (cfg.get("architectures") or []) and "Eagle3LlamaForCausalLM" not in (cfg.get("architectures") or []):
        raise DraftError(f"{path}/config.json describes {cfg.get('architectures')}, not an EAGLE-3 Llama draft",
                         f"LayerScope loads drafts with architectures [\"{ARCHITECTURE}\"]")
    config = DraftConfig.from_hf_config(cfg, draft_layers(path, cfg, meta, read_layers_record(path)))
    check_weights(path, config)          # names, shapes and dtypes from the header: nothing large is read yet
    if target is not None:
        check_fits(config, meta, target, path)
        config.target_num_layers = int(target.num_layers)
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise DraftError(f"{path}/model.safetensors is unreadable ({e})", "Train or copy the draft again") from e
    tensors.pop("embed_tokens.weight", None)   # a foreign checkpoint may carry the target's embedding
    head = DraftHead(config, d2t=tensors.get("d2t"), t2d=tensors.get("t2d"))    # checks the memory and d2t/t2d
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()})
    if target is not None:
        head.set_embedding(target.model.get_input_embeddings().weight)
        head.to(target.device)
    return head.eval()


WEIGHT_DTYPES = {"F32", "F16", "BF16"}
MAP_DTYPES = {"d2t": {"I64", "I32"}, "t2d": {"BOOL", "U8"}}


def weights_header(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, without reading a tensor (safetensors checks
    that the header's offsets cover the file exactly, so the shapes are bounded by the file's size). DraftError
    when the file is not a safetensors file."""
    try:
        with safe_open(str(f), framework="pt") as h:
            return {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape())) for k in h.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise DraftError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})",
                         "The draft's weights are damaged or another kind of file; train or copy the draft again") from None


def check_weights(path, config: DraftConfig) -> None:
    """The one check of a draft's model.safetensors against its config.json, from the header alone: the tensors
    DraftConfig.shapes() names (the target's embedding may be there too), each of that shape, floating point
    weights, whole-number d2t and boolean t2d. DraftError naming what differs."""
    f = Path(path) / "model.safetensors"
    found = weights_header(f)
    found.pop("embed_tokens.weight", None)
    expected = config.shapes()
    if {k: v[1] for k, v in found.items()} != expected:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k][1])
        raise DraftError(f"{f} does not match its config.json (missing {missing[:5]}, unexpected {extra[:5]}, wrong "
                         f"shape {[(k, found[k][1], expected[k]) for k in wrong[:5]]})",
                         "The checkpoint is damaged or from another architecture; train it again")
    bad = [(k, dtype) for k, (dtype, _) in found.items() if dtype not in MAP_DTYPES.get(k, WEIGHT_DTYPES)]
    if bad:
        raise DraftError(f"{f} holds tensors of the wrong type ({', '.join(f'{k}: {t}' for k, t in bad[:5])})",
                         "The checkpoint is damaged; train it again")


def check_fits(config: DraftConfig, meta: dict, target, path) -> None:
    """Refuse a draft whose target is not `target`, naming both."""
    name = getattr(target, "spec", "the target")
    vocab = int(target.model.get_input_embeddings().weight.shape[0])
    problems = []
    if config.target_hidden_size != target.hidden_size or config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.target_hidden_size} vs {target.hidden_size}")
    if config.vocab_size != vocab:
        problems.append(f"vocabulary {config.vocab_size} vs {vocab}")
    if config.aux_layers[-1] >= target.num_layers:
        problems.append(f"layers {config.aux_layers} vs {target.num_layers} decoder layers")
    trained_for = meta.get("target_fingerprint")
    if trained_for and trained_for != target.fingerprint:
        problems.append(f"weights fingerprint {trained_for} vs {target.fingerprint}")
    if problems:
        raise DraftError(f"Draft {path} was trained for {meta.get('target_model', 'another target')} and does not fit "
                         f"{name} ({'; '.join(problems)}; draft vs target)",
                         f"Load it with the target it was trained for, or train a draft for {name} with `layerscope train-draft`")


def draft_layers(path, cfg: dict, meta: dict, record: dict) -> list[int] | None:
    """The one layer set every file of the draft in `path` records, with the engines' conventions applied:
    config.json's vLLM key (ids = layers) and SGLang key (eagle_config; ids = layers - 1 for Llama-like
    targets, layers.json's sglang_rule otherwise), layers.json (hf_hidden_states, vllm_speculators_ids,
    sglang_specforge_ids) and layerscope.json (aux_layers or layers). DraftError naming which file says
    what when they disagree; None when no file names the layers (from_hf_config then says so)."""
    facts = recorded_facts_of(record)
    rule_type = facts.model_type if facts else "llama"      # layers_record assumes a Llama-like target then
    told: list[tuple[str, list[int]]] = []

    def say(where: str, ids, convert=None):
        if ids is None:
            return
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise DraftError(f"{path}: {where} is not a list of layer ids ({str(ids)[:80]})",
                             "Re-export the draft with `layerscope export`, or train it again")
        told.append((where, convert(ids) if convert else list(ids)))

    def from_sglang(ids):
        reads, _ = engines.read_layers("sglang", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
                                       TargetFacts(model_type=rule_type, num_layers=max(ids) + 2, dtype="float32"))
        return reads

    say("config.json eagle_aux_hidden_state_layer_ids (vLLM ids)", cfg.get("eagle_aux_hidden_state_layer_ids"))
    if record.get("sglang_specforge_ids", 0) is not None:    # None: no SGLang id list reads this set (layers.json)
        say(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids (SGLang ids, {rule_type} convention)",
            (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), from_sglang)
        say(f"layers.json sglang_specforge_ids ({rule_type} convention)", record.get("sglang_specforge_ids"),
            from_sglang)
    say("layers.json hf_hidden_states", record.get("hf_hidden_states"))
    say("layers.json vllm_speculators_ids", record.get("vllm_speculators_ids"))
    say("layerscope.json aux_layers", meta.get("aux_layers"))
    say("layerscope.json layers", meta.get("layers"))
    if len({tuple(sorted(layers)) for _, layers in told}) > 1:      # a set: the engines read it in ascending order
        said = "; ".join(f"{where} says layers {layers}" for where, layers in told)
        raise DraftError(f"The files of draft {path} disagree on the layers it reads: {said}",
                         f"Re-export it from the original with `layerscope export DRAFT --for ENGINE --out DIR`, or "
                         f"run `layerscope check-draft {path} --target MODEL` to see what each engine would read; "
                         "do not edit the ids by hand")
    return told[0][1] if told else None


def recorded_facts_of(record: dict) -> TargetFacts | None:
    target = record.get("target") if isinstance(record, dict) else None
    try:
        return TargetFacts.from_dict(target) if target else None
    except (KeyError, TypeError, ValueError):
        return None


def _read_json(f: Path) -> dict:
    try:
        value = jsonsafe.loads(f.read_bytes(), what=str(f), error=DraftError, max_bytes=MAX_JSON_BYTES,
                               fix="The draft is damaged; train or copy it again")
    except OSError as e:
        raise DraftError(f"{f} cannot be read ({e.strerror or e})", "Check the draft directory") from None
    if not isinstance(value, dict):
        raise DraftError(f"{f} does not hold a JSON object", "The draft is damaged; train or copy it again")
    return value
