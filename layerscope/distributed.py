"""Several processes with torch.distributed: `torchrun --nproc-per-node N -m layerscope ...`.

torchrun starts N copies of the command with RANK / WORLD_SIZE / LOCAL_RANK set. `init()` (called by
`python -m layerscope` before anything loads a model) joins the process group: NCCL with one GPU per process
(cuda:LOCAL_RANK) when CUDA is present, else gloo on the CPU. What then runs across the ranks uses the
helpers here (rank, world, shard, agree):

    capture          every rank writes its contiguous range of the batches (layerscope/capture/run.py)
    online training  every rank forwards its share of a step's conversations, gradients summed over
                     the ranks (layerscope/draft/training/online.py, layerscope/draft/training/fit.py)

This module knows none of them: it only imports torch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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
