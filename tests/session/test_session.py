"""Sessions: round trips through the store and the shareable archive; broken or foreign files are refused."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import zipfile

import pytest
import torch
from safetensors.torch import save as save_tensors

from layerscope.draft.checkpoint import load_draft, save_draft
from layerscope.errors import SessionError
from layerscope.session import share, storage
from layerscope.session.archive import MAX_ARCHIVE_BYTES, PLAIN_FORMAT
from layerscope.session.model import Session, owner_hash
from layerscope.store import Store
from tests.helpers import untrained_draft


def _full_session() -> Session:
    n = 5
    s = Session(model="tiny-llama", prompt_set="builtin", capture_key="ab" * 12,
                capture={"num_layers": n, "tokens": 321, "conversations": 6, "hidden_size": 64})
    s.set_stats({
        "entropy": [0.5 + 0.1 * i for i in range(n + 1)],
        "entropy_normalized": [0.1 * i for i in range(n + 1)],
        "cka": torch.eye(n + 1).tolist(),
        "cka_debiased": (torch.eye(n + 1) * 0.9).tolist(),
        "tokens_total": 321, "tokens_kept": 200, "outliers_dropped": 3, "threshold": 0.5,
        "compartments": [[0, 2], [3, 5]], "options": {"alpha": 1.0, "min_entropy": 0.5},
    })
    s.add_layer_set("default", [2, 2, 3], strategy="default")
    s.add_layer_set("mine", [4, 1], strategy="manual")
    s.manual_picks = [1, 4]
    s.drafts.append({"name": "d1", "path": "/tmp/drafts/x", "layers": [1, 2, 3], "val_accuracy": [0.5, 0.3]})
    s.bench_results.append({"name": "d1", "tau": 1.7, "acceptance_by_position": [0.5, 0.2]})
    return s


def test_archive_round_trip_keeps_everything():
    s = _full_session()
    back = Session.from_bytes(s.to_bytes())
    assert back.to_json() == s.to_json()
    assert set(back.arrays) == {"entropy", "entropy_normalized", "cka", "cka_debiased"}
    for k, v in s.arrays.items():
        assert torch.equal(back.arrays[k], v)
    d = back.stats_dict()
    assert d["tokens_kept"] == 200 and d["cka"][2][2] == 1.0 and len(d["entropy"]) == 6
    assert back.layer_sets == [{"name": "default", "layers": [2, 3], "strategy": "default"},
                               {"name": "mine", "layers": [1, 4], "strategy": "manual"}]


def test_archive_holds_only_json_and_safetensors():
    z = zipfile.ZipFile(io.BytesIO(_full_session().to_bytes()))
    assert sorted(z.namelist()) == ["arrays.safetensors", "session.json"]
    doc = json.loads(z.read("session.json"))
    assert doc["layerscope_session"] == PLAIN_FORMAT == 1      # no drafts inside: readable by older versions


def test_store_save_load_list_delete(store):
    s = _full_session()
    path = storage.save(s, store, name="  first look ")
    assert path == store.path("sessions", s.id) / "session.zip" and path.is_file()
    assert not list(path.parent.glob("*.tmp"))
    back = storage.load(store, s.id)
    assert back.name == "first look" and back.to_json() == s.to_json()
    other = Session(model="smollm2-135m", owner=owner_hash("this browser"))
    storage.save(other, store)
    listed = storage.list_sessions(store)
    assert {r["id"] for r in listed} == {s.id, other.id}
    named = storage.list_sessions(store, include_unnamed=False)
    assert [r["id"] for r in named] == [s.id]
    assert named[0]["layer_sets"] == [[2, 3], [1, 4]] and named[0]["tokens"] == 321
    storage.delete(store, other.id, owner=owner_hash("this browser"))
    assert not storage.exists(store, other.id)
    with pytest.raises(SessionError, match="No saved session"):
        storage.load(store, other.id)


def test_ids_from_links_are_checked(store):
    for bad in ["../../etc", "ABCDEF012345", "123", "", None]:
        with pytest.raises(SessionError, match="not a session id"):
            storage.load(store, bad)
    with pytest.raises(SessionError):
        storage.save(Session(id="../x"), store)


def test_import_keeps_id_or_renames_on_clash(store):
    s = _full_session()
    data = share.export_bytes(s)
    imported = share.import_bytes(data, store)
    assert imported.id == s.id and storage.exists(store, s.id)
    again = share.import_bytes(data, store)        # the same content: same id
    assert again.id == s.id
    s.notes = "changed"
    clash = share.import_bytes(share.export_bytes(s), store)
    assert clash.id != s.id and storage.load(store, clash.id).notes == "changed"
    assert storage.load(store, s.id).notes == ""


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _doc(**changes) -> bytes:
    body = _full_session().to_json()
    body.update(changes)
    return json.dumps({"layerscope_session": 1, "session": body}).encode()


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"\x89PNG\r\n\x1a\n....", "not a zip archive"),
    (b'{"session": {}}', "JSON file"),
    (pickle.dumps({"id": "0" * 12}), "not a zip archive"),
    (_zip({"data.pkl": pickle.dumps([1, 2])}), "no session.json"),
    (_zip({"session.json": b"{not json"}), "not valid JSON"),
    (_zip({"session.json": b"\xff\xfe\x00"}), "not UTF-8"),
    (_zip({"session.json": json.dumps({"hello": 1}).encode()}), "marker"),
    (_zip({"session.json": _doc(), "evil.py": b"print(1)"}), "unexpected files"),
    (_zip({"session.json": _doc(id="../../x")}), "session id"),
    (_zip({"session.json": _doc(layer_sets=[{"name": "x", "layers": [1, 99]}])}), "distinct layers in 0..5"),
    (_zip({"session.json": _doc(layer_sets=[{"name": "x", "layers": [1, 1]}])}), "distinct layers"),
    (_zip({"session.json": _doc(manual_picks=["1"])}), "manual_picks"),
    (_zip({"session.json": _doc(surprise=1)}), "unknown fields"),
    (_zip({"session.json": _doc(capture="nope")}), "'capture' must be an object"),
    (_zip({"session.json": _doc(), "arrays.safetensors": b"garbage"}), "not a valid safetensors"),
    (_zip({"session.json": _doc(), "arrays.safetensors": save_tensors({"cka": torch.ones(3, 3)})}), "must be 6×6"),
    (_zip({"session.json": _doc(), "arrays.safetensors": save_tensors({"entropy": torch.tensor([float("nan")] * 6)})}),
     "NaN"),
    (_zip({"session.json": _doc(), "arrays.safetensors": save_tensors({"weights": torch.ones(2)})}), "unexpected tensor"),
    (_zip({"session.json": _doc(), "arrays.safetensors": save_tensors({"entropy": torch.arange(6)})}), "floating point"),
])
def test_broken_and_foreign_files_are_refused(data, message):
    with pytest.raises(SessionError, match=message) as e:
        Session.from_bytes(data, source="upload.zip")
    assert "upload.zip" in str(e.value)
    assert e.value.fix    # always says what to do


def test_newer_format_says_update():
    data = _zip({"session.json": json.dumps({"layerscope_session": 99, "session": {}}).encode()})
    with pytest.raises(SessionError, match="newer LayerScope"):
        Session.from_bytes(data)


def test_truncated_archive_is_refused():
    data = _full_session().to_bytes()
    with pytest.raises(SessionError):
        Session.from_bytes(data[: len(data) // 2])


def test_a_broken_stored_session_is_listed_with_its_error(store):
    s = _full_session()
    path = storage.save(s, store)
    path.write_bytes(b"broken")
    rows = storage.list_sessions(store)
    assert rows[0]["id"] == s.id and "not a zip archive" in rows[0]["error"]
    with pytest.raises(SessionError):
        storage.load(store, s.id)


def test_layer_sets_are_deduplicated_and_checked():
    s = Session()
    s.add_layer_set("a", [3, 1])
    s.add_layer_set("b", [1, 3], strategy="greedy")   # same layers: renamed, not duplicated
    assert s.layer_sets == [{"name": "b", "layers": [1, 3], "strategy": "greedy"}]
    with pytest.raises(SessionError):
        s.add_layer_set("empty", [])
    s.remove_layer_set([3, 1])
    assert s.layer_sets == []


def test_nan_statistics_do_not_break_saving():
    s = Session()
    s.set_stats({"entropy": [1.0, 2.0], "cka": [[1.0, 0.5], [0.5, 1.0]], "threshold": float("nan")})
    back = Session.from_bytes(s.to_bytes())
    assert back.stats["threshold"] is None


# ---------------------------------------------------------------------------- the whole-session schema

def _with(**changes) -> bytes:
    """The full session's archive (with its tensors) with some JSON fields replaced."""
    z = zipfile.ZipFile(io.BytesIO(_full_session().to_bytes()))
    doc = _doc(**changes).replace(b"12345678.5", b"1e400")      # JSON that parses to infinity
    return _zip({"session.json": doc, "arrays.safetensors": z.read("arrays.safetensors")})


@pytest.mark.parametrize("changes, message", [
    ({"id": "0123456789ab\n"}, "session id"),                              # ids match in full
    ({"capture_key": "ab" * 12 + "\n"}, "capture key"),
    ({"capture_key": "abcdef12"}, "capture key"),                           # a prefix is not a key
    ({"capture": {"num_layers": 5, "tokens": "many"}}, "capture.tokens must be an integer"),
    ({"capture": {"num_layers": 5, "tokens": 12345678.5}}, "capture.tokens must be an integer"),
    ({"capture": {"num_layers": 5, "conversations": -1}}, "capture.conversations must be an integer in 0"),
    ({"name": "two\nlines"}, "name must be 1..120 characters"),
    ({"notes": "x" * 100_001}, "notes must be a string of at most 100000"),
    ({"model": "m" * 5000}, "model must be a string of at most 4096"),
    ({"analysis_options": {"alpha": -1.0}}, "alpha must be >= 0"),
    ({"analysis_options": {"alpha": 12345678.5}}, "alpha must be a finite number"),
    ({"analysis_options": {"min_entropy": "0.5"}}, "min_entropy must be a finite number"),
    ({"analysis_options": {"evil": 1}}, "analysis_options has unknown fields"),
    ({"analysis_options": {"kernel": "rbf"}}, "kernel must be one of"),
    ({"stats": {"threshold": "high"}}, "stats.threshold must be a finite number"),
    ({"stats": {"tokens_kept": 2.5}}, "stats.tokens_kept must be an integer"),
    ({"stats": {"compartments": [[0, 99]]}}, "compartments must be"),
    ({"stats": {"num_layers": 7}}, "stats.num_layers is 7"),
    ({"view": {"entropy_scale": "<img src=x>"}}, "view.entropy_scale must be one of"),
    ({"view": {"cka_compartments": "3"}}, "view.cka_compartments must be an integer"),
    ({"view": {"surprise": 1}}, None),                                      # unknown view choices are plain JSON: kept
    ({"bench_results": [{"results": [{"name": "d", "tau": "fast"}]}]}, "results[0].tau must be a finite number"),
    ({"bench_results": [{"results": [{"tau": 1.0}]}]}, "results[0].name is missing"),
    ({"bench_results": [{"prompts": "8"}]}, "bench_results[0].prompts must be an integer"),
    ({"study": [{"prompts": 4}]}, "study[0].rows is missing"),
    ({"study": [{"prompts": 4, "rows": [{"layers": [1], "strategies": ["a"], "draft": "d", "mean_entropy": 1,
                                         "mean_cka": "x", "aggregate_entropy": 1}]}]}, "mean_cka must be a finite"),
    ({"drafts": [{"path": "p", "layers": [1], "val_accuracy": "good"}]}, "val_accuracy must be"),
    ({"layer_sets": [{"name": "x", "layers": [1]}] * 1001}, "at most 1000 items"),
    ({"bench_results": [{"extra": {"deep": [[[[[[[[[[[[[[1]]]]]]]]]]]]]]}}]}, "not plain JSON"),
])
def test_every_field_a_page_reads_is_checked(changes, message):
    if message is None:
        assert Session.from_bytes(_with(**changes)).view == changes["view"]
        return
    with pytest.raises(SessionError, match=re.escape(message)):
        Session.from_bytes(_with(**changes), source="upload.zip")


def test_user_text_round_trips_exactly():
    name = "[click](http://evil.example) ![x](http://evil.example/p.png) <b>**bold**</b> $x$"
    s = _full_session()
    s.name = name
    s.add_layer_set(name, [1, 2])
    back = Session.from_bytes(s.to_bytes())
    assert back.name == name and back.layer_sets[-1]["name"] == name


def test_same_limits_on_save_as_on_import(store):
    s = _full_session()
    storage.save(s, store)
    s.notes = "x" * 100_001
    with pytest.raises(SessionError, match="notes must be a string"):
        storage.save(s, store)
    s.notes = ""
    s.bench_results = [{"results": [{"name": "d", "tau": float("inf")}]}]   # JSON would write null: loads again
    storage.save(s, store)
    s.bench_results = [{"prompts": "eight"}]
    with pytest.raises(SessionError, match="prompts must be an integer"):
        storage.save(s, store)
    with pytest.raises(SessionError, match="one line"):
        storage.save(s, store, name="a\nb")
    assert storage.load(store, s.id).bench_results == [{"results": [{"name": "d", "tau": None}]}]


def test_imported_sessions_always_open_again(store):
    for changes in ({}, {"name": "x" * 120}, {"notes": "n" * 100_000}, {"view": {"cka_estimator": "debiased"}}):
        s = share.import_bytes(_with(**changes), store)
        assert storage.load(store, s.id).to_json() == s.to_json()


def test_stats_without_a_capture_must_agree_and_give_num_layers():
    s = Session()
    s.set_stats({"entropy": [1.0, 2.0, 3.0], "cka": torch.eye(3).tolist()})
    back = Session.from_bytes(s.to_bytes())
    assert back.stats_dict()["num_layers"] == 2                # the pages read it; the tensors say it
    s.arrays["cka"] = torch.eye(4)
    with pytest.raises(SessionError, match="disagree on the number of layers"):
        Session.from_bytes(s.to_bytes())


def test_oversized_archive_and_special_files_are_refused(store, tmp_path):
    with pytest.raises(SessionError, match="larger than"):
        Session.from_bytes(b"PK" + b"\0" * (MAX_ARCHIVE_BYTES + 1))
    s = _full_session()
    path = storage.save(s, store)
    path.unlink()
    os.mkfifo(path)                                            # reading it would block forever
    with pytest.raises(SessionError, match="No saved session"):      # at once, not blocked on the pipe
        storage.load(store, s.id)
    assert storage.list_sessions(store) == []
    path.unlink()
    (tmp_path / "elsewhere.zip").write_bytes(_full_session().to_bytes())
    path.symlink_to(tmp_path / "elsewhere.zip")                 # a file outside the store, behind a link
    with pytest.raises(SessionError, match="not a regular file"):
        storage.load(store, s.id)
    with pytest.raises(SessionError, match="is not a session id"):
        storage.load(store, s.id + "\n")


# ---------------------------------------------------------------------------- archives with drafts (issue 16)

def _draft_logits(head, tiny, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny.model.config.vocab_size, (2, 7), generator=g)
    aux = torch.randn(2, 7, len(head.aux_layers) * tiny.hidden_size, generator=g)
    with torch.no_grad():
        return head(ids, head.fuse(aux), torch.arange(7).expand(2, 7))


@pytest.fixture
def session_with_drafts(tiny, store):
    """A session naming two drafts in `store` (one of them twice) and one this server does not hold."""
    meta = {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec}
    a = save_draft(store.path("drafts", "a" * 24), untrained_draft(tiny.model, layers=(1, 2, 3)), meta, target=tiny)
    b = save_draft(store.path("drafts", "b" * 24), untrained_draft(tiny.model, layers=(1, 3), seed=2), meta, target=tiny)
    s = _full_session()
    s.drafts = [{"name": "three", "path": str(a), "layers": [1, 2, 3]}, {"name": "two", "path": str(b), "layers": [1, 3]},
                {"name": "again", "path": str(a), "layers": [1, 2, 3]},
                {"name": "gone", "path": "/nowhere/drafts/x", "layers": [1, 2]}]
    return s


def test_archive_with_drafts_round_trips_into_another_store(tiny, store, tmp_path, session_with_drafts):
    s = session_with_drafts
    assert share.missing_drafts(s) == ["/nowhere/drafts/x"]
    data = share.export_bytes(s, drafts=True)
    z = zipfile.ZipFile(io.BytesIO(data))
    doc = json.loads(z.read("session.json"))
    assert doc["layerscope_session"] == 2 and [d["entry"] for d in doc["drafts"]] == ["a" * 24, "b" * 24]
    assert f"drafts/{'a' * 24}/model.safetensors" in z.namelist()
    other = Store(tmp_path / "other-store")
    try:
        imported = share.import_archive(data, other, source="shared.zip")
        new = imported.session
        assert imported.drafts == [str(other.path("drafts", "a" * 24)), str(other.path("drafts", "b" * 24))]
        assert [d["path"] for d in new.drafts] == [imported.drafts[0], imported.drafts[1], imported.drafts[0],
                                                  "/nowhere/drafts/x"]      # the one not exported stays a reference
        assert storage.load(other, new.id).drafts == new.drafts
        for before, after in zip(s.drafts[:2], new.drafts[:2]):
            h0, h1 = load_draft(before["path"], tiny), load_draft(after["path"], tiny)
            (a, ha), (b, hb) = _draft_logits(h0, tiny), _draft_logits(h1, tiny)
            assert torch.equal(a, b) and torch.equal(ha, hb)
        assert not list((tmp_path / "other-store" / "drafts").glob(".*"))      # no staging left behind
        again = share.import_archive(data, other)              # the same drafts: reused, the same session
        assert again.session.id == new.id and again.drafts == imported.drafts
        (other.path("drafts", "b" * 24) / "layerscope.json").write_text("{}")  # another draft under that name
        third = share.import_archive(data, other)
        assert third.drafts[1].startswith(str(other.path("drafts", "b" * 24)) + "-")
        renamed = load_draft(third.drafts[1], tiny)                # draft b, imported under a new name
        assert list(renamed.aux_layers) == [1, 3]
        (a, ha), (b, hb) = _draft_logits(load_draft(s.drafts[1]["path"], tiny), tiny), _draft_logits(renamed, tiny)
        assert torch.equal(a, b) and torch.equal(ha, hb)
    finally:
        other.close()


def _with_member(data: bytes, name: str, payload: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
        z.writestr(name, payload)
    return buf.getvalue()


@pytest.mark.parametrize("member", ["../../evil.py", "drafts/../../evil/config.json", "/etc/cron.d/x",
                                    "drafts/..\\..\\evil.json"])
def test_a_member_outside_the_archive_is_refused_and_nothing_is_written(tiny, store, tmp_path, member,
                                                                         session_with_drafts):
    data = _with_member(share.export_bytes(session_with_drafts, drafts=True), member, b"x")
    other = Store(tmp_path / "other-store")
    try:
        with pytest.raises(SessionError) as e:
            share.import_archive(data, other, source="shared.zip")
        line = str(e.value)
        assert "points outside the archive's folder" in line and "shared.zip" in line and "\n" not in line
        assert not (tmp_path / "other-store" / "drafts").exists() and storage.list_sessions(other) == []
        assert not list(tmp_path.rglob("evil*"))
    finally:
        other.close()


def test_damaged_or_inconsistent_drafts_are_refused_whole(tiny, store, tmp_path, session_with_drafts):
    data = share.export_bytes(session_with_drafts, drafts=True)
    z = zipfile.ZipFile(io.BytesIO(data))
    members = {n: z.read(n) for n in z.namelist()}
    doc = json.loads(members["session.json"])
    model_b = f"drafts/{'b' * 24}/model.safetensors"

    def variant(**changes):
        m = dict(members)
        m.update(changes)
        return _zip(m)

    broken_doc = json.loads(json.dumps(doc))
    broken_doc["drafts"][1]["files"]["model.safetensors"]["sha256"] = "0" * 64
    garbage = b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}"
    regarbled = json.loads(json.dumps(doc))
    regarbled["drafts"][1]["files"]["model.safetensors"] = {"bytes": len(garbage),
                                                            "sha256": hashlib.sha256(garbage).hexdigest()}
    plain = json.loads(json.dumps(doc))
    plain["layerscope_session"] = 1
    cases = [
        (variant(**{"session.json": json.dumps(broken_doc).encode()}), "does not match its size and checksum"),
        (variant(**{"session.json": json.dumps(regarbled).encode(), model_b: garbage}), "does not load"),
        (variant(**{f"drafts/{'b' * 24}/notes.txt": b"hi"}), "unexpected files"),
        (variant(**{"session.json": json.dumps(plain).encode()}), "not format 2"),
        (variant(**{f"drafts/{'c' * 24}/config.json": b"{}"}), "differ"),
    ]
    other = Store(tmp_path / "other-store")
    try:
        for archive, message in cases:
            with pytest.raises(SessionError, match=message):
                share.import_archive(archive, other, source="shared.zip")
            drafts = tmp_path / "other-store" / "drafts"
            assert not drafts.exists() or not [p for p in drafts.iterdir() if not p.name.startswith(".")], message
        assert storage.list_sessions(other) == []
    finally:
        other.close()


def test_archives_without_drafts_import_as_before(store, tmp_path):
    s = _full_session()
    old = _zip({"session.json": json.dumps({"layerscope_session": 1, "session": s.to_json()}).encode(),
                "arrays.safetensors": zipfile.ZipFile(io.BytesIO(s.to_bytes())).read("arrays.safetensors")})
    other = Store(tmp_path / "other-store")
    try:
        imported = share.import_archive(old, other)
        assert imported.drafts == [] and imported.session.drafts == s.drafts       # paths kept as references
        assert storage.load(other, s.id).to_json() == s.to_json()
        plain = share.export_bytes(s)                   # drafts not asked for: format 1, the store's bytes
        assert json.loads(zipfile.ZipFile(io.BytesIO(plain)).read("session.json"))["layerscope_session"] == 1
    finally:
        other.close()


# ---------------------------------------------------------------------------- owners and snapshots

def test_only_the_owner_saves_over_or_deletes_a_session_and_a_snapshot_never_changes(store):
    mine, theirs = owner_hash("browser A"), owner_hash("browser B")
    s = _full_session()
    s.owner = mine
    storage.save(s, store, name="A's look")
    stolen = storage.load(store, s.id)
    stolen.owner, stolen.notes = theirs, "overwritten"
    with pytest.raises(SessionError, match="someone else"):
        storage.save(stolen, store)
    with pytest.raises(SessionError, match="not yours to delete"):
        storage.delete(store, s.id, owner=theirs)
    with pytest.raises(SessionError, match="not yours to delete"):
        storage.delete(store, s.id, owner=None)
    assert storage.load(store, s.id).notes == "" and storage.load(store, s.id).editable_by(mine)
    assert not storage.load(store, s.id).editable_by(theirs)
    assert [r["id"] for r in storage.list_sessions(store, owner=theirs)] == []

    snap = storage.snapshot(s, store)
    assert snap.id != s.id and snap.frozen and snap.origin == s.id
    s.layer_sets = []
    storage.save(s, store)                                # the owner goes on working: the snapshot stays
    kept = storage.load(store, snap.id)
    assert [x["layers"] for x in kept.layer_sets] == [[2, 3], [1, 4]] and not kept.editable_by(mine)
    kept.notes = "changed"
    with pytest.raises(SessionError, match="shared snapshot"):
        storage.save(kept, store)
    with pytest.raises(SessionError, match="not yours to delete"):
        storage.delete(store, snap.id, owner=mine)
    assert [r["id"] for r in storage.list_sessions(store, owner=mine)] == [s.id]     # snapshots are not listed

    mine_copy = kept.copy(owner=theirs)                   # a fork copies: the snapshot is untouched
    storage.save(mine_copy, store)
    assert mine_copy.editable_by(theirs) and storage.load(store, snap.id).notes != "changed"
    storage.delete(store, s.id, owner=mine)
    assert not storage.exists(store, s.id) and storage.exists(store, snap.id)


def test_an_import_is_named_apart_from_its_original_and_owned_by_the_importer(store):
    s = _full_session()
    s.name, s.owner = "first look", owner_hash("browser A")
    storage.save(s, store)
    me = owner_hash("browser B")
    imported = share.import_bytes(share.export_bytes(s), store, owner=me)
    assert imported.id != s.id and imported.name == "first look (imported)" and imported.owner == me
    assert storage.load(store, s.id).name == "first look"
    again = share.import_bytes(share.export_bytes(imported), Store(store.root / "other"), owner=me)
    assert again.name == "first look (imported)"              # once, not twice
    assert share.imported_name("x" * 120).endswith(" (imported)") and len(share.imported_name("x" * 120)) == 120


# ---------------------------------------------------------------------------- several writers

def test_two_writers_of_one_session_keep_both_changes(store):
    """Two tabs (or servers) read one session; each changes it and saves. The second save merges: each side's
    additions, removals and view choices stay, a field both changed is the later save's, and the tab that saved
    second now holds the merged session. A third save with nothing new in between is a plain save."""
    s = _full_session()
    s.owner = owner_hash("browser A")
    storage.save(s, store, name="shared")
    a, b = storage.load(store, s.id), storage.load(store, s.id)
    a.add_layer_set("a's", [0, 4])
    a.view["cka_estimator"] = "debiased"
    a.drafts.append({"name": "d2", "path": "/tmp/drafts/y", "layers": [0, 4]})
    a.name = "renamed in a"
    storage.save(a, store)
    b.remove_layer_set([2, 3])
    b.view["entropy_scale"] = "normalized"
    b.bench_results.append({"name": "d2", "tau": 1.2})
    b.notes = "b's notes"
    b.name = "renamed in b"
    storage.save(b, store)
    back = storage.load(store, s.id)
    assert [x["layers"] for x in back.layer_sets] == [[1, 4], [0, 4]]
    assert back.view == {"cka_estimator": "debiased", "entropy_scale": "normalized"}
    assert [d["path"] for d in back.drafts] == ["/tmp/drafts/x", "/tmp/drafts/y"]
    assert [r["name"] for r in back.bench_results] == ["d1", "d2"] and back.notes == "b's notes"
    assert back.name == "renamed in b" and back.capture_key == s.capture_key and back.has_stats
    assert b.to_json() == back.to_json()                     # the second tab shows what is stored
    b.manual_picks = [2]
    storage.save(b, store)
    assert storage.load(store, s.id).manual_picks == [2] and storage.load(store, s.id).layer_sets == back.layer_sets


def test_a_merge_keeps_the_shown_runs_pointing_at_the_same_runs(store):
    """Both tabs add a benchmark run and show their own (view.bench_run = its position). After the merge the other
    tab's run comes first, so the second saver's run moved: its view follows it, as does the first saver's
    stored choice, and the Compare page's list of runs. A run removed on one side leaves no position to it."""
    s = _full_session()
    s.owner = owner_hash("browser A")
    storage.save(s, store)                                   # bench_results: [d1]
    a, b = storage.load(store, s.id), storage.load(store, s.id)
    a.bench_results.append({"name": "from a", "tau": 1.1})
    a.view["bench_run"] = 1
    storage.save(a, store)
    b.bench_results.append({"name": "from b", "tau": 1.3})
    b.view["bench_run"] = 1
    b.view["cmp_bench_runs"] = [1, 0]
    storage.save(b, store)
    back = storage.load(store, s.id)
    assert [r["name"] for r in back.bench_results] == ["d1", "from a", "from b"]
    assert back.view["bench_run"] == 2 and back.bench_results[back.view["bench_run"]]["name"] == "from b"
    assert back.view["cmp_bench_runs"] == [2, 0]
    # a shows its own run; b removes it meanwhile: a's saved choice points at no run, so it is dropped
    a = storage.load(store, s.id)
    a.view["bench_run"] = 1
    b.bench_results = [r for r in b.bench_results if r["name"] != "from a"]
    b.view["bench_run"], b.view["cmp_bench_runs"] = 1, [1, 0]
    storage.save(b, store)
    a.notes = "a's notes"
    storage.save(a, store)
    back = storage.load(store, s.id)
    assert [r["name"] for r in back.bench_results] == ["d1", "from b"] and "bench_run" not in back.view
    assert back.view["cmp_bench_runs"] == [1, 0] and back.notes == "a's notes"     # b's, unchanged in a


def test_a_change_that_no_longer_fits_the_other_writers_session_is_refused_and_the_stored_one_stays(store):
    s = _full_session()
    s.owner = owner_hash("browser A")
    storage.save(s, store)
    a, b = storage.load(store, s.id), storage.load(store, s.id)
    a.capture_key, a.capture = "cd" * 12, {"num_layers": 3, "tokens": 50, "conversations": 2, "hidden_size": 64}
    a.set_stats({"entropy": [0.5, 0.6, 0.7, 0.8], "cka": torch.eye(4).tolist(), "tokens_total": 50, "tokens_kept": 40})
    a.layer_sets, a.manual_picks = [{"name": "default", "layers": [1, 2], "strategy": "default"}], []
    storage.save(a, store)                                   # a new capture of 3 layers: layers 3 and 4 are gone
    b.add_layer_set("deep", [3, 4])
    with pytest.raises(storage.SessionConflict, match="changed elsewhere") as e:
        storage.save(b, store)
    assert "\n" not in str(e.value) and "reload the page" in e.value.fix
    kept = storage.load(store, s.id)
    assert kept.capture_key == "cd" * 12 and [x["layers"] for x in kept.layer_sets] == [[1, 2]]
