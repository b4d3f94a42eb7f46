"""The sidebar: the active session at a glance (model, prompts, capture, sets, device) and app settings."""

from __future__ import annotations

import streamlit as st

from layerscope.session import Session
from layerscope.ui.jobs import get_manager
from layerscope.ui.models import device_label
from layerscope.ui.widgets import IMAGE_FORMAT_KEY


def render(s: Session) -> None:
    st.markdown(f"**Session** · {s.name or '*unsaved*'}  \n`{s.id}`")
    cap = s.capture or {}
    rows = [
        ("Model", f"`{s.model}`" if s.model else "—"),
        ("Prompt set", s.prompt_set or "—"),
        ("Capture", (f"{cap.get('tokens', 0):,} tokens · {cap.get('conversations', '?')} prompts · "
                     f"layers 0..{cap.get('num_layers', '?')}") if s.capture_key else "none yet"),
        ("Device", device_label()),
    ]
    st.markdown("  \n".join(f"{k}: {v}" for k, v in rows))
    if s.layer_sets:
        st.markdown("Layer sets to test:  \n" + "  \n".join(
            f"- {x['name']}: `{x['layers']}`" for x in s.layer_sets))
    else:
        st.caption("No layer sets chosen yet (Layer sets page).")
    if s.drafts:
        st.caption(f"{len(s.drafts)} trained draft(s) · {len(s.bench_results)} benchmark result(s)")
    running = get_manager().active(s.id)
    if running:
        st.caption("Running: " + ", ".join(j.title for j in running))
    st.radio("Chart download format", ["png", "svg"], key=IMAGE_FORMAT_KEY, horizontal=True,
             help="What the camera button in a chart's toolbar saves")
