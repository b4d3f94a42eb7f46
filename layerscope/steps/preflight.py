"""Preflight: what a command can check before it loads a model or trains, checked first (the disk checks
themselves are in `disk`, a capture's size in `capture.size`).

    capture_estimate(store, model, ps, o) what a capture will write, before the target loads (the app's Capture page)
    prompt_spec(spec)                    a prompt set that exists and can be opened (builtin, sharegpt, a file)
    draft_dir(path)                      a draft the user named: the path rule, its files, its metadata agreeing
    output(path)                         a directory about to be written whole (--out): the path rule, writable
    outside_store(store, path, ...)      a folder the user names that must not lie inside the store (export-states)
    starting_drafts(paths)               the drafts a training continues (--init-from)
    train_online(store, model, sets, o)  every check of online training (workflow.train_online calls it first);
                                         online_bytes: what it writes
    train_capture(store, key, sets, ...) every check of training from a capture (workflow.train calls it first)
    study(store, model, options)         every check of a study: its prompts, room for all its drafts (study_sets,
                                         study_bytes)
    bench_drafts(paths)                  every --draft of a benchmark

Estimates of what a step writes (bytes), from the target's shape when it can be read without loading
the weights (`target.shape.target_shape`: tiny-llama, a model directory's or the Hugging Face cache's config.json,
the de-quantized copy of a GGUF in the store); None when it cannot, and then only the store is checked:
    capture     tokens x (N + 1 (+1 pre-norm)) x d x 2 (float16 states) + 17 per token (the token table): capture.size;
                the capture itself states it again once the prompts are tokenized, and refuses over --max-store-bytes
    draft       its parameter count x 4 (float32 at most): draft.size
    checkpoint  the drafts' parameters x 4 x 3 (weights and Adam's two moments); online training holds two
                for a moment when it replaces one, so it needs twice that
    responses   online training's regenerated answers: conversations x max_new_tokens x 8 (JSON token ids)
Every failure is a LayerScopeError (one line, exit 2 in the CLI) and nothing has been written.
"""

from __future__ import annotations

from pathlib import Path

from layerscope import disk, jsonsafe, layerset, paths
from layerscope.capture import size
from layerscope.capture.stored import open_capture
from layerscope.draft import builtin
from layerscope.draft.checkpoint import draft_layers, read_config, read_layers_record, read_meta
from layerscope.draft.size import checkpoint_bytes, draft_bytes
from layerscope.errors import DraftError, LayerScopeError
from layerscope.prompts.sets import check_spec, load_prompts
from layerscope.prompts.sharegpt import sharegpt_index, sharegpt_path
from layerscope.store import Store
from layerscope.study.outcomes import OutcomeFolder
from layerscope.target.aliases import ALIASES
from layerscope.target.load import byte_tokenizer
from layerscope.target.shape import MAX_CONFIG_BYTES, gguf_config, target_shape

# ---------------------------------------------------------------------------- estimates

def chat_template(spec: str, store: Store, shape) -> str:
    """The target's chat template read without loading it (a GGUF header's, tiny-llama's, a model directory's or
    a de-quantized copy's tokenizer_config.json or chat_template.jinja); "" when none is found."""
    spec = (spec or "").strip()
    if getattr(shape, "chat_template", None):
        return str(shape.chat_template)
    if spec == "tiny-llama" or spec.startswith("tiny-llama:"):
        return str(byte_tokenizer().chat_template or "")
    folder = None
    if spec in ALIASES or spec.endswith(".gguf"):
        config = gguf_config(spec, store)
        folder = config.parent if config is not None else None
    elif Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
    if folder is None:
        return ""
    try:
        jinja = folder / "chat_template.jinja"
        if jinja.is_file() and jinja.stat().st_size <= MAX_CONFIG_BYTES:
            return jinja.read_text(errors="replace")
        tc = folder / "tokenizer_config.json"
        if tc.is_file() and tc.stat().st_size <= MAX_CONFIG_BYTES:
            got = jsonsafe.loads(tc.read_bytes(), what=str(tc)).get("chat_template")
            return got if isinstance(got, str) else "".join(str(t.get("template", "")) for t in got or [])
    except (LayerScopeError, OSError, AttributeError, TypeError):
        pass
    return ""


def dequantized(spec: str, store: Store) -> bool:
    """Whether the GGUF of `spec` (an alias or a .gguf file) has its de-quantized copy in the store already."""
    config = gguf_config(spec, store)
    return config is not None and config.is_file()


def capture_estimate(store: Store, model: str, prompts, options) -> size.Estimate | None:
    """What a capture of `prompts` (a list of Prompt, the limit applied) with CaptureOptions `options` will write,
    before the target loads: from its config (target_shape) and the prompts' bytes and the chat template's, an upper
    bound (size.prompt_tokens_at_most; the capture tokenizes them and states the exact estimate before its first
    batch), with the store's free space and
    the budget. None when the config cannot be read without loading the model."""
    shape = target_shape(model, store)
    if shape is None:
        return None
    template = chat_template(model, store, shape)
    plan = size.estimate([size.prompt_tokens_at_most(p.turns[0], template) for p in prompts], options.max_new_tokens,
                         int(shape.num_hidden_layers), int(shape.hidden_size), max_tokens=options.max_tokens,
                         batch_size=options.batch_size, sample_positions=options.sample_positions, prompts_exact=False)
    plan.free, plan.budget = disk.free_bytes(store.root), options.max_store_bytes
    return plan


# ---------------------------------------------------------------------------- options and paths

def prompt_spec(spec: str) -> None:
    """The prompt set exists and opens (the cheap part of load_prompts: no file is read through)."""
    check_spec(spec)


def draft_dir(path, *, agree: bool = True) -> Path:
    """A draft directory the user named: no link loop, exists, has config.json and model.safetensors, and
    (with `agree`) its layer records agree (draft.checkpoint.draft_layers). Returns its real path."""
    if builtin.SHORT_PREFIX_RE.fullmatch(str(path)) and not Path(path).exists():     # meant as a stored draft's key
        raise DraftError(f"{str(path)!r} is too short to be a stored draft's key prefix (at least "
                         f"{builtin.MIN_PREFIX} characters)", f"Type at least {builtin.MIN_PREFIX} characters of the "
                         "key (`ls` the store's drafts/ folder), or give the draft's directory")
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
    disk.directory_writable(where.parent)
    return where


def outside_store(store: Store, path, what: str, written: str) -> None:
    """A folder the user names for `written` (`what`: --out) lies outside the store, links followed on both: the
    store counts, evicts and lists what is inside it as its own (an export under captures/ would read as an
    unfinished capture)."""
    where, root = paths.real(path, what), paths.real(store.root, "The store")
    if where == root or root in where.parents:
        raise LayerScopeError(f"{what} {path} lies inside the store ({root}), which would count, evict or list "
                              f"{written} as its own", f"Pass {what} a folder outside {root}")


def outcomes_folder(path) -> None:
    """A study's outcomes folder (--outcomes): a folder, or none yet (study.outcomes.OutcomeFolder's rule), where
    a file can be created."""
    disk.directory_writable(OutcomeFolder(path).root)


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
    disk.writable(store)
    prompt_spec(options.prompts)
    starting_drafts(options.init_from)
    shape = target_shape(model, store)
    if shape is not None and sets:
        layerset.check_sets(sets, int(shape.num_hidden_layers), "--layers", DraftError)
    need, what = online_bytes(store, shape, sets, options)
    disk.need_space(store.root, need, f"online training of {len(sets)} draft(s) on {model} ({what})"
                    if shape is not None and sets else "the generated responses of online training")


def online_bytes(store: Store, shape, sets, options) -> tuple[int, str]:
    """What online training of `sets` writes at most, and what that is: two checkpoints (at the moment one replaces
    the other; the drafts are smaller) and the regenerated responses; the responses alone when `shape` is None."""
    responses = responses_bytes(options, store) if options.responses == "regenerate" else 0
    if shape is None or not sets:
        return responses, f"{disk.mib(responses)} of generated responses"
    ckpt = checkpoint_bytes(shape, sets, int(options.draft_vocab), options.draft_intermediate)
    return 2 * ckpt + responses, (f"two checkpoints of {disk.mib(ckpt)} at the moment one replaces the other, then "
                                  f"the drafts; {disk.mib(responses)} of generated responses")


def study(store: Store, model: str, options) -> None:
    """A study (workflow.study, so the CLI and the app alike), before the target loads: the store writable,
    its prompt sets, and room for every draft it may train (study_bytes). options: a StudyOptions."""
    disk.writable(store)
    prompt_spec(options.prompts)
    if options.online is not None:
        prompt_spec(options.online.prompts)
    options.validate()
    if options.outcomes is not None:
        outcomes_folder(options.outcomes)
    shape = target_shape(model, store)
    if shape is None:
        return
    need, what = study_bytes(store, shape, options)
    disk.need_space(store.root, need, f"the study ({what})")


def study_sets(shape, options) -> list[int]:
    """The sizes of the layer sets a study may train (each strategy's set and the user's, the random controls; an
    upper bound: strategies that agree share one draft)."""
    strategies = [x for x in options.strategies if x not in ("default", "random")]
    sizes = [options.k] * (1 + len(strategies) + (options.random_sets if "random" in options.strategies else 0))
    sizes += [len(set(s)) for s in options.extra_sets]
    if "single" in strategies:
        sizes[1 + strategies.index("single")] = 1
    return [min(n, int(shape.num_hidden_layers)) for n in sizes]


def study_bytes(store: Store, shape, options, sizes: list[int] | None = None) -> tuple[int, str]:
    """What a study writes at most, and what that is: every draft it may train (study_sets, or the sets of `sizes`)
    per training seed, with online training two checkpoints of one seed's pass and the regenerated answers."""
    sizes = study_sets(shape, options) if sizes is None else sizes
    train = options.online if options.online is not None else options.train
    seeds = len(options.seeds) if options.seeds else 1
    one_pass = sum(draft_bytes(shape, list(range(n)), int(train.draft_vocab), train.draft_intermediate) for n in sizes)
    need, what = one_pass * seeds, f"up to {len(sizes)} drafts x {seeds} training seed(s)"
    if options.online is not None:
        responses = responses_bytes(options.online, store) if options.online.responses == "regenerate" else 0
        need += 2 * 3 * one_pass + responses
        what += f", two checkpoints of one pass, {disk.mib(responses)} of generated responses"
    return need, what


def train_capture(store: Store, capture_key: str, sets, draft_vocab: int, out=None, init_from=(), intermediate=None):
    """Training from a capture (workflow.train; the CLI also before a --strategy's analysis): --out or the
    store writable, the capture opens, the layer sets fit it, room for the draft. Returns what it checked,
    for the caller to use rather than open or resolve again: (the CaptureReader, the sets checked and
    sorted, --out's real path or None)."""
    starting_drafts(init_from)
    real_out = output(out) if out is not None else None     # into --out, links followed
    if real_out is None:                                     # into the store's drafts/
        disk.writable(store)
    cap = open_capture(store, capture_key)
    cap.require_every_position("training a draft", TRAIN_FIX)
    if sets:
        sets = layerset.check_sets(sets, cap.num_layers, "--layers", DraftError)
        shape = target_shape(cap.manifest.get("model") or "", store)
        if shape is not None:
            disk.need_space(real_out or store.root, draft_bytes(shape, sets[0], int(draft_vocab), intermediate),
                            "the draft")
    return cap, list(sets), real_out


TRAIN_FIX = "Train online (train-draft --model, the app's online training), or capture again without --sample-positions"
PROBE_FIX = "Choose a strategy that reads the statistics only, or capture again without --sample-positions"


RESPONSE_TOKEN_BYTES = 8        # a token id in a JSON list: up to 6 digits, a comma and a space


def online_conversations(options, store: Store) -> int:
    """The conversations online training draws, at most (longer prompts are left out): options.limit, else the
    prompt set's size (ShareGPT: its index, cached in the store)."""
    n = options.limit
    if n is None:
        spec = str(options.prompts).strip()
        if spec in ("sharegpt", "sharegpt-heldout"):
            n = int(sharegpt_index(sharegpt_path(), cache=store.root / "prompts")["usable"])
        else:
            n = len(load_prompts(spec))
    return int(n)


def responses_bytes(options, store: Store) -> int:
    """What online training's regenerated responses take (at most max_new_tokens per conversation)."""
    return online_conversations(options, store) * int(options.max_new_tokens) * RESPONSE_TOKEN_BYTES


