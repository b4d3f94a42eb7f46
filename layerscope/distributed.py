"""Several processes with torch.distributed: `torchrun --nproc-per-node N -m layerscope capture ...`.

torchrun starts N copies of the command with RANK / WORLD_SIZE / LOCAL_RANK set. `init()` (called by
`python -m layerscope` before anything loads a model) joins the process group: NCCL with one GPU per process
(cuda:LOCAL_RANK) when CUDA is present, else gloo on the CPU. A capture then splits its batches of
conversations into N contiguous ranges, one per rank:

    batches b = 0..B-1 (the one-process capture's batches, same size, same order)
    rank r writes batches [r*B//N, (r+1)*B//N) as chunk files into the capture's one partial directory
    rank 0 holds the store's write lock for the key throughout, and after every rank is done writes the
    manifest and renames the capture into place, exactly as a one-process capture does

Every chunk is computed from the same prompts, batch and model as in one process, so the finished capture
is the same, chunk for chunk, as a one-process capture (greedy responses; sampled responses and a token
budget depend on the order of batches and are refused across processes). A rank that fails makes every
rank raise, with the failing rank's message, instead of leaving the others waiting.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from layerscope import capture as _capture    # capture.py calls back into this module: refer to it by module
from layerscope.errors import CaptureError
from layerscope.store import CHUNK_RE, atomic_save_tensors, chunk_name, list_chunks, read_header


def launched() -> bool:
    """True in a process torchrun started with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init() -> None:
    """Join the process group torchrun describes (no-op for a single process or when already joined)."""
    if not launched() or (dist.is_available() and dist.is_initialized()):
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))   # before any model lands on "cuda"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def active() -> bool:
    """True when this process is one of several ranks of a joined process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def shard(items: list, rank: int, world: int) -> list:
    """The contiguous range of `items` that rank `rank` of `world` takes: [rank*n//world, (rank+1)*n//world)."""
    n = len(items)
    return items[rank * n // world:(rank + 1) * n // world]


def agree(value):
    """Rank 0's `value`, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ok(error: BaseException | None) -> None:
    """Raise on every rank when any rank failed (the first failing rank's message), else return."""
    messages = [None] * world()
    dist.all_gather_object(messages, None if error is None else f"rank {rank()}: {error}")
    failed = [m for m in messages if m]
    if failed:
        if error is not None:
            raise error
        raise CaptureError(f"Another process of the capture failed ({failed[0]})", "Fix that error and run it again; "
                           "finished chunks are kept and the next run resumes from them")


# ----------------------------------------------------------------------------------------- capture

def capture_ranks(key, loaded, prompt_set, store, prompts, encoded, opts, t0, progress, should_stop):
    """The capture of `key` written by every rank together (see the module docstring); returns the
    CaptureResult on every rank. Arguments as capture._write_capture takes them."""
    if opts.temperature > 0:
        raise CaptureError(f"Sampled responses (temperature {opts.temperature}) across {world()} processes would not "
                           "match a one-process capture", "Capture with --temperature 0 or in one process")
    if opts.max_tokens is not None:
        raise CaptureError("--max-tokens stops after the batches that come first, which several processes do not "
                           "write in order", "Use --limit to size the capture, or capture in one process")
    lock = store.lock("captures", key) if rank() == 0 else nullcontext()
    with lock:
        stored = agree(store.has_capture(key) if rank() == 0 else None)
        if stored:
            cap = store.open_capture(key)
            return _capture.CaptureResult(key, True, time.perf_counter() - t0, cap.num_tokens, cap.path, cap.manifest)
        partial = store.partial_capture_dir(key)
        if rank() == 0:
            partial.mkdir(parents=True, exist_ok=True)
            for p in partial.iterdir():        # temporary files of a killed writer (the lock is ours)
                if not CHUNK_RE.fullmatch(p.name) and p.is_file():
                    p.unlink(missing_ok=True)
        dist.barrier()
        batches = [(s, min(s + opts.batch_size, len(prompts))) for s in range(0, len(prompts), opts.batch_size)]
        error = None
        try:
            write_batches(shard(batches, rank(), world()), loaded, encoded, opts, partial, t0, progress, should_stop)
        except Exception as e:   # every rank must reach all_ok, or the others would wait forever
            error = e
        all_ok(error)
        result = None
        if rank() == 0:
            try:
                result = finish(key, loaded, prompt_set, store, prompts, opts, partial, t0)
            except Exception as e:
                error = e
        all_ok(error)
        done = agree(None if result is None else (str(result.path), result.tokens))
    cap = store.open_capture(key)
    return _capture.CaptureResult(key, False, time.perf_counter() - t0, done[1], cap.path, cap.manifest)


def write_batches(batches, loaded, encoded, opts, partial, t0, progress, should_stop) -> None:
    """Write the chunk of each (start, end) batch that is not already complete in `partial`."""
    torch.manual_seed(opts.seed)
    tokens = 0
    for start, end in batches:
        path = partial / chunk_name(start, end)
        if path.is_file():
            try:
                read_header(path)
                tokens += _capture._chunk_tokens(path)
                continue
            except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
                path.unlink(missing_ok=True)       # not a complete chunk (damaged on disk): write it again
        if should_stop is not None and should_stop():
            raise _capture.CaptureCancelled("Capture cancelled", "Finished chunks are saved; run it again to resume")
        if progress:
            progress(_capture.CaptureProgress("generate", start, len(encoded), tokens, 0.0, time.perf_counter() - t0))
        responses = _capture.generate_responses(loaded, encoded[start:end], opts, should_stop=should_stop)
        tensors = _capture.record(loaded, encoded[start:end], responses, first_conversation=start)
        atomic_save_tensors(path, tensors)
        tokens += tensors["token_id"].numel()


def finish(key, loaded, prompt_set, store, prompts, opts, partial, t0):
    """Rank 0, every chunk written: the manifest over the planned batches and the rename into place, as
    capture._write_capture ends."""
    have = {(s, e): p for s, e, p in list_chunks(partial)}
    chunks = []
    for start in range(0, len(prompts), opts.batch_size):
        end = min(start + opts.batch_size, len(prompts))
        if (start, end) not in have:
            raise CaptureError(f"Chunk {chunk_name(start, end)} is missing after every process finished",
                               "Run the capture again; it resumes from the chunks that are there")
        chunks.append((start, end, have[(start, end)]))
    manifest = _capture.build_manifest(key, loaded, prompt_set, prompts, opts, chunks, time.perf_counter() - t0)
    path = store.finish_capture(key, manifest)
    return _capture.CaptureResult(key, False, time.perf_counter() - t0, manifest["tokens"], path, manifest)
