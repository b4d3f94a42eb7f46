"""Sessions a user can trust, through streamlit.testing.v1.AppTest: a session belongs to the browser that made it,
another browser opens it read-only and edits a copy, a share link opens a snapshot that never changes, a capture
asks before it replaces a session's capture, 'New session' starts one, and LAYERSCOPE_TOKEN closes the server.

Uses the tiny capture of tests/ui/test_app.py (one per module); each test opens its own copy of that session.
"""

from __future__ import annotations

import re

import pytest

from layerscope.errors import SessionError
from layerscope.session import storage
from layerscope.session.model import owner_hash
from layerscope.ui.access import OWNER_KEY
from tests.ui.test_app import captured, copy_of, manager, new_app, no_exception, plain, settle, sid, start_tiny_capture  # noqa: F401

SETS, SESSIONS, CKA = "app_pages/layer_sets.py", "app_pages/sessions.py", "app_pages/cka.py"


def archive_bytes(store, session_id: str) -> bytes:
    return (store.path("sessions", session_id) / storage.ARCHIVE_NAME).read_bytes()


def owner_of(at) -> str:
    return owner_hash(at.session_state[OWNER_KEY])


def add_set(at, layers: list[int]) -> None:
    at.switch_page(SETS).run()
    settle(at)
    at.multiselect(key="ls_sets_manual").set_value(layers).run()
    at.multiselect(key="ls_sets_to_add").set_value([f"hand-picked {layers}"]).run()
    at.button(key="ls_sets_add").click().run()
    no_exception(at)


def test_another_browser_opens_a_session_read_only_and_its_changes_go_into_its_own_copy(app_store, copy_of):
    first = new_app(copy_of).run()
    first.switch_page(SESSIONS).run()
    first.text_input(key="ls_w_sess_name").set_value("A's look").run()
    first.button(key="ls_sess_save").click().run()
    before = archive_bytes(app_store, copy_of)
    assert not any("Read-only" in i.value for i in first.info)

    other = new_app(copy_of, browser="someone else").run()           # the URL ?session=<A's id> in B's browser
    no_exception(other)
    assert any("Read-only: someone else's session" in i.value for i in other.info)
    assert other.query_params["session"] == copy_of and sid(other) != copy_of
    assert "A's look" not in " ".join(str(x) for x in other.switch_page(SESSIONS).run().dataframe[0].value["name"]) \
        if other.dataframe else True                                  # B's list does not hold A's session
    add_set(other, [1, 2])                                            # B edits: a copy of B's own is saved
    copy_id = sid(other)
    assert archive_bytes(app_store, copy_of) == before                # A's session is untouched
    mine = storage.load(app_store, copy_id)
    assert mine.origin == copy_of and mine.owner == owner_of(other) and mine.name == "A's look (copy)"
    assert [x["layers"] for x in mine.layer_sets] == [[1, 2]]
    assert other.query_params["session"] == copy_id
    assert not any("Read-only" in i.value for i in other.info)
    # B's Sessions page lists B's copy only, and cannot delete A's session
    other.switch_page(SESSIONS).run()
    assert list(other.dataframe[0].value["id"]) == [copy_id]
    with pytest.raises(SessionError, match="not yours"):
        storage.delete(app_store, copy_of, owner=owner_of(other))
    assert archive_bytes(app_store, copy_of) == before
    # A still owns and edits it
    first.switch_page(SESSIONS).run()
    assert copy_of in list(first.dataframe[0].value["id"]) and copy_id not in list(first.dataframe[0].value["id"])
    add_set(first, [2, 3])
    assert [x["layers"] for x in storage.load(app_store, copy_of).layer_sets] == [[2, 3]]


def test_make_my_copy_forks_and_the_original_stays(app_store, copy_of):
    before = archive_bytes(app_store, copy_of)
    other = new_app(copy_of, browser="someone else").run()
    other.button(key="ls_make_copy").click().run()
    no_exception(other)
    copy_id = sid(other)
    assert copy_id != copy_of and storage.load(app_store, copy_id).owner == owner_of(other)
    assert other.query_params["session"] == copy_id and archive_bytes(app_store, copy_of) == before


def test_a_share_link_opens_a_snapshot_that_later_changes_do_not_touch(app_store, copy_of):
    at = new_app(copy_of).run()
    add_set(at, [1, 2])
    at.switch_page(SESSIONS).run()
    at.button(key="ls_sess_share").click().run()
    no_exception(at)
    link = next(c.value for c in at.code if "?session=" in c.value)
    snap = re.search(r"\?session=([0-9a-f]{12})", link).group(1)
    assert snap != copy_of
    add_set(at, [2, 3])                                               # the owner goes on working
    assert sorted(x["layers"] for x in storage.load(app_store, copy_of).layer_sets) == [[1, 2], [2, 3]]
    for browser in ("someone else", "tester"):                        # a snapshot is read-only even to its owner
        viewer = new_app(snap, browser=browser).run()
        viewer.switch_page(CKA).run()
        no_exception(viewer)
        assert [x["layers"] for x in viewer.session_state["ls_session"].layer_sets] == [[1, 2]]
        assert any("Read-only" in i.value for i in viewer.info)
        add_set(viewer, [1, 3])
        assert [x["layers"] for x in storage.load(app_store, snap).layer_sets] == [[1, 2]]


def test_a_capture_asks_before_it_replaces_a_session_capture_and_can_start_a_new_session(app_store, copy_of):
    at = new_app(copy_of).run()
    add_set(at, [1, 2])
    start_tiny_capture(at, limit=2, new_tokens=4, batch=2)
    before = archive_bytes(app_store, copy_of)          # with the Capture page's choices, saved as they were made
    no_exception(at)
    assert manager().latest(copy_of, "capture") is None, "nothing starts before the user answers"
    asked = " ".join(plain(w.value) for w in at.warning)
    assert "already has its capture" in asked and "1 layer set" in asked, asked
    at.button(key="ls_cap_new_session").click().run()
    settle(at)
    no_exception(at)
    fresh = at.session_state["ls_session"]
    assert fresh.id != copy_of and fresh.capture_key and fresh.layer_sets == []
    assert at.query_params["session"] == fresh.id and fresh.owner == owner_of(at)
    assert archive_bytes(app_store, copy_of) == before               # the old session kept its capture and set
    # Cancel asks nothing more and starts nothing
    start_tiny_capture(at, limit=3, new_tokens=6, batch=2)
    at.button(key="ls_cap_cancel").click().run()
    assert manager().latest(fresh.id, "capture").view().state == "done" and not at.warning


def test_new_session_starts_an_empty_one_and_keeps_the_old(app_store, copy_of):
    at = new_app(copy_of).run()
    before = archive_bytes(app_store, copy_of)
    at.sidebar.button(key="ls_new_session").click().run()
    no_exception(at)
    s = at.session_state["ls_session"]
    assert s.id != copy_of and not s.capture_key and at.query_params["session"] == s.id
    assert archive_bytes(app_store, copy_of) == before


def test_the_server_token_is_asked_before_anything(app_store, copy_of, monkeypatch):
    monkeypatch.setenv("LAYERSCOPE_TOKEN", "open sesame")
    at = new_app(copy_of).run()
    no_exception(at)
    assert [t.value for t in at.title] == ["LayerScope"] and "ls_session" not in at.session_state
    at.text_input(key="ls_access_token").input("guess")
    at.button[0].click().run()
    assert any("not this server's access token" in plain(e.value) for e in at.error)
    assert "ls_session" not in at.session_state
    at.text_input(key="ls_access_token").input("open sesame")
    at.button[0].click().run()
    no_exception(at)
    assert sid(at) == copy_of and not at.error
