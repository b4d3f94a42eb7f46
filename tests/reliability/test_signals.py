"""SIGTERM (a scheduler's stop, `kill`, `timeout`) stops a command the way Ctrl-C does: real `layerscope` processes
on the tiny model are sent SIGTERM mid-run. Each exits promptly with one `error:` line (exit 2, no traceback),
leaves nothing half-written in the store, and the same command run again resumes: a capture from its chunks (and
ends equal to an uninterrupted capture), online training from the checkpoint the stop saved (and ends with the
drafts of an uninterrupted run), a benchmark starts cleanly (it keeps nothing half-way)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from layerscope.capture.format import read_header
from layerscope.capture.run import CaptureOptions, capture, capture_key
from layerscope.capture.stored import list_captures, open_capture, partial_capture_dir, verify_capture
from layerscope.draft.checkpoint import save_draft
from layerscope.draft.training.checkpoints import complete_checkpoints
from layerscope.prompts.sets import load_prompts
from layerscope.store import Store
from tests.helpers import untrained_draft

ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def start(args: list[str], err: Path) -> subprocess.Popen:
    with open(err, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "layerscope.commands.cli", *args], stdout=subprocess.PIPE, stderr=f,
                                text=True, env=ENV)


def wait_for(cond, proc: subprocess.Popen, err: Path, timeout: float = 300.0) -> None:
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, f"it ended (exit {proc.returncode}) before the signal:\n{err.read_text()[-3000:]}"
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.02)


def terminated(proc: subprocess.Popen, err: Path) -> str:
    """SIGTERM `proc`; it must end within a minute with exit 2 and one `error:` line (returned), no traceback."""
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    text = err.read_text()
    lines = [x for x in text.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in text, (proc.returncode, text[-3000:])
    return lines[0]


def run(args: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "layerscope.commands.cli", *args], capture_output=True, text=True, env=ENV,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def temporaries(root: Path) -> list[Path]:
    """Temporary files and staging folders: what a write cut short would leave."""
    return [p for p in root.rglob("*") if p.name.endswith(".tmp") or p.name == ".layerscope-staging"]


CAPTURE = ["capture", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--batch-size", "1",
           "--max-new-tokens", "4", "--json"]


def test_sigterm_during_capture_keeps_its_chunks_and_the_rerun_resumes_to_the_same_capture(tmp_path, tiny, one_thread):
    store = Store(tmp_path / "store")
    options = CaptureOptions(limit=12, batch_size=1, max_new_tokens=4)
    key = capture_key(tiny, load_prompts("builtin", limit=12), options)
    partial = partial_capture_dir(store, key)
    proc = start([*CAPTURE, "--store", str(store.root)], tmp_path / "err")
    wait_for(lambda: len(list(partial.glob("chunk-*.safetensors"))) >= 2, proc, tmp_path / "err")
    line = terminated(proc, tmp_path / "err")
    assert "SIGTERM" in line and "run the same command again" in line.lower()
    assert list_captures(store) == [] and not temporaries(store.root)      # nothing listed, nothing half-written
    kept = {p.name: p.stat().st_ino for p in partial.glob("chunk-*.safetensors")}
    assert 2 <= len(kept) < 12 and sorted(p.name for p in partial.iterdir()) == sorted(kept)
    for name in kept:
        read_header(partial / name)                                         # each a whole chunk

    out = run([*CAPTURE, "--store", str(store.root)])
    assert out["key"] == key and not out["cached"]
    assert verify_capture(store, key) == []
    cap = open_capture(store, key)
    assert {name: (cap.path / name).stat().st_ino for name in kept} == kept     # resumed: the chunks were kept
    ref = Store(tmp_path / "reference")
    ref_cap = open_capture(ref, capture(tiny, load_prompts("builtin", limit=12), ref, **vars(options)).key)
    assert [(c["start"], c["end"], c["tokens"]) for c in cap.manifest["chunks"]] == \
        [(c["start"], c["end"], c["tokens"]) for c in ref_cap.manifest["chunks"]]
    for name in ("token_id", "is_response", "conversation", "position"):
        assert torch.equal(cap.tokens()[name], ref_cap.tokens()[name])
    assert torch.allclose(cap.layer(4), ref_cap.layer(4), atol=1e-2)
    store.close(), ref.close()


TRAIN = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10",
         "--layers", "1,3", "--steps", "300", "--batch-size", "3", "--seq-len", "64", "--draft-vocab", "64",
         "--val-conversations", "2", "--eval-points", "2", "--checkpoint-every", "10h", "--threads", "1", "--json"]


def test_sigterm_during_online_training_saves_a_checkpoint_and_the_rerun_resumes_from_it(tmp_path):
    root = tmp_path / "store"
    err = tmp_path / "err"
    proc = start([*TRAIN, "--store", str(root)], err)
    wait_for(lambda: "step=3" in err.read_text(), proc, err)        # training, with no checkpoint yet (every 10 h)
    line = terminated(proc, err)
    assert "Training stopped at step" in line and "run the same command again to continue" in line
    [run_dir] = list((root / "runs").iterdir())
    [ckpt] = complete_checkpoints(run_dir)                           # the stop saved one, whole
    step = json.loads((ckpt / "state.json").read_text())["step"]
    assert 3 <= step < 300 and load_file(str(ckpt / "tensors.safetensors"))
    assert not temporaries(root) and not (root / "drafts").exists()

    resumed = run([*TRAIN, "--store", str(root)])
    assert resumed["resumed"] and not resumed["cached"]
    history = json.loads((Path(resumed["drafts"][0]["path"]) / "layerscope.json").read_text())["history"]
    assert [r["step"] for r in history["resumed_at"]] == [step]       # it went on from that checkpoint
    whole = run([*TRAIN, "--store", str(tmp_path / "uninterrupted")])
    a, b = (load_file(str(Path(d["drafts"][0]["path"]) / "model.safetensors")) for d in (resumed, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["drafts"][0]["val_accuracy"] == whole["drafts"][0]["val_accuracy"]


def test_sigterm_during_bench_is_one_line_and_the_rerun_starts_cleanly(tmp_path, tiny):
    draft = save_draft(tmp_path / "draft", untrained_draft(tiny.model, (1, 2)), {"target_model": "tiny-llama"},
                       target=tiny)
    root, saved, err = tmp_path / "store", tmp_path / "out" / "bench.json", tmp_path / "err"
    saved.parent.mkdir()
    args = ["bench", "--model", "tiny-llama", "--draft", str(draft), "--prompts", "builtin", "--limit", "8",
            "--max-new-tokens", "48", "--k", "3", "--no-peers", "--store", str(root), "--save-json", str(saved), "--json"]
    proc = start(args, err)
    wait_for(lambda: "prompt=" in err.read_text(), proc, err)        # decoding the prompts
    line = terminated(proc, err)
    assert "SIGTERM" in line and "`bench` keeps nothing of an unfinished run, so it starts over" in line
    assert not saved.exists() and not temporaries(root) and not temporaries(saved.parent)
    out = run(args)
    assert out["prompts"] == 8 and json.loads(saved.read_text())["prompts"] == 8
