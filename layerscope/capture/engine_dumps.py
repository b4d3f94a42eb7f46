"""The hidden-state dumps the serving engines' training tools write, read one sample at a time.

Two formats, and the layer ids each one uses. LayerScope's layer `l` is transformers' `hidden_states[l]`
(0 = embedding output, l in 1..N-1 = the residual stream entering decoder layer l, N = the final state
after the final norm; README "Layer indices").

speculators (vLLM's `extract_hidden_states` method; speculators/cli/generate_offline_data.py, scripts/launch_vllm.py)
    DIR/                      the prepared data, a `datasets.save_to_disk` folder: state.json, data-*.arrow
                              with columns input_ids [L], loss_mask [L], seq_len (speculators/cli/prepare_data.py)
    DIR/hidden_states/hs_<i>.safetensors   row i's states (speculators/train/data.py ArrowDataset):
        hidden_states  [L, K, d]   the layers of `--target-layer-ids`, in that order; launch_vllm.py appends
                                   id N (the last layer) unless --no-include-last-layer
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
        aux_hidden_state  [1, L, K*d]   the layers of `--aux-hidden-states-layers`, concatenated in that order
    Layer ids: SGLang's. SGLang captures the input of decoder layer id+1 (`set_eagle3_layers_to_capture` adds one;
    prepare_hidden_states.py writes its default as [2-1, N//2-1, N-3-1]): SGLang id s is LayerScope's s+1, and
    LayerScope's layer 0 (the embedding output) has no SGLang id.
    Files are read with torch.load(weights_only=True): tensors and plain containers, never arbitrary pickles.

`open_dump(fmt, directory, layers, num_layers, hidden_size)` scans the whole dump first, reading only headers,
sizes and token ids, and returns a `Dump`: the usable samples in order, and every missing, unreadable, partial or
mismatched one with its reason. A `Sample` reads one layer at a time, so no dump and no sample is held whole.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch
from safetensors import safe_open

from layerscope.errors import CaptureError

FORMATS = ("speculators", "specforge")
HS_RE = re.compile(r"hs_(\d+)\.safetensors")
CKPT_RE = re.compile(r"data_(\d+)\.ckpt(\.gz)?")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GZ_BYTES = 8 * 2**30          # a .ckpt.gz sample is inflated in memory: refuse one larger than this
MAX_LISTED = 10                   # skipped samples named in one message


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
    """`--layers` of import-states: 'all', or comma/space separated integers as given to the engine."""
    text = (text or "").strip()
    if text == "all":
        return "all"
    parts = [p for p in re.split(r"[,\s]+", text) if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise CaptureError(f"--layers {text!r} is not 'all' or a list of integers",
                           "Pass the layer ids exactly as the engine was given them, e.g. --layers 2,15,27") from None
    if not ids:
        raise CaptureError("--layers is empty", "Pass 'all' or the engine's layer ids, e.g. --layers 2,15,27")
    if len(set(ids)) != len(ids):
        raise CaptureError(f"--layers {text!r} repeats a layer", "Name each layer once, in the engine's order")
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
            raise CaptureError(f"--layers names {bad}, outside vLLM's ids 0..{N} for a {N}-layer target",
                               "Pass the ids given to launch_vllm.py --target-layer-ids")
        if states != len(ids):
            raise CaptureError(f"The dump's files hold {states} layer states, --layers names {len(ids)} ({ids})",
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
            raise CaptureError(f"--layers names {bad}, outside SGLang's ids 0..{N - 2} for a {N}-layer target "
                               "(SGLang id s is the input of layer s+1)",
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


# ----------------------------------------------------------------------------- one sample

class Sample:
    """One conversation of a dump: its token table and its layer states, read one layer at a time.

    input_ids [L] int64, loss_mask [L] bool; `state(k)` [L, d] the k-th of the K states in the dump's order;
    `final()` [L, d] SpecForge's post-norm final state."""

    def __init__(self, fmt: str, index: int, path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 dtype: torch.dtype):
        self.fmt, self.index, self.path = fmt, index, path
        self.input_ids, self.loss_mask, self.dtype = input_ids, loss_mask, dtype
        self._data = None

    @property
    def name(self) -> str:
        return self.path.name

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    def state(self, k: int, d: int) -> torch.Tensor:
        if self.fmt == "speculators":
            with safe_open(str(self.path), framework="pt") as f:
                return f.get_slice("hidden_states")[:, k, :]
        aux = self._ckpt()["aux_hidden_state"]
        aux = aux[0] if aux.dim() == 3 else aux
        return aux[:, k * d:(k + 1) * d]

    def final(self) -> torch.Tensor:
        h = self._ckpt()["hidden_state"]
        return h[0] if h.dim() == 3 else h

    def _ckpt(self) -> dict:
        if self._data is None:
            self._data = load_ckpt(self.path)
        return self._data

    def release(self) -> None:
        self._data = None


def load_ckpt(path: Path) -> dict:
    """A SpecForge sample: torch.load with weights_only (tensors and plain containers only), memory-mapped
    when it is an uncompressed zip file; a .gz file is inflated in memory (refused beyond MAX_GZ_BYTES)."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            raw = f.read(MAX_GZ_BYTES + 1)
        if len(raw) > MAX_GZ_BYTES:
            raise ValueError(f"inflates to more than {MAX_GZ_BYTES >> 30} GiB")
        data = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    else:
        data = torch.load(str(path), weights_only=True, mmap=True, map_location="cpu")
    if not isinstance(data, dict):
        raise ValueError(f"holds a {type(data).__name__}, not a dict of tensors")
    return data


# ----------------------------------------------------------------------------- the scan

@dataclass
class Dump:
    fmt: str
    directory: Path
    samples: list[Sample]                                   # usable, in sample order
    skipped: list[dict] = field(default_factory=list)       # [{sample, reason}] in sample order
    states: int = 0                                         # K, layer states per sample
    dtype: torch.dtype = torch.float16
    identity: list = field(default_factory=list)            # [name, size, mtime_ns] of every file read

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def skipped_line(self) -> str:
        """One line naming the skipped samples and why (the first MAX_LISTED)."""
        if not self.skipped:
            return ""
        shown = "; ".join(f"{s['sample']}: {s['reason']}" for s in self.skipped[:MAX_LISTED])
        more = f"; and {len(self.skipped) - MAX_LISTED} more" if len(self.skipped) > MAX_LISTED else ""
        return f"{len(self.skipped)} of {len(self.skipped) + len(self.samples)} samples skipped ({shown}{more})"


def open_dump(fmt: str, directory, hidden_size: int, *, hidden_states_dir=None) -> Dump:
    """Scan the dump at `directory` (see the module docstring) without reading any state: every sample is
    kept or skipped with its reason. CaptureError when there is no dump there or no usable sample."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise CaptureError(f"{directory} is not a directory", "Pass the folder the engine wrote")
    if fmt == "speculators":
        dump = _scan_speculators(directory, Path(hidden_states_dir) if hidden_states_dir else directory / "hidden_states",
                                 hidden_size)
    elif fmt == "specforge":
        dump = _scan_specforge(directory, hidden_size)
    else:
        raise CaptureError(f"Unknown dump format {fmt!r}", f"Use one of: {', '.join(FORMATS)}")
    if not dump.samples:
        raise CaptureError(f"No usable sample in {directory}" + (f": {dump.skipped_line()}" if dump.skipped else ""),
                           "Check --format and the folder; regenerate the samples named")
    return dump


def _skip(skipped: list, name: str, reason: str) -> None:
    skipped.append({"sample": name, "reason": reason})


def read_arrow_rows(directory: Path):
    """(input_ids, loss_mask) of each row of a `datasets.save_to_disk` folder, in order, one record batch in
    memory at a time (pyarrow; the `datasets` package is not needed)."""
    state = directory / "state.json"
    try:
        files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CaptureError(f"{directory} has no readable state.json ({type(e).__name__}: {e})",
                           "Pass the folder speculators prepare-data wrote (it holds state.json and data-*.arrow)") from None
    for name in files:
        path = directory / Path(name).name
        try:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_stream(source)
                names = reader.schema.names
                if "input_ids" not in names or "loss_mask" not in names:
                    raise CaptureError(f"{path.name} has no input_ids and loss_mask columns (it has {names})",
                                       "Pass the folder speculators prepare-data wrote")
                for batch in reader:
                    ids = batch.column("input_ids").to_pylist()
                    mask = batch.column("loss_mask").to_pylist()
                    yield from zip(ids, mask)
        except (OSError, pa.ArrowInvalid) as e:
            raise CaptureError(f"{path} is not a readable Arrow file ({e})", "Run speculators prepare-data again") from None


def _scan_speculators(directory: Path, hs_dir: Path, d: int) -> Dump:
    dump = Dump("speculators", directory, [])
    if not hs_dir.is_dir():
        raise CaptureError(f"{hs_dir} does not exist", "Pass --hidden-states DIR where generate-offline-data wrote "
                           "hs_<i>.safetensors (default: the data folder's hidden_states/)")
    present = {int(m[1]): p for p in hs_dir.iterdir() if (m := HS_RE.fullmatch(p.name)) and p.is_file()}
    seen = set()
    dtypes = set()
    for i, (ids, mask) in enumerate(read_arrow_rows(directory)):
        seen.add(i)
        name = f"hs_{i}.safetensors"
        path = present.get(i)
        if path is None:
            _skip(dump.skipped, name, "missing")
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    _skip(dump.skipped, name, f"partial: holds {sorted(keys)}, not hidden_states and token_ids")
                    continue
                hs = f.get_slice("hidden_states")
                shape, dtype = hs.get_shape(), _torch_dtype(hs.get_dtype())
                tokens = f.get_tensor("token_ids").long()
        except Exception as e:   # safetensors raises its own kinds for a truncated or malformed file
            _skip(dump.skipped, name, f"unreadable ({str(e).splitlines()[0][:120] or type(e).__name__})")
            continue
        ids_t = torch.tensor(ids, dtype=torch.long)
        reason = _mismatch(shape, dtype, len(ids), len(mask), d, dump.states or None)
        if reason is None and not torch.equal(tokens, ids_t):
            reason = "mismatched: its token_ids are not the data row's input_ids"
        if reason:
            _skip(dump.skipped, name, reason)
            continue
        dump.states = dump.states or shape[1]
        dtypes.add(dtype)
        st = path.stat()
        dump.identity.append([name, st.st_size, st.st_mtime_ns])
        dump.samples.append(Sample("speculators", i, path, ids_t, torch.tensor(mask).bool(), dtype))
    for i in sorted(set(present) - seen):
        _skip(dump.skipped, f"hs_{i}.safetensors", "orphan: no data row has this index")
    for f in sorted(directory.glob("data-*.arrow")) + [directory / "state.json"]:
        st = f.stat()
        dump.identity.append([f.name, st.st_size, st.st_mtime_ns])
    dump.dtype = _common_dtype(dtypes)
    return dump


def _scan_specforge(directory: Path, d: int) -> Dump:
    dump = Dump("specforge", directory, [])
    found = []
    for p in directory.rglob("*"):
        m = CKPT_RE.fullmatch(p.name)
        if m and p.is_file() and not p.is_symlink():
            found.append((int(m[1]), p))
    found.sort()
    dtypes = set()
    for i, path in found:
        name = str(path.relative_to(directory))
        try:
            data = load_ckpt(path)
        except Exception as e:   # torch.load raises many kinds for a damaged or foreign file
            _skip(dump.skipped, name, f"unreadable ({str(e).splitlines()[0][:120] or type(e).__name__})")
            continue
        need = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
        if not all(isinstance(data.get(k), torch.Tensor) for k in need):
            _skip(dump.skipped, name, f"partial: holds {sorted(map(str, data))}, not {', '.join(need)}")
            continue
        ids, mask = data["input_ids"].reshape(-1).long(), data["loss_mask"].reshape(-1)
        aux, final = data["aux_hidden_state"], data["hidden_state"]
        aux = aux[0] if aux.dim() == 3 and aux.shape[0] == 1 else aux
        final = final[0] if final.dim() == 3 and final.shape[0] == 1 else final
        reason = None
        if aux.dim() != 2 or final.dim() != 2:
            reason = f"mismatched: aux_hidden_state {list(data['aux_hidden_state'].shape)}, hidden_state " \
                     f"{list(data['hidden_state'].shape)}, not [1, L, K*d] and [1, L, d]"
        elif aux.shape[1] % d or final.shape[1] != d:
            reason = f"mismatched: widths {aux.shape[1]} and {final.shape[1]} are not K*{d} and {d} (the target's d)"
        elif not (aux.shape[0] == final.shape[0] == ids.numel() == mask.numel()):
            reason = f"mismatched: {ids.numel()} input_ids, {mask.numel()} loss_mask, {aux.shape[0]} and " \
                     f"{final.shape[0]} state rows"
        elif aux.dtype not in FLOAT_DTYPES or final.dtype not in FLOAT_DTYPES:
            reason = f"mismatched: states of dtype {aux.dtype}"
        elif dump.states and aux.shape[1] // d != dump.states:
            reason = f"mismatched: {aux.shape[1] // d} layer states where the first sample has {dump.states}"
        if reason:
            _skip(dump.skipped, name, reason)
            continue
        dump.states = dump.states or aux.shape[1] // d
        dtypes.add(aux.dtype)
        st = path.stat()
        dump.identity.append([name, st.st_size, st.st_mtime_ns])
        dump.samples.append(Sample("specforge", i, path, ids.clone(), mask.bool().clone(), aux.dtype))
        del data
    dump.dtype = _common_dtype(dtypes)
    return dump


def _mismatch(shape, dtype, n_ids: int, n_mask: int, d: int, states: int | None) -> str | None:
    if len(shape) != 3:
        return f"mismatched: hidden_states is {list(shape)}, not [L, K, d]"
    if dtype not in FLOAT_DTYPES:
        return f"mismatched: hidden_states of dtype {dtype}"
    if shape[2] != d:
        return f"mismatched: hidden size {shape[2]}, the target's is {d}"
    if not shape[0] == n_ids == n_mask:
        return f"mismatched: {shape[0]} state rows, the data row has {n_ids} input_ids and {n_mask} loss_mask"
    if states is not None and shape[1] != states:
        return f"mismatched: {shape[1]} layer states where the first sample has {states}"
    return None


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
