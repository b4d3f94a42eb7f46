"""Draft checkpoints: a directory the engines load as it is, and LayerScope loads back without pickle.

    config.json         DraftConfig.to_hf_config() with the engines' ids for this target (layerscope/engines.py)
                        and "torch_dtype"/"dtype" = the dtype the weights are saved in (the target's by default)
    model.safetensors   fc, midlayer.*, norm, lm_head (in that dtype), d2t (int64), t2d (bool); no embed_tokens:
                        every engine shares the target's embedding when the checkpoint has none (a speculators
                        export carries it: speculators' own forward reads the checkpoint's, see write_speculators)
    layers.json         the layer set three ways (hidden_states index, vLLM/speculators id, SGLang/SpecForge id),
                        the target facts they were computed for, and what each engine can or cannot do with it
    layerscope.json     what produced it: target fingerprint, capture key, layers, strategy, budget, seed,
                        validation accuracy per TTT step, tokens, seconds

Crash safety: the directory is written in a staging folder beside the destination (`.layerscope-staging/`,
which no draft listing looks into) and swapped into place with one atomic rename (renameat2
RENAME_EXCHANGE where the kernel has it). A process killed at any point leaves `path` either the complete
old draft or the complete new one, never missing and never half-written.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from huggingface_hub import try_to_load_from_cache

from layerscope import engines, jsonsafe, models
from layerscope.draft.model import ARCHITECTURE, DraftConfig, DraftHead
from layerscope.engines import TargetFacts
from layerscope.errors import DraftError
from layerscope.store import as_write_error

FORMAT = 1
FILES = ("config.json", "model.safetensors", "layers.json", "layerscope.json")
STAGING = ".layerscope-staging"
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

def layers_record(layers: list[int], facts: TargetFacts | None) -> dict:
    """layers.json: the set three ways and each engine's verdict for this target (None: target unknown,
    the Llama/Qwen SGLang convention is assumed and said so)."""
    assumed = facts is None
    facts = facts or TargetFacts(model_type="llama", num_layers=max(layers) + 1, dtype="float32")
    try:
        sgl = engines.sglang_ids(layers, facts.model_type)
    except DraftError:
        sgl = None
    verdicts = {}
    for engine in engines.ENGINES:
        reason = engines.refusal(engine, layers, facts)
        verdicts[engine] = {"ok": reason is None, "reason": reason, "notes": engines.notes(engine, layers, facts)}
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
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(meta or {})}
    (directory / "config.json").write_text(json.dumps(engine_config(head.config, facts, dtype), indent=2))
    save_file(draft_tensors(head, dtype), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "layers.json").write_text(json.dumps(layers_record(head.aux_layers, facts), indent=2))
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


# ----------------------------------------------------------------------------------------- placing a directory

class staged:
    """`with staged(path) as tmp:` fill `tmp`; on a clean exit it replaces `path` atomically, on an error it
    is removed and `path` is untouched. tmp lives in `<parent>/.layerscope-staging/`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.area = self.path.parent / STAGING

    def __enter__(self) -> Path:
        for attempt in range(3):     # another writer may remove the empty staging folder between the two calls
            self.area.mkdir(parents=True, exist_ok=True)
            try:
                self.tmp = Path(tempfile.mkdtemp(dir=self.area, prefix=f"{self.path.name}.{os.getpid()}."))
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        _remove_stale(self.area, self.path.name)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                swap_into_place(self.tmp, self.path)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)   # after a swap it holds the old directory
            try:
                self.area.rmdir()                          # only when empty: other writers may be staging
            except OSError:
                pass
        return False


def swap_into_place(tmp: Path, path: Path) -> None:
    """Make the complete directory `tmp` appear at `path`. An existing `path` is exchanged with `tmp` in one
    rename (the old directory ends up at `tmp`); without renameat2, `path` is moved aside into the staging
    area first, so the window where `path` is missing holds no half-written directory either."""
    if not path.exists():
        os.replace(tmp, path)
        return
    if _exchange(tmp, path):
        return
    aside = tmp.with_name(tmp.name + ".old")
    os.replace(path, aside)
    os.replace(tmp, path)
    os.replace(aside, tmp)


_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the system cannot."""
    fn = getattr(_LIBC, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_stale(area: Path, name: str) -> None:
    """Staging folders for `name` left by processes that no longer run."""
    for entry in area.glob(f"{name}.*"):
        try:
            pid = int(entry.name[len(name) + 1:].split(".", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------------------- reading back

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
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise DraftError(f"{path}/model.safetensors is unreadable ({e})", "Train or copy the draft again") from e
    tensors.pop("embed_tokens.weight", None)   # a foreign checkpoint may carry the target's embedding
    if target is not None:
        check_fits(config, meta, target, path)
        config.target_num_layers = int(target.num_layers)
    head = DraftHead(config, d2t=tensors.get("d2t"), t2d=tensors.get("t2d"))
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if expected != found:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
        raise DraftError(f"{path}/model.safetensors does not match its config.json (missing {missing}, unexpected "
                         f"{extra}, wrong shape {[(k, found[k], expected[k]) for k in wrong]})",
                         "The checkpoint is damaged or from another architecture; train it again")
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()})
    if int((head.d2t + torch.arange(config.draft_vocab_size)).max()) >= config.vocab_size:
        raise DraftError(f"{path}: d2t maps draft ids past the target vocabulary of {config.vocab_size}",
                         "The checkpoint is damaged; train it again")
    if target is not None:
        head.set_embedding(target.model.get_input_embeddings().weight)
        head.to(target.device)
    return head.eval()


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


def read_config(path) -> dict:
    """config.json of a draft directory."""
    return _read_json(Path(path) / "config.json")


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
    reason = engines.refusal(engine, layers, facts)
    if reason:
        raise DraftError(f"Cannot export for {engine}: {reason}", f"Train a draft on a layer set {engine} takes "
                         f"(layers.json lists every engine's verdict), or export for another engine")
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
                                                     target.spec if target is not None else trained.get("target_model")))
    return out


def trained_target(draft_dir, store=None):
    """The target a draft was trained for, loaded from the spec its layerscope.json records."""
    spec = read_meta(draft_dir).get("target_model")
    if not spec:
        raise DraftError(f"{draft_dir}/layerscope.json does not name the target model, whose input embedding a "
                         "speculators export carries", "Pass --target MODEL (the model the draft was trained for)")
    try:
        return models.load_model(spec, store=store)
    except models.ModelSpecError as e:
        raise DraftError(f"A speculators export carries the target's input embedding, and the draft's target "
                         f"{spec!r} does not load here ({e.problem})",
                         "Pass --target MODEL (the model the draft was trained for)") from e


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
    """The rule: an alias (smollm2-135m) is named by its public Hugging Face id (models.ALIASES); a local
    `folder` relative to the export folder `out` when both lie under one directory below the root (out None:
    the export moves, as a zip does), else by its absolute path; anything else (a hub id, tiny-llama) as given."""
    hf = models.public_id(spec)
    if hf:
        alias = models.ALIASES[spec.strip()]
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


def verifier_problem(name: str | None, directory: Path) -> str | None:
    """Why speculators, run from the current directory, cannot resolve a converted draft's verifier (None
    when it can: a model folder here, or a hub id in the local Hugging Face cache). SpeculatorModel.from_pretrained
    reads the verifier's config and weights (src/speculators/utils/loading.py _resolve_file: a local directory
    when Path(name).is_dir(), else hf_hub_download; models/utils.py get_verifier_config)."""
    if not name:
        return ("config.json names no verifier (speculators_config.verifier.name_or_path): speculators cannot "
                "read the target's depth, output head and final norm")
    if (Path(name).expanduser() / "config.json").is_file():
        return None
    if (Path(directory) / name / "config.json").is_file():
        return (f"the verifier `{name}` is a folder relative to {directory}, but speculators resolves it from the "
                f"working directory ({Path.cwd()}), where it does not exist: run from {directory}, or write its "
                "absolute path in config.json")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
        return (f"the verifier `{name}` is not in this machine's Hugging Face cache: speculators downloads it from "
                "the Hub, which needs network access (and a token for a gated model)")
    return (f"the verifier `{name}` is neither a model folder here nor a Hugging Face id: speculators cannot load "
            "this draft; put the target's folder or Hugging Face id in speculators_config.verifier.name_or_path")


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
    return {"engine": engine, "layers": layers, "target": facts, "refusal": engines.refusal(engine, layers, facts),
            "notes": engines.notes(engine, layers, facts)}


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
    (directory / "specforge.yaml").write_text(SPECFORGE_YAML.format(
        target=target_path, out=out, ids=json.dumps(ids), dtype=dtype))


SPECFORGE_YAML = """\
# SpecForge run config for the LayerScope draft in {out} (fields: specforge/config/schema.py).
# Offline EAGLE-3: first write the target's hidden states with scripts/prepare_hidden_states.py (COMMANDS.md).
model:
  target_model_path: "{target}"
  draft_model_config: "{out}/draft_config.json"
  vocab_mapping_path: "{out}/vocab_mapping.pt"
  # SGLang ids (SpecForge hands them to the target's set_eagle3_layers_to_capture); exactly three
  aux_hidden_state_layer_ids: {ids}
  # start from the LayerScope draft instead of a random one (drop this line to train from scratch)
  draft_checkpoint_path: "{out}"
  target_backend: "sglang"
  torch_dtype: "{dtype}"
data:
  hidden_states_path: "./cache/hidden_states/layerscope"
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
                                "tie_word_embeddings")}
    layer.update({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": dtype, "dtype": dtype})
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
        "fc_norm": False,
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
    (directory / "layers.json").write_text(json.dumps(layers_record(head.aux_layers, facts), indent=2))
    info = {"format": FORMAT, "aux_layers": head.aux_layers, "draft_vocab_size": head.config.draft_vocab_size,
            "serving_notes": serving_notes(head.config), **meta}
    (directory / "layerscope.json").write_text(json.dumps(info, indent=2, default=float))


ENGINE_READS = {
    # engine: (what it reads from the export folder, what it ignores there); docs/drafts.md has the same table
    "vllm": ("config.json: `architectures` (LlamaForCausalLMEagle3), the top-level `eagle_aux_hidden_state_layer_ids`, "
             "`draft_vocab_size`, `target_hidden_size`, the layer shape, `eagle_config.use_aux_hidden_state`; "
             "model.safetensors: `fc`, `midlayer.*` (as `layers.0.*`, q/k/v and gate/up stacked), `norm`, `lm_head`, "
             "`d2t` (as `draft_id_to_target_id`)",
             "`t2d`, the SGLang ids under `eagle_config`, layers.json, layerscope.json, COMMANDS.md; the checkpoint "
             "has no `embed_tokens`, so the draft shares the target's embedding"),
    "sglang": ("config.json: `architectures`, `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang ids), "
               "`draft_vocab_size`, the layer shape, `tie_word_embeddings` (false); model.safetensors: the same "
               "weights under `model.`, `d2t` (as `hot_token_id = d2t + arange`)",
               "`t2d`, the top-level vLLM ids, layers.json, layerscope.json, COMMANDS.md; the EAGLE worker gives the "
               "draft the target's embedding"),
    "specforge": ("specforge.yaml (`model.aux_hidden_state_layer_ids` first, `target_model_path`, "
                  "`draft_checkpoint_path` = this folder), draft_config.json (its `eagle_config` ids when the run "
                  "config has none), vocab_mapping.pt (`d2t`, `t2d`)",
                  "config.json's top-level vLLM ids, layers.json, layerscope.json, COMMANDS.md"),
    "speculators": ("config.json: `speculators_config.verifier.name_or_path` (the verifier's config for its depth "
                    "and hidden size, and its `lm_head` and final norm for the training loss), "
                    "`transformer_layer_config`, `eagle_aux_hidden_state_layer_ids`, `draft_vocab_size`, "
                    "`target_hidden_size`, `norm_before_residual` and the other norm flags; model.safetensors: "
                    "`fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` and `embed_tokens` (the target's input "
                    "embedding, which its forward embeds tokens with). vLLM serving this folder reads the same "
                    "config and weights, loads `embed_tokens` and skips `t2d`",
                    "layers.json, layerscope.json, COMMANDS.md; the verifier's own embedding and `lm_head`, which "
                    "it copies in only when the checkpoint lacks them"),
}


def commands_md(engine: str, layers: list[int], facts: TargetFacts, dtype: str, target: str, out: Path,
                draft_vocab: int, note: str | None = None, check_as: str | None = None) -> str:
    """COMMANDS.md: the command lines to train at scale, serve and benchmark this draft with `engine`.
    target: how the commands name the target; note: what to change on another machine (TargetName.note);
    check_as: the LayerScope model spec for `layerscope check-draft` (default `target`)."""
    vllm = engines.vllm_ids(layers)
    space = " ".join(str(i) for i in vllm)
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    sgl = None if engine in ("vllm", "speculators") else engines.sglang_ids(layers, facts.model_type)
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
    notes = engines.notes(engine, layers, facts)
    if notes:
        head += ["Notes:", *[f"- {n}" for n in notes], ""]
    serve_vllm = ["## Serve (vLLM)", "", "```bash",
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
    train_speculators = ["## Train at scale (speculators, vLLM's trainer; scripts/ of the speculators repository)", "",
                         "```bash",
                         f"python scripts/launch_vllm.py {target} --target-layer-ids {space} -- --port 8000 &",
                         "torchrun --standalone --nproc_per_node 8 scripts/train.py \\",
                         f"  --verifier-name-or-path {target} --data-path ./output --vllm-endpoint http://localhost:8000/v1 \\",
                         f"  --save-path ./output/checkpoints --draft-vocab-size {draft_vocab} --target-layer-ids {space}",
                         "```", "",
                         "Both commands need the ids: without them the server captures and the trainer assumes "
                         f"`[2, N//2, N-3]` = {engines.default_layers('speculators', facts.num_layers)}.", ""]
    serve_sglang = ["## Serve (SGLang)", "", "```bash",
                    f"python -m sglang.launch_server --model-path {target} --dtype {dtype} \\",
                    f"  --speculative-algorithm EAGLE3 --speculative-draft-model-path {out} \\",
                    "  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
                    "```", "",
                    "## Benchmark (SGLang)", "", "```bash",
                    "python -m sglang.bench_serving --backend sglang --dataset-name sharegpt --num-prompts 200",
                    "```", ""]
    if engine == "vllm":
        body = serve_vllm + train_speculators
    elif engine == "speculators":
        convert = json.dumps({"eagle_aux_hidden_state_layer_ids": vllm})
        body = [f"`{out}` is already the converted checkpoint, with `eagle_aux_hidden_state_layer_ids` = {vllm} "
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
                "```", ""] + serve_vllm + train_speculators
    elif engine == "sglang":
        body = serve_sglang + [
            "## Train at scale", "",
            f"SpecForge trains SGLang drafts: `layerscope export DRAFT --for specforge --out DIR` writes its inputs "
            f"with the SGLang ids {sgl}.", ""]
    else:
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
        body += [line.replace(str(out), "./outputs/layerscope-eagle3-sglang") if "speculative-draft-model-path" in line
                 else line for line in serve_sglang]
    return "\n".join(head + body)


# ----------------------------------------------------------------------------------------- checking a directory

def check_draft(directory, facts: TargetFacts, only: list[str] | None = None) -> dict:
    """Which layers each engine would read from `directory` for this target, against the set the draft was
    trained on (layerscope.json, cross-checked with the width of fc). Returns {"trained", "rows", "ok",
    "warnings", "speculators"}; a row fails when an engine that should load the directory reads another set or
    cannot load it at all. For a converted (speculators) directory the speculators row also has the library's
    own reading (library_reads), and "speculators" says whether its verifier resolves from the working
    directory and whether the checkpoint carries the embedding; what it finds wrong there is a warning."""
    directory = Path(directory)
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise DraftError(f"{directory} is not a draft directory (config.json and model.safetensors are needed)",
                         "Give a directory written by `layerscope train-draft` or `layerscope export`")
    cfg = _read_json(directory / "config.json")
    meta = read_meta(directory)
    trained = meta.get("aux_layers") or meta.get("layers")
    if not trained:
        raise DraftError(f"{directory} has no record of the layers it was trained on (layerscope.json)",
                         "Check a draft LayerScope trained or exported; for others the trained set is unknown")
    trained = [int(l) for l in trained]
    width = _fc_inputs(directory, cfg)
    problems = []
    try:                           # every file's record of the layers, layers.json included (load_draft's rule)
        draft_layers(directory, cfg, meta, read_layers_record(directory))
    except DraftError as e:
        problems.append(e.problem)
    if width is not None and width != len(trained):
        problems.append(f"fc reads {width} layers but layerscope.json records {len(trained)} ({trained})")
    converted = "speculators_model_type" in cfg
    if only:
        wanted = list(only)
    elif meta.get("exported_for"):
        wanted = [meta["exported_for"]]
    else:
        wanted = ["speculators"] if converted else ["vllm", "sglang", "specforge"]
    rows = []
    for engine in engines.ENGINES:
        if converted != (engine == "speculators"):
            if engine in wanted:
                problems.append(f"{engine} does not load a {'speculators' if converted else 'LayerScope'}-format "
                                "directory like this one")
            continue
        reads, source = engines.read_layers(engine, cfg, facts)
        refused = engines.refusal(engine, trained, facts)
        checked = engine in wanted
        ok = refused is None and reads == trained
        if refused:
            status = f"cannot load it: {refused}"
        elif reads == trained:
            status = "reads the trained layers"
        elif source.startswith("default"):
            status = f"SILENT FALLBACK to {reads}: {source}"
        else:
            status = f"READS OTHER LAYERS {reads} than the trained {trained}"
        row = {"engine": engine, "reads": reads, "source": source, "ok": ok, "checked": checked, "status": status}
        rows.append(row)
        if checked and not ok:
            problems.append(f"{engine}: {status}")
        if engine == "speculators":
            row["library_reads"], row["library_source"] = engines.speculators_reads(cfg, facts)
            if checked and row["library_reads"] != trained and not refused:
                problems.append(f"speculators' own from_pretrained reads {row['library_reads']} "
                                f"({row['library_source']}), not the trained {trained}")
    warnings, spec = [], None
    if converted:
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        spec = {"verifier": verifier, "verifier_problem": verifier_problem(verifier, directory),
                "embedding": "embed_tokens.weight" in _tensor_names(directory)}
        if spec["verifier_problem"]:
            warnings.append(spec["verifier_problem"])
        if not spec["embedding"]:
            warnings.append("model.safetensors has no embed_tokens.weight: speculators' own forward then embeds "
                            "tokens with a weight from_pretrained initialized, not the target's (vLLM shares the "
                            "target's, so serving is unaffected); export it again with `layerscope export --for "
                            "speculators`")
    return {"directory": str(directory), "trained": trained, "target": facts.to_dict(), "rows": rows,
            "problems": problems, "ok": not problems, "warnings": warnings, "speculators": spec}


def _tensor_names(directory: Path) -> set[str]:
    """The tensor names in a directory's model.safetensors, from its header (empty when unreadable)."""
    try:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            return set(f.keys())
    except Exception:  # an unreadable checkpoint is load_draft's to report
        return set()


def _fc_inputs(directory: Path, cfg: dict) -> int | None:
    """How many layers fc concatenates, from the checkpoint's header (None when it cannot tell)."""
    hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size") or \
        (cfg.get("transformer_layer_config") or {}).get("hidden_size")
    try:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            if "fc.weight" not in f.keys():
                return None
            cols = f.get_slice("fc.weight").get_shape()[1]
    except Exception:  # an unreadable checkpoint is load_draft's to report
        return None
    return int(cols) // int(hidden) if hidden else None
