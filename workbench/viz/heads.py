"""Layer x head heatmaps: head scores (``analysis.heads``) and any sweep's table, with clickable
cells for a page."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis.common import head_label, unit_label
from workbench.viz._common import DIVERGING, SEQUENTIAL, _template, subplot_spacing


def head_scores_figure(scores: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """A ``head_scores`` table (long form: layer, head, kind, score): one layer x head heatmap
    per kind of score, two to a row, every cell's score written in it."""
    for column in ("layer", "head", "kind", "score"):
        if column not in scores:
            raise ValueError(f"head_scores_figure takes the long head_scores table; it has no {column!r}")
    kinds = scores["kind"].nunique()
    rows = -(-kinds // 2)
    height = rows * max(200, 60 * scores["layer"].nunique() + 90) + 120
    # 110 px between rows: the tick labels and "head" of one row, then the next row's panel titles.
    fig = layer_head_figure(scores, "score", facet="kind", theme=theme, units="score", columns=2,
                            row_gap=min(0.4, 110 / height))
    fig.update_layout(title="Head scores (layer × head, one panel per kind)", height=height + 40 * (rows - 1))
    return fig


# A layer's row holds its 12 px tick label in 15 px, and 10 px cell text in 22 px; a head's column
# 22 px, or 34 px for a value written in it ("-0.05" at 10 px). The rest: plotly's margins (180 px
# tall; 160 px wide) and the colour bar with its title (about 100 px).
ROW_PX, TEXT_ROW_PX, COLUMN_PX, TEXT_COLUMN_PX = 15, 22, 22, 34
MIN_HEIGHT, MAX_HEIGHT, MIN_WIDTH, MAX_WIDTH = 450, 4000, 450, 1600


def _grid_size(n_layers: int, n_heads: int, n_rows: int, per_row: int, down: float, across: float,
               text: bool) -> dict:
    """The height and width that give each layer a readable row and each head a readable column
    (30 layers of 9 heads with their values written in: 840 x 566 px), within sane bounds.
    ``down`` / ``across``: the gaps between rows / columns of panels, fractions of the plot."""
    # many rows of panels: each keeps about 200 px instead of sharing plotly's default 450
    height = 120 + 220 * n_rows if n_rows > 2 else MIN_HEIGHT
    rows_px = (TEXT_ROW_PX if text else ROW_PX) * n_layers * n_rows / (1 - down * (n_rows - 1))
    height = min(MAX_HEIGHT, max(height, int(np.ceil(180 + rows_px))))
    columns_px = (TEXT_COLUMN_PX if text else COLUMN_PX) * n_heads * per_row / (1 - across * (per_row - 1))
    width = min(MAX_WIDTH, max(MIN_WIDTH, int(np.ceil(260 + columns_px))))
    return {"height": height, "width": width}


def layer_head_figure(frame: pd.DataFrame, value: str = "delta", title: str = "",
                      facet: Optional[str] = None, theme: Optional[str] = "default", units: Optional[str] = None,
                      clickable: bool = False, text: Optional[bool] = None, columns: Optional[int] = None,
                      row_gap: float = 0.12) -> go.Figure:
    """A layer x head heatmap of ``value`` (e.g. an ablation sweep's ``delta``, or head scores).

    With ``facet`` (a column such as ``method`` or ``kind``), one panel per value of it,
    ``columns`` panels to a row (default: all in one row). ``units`` titles the colour bar (default: the column name). ``text`` writes each cell's
    value in it at 10 px (default: when all panels of a row have at most 12 heads together). ``row_gap``: the space
    between rows of panels, a fraction of the height (room for ticks, an axis title and the next
    panel's title). ``clickable`` lays a
    scatter point on every cell: plotly heatmaps emit no selection events, scatter points
    do, so a click on a cell selects that point (its ``customdata`` is [layer, head, value])
    and a page can act on it; the points also carry the hover text.
    """
    for column in ("layer", "head", value) + ((facet,) if facet else ()):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    # Stacked with tables that have no heads, the columns turn float (NaN there): back to whole numbers.
    frame = frame[frame["head"] >= 0].astype({"layer": int, "head": int})
    panels = sorted(frame[facet].unique()) if facet else [None]
    per_row = min(len(panels), columns or len(panels))
    n_rows = -(-len(panels) // per_row)
    across, down = subplot_spacing(n_rows, per_row, vertical=row_gap, horizontal=0.08)
    fig = make_subplots(rows=n_rows, cols=per_row, subplot_titles=[str(p) for p in panels] if facet else None,
                        horizontal_spacing=across if per_row > 1 else 0.06,
                        vertical_spacing=down if n_rows > 1 else 0.12)
    diverging = bool((frame[value] < 0).any() and (frame[value] > 0).any())
    limit = float(frame[value].abs().max()) or 1.0
    # 10 px cell text needs about 30 px a cell: up to 12 cells across the figure (hover has them all).
    text = frame["head"].nunique() * per_row <= 12 if text is None else text
    hover = "%{y} %{x}<br>" + value + " %{z:.4f}" + (f" {units}" if units else "") + "<extra></extra>"
    for i, panel in enumerate(panels):
        r, c = i // per_row + 1, i % per_row + 1
        part = frame if panel is None else frame[frame[facet] == panel]
        grid = part.pivot_table(index="layer", columns="head", values=value, aggfunc="mean")
        xs, ys = [head_label(h) for h in grid.columns], [unit_label(l) for l in grid.index]
        fig.add_trace(go.Heatmap(
            z=grid.to_numpy(), x=xs, y=ys, coloraxis="coloraxis",
            texttemplate="%{z:.2f}" if text else None, textfont=dict(size=10),
            hovertemplate=hover, hoverinfo="skip" if clickable else None,
        ), row=r, col=c)
        if clickable:
            layers, heads = np.meshgrid(grid.index.to_numpy(), grid.columns.to_numpy(), indexing="ij")
            values = grid.to_numpy()
            fig.add_trace(go.Scatter(
                x=[head_label(h) for h in heads.ravel()], y=[unit_label(l) for l in layers.ravel()], mode="markers",
                # A list, not an array: plotly sends arrays as typed arrays, and a browser hands a
                # clicked point's row of one back as {"0": .., "1": ..} instead of a list.
                customdata=np.stack([layers.ravel(), heads.ravel(), values.ravel()], axis=-1).tolist(),
                marker=dict(symbol="square-open", size=22, color="white", line=dict(width=3), opacity=0),
                selected=dict(marker=dict(opacity=1)), unselected=dict(marker=dict(opacity=0)),
                hovertemplate="%{y} %{x}<br>" + value + " %{customdata[2]:.4f}" + (f" {units}" if units else "")
                              + "<br>click to ablate<extra></extra>",
                showlegend=False, name="cells",
            ), row=r, col=c)
    axis = dict(colorscale=DIVERGING, cmid=0, cmin=-limit, cmax=limit) if diverging else dict(colorscale=SEQUENTIAL)
    fig.update_layout(coloraxis={**axis, "colorbar": dict(title=units or value)}, title=title or value,
                      template=_template(theme))
    fig.update_layout(**_grid_size(frame["layer"].nunique(), frame["head"].nunique(), n_rows, per_row,
                                   down if n_rows > 1 else 0.0, across if per_row > 1 else 0.0, text))
    if clickable:
        # Every click lands on the nearest cell's point, wherever in the cell it is.
        fig.update_layout(hovermode="closest", hoverdistance=-1, clickmode="event+select", dragmode=False)
    fig.update_xaxes(title="head", type="category")
    fig.update_yaxes(autorange="reversed", type="category")
    if clickable and len(panels) == 1:
        # The cells fill the panel exactly: the clickable points' markers would otherwise pad the axes'
        # autorange, moving each row off its cell by a growing amount (a row down by layer 17 of 30).
        n_layers, n_heads = frame["layer"].nunique(), frame["head"].nunique()
        fig.update_xaxes(autorange=False, range=[-0.5, n_heads - 0.5])
        fig.update_yaxes(autorange=False, range=[n_layers - 0.5, -0.5])
    for r in range(1, n_rows + 1):
        fig.update_yaxes(title="layer", row=r, col=1)
    return fig
