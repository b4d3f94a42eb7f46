"""Shared fixtures: a tiny random model, a small capture of it, and the real SmolLM2 and Gemma 3 270M (each loaded once
per test process: `scripts/dev.sh test` runs the suite on 2 pytest-xdist workers, each file whole on one of them)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# In a pytest-xdist worker (the variable is set before this file is imported): the workers share the machine's
# cores, so each runs torch on one thread, and so do the processes its tests start (CLI children, a streamlit
# server), which inherit it. Set here, before anything imports torch; an OMP_NUM_THREADS of the user's own stays.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


# Real models run in float32 in the tests whatever this machine's bf16 units are (layerscope/target/precision.py would pick
# bfloat16 where it measures faster): their tests compare decoders token for token. tests/target/test_precision.py tests
# the choice itself.
os.environ.setdefault("LAYERSCOPE_DTYPE", "float32")
# the commands' progress in a log (the tests' child processes write stderr to files): a line every update, so that
# a test waiting for "step=3" sees it (commands/common.Progress; users' logs get one every 30 s)
os.environ.setdefault("LAYERSCOPE_PROGRESS_EVERY", "0")


@pytest.fixture(scope="session")
def tiny():
    from layerscope.target.load import load_model

    return load_model("tiny-llama")


@pytest.fixture
def store(tmp_path):
    from layerscope.store import Store

    s = Store(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture(scope="session")
def session_store(tmp_path_factory):
    from layerscope.store import Store

    s = Store(tmp_path_factory.mktemp("session-store"))
    yield s
    s.close()


@pytest.fixture(scope="session")
def tiny_capture(tiny, session_store):
    """6 builtin prompts, 12 new tokens each, on the tiny model: a CaptureReader."""
    from layerscope.capture.run import capture
    from layerscope.capture.stored import open_capture
    from layerscope.prompts.sets import load_prompts

    prompts = load_prompts("builtin", limit=6, seed=0)
    result = capture(tiny, prompts, session_store, max_new_tokens=12, batch_size=4)
    return open_capture(session_store, result.key)

@pytest.fixture
def store_with_capture(tiny_capture, tmp_path):
    """A store of its own holding a copy of the tiny capture (so what the store holds can be compared whole):
    (Store, the capture's key)."""
    import shutil

    from layerscope.store import Store

    store = Store(tmp_path / "store")
    shutil.copytree(tiny_capture.path, store.path("captures", tiny_capture.key))
    yield store, tiny_capture.key
    store.close()


@pytest.fixture(scope="module")
def app_store(tmp_path_factory):
    """A store the app's pages use (LAYERSCOPE_STORE points at it for the module's tests), one per test module."""
    from layerscope.store import Store

    root = tmp_path_factory.mktemp("app-store")
    old = os.environ.get("LAYERSCOPE_STORE")
    os.environ["LAYERSCOPE_STORE"] = str(root)
    store = Store(root)
    yield store
    store.close()
    if old is None:
        os.environ.pop("LAYERSCOPE_STORE", None)
    else:
        os.environ["LAYERSCOPE_STORE"] = old


@pytest.fixture(scope="session")
def smollm2(session_store):
    """The real default model; de-quantized once per test session into the session store."""
    from layerscope.target.load import load_model

    return load_model("smollm2-135m", store=session_store)


@pytest.fixture(scope="session")
def gemma3(session_store):
    """The real Gemma 3 270M: its four parts assembled and de-quantized once per test session into the session store."""
    from layerscope.target.load import load_model

    return load_model("gemma3-270m", store=session_store)


@pytest.fixture(scope="session")
def qwen05(session_store):
    """Qwen2.5-Coder-0.5B-Instruct: assembled from its six part packages and de-quantized once per test session."""
    from layerscope.target.load import load_model

    return load_model("qwen2.5-coder-0.5b", store=session_store)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one intra-op thread, and far faster on a shared, busy machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
