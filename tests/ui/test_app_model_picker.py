"""The Capture page offers the built-in models (every alias of aliases.ALIASES, and tiny-llama) as pills beside the
typed spec: a pick becomes the spec and the session's choice; a typed spec shows which built-in it names."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from layerscope.target import aliases

APP = str(Path(__file__).resolve().parents[2] / "app.py")


def test_the_capture_page_offers_every_built_in_model(app_store):
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.switch_page("app_pages/capture.py").run()
    pills = at.pills(key="ls_w_cap_known")
    assert pills.options == [*aliases.ALIASES, "tiny-llama"] and "gemma3-270m" in pills.options
    assert pills.value == aliases.DEFAULT_MODEL == at.text_input(key="ls_w_cap_model").value
    pills.set_value("gemma3-270m").run()
    assert at.text_input(key="ls_w_cap_model").value == "gemma3-270m"
    assert at.session_state["ls_session"].view["cap_model"] == "gemma3-270m"      # kept in the session
    at.text_input(key="ls_w_cap_model").set_value("org/name").run()
    assert at.pills(key="ls_w_cap_known").value is None                            # not a built-in model
    at.switch_page("app_pages/home.py").run()
    at.switch_page("app_pages/capture.py").run()
    assert at.text_input(key="ls_w_cap_model").value == "org/name" and not at.exception
