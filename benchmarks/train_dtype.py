"""One training step of an EAGLE-3 draft for a large target, float32 against bfloat16 autocast (--train-dtype).

The draft is shaped for Qwen2.5-Coder 1.5B (d=1536, 12 heads, 2 KV heads, layers [2, 14, 25], draft vocabulary
8192) with an MLP --ff wide; random weights and data: the step's cost does not depend on their values. A step is
the fit loop's work: the TTT unroll (3 steps) over --batch x --rows rows, the loss on the draft vocabulary, backward,
AdamW. Prints ms per step and rows per second for each dtype, alternating (after one warm-up step each), so both are
measured in the same quiet window. Run it alone on the machine.

    .venv/bin/python benchmarks/train_dtype.py --ff 1024

On a 2-core Xeon with AMX (2026-12-05, quiet): MLP 1024 wide, 3.28 s float32 vs 1.46 s bf16 (2.2x); 8960 wide
(the target's), 7.70 s vs 2.68 s (2.9x). The full width costs 1.8x the narrow one in bf16.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from layerscope.draft.model import DraftConfig, DraftHead

QWEN15 = SimpleNamespace(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         intermediate_size=8960, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                         max_position_embeddings=32768, num_hidden_layers=28, rope_scaling=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ff", type=int, default=1024, help="the draft's MLP width (the target's: 8960)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rows", type=int, default=384)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per dtype and round")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    V, vocab, d = 8192, QWEN15.vocab_size, QWEN15.hidden_size
    config = DraftConfig.from_target(QWEN15, [2, 14, 25], V, fc_norm=True, intermediate_size=a.ff)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:V] = True
    head = DraftHead(config, torch.randn(vocab, d) * 0.02, torch.zeros(V, dtype=torch.long), t2d)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    B, T = a.batch, a.rows
    aux = torch.randn(B, T, 3 * d)
    ids = [torch.randint(0, vocab, (B, T)) for _ in range(3)]
    pos = torch.arange(T).expand(B, T)
    want = torch.randint(0, V, (B * T,))

    def step(bf16: bool) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outs = head.unroll(ids, head.fuse(aux), pos, with_logits=False)
            loss = sum(F.cross_entropy(head.lm_head(head.norm(h)).float().flatten(0, 1), want) for _, h in outs)
        loss.backward()
        opt.step()

    print(f"draft MLP {a.ff} wide, {sum(p.numel() for p in params) / 1e6:.1f}M trained parameters, "
          f"{B} x {T} rows, {torch.get_num_threads()} threads")
    for _ in range(a.rounds):
        for bf16 in (False, True):
            step(bf16)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(bf16)
            dt = (time.perf_counter() - t0) / a.steps
            print(f"  {'bfloat16 autocast' if bf16 else 'float32':17s} {dt * 1000:6.0f} ms/step  {B * T / dt:6.0f} rows/s",
                  flush=True)


if __name__ == "__main__":
    main()
