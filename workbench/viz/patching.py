"""Activation patching heatmaps (``analysis.patching``) and the spread of an effect over prompts
(``analysis.per_prompt``)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench.analysis.common import unique_labels, unit_label
from workbench.viz._common import DIVERGING, SEQUENTIAL, _template
from workbench.viz.heads import layer_head_figure


def patching_figure(frame: pd.DataFrame, site: str, value: str = "metric", tokens: Optional[list[str]] = None,
                    units: str = "", theme: Optional[str] = "default") -> go.Figure:
    """One site of an ``activation_patching`` table as a heatmap: layer x position for the
    residual / attention / MLP sites (``tokens`` label the positions), layer x head for ``head``.
    ``value``: ``metric`` or ``restored`` (the fraction of the clean-corrupted gap restored)."""
    part = frame[frame["site"] == site]
    if part.empty:
        raise ValueError(f"the table has no rows for site={site!r}; it has {sorted(frame['site'].unique())}")
    if value not in part:
        raise ValueError(f"the table has no column {value!r}")
    what = "fraction restored" if value == "restored" else (f"metric ({units})" if units else "metric")
    if site == "head":
        fig = layer_head_figure(part, value, units=what, theme=theme,
                                title=f"Patching each head's output (all positions): {what}")
        return fig
    grid = part.pivot_table(index="layer", columns="pos", values=value, aggfunc="mean")
    n = grid.shape[1]
    xs = unique_labels(tokens[:n]) if tokens else [str(p) for p in grid.columns]
    ys = [unit_label(l) for l in grid.index]
    z = grid.to_numpy(dtype=float)
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=ys, colorscale=SEQUENTIAL if value == "restored" else DIVERGING,
        zmid=None if value == "restored" else float(np.nanmean([part["corrupted"].iloc[0], part["clean"].iloc[0]])),
        colorbar=dict(title=what), texttemplate="%{z:.2f}" if n <= 20 else None, textfont=dict(size=11),
        hovertemplate="%{y} at %{x}<br>" + what + " %{z:.4f}<extra></extra>",
    ))
    fig.update_xaxes(title="position", tickangle=-60, type="category", tickmode="array", tickvals=xs, ticktext=xs)
    fig.update_yaxes(title="layer", autorange="reversed", type="category")
    fig.update_layout(title=f"Patching {site} by layer and position: {what}", template=_template(theme),
                      height=max(300, 60 * len(ys) + 200))
    return fig


def prompt_spread_figure(frame: pd.DataFrame, value: str = "delta", by: str = "label", title: str = "",
                         units: str = "", theme: Optional[str] = "default") -> go.Figure:
    """The spread over prompts of a per-prompt table (``ablation_sweep(..., per_prompt=True)``):
    one box per ``by`` group with every prompt as a point (hover names the prompt), in the order
    the groups first appear."""
    for column in (by, value, "prompt"):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    fig = go.Figure()
    for name, part in frame.groupby(by, sort=False):
        fig.add_trace(go.Box(y=part[value], name=str(name), boxpoints="all", jitter=0.4, pointpos=0,
                             customdata=part["prompt"],
                             hovertemplate="%{x}<br>prompt %{customdata}: %{y:.4f}<extra></extra>"))
    fig.update_layout(title=title or f"{value} per prompt", yaxis_title=units or value, showlegend=False,
                      template=_template(theme), height=380)
    return fig
