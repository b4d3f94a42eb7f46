"""Capture across processes: torchrun with 2 gloo ranks on this CPU gives the one-process capture, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from layerscope.capture.run import capture
from layerscope.capture.stored import open_capture
from layerscope.distributed import shard
from layerscope.prompts.sets import load_prompts
from layerscope.store import Store

OPTIONS = dict(limit=7, max_new_tokens=8, batch_size=2)     # 4 batches, the last one short: 2 per rank


def test_shards_are_contiguous_ranges_covering_every_batch():
    for n in range(0, 12):
        for world in (1, 2, 3, 5):
            parts = [shard(list(range(n)), r, world) for r in range(world)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="torchrun missing")
def test_two_process_capture_equals_one_process_capture(tiny, tmp_path, one_thread):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "layerscope", "capture", "--model", "tiny-llama",
           "--prompts", "builtin", "--limit", "7", "--max-new-tokens", "8", "--batch-size", "2",
           "--store", str(tmp_path / "two"), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert run.returncode == 0, run.stderr[-3000:]
    printed = json.loads(run.stdout)                      # one JSON document: only rank 0 prints
    one = Store(tmp_path / "one")
    result = capture(tiny, load_prompts("builtin", limit=7, seed=0), one, **OPTIONS)
    assert printed["key"] == result.key and printed["tokens"] == result.tokens and not printed["cached"]
    a, b = one.path("captures", result.key), tmp_path / "two" / "captures" / result.key
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len([n for n in names if n.startswith("chunk")]) == 4
    for name in names:
        if name.startswith("chunk"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    timing = {"seconds", "created"}
    assert {k: v for k, v in ma.items() if k not in timing} == {k: v for k, v in mb.items() if k not in timing}
    two = Store(tmp_path / "two")
    assert open_capture(two, result.key).num_tokens == result.tokens
    two.close()
    one.close()
