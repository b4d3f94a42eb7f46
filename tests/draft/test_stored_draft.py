"""A draft directory an earlier LayerScope wrote still loads, with its layers and its tensors.

tests/fixtures/draft-tiny-llama-1-2-3/ was written once, by the code before issue 22 split
layerscope/draft/export.py into modules, and is never rewritten by the tests:

    tiny = load_model("tiny-llama")
    head = untrained_draft(tiny.model, (1, 2, 3))                    # tests/helpers.py
    save_draft(FIXTURE, head, {"target_model": "tiny-llama", "target_fingerprint": tiny.fingerprint,
                               "layers": [1, 2, 3]}, target=tiny)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from layerscope.draft.checkpoint import load_draft, read_meta
from layerscope.draft.engines import target_facts
from layerscope.draft.export.check import check_draft
from tests.helpers import untrained_draft

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "draft-tiny-llama-1-2-3"


def test_a_draft_saved_by_earlier_code_loads_with_its_layers_and_tensors(tiny):
    head = load_draft(FIXTURE)
    assert head.aux_layers == [1, 2, 3] and read_meta(FIXTURE)["layers"] == [1, 2, 3]
    stored = load_file(str(FIXTURE / "model.safetensors"))
    state = head.state_dict()
    assert set(state) == set(stored)
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in stored.items())
    # the tensors are the ones the head had when it was saved
    saved = untrained_draft(tiny.model, (1, 2, 3)).state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in stored)


def test_a_draft_saved_by_earlier_code_fits_its_target_and_every_engine_reads_its_layers(tiny):
    assert load_draft(FIXTURE, tiny).aux_layers == [1, 2, 3]
    report = check_draft(FIXTURE, target_facts(tiny))
    assert report["ok"], report["problems"]
    assert all(row["reads"] == [1, 2, 3] for row in report["rows"] if row["checked"])
