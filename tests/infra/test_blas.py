"""The matrix library's code path: set when LayerScope is imported, the user's choice kept, carried on every
machine line and in a cost curve's store key (a curve measured under another path is never reused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import torch

from layerscope import blas, quietness
from layerscope.decoding import costmodel

PROBE = ("import json, os, subprocess, sys, layerscope; "
         "child = subprocess.run([sys.executable, '-c', 'import layerscope; print(layerscope.blas.describe())'], "
         "capture_output=True, text=True, check=True).stdout.strip(); "
         "print(json.dumps({'env': os.environ.get('MKL_CBWR'), 'describe': layerscope.blas.describe(), "
         "'child': child}))")


def _run(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", blas.ENV, blas._SET_BY_US)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_importing_layerscope_sets_the_measured_path_and_children_inherit_it():
    got = _run()
    assert got == {"env": blas.CHOICE, "describe": f"MKL_CBWR={blas.CHOICE}", "child": f"MKL_CBWR={blas.CHOICE}"}


def test_a_users_own_setting_is_kept_and_said_to_be_theirs():
    got = _run(MKL_CBWR="COMPATIBLE")
    assert got == {"env": "COMPATIBLE", "describe": "MKL_CBWR=COMPATIBLE (yours)",
                   "child": "MKL_CBWR=COMPATIBLE (yours)"}


def test_layerscope_blas_default_leaves_mkl_alone():
    got = _run(LAYERSCOPE_BLAS="default")
    assert got == {"env": None, "describe": "MKL default", "child": "MKL default"}


def test_the_machine_line_and_json_carry_the_path_and_old_states_read_without_it():
    s = quietness.classify(0.01, 0.01, 0.5, 2, 2, 1.0)
    assert s.blas == blas.describe()
    assert blas.describe() in quietness.line(s)
    back = quietness.MachineState.from_json(s.to_json())
    assert back.blas == s.blas
    old = {k: v for k, v in s.to_json().items() if k != "blas"}
    assert quietness.MachineState.from_json(old).blas == ""
    assert "MKL" not in quietness.details(quietness.MachineState.from_json(old))


class _Loaded:
    fingerprint = "f" * 24
    device = "cpu"
    dtype = "torch.float32"
    model = types.SimpleNamespace(dtype=torch.float32)      # float32: no row alignment (specdec.row_alignment)


def test_a_cost_curve_measured_under_another_path_has_another_key(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.setenv(blas._SET_BY_US, "AUTO")
    ours = costmodel.curve_key(_Loaded())
    monkeypatch.delenv("MKL_CBWR")
    default = costmodel.curve_key(_Loaded())
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.delenv(blas._SET_BY_US)
    yours = costmodel.curve_key(_Loaded())
    assert ours == yours != default
