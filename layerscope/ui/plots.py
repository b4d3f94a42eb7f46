"""Pure Plotly figure builders: plain data in, `plotly.graph_objects.Figure` out.

Nothing here imports Streamlit or touches the store, so every figure can be built and checked in a
test, exported as standalone HTML, or used from a notebook. Layer indices follow README "Layer indices":
layer ``l`` is ``hidden_states[l]``; 0 is the embedding output and ``N`` is the final state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from layerscope import fmt
from layerscope.draft.training.loss import simulated_acc_len

# One color per layer set, in the order the sets are given; the default rule is always grey.
SET_COLORS = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22"]
DEFAULT_SET_COLOR = "#555555"
SET_SYMBOLS = ["circle", "diamond", "square", "triangle-up", "star", "hexagon", "cross", "x"]
SET_ROW = 0.9          # cells: the height of one row of set markers (above the matrix on the CKA heatmap)
CURVE_COLORS = ["#1f77b4", "#7f7f7f", "#aec7e8", "#c49c94"]


def _as_list(values) -> list:
    """Accept lists, tuples, numpy arrays and torch tensors alike."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return list(values)


def _matrix(values) -> list[list[float]]:
    rows = _as_list(values)
    out = [[float(v) for v in _as_list(r)] for r in rows]
    n = len(out)
    if any(len(r) != n for r in out):
        raise ValueError(f"expected a square matrix, got rows of lengths {sorted({len(r) for r in out})}")
    return out


def _named_sets(sets) -> list[tuple[str, list[int]]]:
    """`sets` as [(name, layers)], from a mapping, a list of pairs, or objects with .name/.layers; the names
    escaped for display (`fmt.escape`: a set's name is user text)."""
    if not sets:
        return []
    if isinstance(sets, Mapping):
        items = list(sets.items())
    else:
        items = []
        for s in sets:
            if isinstance(s, Mapping):
                items.append((s.get("name") or s.get("strategy"), s["layers"]))
            elif hasattr(s, "layers"):
                items.append((getattr(s, "name", None) or getattr(s, "strategy", "set"), s.layers))
            else:
                items.append((s[0], s[1]))
    return [(fmt.escape(name), [int(x) for x in _as_list(layers)]) for name, layers in items]


BASELINE_COLORS = {"autoregressive": "#9e9e9e", "hf-generate": "#bdbdbd", "hf-prompt-lookup": "#d6d6d6"}


def set_color(name: str, index: int, layers=None, colors: Mapping | None = None) -> str:
    """Grey for the default rule and the baselines (plain decoding, HF peers); else the color `colors` gives the
    layer set (`palette`: one color per set, the same in every figure), else a palette color by position."""
    if name in BASELINE_COLORS:
        return BASELINE_COLORS[name]
    if colors and layers is not None and tuple(int(l) for l in layers) in colors:
        return colors[tuple(int(l) for l in layers)]
    return DEFAULT_SET_COLOR if name.startswith("default") else SET_COLORS[index % len(SET_COLORS)]


def palette(layer_sets, default=None) -> dict[tuple, str]:
    """One color per distinct layer set, in the order given (the default rule's set grey): pass it as `colors=`
    to every figure so a set (and a draft reading it) keeps its color from one figure to the next."""
    out: dict[tuple, str] = {}
    if default is not None:
        out[tuple(int(l) for l in default)] = DEFAULT_SET_COLOR
    for layers in layer_sets:
        key = tuple(int(l) for l in layers)
        if key not in out:
            out[key] = SET_COLORS[(len(out) - (default is not None)) % len(SET_COLORS)]
    return out


def layer_label(layer: int, num_layers: int, final_state: str = "post-norm") -> str:
    """How a layer index reads in the UI: 'emb' for 0, 'N (post-norm)' for the last one."""
    if layer == 0:
        return "0 (embeddings)"
    if layer == num_layers:
        return f"{layer} (final, {final_state})"
    return str(layer)


# Layer kinds (a capture's format.state_kinds: what the decoder layer producing each hidden state mixes tokens with),
# marked on the per-layer curves: a tinted band behind each layer of the entropy curve, a colored tick label on the
# CKA heatmap's axes, the kind in every hover, and one legend entry per kind present.
KIND_LABELS = {"attention": "attention", "sliding": "sliding", "chunked": "chunked", "linear": "linear attention",
               "ssm": "SSM", "ssm+attention": "SSM + attention", "conv": "conv"}
KIND_COLORS = {"attention": "#1f77b4", "sliding": "#2ca02c", "chunked": "#8c564b", "linear": "#ff7f0e",
               "ssm": "#9467bd", "ssm+attention": "#17becf", "conv": "#d62728"}
OTHER_KIND_COLOR = "#7f7f7f"
KIND_BAND_OPACITY = 0.13


def _kinds(kinds, n: int) -> list[str] | None:
    """`kinds` (one per hidden state 0..n-1, the first "embedding") checked against the figure's n layers; None
    for none."""
    if kinds is None:
        return None
    kinds = [str(k) for k in _as_list(kinds)]
    if len(kinds) != n:
        raise ValueError(f"kinds: one per layer 0..{n - 1} ({n}), got {len(kinds)}")
    return kinds


def mixed_kinds(kinds) -> bool:
    """Whether the decoder layers are of more than one kind (`kinds` as in `entropy_curve`): only then do the
    figures mark them with colors (a target of one kind gets its kind in the hover alone)."""
    return kinds is not None and len(set(list(kinds)[1:])) > 1


def kind_label(kind: str) -> str:
    """How a layer kind reads in a legend and a hover ("SSM", "linear attention", ...); an unknown kind as it is."""
    return KIND_LABELS.get(kind, fmt.escape(kind))


def _layer_kind_labels(labels: list[str], kinds: list[str] | None) -> list[str]:
    """The layer labels with each decoder layer's kind: '3 · SSM' (the embedding output keeps its own label)."""
    if kinds is None:
        return labels
    return [label if i == 0 else f"{label} · {kind_label(kind)}" for i, (label, kind) in enumerate(zip(labels, kinds))]


def _kind_legend(fig: go.Figure, kinds: list[str]) -> None:
    """One legend entry per kind present, in LAYER_KINDS order (traces without points, grouped as "layer kind")."""
    present = [k for k in KIND_LABELS if k in kinds[1:]] + sorted({k for k in kinds[1:] if k not in KIND_LABELS})
    for kind in present:
        fig.add_trace(go.Scatter(
            x=[None], y=[None], mode="markers", name=f"layer kind: {kind_label(kind)}", legendgroup="layer kinds",
            marker=dict(size=11, symbol="square", color=KIND_COLORS.get(kind, OTHER_KIND_COLOR),
                        opacity=0.6), meta={"layer_kind": kind}, hoverinfo="skip"))


# Where a figure's legend goes: under the plot (above it, beside the title, it ran into the title at 1024 px), or
# right of it where the x axis carries long upright category names that a legend below would cover.
LEGEND_BELOW = dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0.0)
LEGEND_RIGHT = dict(orientation="v", yanchor="top", y=1.0, xanchor="left", x=1.02)


def _base_layout(fig: go.Figure, title: str | None, **kw) -> go.Figure:
    fig.update_layout(
        title=dict(text=fmt.escape(title), x=0.0, xanchor="left") if title else None,
        margin=dict(l=60, r=20, t=60 if title else 30, b=50),
        legend=kw.pop("legend", LEGEND_BELOW),
        hovermode="closest",
        **kw,
    )
    return fig


def contender_colors(names: Sequence[str], layers: Sequence, colors: Mapping | None = None) -> list[str]:
    """One color per contender of a figure, each its own: its layer set's (set_color: the same in every figure),
    unless a contender before it has that color already (a built-in draft reading the default rule's layers and the
    default rule, two drafts of one set), then the first palette color that is no contender's own. The same
    contenders in the same order get the same colors."""
    own = [set_color(str(name), i, ls, colors) for i, (name, ls) in enumerate(zip(names, layers))]
    out: list[str] = []
    for color in own:
        if color in out:
            color = next((c for c in SET_COLORS + CURVE_COLORS if c not in out and c not in own), color)
        out.append(color)
    return out


def entropy_curve(
    curves: Mapping[str, Sequence[float]],
    *,
    sets=None,
    title: str | None = "Matrix entropy per layer",
    y_title: str = "entropy (nats)",
    final_state: str = "post-norm",
    colors: Mapping | None = None,
    kinds: Sequence[str] | None = None,
) -> go.Figure:
    """Per-layer curves (e.g. dataset-level and prompt-level entropy) with layer sets highlighted (`colors`: palette).

    curves: name -> values for layers 0..N (all curves the same length).
    sets: layer sets to mark on the first curve: {name: layers}, [(name, layers)] or objects with
    ``.layers``; each set gets its own color and marker, drawn on top of the curve.
    kinds: each layer's kind (format.state_kinds: "embedding", then "attention", "sliding", "linear", "ssm",
    "conv", ...), or None where the capture records none: each decoder layer gets its kind in the hover and, where
    the layers are of more than one kind (`mixed_kinds`), a band of its kind's color behind the curves, each kind a
    legend entry.
    """
    if not curves:
        raise ValueError("entropy_curve needs at least one curve")
    named = [(fmt.escape(name), [float(v) for v in _as_list(vals)]) for name, vals in curves.items()]
    n_points = len(named[0][1])
    if n_points == 0 or any(len(v) != n_points for _, v in named):
        raise ValueError("every curve needs one value per layer 0..N, all of the same length")
    num_layers = n_points - 1
    xs = list(range(n_points))
    kinds = _kinds(kinds, n_points)
    labels = _layer_kind_labels([layer_label(x, num_layers, final_state) for x in xs], kinds)
    fig = go.Figure()
    for l, kind in enumerate(kinds if mixed_kinds(kinds) else []):
        if l:               # state 0, the embedding output, has no layer kind
            fig.add_vrect(x0=l - 0.5, x1=l + 0.5, fillcolor=KIND_COLORS.get(kind, OTHER_KIND_COLOR),
                          opacity=KIND_BAND_OPACITY, line_width=0, layer="below", name=f"kind {l}: {kind}")
    for i, (name, ys) in enumerate(named):
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name=name,
            line=dict(color=CURVE_COLORS[i % len(CURVE_COLORS)], width=2 if i == 0 else 1.5,
                      dash="solid" if i == 0 else "dot"),
            marker=dict(size=5),
            customdata=labels,
            hovertemplate="layer %{customdata}<br>%{fullData.name}: %{y:.4f}<extra></extra>",
        ))
    base = named[0][1]
    for i, (name, layers) in enumerate(_named_sets(sets)):
        inside = [l for l in layers if 0 <= l < n_points]
        color = set_color(name, i, layers, colors)
        fig.add_trace(go.Scatter(
            x=inside, y=[base[l] for l in inside], mode="markers", name=f"{name} {layers}",
            marker=dict(size=14 - min(i, 4), color="rgba(0,0,0,0)", symbol=SET_SYMBOLS[i % len(SET_SYMBOLS)],
                        line=dict(color=color, width=2.5)),
            customdata=[[labels[l], name] for l in inside],
            hovertemplate="%{customdata[1]}: layer %{customdata[0]}<br>%{y:.4f}<extra></extra>",
        ))
    if mixed_kinds(kinds):
        _kind_legend(fig, kinds)
    _base_layout(fig, title)
    # the legend under the plot: above it, beside the title, it ran into the title at 1024 px
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0.0))
    fig.update_xaxes(title="layer (hidden_states index)", dtick=1 if n_points <= 40 else 5,
                     range=[-0.5, n_points - 0.5])
    fig.update_yaxes(title=y_title)
    return fig


def entropy_histogram(
    entropies: Sequence[float],
    threshold: float | None,
    *,
    kept: int | None = None,
    total: int | None = None,
    nbins: int = 60,
    title: str | None = "Predictive entropy of captured tokens",
) -> go.Figure:
    """Histogram of the target's next-token entropies (nats), the filter threshold as a line."""
    values = [float(v) for v in _as_list(entropies)]
    fig = go.Figure(go.Histogram(
        x=values, nbinsx=nbins, name="tokens", marker=dict(color=CURVE_COLORS[0]),
        hovertemplate="entropy %{x}<br>%{y} tokens<extra></extra>",
    ))
    if threshold is not None:
        if total is None:
            total = len(values)
        if kept is None:
            kept = sum(v >= threshold for v in values)
        fig.add_vline(x=float(threshold), line=dict(color="#d62728", width=2, dash="dash"))
        fig.add_annotation(
            x=float(threshold), y=1.0, yref="paper", xanchor="left", yanchor="bottom", showarrow=False,
            text=f"threshold {threshold:.3g} nats: {kept:,} of {total:,} tokens kept",
            font=dict(color="#d62728"),
        )
    _base_layout(fig, title, bargap=0.02, showlegend=False)
    fig.update_xaxes(title="predictive entropy (nats)")
    fig.update_yaxes(title="tokens")
    return fig


def _compartment_ranges(compartments, n: int) -> list[tuple[int, int]]:
    """Compartments as inclusive (start, end) ranges: from [(s, e)], [[l, l, ...]] or labels per layer."""
    if not compartments:
        return []
    comps = _as_list(compartments)
    if all(isinstance(c, (int, float)) for c in comps) and len(comps) == n:
        ranges, start = [], 0  # one label per layer
        for i in range(1, n + 1):
            if i == n or comps[i] != comps[start]:
                ranges.append((start, i - 1))
                start = i
        return ranges
    ranges = []
    for c in comps:
        if isinstance(c, Mapping):
            c = (c["start"], c["end"])
        c = [int(x) for x in _as_list(c)]
        if not c:
            continue
        if len(c) == 2 and c[1] >= c[0]:
            ranges.append((c[0], c[1]))
        else:
            ranges.append((min(c), max(c)))
    return ranges


def cka_heatmap(
    cka,
    *,
    compartments=None,
    sets=None,
    picks: Iterable[int] = (),
    title: str | None = "Linear CKA between layers",
    final_state: str = "post-norm",
    zmin: float | None = 0.0,
    zmax: float | None = 1.0,
    box_select: bool = False,
    colors: Mapping | None = None,
    height: int | None = None,
    kinds: Sequence[str] | None = None,
) -> go.Figure:
    """(N+1)×(N+1) CKA heatmap; `box_select`: a drag draws a selection box (else a drag zooms and a click selects
    a cell); `height`: the chart's height in pixels (default `cka_heatmap_height(N+1)`; two heatmaps side by side
    pass the larger of theirs so that they line up).

    Trace 0 is the heatmap; trace 1 is a transparent marker on every cell so that clicks and box
    selections report cells (heatmaps themselves are not selectable in plotly.js): a selected point
    carries ``customdata = [row layer, column layer, value]``. Compartments are outlined as
    rectangles on the diagonal; the layers of each set are marked in rows above the matrix, the current picks
    by a frame on their diagonal cells. `kinds` (as in `entropy_curve`): each layer's kind in the hover and, where
    the layers are of more than one kind, each layer's tick label on both axes in its kind's color and each kind a
    legend entry.
    """
    z = _matrix(cka)
    n = len(z)
    num_layers = n - 1
    kinds = _kinds(kinds, n)
    labels = _layer_kind_labels([layer_label(i, num_layers, final_state) for i in range(n)], kinds)
    hover = [[[labels[i], labels[j]] for j in range(n)] for i in range(n)]
    fig = go.Figure()
    fig.add_trace(go.Heatmap(
        z=z, x=list(range(n)), y=list(range(n)), zmin=zmin, zmax=zmax, colorscale="Viridis",
        customdata=hover, name="CKA",
        colorbar=dict(title=dict(text="CKA"), thickness=14),
        hovertemplate="layer %{customdata[0]} × layer %{customdata[1]}<br>CKA %{z:.3f}<extra></extra>",
    ))
    xs, ys, cd = [], [], []
    for i in range(n):
        for j in range(n):
            xs.append(j)
            ys.append(i)
            cd.append([i, j, z[i][j]])
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="markers", name="cells", showlegend=False, customdata=cd,
        marker=dict(size=max(4, min(18, 600 // max(n, 1))), color="rgba(0,0,0,0)", symbol="square"),
        selected=dict(marker=dict(color="rgba(255,255,255,0.55)")),
        unselected=dict(marker=dict(opacity=0.0)),
        hovertemplate="layer %{customdata[0]} × layer %{customdata[1]}<br>CKA %{customdata[2]:.3f}<extra></extra>",
    ))
    for start, end in _compartment_ranges(compartments, n):
        fig.add_shape(type="rect", x0=start - 0.5, x1=end + 0.5, y0=start - 0.5, y1=end + 0.5,
                      line=dict(color="white", width=2.5), fillcolor="rgba(0,0,0,0)", layer="above")
    for k, (name, layers) in enumerate(_named_sets(sets)):
        inside = [l for l in layers if 0 <= l < n]
        color = set_color(name, k, layers, colors)
        fig.add_trace(go.Scatter(
            x=inside, y=[n - 0.5 + SET_ROW * (k + 1)] * len(inside), mode="markers", name=f"{name} {layers}",
            marker=dict(size=10, color=color, symbol=SET_SYMBOLS[k % len(SET_SYMBOLS)]),
            unselected=dict(marker=dict(opacity=1.0)),      # a cell selection must not dim the set markers
            customdata=[name] * len(inside), hovertemplate="%{customdata}: layer %{x}<extra></extra>", cliponaxis=False,
        ))
    # picked layers: a red frame around their diagonal cells (shapes: a chart selection does not dim them)
    for p in sorted({int(p) for p in picks if 0 <= int(p) < n}):
        fig.add_shape(type="rect", x0=p - 0.5, x1=p + 0.5, y0=p - 0.5, y1=p + 0.5, name=f"picked {p}",
                      line=dict(color="#ff2d2d", width=3), fillcolor="rgba(255,45,45,0.15)", layer="above")
    if mixed_kinds(kinds):
        _kind_legend(fig, kinds)
    n_sets = len(_named_sets(sets))
    # box_select: dragging draws a selection box; otherwise dragging zooms in (a double click zooms out) and a click
    # selects the cell (Streamlit's chart selects on click, clickmode event+select, whatever the dragmode).
    # uirevision keeps the tool, zoom and pan when the page redraws the figure.
    _base_layout(fig, title, height=height or cka_heatmap_height(n), uirevision="cka-heatmap",
                 dragmode="select" if box_select else "zoom")
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.12, xanchor="left", x=0.0))
    _square_layer_axes(fig, n, top=n - 0.5 + SET_ROW * (n_sets + 0.6) if n_sets else n - 0.5)   # set rows above
    if mixed_kinds(kinds):
        ticks = list(fig.layout.xaxis.tickvals)
        text = [str(t) if t == 0 else f'<span style="color:{KIND_COLORS.get(kinds[t], OTHER_KIND_COLOR)}">'
                f"<b>{t}</b></span>" for t in ticks]
        fig.update_xaxes(ticktext=text)
        fig.update_yaxes(ticktext=text)
    return fig


HEATMAP_MAX_HEIGHT = 560   # px: at 1024 px the page's plot is about 460 px wide, and the square matrix keeps to that
                           # width, so a taller chart left a blank band between the title and the matrix


def cka_heatmap_height(n: int) -> int:
    """Pixel height of the heatmap of an n×n CKA matrix (n = layers + 1): 18 px a row and room for the title and
    legend, between 480 and HEATMAP_MAX_HEIGHT (the matrix is square: more height than the chart's width is blank)."""
    return max(480, min(HEATMAP_MAX_HEIGHT, 18 * n + 200))


def _square_layer_axes(fig: go.Figure, n: int, *, top: float) -> None:
    """Layer axes 0..n-1 of an n×n heatmap: square cells whatever the chart's width and height, the tick labels at
    the matrix's edges. Both axes give up domain, never range, to keep the cells square, so the x axis stays at the
    matrix's lower edge even where the column is narrower than the chart is tall (there a y range grown to fit put
    the labels far below the cells), and the matrix keeps to the bottom of the chart, by its legend. The y range
    runs from the matrix's lower edge to `top` (room for rows of markers above the matrix)."""
    ticks = list(range(0, n, 1 if n <= 32 else 5))
    fig.update_xaxes(title="layer", tickmode="array", tickvals=ticks, range=[-0.5, n - 0.5], constrain="domain",
                     showgrid=False, zeroline=False)
    fig.update_yaxes(title="layer", tickmode="array", tickvals=ticks, range=[-0.5, top], constrain="domain",
                     constraintoward="bottom", scaleanchor="x", scaleratio=1, showgrid=False, zeroline=False)


def _cells(points: Iterable[Mapping]) -> list[tuple[int, int]]:
    """(row, column) of every selected cell; only points of the cell trace (customdata of three numbers) count, so
    set markers and picks drawn on the figure are ignored."""
    out = []
    for p in points:
        cd = p.get("customdata")
        if isinstance(cd, (list, tuple)) and len(cd) == 3:
            out.append((int(cd[0]), int(cd[1])))
    return out


def cells_to_layers(points: Iterable[Mapping]) -> list[int]:
    """Layers picked by a click on the heatmap: the row and column layer of every selected cell (Streamlit/plotly
    selection points)."""
    return sorted({layer for cell in _cells(points) for layer in cell})


def diagonal_layers(points: Iterable[Mapping]) -> list[int]:
    """Layers picked by a box or lasso on the heatmap: those whose own (diagonal) cell it covers. The rows and
    columns of every covered cell would be every layer the box spans on either axis, far more than a draft reads."""
    return sorted({row for row, col in _cells(points) if row == col})


def acceptance_bars(
    acceptance: Mapping[str, Sequence[float]] | Sequence[float],
    *,
    title: str | None = "Acceptance rate per draft position",
    layers: Mapping[str, Sequence[int]] | None = None,
    colors: Mapping | None = None,
) -> go.Figure:
    """Bars of the acceptance rate at draft positions 1..K; several contenders grouped (`layers`: each one's
    layer set, for its color in `colors`)."""
    if not isinstance(acceptance, Mapping):
        acceptance = {"draft": acceptance}
    fig = go.Figure()
    bar_colors = contender_colors(list(acceptance), [(layers or {}).get(name) for name in acceptance], colors)
    for i, (name, rates) in enumerate(acceptance.items()):
        rates = [float(r) for r in _as_list(rates)]
        fig.add_trace(go.Bar(
            x=[f"pos {k + 1}" for k in range(len(rates))], y=rates, name=fmt.escape(name),
            marker=dict(color=bar_colors[i]),
            text=[fmt.percent(r) for r in rates], textposition="outside", cliponaxis=False,
            hovertemplate="%{fullData.name}<br>%{x}: %{y:.1%}<extra></extra>",
        ))
    _base_layout(fig, title, barmode="group", showlegend=len(acceptance) > 1)
    fig.update_yaxes(title="accepted", range=[0, 1.12], tickformat=".0%")
    fig.update_xaxes(title="draft position")
    return fig


def tau_over_time(
    tau_per_step: Sequence[float],
    *,
    running: Sequence[float] | None = None,
    title: str | None = "τ (tokens per target forward) while decoding",
) -> go.Figure:
    """τ of each verification step as points and the running mean as a line."""
    taus = [float(t) for t in _as_list(tau_per_step)]
    if running is None:
        running, total = [], 0.0
        for i, t in enumerate(taus):
            total += t
            running.append(total / (i + 1))
    running = [float(r) for r in _as_list(running)]
    xs = list(range(1, len(taus) + 1))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=taus, mode="markers", name="this step",
                             marker=dict(size=4, color="#aec7e8"),
                             hovertemplate="step %{x}: τ %{y:.0f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=xs[: len(running)], y=running, mode="lines", name="running τ",
                             line=dict(color="#1f77b4", width=2.5),
                             hovertemplate="step %{x}: running τ %{y:.3f}<extra></extra>"))
    fig.add_hline(y=1.0, line=dict(color="#7f7f7f", dash="dot"))
    _base_layout(fig, title)
    fig.update_xaxes(title="verification step")
    fig.update_yaxes(title="tokens per target forward", rangemode="tozero")
    return fig


SCORE_COLUMNS = ("mean_entropy", "mean_cka", "aggregate_entropy", "objective")


def set_comparison(
    rows: Sequence[Mapping],
    *,
    metrics: Sequence[str] = SCORE_COLUMNS,
    title: str | None = "Layer sets compared",
    colors: Mapping | None = None,
) -> go.Figure:
    """One subplot column per metric, one bar per set: compares sets on a common scale.

    rows: [{"name": ..., "layers": [...], <metric>: value, ...}]; a metric missing from every row is
    skipped; a missing value is left blank.
    """
    metrics = [m for m in metrics if any(r.get(m) is not None for r in rows)]
    if not metrics:
        raise ValueError("set_comparison needs at least one metric present in the rows")
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[fmt.name(m) for m in metrics],
                        horizontal_spacing=0.08)
    names = [f"{fmt.escape(r.get('name', '?'))} {fmt.layers(r.get('layers', []))}" for r in rows]
    bar_colors = [set_color(str(r.get("name", "")), i, r.get("layers"), colors) for i, r in enumerate(rows)]
    for c, m in enumerate(metrics, start=1):
        ys = [None if r.get(m) is None else float(r[m]) for r in rows]
        fig.add_trace(go.Bar(
            x=names, y=ys, marker=dict(color=bar_colors), showlegend=False, name=fmt.name(m),
            text=[None if y is None else fmt.number(y) for y in ys], textposition="outside", cliponaxis=False,
            textfont=dict(size=10), hovertemplate="%{x}<br>" + fmt.name(m) + ": %{y:.4f}<extra></extra>",
        ), row=1, col=c)
        top = max((y for y in ys if y is not None), default=1.0)
        fig.update_yaxes(range=[min(0.0, min((y for y in ys if y is not None), default=0.0)), top * 1.18 or 1.0],
                         row=1, col=c)
        # upright labels, one per bar: slanted ones ran into the next subplot's labels on narrow screens
        fig.update_xaxes(showticklabels=len(rows) <= 10, tickangle=-90, automargin=True, tickfont=dict(size=11),
                         row=1, col=c)
    _base_layout(fig, title, showlegend=False, height=480)
    return fig


def _contender(row: Mapping) -> str:
    """A benchmark contender as it reads on an axis: its name (escaped: user text) and its layers."""
    return fmt.escape(str(row.get("name"))) + (f" {fmt.layers(row['layers'])}" if row.get("layers") else "")


def _study_set(row: Mapping) -> str:
    """A study's set as it reads on an axis: its strategies (escaped: a hand-made set's name) and its layers."""
    return fmt.escape("/".join(fmt.strategy(x) for x in row["strategies"])) + f" {fmt.layers(row['layers'])}"


def bench_comparison(
    results: Sequence[Mapping],
    *,
    title: str | None = "τ and speedup per contender",
    colors: Mapping | None = None,
) -> go.Figure:
    """τ and speedup of several drafts (and baselines) side by side, from benchmark result rows, each with its
    interval as an error bar where the row has one (`tau_ci`, `speedup_ci`)."""
    if not results:
        raise ValueError("bench_comparison needs at least one result")
    fig = make_subplots(rows=1, cols=2, subplot_titles=["τ", "speedup (× plain)"], horizontal_spacing=0.12)
    names = [_contender(r) for r in results]
    bar_colors = contender_colors([str(r.get("name", "")) for r in results], [r.get("layers") for r in results], colors)
    tops = []
    for col, (metric, form) in enumerate((("tau", fmt.tau), ("speedup", fmt.speedup)), start=1):
        ys = [None if r.get(metric) is None else float(r[metric]) for r in results]
        cis = [r.get(f"{metric}_ci") if r.get(f"{metric}_ci") and None not in r[f"{metric}_ci"] else None for r in results]
        error = None
        if any(cis):
            error = dict(type="data", symmetric=False, color="#444444", thickness=1.2, width=4,
                         array=[(c[1] - y) if c and y is not None else 0 for c, y in zip(cis, ys)],
                         arrayminus=[(y - c[0]) if c and y is not None else 0 for c, y in zip(cis, ys)])
        fig.add_trace(go.Bar(x=names, y=ys, marker=dict(color=bar_colors), name=fmt.name(metric), error_y=error,
                             text=[None if y is None else form(y) for y in ys], textposition="inside",
                             insidetextanchor="start", textfont=dict(size=10, color="white")), row=1, col=col)
        tops.append(max([c[1] for c in cis if c] + [y for y in ys if y is not None] + [1.0]))
    fig.add_hline(y=1.0, line=dict(color="#7f7f7f", dash="dot"), row=1, col=2)
    _base_layout(fig, title, showlegend=False, height=460)
    fig.update_annotations(font_size=12)
    # upright contender names and axis titles that say the unit: slanted names ran into each other and
    # long subplot titles into the next subplot in a half-width column; values inside the bars (above them they
    # were cut by the next subplot at 1024 px), intervals as error bars
    fig.update_xaxes(tickangle=-90, automargin=True, tickfont=dict(size=11))
    fig.update_yaxes(title="tokens per target forward", rangemode="tozero", row=1, col=1)
    for col, top in enumerate(tops, start=1):
        fig.update_yaxes(range=[0, top * 1.12], row=1, col=col)
    return fig


def runs_comparison(
    runs: Mapping[str, Sequence[Mapping]],
    *,
    metric: str = "tau",
    title: str | None = None,
) -> go.Figure:
    """One metric ("tau" or "speedup") of several benchmark runs overlaid: one group per contender (name and
    layers), one bar per run with its interval as an error bar. runs: {run label: result rows}."""
    if not runs:
        raise ValueError("runs_comparison needs at least one run")
    form = fmt.tau if metric == "tau" else fmt.speedup
    names = list(dict.fromkeys(_contender(r) for rows in runs.values() for r in rows))
    fig = go.Figure()
    for i, (label, rows) in enumerate(runs.items()):
        by = {_contender(r): r for r in rows}
        ys = [None if by.get(n, {}).get(metric) is None else float(by[n][metric]) for n in names]
        cis = [by.get(n, {}).get(f"{metric}_ci") for n in names]
        has = [bool(c) and None not in c and y is not None for c, y in zip(cis, ys)]
        fig.add_trace(go.Bar(
            x=names, y=ys, name=fmt.escape(label), marker=dict(color=CURVE_COLORS[i % len(CURVE_COLORS)] if i < 2
                                                       else SET_COLORS[i % len(SET_COLORS)]),
            text=[None if y is None else form(y) for y in ys], textposition="inside", insidetextanchor="start",
            textfont=dict(size=10, color="white"),
            error_y=dict(type="data", symmetric=False, color="#444444", thickness=1.2, width=4,
                         array=[(c[1] - y) if h else 0 for c, y, h in zip(cis, ys, has)],
                         arrayminus=[(y - c[0]) if h else 0 for c, y, h in zip(cis, ys, has)]) if any(has) else None))
    _base_layout(fig, title or ("τ of each contender, run by run" if metric == "tau" else "Speedup of each contender, run by run"),
                 barmode="group", height=420, legend=LEGEND_RIGHT)
    fig.update_xaxes(tickangle=-90, automargin=True, tickfont=dict(size=11))
    fig.update_yaxes(title="tokens per target forward" if metric == "tau" else "× plain decoding", rangemode="tozero")
    if metric == "speedup":
        fig.add_hline(y=1.0, line=dict(color="#7f7f7f", dash="dot"))
    return fig


def cost_curve(
    points: Sequence[Mapping],
    *,
    draft_step_seconds: float | None = None,
    steps: Sequence[Mapping] = (),
    title: str | None = "Cost of verifying T tokens here",
) -> go.Figure:
    """A cost curve ([{tokens, seconds}], layerscope profile / bench JSON) as multiples of a one-token forward, with
    one draft step (`draft_step_seconds`) as a dotted line, and `steps`: benchmark rows ({name, verified_tokens,
    break_even_tau, curve_break_even_tau}) each marked at the tokens its step verifies with what a whole step cost
    (its break-even τ, the number its verdict names) beside what the curve priced it at."""
    if not points:
        raise ValueError("cost_curve needs at least one point")
    base = float(points[0]["seconds"])
    fig = go.Figure(go.Scatter(x=[int(p["tokens"]) for p in points], y=[float(p["seconds"]) / base for p in points],
                               mode="lines+markers", name="target forward",
                               hovertemplate="T=%{x}: %{y:.2f}× a one-token forward<extra></extra>"))
    shown = [x for x in steps if x.get("verified_tokens") and x.get("break_even_tau") is not None]
    for what, key, symbol in (("step measured", "break_even_tau", "diamond"),
                              ("step on the curve", "curve_break_even_tau", "circle-open")):
        marked = [x for x in shown if x.get(key) is not None]
        if marked:
            fig.add_trace(go.Scatter(
                x=[int(x["verified_tokens"]) for x in marked], y=[float(x[key]) for x in marked], mode="markers",
                name=what, marker=dict(symbol=symbol, size=10), text=[fmt.escape(str(x.get("name", ""))) for x in marked],
                hovertemplate="%{text}: a whole step cost %{y:.3f}× a one-token forward (its break-even τ), "
                              + what + "<extra></extra>"))
    if draft_step_seconds:
        fig.add_hline(y=float(draft_step_seconds) / base, line=dict(color="#7f7f7f", dash="dot"),
                      annotation_text="one draft step" + (" (measured)" if shown else ""),
                      annotation_position="top left")
    fig.update_xaxes(title_text="tokens verified in one forward (T)")
    fig.update_yaxes(title_text="cost (× one-token forward)", rangemode="tozero")
    _base_layout(fig, title, showlegend=bool(shown), height=380)
    return fig


def study_intervals(
    rows: Sequence[Mapping],
    *,
    title: str | None = "Study: τ per layer set with its 95% interval",
    colors: Mapping | None = None,
) -> go.Figure:
    """τ of each set of a study with its paired bootstrap interval (`tau_ci`), the default rule's τ as a
    dotted line, and each training seed's τ as small marks. rows: `study --json` rows."""
    if not rows:
        raise ValueError("study_intervals needs at least one row")
    names = [_study_set(r) for r in rows]
    taus = [r.get("tau") for r in rows]
    ci = [r.get("tau_ci") or [t, t] for r, t in zip(rows, taus)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=names, y=taus, mode="markers", name="τ (mean over seeds)",
        marker=dict(size=11, color=[set_color(n, i, r["layers"], colors) for i, (n, r) in enumerate(zip(names, rows))]),
        error_y=dict(type="data", symmetric=False, array=[(c[1] - t) if t is not None else None for c, t in zip(ci, taus)],
                     arrayminus=[(t - c[0]) if t is not None else None for c, t in zip(ci, taus)]),
        hovertemplate="%{x}<br>τ %{y:.3f}<extra></extra>"))
    seeds_x = [n for n, r in zip(names, rows) for _ in r.get("seeds") or []]
    seeds_y = [s.get("tau") for r in rows for s in r.get("seeds") or []]
    if seeds_x:
        fig.add_trace(go.Scatter(x=seeds_x, y=seeds_y, mode="markers", name="τ of one training seed",
                                 marker=dict(size=6, symbol="line-ew-open", color="#333333")))
    ref = next((t for r, t in zip(rows, taus) if "default" in r["strategies"]), None)
    if ref is not None:
        fig.add_hline(y=ref, line=dict(color=DEFAULT_SET_COLOR, dash="dot"), annotation_text="default rule")
    return _base_layout(fig, title, height=420, yaxis_title="τ (tokens / target forward)", legend=LEGEND_RIGHT)


def study_proxies(
    rows: Sequence[Mapping],
    version: str,
    proxies: Sequence[str] = ("mean_entropy", "mean_cka", "aggregate_entropy"),
    *,
    correlations: Sequence[Mapping] = (),
    title: str | None = None,
    colors: Mapping | None = None,
) -> go.Figure:
    """τ (with its interval) against each proxy, one panel per proxy, one point per set of a study: the
    statistics proxies of one version ("linear, H≥0.5"), then the training-free probe's held-out agreement
    and the drafts' own held-out agreement at position 1 where the rows have them. Each panel's title gives
    the proxy's Spearman ρ with τ and its 95% interval, read from `correlations` (`study --json`'s: proxy,
    version, rho, ci). rows: `study --json` rows (`proxies[version]`, `probe`, `val_accuracy`)."""
    if not rows:
        raise ValueError("study_proxies needs at least one row")
    # (proxy, the version its correlation is filed under, x per row)
    panels = [(p, version, [(r.get("proxies") or {}).get(version, {}).get(p) for r in rows]) for p in proxies]
    if any(r.get("probe") for r in rows):
        panels.append(("probe", "held-out agreement", [(r.get("probe") or {}).get("agreement") for r in rows]))
    if any(r.get("val_accuracy") for r in rows):
        panels.append(("val_accuracy@1", "training", [(r.get("val_accuracy") or [None])[0] for r in rows]))
    rho = {(c.get("proxy"), c.get("version")): c for c in correlations}

    def head(proxy, filed):
        name = fmt.name(proxy)
        if len(panels) > 3:                      # narrow panels: the name on two lines ("held-out / agreement @1")
            name = name.replace(" ", "<br>", 1)
        c = rho.get((proxy, filed))
        if c is None or c.get("rho") is None:
            return name + ("<br>ρ n/a" if c is not None else "")
        return f"{name}<br>ρ {fmt.interval(c['rho'], c.get('ci'), 'delta')}"

    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[head(p, f) for p, f, _ in panels],
                        shared_yaxes=True, horizontal_spacing=0.04 if len(panels) > 3 else 0.06)
    names = [_study_set(r) for r in rows]
    taus = [r.get("tau") for r in rows]
    ci = [r.get("tau_ci") or [t, t] for r, t in zip(rows, taus)]
    for j, (proxy, _, x) in enumerate(panels):
        fig.add_trace(go.Scatter(
            x=x, y=taus, mode="markers", text=names, showlegend=False,
            marker=dict(size=10, color=[set_color(n, i, r["layers"], colors) for i, (n, r) in enumerate(zip(names, rows))]),
            error_y=dict(type="data", symmetric=False,
                         array=[(c[1] - t) if t is not None else None for c, t in zip(ci, taus)],
                         arrayminus=[(t - c[0]) if t is not None else None for c, t in zip(ci, taus)]),
            hovertemplate="%{text}<br>" + fmt.name(proxy) + " %{x:.3f}<br>τ %{y:.3f}<extra></extra>"), row=1, col=j + 1)
    fig.update_yaxes(title_text="τ", row=1, col=1)
    _base_layout(fig, title or f"Study: τ against each proxy ({version}), Spearman ρ [95% interval]", height=420)
    fig.update_layout(margin=dict(t=115))                  # the title above panel titles of up to three lines
    fig.update_annotations(font_size=12)
    return fig


def training_curves(
    history: Sequence[Mapping],
    *,
    title: str | None = "Draft training",
) -> go.Figure:
    """Loss and per-TTT-step accuracy over training steps.

    history: [{"step": int, "loss": float, "accuracy": [acc step 1, acc step 2, ...]}, ...]
    """
    fig = make_subplots(rows=1, cols=2, subplot_titles=["loss", "accuracy per draft step"])
    steps = [int(h["step"]) for h in history]
    fig.add_trace(go.Scatter(x=steps, y=[float(h["loss"]) for h in history], mode="lines", name="loss",
                             line=dict(color="#1f77b4")), row=1, col=1)
    depth = max((len(_as_list(h.get("accuracy") or [])) for h in history), default=0)
    for k in range(depth):
        ys = [(_as_list(h.get("accuracy") or []) + [None] * depth)[k] for h in history]
        fig.add_trace(go.Scatter(x=steps, y=ys, mode="lines", name=f"step {k + 1}",
                                 line=dict(color=SET_COLORS[k % len(SET_COLORS)])), row=1, col=2)
    fig.update_yaxes(range=[0, 1], tickformat=".0%", row=1, col=2)
    fig.update_xaxes(title="training step")
    _base_layout(fig, title, height=380)
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0.0))
    return fig


def learning_curves(curves: Mapping[str, Sequence], *, step: int = 0,
                    title: str | None = "Held-out agreement as the drafts see more tokens",
                    layers: Mapping[str, Sequence[int]] | None = None, colors: Mapping | None = None) -> go.Figure:
    """One line per layer set: agreement at TTT step `step`+1 (every held-out position; the estimate of
    first-position acceptance for step 0) against tokens seen; the hover shows every step's agreement and
    SpecForge's simulated_acc_len (draft.training.loss.simulated_acc_len) at each point.

    curves: {set name: [[tokens seen, [agreement per TTT step]], ...]} (layerscope.json's "curve")."""
    fig = go.Figure()
    for i, (name, points) in enumerate(curves.items()):
        pts = [(int(t), [float(v) for v in _as_list(a)]) for t, a in points if len(_as_list(a)) > step]
        hover = [" / ".join(f"{v:.1%}" for v in a) + f"<br>simulated_acc_len {simulated_acc_len(a):.3f}" for _, a in pts]
        fig.add_trace(go.Scatter(x=[t for t, _ in pts], y=[a[step] for _, a in pts], mode="lines+markers", name=fmt.escape(name),
                                 customdata=hover, hovertemplate="%{x:,} tokens: agreement per draft step %{customdata}"
                                 "<extra>%{fullData.name}</extra>",
                                 line=dict(color=set_color(str(name), i, (layers or {}).get(name), colors))))
    fig.update_xaxes(title="tokens seen")
    fig.update_yaxes(title=f"agreement, draft step {step + 1}", tickformat=".0%", rangemode="tozero")
    _base_layout(fig, title, height=360)
    return fig


def figure_config(filename: str, image_format: str = "png") -> dict:
    """Plotly config for the chart toolbar: download as PNG or SVG under a useful file name."""
    fmt = image_format.lower()
    if fmt not in ("png", "svg"):
        raise ValueError(f"image format must be png or svg, not {image_format!r}")
    return {
        "displaylogo": False,
        "toImageButtonOptions": {"format": fmt, "filename": filename, "scale": 2 if fmt == "png" else 1},
        # the chart's one download is the button under it (ui.widgets.chart); the toolbar keeps zoom and pan
        "modeBarButtonsToRemove": ["lasso2d", "toImage"],
    }


def figure_html(fig: go.Figure, *, offline: bool = True) -> str:
    """A standalone HTML page of the figure; offline embeds plotly.js so it opens without network."""
    return fig.to_html(include_plotlyjs=True if offline else "cdn", full_html=True,
                       config={"displaylogo": False})


# ---------------------------------------------------------------------------- comparing two captures

COMPARE_COLORS = ["#1f77b4", "#d62728"]     # capture A, capture B (the Compare page)


def entropy_overlay(
    curves: Mapping[str, Sequence[float]],
    *,
    title: str | None = "Matrix entropy per layer, two captures",
    y_title: str = "entropy (nats)",
    final_states: Sequence[str] = (),
) -> go.Figure:
    """Per-layer curves of several captures on one figure (the Compare page).

    curves: name -> values for layers 0..N of that capture ([N+1] each; N may differ between curves).
    When every curve has the same N the x axis is the layer index; otherwise each curve is drawn
    against relative depth l / N (0 = embeddings, 1 = the final state) and the axis says so.
    """
    if not curves:
        raise ValueError("entropy_overlay needs at least one curve")
    named = [(fmt.escape(name), [float(v) for v in _as_list(vals)]) for name, vals in curves.items()]
    if any(len(v) < 2 for _, v in named):
        raise ValueError("every curve needs values for layers 0..N with N >= 1")
    relative = len({len(v) for _, v in named}) > 1
    fig = go.Figure()
    for i, (name, ys) in enumerate(named):
        n = len(ys) - 1
        final = final_states[i] if i < len(final_states) else "post-norm"
        xs = [l / n for l in range(n + 1)] if relative else list(range(n + 1))
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name=name,
            line=dict(color=COMPARE_COLORS[i] if i < len(COMPARE_COLORS) else CURVE_COLORS[i % len(CURVE_COLORS)],
                      width=2, dash="solid" if i == 0 else "dash"),
            marker=dict(size=5, symbol=SET_SYMBOLS[i % len(SET_SYMBOLS)]),
            customdata=[f"{layer_label(l, n, final)} of {n}" for l in range(n + 1)],
            hovertemplate="%{fullData.name}<br>layer %{customdata}<br>%{y:.4f}<extra></extra>",
        ))
    _base_layout(fig, title)
    if relative:
        fig.update_xaxes(title="relative depth (layer / N; the captures have different N)", range=[-0.02, 1.02],
                         tickformat=".0%")
    else:
        n_points = len(named[0][1])
        fig.update_xaxes(title="layer (hidden_states index)", dtick=1 if n_points <= 40 else 5,
                         range=[-0.5, n_points - 0.5])
    fig.update_yaxes(title=y_title)
    return fig


def cka_difference_heatmap(
    diff,
    *,
    kernel: str = "linear",
    estimator: str = "biased",
    names: tuple[str, str] = ("A", "B"),
    title: str | None = None,
    final_state: str = "post-norm",
) -> go.Figure:
    """(N+1)×(N+1) heatmap of CKA(A) − CKA(B): a diverging scale centred on 0, symmetric about it
    (red: A's two layers are more alike than B's; blue: less). The title names the kernel and estimator."""
    z = _matrix(diff)
    n = len(z)
    num_layers = n - 1
    top = max((abs(v) for row in z for v in row), default=0.0) or 1e-6
    labels = [layer_label(i, num_layers, final_state) for i in range(n)]
    a, b = (fmt.escape(x) for x in names)
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(n)), y=list(range(n)), zmin=-top, zmax=top, colorscale="RdBu", reversescale=True,
        customdata=[[[labels[i], labels[j]] for j in range(n)] for i in range(n)], name="ΔCKA",
        colorbar=dict(title=dict(text=f"ΔCKA ({a} − {b})"), thickness=14),
        hovertemplate="layer %{customdata[0]} × layer %{customdata[1]}<br>ΔCKA %{z:+.4f}<extra></extra>",
    ))
    _base_layout(fig, title or f"CKA difference {names[0]} − {names[1]} ({kernel} kernel, {estimator})",
                 height=cka_heatmap_height(n))
    _square_layer_axes(fig, n, top=n - 0.5)
    return fig
