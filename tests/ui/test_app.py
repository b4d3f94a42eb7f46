"""Every page through streamlit.testing.v1.AppTest, on the tiny model and a tiny capture in a temporary store.

A capture runs once per module (3 builtin prompts, 6 new tokens); each test opens its own copy of
that session through the share link ``?session=ID``, so tests do not see each other's changes.
Jobs run in the app's worker process (LAYERSCOPE_WORKER=process, the default), as they do for users; `settle` reruns
the app until none is left running.
"""

from __future__ import annotations

import json
import re
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from layerscope import fmt
from layerscope import store as store_module
from layerscope.decoding import specdec
from layerscope.decoding.bench import auto_note
from layerscope.decoding.sanity import bench_warnings, study_warnings
from layerscope.session import share, storage
from layerscope.session.model import new_id
from layerscope.session.schema import valid_id
from layerscope.study.recommend import set_label
from layerscope.ui import speculate, tasks
from layerscope.ui.access import OWNER_KEY
from layerscope.ui.jobs import JobView, get_manager
from layerscope.ui.kernel import kernel_of
from layerscope.ui.picks import heatmap_picks, toggle_picks
from layerscope.ui.report import session_report
from layerscope.ui.widgets import display_frame, in_app_words, option_changes, text_key, time_left

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TIMEOUT = 120


def manager():
    return get_manager()


def new_app(session_id: str | None = None, *, browser: str = "tester") -> AppTest:
    """The app in a tab of `browser`: tabs of one browser share its owner token (its cookie, which AppTest cannot
    send, so it is put where the app keeps it), tabs of another browser do not."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.session_state[OWNER_KEY] = f"test-browser-{browser}".replace(" ", "-").ljust(40, "x")
    if session_id:
        at.query_params["session"] = session_id
    return at


def sid(at: AppTest) -> str:
    return at.session_state["ls_session"].id


def settle(at: AppTest, timeout: float = 300) -> AppTest:
    """Rerun until no job of this tab's session runs (a finished job may start the next one)."""
    deadline = time.time() + timeout
    while True:
        active = manager().active(sid(at))
        if not active:
            at.run()
            if not manager().active(sid(at)):
                return at
            continue
        if time.time() > deadline:
            raise AssertionError(f"jobs still running after {timeout} s: {[j.title for j in active]}")
        active[0].wait(0.5)


def plain(text: str) -> str:
    """Markdown-escaped text as the user reads it."""
    return re.sub(r"\\(.)", r"\1", text)


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def set_number(at: AppTest, key: str, value):
    """Type `value` into the number field whose number lives at `key` (widgets.number_field: a text box)."""
    return at.text_input(key=text_key(key)).set_value("" if value is None else str(value))


def number_shown(at: AppTest, key: str):
    """What the number field of `key` shows: an int when it reads as digits, else the text as it stands."""
    text = at.text_input(key=text_key(key)).value
    return int(text) if re.fullmatch(r"-?[0-9]+", text or "") else text


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def frame_with(at: AppTest, column: str):
    """The first table on the page with `column` (its values as shown: text in the one number form)."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def sidebar_text(at: AppTest) -> str:
    return "\n".join(m.value for m in at.sidebar.markdown)


def capture_with_model(spec: str) -> AppTest:
    """A new tab that starts a capture with model `spec` and runs until its job is over (no exception)."""
    at = new_app().run()
    at.switch_page("app_pages/capture.py").run()
    at.text_input(key="ls_w_cap_model").set_value(spec)
    at.run()
    at.button(key="ls_cap_start").click().run()
    settle(at)
    no_exception(at)
    return at


def start_tiny_capture(at, *, limit: int, new_tokens: int, batch: int, answer: str | None = None) -> None:
    """Open the Capture page, fill it for the tiny model and press Start; in a session that has a capture, then
    `answer` the question the page asks ("replace": in this session, "new_session": in a new one)."""
    at.switch_page("app_pages/capture.py").run()
    at.text_input(key="ls_w_cap_model").set_value("tiny-llama")
    set_number(at, "ls_w_cap_limit", limit)
    set_number(at, "ls_w_cap_new", new_tokens)
    set_number(at, "ls_w_cap_batch", batch)
    at.run()
    at.button(key="ls_cap_start").click().run()
    if answer:
        at.button(key=f"ls_cap_{answer}").click().run()


@pytest.fixture(scope="module")
def captured(app_store) -> str:
    """Session id of a session holding a finished tiny capture and its statistics."""
    at = new_app().run()
    start_tiny_capture(at, limit=3, new_tokens=6, batch=2)
    settle(at)
    no_exception(at)
    s = at.session_state["ls_session"]
    assert s.capture_key and s.has_stats, [e.value for e in at.error]
    return s.id


@pytest.fixture
def copy_of(app_store, captured):
    """A fresh copy of the captured session (its own id) to change freely."""
    base = storage.load(app_store, captured)
    base.id = new_id()
    storage.save(base, app_store)
    return base.id


def test_capture_page_shows_its_widgets_and_a_preview(app_store):
    at = new_app().run()
    no_exception(at)
    assert at.title[0].value == "LayerScope"             # the app opens on its Home page
    at.switch_page("app_pages/capture.py").run()
    assert at.title[0].value == "Capture hidden states"
    assert at.text_input(key="ls_w_cap_model").value == "smollm2-135m"
    assert at.radio(key="ls_w_cap_source").options == ["builtin", "sharegpt", "upload"]
    assert number_shown(at, "ls_w_cap_limit") == 16
    assert not at.button(key="ls_cap_start").disabled
    preview = at.dataframe[0].value
    assert len(preview) == 16 and set(preview.columns) == {"id", "category", "prompt"}
    set_number(at, "ls_w_cap_limit", 5).run()
    assert len(at.dataframe[0].value) == 5
    side = sidebar_text(at)
    assert "Device: cpu" in side or "Device: cuda" in side
    assert at.query_params["session"] == sid(at)       # a refresh comes back to this session


def test_capture_page_estimate_follows_its_options(app_store):
    """The storage estimate from the model's config, before any capture: it follows the options, and warns over a
    budget (which then reaches the capture job; an unreadable budget keeps Start off)."""
    at = new_app().run()
    at.switch_page("app_pages/capture.py").run()
    at.text_input(key="ls_w_cap_model").set_value("tiny-llama").run()
    shown = lambda: {m.label: m.value for m in at.metric}       # noqa: E731
    assert shown()["Per token"] == "785 B"                       # tiny-llama: 6 states x d=64 x 2 + 17
    first = shown()["Estimated size"]
    set_number(at, "ls_w_cap_new", 400).run()
    assert shown()["Estimated size"] != first and not at.warning
    at.text_input(key="ls_w_cap_budget").set_value("100k").run()
    assert any("Over the budget of 97.7 KiB" in w.value for w in at.warning)
    set_number(at, "ls_w_cap_sample", 4).run()     # 16 conversations x 4 positions: far below
    assert not at.warning and shown()["Estimated size"] == fmt.size(16 * 4 * 785 + 2 * (8 + 128 * 11))  # 2 chunk headers
    at.text_input(key="ls_w_cap_budget").set_value("lots").run()
    assert at.button(key="ls_cap_start").disabled and "not a size" in at.error[0].value
    at.text_input(key="ls_w_cap_budget").set_value("").run()
    said = [c.value.replace("\\", "") for c in at.caption]              # as read: markdown's escapes dropped
    said = [x for x in said if x.startswith("Estimate before the capture starts: ")]
    assert len(said) == 1 and "16 conversations, up to 400 answer tokens each" in said[0]     # by its start button
    no_exception(at)


def test_capture_run_fills_the_session_and_the_store(app_store, captured):
    at = new_app(captured).run()
    at.switch_page("app_pages/capture.py").run()
    no_exception(at)
    s = at.session_state["ls_session"]
    assert s.model == "tiny-llama" and s.prompt_set == "builtin"
    assert s.capture["num_layers"] == 4 and s.capture["tokens"] > 0
    assert len(s.arrays["cka"]) == 5
    assert "tokens · 3 prompts" in sidebar_text(at)
    table = at.dataframe[-1].value
    assert s.capture_key in list(table["key"])
    # the same capture again is served from the store
    start_tiny_capture(at, limit=3, new_tokens=6, batch=2, answer="replace")
    settle(at)
    assert any("served from the store" in c.value for c in at.caption)
    assert at.session_state["ls_session"].capture_key == s.capture_key


def test_a_bad_model_spec_is_an_error_message_not_a_traceback(app_store):
    at = capture_with_model("no-such-model")
    errors = [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]        # the text is Markdown-escaped: user text
    assert any("Unknown model spec 'no-such-model'" in e and "tiny-llama" in e for e in errors), errors
    assert "Traceback" not in "".join(errors)
    assert at.session_state["ls_session"].capture_key is None
    assert at.session_state["ls_session"].model is None          # a failed model name is not kept
    assert storage.load(app_store, sid(at)).model is None if storage.exists(app_store, sid(at)) else True


def test_a_capture_loading_its_model_leaves_the_page_usable(app_store):
    """Issue 51: while a capture loads its model (a first use de-quantizes it: seconds to minutes) it has no numbers
    yet; the Capture page once took that for "just finished" and reran itself at once, again and again, so the page
    never finished a run (greyed out in the browser until the job ended). A run must end, saying the model loads,
    and the result must show on a later run once the job is done."""
    at = new_app().run()
    at.switch_page("app_pages/capture.py").run()
    loaded = threading.Event()

    def slow_capture(job):
        """The page's capture job with a model load that lasts until the test says so."""
        job.update(None, "loading model tiny-llama (a first load de-quantizes the weights: up to a few minutes on a "
                         "small CPU)", eta_s=None)
        loaded.wait(120)
        return tasks.capture_job(model="tiny-llama", prompts="builtin", limit=2, max_new_tokens=4, batch_size=2, seed=0,
                                 store=app_store)(job)

    job = manager().submit(sid(at), "capture", slow_capture, title="Capture of tiny-llama")
    try:
        deadline = time.time() + 30
        while not job.view().message.startswith("loading model"):
            assert time.time() < deadline, f"the job did not start: {job.view().message}"
            time.sleep(0.05)
        at.run(timeout=30)            # the old page reran in a loop here: the run timed out
        no_exception(at)
        bars = [plain(p.proto.text) for p in at.get("progress")]
        assert any("loading model tiny-llama" in b and "elapsed" in b for b in bars), bars
        assert any("from the first batch" in c.value for c in at.caption)
        assert job.view().running, "the model was still loading while the page ran"
    finally:
        loaded.set()                  # the job goes on and ends (a looping old page then stops too)
        job.wait(120)
    assert job.view().finished_ok, job.view().error
    at.run()
    no_exception(at)
    key = job.view().result["key"]
    assert any(c.value.startswith(f"Capture `{key}`: ") for c in at.caption), [c.value for c in at.caption]
    assert at.session_state["ls_session"].capture_key == key


def test_a_bad_prompt_upload_is_an_error_message(app_store):
    at = new_app().run()
    at.switch_page("app_pages/capture.py").run()
    at.radio(key="ls_w_cap_source").set_value("upload").run()
    assert at.button(key="ls_cap_start").disabled
    at.file_uploader(key="ls_cap_upload").set_value(("prompts.txt", b"\n\n   \n", "text/plain"))
    at.run()
    no_exception(at)
    assert at.error, "an empty prompt file must be refused with a message"
    assert at.button(key="ls_cap_start").disabled, "no capture can start from a file that does not read"
    at.file_uploader(key="ls_cap_upload").set_value(("ok.txt", b"What is 2+2?\nName a colour.\n", "text/plain"))
    at.run()
    no_exception(at)
    assert not at.error
    assert not at.button(key="ls_cap_start").disabled
    assert list(at.dataframe[0].value["prompt"]) == ["What is 2+2?", "Name a colour."]


def test_entropy_page_curve_histogram_counts_and_filter(app_store, copy_of):
    at = new_app(copy_of).switch_page("app_pages/entropy.py")
    at.run()
    at.switch_page("app_pages/entropy.py").run()
    settle(at)
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    kept_filtered = int(metrics["Tokens kept"].replace(",", ""))
    assert metrics["Threshold"] == "0.50 nats" and kept_filtered > 0
    line = next(c.value for c in at.caption if " captured = " in c.value)     # every captured token accounted for
    captured, parts = line.split(" captured = ")
    counts = [int(p.split(" ")[0].replace(",", "")) for p in parts.split(" + ")]
    assert sum(counts) == int(metrics["Captured"].replace(",", "")) == int(captured.replace(",", ""))
    assert "prompt tokens" in parts and f"{kept_filtered:,} kept" in parts
    figs = charts(at)
    curve, hist = figs[0], figs[1]
    assert len(curve["data"][0]["y"]) == 5 and curve["data"][0]["name"] == "dataset-level"
    assert any(t["name"].startswith("prompt-level") for t in curve["data"])
    assert any(t["name"].startswith("default") for t in curve["data"])
    assert any(sh.get("type") == "line" for sh in hist["layout"]["shapes"])
    # turn the token-entropy filter off: recomputed in the background, more tokens kept, no threshold line
    at.toggle(key="ls_ent_filter").set_value(False).run()
    at.button(key="ls_ent_recompute").click().run()
    at.button(key="ls_ent_confirm").click().run()
    settle(at)
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Threshold"] == "0.00 nats"
    assert int(metrics["Tokens kept"].replace(",", "")) >= kept_filtered
    assert at.session_state["ls_session"].analysis_options["min_entropy"] == 0.0
    assert not any(sh.get("type") == "line" for sh in charts(at)[1]["layout"].get("shapes", []))
    # normalized scale
    at.radio(key="ls_w_ent_scale").set_value("normalized").run()
    assert max(charts(at)[0]["data"][0]["y"]) <= 1.0


def test_cka_heatmap_has_a_cell_per_layer_pair(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/cka.py").run()
    settle(at)
    no_exception(at)
    fig = charts(at)[0]
    heat = fig["data"][0]
    assert heat["type"] == "heatmap" and len(heat["z"]) == 5 and all(len(r) == 5 for r in heat["z"])
    assert abs(heat["z"][2][2] - 1.0) < 1e-4
    assert len(fig["data"][1]["x"]) == 25           # the selectable cell layer
    assert any(sh["type"] == "rect" for sh in fig["layout"]["shapes"])   # compartments outlined
    at.radio(key="ls_w_cka_kind").set_value("debiased").run()
    deb = charts(at)[0]["data"][0]["z"]
    assert deb != heat["z"]
    assert at.download_button  # HTML export under the chart


def test_layer_sets_page_compares_adds_and_state_survives_page_switches(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/layer_sets.py").run()
    settle(at)
    no_exception(at)
    table = frame_with(at, "strategy")          # each strategy's own objective, in STRATEGIES order
    assert list(table["strategy"]) == ["default", "entropy-topk", "greedy", "aggregate", "spread"]
    at.multiselect(key="ls_sets_manual").set_value([0, 3]).run()
    assert list(frame_with(at, "strategy")["strategy"])[-1] == "hand-picked"
    assert at.session_state["ls_session"].manual_picks == [0, 3]
    options = at.multiselect(key="ls_sets_to_add").options
    greedy = next(o for o in options if o.startswith("greedy "))
    greedy_layers = json.loads(table["layers"][2])          # shown in full as text: [1, 2, 3]
    assert greedy == f"greedy {greedy_layers}" and "hand-picked [0, 3]" in options
    at.multiselect(key="ls_sets_to_add").set_value([greedy, "hand-picked [0, 3]"]).run()
    at.text_input(key="ls_w_sets_name").set_value("mine").run()
    at.button(key="ls_sets_add").click().run()
    no_exception(at)
    s = at.session_state["ls_session"]
    assert [(x["name"], x["layers"]) for x in s.layer_sets] == [("greedy", greedy_layers), ("mine", [0, 3])]
    assert "mine: `[0, 3]`" in sidebar_text(at)
    # the sets and picks show on the heatmap, after switching pages
    at.switch_page("app_pages/cka.py").run()
    fig = charts(at)[0]
    assert "mine [0, 3]" in [t.get("name", "") for t in fig["data"]]
    assert [sh["name"] for sh in fig["layout"]["shapes"] if sh.get("name", "").startswith("picked")] == ["picked 0", "picked 3"]
    at.switch_page("app_pages/layer_sets.py").run()
    assert at.multiselect(key="ls_sets_manual").value == [0, 3]
    assert storage.load(app_store, s.id).layer_sets == s.layer_sets   # saved as it changed


def test_share_link_opens_the_same_session(app_store, copy_of):
    first = new_app(copy_of).run()
    first.switch_page("app_pages/layer_sets.py").run()
    settle(first)
    first.multiselect(key="ls_sets_manual").set_value([1, 2]).run()
    first.multiselect(key="ls_sets_to_add").set_value(["hand-picked [1, 2]"]).run()
    first.button(key="ls_sets_add").click().run()
    first.switch_page("app_pages/cka.py").run()
    heat = charts(first)[0]["data"][0]["z"]
    other = new_app(copy_of)          # another browser opening ?session=ID
    other.run()
    other.switch_page("app_pages/cka.py").run()
    no_exception(other)
    s = other.session_state["ls_session"]
    assert s.id == copy_of and [x["layers"] for x in s.layer_sets] == [[1, 2]]
    assert charts(other)[0]["data"][0]["z"] == heat


def test_a_broken_share_link_starts_a_new_session(app_store):
    at = new_app("../../etc/passwd").run()
    no_exception(at)
    assert any("not a session id" in w.value for w in at.warning)
    assert valid_id(sid(at)) and at.query_params["session"] == sid(at)
    at = new_app("0123456789ab").run()
    assert any("not saved on this server" in i.value for i in at.info)


def test_sessions_page_save_list_open_and_import(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/sessions.py").run()
    no_exception(at)
    at.button(key="ls_sess_save").click().run()
    assert any("needs a name" in re.sub(r"\\(.)", r"\1", e.value) for e in at.error)
    at.text_input(key="ls_w_sess_name").set_value("tiny look").run()
    at.button(key="ls_sess_save").click().run()
    no_exception(at)
    assert storage.load(app_store, copy_of).name == "tiny look"
    assert "tiny look" in list(at.dataframe[0].value["name"])
    assert "tiny look" in sidebar_text(at)
    # import: a foreign file is refused with a message, a real archive is accepted and opens
    at.file_uploader(key="ls_sess_upload").set_value(("notes.zip", b"PK\x03\x04 definitely not a zip", "application/zip"))
    at.run()
    no_exception(at)
    assert any("not a valid LayerScope session" in re.sub(r"\\(.)", r"\1", e.value) for e in at.error)
    exported = storage.load(app_store, copy_of)
    exported.id, exported.name = new_id(), "from a colleague"
    at.file_uploader(key="ls_sess_upload").set_value(("shared.zip", share.export_bytes(exported), "application/zip"))
    at.run()
    no_exception(at)
    assert any("Imported session" in x.value for x in at.success)
    at.button(key="ls_sess_open_imported").click().run()
    no_exception(at)
    s = at.session_state["ls_session"]
    assert s.id == exported.id and s.name == "from a colleague (imported)" and s.has_stats
    assert at.text_input(key="ls_w_sess_name").value == "from a colleague (imported)"   # not the previous session's name
    assert at.query_params["session"] == exported.id
    # open the first one again from the list
    at.selectbox(key="ls_sess_pick").set_value(copy_of).run()
    at.button(key="ls_sess_open").click().run()
    assert sid(at) == copy_of


def test_an_imported_session_without_its_capture_shows_its_snapshot(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.id, s.capture_key = new_id(), "f" * 24        # a capture this store does not hold
    storage.save(s, app_store)
    at = new_app(s.id).run()
    at.switch_page("app_pages/cka.py").run()
    no_exception(at)
    assert len(charts(at)[0]["data"][0]["z"]) == 5
    assert any("not in this store" in c.value for c in at.caption)


def test_a_running_job_survives_a_refresh_and_can_be_cancelled(app_store):
    at = new_app().run()
    # long enough (120 x 256 decode steps) that the refresh and the click below come before its end on any machine
    start_tiny_capture(at, limit=120, new_tokens=256, batch=1)
    job = manager().latest(sid(at), "capture")
    assert job is not None and job.view().running
    refreshed = new_app(sid(at)).run()          # the browser reloads the page: a new script session
    refreshed.switch_page("app_pages/capture.py").run()     # (a reload keeps the page's URL)
    no_exception(refreshed)
    assert refreshed.get("progress"), "the running capture shows its progress after a refresh"
    refreshed.button(key=f"capture_cancel_{job.id}").click().run()
    job.wait(120)
    settle(refreshed)
    assert job.view().state == "cancelled"
    assert any("cancelled" in w.value for w in refreshed.warning)
    assert refreshed.session_state["ls_session"].capture_key is None


def test_speculate_page_trains_a_draft_with_live_progress(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/speculate.py").run()
    no_exception(at)
    at.radio(key="ls_w_spec_mode").set_value("capture").run()          # the tiny capture starts online (small)
    assert at.selectbox(key="ls_w_spec_set").options[-1].startswith("default")
    set_number(at, "ls_w_spec_steps", 4).run()
    at.button(key="ls_spec_train").click().run()
    settle(at)
    no_exception(at)
    s = at.session_state["ls_session"]
    assert len(s.drafts) == 1
    d = s.drafts[0]
    assert d["layers"] == [1, 2] and d["steps"] == 4 and len(d["val_accuracy"]) == 3
    assert Path(d["path"], "config.json").is_file()
    assert any(x.value.startswith("Draft for default") for x in at.success)
    assert at.dataframe[0].value["name"].tolist() == ["default"]


def test_backend_messages_read_in_the_apps_words():
    plain = {"name": "d auto", "chosen": {"plain": True},
             "calibrated": {"decoding": "chain k=2", "speedup": 0.8, "tau": 1.3, "break_even_tau": 1.6}}
    for text in (f"Free disk space or pass --store on a larger disk, then {store_module.RESUME}",
                 auto_note(plain), "calibration for --k auto: d, prompt 1/2",
                 "The progress is saved; run the same command again to continue",
                 "Run the same command again to resume"):
        said = in_app_words(text)
        assert "command" not in said and "--" not in said, said
    assert in_app_words("calibration for --k auto: d") == "calibration for K = auto: d"


def test_training_starts_online_when_the_capture_is_small(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/speculate.py").run()
    no_exception(at)
    s = at.session_state["ls_session"]
    assert speculate.small_capture_warning(s.capture)                        # the tiny capture is small ...
    assert at.radio(key="ls_w_spec_mode").value == "online"                  # ... so training starts online
    assert speculate.default_training_mode({"tokens": speculate.SMALL_CAPTURE_TOKENS}) == "capture"
    said = lambda what: [c.value.replace("\\", "") for c in at.caption                    # noqa: E731
                         if c.value.replace("\\", "").startswith(f"Estimate before the {what} starts")]
    assert "the target's answers to 1,000 conversations" in said("online training")[0]     # by the start buttons
    assert "training 0 drafts" not in said("online training")[0] and said("study")
    at.radio(key="ls_w_spec_mode").set_value("capture").run()
    assert "training 1 draft on " in said("training")[0]


def test_benchmark_runs_lossless_and_shows_results(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/speculate.py").run()
    at.radio(key="ls_w_spec_mode").set_value("capture").run()
    set_number(at, "ls_w_spec_steps", 3).run()
    at.button(key="ls_spec_train").click().run()
    settle(at)
    assert at.multiselect(key="ls_spec_bench_drafts").value == [at.session_state["ls_session"].drafts[0]["path"]]
    at.radio(key="ls_w_spec_bench_src").set_value("builtin")
    set_number(at, "ls_w_spec_bench_n", 2)
    set_number(at, "ls_w_spec_bench_new", 10)
    at.toggle(key="ls_w_spec_bench_auto").set_value(False).run()      # a fixed K (the default is auto)
    set_number(at, "ls_w_spec_bench_k", 3)
    at.run()
    said = [c.value.replace("\\", "") for c in at.caption if c.value.replace("\\", "").startswith("Estimate before the benchmark")]
    assert "up to 40 tokens decoded (2 prompts x 10 tokens x each decoder)" in said[0]     # plain and the draft
    at.button(key="ls_spec_bench").click().run()
    job = manager().latest(sid(at), "bench")
    assert job is not None
    settle(at)
    no_exception(at)
    v = job.view()
    assert v.state == "done", (v.error, v.fix)
    assert v.series.get("tau:default") and set(v.metrics["live"]) == {"autoregressive", "default"}
    assert all(1 <= t <= 4 for t in v.series["tau:default"])        # at most K drafted + 1 per step
    res = at.session_state["ls_session"].bench_results[-1]
    names = [r["name"] for r in res["results"]]
    assert names == ["autoregressive", "default"] and res["prompts"] == 2 and res["max_new_tokens"] == 10
    assert all(r["lossless"] for r in res["results"])
    draft = res["results"][1]
    assert draft["layers"] == [1, 2] and len(draft["acceptance_by_position"]) == 3 and draft["tau"] >= 1.0
    tables = [d.value for d in at.dataframe if "contender" in d.value.columns]
    assert list(tables[0]["contender"]) == ["autoregressive", "default"]      # then the per-category table
    titles = [c["layout"]["title"]["text"] for c in charts(at) if c["layout"].get("title")]
    assert any("τ and speedup" in t for t in titles) and any("Acceptance rate" in t for t in titles)
    assert storage.load(app_store, copy_of).bench_results == at.session_state["ls_session"].bench_results
    # "+ prompt lookup": the chain also with prompt lookup first, its lookup steps counted apart
    at.selectbox(key="ls_w_spec_bench_lookup").set_value(str(specdec.DEFAULT_LOOKUP)).run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    no_exception(at)
    res = at.session_state["ls_session"].bench_results[-1]
    assert [r["name"] for r in res["results"]] == ["autoregressive", "default chain k=3",
                                                   f"default chain k=3 + lookup {specdec.DEFAULT_LOOKUP}"]
    assert all(r["lossless"] for r in res["results"]) and "lookup" in res["results"][2]
    # prompt lookup = auto: the span predicted best (or none), said in one line under the table
    at.selectbox(key="ls_w_spec_bench_lookup").set_value("auto").run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    no_exception(at)
    res = at.session_state["ls_session"].bench_results[-1]
    chose = [r for r in res["results"] if r.get("lookup_auto")]
    assert len(chose) == 1 and chose[0]["lossless"] and chose[0]["lookup_auto"]["k"] == 3
    assert any("prompt lookup = auto chose" in c.value for c in at.caption)


def test_study_trains_one_draft_per_set_and_correlates(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/speculate.py").run()
    no_exception(at)
    set_number(at, "ls_w_study_k", 2)
    set_number(at, "ls_w_study_steps", 2)
    at.selectbox(key="ls_w_study_src").set_value("builtin")
    set_number(at, "ls_w_study_n", 2)
    set_number(at, "ls_w_study_new", 8)
    at.run()
    plan = [m.value for m in at.markdown if m.value.startswith("Sets in the study")][0]
    assert "**default" in plan
    at.button(key="ls_spec_study").click().run()
    settle(at, timeout=600)
    no_exception(at)
    job = manager().latest(sid(at), "study")
    assert job.view().state == "done", (job.view().error, job.view().fix)
    s = at.session_state["ls_session"]
    study = s.study[-1]
    layer_sets = [tuple(r["layers"]) for r in study["rows"]]
    assert len(layer_sets) == len(set(layer_sets)) >= 2               # one draft per distinct set
    assert all(len(r["layers"]) <= 2 and r["tau"] >= 1.0 and r["lossless"] for r in study["rows"])
    assert "default" in [x for r in study["rows"] for x in r["strategies"]]
    assert set(study["spearman"]) >= {"mean_entropy", "mean_cka", "aggregate_entropy", "val_accuracy@1"}
    assert study["options"]["train"]["steps"] == 2 and study["options"]["k"] == 2
    assert {d["path"] for d in s.drafts} >= {r["draft"] for r in study["rows"]}
    assert any("Spearman correlation with τ" in m.value for m in at.markdown)
    assert all(r["seeds"][0]["curve"] for r in study["rows"])                  # a learning curve per set, shown
    assert any("First training seed" in c.value for c in at.caption)


def test_view_state_survives_page_changes_and_share_links(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/cka.py").run()
    settle(at)
    at.radio(key="ls_w_cka_kind").set_value("debiased").run()
    set_number(at, "ls_w_cka_k", 2).run()
    no_exception(at)
    at.switch_page("app_pages/entropy.py").run()
    at.radio(key="ls_w_ent_scale").set_value("normalized").run()
    at.switch_page("app_pages/cka.py").run()
    assert at.radio(key="ls_w_cka_kind").value == "debiased" and number_shown(at, "ls_w_cka_k") == 2
    view = storage.load(app_store, copy_of).view
    assert {k: view.get(k) for k in ("cka_estimator", "cka_compartments", "entropy_scale")} == \
        {"cka_estimator": "debiased", "cka_compartments": 2, "entropy_scale": "normalized"}
    other = new_app(copy_of).run()                # a share link opened in another browser
    other.switch_page("app_pages/cka.py").run()
    no_exception(other)
    assert other.radio(key="ls_w_cka_kind").value == "debiased" and number_shown(other, "ls_w_cka_k") == 2
    heat = charts(other)[0]["data"][0]["z"]
    deb = other.session_state["ls_session"].stats_dict()["cka_debiased"]
    assert [v for r in heat for v in r] == pytest.approx([v for r in deb for v in r], abs=1e-5)
    other.switch_page("app_pages/entropy.py").run()
    assert other.radio(key="ls_w_ent_scale").value == "normalized"


def test_heatmap_picks_can_be_unpicked(app_store, copy_of):
    assert toggle_picks([], [1, 3]) == [1, 3]
    assert toggle_picks([1, 3], [1, 3]) == []            # the same cell again unpicks
    assert toggle_picks([1, 3], [3, 3]) == [1]           # a diagonal cell unpicks its layer
    assert toggle_picks([1], [1, 2]) == [1, 2]           # a cell with a new layer adds it
    at = new_app(copy_of).run()
    at.switch_page("app_pages/cka.py").run()
    settle(at)
    fig = charts(at)[0]
    assert fig["layout"]["dragmode"] == "zoom" and fig["layout"]["uirevision"]   # a click picks, a drag zooms
    at.radio(key="ls_w_cka_tool").set_value("drag a box").run()
    assert charts(at)[0]["layout"]["dragmode"] == "select"           # dragging draws a box, and keeps doing so
    assert storage.load(app_store, copy_of).view["cka_tool"] == "drag a box"
    at.multiselect(key="ls_cka_picks").set_value([1, 2]).run()
    assert at.session_state["ls_session"].manual_picks == [1, 2]
    at.multiselect(key="ls_cka_picks").set_value([2]).run()
    no_exception(at)
    assert at.session_state["ls_session"].manual_picks == [2]
    assert [sh["name"] for sh in charts(at)[0]["layout"]["shapes"] if sh.get("name", "").startswith("picked")] == ["picked 2"]


def _cell(row, col):
    """A selected heatmap cell as Streamlit hands it over (the cell trace's customdata: row, column, CKA)."""
    return {"curve_number": 1, "point_index": row * 9 + col, "x": col, "y": row, "customdata": [row, col, 0.5]}


def _box(rows, cols):
    """Streamlit's selection after a box dragged over rows × cols of the 9 × 9 heatmap of an 8-layer capture."""
    return {"points": [_cell(r, c) for r in rows for c in cols],
            "box": [{"type": "rect", "xref": "x", "yref": "y", "x": [min(cols) - 0.6, max(cols) + 0.6],
                     "y": [min(rows) - 0.6, max(rows) + 0.6]}], "lasso": []}


def test_a_box_on_the_heatmap_picks_the_layers_of_its_diagonal_cells_up_to_the_set_size():
    # a click: the cell's row and column layer, toggled
    assert heatmap_picks({"points": [_cell(1, 5)], "box": [], "lasso": []}, [], limit=3, num_layers=8) == ([1, 5], None)
    assert heatmap_picks({"points": [_cell(1, 5)], "box": [], "lasso": []}, [1, 5], limit=3, num_layers=8) == ([], None)
    # a box along the diagonal: its diagonal cells' layers, not every row and column it spans
    assert heatmap_picks(_box(range(2, 5), range(2, 5)), [], limit=3, num_layers=8) == ([2, 3, 4], None)
    assert heatmap_picks(_box(range(2, 5), range(3, 7)), [0], limit=3, num_layers=8) == ([0, 3, 4], None)
    assert heatmap_picks(_box(range(2, 5), range(2, 5)), [2, 3, 4, 7], limit=3, num_layers=8) == ([7], None)
    lasso = {**_box(range(2, 4), range(2, 4)), "box": [], "lasso": [{"type": "path", "x": [1, 4, 4], "y": [1, 1, 4]}]}
    assert heatmap_picks(lasso, [], limit=3, num_layers=8) == ([2, 3], None)
    # more layers than the set size: nothing changes, and the line says why and what to do
    picks, said = heatmap_picks(_box(range(0, 8), range(0, 8)), [1], limit=3, num_layers=8)
    assert picks == [1] and said == ("The box covers 8 layers on the diagonal, [0, 1, 2, 3, 4, 5, 6, 7]: more than "
                                     "the set size k = 3 (Layer sets page), so it picked none. Drag a smaller box, "
                                     "or click cells.")
    # off the diagonal: nothing, said; the final state's own cell: nothing (drafts read 0..N-1), said
    picks, said = heatmap_picks(_box(range(0, 2), range(5, 8)), [1], limit=3, num_layers=8)
    assert picks == [1] and said.startswith("The box covers no cell on the diagonal")
    picks, said = heatmap_picks(_box([8], [8]), [], limit=3, num_layers=8)
    assert picks == [] and said.startswith("The box covers only layer 8, the final state")


def test_statistics_are_named_by_the_kernel_they_were_computed_with():
    assert kernel_of({"kernel": "linear", "options": {"kernel": "linear"}}) == "linear"
    assert kernel_of({"kernel": "cosine", "options": {}}) == "cosine"
    assert kernel_of({"options": {"alpha": 1.0}}) == "cosine"     # from before the option: row-normalised, as LayerStats reads them


def test_the_cka_kernel_is_chosen_on_the_cka_page_and_is_the_sessions(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/cka.py").run()
    settle(at)
    linear = charts(at)[0]
    assert at.radio(key="ls_w_cka_kernel").value == "linear"           # AnalysisOptions' default
    assert at.radio(key="ls_w_cka_kernel").options == ["linear", "cosine"]
    at.radio(key="ls_w_cka_kernel").set_value("cosine").run()
    settle(at)
    no_exception(at)
    s = at.session_state["ls_session"]
    assert s.analysis_options["kernel"] == "cosine" and s.stats_dict()["options"]["kernel"] == "cosine"
    assert storage.load(app_store, copy_of).analysis_options["kernel"] == "cosine"
    cosine = charts(at)[0]
    assert "cosine kernel" in cosine["layout"]["title"]["text"] and "linear kernel" in linear["layout"]["title"]["text"]
    assert cosine["data"][0]["z"] != linear["data"][0]["z"]
    # the Entropy page shows the same kernel, with nothing left to apply
    at.switch_page("app_pages/entropy.py").run()
    settle(at)
    assert at.radio(key="ls_ent_kernel").value == "cosine" and at.button(key="ls_ent_recompute").disabled
    # back to linear: the statistics of the linear kernel again (the analysis is cached in the store)
    at.switch_page("app_pages/cka.py").run()
    at.radio(key="ls_w_cka_kernel").set_value("linear").run()
    settle(at)
    assert charts(at)[0]["data"][0]["z"] == linear["data"][0]["z"]


def test_layer_sets_page_ranks_sets_of_one_size_and_recommends_from_evidence(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/layer_sets.py").run()
    settle(at)
    no_exception(at)
    k = number_shown(at, "ls_w_sets_k")
    assert k == 2                                          # the default rule's size: tiny-llama's rule reads [1, 2]
    ranked = frame_with(at, "τ [95% CI]")
    assert all(len(json.loads(l)) == k for l in ranked["layers"])          # one set size per ranking
    assert "objective" not in ranked.columns and "mRMR" not in ranked.columns
    assert set(ranked["rank"]) == {"—"}                    # nothing measured: no proxy ranks the strategies
    assert list(ranked["set"]).count("★ default ◆") == 1          # recommended, the default rule: the prior
    text = plain(next(m.value for m in at.markdown if plain(m.value).startswith("Recommended: ")))
    assert "the default rule [1, 2]" in text and "nothing measured" in text and "held-out agreement" in text
    at.multiselect(key="ls_sets_manual").set_value([0, 1]).run()
    manual = frame_with(at, "τ [95% CI]")
    row = manual[manual["set"].str.startswith("hand-picked")].iloc[0]
    assert "layer 0" in row["flags"]
    # a set of another size is listed apart, never ranked with these
    at.multiselect(key="ls_sets_manual").set_value([1, 2, 3]).run()
    other = next(d.value for d in at.dataframe if "τ [95% CI]" in d.value.columns and "rank" not in d.value.columns)
    assert "[1, 2, 3]" in list(other["layers"])


def test_entropy_threshold_line_follows_the_slider_and_a_recompute_can_be_undone(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/entropy.py").run()
    settle(at)
    before = dict(at.session_state["ls_session"].analysis_options)
    at.slider(key="ls_ent_threshold").set_value(1.5).run()
    line = next(sh for sh in charts(at)[1]["layout"]["shapes"] if sh.get("type") == "line")
    assert line["x0"] == pytest.approx(1.5)                # moved before any recompute
    assert at.session_state["ls_session"].analysis_options == before     # the session is not changed yet
    assert any("1 change(s) not applied yet: threshold 0.5 → 1.5" in c.value for c in at.caption)
    at.button(key="ls_ent_recompute").click().run()
    assert at.session_state["ls_session"].analysis_options == before     # a review first, then a confirm
    at.button(key="ls_ent_confirm").click().run()
    settle(at)
    assert at.session_state["ls_session"].analysis_options["min_entropy"] == 1.5
    assert any("recomputed (threshold 0.5 → 1.5)" in i.value for i in at.info)
    at.button(key="ls_ent_undo_btn").click().run()
    settle(at)
    no_exception(at)
    assert at.session_state["ls_session"].analysis_options == before
    assert {m.label: m.value for m in at.metric}["Threshold"] == "0.50 nats"


def test_tables_show_missing_values_as_a_dash():
    df = pd.DataFrame({"name": ["a", None], "tau": [1.25, None], "layers": [[1, 2], [3]]})
    shown = display_frame(df)
    assert list(shown["name"]) == ["a", "—"] and list(shown["tau"]) == ["1.250", "—"]
    assert list(shown["layers"]) == ["[1, 2]", "[3]"]                  # layer lists in full, as text
    assert "None" not in shown.astype(str).to_string() and df["tau"].isna().sum() == 1     # the data is untouched
    assert option_changes({"min_entropy": 0.5, "kernel": "linear"}, {"min_entropy": 1.0, "kernel": "linear"}) == \
        ["threshold 0.5 → 1"]


def test_job_status_says_the_time_left_its_phase_measured():
    """The job's own eta_s (its current phase's rate, layerscope.eta), never a rate of the progress bar."""
    def view(metrics, state="running", p=0.5):
        return JobView(id="eta-test", owner="o", kind="capture", title="t", state=state, progress=p, message="",
                       metrics=metrics, series={}, result=None, error=None, fix=None, created=0.0, started=0.0,
                       finished=None, applied=False, cancel_requested=False)

    assert time_left(view({})) is None                                  # a job that says nothing of it
    assert time_left(view({"eta_s": None})) == "estimating time left…"
    assert time_left(view({"eta_s": 72.0}, p=0.01)) == "about 72 s left"     # whatever the bar shows
    assert time_left(view({"eta_s": 72.0}, state="done")) is None


def test_seconds_read_as_words_in_one_form():
    assert [fmt.duration(x) for x in (0.42, 9.94, 72, 1200, 9000)] == ["0.4 s", "9.9 s", "72 s", "20 min", "2.5 h"]
    assert fmt.duration(None) == fmt.MISSING and fmt.duration(-3) == "0.0 s"


def test_honest_numbers_warn_about_noise_few_prompts_and_few_sets():
    rows = [{"name": "autoregressive", "tau": 1.0, "speedup": 1.0},
            {"name": "default", "layers": [2, 15, 27], "tau": 1.12, "speedup": 1.21}]
    warnings = bench_warnings(rows, prompts=4)
    assert any("default: speedup 1.21× with τ 1.12" in w for w in warnings)
    assert any("Only 4 prompt(s)" in w for w in warnings)
    assert bench_warnings([{**rows[1], "speedup": 0.9}], prompts=40) == []
    study = [{"layers": [i], "tau": t} for i, t in enumerate([1.1, 1.1, 1.2, 1.2, 1.1, 1.2])]
    assert any("2 distinct τ" in w for w in study_warnings(study, prompts=40))
    assert any("over 3 sets" in w for w in study_warnings(study[:3], prompts=40))
    assert set_label(["greedy", "manual"], [1, 9, 20], [{"name": "mine", "layers": [1, 9, 20]}]) == "greedy, also mine"
    assert set_label(["default"], [2, 15, 27]) == "default"


def test_session_report_is_one_self_contained_page(app_store, copy_of):
    s = storage.load(app_store, copy_of)
    s.name = "<script>alert(1)</script> **bold**"
    s.add_layer_set("mine & yours", [1, 2])
    page = session_report(s)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; **bold**" in page
    assert "<script src=" not in page and "<script type=\"text/javascript\" src=" not in page   # plotly.js inlined
    assert page.count("Plotly.newPlot") == 2                                # entropy curve and CKA heatmap
    assert "Recommendation (no measured τ: nothing measured yet)." in page and "Verdict." not in page
    assert "Recommended: " in page and "Layer sets of 2 layers" in page
    HTMLParser().feed(page)                                                 # parses

    at = new_app(copy_of).run()
    at.switch_page("app_pages/sessions.py").run()
    no_exception(at)
    assert "ls_sess_report" in [b.key for b in at.get("download_button")]


def test_speculate_page_trains_several_sets_online_with_learning_curves(app_store, copy_of):
    at = new_app(copy_of).run()
    at.switch_page("app_pages/speculate.py").run()
    at.radio(key="ls_w_spec_mode").set_value("online").run()
    no_exception(at)
    labels = at.multiselect(key="ls_w_spec_online_sets").options
    at.multiselect(key="ls_w_spec_online_sets").set_value(labels[:2])
    at.selectbox(key="ls_w_spec_online_prompts").set_value("builtin")
    set_number(at, "ls_w_spec_online_limit", 10)
    set_number(at, "ls_w_spec_online_tokens", 1)
    at.run()
    at.button(key="ls_spec_train_online").click().run()
    settle(at)
    no_exception(at)
    s = at.session_state["ls_session"]
    assert len(s.drafts) == len(labels[:2]) >= 1
    assert all(d.get("curve") and d["tokens_seen"] >= 1000 for d in s.drafts)
    titles = [(c.get("layout", {}).get("title") or {}).get("text", "") for c in charts(at)]
    assert any("Held-out agreement" in t for t in titles), titles


def test_user_text_in_an_error_is_not_markdown(app_store):
    """A model spec that is a Markdown image must not make the viewer's browser fetch anything."""
    at = capture_with_model("![x](http://example.invalid/p.png)")
    shown = [e.value for e in at.error]
    assert shown and all("![x](" not in e for e in shown), shown
    assert any(r"\!\[x\]\(http" in e for e in shown), shown
