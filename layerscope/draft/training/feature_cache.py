"""Online training's target features, kept for the epochs after the first.

Online training runs the target over every batch of conversations (draft/training/online.py). Over a budget of several
epochs the same conversations come back, and the target's forward is most of a step's time (on a 2-core CPU the 1.5B
prefills ~108 tokens a second in bfloat16, where its one-layer draft trains several times faster). So the features
a conversation's first forward gives are written to the run's folder, and later epochs read them instead:

    runs/<key>/features/<conversation index, 7 digits>.safetensors     {"L<l>": [n, d]} for each layer the sets read
                                                                        and N (post-norm), n = the conversation's tokens

in the dtype that forward stored them in (capture.format.state_dtype: float16, or bfloat16 where float16 overflows).
Each file is written whole or not at all (store.atomic_write_bytes); one that cannot be read, is larger than the
conversation's features can be (never read into memory), or whose layers or shapes are not the conversation's, counts
as missing and is computed again. The folder goes when the run finishes; a stopped run's counts in the store's size
limit (LAYERSCOPE_STORE_LIMIT) and is evicted, least recently written first, like the store's entries (Store.evict).

A conversation's features then come from the batch it was first forwarded in, where without the cache each epoch
forwards it again among other conversations (a padded batch can round a row differently, in 16-bit floats most):
differences of rounding, not of data. A run resumed from a checkpoint reads the same files, so it still ends with the
drafts of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from layerscope.store import RUN_CACHE, StoreWriteError, atomic_write_bytes

FOLDER = RUN_CACHE                   # the store evicts a stopped run's (Store.evict)
BYTES_PER_VALUE = 2                 # float16 or bfloat16
HEADER_MAX = 2**16                  # bytes a kept file's safetensors header may take (a few tensors: a few hundred)
FREE_AFTER = 2 * 2**30              # bytes the disk keeps free with the cache at its fullest
FIRST_EPOCH = "the budget ends within the first epoch: no feature would be read back"


def cache_bytes(tokens: int, layers: int, hidden: int) -> int:
    """Bytes the cache of `tokens` training tokens holds when full: `layers` feature rows of `hidden` values each."""
    return tokens * layers * hidden * BYTES_PER_VALUE


def room(need: int, free: int) -> str | None:
    """None when a cache of `need` bytes fits in `free` bytes of disk with FREE_AFTER to spare, else why not (a line)."""
    if free - need >= FREE_AFTER:
        return None
    return (f"the target's features of the training conversations need {need / 2**30:.1f} GiB more and the store's disk "
            f"has {free / 2**30:.1f} GiB free (keeping {FREE_AFTER / 2**30:.0f} GiB): the target runs for what is not kept")


class FeatureCache:
    """The features of a run's training conversations, one file each, in `folder`. `layers`: the layers kept (the
    sets' union and N). Counts what this process read and wrote; `off` says why it writes nothing more (no room on the
    disk, a failed write): what it keeps is still read."""

    def __init__(self, folder: Path, layers: list[int]):
        self.folder, self.layers = Path(folder), sorted(layers)
        self.read = self.written = 0
        self.off: str | None = None

    def _path(self, index: int) -> Path:
        return self.folder / f"{index:07d}.safetensors"

    def get(self, index: int, tokens: int, hidden: int) -> dict[int, torch.Tensor] | None:
        """Conversation `index`'s features {l: [tokens, hidden]}, or None when none are kept (or the file is not whole
        and right: it is removed, and the caller computes them again)."""
        path = self._path(index)
        try:
            if path.stat().st_size > cache_bytes(tokens, len(self.layers), hidden) + 8 + HEADER_MAX:
                _drop(path)                                 # never read more than the conversation's features
                return None
            data = load(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, SafetensorError):
            _drop(path)
            return None
        want = {f"L{l}" for l in self.layers}
        if set(data) != want or any(t.shape != (tokens, hidden) or t.dtype not in (torch.float16, torch.bfloat16)
                                    for t in data.values()):
            _drop(path)
            return None
        self.read += 1
        return {l: data[f"L{l}"] for l in self.layers}

    def put(self, index: int, feats: dict[int, torch.Tensor]) -> None:
        """Keep conversation `index`'s features {l: [n, d]} (a copy of each; the caller's batch stays as it is). A
        write that fails (a full disk) stops the writing for the rest of the run: the target runs for what is not kept."""
        if self.off is not None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self._path(index), save({f"L{l}": feats[l].contiguous() for l in self.layers}))
        except (OSError, StoreWriteError) as e:
            self.off = f"a feature file could not be written ({str(e)[:200]}): the target runs again from here on"
            return
        self.written += 1

    def summary(self) -> dict:
        """What this process did with the cache, for the run's result."""
        return {"read": self.read, "written": self.written, "off": self.off}


def _drop(path: Path) -> None:
    """A kept file that is not whole or not this run's, gone where it can be (else it is read and dropped again)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def remove(run_dir: Path) -> None:
    """The run's cache, gone (the run is finished: its drafts are stored)."""
    shutil.rmtree(Path(run_dir) / FOLDER, ignore_errors=True)
