"""How much CPU the app's Streamlit server takes while it only shows pages, with browser tabs open.

    .venv/bin/python benchmarks/app_server.py                      # the app's own config (.streamlit/config.toml)
    .venv/bin/python benchmarks/app_server.py --streamlit-defaults # Streamlit's defaults: file watcher, GC per run
    .venv/bin/python benchmarks/app_server.py --tabs 3 --seconds 60 --page cka --session ID --store cache
    .venv/bin/python benchmarks/app_server.py --job --model tiny-llama --limit 16 --new-tokens 48
    .venv/bin/python benchmarks/app_server.py --job --worker thread   # the job in a server thread, as before

Starts `streamlit run app.py` on a free port, opens `--tabs` headless Chromium tabs on a page (Debian's
chromium through Playwright), waits until they have drawn, then reads the server's CPU time from
/proc/<pid>/stat over `--seconds` and prints the share of one core it used (the tabs' own CPU is not
counted: they are other processes). The app's worker process (ui/worker.py, where jobs run) is measured
apart, as `worker_cpu_percent_of_one_core`, once its start-up imports are over. Prints one JSON line; `--json` only that line.

The server gets a temporary empty store unless `--store` is given (then a `--session` id shows that
session's pages). On a shared machine, run both configurations back to back and compare the two.

`--job`: the same capture twice, each into a fresh store: once with the CLI (`layerscope capture`),
once started from the app's Capture page with `--tabs` tabs open on it (they poll the live view).
Compares the capture's own time (manifest `seconds`, measured inside capture()) of the two runs, and
says how much CPU the server and the worker used meanwhile.

`--worker process|thread` sets LAYERSCOPE_WORKER for the server: where the app runs its jobs (default
process: a worker process; thread: a thread of the server, which then competes with the tabs' reruns
for the interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("LAYERSCOPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
STREAMLIT_DEFAULTS = ["--server.fileWatcherType", "auto", "--runner.postScriptGC", "true"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (the app's worker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_with_children(pid: int) -> tuple[float, float]:
    """CPU seconds of the server and of its live child processes (the worker), read now."""
    kids = 0.0
    for child in children(pid):
        try:
            kids += cpu_seconds(child)
        except OSError:
            pass
    return cpu_seconds(pid), kids


def wait_for_quiet_worker(pid: int, limit: float = 180.0) -> None:
    """Wait until the server's worker has finished its start-up imports (under 5 % of a core over a second)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        _, w0 = cpu_with_children(pid)
        time.sleep(1.0)
        _, w1 = cpu_with_children(pid)
        if w1 - w0 < 0.05:
            return


def start_server(store: Path, extra: list[str], log_path: Path, worker: str = "process") -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, LAYERSCOPE_STORE=str(store), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), LAYERSCOPE_WORKER=worker)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"),
                             "--server.port", str(port), *extra],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"streamlit did not start; see {log_path}")
        time.sleep(0.3)


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server (its worker process exits when the server's end of their socket closes)."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def fill_capture_form(tab, url: str, model: str, numbers) -> str:
    """Open the Capture page in `tab`, type the model and each (label, value) number; the session id."""
    tab.goto(url + "/")
    tab.get_by_text("Capture hidden states").wait_for()
    sid = tab.url.split("session=")[1][:12]
    box = tab.get_by_role("textbox", name="Target model")
    box.fill(model)
    box.press("Enter")
    for label, value in numbers:
        box = tab.get_by_role("spinbutton", name=label, exact=True)
        box.fill(str(value))
        box.press("Enter")
        tab.wait_for_timeout(1500)
    return sid


def measure(args) -> dict:
    from playwright.sync_api import sync_playwright

    tmp = tempfile.TemporaryDirectory(prefix="layerscope-bench-")
    store = Path(args.store).resolve() if args.store else Path(tmp.name) / "store"
    extra = STREAMLIT_DEFAULTS if args.streamlit_defaults else []
    proc, url = start_server(store, extra, Path(tmp.name) / "streamlit.log", args.worker)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page_url = f"{url}/{args.page}" + (f"?session={args.session}" if args.session else "")
            tabs = []
            for _ in range(args.tabs):
                tab = browser.new_page(viewport={"width": 1440, "height": 1000})
                tab.goto(page_url)
                tab.wait_for_selector("h1", timeout=120_000)
                tabs.append(tab)
            time.sleep(args.settle)           # first runs, imports and figure drawing are over
            wait_for_quiet_worker(proc.pid)   # and the worker's start-up imports
            (c0, w0), t0 = cpu_with_children(proc.pid), time.monotonic()
            time.sleep(args.seconds)
            (c1, w1), t1 = cpu_with_children(proc.pid), time.monotonic()
            browser.close()
    finally:
        stop_server(proc)
        tmp.cleanup()
    return {"config": "streamlit defaults" if args.streamlit_defaults else "app (.streamlit/config.toml)",
            "tabs": args.tabs, "page": args.page or "capture", "seconds": round(t1 - t0, 1),
            "server_cpu_percent_of_one_core": round(100 * (c1 - c0) / (t1 - t0), 2),
            "worker": args.worker, "worker_cpu_percent_of_one_core": round(100 * (w1 - w0) / (t1 - t0), 2),
            "load_average_1min": os.getloadavg()[0]}


def capture_seconds(store: Path) -> float:
    manifests = sorted(store.glob("captures/*/manifest.json"))
    if len(manifests) != 1:
        raise SystemExit(f"expected one capture in {store}, found {len(manifests)}")
    return float(json.loads(manifests[0].read_text())["seconds"])


def job_vs_cli(args) -> dict:
    from playwright.sync_api import sync_playwright

    tmp = tempfile.TemporaryDirectory(prefix="layerscope-bench-")
    cli_store, app_store = Path(tmp.name) / "cli", Path(tmp.name) / "app"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "layerscope.commands.cli", "capture", "--store", str(cli_store), "--model", args.model,
                    "--prompts", "builtin", "--limit", str(args.limit), "--max-new-tokens", str(args.new_tokens),
                    "--batch-size", str(args.batch), "--json"], cwd=ROOT, env=env, check=True, capture_output=True)
    cli_wall = time.monotonic() - t0
    extra = STREAMLIT_DEFAULTS if args.streamlit_defaults else []
    proc, url = start_server(app_store, extra, Path(tmp.name) / "streamlit.log", args.worker)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            first = browser.new_page(viewport={"width": 1440, "height": 1000})
            first.set_default_timeout(1_800_000)
            sid = fill_capture_form(first, url, args.model, (("Prompts (limit)", args.limit),
                                                             ("New tokens per response", args.new_tokens),
                                                             ("Batch size", args.batch)))
            (c0, w0), t0 = cpu_with_children(proc.pid), time.monotonic()
            first.get_by_role("button", name="Start capture").click()
            others = []
            for _ in range(max(0, args.tabs - 1)):
                tab = browser.new_page(viewport={"width": 1440, "height": 1000})
                tab.set_default_timeout(600_000)      # a busy server can take long to serve a page
                tab.goto(f"{url}/?session={sid}")   # Capture is the main page
                others.append(tab)
            first.get_by_text(f"Capture of {args.model}: done in").wait_for()
            (c1, w1), t1 = cpu_with_children(proc.pid), time.monotonic()
            browser.close()
    finally:
        stop_server(proc)
    cli_s, app_s = capture_seconds(cli_store), capture_seconds(app_store)
    tmp.cleanup()
    return {"config": "streamlit defaults" if args.streamlit_defaults else "app (.streamlit/config.toml)",
            "model": args.model, "prompts": args.limit, "new_tokens": args.new_tokens, "tabs": args.tabs,
            "cli_capture_s": round(cli_s, 2), "cli_wall_s": round(cli_wall, 2), "app_capture_s": round(app_s, 2),
            "app_over_cli": round(app_s / cli_s, 3), "worker": args.worker,
            "job_wall_s": round(t1 - t0, 1), "server_cpu_s": round(c1 - c0, 1), "worker_cpu_s": round(w1 - w0, 1),
            "load_average_1min": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tabs", type=int, default=3, help="browser tabs open on the page (default 3)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window (default 30)")
    ap.add_argument("--settle", type=float, default=10.0, help="wait after the tabs drew (default 10)")
    ap.add_argument("--page", default="", help="url path of the page the tabs show (default: Capture, the main page)")
    ap.add_argument("--store", help="store directory (default: a temporary empty store)")
    ap.add_argument("--session", help="session id the tabs open (?session=ID)")
    ap.add_argument("--streamlit-defaults", action="store_true",
                    help="override the app's config with Streamlit's defaults (file watcher, GC after every run)")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--job", action="store_true", help="compare a capture's speed in the app (tabs open) with the CLI")
    ap.add_argument("--model", default="tiny-llama", help="--job: model spec (default tiny-llama)")
    ap.add_argument("--limit", type=int, default=16, help="--job: builtin prompts (default 16)")
    ap.add_argument("--new-tokens", type=int, default=48, help="--job: new tokens per response (default 48)")
    ap.add_argument("--batch", type=int, default=8, help="--job: batch size (default 8)")
    ap.add_argument("--worker", choices=["process", "thread"], default="process",
                    help="LAYERSCOPE_WORKER for the server: jobs in a worker process (default) or in a server thread")
    args = ap.parse_args(argv)
    if args.job:
        result = job_vs_cli(args)
        if not args.json:
            print(f"{result['config']}, jobs in a {result['worker']}: capture took {result['app_capture_s']} s in the app "
                  f"with {result['tabs']} tab(s) open, {result['cli_capture_s']} s with the CLI: {result['app_over_cli']:.2f}× "
                  f"(1-min load average {result['load_average_1min']:.2f})")
        print(json.dumps(result))
        return
    result = measure(args)
    if not args.json:
        print(f"{result['config']}: server used {result['server_cpu_percent_of_one_core']:.2f} % of one core "
              f"(its idle worker {result['worker_cpu_percent_of_one_core']:.2f} %) "
              f"over {result['seconds']} s with {result['tabs']} tab(s) on the {result['page']} page "
              f"(1-min load average {result['load_average_1min']:.2f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
