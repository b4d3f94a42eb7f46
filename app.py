"""LayerScope: which layers of the target model should an EAGLE-3 draft read?

Run with `streamlit run app.py` (README). This file sets the page config, shows the active analysis
session in the sidebar and hands over to the page chosen in the navigation (files in app_pages/).

The page files live in app_pages/, not pages/: Streamlit treats a `pages/` folder beside the main
script as an old-style multipage app until st.navigation has run once in the process, so the first
request for a page URL (say a share link to /cka) would run that page alone, without this shell.
"""

from __future__ import annotations

import streamlit as st

st.set_page_config(page_title="LayerScope", page_icon=":material/layers:", layout="wide")

from layerscope.ui import access, sidebar  # noqa: E402  (after set_page_config)
from layerscope.ui.apply import COLLECTED, collect  # noqa: E402
from layerscope.ui.state import active_session, dismiss_notes, notes, pop_notice  # noqa: E402
from layerscope.ui.views import read_only_banner  # noqa: E402
from layerscope.ui.widgets import CANCEL_OWNER_KEY, guard, md_text  # noqa: E402

PAGES = [
    # Home is the default page (the bare URL); every step's page has its own URL, /capture included.
    st.Page("app_pages/home.py", title="Home", icon=":material/home:", url_path="index", default=True),
    # the default page answers the bare URL only; /home (a link someone wrote out) opens it too
    st.Page("app_pages/home.py", title="Home", url_path="home", visibility="hidden"),
    st.Page("app_pages/capture.py", title="Capture", icon=":material/download:", url_path="capture"),
    st.Page("app_pages/entropy.py", title="Entropy", icon=":material/show_chart:", url_path="entropy"),
    st.Page("app_pages/cka.py", title="CKA heatmap", icon=":material/grid_on:", url_path="cka"),
    st.Page("app_pages/layer_sets.py", title="Layer sets", icon=":material/checklist:", url_path="layer_sets"),
    st.Page("app_pages/speculate.py", title="Speculative decoding", icon=":material/bolt:", url_path="speculate"),
    st.Page("app_pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("app_pages/sessions.py", title="Sessions", icon=":material/folder_shared:", url_path="sessions"),
]

access.gate()             # with LAYERSCOPE_TOKEN set: nothing shows until the token is given
access.remember()         # this browser's owner token (and access) kept in its cookies
st.session_state[CANCEL_OWNER_KEY] = {}   # a full run: the first panel drawn for a job gets its cancel button
session = active_session()
collect(session)          # results of jobs that finished since the last run land in the session
collected = st.session_state.get(COLLECTED, 0)
page = st.navigation(PAGES, position="sidebar", expanded=True)
read_only_banner()        # a session this browser does not own: read-only, with "Make my copy"
notice = pop_notice()
if notice:
    kind, text = notice
    getattr(st, kind)(text)
said = notes(session)      # changes the app made to the session (sets that did not fit a new capture): until dismissed
if said:
    for text in said:
        st.warning(md_text(text), icon=":material/published_with_changes:")
    st.button("Dismiss these notes", key="ls_notes_dismiss", icon=":material/done_all:",
              on_click=lambda: dismiss_notes(active_session()))
summary = st.sidebar.container()
try:
    with guard(page.title):   # a bug shows as one readable line, never a traceback
        page.run()
finally:
    # A job that finished while the page ran lands now, if the page did not take it in itself; the sidebar, drawn
    # after the page, shows what the page just changed (a capture attached, a set added).
    collect(active_session())
    with summary:
        sidebar.render(active_session())
if st.session_state.get(COLLECTED, 0) != collected:
    st.rerun()             # the page may have drawn the session without that result, and the job as done: once more
