"""The loaded target model, kept across jobs in the process that runs them (keyed by spec and store).

In the app's default mode that process is the worker (`ui.worker`): the model loads once per worker and
stays for the next job; in thread mode (LAYERSCOPE_WORKER=thread) it is the server. `get_model` is safe
to call from several threads: the first call loads (GGUF de-quantization the first time; 3.5 min for
SmolLM2 on a busy 2-core machine), later calls return the same object at once. How long the last load
of a spec took is kept in the store, so the next load's message can say what to expect (`load_message`).
What this process holds is `loaded_models()`; the server learns the worker's through its messages
(`jobs.JobManager.worker_models`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from layerscope import fmt
from layerscope.store import make_key
from layerscope.target.load import load_model

MAX_MODELS = 3

_cache: OrderedDict[tuple[str, str], object] = OrderedDict()    # (spec, store root) -> LoadedModel, newest last
_loaded: dict[str, dict] = {}      # spec -> {"device", "loads", "seconds"} of models loaded in this process
_lock = threading.Lock()          # guards the two dicts (held briefly)
_load_lock = threading.Lock()     # one load at a time: two jobs asking for the same model share one load


def get_model(spec: str, store):
    """The LoadedModel for `spec`, loaded once per process and store (at most MAX_MODELS kept)."""
    spec, root = spec.strip(), str(store.root)
    with _load_lock:
        with _lock:
            if (spec, root) in _cache:
                _cache.move_to_end((spec, root))
                return _cache[(spec, root)]
        t0 = time.perf_counter()
        loaded = load_model(spec, store=store)
        seconds = time.perf_counter() - t0
        with _lock:
            _cache[(spec, root)] = loaded
            while len(_cache) > MAX_MODELS:
                gone, _ = _cache.popitem(last=False)
                if not any(k[0] == gone[0] for k in _cache):
                    _loaded.pop(gone[0], None)
            before = _loaded.get(spec, {})
            _loaded[spec] = {"device": device_label(loaded.device), "loads": before.get("loads", 0) + 1,
                             "seconds": round(seconds, 2)}
    store.put_json("ui-model-loads", make_key({"spec": spec}), {"spec": spec, "seconds": seconds})
    return loaded


def loaded_models() -> dict[str, dict]:
    """The models this process holds: spec -> {"device", "loads" (how often it was loaded here), "seconds"}."""
    with _lock:
        return {spec: dict(v) for spec, v in _loaded.items()}


def is_loaded(spec: str, store=None) -> bool:
    """Whether this process holds `spec` (for `store`, if given). In the worker this is the worker's cache,
    the one its jobs use; the server's answer for the worker is `JobManager.worker_models`."""
    spec = spec.strip()
    with _lock:
        return any(k[0] == spec and (store is None or k[1] == str(store.root)) for k in _cache)


def load_message(spec: str, store) -> str:
    """What a job says while `spec` loads: nothing to wait for, the last load's time, or that a first load
    (de-quantizing the weights) can take minutes on a small CPU. Called in the process that loads."""
    spec = spec.strip()
    if is_loaded(spec, store):
        return f"model {spec} (already loaded)"
    last = store.get_json("ui-model-loads", make_key({"spec": spec}))
    if last and last.get("seconds") is not None:
        return f"loading model {spec} (the last load took {fmt.duration(last['seconds'])})"
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
    return f"cpu ({fmt.plural(torch.get_num_threads(), 'thread')})"
