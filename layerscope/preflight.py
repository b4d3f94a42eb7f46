"""Preflight: what a command can check before it loads a model or trains, checked first.

    writable(store)                      the store takes a new file (a real probe: root and a read-only mount)
    need_space(directory, nbytes, what)  the disk holding `directory` has room for an estimated output
    prompt_spec(spec)                    a prompt set that exists and can be opened (builtin, sharegpt, a file)
    draft_dir(path)                      a draft the user named: the path rule, its files, its metadata agreeing
    output(path)                         a directory about to be written whole (--out): the path rule, writable
    capture_need(...)                    what a capture may still write, for need_space
    starting_drafts(paths)               the drafts a training continues (--init-from)
    train_online(store, model, sets, o)  every check of online training (workflow.train_online calls it first)
    train_capture(store, key, sets, ...) every check of training from a capture (workflow.train calls it first)
    study(store, model, options)         every check of a study: its prompts, room for all its drafts
    bench_drafts(paths)                  every --draft of a benchmark

Estimates of what a step writes (bytes), from the target's shape when it can be read without loading
the weights (`target_shape`: tiny-llama, a model directory's or the Hugging Face cache's config.json,
the de-quantized copy of a GGUF in the store); None when it cannot, and then only the store is checked:
    capture     tokens x (N + 1 (+1 pre-norm)) x d x 2 (float16 states) + 17 per token (the token table)
    draft       its parameter count x 4 (float32 at most)
    checkpoint  the drafts' parameters x 4 x 3 (weights and Adam's two moments); online training holds two
                for a moment when it replaces one, so it needs twice that
    responses   online training's regenerated answers: conversations x max_new_tokens x 8 (JSON token ids)
Every failure is a LayerScopeError (one line, exit 2 in the CLI) and nothing has been written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from layerscope import jsonsafe, layerset, paths
from layerscope.errors import DraftError, LayerScopeError
from layerscope.store import Store, StoreWriteError, write_error
from layerscope.study.outcomes import OutcomeFolder

MARGIN = 1.05                  # free space must exceed the estimate by 5% ...
RESERVE = 8 * 2**20            # ... and by 8 MiB (the index, locks, small JSON files)
MAX_CONFIG_BYTES = 4 * 2**20


# ---------------------------------------------------------------------------- the store and the disk

def writable(store: Store) -> None:
    """StoreWriteError (read-only, full, not permitted) unless a file can be created in the store root.
    A real probe: os.access says yes to root on a read-only directory, and to anyone before a mount check."""
    directory_writable(store.root)


def free_bytes(directory: Path) -> int:
    """Bytes available to this user on the disk holding `directory` (its nearest existing ancestor)."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def need_space(directory: Path, nbytes: int | None, what: str) -> None:
    """StoreWriteError when the disk holding `directory` has less free space than `what` needs (about nbytes)."""
    if not nbytes:
        return
    free = free_bytes(directory)
    if free < nbytes * MARGIN + RESERVE:
        raise StoreWriteError(f"Not enough free space for {what}: it needs about {_mib(nbytes)}, the disk holding "
                              f"{directory} has {_mib(free)} free",
                              "Free disk space or pass --store on a larger disk (nothing was written)")


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------- estimates

def capture_bytes(tokens: int, num_layers: int, hidden_size: int, prenorm: bool = True) -> int:
    """Bytes of a capture of `tokens` tokens: float16 states of layers 0..N (and the pre-norm final state),
    plus the token table (token id, position, conversation: int32; is_response: bool; entropy: float32)."""
    states = (num_layers + 1 + int(prenorm)) * hidden_size * 2
    return int(tokens) * (states + 4 + 4 + 4 + 1 + 4)


def draft_params(shape, layers, draft_vocab: int) -> int:
    """Parameters and buffers of a draft reading `layers` of a target with config `shape` (counted on the
    meta device: exact, nothing allocated)."""
    from layerscope.draft.model import DraftConfig, DraftHead

    vocab = int(shape.vocab_size)
    config = DraftConfig.from_target(shape, sorted(set(layers)), min(int(draft_vocab), vocab))
    with torch.device("meta"):
        head = DraftHead(config)
    return sum(t.numel() for t in head.state_dict().values())


def draft_bytes(shape, layers, draft_vocab: int) -> int:
    return 4 * draft_params(shape, layers, draft_vocab)


def checkpoint_bytes(shape, layer_sets, draft_vocab: int) -> int:
    return 3 * sum(draft_bytes(shape, s, draft_vocab) for s in layer_sets)


def target_shape(spec: str, store: Store):
    """The target's config (hidden_size, num_hidden_layers, vocab_size, heads, ...) read without loading its
    weights, or None when that is not possible (a GGUF not de-quantized yet, a hub id not in the local cache)."""
    from layerscope import models

    spec = (spec or "").strip()
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        return models.load_model(spec).model.config      # a random tiny model: built in milliseconds
    config = None
    if spec == models.DEFAULT_MODEL or spec.endswith(".gguf"):
        config = _gguf_config(spec, store)
    elif Path(spec).expanduser().is_dir():
        config = Path(spec).expanduser() / "config.json"
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(spec, "config.json")
            config = Path(hit) if isinstance(hit, str) else None
        except Exception:       # no cache, a malformed id: the model load says what is wrong
            config = None
    if config is None or not config.is_file() or config.stat().st_size > MAX_CONFIG_BYTES:
        return None
    try:
        cfg = jsonsafe.loads(config.read_bytes(), what=str(config))
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
        shape = SimpleNamespace(**cfg)
        int(shape.hidden_size), int(shape.num_hidden_layers), int(shape.vocab_size)
        int(shape.num_attention_heads), int(shape.intermediate_size)
        return shape
    except (LayerScopeError, OSError, AttributeError, TypeError, ValueError):
        return None       # the model load reports a broken config


def _gguf_config(spec: str, store: Store) -> Path | None:
    """config.json of the GGUF's de-quantized copy in the store, found through the store's file-hash memo."""
    from layerscope import models

    try:
        path = models.smollm2_gguf_path() if spec == models.DEFAULT_MODEL else Path(spec).expanduser()
        st = path.stat()
        memo = jsonsafe.loads((store.root / "file-hashes.json").read_bytes(), what="file-hashes.json")
        digest = memo.get(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    except (LayerScopeError, OSError, AttributeError):
        return None
    return Path(store.path("models", f"gguf-{digest}")) / "config.json" if digest else None


# ---------------------------------------------------------------------------- options and paths

def prompt_spec(spec: str) -> None:
    """The prompt set exists and opens (the cheap part of load_prompts: no file is read through)."""
    from layerscope.prompts.sets import check_spec

    check_spec(spec)


def draft_dir(path, *, agree: bool = True) -> Path:
    """A draft directory the user named: no link loop, exists, has config.json and model.safetensors, and
    (with `agree`) its layer records agree (draft.export.draft_layers). Returns its real path."""
    from layerscope.draft.checkpoint import draft_layers, read_config, read_layers_record, read_meta

    real = paths.existing_dir(path, "The draft", DraftError,
                              "Give the directory `layerscope train-draft` or `layerscope export` wrote")
    missing = [f for f in ("config.json", "model.safetensors") if not (real / f).is_file()]
    if missing:
        raise DraftError(f"{path} is not a draft directory (it has no {' or '.join(missing)})",
                         "Give the directory `layerscope train-draft` or `layerscope export` wrote")
    if agree:
        draft_layers(real, read_config(real), read_meta(real), read_layers_record(real))
    return real


def output(path, what: str = "--out") -> Path:
    """A directory about to be written whole (--out): the path rule (paths.output_dir) and a real write probe
    where it will be made. Returns its real path."""
    where = paths.output_dir(path, what, DraftError)
    directory_writable(where.parent)
    return where


def capture_need(encoded, max_new_tokens: int, max_tokens: int | None, batch_size: int, num_layers: int,
                 hidden_size: int, partial: Path | None = None) -> int:
    """Bytes a capture of the prompts `encoded` (token ids) may still write: every prompt with a full-length
    response (an upper bound: answers may end early), cut at max_tokens plus one batch, less the chunks
    already in `partial`."""
    lengths = [len(ids) + int(max_new_tokens) for ids in encoded]
    tokens = sum(lengths)
    if max_tokens is not None:
        tokens = min(tokens, int(max_tokens) + sum(sorted(lengths)[-int(batch_size):]))
    done = sum(f.stat().st_size for f in Path(partial).glob("chunk-*.safetensors")) if partial and Path(partial).is_dir() else 0
    return max(0, capture_bytes(tokens, num_layers, hidden_size) - done)


def outcomes_folder(path) -> None:
    """A study's outcomes folder (--outcomes): a folder, or none yet (study_outcomes.OutcomeFolder's rule), where
    a file can be created."""
    directory_writable(OutcomeFolder(path).root)


def starting_drafts(paths) -> None:
    """Every draft a training continues (--init-from), checked before the target loads (draft/init_from.py
    then matches them to the sets and to the target)."""
    for p in paths:
        draft_dir(p)


def bench_drafts(drafts) -> None:
    """Every draft directory of a benchmark, checked before the target loads."""
    for d in drafts:
        draft_dir(d)


# ---------------------------------------------------------------------------- commands

def train_online(store: Store, model: str, sets, options) -> None:
    """Online training (workflow.train_online, so the CLI and the app alike): the prompt set, the layer sets
    against the target's depth, the store writable, room for two checkpoints and the generated responses.
    options: an OnlineOptions (its draft_vocab, prompts, limit, responses, max_new_tokens)."""
    writable(store)
    prompt_spec(options.prompts)
    starting_drafts(options.init_from)
    shape = target_shape(model, store)
    responses = responses_bytes(options, store) if options.responses == "regenerate" else 0
    if shape is not None and sets:
        layerset.check_sets(sets, int(shape.num_hidden_layers), "--layers", DraftError)
        ckpt = checkpoint_bytes(shape, sets, int(options.draft_vocab))
        need_space(store.root, 2 * ckpt + responses,
                   f"online training of {len(sets)} draft(s) on {model} (two checkpoints of {_mib(ckpt)} at "
                   f"the moment one replaces the other, then the drafts; {_mib(responses)} of generated responses)")
    else:
        need_space(store.root, responses, "the generated responses of online training")


def study(store: Store, model: str, options) -> None:
    """A study (workflow.study, so the CLI and the app alike), before the target loads: the store writable,
    its prompt sets, and room for every draft it may train (each strategy's set and the user's, the random
    controls, per training seed: an upper bound, strategies that agree share one draft), with online
    training two checkpoints of one seed's pass and the regenerated answers. options: a StudyOptions."""
    writable(store)
    prompt_spec(options.prompts)
    if options.online is not None:
        prompt_spec(options.online.prompts)
    n = options.sets_per_pass
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise LayerScopeError(f"sets per pass must be a whole number >= 1 (got {n!r})",
                             "Pass --sets-per-pass 1 or more, or leave it out to train every set in one pass")
    if options.outcomes is not None:
        outcomes_folder(options.outcomes)
    shape = target_shape(model, store)
    if shape is None:
        return
    strategies = [x for x in options.strategies if x not in ("default", "random")]
    sizes = [options.k] * (1 + len(strategies) + (options.random_sets if "random" in options.strategies else 0))
    sizes += [len(set(s)) for s in options.extra_sets]
    if "single" in strategies:
        sizes[1 + strategies.index("single")] = 1
    sizes = [min(n, int(shape.num_hidden_layers)) for n in sizes]
    train = options.online if options.online is not None else options.train
    seeds = len(options.seeds) if options.seeds else 1
    one_pass = sum(draft_bytes(shape, list(range(n)), int(train.draft_vocab)) for n in sizes)
    need, what = one_pass * seeds, f"up to {len(sizes)} drafts x {seeds} training seed(s)"
    if options.online is not None:
        responses = responses_bytes(options.online, store) if options.online.responses == "regenerate" else 0
        need += 2 * 3 * one_pass + responses
        what += f", two checkpoints of one pass, {_mib(responses)} of generated responses"
    need_space(store.root, need, f"the study ({what})")


def train_capture(store: Store, capture_key: str, sets, draft_vocab: int, out=None, init_from=()):
    """Training from a capture (workflow.train; the CLI also before a --strategy's analysis): --out or the
    store writable, the capture opens, the layer sets fit it, room for the draft. Returns what it checked,
    for the caller to use rather than open or resolve again: (the CaptureReader, the sets checked and
    sorted, --out's real path or None)."""
    starting_drafts(init_from)
    real_out = output(out) if out is not None else None     # into --out, links followed
    if real_out is None:                                     # into the store's drafts/
        writable(store)
    cap = store.open_capture(capture_key)
    if sets:
        sets = layerset.check_sets(sets, cap.num_layers, "--layers", DraftError)
        shape = target_shape(cap.manifest.get("model") or "", store)
        if shape is not None:
            need_space(real_out or store.root, draft_bytes(shape, sets[0], int(draft_vocab)), "the draft")
    return cap, list(sets), real_out


RESPONSE_TOKEN_BYTES = 8        # a token id in a JSON list: up to 6 digits, a comma and a space


def responses_bytes(options, store: Store) -> int:
    """What online training's regenerated responses take (at most max_new_tokens per conversation), from the
    number of conversations: options.limit, else the prompt set's size (ShareGPT: its index, cached in the store)."""
    from layerscope.prompts.sets import load_prompts
    from layerscope.prompts.sharegpt import sharegpt_index, sharegpt_path

    n = options.limit
    if n is None:
        spec = str(options.prompts).strip()
        if spec in ("sharegpt", "sharegpt-heldout"):
            n = int(sharegpt_index(sharegpt_path(), cache=store.root / "prompts")["usable"])
        else:
            n = len(load_prompts(spec))
    return int(n) * int(options.max_new_tokens) * RESPONSE_TOKEN_BYTES


def directory_writable(directory: Path) -> None:
    """A file can be created in `directory`, or in its nearest existing ancestor (which then gets the folders)."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".preflight-", suffix=".tmp")
    except OSError as e:
        raise write_error(e, Path(directory) / ".preflight") from None
    os.close(fd)
    os.unlink(probe)
