"""The loaded target model, kept across reruns and pages (st.cache_resource keyed by spec and store).

`get_model` is safe to call from a background job thread: the first call loads (GGUF de-quantization
the first time, ~20 s for SmolLM2 on 2 cores), later calls return the same object at once.
"""

from __future__ import annotations

import streamlit as st
import torch

_loaded_specs: dict[str, str] = {}   # spec -> device label of models loaded in this process


@st.cache_resource(show_spinner=False, max_entries=3)
def _load(spec: str, store_root: str):
    from layerscope.models import load_model
    from layerscope.store import Store

    loaded = load_model(spec, store=Store(store_root))
    _loaded_specs[spec] = device_label(loaded.device)
    return loaded


def get_model(spec: str, store):
    """The LoadedModel for `spec`, loaded once per server process and store."""
    return _load(spec.strip(), str(store.root))


def is_loaded(spec: str) -> bool:
    return spec.strip() in _loaded_specs


def device_label(device: torch.device | str | None = None) -> str:
    """'cuda (NVIDIA H200)' or 'cpu (2 threads)': what the app computes on."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return f"cuda ({torch.cuda.get_device_name(device)})"
        except Exception:  # no driver details available
            return "cuda"
    return f"cpu ({torch.get_num_threads()} threads)"
