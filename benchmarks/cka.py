"""Benchmark: all-pairs linear CKA, fast exact and low-rank, against a per-pair float64 reference.

    .venv/bin/python benchmarks/cka.py                      # synthetic: 31 layers × 8192 tokens × d=576
    .venv/bin/python benchmarks/cka.py --key KEY            # a stored capture (default analysis token filter)
    .venv/bin/python benchmarks/cka.py --pairs 0            # run the reference on every pair (slow on CPU)

The reference is the straightforward way: for each pair, prepare both layers and compute
‖XᵀY‖² / (‖XᵀX‖ ‖YᵀY‖) in float64. It is timed on a sample of pairs and extrapolated to all
L(L+1)/2 pairs (the output says so); the max difference is taken over the sampled pairs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerscope.capture.stored import open_capture
from layerscope.stats import cka as C  # noqa: E402
from layerscope.stats.entropy import prepare  # noqa: E402


def synthetic_layers(L: int, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    """L layers [n, d] float32: a shared latent signal (rank 64) drifting with depth, a decaying
    per-layer spectrum, isotropic noise. Neighbouring layers are similar, distant ones less so."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 64, generator=g)
    decay = torch.logspace(0, -1, 64)
    w = torch.randn(64, d, generator=g)
    out = []
    for _ in range(L):
        w = w + 0.35 * torch.randn(64, d, generator=g)
        own = torch.randn(n, 16, generator=g) @ torch.randn(16, d, generator=g) * 0.5
        out.append((latent * decay) @ w + own + 0.3 * torch.randn(n, d, generator=g))
    return out


def capture_layers(key: str, store_dir: str | None, max_tokens: int) -> list[torch.Tensor]:
    from layerscope.stats.analysis import AnalysisOptions, token_index
    from layerscope.store import Store

    cap = open_capture(Store(store_dir), key)
    index, report = token_index(cap, AnalysisOptions(max_tokens=max_tokens))
    print(f"capture {key}: {report['tokens_kept']} of {report['tokens_total']} tokens kept "
          f"({report['outliers_dropped']} outliers, {report['low_entropy_dropped']} low-entropy dropped)")
    return [cap.layer(l, index) for l in range(cap.num_layers + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--key", help="capture key (default: synthetic data)")
    ap.add_argument("--store", default=None)
    ap.add_argument("--layers", type=int, default=31)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--rank", type=int, default=64, help="rank of the low-rank mode")
    ap.add_argument("--pairs", type=int, default=8, help="reference pairs to time (0 = all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device(args.device)

    if args.key:
        layers = capture_layers(args.key, args.store, args.tokens)
    else:
        layers = synthetic_layers(args.layers, args.tokens, args.dim, args.seed)
    layers = [z.to(dev) for z in layers]
    L, (n, d) = len(layers), layers[0].shape
    pairs = [(i, j) for i in range(L) for j in range(i, L)]
    print(f"data: {L} layers × {n} tokens × d={d} on {dev} ({torch.get_num_threads()} CPU threads); "
          f"{len(pairs)} pairs incl. diagonal")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # fast exact: prepare once per layer, one pass per layer over token blocks
    sync()
    t0 = time.perf_counter()
    p = torch.stack([prepare(z).to(torch.float32) for z in layers], dim=1)
    sync()
    t_prep = time.perf_counter() - t0
    fast = C.cka_all_pairs(p, debiased=True)
    sync()
    t_fast = time.perf_counter() - t0
    print(f"fast all-pairs (biased + debiased, route {fast.route}): {t_fast:.2f} s "
          f"(prepare {t_prep:.2f} s); {2 * n * (L * d) ** 2 / 2 / 1e12:.2f} TFLOP in float32 GEMMs")

    # reference: per pair, float64, nothing shared
    g = torch.Generator().manual_seed(args.seed)
    sample = pairs if args.pairs <= 0 or args.pairs >= len(pairs) else \
        [pairs[i] for i in torch.randperm(len(pairs), generator=g)[:args.pairs].sort().values.tolist()]
    diff_b = diff_d = 0.0
    sync()
    t0 = time.perf_counter()
    for i, j in sample:
        ref = C.cka(layers[i], layers[j])
        diff_b = max(diff_b, abs(ref - float(fast.biased[i, j])))
    sync()
    t_ref = (time.perf_counter() - t0) / len(sample) * len(pairs)
    for i, j in sample[:4]:
        diff_d = max(diff_d, abs(C.cka(layers[i], layers[j], debiased=True) - float(fast.debiased[i, j])))
    how = "all pairs" if len(sample) == len(pairs) else f"timed on {len(sample)} sampled pairs, extrapolated to {len(pairs)}"
    print(f"reference per-pair float64 (biased): {t_ref:.2f} s ({how}); "
          f"{3 * 2 * n * d * d * len(pairs) / 1e12:.2f} TFLOP in float64 GEMMs")
    print(f"speed ratio reference / fast: {t_ref / t_fast:.1f}x")
    print(f"max |fast - reference|: biased {diff_b:.2e} over {len(sample)} pairs, "
          f"debiased {diff_d:.2e} over {min(4, len(sample))} pairs")

    # low rank: interactive mode with an error bound
    sync()
    t0 = time.perf_counter()
    low = C.cka_lowrank(p, args.rank)
    sync()
    t_low = time.perf_counter() - t0
    err = (low.biased - fast.biased).abs()
    off = ~torch.eye(L, dtype=torch.bool, device=err.device)
    print(f"low-rank r={args.rank}: {t_low:.2f} s (after prepare; {t_fast / t_low:.1f}x faster than exact); "
          f"max error {err.max():.2e}, stated bound max {low.bound[off].max():.2e} / mean {low.bound[off].mean():.2e}; "
          f"within bound: {bool((err <= low.bound + 1e-6).all())}")


if __name__ == "__main__":
    main()
