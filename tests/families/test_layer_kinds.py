"""Each layer's kind (attention, sliding, linear attention, SSM, conv), recorded by a capture and marked on the
per-layer curves.

A capture records what each decoder layer mixes tokens with in its manifest (`layer_kinds`, capture.run.layer_kinds),
so the app marks them without loading the model; a capture made before they were recorded shows none. The kinds of
every family of tests/families/test_families.py's matrix are read from tiny random models of it (built, never run); one hybrid
goes through capture and analyze, and its entropy curve and CKA heatmap carry the kinds.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerscope.capture import format as capture_format
from layerscope.capture.run import layer_kinds
from layerscope.commands.cli import main
from layerscope.errors import StoreError
from layerscope.ui import plots
from tests.families.test_families import FAMILIES, SHAPE, model_dir

A, S, LIN, SSM, CONV = "attention", "sliding", "linear", "ssm", "conv"
# family -> its 8 layers' kinds at the matrix's size (tests/families/test_families.py)
EXPECTED = {
    "mistral": [S] * 8, "starcoder2": [S] * 8,
    "qwen2": [A] * 4 + [S] * 4,                                # use_sliding_window from max_window_layers = 4 on
    "gemma2": [S, A] * 4, "gemma3": [S, A] * 4, "cohere2": [S, A] * 4, "gpt_oss": [S, A] * 4,
    "exaone4": [S, S, S, A] * 2,
    "qwen3_next": [LIN, LIN, LIN, A] * 2, "qwen3_5": [LIN, LIN, LIN, A] * 2, "olmo_hybrid": [LIN, LIN, LIN, A] * 2,
    "granitemoehybrid": [SSM, A] * 4, "jamba": [SSM, A] * 4, "bamba": [SSM, A] * 4,
    "falcon_h1": ["ssm+attention"] * 8,                        # a Mamba-2 mixer beside attention in every layer
    "lfm2": [CONV, A] * 4,
}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(family: str):
    config_class, fields = FAMILIES[family]
    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config_class(**{**SHAPE, **fields, **ids})).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_capture_knows_each_layers_kind(family):
    assert layer_kinds(tiny(family)) == EXPECTED.get(family, [A] * 8)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, one_thread):
    """A Jamba (Mamba and attention alternating) captured and analyzed through the command line: (capture
    directory, statistics)."""
    root = tmp_path_factory.mktemp("kinds")
    model = model_dir(root / "models", "jamba")
    store = ["--store", str(root / "store")]

    def run(*args) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([str(a) for a in args] + store + ["--json"]) == 0
        return json.loads(out.getvalue())

    key = run("capture", "--model", model, "--prompts", "builtin", "--limit", 2, "--max-new-tokens", 4)["key"]
    return root / "store" / "captures" / key, run("analyze", key)


def test_the_manifest_records_the_kinds_and_the_figures_carry_them(hybrid):
    path, stats = hybrid
    manifest = capture_format.read_manifest(path)
    assert manifest["layer_kinds"] == [SSM, A] * 4
    kinds = capture_format.capture_state_kinds(path, num_layers=8)
    assert kinds == ["embedding"] + [SSM, A] * 4

    fig = plots.entropy_curve({"entropy": stats["entropy"]}, sets={"picked": [1, 4, 6]}, kinds=kinds)
    legend = [t.name for t in fig.data if (t.meta or {}).get("layer_kind")]
    assert legend == ["layer kind: attention", "layer kind: SSM"]
    bands = [shape for shape in fig.layout.shapes if shape.name and shape.name.startswith("kind ")]
    assert [(b.x0 + 0.5, b.fillcolor) for b in bands] == [(l, plots.KIND_COLORS[kinds[l]]) for l in range(1, 9)]
    curve = fig.data[0]
    assert curve.customdata[1] == "1 · SSM" and curve.customdata[2] == "2 · attention"
    assert curve.customdata[0] == "0 (embeddings)"                  # the embedding output has no kind
    assert fig.data[1].customdata[0][0] == "1 · SSM"                # the set's markers say which kind they read

    heat = plots.cka_heatmap(stats["cka"], sets={"picked": [1, 4, 6]}, kinds=kinds)
    assert [t.name for t in heat.data if (t.meta or {}).get("layer_kind")] == legend
    assert heat.data[0].customdata[1][2] == ["1 · SSM", "2 · attention"]
    assert plots.KIND_COLORS[SSM] in heat.layout.xaxis.ticktext[1] and plots.KIND_COLORS[A] in heat.layout.yaxis.ticktext[2]
    assert len(heat.layout.xaxis.ticktext) == len(heat.layout.xaxis.tickvals)


def test_an_older_capture_shows_no_kinds(hybrid, tmp_path):
    path, stats = hybrid
    manifest = capture_format.read_manifest(path)
    older = copy.deepcopy(manifest)
    del older["layer_kinds"]
    capture_format.validate_manifest(older, manifest["key"])         # still a valid capture
    assert capture_format.state_kinds(older) is None
    assert capture_format.capture_state_kinds(tmp_path / "nowhere") is None
    assert capture_format.capture_state_kinds(path, num_layers=12) is None     # not this figure's depth
    for fig in (plots.entropy_curve({"entropy": stats["entropy"]}), plots.cka_heatmap(stats["cka"])):
        assert not [t for t in fig.data if (t.meta or {}).get("layer_kind")]
        assert not [s for s in fig.layout.shapes if s.name and s.name.startswith("kind ")]
    for bad in ([SSM] * 7, [SSM] * 7 + [3], "ssm"):
        with pytest.raises(StoreError, match="layer_kinds"):
            capture_format.validate_manifest({**manifest, "layer_kinds": bad}, manifest["key"])
    uniform = ["embedding"] + [A] * 8                                # one kind: in the hover, no colors
    fig = plots.entropy_curve({"entropy": stats["entropy"]}, kinds=uniform)
    assert fig.data[0].customdata[3] == "3 · attention" and len(fig.data) == 1 and not fig.layout.shapes
    heat = plots.cka_heatmap(stats["cka"], kinds=uniform)
    assert heat.data[0].customdata[0][3] == ["0 (embeddings)", "3 · attention"] and heat.layout.xaxis.ticktext is None
    with pytest.raises(ValueError, match="kinds"):
        plots.entropy_curve({"entropy": stats["entropy"]}, kinds=["embedding", A])
