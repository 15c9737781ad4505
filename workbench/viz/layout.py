"""Putting figures together: two side by side, a chart of any table column, and thinned tick labels."""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis.common import check_choice
from workbench.viz._common import _template


def _one_fixed_scale(left: go.Figure, right: go.Figure) -> bool:
    """Whether each figure is one heatmap, and both have the same colour scale with the same fixed ends."""
    maps = [[t for t in f.data if isinstance(t, go.Heatmap)] for f in (left, right)]
    if any(len(m) != 1 for m in maps):
        return False
    a, b = maps[0][0], maps[1][0]
    return (a.coloraxis is None and b.coloraxis is None and a.zmin is not None and a.zmax is not None
            and (a.zmin, a.zmax) == (b.zmin, b.zmax) and a.colorscale == b.colorscale)


def side_by_side(left: go.Figure, right: go.Figure, titles: Optional[tuple[str, str]] = None,
                 theme: Optional[str] = "default") -> go.Figure:
    """Two figures in one row (e.g. a model clean and ablated, or two models)."""
    for source in (left, right):
        if any(getattr(trace, "xaxis", None) not in (None, "x") for trace in source.data):
            raise ValueError("side_by_side takes single-panel figures; this one has several subplots")
    titles = titles or tuple((f.layout.title.text or "") for f in (left, right))
    spacing = 0.28  # room for the left panel's colour bar and the right panel's tick labels
    # Two heatmaps on one fixed scale (two attention patterns, 0 to 1) share one colour bar, at the
    # right: the left one's, between the panels, ran into the right panel's axis title once its tick
    # labels were a real tokenizer's words.
    shared = _one_fixed_scale(left, right)
    spacing = 0.16 if shared else spacing  # no bar between the panels: the right one's tick labels only
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=spacing)
    for col, source in ((1, left), (2, right)):
        for trace in source.data:
            trace = go.Figure(trace).data[0]  # a copy, so the source figure is left alone
            if isinstance(trace, go.Heatmap) and trace.coloraxis is None and shared:
                trace.update(showscale=col == 2, colorbar=dict(x=1.0, len=0.9, thickness=12))
            elif isinstance(trace, go.Heatmap) and trace.coloraxis is None:
                trace.update(colorbar=dict(x=0.5 - spacing / 2 + 0.01 if col == 1 else 1.0, len=0.9, thickness=12))
            if isinstance(trace, go.Heatmap) and trace.coloraxis is not None:
                axis = source.layout.coloraxis
                trace.update(coloraxis=None, colorscale=axis.colorscale, zmin=axis.cmin, zmax=axis.cmax,
                             showscale=col == 2)
            fig.add_trace(trace, row=1, col=col)
        # the source's own ticks (every token labelled, say), so thin_ticks can thin them after
        ticks = lambda ax: {k: v for k, v in dict(type=ax.type, tickmode=ax.tickmode, tickvals=ax.tickvals,  # noqa: E731
                                                      ticktext=ax.ticktext).items() if v is not None}
        fig.update_xaxes(title=source.layout.xaxis.title.text, **ticks(source.layout.xaxis), row=1, col=col)
        fig.update_yaxes(title=source.layout.yaxis.title.text, autorange=source.layout.yaxis.autorange,
                         **ticks(source.layout.yaxis), row=1, col=col)
    named = any(trace.name for trace in fig.data)
    fig.update_layout(template=_template(theme), showlegend=named)
    return fig


def table_chart(table: pd.DataFrame, x: str, y: str, color: Optional[str] = None, kind: str = "bar",
                theme: Optional[str] = "default") -> tuple[go.Figure, str]:
    """A bar, line or scatter chart of ``y`` against ``x`` (one trace per ``color`` value),
    and a note for the reader ("" when there is nothing to say).

    Bars never stack silently: where several rows share an x (and colour), each bar is
    their mean and the note says how many rows each bar averages; lines are drawn through
    the means the same way; a scatter shows every row.
    """
    check_choice("kind", kind, ("bar", "line", "scatter"))
    for column in (x, y) + ((color,) if color else ()):
        if column not in table:
            raise ValueError(f"the table has no column {column!r}; it has {list(table.columns)}")
    keys = [x] + ([color] if color and color != x else [])
    note = ""
    frame = table[keys + [y]].dropna(subset=[y])
    if kind != "scatter":
        counts = frame.groupby(keys, sort=False, dropna=False)[y].transform("size")
        if (counts > 1).any():
            most = int(counts.max())
            note = (f"Several rows share each {' and '.join(keys)} (up to {most}): each "
                    f"{'bar' if kind == 'bar' else 'point'} is their mean. Pick a colour column or filter "
                    "the rows to split them.")
            frame = frame.groupby(keys, sort=False, dropna=False, as_index=False)[y].mean()
    groups = frame.groupby(color, sort=False) if color else [(None, frame)]
    fig = go.Figure()
    for name, part in groups:
        label = None if name is None else str(name)
        if kind == "bar":
            fig.add_bar(x=part[x], y=part[y], name=label)
        else:
            fig.add_scatter(x=part[x], y=part[y], name=label, mode="lines+markers" if kind == "line" else "markers")
    fig.update_layout(barmode="group", template=_template(theme), xaxis_title=x, yaxis_title=y,
                      showlegend=color is not None, legend_title=color)
    return fig, note


def thin_ticks(fig: go.Figure, max_labels: int = 16, axis: str = "x") -> go.Figure:
    """Label every k-th category of the figure's ``axis`` axes so at most ``max_labels`` show (for a
    figure drawn in a narrow column, where every token's label would pile onto its neighbours);
    every category keeps its hover."""
    for ax in fig.select_xaxes() if axis == "x" else fig.select_yaxes():
        values = list(ax.tickvals) if ax.tickvals is not None else None
        if not values or len(values) <= max_labels:
            continue
        step = -(-len(values) // max_labels)
        texts = list(ax.ticktext) if ax.ticktext is not None else values
        ax.update(tickvals=values[::step], ticktext=texts[::step])
    return fig
