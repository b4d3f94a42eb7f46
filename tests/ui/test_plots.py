"""The figure builders: right traces, right shapes, values and labels where a reader looks for them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from layerscope.ui import image_export, plots


def _cka(n: int) -> np.ndarray:
    idx = np.arange(n)
    return np.exp(-np.abs(idx[:, None] - idx[None, :]) / 4.0)


def test_entropy_curve_highlights_each_set_on_the_curve():
    ent = [1.0 + 0.1 * i for i in range(31)]
    fig = plots.entropy_curve({"dataset": ent, "prompt-level": [e - 0.2 for e in ent]},
                              sets={"default": [2, 15, 27], "greedy": [3, 9, 20]})
    assert isinstance(fig, go.Figure)
    names = [t.name for t in fig.data]
    assert names[:2] == ["dataset", "prompt-level"]
    default = next(t for t in fig.data if t.name.startswith("default"))
    assert list(default.x) == [2, 15, 27]
    assert list(default.y) == pytest.approx([ent[2], ent[15], ent[27]])
    greedy = next(t for t in fig.data if t.name.startswith("greedy"))
    assert greedy.marker.line.color != default.marker.line.color
    assert default.marker.line.color == plots.DEFAULT_SET_COLOR
    # the final layer is labelled with what it is
    assert "post-norm" in fig.data[0].customdata[30]
    assert "embeddings" in fig.data[0].customdata[0]


def test_entropy_curve_accepts_tensors_and_objects_with_layers():
    class Sel:
        strategy, layers = "aggregate", [1, 2]

    fig = plots.entropy_curve({"h": torch.linspace(0, 1, 5)}, sets=[Sel()])
    assert list(fig.data[1].x) == [1, 2]
    assert fig.data[1].name.startswith("aggregate")


def test_entropy_curve_rejects_ragged_curves():
    with pytest.raises(ValueError):
        plots.entropy_curve({"a": [1, 2, 3], "b": [1, 2]})
    with pytest.raises(ValueError):
        plots.entropy_curve({})


def test_histogram_marks_threshold_and_counts_kept_tokens():
    values = [0.1, 0.2, 0.6, 1.5, 3.0]
    fig = plots.entropy_histogram(values, 0.5)
    assert list(fig.data[0].x) == values
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(lines) == 1 and lines[0].x0 == 0.5
    text = fig.layout.annotations[0].text
    assert "3 of 5 tokens kept" in text
    no_line = plots.entropy_histogram(values, None)
    assert not no_line.layout.shapes


def test_cka_heatmap_cells_hover_and_compartments():
    n = 7
    m = _cka(n)
    fig = plots.cka_heatmap(m, compartments=[(0, 2), (3, 6)], sets={"default": [2, 3, 4]}, picks=[1, 5])
    heat = fig.data[0]
    assert heat.type == "heatmap"
    assert np.array(heat.z).shape == (n, n)
    assert heat.z[1][3] == pytest.approx(m[1, 3])
    assert "%{z" in heat.hovertemplate and "customdata[0]" in heat.hovertemplate and "customdata[1]" in heat.hovertemplate
    # one selectable cell marker per cell, carrying row, column, value
    cells = fig.data[1]
    assert len(cells.x) == n * n
    k = 3 * n + 5
    assert list(cells.customdata[k]) == [3, 5, pytest.approx(m[3, 5])]
    assert cells.x[k] == 5 and cells.y[k] == 3
    rects = [s for s in fig.layout.shapes if s.type == "rect" and not (s.name or "").startswith("picked")]
    assert [(r.x0, r.x1) for r in rects] == [(-0.5, 2.5), (2.5, 6.5)]
    assert any(t.name.startswith("default") and list(t.x) == [2, 3, 4] for t in fig.data)
    picked = [(s.name, s.x0, s.y0) for s in fig.layout.shapes if (s.name or "").startswith("picked")]
    assert picked == [("picked 1", 0.5, 0.5), ("picked 5", 4.5, 4.5)]


def test_compartments_from_labels_per_layer():
    fig = plots.cka_heatmap(_cka(6), compartments=[0, 0, 1, 1, 1, 2])
    rects = [(s.x0 + 0.5, s.x1 - 0.5) for s in fig.layout.shapes if s.type == "rect"]
    assert rects == [(0, 1), (2, 4), (5, 5)]


def test_cka_heatmap_refuses_non_square():
    with pytest.raises(ValueError):
        plots.cka_heatmap([[1, 0.5], [0.5]])


def test_cells_to_layers_reads_only_cell_points():
    points = [{"customdata": [3, 5, 0.7]}, {"customdata": [4, 4, 1.0]}, {"x": 2, "y": 2},
              {"customdata": ["default", 1]}]
    assert plots.cells_to_layers(points) == [3, 4, 5]
    assert plots.cells_to_layers([]) == []


def test_acceptance_bars_grouped():
    fig = plots.acceptance_bars({"default": [0.6, 0.4, 0.2], "greedy": [0.7, 0.5, 0.3]})
    assert [t.type for t in fig.data] == ["bar", "bar"]
    assert list(fig.data[1].y) == [0.7, 0.5, 0.3]
    assert list(fig.data[0].x) == ["pos 1", "pos 2", "pos 3"]
    assert fig.layout.barmode == "group"


def test_tau_over_time_running_mean():
    fig = plots.tau_over_time([1, 3, 2])
    assert list(fig.data[1].y) == pytest.approx([1.0, 2.0, 2.0])


def test_set_comparison_and_bench_comparison():
    rows = [{"name": "default", "layers": [2, 15, 27], "mean_entropy": 3.0, "mean_cka": 0.5, "objective": 2.5},
            {"name": "greedy", "layers": [1, 9, 20], "mean_entropy": 3.2, "mean_cka": 0.4, "objective": 2.8}]
    fig = plots.set_comparison(rows)
    assert len(fig.data) == 3          # aggregate_entropy is in no row: skipped
    assert list(fig.data[2].y) == [2.5, 2.8]
    with pytest.raises(ValueError):
        plots.set_comparison([{"name": "x"}])
    b = plots.bench_comparison([{"name": "autoregressive", "tau": 1.0, "speedup": 1.0},
                                {"name": "default", "layers": [2, 15, 27], "tau": 2.1, "speedup": 1.3}])
    assert list(b.data[0].y) == [1.0, 2.1] and list(b.data[1].y) == [1.0, 1.3]


def test_training_curves_one_line_per_draft_step():
    hist = [{"step": i, "loss": 5.0 - i, "accuracy": [0.1 * i, 0.05 * i]} for i in range(4)]
    fig = plots.training_curves(hist)
    assert [t.name for t in fig.data] == ["loss", "step 1", "step 2"]


def test_config_and_html_export():
    cfg = plots.figure_config("cka", "svg")
    assert cfg["toImageButtonOptions"]["format"] == "svg" and cfg["toImageButtonOptions"]["filename"] == "cka"
    with pytest.raises(ValueError):
        plots.figure_config("x", "gif")
    html = plots.figure_html(plots.tau_over_time([1, 2]))
    assert "<html>" in html[:200] and "plotly" in html.lower() and len(html) > 1_000_000   # plotly.js embedded
    json.loads(plots.cka_heatmap(_cka(3)).to_json())   # serialisable for the browser


def test_plots_does_not_import_streamlit():
    code = "import sys, layerscope.ui.plots, layerscope.ui.image_export, layerscope.session; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_heatmap_drags_a_selection_box_and_keeps_the_tool():
    fig = plots.cka_heatmap(_cka(5), box_select=True)
    assert fig.layout.dragmode == "select" and fig.layout.uirevision    # a drag draws a box; a redraw keeps it
    click = plots.cka_heatmap(_cka(5))
    assert click.layout.dragmode == "zoom" and click.layout.uirevision  # a drag zooms, a click selects a cell


def test_heatmaps_of_different_depths_take_one_height_when_told():
    """Grown with the layer count by default (a 30-layer model's is taller than an 18-layer one's); the Compare page
    passes the larger height to both so that two models' heatmaps line up side by side."""
    deep, shallow = plots.cka_heatmap(_cka(31)), plots.cka_heatmap(_cka(19))
    assert deep.layout.height == plots.cka_heatmap_height(31) == plots.HEATMAP_MAX_HEIGHT
    assert shallow.layout.height == plots.cka_heatmap_height(19) == 18 * 19 + 200 < deep.layout.height
    assert plots.cka_heatmap(_cka(19), height=deep.layout.height).layout.height == deep.layout.height
    assert plots.cka_heatmap_height(3) == 480 and plots.cka_heatmap_height(200) == plots.HEATMAP_MAX_HEIGHT


@pytest.mark.parametrize("sets", [None, {"default": [1, 3]}, [("a", [0, 1]), ("b", [2, 4]), ("c", [5])]])
def test_heatmap_tick_labels_sit_at_the_matrix_edges_whatever_the_chart_width(sets):
    """Set markers go in rows above the matrix and both axes keep square cells by giving up domain, never range: the
    y range starts at the matrix's lower edge, so the x tick labels (drawn at the bottom of the y range) touch it."""
    n = 8
    for fig in (plots.cka_heatmap(_cka(n), sets=sets), plots.cka_difference_heatmap(_cka(n) - 0.5)):
        x, y = fig.layout.xaxis, fig.layout.yaxis
        assert tuple(x.range) == (-0.5, n - 0.5) and y.range[0] == -0.5
        assert x.constrain == y.constrain == "domain" and y.scaleanchor == "x" and y.scaleratio == 1
        markers = [t for t in fig.data if t.type == "scatter" and t.name != "cells"]
        assert all(min(t.y) > n - 0.5 and max(t.y) < y.range[1] for t in markers)      # above the matrix, in range
        assert len(markers) == (len(sets) if sets and fig.data[0].name == "CKA" else 0)


def test_set_comparison_labels_stand_upright():
    rows = [{"name": f"strategy-{i}", "layers": [i, i + 1, i + 2], "aggregate_entropy": 1.0 + i} for i in range(6)]
    fig = plots.set_comparison(rows, metrics=("aggregate_entropy",))
    assert fig.layout.xaxis.tickangle == -90 and fig.layout.xaxis.automargin


@pytest.mark.browser
def test_figure_image_png_and_svg_rendered_by_chromium():
    if image_export.chromium_path() is None:
        pytest.fail("no chromium: install Debian's chromium (apt-get install -y chromium) for static image export")
    fig = plots.entropy_curve({"dataset": [1.0, 2.0, 1.5]}, sets={"default": [1]}, title="export check")
    png = image_export.figure_image(fig, "png", width=400, height=300, scale=1)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (400, 300)
    svg = image_export.figure_image(fig, "svg", width=400, height=300).decode()
    assert svg.startswith("<svg") and "export check" in svg and svg.rstrip().endswith("</svg>")
    with pytest.raises(ValueError):
        image_export.figure_image(fig, "gif")


def test_learning_curves_hover_every_step_and_simulated_acc_len():
    fig = plots.learning_curves({"a": [[1000, [0.5, 0.5, 0.5]], [2000, [0.8, 0.5]]]})
    trace = fig.data[0]
    assert list(trace.x) == [1000, 2000] and list(trace.y) == [0.5, 0.8]
    assert trace.customdata[0] == "50.0% / 50.0% / 50.0%<br>simulated_acc_len 0.875"   # 0.5 + 0.25 + 0.125
    assert trace.customdata[1].endswith("simulated_acc_len 1.200")                      # 0.8 + 0.4


# User text as it may come: a link, a paint-over, a hovertemplate variable and Plotly's own line break.
LINK = '<a href="https://evil.example/">click me</a>'
PAINT = '<span style="position:fixed;top:0;left:0;font-size:400px">X</span>'
HOSTILE = [LINK, PAINT, "50%{y} <br>b & c"]


def _every_figure_with(name: str, other: str) -> dict[str, go.Figure]:
    """Every builder that shows user text (set, draft, capture, run names), given `name` and `other` as that text."""
    ent = [1.0 + 0.1 * i for i in range(6)]
    bench = [{"name": name, "layers": [1, 3], "tau": 1.2, "tau_ci": [1.1, 1.3], "speedup": 1.1},
             {"name": other, "tau": 1.0, "speedup": 1.0}]
    study = [{"strategies": [name], "layers": [1, 3], "tau": 1.2, "tau_ci": [1.1, 1.3],
              "proxies": {"v": {"mean_entropy": 1.0}}, "seeds": [{"tau": 1.2}]},
             {"strategies": ["default"], "layers": [2, 4], "tau": 1.1, "proxies": {"v": {"mean_entropy": 2.0}}}]
    return {
        "entropy_curve": plots.entropy_curve({name: ent}, sets={other: [1, 3]}, title=f"Entropy of {name}"),
        "cka_heatmap": plots.cka_heatmap(_cka(6), sets=[(name, [1, 3])], title=f"CKA, {other}"),
        "acceptance_bars": plots.acceptance_bars({name: [0.5, 0.3], other: [0.4, 0.2]}),
        "set_comparison": plots.set_comparison([{"name": name, "layers": [1, 3], "mean_entropy": 1.0}]),
        "bench_comparison": plots.bench_comparison(bench),
        "runs_comparison": plots.runs_comparison({other: bench}),
        "study_intervals": plots.study_intervals(study),
        "study_proxies": plots.study_proxies(study, "v", ("mean_entropy",)),
        "learning_curves": plots.learning_curves({name: [[100, [0.3]], [200, [0.4]]]}),
        "entropy_overlay": plots.entropy_overlay({name: ent, other: ent}),
        "cka_difference_heatmap": plots.cka_difference_heatmap(_cka(6) - _cka(6).T, names=(name, other)),
    }


def _strings(node):
    """Every string in a figure's JSON, with the key it sits under."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str):
                yield k, v
            else:
                yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from (_strings(v) if isinstance(v, (dict, list)) else [("", v)] if isinstance(v, str) else [])


@pytest.mark.parametrize("name", HOSTILE)
def test_user_text_is_plain_text_in_every_figure(name):
    """Plotly renders <a href>, <span style>, <br> and entities in names, titles, ticks and hover text, and fills
    in %{...} in a hovertemplate: a name reaches a figure escaped, and never as part of a hovertemplate."""
    for builder, fig in _every_figure_with(name, PAINT if name != PAINT else LINK).items():
        strings = list(_strings(json.loads(fig.to_json())))
        shown = " ".join(v for _, v in strings)
        assert "<a" not in shown and "<span" not in shown, builder
        assert "&lt;" in shown or "<" not in name, builder                      # the name is there, escaped
        for key, v in strings:
            assert "%{y} " not in v, (builder, key, v)                          # never inside a hovertemplate
            assert "<br>b" not in v, (builder, key, v)                          # the user's <br> stays text
