"""A prompt set as the Capture page previews it, read once per (spec, limit, seed) in the server process."""

from __future__ import annotations

import streamlit as st

from layerscope.ui import tasks


@st.cache_resource(show_spinner="Reading the prompt set…", max_entries=16)
def preview_prompts(spec: str, limit: int, seed: int):
    return tasks.load_prompt_set(spec, limit, seed)
