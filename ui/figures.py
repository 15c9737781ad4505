"""Plotly figures the pages draw that ``workbench.viz`` does not provide (per-token loss, norms).

Each takes a tidy DataFrame from the library and only arranges it. Axes carry the token
strings, position-prefixed ("3: the") so repeated tokens stay distinct; colours are plotly
scales that read on light and dark backgrounds (the page draws them with Streamlit's theme).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go


def labels(pos, token) -> list[str]:
    return [f"{p}: {t}" for p, t in zip(pos, token)]


def token_losses(df: pd.DataFrame, title: str = "Per-token loss") -> go.Figure:
    """Bars of the loss of predicting each token (x: the token predicted, at its own position).

    ``df`` is a ``workbench.analysis.token_losses`` table of one sequence.
    """
    x = labels(df["pos"] + 1, df["next_token"])
    fig = go.Figure(go.Bar(
        x=x, y=df["loss"], marker_color=np.where(df["correct"], "#2ca02c", "#d62728"),
        customdata=np.stack([df["predicted"], df["token"]], axis=-1),
        hovertemplate="%{x}<br>loss %{y:.3f}<br>after %{customdata[1]!r}, top prediction %{customdata[0]!r}<extra></extra>",
    ))
    fig.update_layout(title=title, yaxis_title="loss (nats)", xaxis_title="token (green: top-1 correct)",
                      height=320, margin=dict(t=40, b=10))
    fig.update_xaxes(type="category", tickangle=-60)
    return fig


def token_losses_compare(frames: dict[str, pd.DataFrame], title: str = "Per-token loss") -> go.Figure:
    """Grouped bars of per-token loss, one colour per name (same tokens in every frame)."""
    fig = go.Figure()
    for name, df in frames.items():
        fig.add_bar(x=labels(df["pos"] + 1, df["next_token"]), y=df["loss"], name=name)
    fig.update_layout(title=title, barmode="group", yaxis_title="loss (nats)", height=340, margin=dict(t=40, b=10))
    fig.update_xaxes(type="category", tickangle=-60)
    return fig


def residual_norms(df: pd.DataFrame, title: str = "Residual-stream norm") -> go.Figure:
    """The norm at every position across layers (thin lines, hover names the token), and the mean.

    All positions share one trace (NaN breaks the line between them): one trace per
    position made this figure slow to build for long prompts.
    """
    df = df.sort_values(["pos", "layer"])
    order = df.drop_duplicates("layer")["layer_label"].tolist()
    n_layer = len(order)
    x, y, text = [], [], []
    for pos, sub in df.groupby("pos", sort=True):
        x += sub["layer_label"].tolist() + [None]
        y += sub["norm"].tolist() + [None]
        text += [f"{pos}: {sub['token'].iloc[0]}"] * (n_layer + 1)
    fig = go.Figure()
    fig.add_scatter(x=x, y=y, text=text, mode="lines", line=dict(width=1), opacity=0.35, name="each position",
                    hovertemplate="%{text}<br>%{x}: %{y:.2f}<extra></extra>")
    mean = df.groupby("layer", as_index=False).agg(norm=("norm", "mean"), layer_label=("layer_label", "first"))
    fig.add_scatter(x=mean["layer_label"], y=mean["norm"], mode="lines+markers", line=dict(width=3), name="mean")
    fig.update_layout(title=title, yaxis_title="L2 norm", height=340, margin=dict(t=40))
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig
