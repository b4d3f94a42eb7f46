"""Export a capture as speculators' offline training data, for the layers LayerScope chose.

    export_states(cap, "/data/for-speculators", layers=[2, 15, 27])

writes what `speculators train --data-path OUT --target-layer-ids 2 15 27` reads (speculators/train/data.py
ArrowDataset, hs_connectors FileTransfer; the layout is documented in capture/engine_dumps.py):

    OUT/state.json, OUT/dataset_info.json, OUT/data-00000-of-00001.arrow
                          a `datasets.save_to_disk` folder: one row per conversation, input_ids [L] int64,
                          loss_mask [L] int64 (1 = a response token), seq_len (written with pyarrow, a batch of
                          rows at a time)
    OUT/hidden_states/hs_<i>.safetensors
                          hidden_states [L, K+1, d]: the K chosen layers (vLLM ids are LayerScope's) and then the
                          last layer before the final norm (vLLM id N, the capture's prenorm_final), in the capture's
                          dtype; token_ids [L] int64
    OUT/token_freq.pt     {token id: count} over response tokens, as speculators' save_token_frequency_distribution
                          counts them (its trainer builds the draft vocabulary from it)

The folder is written beside OUT under a hidden name and renamed into place when complete. OUT is checked before
anything is read (`output_folder`): links are followed (a loop or a dangling link is refused), a file, a non-empty
folder, a name or path too long to create and a place that cannot be written are each one line; workflow.export_states
also refuses an OUT inside the store. Memory: one chunk's chosen layers.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Callable

import pyarrow as pa
import torch
from safetensors import safe_open

from layerscope import disk, paths
from layerscope.capture.format import CaptureReader
from layerscope.errors import CaptureError
from layerscope.store import atomic_save_tensors

ARROW_FILE = "data-00000-of-00001.arrow"
SCHEMA = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())])
FEATURES = {"input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "seq_len": {"dtype": "int64", "_type": "Value"}}


def export_states(cap: CaptureReader, out, layers: list[int],
                  progress: Callable[[int, int], None] | None = None) -> dict:
    """Write capture `cap` as speculators data at `out` for `layers` (LayerScope ids in 0..N-1); returns a
    summary {path, conversations, tokens, bytes, layers, target_layer_ids, train_command}."""
    N = cap.num_layers
    layers = [int(l) for l in layers]
    bad = [l for l in layers if not 0 <= l < N]
    if not layers or bad or len(set(layers)) != len(layers):
        raise CaptureError(f"--layers {layers} must be distinct layers in 0..{N - 1}",
                           f"Pick the draft's layers; the last layer (vLLM id {N}) is added by itself")
    cap.require_every_position("speculators' training data", "Export a capture made without --sample-positions")
    if not cap.manifest.get("has_prenorm_final"):
        raise CaptureError(f"Capture {cap.key} has no pre-norm final states, which speculators trains against",
                           "Capture again with this version (or import a speculators dump, which holds them)")
    out = output_folder(out)
    disk.need_space(out.parent, export_bytes(cap.num_tokens, len(layers) + 1, cap.hidden_size), "the export")
    tmp = out.parent / partial_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hidden_states").mkdir(parents=True)
    try:
        summary = _write(cap, tmp, layers, progress)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary["path"] = str(out)
    summary["train_command"] = (f"speculators train --data-path {out} --target-layer-ids {' '.join(map(str, layers))}"
                                f" --verifier-name-or-path <the target's Hugging Face id or directory>")
    return summary


def partial_name(out: Path) -> str:
    """The hidden name beside `out` the export is written under until it is complete."""
    return f".{out.name}.partial"


def output_folder(out) -> Path:
    """The real path of the folder an export writes (--out), checked before anything is read or written: the path
    rule (paths.output_dir: no link loop, no dangling link, not a file, a length the system can create with the
    temporary name beside it), a new or empty folder, and writable where it is made; else one CaptureError or
    StoreWriteError line."""
    real = paths.output_dir(out, "--out", CaptureError, room=len(partial_name(Path("x"))) - 1)
    if real.exists() and any(real.iterdir()):
        raise CaptureError(f"{out} exists and is not empty", "Pass a new folder with --out")
    disk.output_writable(real, "--out")
    return real


def export_bytes(tokens: int, states: int, hidden_size: int) -> int:
    """Bytes of an export: `states` layers of 2-byte states per token, token ids twice (hs file, data), the mask."""
    return int(tokens) * (states * hidden_size * 2 + 8 + 8 + 8)


def _write(cap: CaptureReader, tmp: Path, layers: list[int], progress) -> dict:
    table = cap.tokens()
    conv = table["conversation"]
    freq: Counter[int] = Counter()
    written = 0
    nbytes = 0
    conversations = int(conv.max()) + 1 if conv.numel() else 0
    with pa.OSFile(str(tmp / ARROW_FILE), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        offset = 0
        for c, (_, n) in enumerate(cap.chunks):
            index = torch.arange(offset, offset + n)
            states = torch.stack([cap.layer(l, index).to(_dtype(cap, c)) for l in layers] +
                                 [cap.prenorm_final(index).to(_dtype(cap, c))], dim=1)          # [n, K+1, d]
            ids, mask, cv = table["token_id"][index], table["is_response"][index], conv[index]
            rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
            for k in cv.unique().tolist():
                where = (cv == k).nonzero().squeeze(1)
                tok = ids[where].long()
                path = tmp / "hidden_states" / f"hs_{k}.safetensors"
                atomic_save_tensors(path, {"hidden_states": states[where].contiguous(), "token_ids": tok})
                nbytes += path.stat().st_size
                m = mask[where].long()
                rows["input_ids"].append(tok.tolist())
                rows["loss_mask"].append(m.tolist())
                rows["seq_len"].append(int(tok.numel()))
                freq.update(tok[m.bool()].tolist())
                written += 1
            writer.write_batch(pa.record_batch([pa.array(rows[f.name], f.type) for f in SCHEMA], schema=SCHEMA))
            offset += n
            if progress:
                progress(written, conversations)
    (tmp / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": ARROW_FILE}], "_fingerprint": cap.key[:16], "_format_columns": None,
        "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False, "_split": None}, indent=2))
    (tmp / "dataset_info.json").write_text(json.dumps({"citation": "", "description": f"LayerScope capture {cap.key}",
                                                       "features": FEATURES, "homepage": "", "license": ""}, indent=2))
    torch.save(dict(freq), tmp / "token_freq.pt")
    nbytes += sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
    return {"conversations": written, "tokens": cap.num_tokens, "bytes": nbytes, "layers": layers,
            "target_layer_ids": layers, "last_layer_id": cap.num_layers}


def _dtype(cap: CaptureReader, chunk: int) -> torch.dtype:
    """The states' dtype of chunk `chunk` as stored (float16, or bfloat16 where float16 would overflow)."""
    with safe_open(str(cap.path / cap.chunks[chunk][0]), framework="pt") as f:
        return torch.bfloat16 if f.get_slice("hidden.0").get_dtype() == "BF16" else torch.float16
