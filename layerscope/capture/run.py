"""Capture: the target answers each prompt, then a forward over its conversation records every layer at every token.

The conversations are cut into batches of --batch-size in order, one chunk file each, and the batches into windows
of BUCKET_BATCHES. Per window:
  1. generate   the target writes its own response (greedy by default), as EAGLE-3 training data is made, in
                batches bucketed by prompt length: the window's conversations sorted by prompt length (ties by
                index), batch_size neighbours a batch (`generation_batches`), so that one long prompt pads only
                prompts of its own length; sampled responses are seeded per batch (its first conversation);
Then per batch of conversations (chunk), in order:
  2. record     forwards over prompt + response with output_hidden_states, the batch's conversations sorted by
                length into groups that pad at most RECORD_PAD times their tokens (`record_groups`): hidden_states[0..N]
                (state N is post-norm; the pre-norm output of the last layer is kept too), the
                predictive entropy (nats) of the next-token distribution, token id, position,
                conversation index, prompt/response flag;
     With --sample-positions s, only a seeded sample of min(s, n - 1) positions of each conversation is kept,
                response positions first (sample_rows; format.py's `sample_positions`): statistics only.
  3. write      one chunk file (float16 states, bfloat16 where they would overflow; float32 entropies) per batch, atomically.
Before the first batch the capture reports its Estimate (capture.size: bytes per token, tokens, total, free space;
a CaptureProgress of phase "estimate") and refuses, nothing written, when it is over --max-store-bytes. Every later
CaptureProgress carries the time left (`eta_s`, layerscope.eta) from the rate of this run's decode steps.
Peak memory is one batch's states (a window holds only its responses' token ids), whatever the number of prompts.
The store key is a hash of (model fingerprint, prompt-set content, options, format version); an identical request
is served from the store, and an interrupted one resumes from its finished chunks: a window with a missing chunk
generates again exactly the bucketed batches that hold a conversation of a missing chunk, each the same batch as in
an uninterrupted run, so the resumed capture's chunks are the uninterrupted one's, byte for byte.

Concurrency: the writing happens under the store's lock for the key. Any number of identical
captures may start at once; one writes, the others wait (phase "waiting") and are then served the
finished capture. A killed writer frees the lock at once and the next one resumes from its chunks.
The manifest records every chunk's size and sha256 (checked when the capture is read).

Across processes (`torchrun --nproc-per-node N -m layerscope capture ...`, process group: layerscope/distributed.py):
the windows of batches are split into N contiguous ranges, one per rank:

    windows w = 0..W-1 (the one-process capture's windows of batches, same size, same order)
    rank r writes the batches of windows [r*W//N, (r+1)*W//N) as chunk files into the capture's one partial directory
    rank 0 holds the store's write lock for the key throughout, and after every rank is done writes the
    manifest and renames the capture into place, exactly as a one-process capture does

Every chunk is computed from the same prompts, batches and model as in one process, so the finished capture
is the same, chunk for chunk, as a one-process capture (greedy responses; sampled responses, and a token
budget, which depends on the order of batches, are refused across processes). A rank that fails makes every
rank raise, with the failing rank's message, instead of leaving the others waiting.
"""

from __future__ import annotations

import datetime as _dt
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import safe_open

from layerscope import disk, distributed, eta, fmt
from layerscope.capture import size
from layerscope.capture.format import CHUNK_RE, chunk_name, file_sha256, list_chunks, read_header, state_dtype
from layerscope.capture.stored import finish_capture, has_capture, open_capture, partial_capture_dir
from layerscope.errors import CaptureError
from layerscope.prompts.sets import PromptSet, chat_ids
from layerscope.store import LockWaitCancelled, Store, atomic_save_tensors, make_key
from layerscope.target.head import head_transform, predictive_entropy
from layerscope.target.load import LoadedModel
from layerscope.validate import check_number

FORMAT_VERSION = 1
BUCKET_BATCHES = 8     # batches of a window, whose responses are generated in batches bucketed by prompt length
RECORD_PAD = 1.25      # a record forward pads its conversations to at most this many times their tokens


@dataclass
class CaptureOptions:
    limit: int | None = None           # conversations to take from the prompt set (None: all)
    max_new_tokens: int = 64           # response length cap per conversation
    max_tokens: int | None = None      # stop starting new batches once this many tokens are recorded
    batch_size: int = 8
    seed: int = 0
    temperature: float = 0.0           # 0 = greedy responses
    skip_long: bool = False            # drop prompts that do not fit the context (else refuse the capture)
    max_prompt_tokens: int | None = None   # drop prompts longer than this (keeps batches of ShareGPT compact)
    sample_positions: int | None = None    # keep a seeded sample of at most this many positions per conversation
                                           # (statistics only: training and the probe need every position)
    max_store_bytes: int | None = None     # refuse a capture whose estimate (capture.size) is larger (None: no budget)

    def validate(self) -> None:
        """One rule for every option (layerscope.validate): finite numbers of the right kind, in range."""
        check = lambda name, value, lo, hi, fix, **kw: check_number(  # noqa: E731
            name, value, minimum=lo, maximum=hi, fix=fix, error=CaptureError, **kw)
        check("limit", self.limit, 1, None, "Pass --limit 1 or more, or leave it out for all prompts", integer=True,
              optional=True)
        check("max_new_tokens", self.max_new_tokens, 1, 1_000_000, "Pass --max-new-tokens 1 or more", integer=True)
        check("max_tokens", self.max_tokens, 1, None, "Pass --max-tokens 1 or more, or leave it out", integer=True,
              optional=True)
        check("batch_size", self.batch_size, 1, 65_536, "Pass --batch-size 1 or more", integer=True)
        check("seed", self.seed, -2**63, 2**64 - 1, "Pass an integer --seed, e.g. 0", integer=True)
        check("temperature", self.temperature, 0, 100, "Use 0 for greedy responses")
        check("max_prompt_tokens", self.max_prompt_tokens, 1, None, "Pass --max-prompt-tokens 1 or more, or leave it "
              "out", integer=True, optional=True)
        check("sample_positions", self.sample_positions, 1, None, "Pass --sample-positions 1 or more, or leave it "
              "out to keep every position", integer=True, optional=True)
        check("max_store_bytes", self.max_store_bytes, 1, None, "Pass --max-store-bytes as a size such as 500M or 2G, "
              "or leave it out", integer=True, optional=True)
        if not isinstance(self.skip_long, bool):
            raise CaptureError(f"skip_long must be true or false (got {self.skip_long!r})", "Pass --skip-long or not")


@dataclass
class CaptureProgress:
    phase: str                 # "estimate" (before the first batch) | "waiting" (another process writes this capture)
                               # | "generate" | "record" | "done"
    conversations_done: int
    conversations_total: int
    tokens_done: int           # tokens recorded so far
    tokens_per_s: float        # recorded tokens per second of wall time, generation included
    elapsed_s: float
    generated: int = 0         # "generate": new tokens generated so far for the current batch (of max_new_tokens)
    estimate: size.Estimate | None = None    # "estimate": what the capture will write (capture.size)
    eta_s: float | None = None # seconds left (layerscope.eta: the rate of this run's decode steps); None: estimating
    fraction: float | None = None  # this run's share done, in decode steps (generated tokens + record passes; a
                               # bucketed window generates out of conversation order, so conversations_done
                               # alone can move back and forth); None: not counted


@dataclass
class CaptureResult:
    key: str
    cached: bool
    seconds: float
    tokens: int
    path: Path
    manifest: dict = field(repr=False)


class CaptureCancelled(CaptureError):
    """The caller asked to stop; finished chunks stay and a re-run resumes from them."""


def capture_key(loaded: LoadedModel, prompt_set: PromptSet, options: CaptureOptions) -> str:
    """The key of what is captured: the model, the prompts, the options that change what is stored (the budget
    does not; sample_positions only when set, so the key of a capture of every position is what it always was) and
    the dtype the target ran in when it is not float32 (precision.choose runs bfloat16 where a CPU is faster in it,
    and its states differ from float32's by more than rounding: the same prompts on two machines are two captures;
    a float32 capture keeps the key it always had)."""
    opts = asdict(options)
    del opts["max_store_bytes"]
    if opts["sample_positions"] is None:
        del opts["sample_positions"]
    dtype = loaded.dtype_name
    return make_key({"model": loaded.fingerprint, "prompts": prompt_set.content_hash, "options": opts,
                     "format": FORMAT_VERSION, **({"dtype": dtype} if dtype != "float32" else {})})


def capture(loaded: LoadedModel, prompt_set: PromptSet, store: Store, *, progress: Callable | None = None,
            should_stop: Callable[[], bool] | None = None, **options) -> CaptureResult:
    """Capture `prompt_set` with `loaded`; options are CaptureOptions fields. Served from the store when present."""
    opts = CaptureOptions(**options)
    opts.validate()
    t0 = time.perf_counter()
    key = capture_key(loaded, prompt_set, opts)
    if has_capture(store, key):
        cap = open_capture(store, key)
        return CaptureResult(key, True, time.perf_counter() - t0, cap.num_tokens, cap.path, cap.manifest)

    prompts = prompt_set.prompts[: opts.limit] if opts.limit else list(prompt_set.prompts)
    if not prompts:
        raise CaptureError(f"Prompt set {prompt_set.name!r} is empty", "Choose a prompt set with at least one prompt")
    encoded = [chat_ids(loaded.tokenizer, p) for p in prompts]
    if opts.max_prompt_tokens is not None:
        keep = [len(ids) <= opts.max_prompt_tokens for ids in encoded]
        prompts = [p for p, ok in zip(prompts, keep) if ok]
        encoded = [ids for ids, ok in zip(encoded, keep) if ok]
    fits = [len(ids) + opts.max_new_tokens <= loaded.context_length for ids in encoded]
    if opts.skip_long or not prompts:
        prompts = [p for p, ok in zip(prompts, fits) if ok]
        encoded = [ids for ids, ok in zip(encoded, fits) if ok]
        if not prompts:
            raise CaptureError("No prompt fits the model's context", "Lower --max-new-tokens or choose shorter prompts")
    else:
        _check_lengths(encoded, prompts, opts, loaded.context_length)
    disk.writable(store)              # a read-only or full store fails before the first batch is computed
    plan = plan_capture(loaded, encoded, opts, store)
    if progress:
        progress(CaptureProgress("estimate", 0, len(prompts), 0, 0.0, time.perf_counter() - t0, estimate=plan))
    check_budget(plan, opts)
    disk.need_space(store.root, size.capture_need(plan, partial_capture_dir(store, key)), f"capture {key}")
    if distributed.active():     # under torchrun every rank writes its range of the batches (_capture_ranks)
        return _capture_ranks(key, loaded, prompt_set, store, prompts, encoded, opts, t0, progress, should_stop)

    def waiting():
        if progress:
            progress(CaptureProgress("waiting", 0, len(prompts), 0, 0.0, time.perf_counter() - t0))

    try:
        with store.lock("captures", key, should_stop=should_stop, on_wait=waiting):
            if has_capture(store, key):      # another process finished it while we waited
                cap = open_capture(store, key)
                return CaptureResult(key, True, time.perf_counter() - t0, cap.num_tokens, cap.path, cap.manifest)
            return _write_capture(key, loaded, prompt_set, store, prompts, encoded, opts, t0, progress, should_stop)
    except LockWaitCancelled as e:
        raise CaptureCancelled("Capture cancelled while another process was writing it", e.fix) from None


def _write_capture(key, loaded, prompt_set, store, prompts, encoded, opts, t0, progress, should_stop) -> CaptureResult:
    """Write the missing chunks, then the manifest, and rename the capture into place (the lock is held)."""
    partial = partial_capture_dir(store, key)
    done = resume_partial(partial)
    tokens_done = sum(chunk_tokens(p) for p in done.values())
    # the time left counts decode steps: max_new_tokens per generated batch, one per record pass
    plans = [(w, [b for b in w if b not in done]) for w in capture_windows(len(prompts), opts.batch_size)]
    timer = eta.PhaseClock(sum(len(generation_batches(encoded, w, missing, opts.batch_size)) * opts.max_new_tokens
                               + len(missing) for w, missing in plans))
    units = 0

    def report(phase, conversations, generated=0):
        if progress:
            progress(CaptureProgress(phase, conversations, len(prompts), tokens_done,
                                     tokens_done / max(time.perf_counter() - t0, 1e-9), time.perf_counter() - t0,
                                     generated, eta_s=timer.left(units + generated),
                                     fraction=min((units + generated) / timer.total, 1.0) if timer.total else None))

    def stop_here(saved):
        if should_stop is not None and should_stop():    # a batch stopped mid-way has cut-short responses: not kept
            raise CaptureCancelled("Capture cancelled", f"{saved} of {len(prompts)} conversations are saved; run it "
                                   "again to resume")

    for window, missing in plans:
        if opts.max_tokens is not None and tokens_done >= opts.max_tokens:
            break
        if not missing:
            continue
        responses = {}
        for group in generation_batches(encoded, window, missing, opts.batch_size):
            stop_here(missing[0][0])
            report("generate", missing[0][0])
            responses |= dict(zip(group, generate_responses(
                loaded, [encoded[i] for i in group], opts, on_step=lambda n: report("generate", missing[0][0], n),
                should_stop=should_stop, seed=batch_seed(opts.seed, group[0]))))
            units += opts.max_new_tokens
        for start, end in missing:
            if opts.max_tokens is not None and tokens_done >= opts.max_tokens:
                break
            stop_here(start)
            report("record", start)
            tensors = record(loaded, encoded[start:end], [responses[i] for i in range(start, end)],
                             first_conversation=start, sample_positions=opts.sample_positions, seed=opts.seed)
            atomic_save_tensors(partial / chunk_name(start, end), tensors)
            tokens_done += tensors["token_id"].numel()
            units += 1
    if progress:
        progress(CaptureProgress("done", len(prompts), len(prompts), tokens_done,
                                 tokens_done / max(time.perf_counter() - t0, 1e-9), time.perf_counter() - t0))

    have = {(s, e): p for s, e, p in list_chunks(partial)}
    chunks = []
    for start in range(0, len(prompts), opts.batch_size):     # the planned batches, in order, up to the first gap
        end = min(start + opts.batch_size, len(prompts))
        if (start, end) not in have:
            break
        chunks.append((start, end, have[(start, end)]))
    if not chunks:
        raise CaptureError("The capture wrote no chunk", "Run it again")
    manifest = build_manifest(key, loaded, prompt_set, prompts, opts, chunks, time.perf_counter() - t0)
    path = finish_capture(store, key, manifest)
    return CaptureResult(key, False, time.perf_counter() - t0, manifest["tokens"], path, manifest)


def capture_windows(conversations: int, batch_size: int) -> list[list[tuple[int, int]]]:
    """The capture's batches (start, end) of `batch_size` conversations in order (one chunk each), in windows of
    BUCKET_BATCHES consecutive batches."""
    batches = [(s, min(s + batch_size, conversations)) for s in range(0, conversations, batch_size)]
    return [batches[i:i + BUCKET_BATCHES] for i in range(0, len(batches), BUCKET_BATCHES)]


def generation_batches(encoded, window: list[tuple[int, int]], missing: list[tuple[int, int]],
                       batch_size: int) -> list[list[int]]:
    """The batches (conversation indices) in which the responses of `window` are generated, bucketed by prompt
    length: the window's conversations sorted by the length of their prompt `encoded[i]` (ties by index), cut into
    batches of `batch_size` neighbours. Only the batches that hold a conversation of a `missing` chunk: a resumed
    window runs exactly those, each the same batch as in an uninterrupted run."""
    order = sorted(range(window[0][0], window[-1][1]), key=lambda i: (len(encoded[i]), i))
    need = {i for start, end in missing for i in range(start, end)}
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [b for b in batches if need.intersection(b)]


def batch_seed(seed: int, first_conversation: int) -> int:
    """The seed of a generation batch whose first conversation is `first_conversation` (sampled responses): the
    same whatever batches ran before it, so a resumed capture samples as an uninterrupted one."""
    return (int(seed) * 0x9E3779B1 + int(first_conversation)) % 2**63


def plan_capture(loaded: LoadedModel, encoded, opts: CaptureOptions, store: Store) -> size.Estimate:
    """The capture's Estimate (capture.size) for the tokenized prompts `encoded`, with the store's free space and
    the budget."""
    plan = size.estimate([len(ids) for ids in encoded], opts.max_new_tokens, loaded.num_layers, loaded.hidden_size,
                         max_tokens=opts.max_tokens, batch_size=opts.batch_size, sample_positions=opts.sample_positions)
    plan.free, plan.budget = disk.free_bytes(store.root), opts.max_store_bytes
    return plan


def check_budget(plan: size.Estimate, opts: CaptureOptions) -> None:
    """CaptureError (one line, nothing written) when the estimate is over --max-store-bytes."""
    if plan.over_budget:
        sample = "" if opts.sample_positions is not None else ", or --sample-positions N for statistics only"
        raise CaptureError(
            f"The capture would store up to {fmt.size(plan.total)} ({fmt.count(plan.tokens)} tokens x "
            f"{fmt.count(plan.bytes_per_token)} bytes), over the budget of {fmt.size(plan.budget)} (--max-store-bytes)",
            f"Take fewer prompts (--limit), shorter answers (--max-new-tokens) or fewer tokens (--max-tokens)"
            f"{sample}; nothing was written")


def clear_temporaries(partial: Path) -> None:
    """Remove a killed writer's temporary files from a capture's partial directory (call with the write lock held:
    then no writer is live)."""
    for p in partial.iterdir():
        if not CHUNK_RE.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def resume_partial(partial: Path) -> dict[tuple[int, int], Path]:
    """A capture's partial directory made ready to resume (the write lock held): created if absent, a killed writer's
    temporary files and any chunk whose header does not read removed; the complete chunks by (start, end)."""
    partial.mkdir(parents=True, exist_ok=True)
    clear_temporaries(partial)
    done = {}
    for s, e, p in list_chunks(partial):
        try:
            read_header(p)
            done[(s, e)] = p
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            p.unlink(missing_ok=True)      # not a complete chunk (damaged on disk): write it again
    return done


def chunk_entry(start: int, end: int, path: Path) -> dict:
    """A manifest's record of the chunk file `path` holding conversations [start, end)."""
    return {"file": path.name, "start": start, "end": end, "tokens": chunk_tokens(path), "bytes": path.stat().st_size,
            "sha256": file_sha256(path)}


def _check_lengths(encoded, prompts, opts: CaptureOptions, context: int) -> None:
    for ids, p in zip(encoded, prompts):
        if len(ids) + opts.max_new_tokens > context:
            raise CaptureError(
                f"Prompt {p.id} is {len(ids)} tokens; with max_new_tokens {opts.max_new_tokens} it exceeds the model's "
                f"context of {context} tokens", "Shorten or remove that prompt, lower --max-new-tokens, or pass "
                "--skip-long to leave such prompts out")


def chunk_tokens(path: Path) -> int:
    with safe_open(str(path), framework="pt") as sf:
        return sf.get_slice("token_id").get_shape()[0]


# ----------------------------------------------------------------------------- under torchrun

def _capture_ranks(key, loaded, prompt_set, store, prompts, encoded, opts, t0, progress, should_stop) -> CaptureResult:
    """The capture of `key` written by every rank together (the module docstring's "Across processes");
    returns the CaptureResult on every rank. Arguments as _write_capture takes them."""
    if opts.temperature > 0:
        raise CaptureError(f"Sampled responses (temperature {opts.temperature}) across {distributed.world()} processes "
                           "would not match a one-process capture", "Capture with --temperature 0 or in one process")
    if opts.max_tokens is not None:
        raise CaptureError("--max-tokens stops after the batches that come first, which several processes do not "
                           "write in order", "Use --limit to size the capture, or capture in one process")
    lock = store.lock("captures", key) if distributed.rank() == 0 else nullcontext()
    with lock:
        stored = distributed.agree(has_capture(store, key) if distributed.rank() == 0 else None)
        if stored:
            cap = open_capture(store, key)
            return CaptureResult(key, True, time.perf_counter() - t0, cap.num_tokens, cap.path, cap.manifest)
        partial = partial_capture_dir(store, key)
        if distributed.rank() == 0:
            partial.mkdir(parents=True, exist_ok=True)
            clear_temporaries(partial)
        dist.barrier()
        windows = capture_windows(len(prompts), opts.batch_size)
        error = None
        try:
            _write_rank_windows(distributed.shard(windows, distributed.rank(), distributed.world()), loaded, encoded,
                                opts, partial, t0, progress, should_stop)
        except Exception as e:   # every rank must reach _all_ok, or the others would wait forever
            error = e
        _all_ok(error)
        result = None
        if distributed.rank() == 0:
            try:
                result = _finish_ranks(key, loaded, prompt_set, store, prompts, opts, partial, t0)
            except Exception as e:
                error = e
        _all_ok(error)
        done = distributed.agree(None if result is None else (str(result.path), result.tokens))
    cap = open_capture(store, key)
    return CaptureResult(key, False, time.perf_counter() - t0, done[1], cap.path, cap.manifest)


def _all_ok(error: BaseException | None) -> None:
    """Raise on every rank when any rank failed (the first failing rank's message), else return."""
    messages = [None] * distributed.world()
    dist.all_gather_object(messages, None if error is None else f"rank {distributed.rank()}: {error}")
    failed = [m for m in messages if m]
    if failed:
        if error is not None:
            raise error
        raise CaptureError(f"Another process of the capture failed ({failed[0]})", "Fix that error and run it again; "
                           "finished chunks are kept and the next run resumes from them")


def _write_rank_windows(windows, loaded, encoded, opts, partial, t0, progress, should_stop) -> None:
    """Write each chunk of this rank's windows that is not already complete in `partial`, as _write_capture does."""
    tokens = 0

    def stop_here():
        if should_stop is not None and should_stop():
            raise CaptureCancelled("Capture cancelled", "Finished chunks are saved; run it again to resume")

    for window in windows:
        missing = []
        for start, end in window:
            path = partial / chunk_name(start, end)
            if path.is_file():
                try:
                    read_header(path)
                    tokens += chunk_tokens(path)
                    continue
                except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
                    path.unlink(missing_ok=True)       # not a complete chunk (damaged on disk): write it again
            missing.append((start, end))
        responses = {}
        for group in generation_batches(encoded, window, missing, opts.batch_size):
            stop_here()
            if progress:
                progress(CaptureProgress("generate", missing[0][0], len(encoded), tokens, 0.0, time.perf_counter() - t0))
            responses |= dict(zip(group, generate_responses(loaded, [encoded[i] for i in group], opts,
                                                            should_stop=should_stop,
                                                            seed=batch_seed(opts.seed, group[0]))))
        for start, end in missing:
            stop_here()
            tensors = record(loaded, encoded[start:end], [responses[i] for i in range(start, end)],
                             first_conversation=start, sample_positions=opts.sample_positions, seed=opts.seed)
            atomic_save_tensors(partial / chunk_name(start, end), tensors)
            tokens += tensors["token_id"].numel()


def _finish_ranks(key, loaded, prompt_set, store, prompts, opts, partial, t0) -> CaptureResult:
    """Rank 0, every chunk written: the manifest over the planned batches and the rename into place, as
    _write_capture ends."""
    have = {(s, e): p for s, e, p in list_chunks(partial)}
    chunks = []
    for start in range(0, len(prompts), opts.batch_size):
        end = min(start + opts.batch_size, len(prompts))
        if (start, end) not in have:
            raise CaptureError(f"Chunk {chunk_name(start, end)} is missing after every process finished",
                               "Run the capture again; it resumes from the chunks that are there")
        chunks.append((start, end, have[(start, end)]))
    manifest = build_manifest(key, loaded, prompt_set, prompts, opts, chunks, time.perf_counter() - t0)
    path = finish_capture(store, key, manifest)
    return CaptureResult(key, False, time.perf_counter() - t0, manifest["tokens"], path, manifest)


# ----------------------------------------------------------------------------- the two passes

class _EveryStep:
    """A generate() stopping criterion that reports each new token and stops the batch on cancel."""

    def __init__(self, on_step: Callable[[int], None] | None, should_stop: Callable[[], bool] | None):
        self.on_step, self.should_stop, self.steps = on_step, should_stop, 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps)
        stop = self.should_stop is not None and bool(self.should_stop())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_responses(loaded: LoadedModel, prompts: list[list[int]], opts: CaptureOptions, *,
                       on_step: Callable[[int], None] | None = None,
                       should_stop: Callable[[], bool] | None = None, seed: int | None = None) -> list[list[int]]:
    """The target's own response to each prompt (left-padded batch), cut after its end-of-sequence token.

    on_step(n) is called after the n-th new token of the batch; should_stop() true ends the batch early
    (the caller must then discard the cut-short responses). `seed`: torch's seed for this batch (sampling)."""
    from transformers import StoppingCriteriaList  # transformers takes seconds to load; the CLI imports this module at start-up

    if seed is not None:
        torch.manual_seed(seed)
    tok, model = loaded.tokenizer, loaded.model
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    eos = _eos_ids(loaded)
    sampling = {"do_sample": True, "temperature": opts.temperature, "top_k": 0, "top_p": 1.0} if opts.temperature > 0 \
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    out = model.generate(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                         max_new_tokens=opts.max_new_tokens, pad_token_id=pad, eos_token_id=eos or None,
                         stopping_criteria=StoppingCriteriaList([_EveryStep(on_step, should_stop)]), **sampling)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


def _eos_ids(loaded: LoadedModel) -> list[int]:
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def sample_rows(lengths: list[int], prompt_lengths: list[int], sample_positions: int | None, seed: int,
                first_conversation: int = 0) -> torch.Tensor:
    """The rows a chunk keeps of conversations of `lengths` tokens (the first `prompt_lengths` of each its prompt)
    laid end to end (LongTensor, ascending): every row, or per conversation size.kept_positions positions among
    1..n-1 (position 0, the attention sink, never): a uniform sample of its response positions, and when it has
    fewer than s of them all of them and a uniform sample of its prompt positions for the rest (the statistics use
    response tokens by default). Seeded by (seed, the conversation's index in the capture): the same whatever the
    batch."""
    if sample_positions is None:
        return torch.arange(sum(lengths))
    out, offset = [], 0
    for i, (n, p) in enumerate(zip(lengths, prompt_lengths)):
        g = torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + first_conversation + i) % 2**64)
        k = size.kept_positions(n, sample_positions)
        first = max(int(p), 1)                                  # the response's first position (never 0)
        response = first + torch.randperm(n - first, generator=g)[:k]
        prompt = 1 + torch.randperm(first - 1, generator=g)[:k - response.numel()]
        out.append(offset + torch.cat([prompt, response]).sort().values)
        offset += n
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def record_groups(lengths: list[int], pad: float = RECORD_PAD) -> list[list[int]]:
    """Indices of conversations of `lengths` tokens in groups recorded by one (right-padded) forward each: sorted by
    length (ties by index), a conversation joins the group of the shorter ones before it while the group padded to
    its length stays within `pad` times its tokens, else starts the next group."""
    groups, tokens = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= pad * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


@torch.no_grad()
def record(loaded: LoadedModel, prompts: list[list[int]], responses: list[list[int]],
           first_conversation: int = 0, sample_positions: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """The chunk's tensors (see CaptureReader) of the conversations prompt + response, in order: every token, or
    with `sample_positions` the rows `sample_rows` keeps (their true positions in `position`). The forwards run over
    `record_groups` of similar length, so that one long conversation does not pad the others."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    kept = [sample_rows([len(s)], [len(p)], sample_positions, seed, first_conversation + i)
            for i, (s, p) in enumerate(zip(seqs, prompts))]
    states: list[list[torch.Tensor] | None] = [None] * len(seqs)     # per conversation: its kept rows of each state
    entropy: list[torch.Tensor | None] = [None] * len(seqs)
    for group in record_groups([len(s) for s in seqs]):
        out = _forward_states(loaded, [seqs[i] for i in group])      # hidden_states[0..N], then the pre-norm output
        rows = [kept[i].to(loaded.device) for i in group]
        for j, i in enumerate(group):
            states[i] = [h[j, :len(seqs[i])][rows[j]].cpu() for h in out]
        final = torch.cat([out[-2][j, :len(seqs[i])][rows[j]] for j, i in enumerate(group)])
        scores = predictive_entropy(loaded.model.lm_head, final, *head_transform(loaded.model.config)).float()
        for i, e in zip(group, scores.split([len(r) for r in rows])):
            entropy[i] = e
        del out, final
    dtype = state_dtype([h for per in states for h in per])         # float16 unless a state would overflow it
    tensors = {}
    for l in range(len(states[0])):
        name = f"hidden.{l}" if l < len(states[0]) - 1 else "prenorm_final"
        tensors[name] = torch.cat([per[l] for per in states]).to(dtype)
        for per in states:
            per[l] = None                                            # one copy of the chunk at a time
    return {**tensors, "entropy": torch.cat(entropy),
            "token_id": torch.cat([torch.tensor(s, dtype=torch.long)[k] for s, k in zip(seqs, kept)]).int(),
            "position": torch.cat(kept).int(),
            "conversation": torch.cat([torch.full((len(k),), first_conversation + i) for i, k in enumerate(kept)]).int(),
            "is_response": torch.cat([k >= len(p) for k, p in zip(kept, prompts)])}


def _forward_states(loaded: LoadedModel, seqs: list[list[int]]) -> list[torch.Tensor]:
    """One right-padded forward over `seqs` with output_hidden_states: hidden_states[0..N] (N: after the final norm)
    and the last decoder layer's output before it, each [len(seqs), longest, d] on the model's device."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), loaded.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    last_layer_out = {}
    hook = loaded.model.model.layers[-1].register_forward_hook(
        lambda _m, _i, o: last_layer_out.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    try:
        out = loaded.model.model(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                                 output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    return [*out.hidden_states, last_layer_out["h"]]


def build_manifest(key, loaded: LoadedModel, prompt_set: PromptSet, prompts, opts, chunks, seconds) -> dict:
    chunk_list = [chunk_entry(s, e, p) for s, e, p in chunks]
    return {
        "key": key, "format": FORMAT_VERSION, "model": loaded.spec, "fingerprint": loaded.fingerprint,
        "dtype": loaded.dtype_name,
        "num_layers": loaded.num_layers, "hidden_size": loaded.hidden_size, "final_state": loaded.final_state,
        "has_prenorm_final": True, "sample_positions": opts.sample_positions, "prompt_set": prompt_set.name,
        "prompt_set_hash": prompt_set.content_hash,
        "prompts": [{"id": p.id, "category": p.category} for p in prompts[: max((e for _, e, _ in chunks), default=0)]],
        "conversations": sum(e - s for s, e, _ in chunks), "tokens": sum(c["tokens"] for c in chunk_list),
        "options": asdict(opts), "chunks": chunk_list, "seconds": round(seconds, 3),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **({"layer_kinds": kinds} if (kinds := layer_kinds(loaded.model)) is not None else {}),
    }


# transformers' layer kinds (config.layer_types; cache_utils.get_layer_types_and_kwargs) -> the manifest's
# (format.LAYER_KINDS). Its "linear_attention" covers gated delta-nets and Mamba mixers alike: `layer_kinds` tells
# them apart by the layer's module.
_KINDS = {"full_attention": "attention", "sliding_attention": "sliding", "chunked_attention": "chunked",
          "conv": "conv", "hybrid": "ssm+attention"}


def layer_kinds(model) -> list[str] | None:
    """What each decoder layer of `model` mixes tokens with (format.LAYER_KINDS), for the manifest: transformers' own
    layer kinds (those its caches are built from: the config's layer_types, else each layer's sliding_window /
    attention_chunk_size), a "linear_attention" layer named "ssm" when it holds a Mamba mixer (a child module named
    `mamba`, or of a Mamba class: Jamba, Bamba, GraniteMoeHybrid) and "linear" otherwise (gated delta-nets: Qwen3-Next,
    Qwen3.5, OLMo-Hybrid). None when they cannot be told (a config transformers reads no kinds from, or a layer count
    that is not the model's): the capture then records none, as older captures do."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        config = model.config.get_text_config(decoder=True)
        kinds, _ = get_layer_types_and_kwargs(config)
        layers = list(model.model.layers)
    except (AttributeError, TypeError, ValueError, IndexError, KeyError):
        return None
    if len(kinds) != len(layers):
        return None

    def mamba(layer) -> bool:
        return hasattr(layer, "mamba") or any("mamba" in type(m).__name__.lower() for m in layer.modules())

    return [("ssm" if mamba(layer) else "linear") if kind == "linear_attention" else _KINDS.get(str(kind), str(kind))
            for kind, layer in zip(kinds, layers)]
