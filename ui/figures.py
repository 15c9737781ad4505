"""Plotly figures the pages draw that ``workbench.viz`` does not (yet) provide.

Each takes a tidy DataFrame from the library and only arranges it. Axes carry the token
strings, position-prefixed ("3: the") so repeated tokens stay distinct; colours are plotly
scales that read on light and dark backgrounds (the page draws them with Streamlit's theme).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

SEQUENTIAL = "Viridis"
DIVERGING = "RdBu"


def labels(pos, token) -> list[str]:
    return [f"{p}: {t}" for p, t in zip(pos, token)]


def token_losses(df: pd.DataFrame, title: str = "Per-token loss") -> go.Figure:
    """Bars of the loss of predicting each token (x: the token predicted)."""
    x = labels(df["pos"], df["token"])
    fig = go.Figure(go.Bar(
        x=x, y=df["loss"], marker_color=np.where(df["correct"], "#2ca02c", "#d62728"),
        customdata=np.stack([df["predicted"], df["context"]], axis=-1),
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
        fig.add_bar(x=labels(df["pos"], df["token"]), y=df["loss"], name=name)
    fig.update_layout(title=title, barmode="group", yaxis_title="loss (nats)", height=340, margin=dict(t=40, b=10))
    fig.update_xaxes(type="category", tickangle=-60)
    return fig


def _pattern_matrix(df: pd.DataFrame) -> tuple[np.ndarray, list[str], list[str]]:
    n = int(df["query_pos"].max()) + 1
    m = np.full((n, n), np.nan)
    m[df["query_pos"].to_numpy(), df["key_pos"].to_numpy()] = df["attention"].to_numpy()
    first = df.drop_duplicates("query_pos").sort_values("query_pos")
    names = labels(first["query_pos"], first["query_token"])
    return m, names, names


def attention_heatmap(df: pd.DataFrame, layer: int, head: int, title: str | None = None) -> go.Figure:
    """One head's pattern: query tokens down, key tokens across."""
    sub = df[(df["layer"] == layer) & (df["head"] == head)]
    m, q, k = _pattern_matrix(sub)
    fig = go.Figure(go.Heatmap(
        z=m, x=k, y=q, colorscale=SEQUENTIAL, zmin=0, zmax=1, colorbar=dict(title="attn"),
        hovertemplate="query %{y}<br>key %{x}<br>attention %{z:.3f}<extra></extra>",
    ))
    fig.update_layout(title=title or f"Attention, layer {layer} head {head}", height=520, margin=dict(t=40))
    fig.update_xaxes(type="category", tickangle=-60, title="key")
    fig.update_yaxes(type="category", autorange="reversed", title="query")
    return fig


def attention_grid(df: pd.DataFrame, title: str = "Every head") -> go.Figure:
    """Every head's pattern as small multiples: one row per layer, one column per head."""
    layers, heads = sorted(df["layer"].unique()), sorted(df["head"].unique())
    mats = []
    for layer in layers:
        for head in heads:
            m, names, _ = _pattern_matrix(df[(df["layer"] == layer) & (df["head"] == head)])
            mats.append(m)
    fig = px.imshow(
        np.stack(mats), facet_col=0, facet_col_wrap=len(heads), color_continuous_scale=SEQUENTIAL,
        zmin=0, zmax=1, x=names, y=names, aspect="equal", facet_row_spacing=0.03, facet_col_spacing=0.01,
    )
    for i, ann in enumerate(sorted(fig.layout.annotations, key=lambda a: int(a.text.split("=")[1]))):
        ann.text = f"L{layers[i // len(heads)]}H{heads[i % len(heads)]}"
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=False)
    fig.update_layout(title=title, height=max(260, 200 * len(layers)) + 60, margin=dict(t=60),
                      coloraxis_colorbar=dict(title="attn"))
    return fig


def logit_lens(df: pd.DataFrame, value: str = "target_prob", title: str = "Logit lens") -> go.Figure:
    """Layers down, positions across; colour = ``value``, text = the lens' top token."""
    df = df.sort_values(["layer", "pos"])
    ys = df.drop_duplicates("layer")["layer_label"].tolist()
    first = df.drop_duplicates("pos")
    xs = labels(first["pos"], first["token"])
    n_layer, n_pos = len(ys), len(xs)
    z = df[value].to_numpy(dtype=float).reshape(n_layer, n_pos)
    text = df["top1"].to_numpy().reshape(n_layer, n_pos)
    target = df["target"].to_numpy().reshape(n_layer, n_pos)
    scale = dict(zmin=0, zmax=1) if value.endswith("prob") else {}
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=ys, text=text, texttemplate="%{text}", textfont=dict(size=10),
        customdata=target, colorscale=SEQUENTIAL, colorbar=dict(title=value.replace("_", " ")), **scale,
        hovertemplate="%{y}<br>at %{x}<br>top: %{text}<br>next token %{customdata}: %{z:.3f}<extra></extra>",
    ))
    fig.update_layout(title=title, height=max(300, 45 * n_layer + 160), margin=dict(t=40))
    fig.update_xaxes(type="category", tickangle=-60, title="position (input token; cell text: the lens' top prediction)")
    fig.update_yaxes(type="category", autorange="reversed")
    return fig


def dla_bars(df: pd.DataFrame, title: str) -> go.Figure:
    """Direct logit attribution per component, coloured by sign."""
    fig = go.Figure(go.Bar(
        x=df["component"], y=df["attribution"],
        marker_color=np.where(df["attribution"] >= 0, "#1f77b4", "#d62728"),
        hovertemplate="%{x}: %{y:.3f}<extra></extra>",
    ))
    fig.update_layout(title=title, yaxis_title="logit contribution", height=340, margin=dict(t=40))
    fig.update_xaxes(type="category", tickangle=-60)
    return fig


def residual_norms(df: pd.DataFrame, title: str = "Residual-stream norm") -> go.Figure:
    """One line per position across layers (hover names the token), plus the mean."""
    order = df.drop_duplicates("layer").sort_values("layer")["layer_label"].tolist()
    fig = go.Figure()
    for pos, sub in df.groupby("pos"):
        sub = sub.sort_values("layer")
        fig.add_scatter(x=sub["layer_label"], y=sub["norm"], mode="lines", line=dict(width=1), opacity=0.35,
                        name=f"{pos}: {sub['token'].iloc[0]}", showlegend=False)
    mean = df.groupby("layer", as_index=False).agg(norm=("norm", "mean"), layer_label=("layer_label", "first"))
    fig.add_scatter(x=mean["layer_label"], y=mean["norm"], mode="lines+markers", line=dict(width=3), name="mean")
    fig.update_layout(title=title, yaxis_title="L2 norm", height=340, margin=dict(t=40))
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig


def training_curves(frames: dict[str, pd.DataFrame], title: str = "Training curve") -> go.Figure:
    """train and val loss against step, for one or several checkpoints' metrics.csv."""
    fig = go.Figure()
    for name, df in frames.items():
        prefix = f"{name} " if len(frames) > 1 else ""
        for col, dash in (("train_loss", "solid"), ("val_loss", "dot")):
            if col in df and df[col].notna().any():
                d = df[df[col].notna()]
                fig.add_scatter(x=d["step"], y=d[col], mode="lines", name=f"{prefix}{col.replace('_', ' ')}",
                                line=dict(dash=dash))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss (nats)", height=340, margin=dict(t=40))
    return fig
