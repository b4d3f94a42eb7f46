"""The hidden-state dumps the serving engines' training tools write, read one sample at a time.

Two formats, and the layer ids each one uses. LayerScope's layer `l` is transformers' `hidden_states[l]`
(0 = embedding output, l in 1..N-1 = the residual stream entering decoder layer l, N = the final state
after the final norm; README "Layer indices").

speculators (vLLM's `extract_hidden_states` method; speculators/cli/generate_offline_data.py, scripts/launch_vllm.py)
    DIR/                      the prepared data, a `datasets.save_to_disk` folder: state.json, data-*.arrow
                              with columns input_ids [L], loss_mask [L], seq_len (speculators/cli/prepare_data.py)
    DIR/hidden_states/hs_<i>.safetensors   row i's states (speculators/train/data.py ArrowDataset):
        hidden_states  [L, K, d]   the layers of `--target-layer-ids`, in ascending layer order (below);
                                   launch_vllm.py appends id N (the last layer) unless --no-include-last-layer
        token_ids      [L]         must equal the row's input_ids
    Layer ids: vLLM's. Id l < N is captured before decoder layer l runs (`hidden_states + residual` entering it,
    vllm/model_executor/models/llama.py and interfaces.py `aux_hidden_state_layers`): LayerScope's l. Id N is the
    last layer's output *before* the final norm (appended after the loop, before `self.norm`): LayerScope's
    pre-norm final state; speculators applies `verifier_norm` to it (speculators/models/eagle3/core.py).
    A file can be truncated by an interrupted run (speculators/data_generation/offline.py,
    find_corrupt_hidden_state_indices): every file's header is checked here before it is used.

SpecForge (scripts/prepare_hidden_states.py; read by specforge/data/preprocessing.py OfflineEagle3Dataset)
    DIR/rows_<a>-<b>/data_<i>.ckpt (or .ckpt.gz), one torch.save dict per sample:
        input_ids [L], loss_mask [L]
        hidden_state      [1, L, d]     the final state after the final norm (the input of lm_head:
                                        SGLang's logits processor, specforge/offline_capture/sglang_backend/utils.py)
        aux_hidden_state  [1, L, K*d]   the layers of `--aux-hidden-states-layers`, concatenated in ascending order
    Layer ids: SGLang's. SGLang captures the input of decoder layer id+1 (`set_eagle3_layers_to_capture` adds one;
    prepare_hidden_states.py writes its default as [2-1, N//2-1, N-3-1]): SGLang id s is LayerScope's s+1, and
    LayerScope's layer 0 (the embedding output) has no SGLang id.
    Files are read with torch.load(weights_only=True): tensors and plain containers, never arbitrary pickles.

The order of the states. Both engines collect them inside the model's own loop over its decoder layers (vLLM:
`for idx, layer in enumerate(self.layers): if idx in self.aux_hidden_state_layers: aux_hidden_states.append(...)`;
SGLang: `for i in range(start_layer, end_layer): if i in self.layers_to_capture: ...`), so a dump holds them in
ascending layer order whatever order the ids were given in. Which state is which cannot be read from the states
themselves, so `parse_engine_layers` refuses ids that are not strictly ascending (a repeated id included): read in
that order they would label layers wrongly. Given ascending, distinct ids, the count check of `layer_map` and its
rule that every layer be present leave exactly one labelling.

`open_dump(fmt, directory, hidden_size, ...)` scans the whole dump first, reading only headers, sizes and token
ids, and returns a `Dump`: the usable samples in order, and every missing, unreadable, partial or mismatched one
with its reason. A `Sample` reads one layer at a time, so no dump and no sample is held whole.

A dump is untrusted input, read within bounds:
    special files  every file is opened with O_NONBLOCK and used only when fstat says it is a regular file
                   (`regular_file`), so a FIFO never blocks the process (a block inside a C library's open would
                   not even end on SIGTERM); a sample that is a FIFO, a device, a socket or (SpecForge) a link is
                   named among the skipped samples, never dropped silently
    compression    a .ckpt.gz sample is inflated a piece at a time into an unnamed temporary file (gone when closed,
                   or when the process dies) and memory-mapped from there; past `max_inflated` bytes (the caller's
                   bound: the most a sample of the target can hold, `max_sample_bytes`) the import is refused
    tensors        a SpecForge tensor must be backed by its file's bytes (a stride-0 view would declare a billion
                   tokens over one value); ids and masks must be integers (masks: or booleans)
    arrow columns  input_ids and loss_mask must be lists of integers (loss_mask: or booleans) without nulls; each
                   record batch is validated in full before a row of it is read
    nesting        state.json is read through jsonsafe (size and depth bounded); SpecForge's folders are walked
                   at most MAX_FOLDER_DEPTH deep, deeper is refused
    vocabulary     with `vocab_size`, a usable sample holding a token id outside 0..vocab_size-1 refuses the import,
                   naming the sample and the id (it would crash training and mislead a probe later)
    empty samples  a sample of no tokens is skipped (a chunk of none would not be a capture's chunk)
    the record     skipped samples are named up to MAX_SKIPPED_KEPT, each reason cut to MAX_REASON_CHARS (a reason
                   can quote the file), and counted in full, so the manifest stays within what the store reads
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch
from safetensors import safe_open

from layerscope import fmt, jsonsafe
from layerscope.errors import CaptureError, LayerScopeError
from layerscope.store import write_error

FORMATS = ("speculators", "specforge")
HS_RE = re.compile(r"hs_(\d+)\.safetensors")
CKPT_RE = re.compile(r"data_(\d+)\.ckpt(\.gz)?")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
MAX_GZ_BYTES = 8 * 2**30          # a .ckpt.gz sample's inflated size when the caller gives no bound of its own
INFLATE_PIECE = 2**20             # a .ckpt.gz sample is inflated this many bytes at a time
MAX_LISTED = 10                   # skipped samples named in one message
MAX_SKIPPED_KEPT = 1000           # skipped samples recorded by name (the rest are counted)
MAX_REASON_CHARS = 160            # a skipped sample's reason, cut to this
MAX_FOLDER_DEPTH = 8              # SpecForge folders walked below the dump (its layout: rows_<a>-<b>/data_<i>.ckpt)
MAX_STATE_JSON_BYTES = 16 * 2**20
PROC_FD = Path("/proc/self/fd")   # where an open file has a path of its own (Linux)
DUMP_FIX = "Pass the folder the engine wrote, or regenerate the file named"


class SampleRefused(CaptureError):
    """A sample's data refused while its states are read (non-finite, or changed since the scan): the import stops
    and what it wrote for this dump is removed, since a rerun of the same dump would meet the same sample."""


class NotRegularFile(ValueError):
    """A path that is a FIFO, a device, a socket or a folder: never read."""


class TooLarge(ValueError):
    """A compressed sample that inflates beyond its bound."""

    def __init__(self, limit: int):
        super().__init__(f"inflates to more than {fmt.size(limit)}")
        self.limit = limit


@dataclass
class LayerMap:
    """Where each LayerScope layer comes from in a dump.

    engine_ids    the ids as the engine was given them (`--layers`), K of them after any appended last layer
    slot          LayerScope layer -> its index among the dump's K states
    prenorm_slot  the index of the pre-norm final state (speculators' id N), or None
    final_given   the dump holds the post-norm final state (SpecForge's hidden_state)
    computed      LayerScope layers computed from the target (0: its embedding; N: its final norm)"""
    engine_ids: list[int]
    slot: dict[int, int]
    prenorm_slot: int | None
    final_given: bool
    computed: list[int]

    def describe(self) -> str:
        held = ", ".join(f"{e}->{l}" for l, e in sorted((l, self.engine_ids[s]) for l, s in self.slot.items()))
        return f"engine id -> LayerScope layer: {held}" + (f"; computed: {self.computed}" if self.computed else "")


def parse_engine_layers(text: str) -> list[int] | str:
    """`--layers` of import-states: 'all', or comma/space separated integers as given to the engine, distinct and
    ascending (the engines write the states in layer order: the module docstring)."""
    text = (text or "").strip()
    if text == "all":
        return "all"
    parts = [p for p in re.split(r"[,\s]+", text) if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise CaptureError(f"--layers {text[:80]!r} is not 'all' or a list of integers",
                           "Pass the layer ids exactly as the engine was given them, e.g. --layers 2,15,27") from None
    if not ids:
        raise CaptureError("--layers is empty", "Pass 'all' or the engine's layer ids, e.g. --layers 2,15,27")
    if len(set(ids)) != len(ids):
        raise CaptureError(f"--layers {text[:80]!r} repeats a layer", "Name each layer once, in the engine's order")
    if ids != sorted(ids):
        raise CaptureError(f"--layers {text[:80]!r} is not in ascending order; vLLM and SGLang write the states in "
                           "layer order whatever order they were given, so these ids would label the layers wrongly",
                           f"Pass the same ids in ascending order: --layers {','.join(map(str, sorted(ids)))}")
    return ids


def layer_map(fmt: str, layers, num_layers: int, states: int) -> LayerMap:
    """The LayerMap of a dump of `fmt` holding `states` layer states, given `--layers` (a list or 'all').
    LayerScope's statistics need every layer 0..N; a dump that lacks one is refused, naming what is missing."""
    N = num_layers
    if fmt == "speculators":
        ids = list(range(N + 1)) if layers == "all" else list(layers)
        if N not in ids and states == len(ids) + 1:
            ids.append(N)                           # launch_vllm.py's --include-last-layer (its default)
        bad = [i for i in ids if not 0 <= i <= N]
        if bad:
            raise CaptureError(f"--layers names {_short_list(bad)}, outside vLLM's ids 0..{N} for a {N}-layer target",
                               "Pass the ids given to launch_vllm.py --target-layer-ids")
        if states != len(ids):
            raise CaptureError(f"The dump's files hold {states} layer states, --layers names {len(ids)} "
                               f"({_short_list(ids)})",
                               "Pass the ids given to launch_vllm.py --target-layer-ids (the last layer N is "
                               "appended when the files hold one more)")
        slot = {i: k for k, i in enumerate(ids) if i < N}
        prenorm = ids.index(N) if N in ids else None
        if prenorm is None:
            raise CaptureError(f"The dump has no last layer (vLLM id {N}), from which token entropies come",
                               "Generate it with launch_vllm.py's default --include-last-layer")
        computed = [0] if 0 not in slot else []
        need = set(range(1, N))
        final_given = False
    elif fmt == "specforge":
        ids = list(range(N - 1)) if layers == "all" else list(layers)
        bad = [i for i in ids if not 0 <= i <= N - 2]
        if bad:
            raise CaptureError(f"--layers names {_short_list(bad)}, outside SGLang's ids 0..{N - 2} for a {N}-layer "
                               "target (SGLang id s is the input of layer s+1)",
                               "Pass the ids given to prepare_hidden_states.py --aux-hidden-states-layers")
        if states != len(ids):
            raise CaptureError(f"The dump's aux_hidden_state holds {states} layer states, --layers names {len(ids)}",
                               "Pass the ids given to prepare_hidden_states.py --aux-hidden-states-layers")
        slot = {i + 1: k for k, i in enumerate(ids)}
        prenorm, computed, need, final_given = None, [0], set(range(1, N)), True
    else:
        raise CaptureError(f"Unknown dump format {fmt!r}", f"Use one of: {', '.join(FORMATS)}")
    missing = sorted(need - set(slot))
    if missing:
        raise CaptureError(
            f"The dump lacks LayerScope layers {_short_list(missing)} of 0..{N}; LayerScope's statistics need every "
            "layer", "Generate the dump with every layer: " + (
                f"launch_vllm.py --target-layer-ids {' '.join(map(str, range(N)))}" if fmt == "speculators" else
                f"prepare_hidden_states.py --aux-hidden-states-layers {','.join(map(str, range(N - 1)))}"))
    return LayerMap(ids, slot, prenorm, final_given, computed)


def _short_list(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 12 else f"[{', '.join(map(str, xs[:10]))}, ... ({len(xs)} in all)]"


def max_sample_bytes(num_layers: int, hidden_size: int, context: int) -> int:
    """The most bytes one SpecForge sample of a target can hold: `context` tokens, each with N states of d float32
    values (hidden_state and at most N-1 aux states) and its int64 input id and loss mask, plus 1 MiB for
    torch.save's container. A compressed sample inflating past it is not a sample of this target."""
    return context * (num_layers * hidden_size * 4 + 16) + 2**20


# ----------------------------------------------------------------------------- reading files within bounds

def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "a special file"


@contextmanager
def regular_file(path):
    """`path` opened for reading when it is a regular file (a link to one is followed): yields a path naming the
    opened file itself (/proc/self/fd/N on Linux, so a file swapped after the check is never what is read) and its
    stat. Opened with O_NONBLOCK, so a FIFO is refused at once instead of blocking; NotRegularFile otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        yield (str(PROC_FD / str(fd)) if PROC_FD.is_dir() else str(path)), st
    finally:
        os.close(fd)


@contextmanager
def inflated(path: str, limit: int, scratch=None):
    """The gzip file at `path` inflated INFLATE_PIECE bytes at a time, so memory never holds more than a piece
    whatever the file declares: into an unnamed temporary file in `scratch` (yields a path naming it; the file is
    gone when closed, or when the process dies), or, where open files have no path, into memory. TooLarge past
    `limit` bytes."""
    on_disk = PROC_FD.is_dir()
    with (tempfile.TemporaryFile(dir=scratch) if on_disk else io.BytesIO()) as out:
        total = 0
        with gzip.open(path, "rb") as src:
            while piece := src.read(INFLATE_PIECE):
                total += len(piece)
                if total > limit:
                    raise TooLarge(limit)
                try:
                    out.write(piece)
                except OSError as e:          # the scratch disk is full: the store's one line, not a skipped sample
                    raise write_error(e, None, Path(scratch or tempfile.gettempdir())) from None
        out.flush()
        if on_disk:
            yield str(PROC_FD / str(out.fileno()))
        else:
            out.seek(0)
            yield out


def load_ckpt(path: Path, *, max_inflated: int = MAX_GZ_BYTES, scratch=None) -> dict:
    """A SpecForge sample: torch.load with weights_only (tensors and plain containers only), memory-mapped. A .gz
    file is inflated first (`inflated`: a piece at a time, refused past `max_inflated` bytes)."""
    with regular_file(path) as (name, _):
        if Path(path).name.endswith(".gz"):
            with inflated(name, max_inflated, scratch) as raw:
                data = torch.load(raw, weights_only=True, mmap=isinstance(raw, str), map_location="cpu")
        else:
            data = torch.load(name, weights_only=True, mmap=True, map_location="cpu")
    if not isinstance(data, dict):
        raise ValueError(f"holds a {type(data).__name__}, not a dict of tensors")
    return data


def _reason_of(e: BaseException) -> str:
    first = str(e).splitlines()[0][:120] if str(e).strip() else ""
    return first or type(e).__name__


# ----------------------------------------------------------------------------- one sample

@dataclass
class ReadLimits:
    """How a SpecForge sample is read: its inflated size at most `max_inflated`, inflated into `scratch`."""
    max_inflated: int = MAX_GZ_BYTES
    scratch: Path | None = None


class Sample:
    """One conversation of a dump: its token table and its layer states, read one layer at a time.

    input_ids [L] int64, loss_mask [L] bool; `state(k)` [L, d] the k-th of the K states in the dump's order;
    `final()` [L, d] SpecForge's post-norm final state. A file that no longer reads as it did at the scan is
    SampleRefused."""

    def __init__(self, fmt: str, index: int, path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 dtype: torch.dtype, hidden_size: int, name: str | None = None, limits: ReadLimits | None = None):
        self.fmt, self.index, self.path = fmt, index, path
        self.input_ids, self.loss_mask, self.dtype = input_ids, loss_mask, dtype
        self.hidden_size, self._name = hidden_size, name
        self.limits = limits or ReadLimits()
        self._data = None

    @property
    def name(self) -> str:
        return self._name or self.path.name

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    def state(self, k: int, d: int) -> torch.Tensor:
        try:
            if self.fmt == "speculators":
                with regular_file(self.path) as (name, _), safe_open(name, framework="pt") as f:
                    x = f.get_slice("hidden_states")[:, k, :]
            else:
                aux = self._ckpt()["aux_hidden_state"]
                aux = aux[0] if aux.dim() == 3 else aux
                x = aux[:, k * d:(k + 1) * d]
        except LayerScopeError:
            raise
        except Exception as e:      # the file was replaced, truncated or removed after the scan
            raise self._changed(_reason_of(e)) from None
        return self._checked(x, d)

    def final(self) -> torch.Tensor:
        try:
            h = self._ckpt()["hidden_state"]
            h = h[0] if h.dim() == 3 else h
        except LayerScopeError:
            raise
        except Exception as e:
            raise self._changed(_reason_of(e)) from None
        return self._checked(h, self.hidden_size)

    def _checked(self, x, d: int) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or list(x.shape) != [len(self), d] or x.dtype not in FLOAT_DTYPES:
            raise self._changed(f"its states are now {getattr(x, 'dtype', type(x).__name__)} "
                                f"{list(getattr(x, 'shape', []))}, the scan read [{len(self)}, {d}]")
        return x

    def _changed(self, reason: str) -> SampleRefused:
        return SampleRefused(f"Sample {self.name} changed or became unreadable after the scan ({reason})",
                             "Leave the dump unchanged while it is imported, then run the import again")

    def _ckpt(self) -> dict:
        if self._data is None:
            self._data = load_ckpt(self.path, max_inflated=self.limits.max_inflated, scratch=self.limits.scratch)
        return self._data

    def release(self) -> None:
        self._data = None


# ----------------------------------------------------------------------------- the scan

@dataclass
class Dump:
    fmt: str
    directory: Path
    samples: list[Sample]                                   # usable, in sample order
    skipped: list[dict] = field(default_factory=list)       # [{sample, reason}] in sample order, the first MAX_SKIPPED_KEPT
    skipped_count: int = 0                                  # every skipped sample, named or not
    states: int = 0                                         # K, layer states per sample
    dtype: torch.dtype = torch.float16
    identity: list = field(default_factory=list)            # [name, size, mtime_ns] of every file read

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def skip(self, name: str, reason: str) -> None:
        """Set sample `name` aside with its reason (recorded by name while fewer than MAX_SKIPPED_KEPT are)."""
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED_KEPT:
            reason = reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."
            self.skipped.append({"sample": name, "reason": reason})

    def skipped_line(self) -> str:
        """One line naming the skipped samples and why (the first MAX_LISTED)."""
        if not self.skipped_count:
            return ""
        shown = "; ".join(f"{s['sample']}: {s['reason']}" for s in self.skipped[:MAX_LISTED])
        more = self.skipped_count - min(len(self.skipped), MAX_LISTED)
        return (f"{self.skipped_count} of {self.skipped_count + len(self.samples)} samples skipped ({shown}"
                f"{f'; and {more} more' if more else ''})")


def open_dump(fmt: str, directory, hidden_size: int, *, hidden_states_dir=None, vocab_size: int | None = None,
              max_inflated: int = MAX_GZ_BYTES, scratch=None) -> Dump:
    """Scan the dump at `directory` (see the module docstring) without reading any state: every sample is
    kept or skipped with its reason. CaptureError when there is no dump there or no usable sample, and when a
    usable sample holds a token id outside 0..vocab_size-1 (with `vocab_size`) or a compressed sample inflates
    past `max_inflated` bytes (inflated into `scratch`, default the system's temporary folder)."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise CaptureError(f"{directory} is not a directory", "Pass the folder the engine wrote")
    if fmt == "speculators":
        dump = _scan_speculators(directory, Path(hidden_states_dir) if hidden_states_dir else directory / "hidden_states",
                                 hidden_size, vocab_size)
    elif fmt == "specforge":
        dump = _scan_specforge(directory, hidden_size, vocab_size, ReadLimits(max_inflated, scratch))
    else:
        raise CaptureError(f"Unknown dump format {fmt!r}", f"Use one of: {', '.join(FORMATS)}")
    if not dump.samples:
        raise CaptureError(f"No usable sample in {directory}" + (f": {dump.skipped_line()}" if dump.skipped_count else ""),
                           "Check --format and the folder; regenerate the samples named")
    return dump


def _check_vocab(name: str, ids: torch.Tensor, vocab_size: int | None) -> None:
    if vocab_size is None or not ids.numel():
        return
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        at = int(bad[0, 0])
        raise CaptureError(f"Sample {name} holds token id {int(ids[at])} at position {at}, outside the target's "
                           f"vocabulary (ids 0..{vocab_size - 1})",
                           "Import with the --model whose tokenizer made the dump, or remove that sample")


# ---------------------------------------------------------------------------- speculators

def _data_files(directory: Path) -> list[str]:
    """The arrow files state.json lists, as names inside `directory`."""
    state = directory / "state.json"
    fix = "Pass the folder speculators prepare-data wrote (it holds state.json and data-*.arrow)"
    try:
        with regular_file(state) as (name, st):
            if st.st_size > MAX_STATE_JSON_BYTES:
                raise CaptureError(f"{state} is {fmt.size(st.st_size)}, more than a state.json can be", fix)
            raw = Path(name).read_bytes()
    except (OSError, NotRegularFile) as e:
        raise CaptureError(f"{directory} has no readable state.json ({_reason_of(e)})", fix) from None
    doc = jsonsafe.loads(raw, what=str(state), error=CaptureError, max_bytes=MAX_STATE_JSON_BYTES, fix=fix)
    files = doc.get("_data_files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise CaptureError(f"{state} has no list of _data_files, each with a filename", fix)
    return [Path(f["filename"]).name for f in files]


def _list_column(path: Path, schema, name: str, values) -> int:
    """The index of column `name` when it is a list whose items pass `values`; CaptureError otherwise."""
    where = schema.get_all_field_indices(name)
    if len(where) != 1:
        raise CaptureError(f"{path.name} has {len(where)} columns named {name} (names: {str(schema.names)[:120]})",
                           "Pass the folder speculators prepare-data wrote")
    t = schema.field(where[0]).type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and values(t.value_type)):
        raise CaptureError(f"{path.name}: column {name} is {str(t)[:80]}, not a list of integers",
                           "Pass the folder speculators prepare-data wrote")
    return where[0]


def read_arrow_rows(directory: Path, identity: list | None = None):
    """(input_ids, loss_mask) numpy arrays of each row of a `datasets.save_to_disk` folder, in order, one record
    batch in memory at a time (pyarrow; the `datasets` package is not needed). Each file read is added to
    `identity` as [name, size, mtime_ns]. Columns that are not lists of integers (loss_mask: or booleans), nulls
    and damaged batches are one CaptureError."""
    for name in _data_files(directory):
        path = directory / name
        try:
            with regular_file(path) as (fd_path, st), pa.memory_map(fd_path) as source:
                if identity is not None:
                    identity.append([name, st.st_size, st.st_mtime_ns])
                reader = pa.ipc.open_stream(source)
                ids_at = _list_column(path, reader.schema, "input_ids", pa.types.is_integer)
                mask_at = _list_column(path, reader.schema, "loss_mask",
                                       lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t))
                for batch in reader:
                    batch.validate(full=True)
                    ids, mask = batch.column(ids_at), batch.column(mask_at)
                    if ids.null_count or mask.null_count or ids.values.null_count or mask.values.null_count:
                        raise CaptureError(f"{path.name} has missing (null) input_ids or loss_mask values",
                                           "Run speculators prepare-data again")
                    ids_off, ids_val = ids.offsets.to_numpy(), ids.values.to_numpy(zero_copy_only=False)
                    mask_off, mask_val = mask.offsets.to_numpy(), mask.values.to_numpy(zero_copy_only=False)
                    for r in range(batch.num_rows):
                        yield ids_val[ids_off[r]:ids_off[r + 1]], mask_val[mask_off[r]:mask_off[r + 1]]
        except NotRegularFile as e:
            raise CaptureError(f"{path} is {e}", "Pass the folder speculators prepare-data wrote") from None
        except (OSError, pa.ArrowException) as e:
            raise CaptureError(f"{path} is not a readable Arrow file ({_reason_of(e)})",
                               "Run speculators prepare-data again") from None


def _scan_speculators(directory: Path, hs_dir: Path, d: int, vocab_size: int | None) -> Dump:
    dump = Dump("speculators", directory, [])
    if not hs_dir.is_dir():
        raise CaptureError(f"{hs_dir} does not exist", "Pass --hidden-states DIR where generate-offline-data wrote "
                           "hs_<i>.safetensors (default: the data folder's hidden_states/)")
    present = {int(m[1]): p for p in hs_dir.iterdir() if (m := HS_RE.fullmatch(p.name))}
    seen = set()
    dtypes = set()
    data_files = []
    for i, (ids, mask) in enumerate(read_arrow_rows(directory, data_files)):
        seen.add(i)
        name = f"hs_{i}.safetensors"
        path = present.get(i)
        if path is None:
            dump.skip(name, "missing")
            continue
        try:
            with regular_file(path) as (opened, st), safe_open(opened, framework="pt") as f:
                keys = set(f.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    dump.skip(name, f"partial: holds {sorted(keys)}, not hidden_states and token_ids")
                    continue
                hs = f.get_slice("hidden_states")
                shape, dtype = hs.get_shape(), _torch_dtype(hs.get_dtype())
                tokens = f.get_tensor("token_ids")
        except NotRegularFile as e:
            dump.skip(name, str(e))
            continue
        except Exception as e:   # safetensors raises its own kinds for a truncated or malformed file
            dump.skip(name, f"unreadable ({_reason_of(e)})")
            continue
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        reason = _mismatch(shape, dtype, len(ids), len(mask), d, dump.states or None)
        if reason is None and not (tokens.dtype in INT_DTYPES and torch.equal(tokens.long(), ids_t)):
            reason = "mismatched: its token_ids are not the data row's input_ids"
        if reason:
            dump.skip(name, reason)
            continue
        _check_vocab(name, ids_t, vocab_size)
        dump.states = dump.states or shape[1]
        dtypes.add(dtype)
        dump.identity.append([name, st.st_size, st.st_mtime_ns])
        dump.samples.append(Sample("speculators", i, path, ids_t, torch.from_numpy(mask.astype(bool)), dtype, d))
    for i in sorted(set(present) - seen):
        dump.skip(f"hs_{i}.safetensors", "orphan: no data row has this index")
    state = directory / "state.json"
    st = state.stat()
    dump.identity += sorted(data_files) + [[state.name, st.st_size, st.st_mtime_ns]]
    dump.dtype = _common_dtype(dtypes)
    return dump


def _mismatch(shape, dtype, n_ids: int, n_mask: int, d: int, states: int | None) -> str | None:
    if len(shape) != 3:
        return f"mismatched: hidden_states is {list(shape)[:8]}, not [L, K, d]"
    if dtype not in FLOAT_DTYPES:
        return f"mismatched: hidden_states of dtype {dtype}"
    if shape[2] != d:
        return f"mismatched: hidden size {shape[2]}, the target's is {d}"
    if not shape[0] == n_ids == n_mask:
        return f"mismatched: {shape[0]} state rows, the data row has {n_ids} input_ids and {n_mask} loss_mask"
    if shape[0] == 0:
        return "empty: no tokens"
    if shape[1] == 0 or (states is not None and shape[1] != states):
        return f"mismatched: {shape[1]} layer states where the first sample has {states}"
    return None


# ---------------------------------------------------------------------------- SpecForge

def _walk_specforge(directory: Path, dump: Dump) -> list[tuple[int, str, Path]]:
    """(index, name, path) of every regular data_<i>.ckpt[.gz] below `directory`, sorted; links and special files of
    that name are skipped by name; folders are walked without following links, at most MAX_FOLDER_DEPTH deep."""
    found = []
    stack = [(directory, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            raise CaptureError(f"{folder} cannot be listed ({e.strerror})", "Check the dump folder's permissions") from None
        for e in entries:
            path = Path(e.path)
            name = str(path.relative_to(directory))
            if e.is_dir(follow_symlinks=False):
                if depth + 1 > MAX_FOLDER_DEPTH:
                    raise CaptureError(f"{directory} holds folders nested more than {MAX_FOLDER_DEPTH} deep "
                                       f"({name[:120]}...)", "Pass the folder prepare_hidden_states.py wrote (its "
                                       "samples lie in rows_<a>-<b>/ folders)")
                stack.append((path, depth + 1))
                continue
            m = CKPT_RE.fullmatch(e.name)
            if e.is_symlink():
                if m or e.is_dir():
                    dump.skip(name, "a link: links are not followed (copy the file or folder into the dump)")
            elif m and not e.is_file(follow_symlinks=False):
                dump.skip(name, f"{_kind(e.stat(follow_symlinks=False).st_mode)}, not a regular file")
            elif m:
                found.append((int(m[1]), name, path))
    return sorted(found)


def _tensor_problem(data: dict, d: int, states: int) -> str | None:
    """Why a loaded SpecForge sample cannot be used, or None."""
    need = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
    if not all(isinstance(data.get(k), torch.Tensor) for k in need):
        keys = [k[:40] if isinstance(k, str) else type(k).__name__ for k in list(data)[:8]]
        return f"partial: holds {keys}{' ...' if len(data) > 8 else ''}, not {', '.join(need)}"
    for k in need:
        t = data[k]
        if t.numel() * t.element_size() > t.untyped_storage().nbytes():
            return f"mismatched: {k} declares {t.numel()} values that its file does not hold"
    ids, mask = data["input_ids"], data["loss_mask"]
    if ids.dtype not in INT_DTYPES or (mask.dtype not in INT_DTYPES and mask.dtype != torch.bool):
        return f"mismatched: input_ids of dtype {ids.dtype}, loss_mask of dtype {mask.dtype}, not integers"
    aux, final = data["aux_hidden_state"], data["hidden_state"]
    aux = aux[0] if aux.dim() == 3 and aux.shape[0] == 1 else aux
    final = final[0] if final.dim() == 3 and final.shape[0] == 1 else final
    if aux.dim() != 2 or final.dim() != 2:
        return (f"mismatched: aux_hidden_state {list(data['aux_hidden_state'].shape)[:8]}, hidden_state "
                f"{list(data['hidden_state'].shape)[:8]}, not [1, L, K*d] and [1, L, d]")
    if aux.shape[1] % d or final.shape[1] != d or aux.shape[1] == 0:
        return f"mismatched: widths {aux.shape[1]} and {final.shape[1]} are not K*{d} and {d} (the target's d)"
    if not (aux.shape[0] == final.shape[0] == ids.numel() == mask.numel()):
        return f"mismatched: {ids.numel()} input_ids, {mask.numel()} loss_mask, {aux.shape[0]} and " \
               f"{final.shape[0]} state rows"
    if aux.dtype not in FLOAT_DTYPES or final.dtype not in FLOAT_DTYPES:
        return f"mismatched: states of dtype {aux.dtype} and {final.dtype}"
    if ids.numel() == 0:
        return "empty: no tokens"
    if states and aux.shape[1] // d != states:
        return f"mismatched: {aux.shape[1] // d} layer states where the first sample has {states}"
    return None


def _scan_specforge(directory: Path, d: int, vocab_size: int | None, limits: ReadLimits) -> Dump:
    dump = Dump("specforge", directory, [])
    dtypes = set()
    for i, name, path in _walk_specforge(directory, dump):
        try:
            st = path.stat()
            data = load_ckpt(path, max_inflated=limits.max_inflated, scratch=limits.scratch)
        except TooLarge as e:
            raise CaptureError(f"Sample {name} {e}, the most a sample of this target can hold",
                               "Remove that file from the dump: it is not a SpecForge sample of this target") from None
        except LayerScopeError:
            raise
        except NotRegularFile as e:
            dump.skip(name, str(e))
            continue
        except Exception as e:   # torch.load raises many kinds for a damaged or foreign file
            dump.skip(name, f"unreadable ({_reason_of(e)})")
            continue
        reason = _tensor_problem(data, d, dump.states)
        if reason:
            dump.skip(name, reason)
            continue
        ids = data["input_ids"].reshape(-1).long()
        _check_vocab(name, ids, vocab_size)
        aux = data["aux_hidden_state"]
        dump.states = dump.states or aux.shape[-1] // d
        dtypes.add(aux.dtype)
        dump.identity.append([name, st.st_size, st.st_mtime_ns])
        dump.samples.append(Sample("specforge", i, path, ids.clone(), data["loss_mask"].reshape(-1).bool().clone(),
                                   aux.dtype, d, name=name, limits=limits))
        del data
    dump.dtype = _common_dtype(dtypes)
    return dump


SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32}


def _torch_dtype(name: str):
    return SAFETENSORS_DTYPES.get(name, name)


def _common_dtype(dtypes: set) -> torch.dtype:
    """The states' dtype in LayerScope's chunks: float16 when every sample is float16, bfloat16 when any is
    bfloat16 (lossless), float32 dumps are judged per chunk (capture.format.state_dtype)."""
    if dtypes == {torch.float16}:
        return torch.float16
    if torch.bfloat16 in dtypes:
        return torch.bfloat16
    return torch.float32
