"""A session stored by an older LayerScope still loads, lists, saves and exports the same.

tests/fixtures/session_format1.zip was written by the single-module layerscope/session.py, before it was
split into the layerscope/session/ package (issue 22): a format 1 archive with every kind of field (a
capture summary, analysis options, a statistics snapshot with all its tensors, layer sets, picks, a
draft reference, benchmark runs in both forms, a study, view choices) and a few fields newer code added.
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_tensors

from layerscope.session import share, storage
from layerscope.session.archive import PLAIN_FORMAT
from layerscope.session.model import Session
from layerscope.store import Store

FIXTURE = Path(__file__).parents[1] / "fixtures" / "session_format1.zip"
SID = "0123456789ab"


def _members(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    z = zipfile.ZipFile(io.BytesIO(data))
    return json.loads(z.read("session.json")), load_tensors(z.read("arrays.safetensors"))


@pytest.fixture
def stored(store):
    """The fixture planted in `store` as a saved session."""
    path = store.path("sessions", SID) / storage.ARCHIVE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURE, path)
    return store


def test_the_old_archive_reads_and_writes_back_the_same():
    data = FIXTURE.read_bytes()
    doc, tensors = _members(data)
    s = Session.from_bytes(data, source="session_format1.zip")
    assert doc["layerscope_session"] == PLAIN_FORMAT
    assert s.to_json() == doc["session"]
    assert set(s.arrays) == set(tensors) and all(torch.equal(s.arrays[k], t) for k, t in tensors.items())
    again, again_tensors = _members(s.to_bytes())
    assert again == doc                                        # the same session.json, format marker included
    assert all(torch.equal(again_tensors[k], t) for k, t in tensors.items())
    assert s.stats_dict()["num_layers"] == 4 and s.has_stats and s.num_layers == 4


def test_the_old_stored_session_loads_lists_and_saves_again(stored):
    doc, _ = _members(FIXTURE.read_bytes())
    s = storage.load(stored, SID)
    assert s.to_json() == doc["session"]
    [row] = storage.list_sessions(stored, include_unnamed=False)
    assert row["id"] == SID and row["name"] == "stored before the split" and "error" not in row
    assert row["layer_sets"] == [[1, 2, 3], [0, 3], [2, 4]] and row["benchmarks"] == 2 and row["drafts"] == 1
    storage.save(s, stored, touch=False)
    assert storage.load(stored, SID).to_json() == doc["session"]


def test_the_old_archive_imports_into_another_store(store, tmp_path):
    other = Store(tmp_path / "other-store")
    try:
        imported = share.import_archive(FIXTURE.read_bytes(), other, source="session_format1.zip")
        assert imported.drafts == [] and imported.session.id == SID
        original = _members(FIXTURE.read_bytes())[0]["session"]          # an import is named apart from its original
        assert storage.load(other, SID).to_json() == original | {"name": f"{original['name']} (imported)"}
        assert share.export_bytes(imported.session) and share.missing_drafts(imported.session) == [
            "/elsewhere/drafts/abc"]
    finally:
        other.close()
