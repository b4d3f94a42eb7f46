"""Checkpoints of an online run (draft/training/online.py): the same command resumes from the newest one.

    runs/<key>/ckpt-<step:09d>/state.json           fit.FitState (step, tokens, data cursor, curves, elapsed
                                                    seconds, ...), each set's optimizer param_groups, FORMAT
    runs/<key>/ckpt-<step:09d>/tensors.safetensors  rng: torch's RNG state; head<i>.<name>: draft i's weights;
                                                    opt<i>.<param>.<name>: its AdamW moments and step
Each is put in place whole (a temporary folder, then one rename: store.staged) and replaces the older ones; the
run removes them all once its drafts are stored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from layerscope import jsonsafe
from layerscope.draft.training.fit import FitState
from layerscope.errors import DraftError
from layerscope.store import staged

FORMAT = 2                              # of an online run, in its key (online.run_key) and every checkpoint;
                                        # 2: trained by the one loop (draft/training/fit.py)


def save_checkpoint(run_dir: Path, state: FitState, drafters: list) -> Path:
    """runs/<key>/ckpt-<step>/ {state.json, tensors.safetensors}, put in place whole (store.staged); older ones removed."""
    tensors = {"rng": torch.get_rng_state()}
    groups = []
    for i, d in enumerate(drafters):
        for name, t in d.head.state_dict().items():
            tensors[f"head{i}.{name}"] = t.detach().cpu().clone()     # the heads share d2t/t2d: one copy each
        sd = d.opt.state_dict()
        groups.append(sd["param_groups"])
        for p, st in sd["state"].items():
            for name, t in st.items():
                tensors[f"opt{i}.{p}.{name}"] = t.detach().cpu().reshape(-1) if t.dim() == 0 else t.detach().cpu()
    final = run_dir / f"ckpt-{state.step:09d}"
    if final.is_dir():
        return final
    with staged(final) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
        (tmp / "state.json").write_text(json.dumps({**state.to_json(), "param_groups": groups, "format": FORMAT},
                                                   default=float))
        for f in tmp.iterdir():
            f.chmod(0o644)                  # like every file of the store (mkdtemp and safetensors make them private)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        tmp.chmod(0o755)
    for old in complete_checkpoints(run_dir)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """ckpt-<step> folders, oldest first (temporary folders start with a dot and are never listed)."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.is_dir() and re.fullmatch(r"ckpt-\d{9}", p.name)
                  and (p / "state.json").is_file() and (p / "tensors.safetensors").is_file())


def load_checkpoint(path: Path, drafters: list) -> FitState:
    """The state saved in `path`; the drafters' heads, optimizers and torch's RNG are restored from it."""
    state = jsonsafe.loads((path / "state.json").read_bytes(), what=f"Checkpoint state {path / 'state.json'}",
                           error=DraftError)
    with safe_open(str(path / "tensors.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert len(state["param_groups"]) == len(drafters), "checkpoint holds another number of layer sets"
    for i, d in enumerate(drafters):
        sd = d.head.state_dict()
        missing = [k for k in sd if f"head{i}.{k}" not in t]
        assert not missing, f"checkpoint {path} lacks {missing[:3]}"
        d.head.load_state_dict({k: t[f"head{i}.{k}"] for k in sd})
        opt_state = {}
        for k, v in t.items():
            parts = k.split(".")
            if parts[0] == f"opt{i}":
                opt_state.setdefault(int(parts[1]), {})[parts[2]] = v.reshape(()) if parts[2] == "step" else v
        d.opt.load_state_dict({"state": opt_state, "param_groups": state["param_groups"][i]})
    torch.set_rng_state(t["rng"])
    return FitState.from_json(state)
