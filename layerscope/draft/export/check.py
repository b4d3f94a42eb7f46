"""check-draft: which layers each engine would actually read from a draft directory, against the set the
draft was trained on, before anything is served.

    check_draft(directory, facts)   a row per engine (what it reads, from where, pass or fail), the problems
                                    (a silent fallback to an engine's default set, other layers, files that
                                    disagree, fc's width against the record, fc_norm's config, weights and record
                                    that disagree) and, for a converted speculators
                                    directory, whether its verifier resolves and it carries the embedding
    verifier_problem(name, dir)     why speculators cannot resolve a converted draft's verifier (None if it can)

Each engine's reading rule is layerscope/draft/engines.py's read_layers; the directory's own agreement is
layerscope/draft/checkpoint.py's draft_layers (the rule load_draft applies), and its weights file is checked
against its config.json from the header (checkpoint.check_weights, load_draft's check too).
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from safetensors import safe_open

from layerscope.draft import engines
from layerscope.draft.checkpoint import check_weights, draft_layers, fc_norm_widths, read_config, read_layers_record, read_meta, weights_header
from layerscope.draft.engines import TargetFacts
from layerscope.draft.model import DraftConfig, check_vocab_maps
from layerscope.errors import DraftError


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
    cfg = read_config(directory)
    meta = read_meta(directory)
    trained = meta.get("aux_layers") or meta.get("layers")
    if not trained:
        raise DraftError(f"{directory} has no record of the layers it was trained on (layerscope.json)",
                         "Check a draft LayerScope trained or exported; for others the trained set is unknown")
    trained = [int(l) for l in trained]
    width = _fc_inputs(directory, cfg)
    problems = []
    if width is not None and width != len(trained):
        problems.append(f"fc reads {width} layers but layerscope.json records {len(trained)} ({trained})")
    norm = fc_norm_report(directory, cfg, meta, len(trained))
    problems += norm.pop("problems")
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
        refused = engines.refusal(engine, trained, facts, norm["widths"])
        checked = engine in wanted
        ok = refused is None and reads == trained
        if refused:      # a family the engine's rule does not cover reads "unknown: not in <list> as of <source>"
            status = refused if refused.startswith("unknown:") else f"cannot load it: {refused}"
        elif reads == trained:
            status = "reads the trained layers"
        elif source.startswith("default"):
            status = f"SILENT FALLBACK to {reads}: {source}"
        else:
            status = f"READS OTHER LAYERS {reads} than the trained {trained}"
        row = {"engine": engine, "reads": reads, "source": source, "ok": ok, "checked": checked, "status": status,
               "notes": engines.fc_norm_notes(engine) if norm["config"] else []}
        rows.append(row)
        if checked and not ok:
            problems.append(f"{engine}: {status}")
        if engine == "speculators":
            row["library_reads"], row["library_source"] = engines.speculators_reads(cfg, facts)
            if checked and row["library_reads"] != trained and not refused:
                problems.append(f"speculators' own from_pretrained reads {row['library_reads']} "
                                f"({row['library_source']}), not the trained {trained}")
    weights = _weights_problems(directory, cfg, trained, converted)
    problems += weights
    if not problems:               # the engines read the trained set: do the draft's other files say it too?
        try:                       # (layers.json included: load_draft's rule, which bench and export apply)
            draft_layers(directory, cfg, meta, read_layers_record(directory))
        except DraftError as e:
            problems.append(e.problem)
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
            "problems": problems, "weights": weights, "ok": not problems, "warnings": warnings, "speculators": spec,
            "fc_norm": norm}


def fc_norm_report(directory: Path, cfg: dict, meta: dict, k: int) -> dict:
    """The per-layer norm before fc three ways: config.json's `fc_norm` (what every engine builds from), the
    `fc_norm.{i}.weight` tensors in the checkpoint, and layerscope.json's record. Returns {"config", "weights",
    "recorded", "widths" (for engines.refusal), "problems"}: a config that asks for it without k weights (vLLM
    and speculators fail to load them), weights the config does not ask for (SGLang skips them without a word
    and serves the draft without its norms), or a record that says otherwise."""
    problems = []
    try:
        widths = fc_norm_widths(cfg)
    except DraftError as e:
        return {"config": None, "weights": 0, "recorded": meta.get("fc_norm"), "widths": None, "problems": [e.problem]}
    on = widths is not None
    names = _tensor_names(directory)
    weights = sum(1 for n in names if n.startswith("fc_norm.") and n.endswith(".weight"))
    if on and weights != k:
        problems.append(f"config.json asks for fc_norm but model.safetensors has {weights} fc_norm weights for "
                        f"{k} layers: engines cannot load it")
    if not on and weights:
        problems.append(f"model.safetensors has {weights} fc_norm weights but config.json does not ask for fc_norm: "
                        "engines would serve the draft without the norms it was trained with")
    recorded = meta.get("fc_norm")
    if recorded is not None and bool(recorded) != on:
        problems.append(f"layerscope.json records fc_norm {bool(recorded)} but config.json says {on}")
    return {"config": on, "weights": weights, "recorded": recorded, "widths": widths, "problems": problems}


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


def _weights_problems(directory: Path, cfg: dict, trained: list[int], converted: bool) -> list[str]:
    """What is wrong with model.safetensors, from its header (load_draft's check_weights against config.json for a
    LayerScope directory; a speculators one, whose names and config differ, is checked to be a safetensors file)."""
    try:
        if converted:
            weights_header(directory / "model.safetensors")
        else:
            config = DraftConfig.from_hf_config(cfg, trained)
            check_weights(directory, config)
            with safe_open(str(directory / "model.safetensors"), framework="pt") as f:   # two small tensors
                check_vocab_maps(f.get_tensor("d2t"), f.get_tensor("t2d"), config)
    except DraftError as e:
        return [e.problem]
    return []


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
