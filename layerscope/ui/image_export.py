"""Static images of Plotly figures for the chart downloads: plotly.js renders the figure in headless chromium.

The app's one exporter (`ui.widgets.chart` offers it under every chart); no kaleido needed. Rendering runs
chromium in a subprocess on a temporary page and reads the image back from the page's DOM.
"""

from __future__ import annotations

import base64
import html
import json
import os
import shutil
import subprocess
import tempfile
import urllib.parse
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """The headless browser that renders static images: $LAYERSCOPE_CHROMIUM, else Debian's chromium."""
    env = os.environ.get("LAYERSCOPE_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class ImageExportError(RuntimeError):
    """A static image could not be rendered (no chromium, or it failed)."""


def figure_image(fig: go.Figure, fmt: str = "png", *, width: int = 1100, height: int | None = None,
                 scale: float = 2.0, timeout: float = 60.0) -> bytes:
    """The figure as a PNG or SVG file, rendered by plotly.js in headless chromium (no kaleido needed).

    Writes a page with plotly.js inlined that draws the figure and replaces itself with
    `Plotly.toImage`'s data URL; chromium's --dump-dom prints it. PNG bytes start with the PNG
    signature; SVG is UTF-8 text starting with "<svg".
    """
    fmt = fmt.lower()
    if fmt not in ("png", "svg"):
        raise ValueError(f"image format must be png or svg, not {fmt!r}")
    browser = chromium_path()
    if browser is None:
        raise ImageExportError("No chromium found for static images: install Debian's chromium "
                               "(apt-get install chromium) or set LAYERSCOPE_CHROMIUM")
    height = int(height or fig.layout.height or 500)
    opts = {"format": fmt, "width": int(width), "height": height, "scale": float(scale) if fmt == "png" else 1}
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><script>" + get_plotlyjs() + "</script></head><body>"
            "<div id='fig'></div><script>"
            f"var spec = {fig.to_json()};"
            "Plotly.newPlot('fig', spec.data, spec.layout, {staticPlot: true})"
            f".then(function(gd) {{ return Plotly.toImage(gd, {json.dumps(opts)}); }})"
            ".then(function(url) { document.body.innerHTML = '<pre id=\"out\"></pre>';"
            " document.getElementById('out').textContent = url; })"
            ".catch(function(e) { document.body.innerHTML = '<pre id=\"err\"></pre>';"
            " document.getElementById('err').textContent = String(e); });"
            "</script></body></html>")
    with tempfile.TemporaryDirectory(prefix="layerscope-image-") as tmp:
        src = Path(tmp) / "figure.html"
        src.write_text(page, encoding="utf-8")
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp}/profile",
               "--virtual-time-budget=20000", "--dump-dom", src.as_uri()]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise ImageExportError(f"chromium took more than {timeout:.0f} s to render the figure") from None
    dom = done.stdout.decode("utf-8", "replace")
    start = dom.find('<pre id="out">')
    if start < 0:
        err = dom.find('<pre id="err">')
        why = html.unescape(dom[err + 14:dom.find("</pre>", err)]) if err >= 0 else done.stderr.decode()[-300:]
        raise ImageExportError(f"chromium did not render the figure: {why.strip() or 'no output'}")
    url = html.unescape(dom[start + len('<pre id="out">'):dom.find("</pre>", start)]).strip()
    head, _, body = url.partition(",")
    if head.endswith(";base64"):
        return base64.b64decode(body)
    return urllib.parse.unquote(body).encode("utf-8")
