"""A screenshot of the app's Compare page for two captures of a store (the docs' side-by-side figures).

    LAYERSCOPE_STORE=$HOME/layerscope-store .venv/bin/python scripts/shoot_compare.py KEY_A KEY_B \
        --out docs/screenshots/compare-smollm2-gemma3.png [--width 1400]

Starts `streamlit run app.py` on the store (a free port, headless), opens the Compare page in Debian's Chromium
(playwright, LAYERSCOPE_CHROMIUM or /usr/bin/chromium), picks the two captures by key, waits until the page has
drawn its charts (their statistics are computed first when the store has none under the default options), and
saves the whole page. The server stops at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from app_server import ServerDidNotStart, app_server  # scripts/app_server.py, beside this script
from playwright.sync_api import sync_playwright

CHROMIUM = os.environ.get("LAYERSCOPE_CHROMIUM", "/usr/bin/chromium")


def wait_idle(page, timeout_s: float) -> None:
    page.wait_for_timeout(500)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout_s * 1000)


def pick(page, label: str, key: str) -> None:
    """Choose the capture whose label holds `key` in the selectbox `label`."""
    box = page.locator("[data-testid='stSelectbox']").filter(has_text=label)
    box.click()
    page.get_by_role("option", name=re.compile(re.escape(key))).first.click()
    wait_idle(page, 600)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="capture key of A (a unique prefix of the key as the page lists it)")
    ap.add_argument("b", help="capture key of B")
    ap.add_argument("--out", required=True, help="PNG file to write")
    ap.add_argument("--width", type=int, default=1400, help="viewport width in pixels (default 1400)")
    args = ap.parse_args(argv)
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"error: {CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
    try:
        with app_server(None, log_path, timeout_s=120) as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": args.width, "height": 1000})
            page.set_default_timeout(600_000)
            page.goto(f"{url}/compare")
            page.get_by_text("Compare captures and runs").first.wait_for()
            wait_idle(page, 600)
            pick(page, "Capture A", args.a)
            pick(page, "Capture B", args.b)
            page.locator(".js-plotly-plot").nth(1).wait_for()      # the entropy overlay and the CKA figure(s)
            wait_idle(page, 600)
            page.wait_for_timeout(1500)                            # chart transitions
            height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
            page.set_viewport_size({"width": args.width, "height": min(int(height) + 40, 8000)})
            page.wait_for_timeout(1000)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    except ServerDidNotStart as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {args.out} (server log: {log_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
