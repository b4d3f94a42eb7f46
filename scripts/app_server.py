"""`streamlit run app.py` on a free local port, for the browser tests and the screenshot scripts alike.

    with app_server(store, log_path) as url:       # url: "http://127.0.0.1:<port>", healthy
        ...                                        # the server is stopped when the block ends

The store is the server's LAYERSCOPE_STORE (None: the environment's). The server's output goes to `log_path`.
A server that exits or is not healthy within `timeout_s` raises `ServerDidNotStart`, naming the log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServerDidNotStart(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def app_server(store: Path | None, log_path: Path, *, timeout_s: float = 90, root: Path = ROOT):
    """Yield the URL of a healthy `streamlit run <root>/app.py` on `store`; stop it (terminate, then kill) afterwards.
    `root`: the checkout whose app runs (another version's, for a before/after: its `layerscope` is imported first)."""
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if store is not None:
        env["LAYERSCOPE_STORE"] = str(store)
    if root != ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(root / "app.py"), "--server.port", str(port),
             "--server.headless", "true", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false"],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + timeout_s
            while not healthy(url):
                if proc.poll() is not None or time.time() > deadline:
                    raise ServerDidNotStart(f"streamlit did not start: see {log_path}")
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
