"""The number format a target model runs in on this machine: float32 or bfloat16, chosen by measurement.

A target's weights are stored in float32 (de-quantized GGUF files, most checkpoints). On a CPU with bf16 matrix
units (Intel AMX; to a lesser degree AVX-512 BF16) a bfloat16 forward reads half the bytes and multiplies
several times faster, so a 1.5B target decodes at ~5 tokens/s instead of ~1; on a CPU without them oneDNN's
bf16 kernels can be slower than MKL's float32 ones (a Xeon with AVX-512 BF16 but no AMX, measured: the same
1-token cost, 16-token verification alike, prefill 0.6x). Which one is faster is a fact of the machine, so it
is measured, never assumed:

    choose(device, d, ff, store)   -> Choice(dtype, why): float32 or bfloat16 for a target of hidden size d and
                                      MLP width ff. LAYERSCOPE_DTYPE=float32|bfloat16 decides instead (auto: the
                                      default); CUDA: bfloat16; a CPU: bfloat16 only where `measure` finds it at
                                      least WIN faster than float32 at the rows that verify and train (16: a
                                      verification, 256: prefill and training) and at least PAR as fast at one
                                      (a decoding step), else float32. One row is where bfloat16 gains least: on
                                      an AMX Xeon 1.09x for the 1.5B's MLP shape, against 2.9x at 16 and 256 rows;
                                      requiring WIN there too left speculative decoding's nearly free
                                      verification on the table (docs/results.md).
    measure(d, ff)                 -> {rows: float32 seconds / bfloat16 seconds} of one [rows, d] x [d, ff]
                                      product, the shape of a decoder layer's MLP (a few seconds; remembered in
                                      the store per machine, torch version, threads and shape: precision.json)

Every timing prints the choice with its reason (`Choice.why`, on the model's `dtype_why`). In bfloat16 a
multi-token verification and a one-token step would take different kernel paths and could flip a near-tie; the
decoders pad every target forward to aligned rows (decoding/specdec.row_alignment) and stay token-exact. The
benchmark still reports, per contender, how many prompts' outputs differ from plain decoding's with the same
weights and dtype (never hidden; docs/internals.md, "bfloat16 and lossless").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from layerscope import jsonsafe
from layerscope.errors import LayerScopeError, ModelSpecError
from layerscope.store import StoreWriteError, atomic_write_bytes

ENV = "LAYERSCOPE_DTYPE"                 # auto (default) | float32 | bfloat16
NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROWS = (1, 16, 256)                      # a decoding step, a verification, prefill/training
WIN = 1.10                               # bfloat16 only where it is at least this much faster at 16 and 256 rows
PAR = 0.95                               # ... and at least this fast at one row (a tie, within a timing's noise)
REPEATS = 9                              # timed rounds per row count (`measure`)
MEMO = "precision.json"
MEMO_BYTES = 2**20
CACHE_BYTES = 256 * 2**20              # float32 weights measured through, more than a CPU cache holds


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    why: str                             # "bfloat16: measured 2.9x/3.4x/5.1x faster than float32 here (1/16/256 rows)"

    @property
    def name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def asked() -> str:
    """LAYERSCOPE_DTYPE as a name: 'auto', 'float32' or 'bfloat16' (anything else is one ModelSpecError)."""
    value = (os.environ.get(ENV) or "auto").strip().lower()
    if value not in ("auto", *NAMES):
        raise ModelSpecError(f"{ENV}={value!r} is not a dtype LayerScope runs a target in",
                             f"Set {ENV} to auto, float32 or bfloat16 (or unset it: auto)")
    return value


def choose(device: torch.device, d: int, ff: int, store_root: Path | None = None) -> Choice:
    """The dtype a target of hidden size d and MLP width ff runs in on `device` (see the module docstring)."""
    value = asked()
    if value != "auto":
        return Choice(NAMES[value], f"{value}: {ENV}={value}")
    if device.type == "cuda":
        return Choice(torch.bfloat16, "bfloat16: CUDA")
    if device.type != "cpu":
        return Choice(torch.float32, f"float32: {device.type}")
    ratios = measured(d, ff, store_root)
    return decide(ratios)


def decide(ratios: dict[int, float]) -> Choice:
    """bfloat16 where it is at least PAR as fast as float32 at one row and at least WIN faster at every larger row
    count, else float32; the reason names the ratios."""
    shown = "/".join(f"{ratios[r]:.2f}x" for r in sorted(ratios))
    rows = "/".join(str(r) for r in sorted(ratios))
    if ratios and all(x >= (PAR if r == 1 else WIN) for r, x in ratios.items()):
        return Choice(torch.bfloat16, f"bfloat16: measured {shown} the speed of float32 here ({rows} rows)")
    return Choice(torch.float32, f"float32: bfloat16 measured {shown} its speed here ({rows} rows; "
                                 f"bfloat16 needs {PAR:.2f}x at one row and {WIN:.2f}x at more)")


def machine_id(d: int, ff: int) -> str:
    """What a measurement depends on: the CPU (model and flags), torch, its threads and the matrix shape."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("model name", "flags")):
                cpu += line
                if line.startswith("flags"):
                    break
    except OSError:
        cpu = platform.processor()
    ident = json.dumps([cpu, torch.__version__, torch.get_num_threads(), os.environ.get("MKL_CBWR"), d, ff])
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def measured(d: int, ff: int, store_root: Path | None = None) -> dict[int, float]:
    """`measure(d, ff)`, remembered in the store's precision.json per machine_id (unreadable: measured again)."""
    ident = machine_id(d, ff)
    path = None if store_root is None else Path(store_root) / MEMO
    memo = {}
    if path is not None:
        try:
            memo = jsonsafe.loads(path.read_bytes(), what=str(path), max_bytes=MEMO_BYTES)
        except (OSError, LayerScopeError):
            memo = {}
    entry = memo.get(ident) if isinstance(memo, dict) else None
    if isinstance(entry, dict) and all(isinstance(entry.get(str(r)), (int, float)) for r in ROWS):
        return {r: float(entry[str(r)]) for r in ROWS}
    ratios = measure(d, ff)
    if path is not None:
        memo = memo if isinstance(memo, dict) else {}
        memo[ident] = {str(r): round(x, 4) for r, x in ratios.items()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps(memo).encode())
        except (OSError, StoreWriteError):      # a read-only or full store: measured again next time
            pass
    return ratios


def measure(d: int, ff: int, rows=ROWS, repeats: int = REPEATS) -> dict[int, float]:
    """{rows: seconds in float32 / seconds in bfloat16} of [rows, d] x [d, ff] products on the CPU, through
    enough weight matrices (up to 8; CACHE_BYTES of float32 in all) that they do not stay in the CPU's caches, as a
    model's layers do not: decoding's memory traffic is measured with its arithmetic. After a warm-up, each of
    `repeats` rounds times float32 and bfloat16 back to back (in alternating order), and the ratio kept is the median
    of the rounds' ratios: a slow spell of a shared machine touches both sides of a round alike, where timing all of
    float32 before all of bfloat16 once put one row's ratio at 0.84x and 1.09x on the same machine."""
    d, ff = max(int(d), 8), max(int(ff), 8)
    gen = torch.Generator().manual_seed(0)
    count = max(1, min(8, -(-CACHE_BYTES // (4 * d * ff))))
    weights = [torch.randn(ff, d, generator=gen) for _ in range(count)]
    by_dtype = {dtype: [w.to(dtype) for w in weights] for dtype in (torch.float32, torch.bfloat16)}

    def seconds(x: torch.Tensor, ws: list[torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for w in ws:
            torch.nn.functional.linear(x, w)
        return time.perf_counter() - t0

    out = {}
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, d, generator=gen)
            xs = {dtype: x.to(dtype) for dtype in by_dtype}
            for dtype, ws in by_dtype.items():                   # warm-up: first calls pay one-time costs
                seconds(xs[dtype], ws)
            ratios = []
            for i in range(repeats):
                order = (torch.float32, torch.bfloat16) if i % 2 == 0 else (torch.bfloat16, torch.float32)
                t = {dtype: seconds(xs[dtype], by_dtype[dtype]) for dtype in order}
                ratios.append(t[torch.float32] / max(t[torch.bfloat16], 1e-9))
            out[r] = sorted(ratios)[len(ratios) // 2]
    return out
