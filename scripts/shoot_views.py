"""Screenshots of what a new user meets, at two widths: the first capture of a real model, a benchmark's estimate,
the Layer sets row and the break-even verdict (issue 51's before/after views).

    .venv/bin/python scripts/shoot_views.py --out docs/screenshots/views-after [--widths 1024,1440] [--model smollm2-135m]
    .venv/bin/python scripts/shoot_views.py --out docs/screenshots/views-before --app-root /tmp/before   # an older checkout

Starts `streamlit run app.py` on a fresh store (a temporary folder: the first capture de-quantizes the model, as a
new user's does), opens one tab per width on the same session and walks it: a capture of 2 prompts, a draft of the
default set trained from the capture for a few steps, then a benchmark of the shipped builtin draft (so the Layer
sets row has two drafts of one set to keep apart). Each view is saved as <out>/<view>-<width>.png. A step that does
not finish in its time is shot as it stands and named in <out>/notes.txt (an older version of the app can freeze:
that is what its "before" shows). Run it alone: it loads the model and decodes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from app_server import ServerDidNotStart, app_server  # scripts/app_server.py, beside this script
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

CHROMIUM = os.environ.get("LAYERSCOPE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]


class Walk:
    """The tabs (one per width) on one session, and what did not go as planned."""

    def __init__(self, pages: dict[int, object], out: Path):
        self.pages, self.out, self.notes = pages, out, []

    @property
    def main(self):
        return self.pages[max(self.pages)]          # the widest tab drives the session; the others follow it

    def note(self, text: str) -> None:
        print(text, file=sys.stderr)
        self.notes.append(text)

    def shoot(self, view: str, *, whole: bool = True) -> None:
        """Every tab, as it stands now (`whole`: the full page, Streamlit's main area grown to fit)."""
        for width, page in self.pages.items():
            path = self.out / f"{view}-{width}.png"
            try:
                if whole:
                    height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
                    page.set_viewport_size({"width": width, "height": max(900, min(int(height) + 40, 6000))})
                    page.wait_for_timeout(800)
                page.screenshot(path=str(path), full_page=True)
                page.set_viewport_size({"width": width, "height": 900})
            except PlaywrightError as e:
                self.note(f"{view}-{width}: no screenshot ({str(e).splitlines()[0]})")

    def follow(self, path: str) -> None:
        """The other tabs open the main tab's session at `path` (a page's URL)."""
        session = re.search(r"session=([0-9a-f]{12})", self.main.url)
        for page in self.pages.values():
            if page is not self.main:
                page.goto(f"{base(self.main.url)}/{path}" + (f"?session={session.group(1)}" if session else ""))
        for page in self.pages.values():
            idle(page, 120)


def base(url: str) -> str:
    return re.match(r"https?://[^/]+", url).group(0)


def idle(page, timeout_s: float) -> bool:
    """Wait until Streamlit has finished its script run; False when it has not within `timeout_s`."""
    page.wait_for_timeout(400)
    try:
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                               timeout=timeout_s * 1000)
        return True
    except PlaywrightError:
        return False


def goto(page, title: str) -> None:
    page.get_by_role("link", name=title, exact=True).click()
    idle(page, 120)


def set_number(page, label: str, value) -> None:
    box = page.get_by_role("textbox", name=label, exact=True)
    box.fill(str(value))
    box.press("Enter")
    idle(page, 120)


def wait_text(page, pattern: str, timeout_s: float) -> bool:
    try:
        page.get_by_text(re.compile(pattern)).first.wait_for(timeout=timeout_s * 1000)
        return True
    except PlaywrightError:
        return False


def walk(w: Walk, model: str, freeze_s: float) -> None:
    page = w.main
    # --- the first capture: the model is de-quantized into the fresh store first
    box = page.get_by_role("textbox", name="Target model")
    box.fill(model)
    box.press("Enter")
    idle(page, 120)
    set_number(page, "Prompts (limit)", 2)
    set_number(page, "New tokens per response", 24)
    set_number(page, "Batch size", 2)
    page.get_by_role("button", name="Start capture").click()
    w.follow("capture")
    page.wait_for_timeout(8000)
    w.shoot("1-first-capture-loading", whole=False)
    if not wait_text(page, rf"^Capture of {re.escape(model)}: done in", freeze_s):
        w.note(f"first capture: no result on the page {freeze_s:.0f} s after the start; shot as it stands, then reloaded")
        w.shoot("1-first-capture-stuck", whole=False)
        page.reload()
        if not wait_text(page, rf"^Capture of {re.escape(model)}: done in", 600):
            w.note("first capture: still no result 10 min after a reload")
    idle(page, 120)
    w.follow("capture")
    w.shoot("1-first-capture-done")
    # --- a draft of the default set from the capture (a few steps), then the benchmark's estimate for the builtin
    goto(page, "Speculative decoding")
    try:
        page.get_by_role("radio", name="from this capture").check(force=True)
        idle(page, 120)
        set_number(page, "Training steps", 5)
        page.get_by_role("button", name="Train draft").click()
        if not wait_text(page, r"^Draft for .*: done in", 900):
            w.note("training: not done in 15 min")
        idle(page, 120)
        page.get_by_role("radio", name="builtin").check(force=True)
        idle(page, 120)
        set_number(page, "Prompts", 4)
        set_number(page, "New tokens", 32)
    except PlaywrightError as e:
        w.note(f"speculative decoding set-up: {str(e).splitlines()[0]}")
    w.follow("speculate")
    w.shoot("2-benchmark-estimate")
    started = time.time()
    try:
        page.get_by_role("button", name="Run benchmark").click()
    except PlaywrightError as e:
        w.note(f"benchmark: could not start ({str(e).splitlines()[0]})")
    if wait_text(page, r"^Benchmark of .*: done in", 1800):
        w.note(f"benchmark: done in {time.time() - started:.0f} s of wall time (the estimate is in 2-benchmark-estimate)")
    else:
        w.note("benchmark: not done in 30 min")
    idle(page, 120)
    w.follow("speculate")
    w.shoot("4-break-even-verdict")
    # --- the Layer sets row of the default set, which now has two drafts
    goto(page, "Layer sets")
    w.follow("layer_sets")
    w.shoot("3-layer-sets-row")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for the PNG files and notes.txt")
    ap.add_argument("--widths", default="1024,1440", help="viewport widths in pixels (default 1024,1440)")
    ap.add_argument("--model", default="smollm2-135m", help="the model of the first capture (default smollm2-135m)")
    ap.add_argument("--app-root", type=Path, default=None,
                    help="another checkout whose app to run (a before/after: `git worktree add /tmp/before <commit>`)")
    ap.add_argument("--freeze-s", type=float, default=240,
                    help="seconds after which a first capture without a result is shot as stuck (default 240)")
    args = ap.parse_args(argv)
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"error: {CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    widths = [int(x) for x in args.widths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="layerscope-views-") as tmp:
        try:
            with app_server(Path(tmp) / "store", Path(tmp) / "streamlit.log", timeout_s=120,
                            **({"root": args.app_root.resolve()} if args.app_root else {})) as url, \
                    sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                context = browser.new_context()       # one person: the tabs share the session's cookie
                pages = {}
                for width in sorted(widths):
                    pages[width] = context.new_page()
                    pages[width].set_viewport_size({"width": width, "height": 900})
                    pages[width].set_default_timeout(120_000)
                w = Walk(pages, args.out)
                w.main.goto(f"{url}/capture")
                w.main.get_by_text("Capture hidden states").wait_for()
                idle(w.main, 120)
                try:
                    walk(w, args.model, args.freeze_s)
                finally:
                    (args.out / "notes.txt").write_text("\n".join(w.notes) + "\n")
                    browser.close()
        except ServerDidNotStart as e:
            raise SystemExit(f"error: {e}") from None
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
