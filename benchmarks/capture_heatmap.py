"""Time from "Start capture" to a drawn CKA heatmap in the app, as a user meets it in a browser.

    .venv/bin/python benchmarks/capture_heatmap.py                       # SmolLM2, 16 builtin prompts: cold, then warm
    .venv/bin/python benchmarks/capture_heatmap.py --model tiny-llama --limit 4 --new-tokens 8   # a quick smoke run

Each round starts `streamlit run app.py` (the app's own config) on a free port with one headless Chromium tab
(Debian's chromium through Playwright), types the model, the prompt limit, the new tokens and the seed on the
Capture page, clicks Start capture, waits for "Capture of MODEL: done", opens the CKA heatmap page and waits until
the heatmap has drawn. The time printed runs from the click to the drawn heatmap: model load, responses, capture,
the default statistics and the page. Three rounds, one store:

  cold       an empty store: the model is read from its package into the store, nothing else is there;
  warm       the same store, a new server and a new capture (seed + 1): the model files are in the store and the
             OS file cache, the capture and its statistics are computed again;
  cached     the same store, a new server, the warm round's capture again: served from the store.

Prints one JSON line per round and a summary. The rounds run one after another in one run; other work on
the machine slows all three (the load average is printed with each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from app_server import CHROMIUM, CHROMIUM_ARGS, fill_capture_form, start_server, stop_server  # noqa: E402  (a sibling script)


def one_round(name: str, store: Path, args, seed: int, log_dir: Path) -> dict:
    from playwright.sync_api import sync_playwright

    proc, url = start_server(store, [], log_dir / f"streamlit-{name}.log")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            tab = browser.new_page(viewport={"width": 1440, "height": 1000})
            tab.set_default_timeout(args.timeout * 1000)
            sid = fill_capture_form(tab, url, args.model, (("Prompts (limit)", args.limit),
                                                           ("New tokens per response", args.new_tokens), ("Seed", seed)))
            t0 = time.monotonic()
            tab.get_by_role("button", name="Start capture").click()
            tab.get_by_text(f"Capture of {args.model}: done in").or_(tab.get_by_text("(served from the store)")).first.wait_for()
            t_capture = time.monotonic() - t0
            tab.goto(f"{url}/cka?session={sid}")
            tab.locator(".js-plotly-plot .heatmaplayer, .js-plotly-plot .hm").first.wait_for()
            total = time.monotonic() - t0
            browser.close()
    finally:
        stop_server(proc)
    return {"round": name, "model": args.model, "prompts": args.limit, "new_tokens": args.new_tokens, "seed": seed,
            "capture_done_s": round(t_capture, 1), "heatmap_drawn_s": round(total, 1),
            "load_average_1min": round(os.getloadavg()[0], 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=16, help="builtin prompts (default 16)")
    ap.add_argument("--new-tokens", type=int, default=48, help="new tokens per response (default 48, the app's default)")
    ap.add_argument("--seed", type=int, default=0, help="prompt sample seed of the cold round (default 0)")
    ap.add_argument("--store", help="store directory for the rounds (default: a new temporary one; it must be empty)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for any one step (default 1800)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="layerscope-heatmap-") as tmp:
        store = Path(args.store).resolve() if args.store else Path(tmp) / "store"
        if store.exists() and any(store.iterdir()):
            raise SystemExit(f"{store} is not empty: the cold round needs an empty store")
        rounds = []
        for name, seed in (("cold", args.seed), ("warm", args.seed + 1), ("cached", args.seed + 1)):
            r = one_round(name, store, args, seed, Path(tmp))
            print(json.dumps(r), flush=True)
            rounds.append(r)
    print(" · ".join(f"{r['round']} {r['heatmap_drawn_s']} s" for r in rounds)
          + f" from Start capture to the drawn CKA heatmap ({args.model}, {args.limit} builtin prompts)")


if __name__ == "__main__":
    main()
