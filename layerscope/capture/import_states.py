"""Import an engine's hidden-state dump (speculators, SpecForge) as a LayerScope capture.

    result = import_states("/data/sharegpt-llama70b", "/models/llama-70b", store,
                           ImportOptions(format="speculators", layers="all"))

1. scan     capture/engine_dumps.py reads every sample's header, size and token ids (no states); samples that are
            missing, unreadable, partial, mismatched, empty or not regular files are set aside with their reason and
            named in the result and the manifest (`imported.skipped`, the first 1000; `imported.skipped_count`), never
            used. A token id outside the target's vocabulary, or a compressed sample inflating past the most a
            sample of the target can hold (engine_dumps.max_sample_bytes), refuses the import before anything is
            written;
2. map      the engine's layer ids (`layers`, as the engine was given them) to LayerScope's (engine_dumps.layer_map):
            every layer 0..N must be there or be derivable (0 from the embedding, N from the pre-norm last state);
3. write    the usable samples in order, `batch_size` conversations per chunk, in the capture format
            (capture/format.py): each chunk is written one layer at a time (store.atomic_stream_tensors), so memory
            holds one layer of one chunk plus the derived layers, never a sample or the dump whole. Token
            entropies come from the last layer through the target's final norm and lm_head (target/ends.py,
            loaded alone); response tokens are the dump's loss mask. A sample whose states are not finite, or that
            changed after the scan, refuses the import (engine_dumps.SampleRefused) and the chunks written for this
            dump are removed: the same dump would meet the same sample again, and a changed one has another key;
4. check    the manifest and chunks are checked as the store checks a capture it opens (its size, schema and every
            chunk's header) before the capture is put in place, and opened from the store after, so an import
            never reports a capture that the store would call damaged.

The key is a hash of the format, the target's fingerprint, the engine's layer ids and the dump's files (names,
sizes, modification times), so the same dump imported again is served from the store, and an interrupted import
resumes from its finished chunks under the store's write lock for the key, as a capture does. The result is a
capture like any other: `analyze`, `select`, the app and `export-states` read it.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from layerscope import disk, jsonsafe
from layerscope.capture.engine_dumps import (
    FORMATS,
    Dump,
    LayerMap,
    SampleRefused,
    layer_map,
    max_sample_bytes,
    open_dump,
    parse_engine_layers,
)
from layerscope.capture.format import FLOAT16_MAX, MAX_MANIFEST_BYTES, check_chunk_files, chunk_name, validate_manifest
from layerscope.capture.run import FORMAT_VERSION, CaptureCancelled, CaptureProgress, CaptureResult, chunk_entry, chunk_tokens, resume_partial
from layerscope.capture.size import capture_bytes
from layerscope.capture.stored import finish_capture, has_capture, open_capture, partial_capture_dir
from layerscope.errors import CaptureError, StoreError
from layerscope.store import LockWaitCancelled, Store, atomic_stream_tensors, make_key
from layerscope.target.ends import TargetEnds
from layerscope.validate import check_number


@dataclass
class ImportOptions:
    format: str = "speculators"        # speculators | specforge
    layers: str = "all"                # the layer ids as the engine was given them ("2,15,27"), or "all"
    hidden_states: str | None = None   # speculators: the folder of hs_<i>.safetensors (default <dir>/hidden_states)
    batch_size: int = 8                # conversations per chunk

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise CaptureError(f"--format must be one of {', '.join(FORMATS)} (got {self.format!r})",
                               "speculators: generate-offline-data's hs_<i>.safetensors; specforge: "
                               "prepare_hidden_states.py's data_<i>.ckpt")
        check_number("batch_size", self.batch_size, minimum=1, maximum=65_536, integer=True, error=CaptureError,
                     fix="Pass --batch-size 1 or more")
        parse_engine_layers(self.layers)


@dataclass
class ImportResult(CaptureResult):
    """A capture's result, with the dump's skipped samples."""

    @property
    def skipped(self) -> list[dict]:
        return self.manifest["imported"]["skipped"]


def import_key(dump: Dump, fingerprint: str, lmap: LayerMap) -> str:
    return make_key({"import": dump.fmt, "model": fingerprint, "engine_layers": lmap.engine_ids,
                     "source": dump.identity, "format": FORMAT_VERSION})


def import_states(directory, spec: str, store: Store, options: ImportOptions | None = None, *,
                  progress: Callable[[CaptureProgress], None] | None = None,
                  should_stop: Callable[[], bool] | None = None, ends: TargetEnds | None = None) -> ImportResult:
    """Import the dump at `directory` for target `spec` into `store` (see the module docstring)."""
    options = options or ImportOptions()
    options.validate()
    t0 = time.perf_counter()
    ends = ends or TargetEnds.load(spec, store)
    dump = open_dump(options.format, directory, ends.hidden_size, hidden_states_dir=options.hidden_states,
                     vocab_size=ends.model.get_input_embeddings().num_embeddings,
                     max_inflated=max_sample_bytes(ends.num_layers, ends.hidden_size, target_context(ends)),
                     scratch=store.root)
    lmap = layer_map(options.format, parse_engine_layers(options.layers), ends.num_layers, dump.states)
    key = import_key(dump, ends.weights.fingerprint, lmap)
    try:
        with store.lock("captures", key, should_stop=should_stop,
                        on_wait=lambda: progress and progress(CaptureProgress("waiting", 0, len(dump.samples), 0, 0.0,
                                                                              time.perf_counter() - t0))):
            if has_capture(store, key):
                cap = open_capture(store, key)
                return ImportResult(key, True, time.perf_counter() - t0, cap.num_tokens, cap.path, cap.manifest)
            return _write(key, dump, lmap, ends, spec, store, options, t0, progress, should_stop)
    except LockWaitCancelled as e:
        raise CaptureCancelled("Import cancelled while another process was writing it", e.fix) from None


def target_context(ends: TargetEnds) -> int:
    """The most tokens a sample of the target can hold: its max_position_embeddings (2**20 when it names none)."""
    n = getattr(ends.config, "max_position_embeddings", None)
    return n if isinstance(n, int) and 0 < n <= 2**24 else 2**20


def _write(key, dump: Dump, lmap: LayerMap, ends: TargetEnds, spec, store, options, t0, progress, should_stop):
    partial = partial_capture_dir(store, key)
    samples, B = dump.samples, options.batch_size
    batches = [(s, min(s + B, len(samples))) for s in range(0, len(samples), B)]
    check_manifest_size(dump, batches)
    planned = {chunk_name(s, e) for s, e in batches}
    done_bytes = sum(f.stat().st_size for f in partial.glob("chunk-*.safetensors") if f.name in planned) \
        if partial.is_dir() else 0
    need = capture_bytes(dump.tokens, ends.num_layers, ends.hidden_size, lmap.prenorm_slot is not None)
    disk.need_space(store.root, max(0, need - done_bytes), f"importing {dump.tokens} tokens")
    done = resume_partial(partial)
    for chunk in set(done) - set(batches):          # written with another --batch-size: not this import's chunks
        done.pop(chunk).unlink(missing_ok=True)
    tokens_done = sum(chunk_tokens(partial / chunk_name(s, e)) for s, e in done)
    for start, end in batches:
        if (start, end) in done:
            continue
        if should_stop is not None and should_stop():
            raise CaptureCancelled("Import cancelled", f"{start} of {len(samples)} samples are saved; run it again "
                                   "to resume")
        if progress:
            elapsed = time.perf_counter() - t0
            progress(CaptureProgress("import", start, len(samples), tokens_done, tokens_done / max(elapsed, 1e-9),
                                     elapsed))
        try:
            tokens_done += write_chunk(partial / chunk_name(start, end), samples[start:end], start, lmap, ends,
                                       dump.dtype)
        except SampleRefused:
            shutil.rmtree(partial, ignore_errors=True)      # a rerun of this dump would stop at the same sample
            raise
    if progress:
        elapsed = time.perf_counter() - t0
        progress(CaptureProgress("done", len(samples), len(samples), tokens_done, tokens_done / max(elapsed, 1e-9),
                                 elapsed))
    manifest = build_import_manifest(key, dump, lmap, ends, spec, options, partial, batches, time.perf_counter() - t0)
    try:
        check_as_stored(manifest, key, partial)
    except CaptureError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finish_capture(store, key, manifest)
    try:
        cap = open_capture(store, key)                      # what the store reads back, not what was meant
    except StoreError as e:
        shutil.rmtree(store.path("captures", key), ignore_errors=True)
        raise CaptureError(f"The imported capture does not read back from the store ({e.problem})",
                           "Nothing was kept; report this with the dump's layout") from None
    return ImportResult(key, False, time.perf_counter() - t0, cap.num_tokens, cap.path, cap.manifest)


MANIFEST_FIX = "Import the dump in parts: folders of fewer samples each (or a larger --batch-size, fewer chunks)"


def check_manifest_size(dump: Dump, batches) -> None:
    """Refuse, before anything is written, a dump whose capture's manifest would be larger than the store reads
    (capture.format.MAX_MANIFEST_BYTES): a bound from its samples' names, its skipped records and its chunks."""
    names = sum(len(json.dumps(s.name)) + 64 for s in dump.samples)
    size = names + len(json.dumps(dump.skipped, indent=2)) + 400 * len(batches) + 2**16
    if size > MAX_MANIFEST_BYTES:
        raise CaptureError(f"The dump's {len(dump.samples)} samples would need a capture manifest of about "
                           f"{size >> 20} MiB, more than the {MAX_MANIFEST_BYTES >> 20} MiB the store reads", MANIFEST_FIX)


def check_as_stored(manifest: dict, key: str, partial: Path) -> None:
    """The checks the store runs on a capture it opens (capture.format.read_manifest, check_chunk_files), run on
    the manifest as finish_capture writes it (store.atomic_write_json) and on the chunks in `partial`; CaptureError."""
    text = json.dumps(manifest, indent=2, default=str).encode()
    if len(text) > MAX_MANIFEST_BYTES:
        raise CaptureError(f"The capture's manifest would be {len(text) >> 20} MiB, more than the "
                           f"{MAX_MANIFEST_BYTES >> 20} MiB the store reads", MANIFEST_FIX)
    try:
        validate_manifest(jsonsafe.loads(text, what="the capture's manifest", error=StoreError), key)
        check_chunk_files(partial, manifest)
    except StoreError as e:
        raise CaptureError(f"The imported capture would not read back: {e.problem}",
                           "Nothing was kept; report this with the dump's layout") from None


def write_chunk(path: Path, samples, first: int, lmap: LayerMap, ends: TargetEnds, source_dtype: torch.dtype) -> int:
    """One capture chunk of `samples` (conversations first, first+1, ...), written a layer at a time; returns
    its token count. Layers the dump lacks are derived (TargetEnds); a non-finite state is refused by name."""
    N, d = ends.num_layers, ends.hidden_size
    derived: dict[int, list[torch.Tensor]] = {}
    prenorm: list[torch.Tensor] = []
    entropy = []
    for s in samples:
        if 0 in lmap.computed:
            derived.setdefault(0, []).append(ends.embedding(s.input_ids))
        if lmap.prenorm_slot is not None:
            pre = _finite(s.state(lmap.prenorm_slot, d), s, "the last layer").float()
            prenorm.append(pre)
            final = ends.final(pre)
        else:
            final = _finite(s.final(), s, "hidden_state").float()
        derived.setdefault(N, []).append(final)
        entropy.append(ends.entropy(final))
    dtype = _chunk_dtype(samples, lmap, d, source_dtype, [t for ts in derived.values() for t in ts] + prenorm)
    n = sum(len(s) for s in samples)

    def held(l):
        def make():
            out = torch.cat([_finite(s.state(lmap.slot[l], d), s, f"layer {l}") for s in samples]).to(dtype)
            return out
        return make

    entries = []
    for l in range(N + 1):
        make = (lambda l=l: torch.cat(derived[l]).to(dtype)) if l in derived else held(l)
        entries.append((f"hidden.{l}", dtype, [n, d], make))
    if prenorm:
        entries.append(("prenorm_final", dtype, [n, d], lambda: torch.cat(prenorm).to(dtype)))
    table = {
        "token_id": torch.cat([s.input_ids for s in samples]).int(),
        "position": torch.cat([torch.arange(len(s)) for s in samples]).int(),
        "conversation": torch.cat([torch.full((len(s),), first + i) for i, s in enumerate(samples)]).int(),
        "is_response": torch.cat([s.loss_mask for s in samples]).bool(),
        "entropy": torch.cat(entropy).float(),
    }
    entries += [(name, t.dtype, list(t.shape), lambda t=t: t) for name, t in table.items()]
    try:
        atomic_stream_tensors(path, entries)
    finally:
        for s in samples:
            s.release()
    return n


def _finite(x: torch.Tensor, sample, what: str) -> torch.Tensor:
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = x.float().flatten()
        value = bad[~torch.isfinite(bad)][0].item()
        raise SampleRefused(f"Sample {sample.name} holds a non-finite value ({value}) in {what}; nothing of this "
                            "import was kept", "Regenerate or remove that sample, then import again")
    return x


def _chunk_dtype(samples, lmap: LayerMap, d: int, source: torch.dtype, derived: list[torch.Tensor]) -> torch.dtype:
    """The chunk's one states dtype: bfloat16 for a bfloat16 dump (lossless); float16 for a float16 dump, and for a
    float32 dump whose states fit it, else bfloat16 (capture.format.state_dtype's rule; a float32 dump's states
    are read once more for it)."""
    if source == torch.bfloat16:
        return torch.bfloat16
    big = any(t.numel() and float(t.abs().amax()) > FLOAT16_MAX for t in derived)
    if source == torch.float32 and not big:
        big = any(float(s.state(k, d).abs().amax()) > FLOAT16_MAX for s in samples for k in lmap.slot.values())
    return torch.bfloat16 if big else torch.float16


def build_import_manifest(key, dump: Dump, lmap: LayerMap, ends: TargetEnds, spec, options: ImportOptions, partial: Path,
                          batches, seconds: float) -> dict:
    chunks = []
    for s, e in batches:
        p = partial / chunk_name(s, e)
        if not p.is_file():
            raise CaptureError(f"Chunk {p.name} is missing after the import", "Run the import again; it resumes")
        chunks.append(chunk_entry(s, e, p))
    return {
        "key": key, "format": FORMAT_VERSION, "model": spec, "fingerprint": ends.weights.fingerprint,
        "num_layers": ends.num_layers, "hidden_size": ends.hidden_size, "final_state": "post-norm",
        "has_prenorm_final": lmap.prenorm_slot is not None,
        "prompt_set": f"{dump.fmt}:{Path(dump.directory).name}", "prompt_set_hash": make_key(dump.identity),
        "prompts": [{"id": s.name, "category": "imported"} for s in dump.samples],
        "conversations": len(dump.samples), "tokens": sum(c["tokens"] for c in chunks),
        "options": asdict(options), "chunks": chunks, "seconds": round(seconds, 3),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "imported": {"format": dump.fmt, "directory": str(Path(dump.directory).resolve()),
                     "engine_layer_ids": lmap.engine_ids,
                     "layer_map": {str(l): lmap.engine_ids[k] for l, k in sorted(lmap.slot.items())},
                     "prenorm_final_engine_id": None if lmap.prenorm_slot is None else lmap.engine_ids[lmap.prenorm_slot],
                     "computed_layers": lmap.computed, "samples": len(dump.samples) + dump.skipped_count,
                     "skipped": dump.skipped, "skipped_count": dump.skipped_count},
    }
