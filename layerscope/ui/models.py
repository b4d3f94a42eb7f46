"""The loaded target model, kept across reruns and pages (st.cache_resource keyed by spec and store).

`get_model` is safe to call from a background job thread: the first call in a server process loads
(GGUF de-quantization the first time; 3.5 min for SmolLM2 on a busy 2-core machine), later calls return
the same object at once. How long the last load of a spec took is kept in the store, so the next
load's message can say what to expect (`load_message`).
"""

from __future__ import annotations

import time

import streamlit as st
import torch

from layerscope.store import make_key

_loaded_specs: dict[str, str] = {}   # spec -> device label of models loaded in this process


@st.cache_resource(show_spinner=False, max_entries=3)
def _load(spec: str, store_root: str):
    from layerscope.models import load_model
    from layerscope.store import Store

    store = Store(store_root)
    t0 = time.perf_counter()
    loaded = load_model(spec, store=store)
    _loaded_specs[spec] = device_label(loaded.device)
    store.put_json("ui-model-loads", make_key({"spec": spec}), {"spec": spec, "seconds": time.perf_counter() - t0})
    return loaded


def get_model(spec: str, store):
    """The LoadedModel for `spec`, loaded once per server process and store."""
    return _load(spec.strip(), str(store.root))


def is_loaded(spec: str) -> bool:
    return spec.strip() in _loaded_specs


def load_message(spec: str, store) -> str:
    """What a job says while `spec` loads: nothing to wait for, the last load's time, or that a first load
    (de-quantizing the weights) can take minutes on a small CPU."""
    spec = spec.strip()
    if is_loaded(spec):
        return f"model {spec} (already loaded)"
    last = store.get_json("ui-model-loads", make_key({"spec": spec}))
    if last and last.get("seconds") is not None:
        s = float(last["seconds"])
        took = f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"
        return f"loading model {spec} (the last load took {took})"
    return f"loading model {spec} (a first load de-quantizes the weights: up to a few minutes on a small CPU)"


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
