"""The sidebar: the active session at a glance (model, prompts, capture, sets, device), its running jobs
with their progress and a link to the page that follows them, and app settings."""

from __future__ import annotations

import streamlit as st

from layerscope import fmt
from layerscope.session.model import Session
from layerscope.ui.jobs import get_manager
from layerscope.ui.model_cache import device_label
from layerscope.ui.state import COPY_SUFFIX, bind_view, new_session, viewing
from layerscope.ui.widgets import IMAGE_FORMAT_KEY, md_text

# The page that shows a job of each kind (url paths of app.py's pages).
JOB_PAGES = {"capture": "app_pages/capture.py", "analysis": "app_pages/entropy.py",
             "analysis-compare": "app_pages/entropy.py", "train": "app_pages/speculate.py",
             "bench": "app_pages/speculate.py", "study": "app_pages/speculate.py", "probe": "app_pages/layer_sets.py"}


def render(s: Session) -> None:
    # Every change is saved at once; a name only lists the session on the Sessions page. A session this browser does
    # not own (a share link) is shown through an unsaved copy: read-only, as the banner says, until "Make my copy".
    original = viewing()
    if original is not None:
        name = s.name.removesuffix(COPY_SUFFIX) if s.name else None
        st.markdown(f"**Session** · {md_text(name) if name else '*unnamed*'}  \n`{original}` · read-only: "
                    "“Make my copy” to edit")
    else:
        st.markdown(f"**Session** · {md_text(s.name) if s.name else '*unnamed*'}  \n`{s.id}` · saved as you work")
    st.button("New session", key="ls_new_session", icon=":material/add:", on_click=new_session,
              help="Start an empty session; this one stays saved (Sessions page)")
    cap = s.capture or {}
    rows = [
        ("Model", md_text(s.model) if s.model else "—"),
        ("Prompt set", md_text(s.prompt_set) if s.prompt_set else "—"),
        ("Capture", (f"{cap.get('tokens', 0):,} tokens · {cap.get('conversations', '?')} prompts · "
                     f"layers 0..{cap.get('num_layers', '?')}") if s.capture_key else "none yet"),
        ("Device", device_label()),
    ]
    st.markdown("  \n".join(f"{k}: {v}" for k, v in rows))
    if s.layer_sets:
        st.markdown("Layer sets to test:  \n" + "  \n".join(
            f"- {md_text(x['name'])}: `{fmt.layers(x['layers'])}`" for x in s.layer_sets))
    else:
        st.caption("No layer sets chosen yet (Layer sets page).")
    if s.drafts:
        st.caption(f"{len(s.drafts)} trained draft(s) · {len(s.bench_results)} benchmark result(s)")
    running = get_manager().active(s.id)
    if running:
        _running_jobs(s.id)
    st.radio("Chart downloads", ["png", "svg"], key=IMAGE_FORMAT_KEY, horizontal=True, format_func=str.upper,
             on_change=bind_view(s, "image_format", IMAGE_FORMAT_KEY, "png", options=["png", "svg"]),
             help="The format of every chart's download button")


@st.fragment(run_every=2.0)
def _running_jobs(owner: str) -> None:
    """Every running job of the session: a small progress bar and a link to the page that follows it."""
    jobs = get_manager().active(owner)
    if not jobs:
        return
    st.markdown("**Running**")
    for j in jobs:
        v = j.view()
        st.progress(v.progress or 0.0, text=f"{v.title} · {fmt.duration(v.elapsed)}")
        page = JOB_PAGES.get(v.kind)
        if page:
            st.page_link(page, label="Follow it on its page", icon=":material/arrow_forward:")
