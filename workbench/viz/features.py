"""Sparse dictionary features (tables from ``analysis.features``): contexts, histograms, logit
effects, densities, a feature's attribution, and values per token."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis.common import unique_labels
from workbench.viz._common import LAST_POSITION, NEGATIVE, PAIR, POSITIVE, _template


# ---- sparse dictionary features (tables from workbench.analysis.features) -----------------------
def feature_contexts_figure(contexts: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """Max-activating contexts, one row each: every token coloured by the feature's activation there.

    Takes ``max_activating_contexts``' table; the activating token is in ``[[ ]]``.
    """
    for column in ("context_tokens", "context_acts", "context_max", "activation"):
        if column not in contexts:
            raise ValueError(f"the table has no column {column!r}; pass max_activating_contexts' table")
    if contexts.empty:
        raise ValueError("no contexts: the feature never fired on these tokens")
    width = max(len(t) for t in contexts["context_tokens"])
    z = np.full((len(contexts), width), np.nan)
    text = np.full((len(contexts), width), "", dtype=object)
    for r, (tokens, acts, at) in enumerate(zip(contexts["context_tokens"], contexts["context_acts"], contexts["context_max"])):
        z[r, : len(acts)] = acts
        text[r, : len(tokens)] = [f"[[{t.strip()}]]" if i == at else t.strip() for i, t in enumerate(tokens)]
    # Each row's label: its rank and the feature's activation at its [[token]] (what orders the rows).
    labels = [f"#{rank}: {act:.2f}" for rank, act in zip(contexts["rank"], contexts["activation"])]
    text = np.vectorize(lambda t: t.replace("\n", "⏎"), otypes=[object])(text)
    fig = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", textfont=dict(size=11), x=list(range(width)), y=labels,
        colorscale="Oranges", zmin=0,
        hovertemplate="%{text}<br>activation %{z:.3f}<extra></extra>", colorbar=dict(title="activation"),
    ))
    feature = contexts["feature"].iloc[0] if "feature" in contexts else ""
    fig.update_layout(title=f"Feature {feature}: max-activating contexts", template=_template(theme),
                      height=max(250, 32 * len(contexts) + 120))
    fig.update_xaxes(showticklabels=False, title="token (the context around the activating [[token]])")
    fig.update_yaxes(autorange="reversed", type="category", title="rank: max activation")
    return fig


def feature_histogram_figure(histogram: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """The activation histogram of one feature (``feature_histogram``'s table), its density in the title."""
    for column in ("bin_left", "bin_right", "count", "density"):
        if column not in histogram:
            raise ValueError(f"the table has no column {column!r}; pass feature_histogram's table")
    centers = (histogram["bin_left"] + histogram["bin_right"]) / 2
    fig = go.Figure(go.Bar(x=centers, y=histogram["count"], width=histogram["bin_right"] - histogram["bin_left"],
                           marker_color=POSITIVE, hovertemplate="activation %{x:.3f}<br>count %{y}<extra></extra>"))
    feature = histogram["feature"].iloc[0] if "feature" in histogram else ""
    fig.update_layout(title=f"Feature {feature}: activations when firing (density {histogram['density'].iloc[0]:.2%})",
                      xaxis_title="activation", yaxis_title="positions", template=_template(theme), bargap=0.02)
    return fig


def feature_logits_figure(effects: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """Top and bottom logit effects of one feature (``feature_logit_effects``' table) as horizontal bars."""
    for column in ("direction", "token", "effect"):
        if column not in effects:
            raise ValueError(f"the table has no column {column!r}; pass feature_logit_effects' table")
    top = effects[effects["direction"] == "top"].sort_values("effect")
    bottom = effects[effects["direction"] == "bottom"].sort_values("effect", ascending=False)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("suppressed", "promoted"), horizontal_spacing=0.2)
    fig.add_trace(go.Bar(x=bottom["effect"], y=unique_labels(bottom["token"].tolist()), orientation="h",
                         marker_color=NEGATIVE, hovertemplate="%{y}: %{x:.3f}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=top["effect"], y=unique_labels(top["token"].tolist()), orientation="h",
                         marker_color=POSITIVE, hovertemplate="%{y}: %{x:.3f}<extra></extra>"), row=1, col=2)
    feature = effects["feature"].iloc[0] if "feature" in effects and len(effects) else ""
    fig.update_layout(title=f"Feature {feature}: logit effects (decoder direction through W_U)", showlegend=False,
                      template=_template(theme))
    return fig


def feature_density_figure(table: pd.DataFrame, theme: Optional[str] = "default") -> go.Figure:
    """How often the features fire: a histogram of log10 density over ``feature_table``'s rows (dead ones counted apart)."""
    if "density" not in table:
        raise ValueError(f"the table has no column 'density'; it has {list(table.columns)}")
    density = table["density"].to_numpy(dtype=float)
    alive = density[density > 0]
    fig = go.Figure(go.Histogram(x=np.log10(alive), nbinsx=40, marker_color=POSITIVE,
                                 hovertemplate="log10 density %{x}<br>features %{y}<extra></extra>"))
    fig.update_layout(title=f"Feature density ({len(density) - len(alive)} of {len(density)} never fired)",
                      xaxis_title="log10(fraction of tokens where the feature fires)", yaxis_title="features",
                      template=_template(theme))
    return fig


def feature_dla_figure(dla: pd.DataFrame, feature: Optional[int] = None, k: int = 12, batch: int = 0, title: str = "",
                       theme: Optional[str] = "default") -> go.Figure:
    """The ``k`` features with the largest |direct logit attribution| (``feature_dla``'s table, one
    batch row) as bars, ``feature`` highlighted (and added when it is not among the ``k``)."""
    for column in ("feature", "dla", "activation"):
        if column not in dla:
            raise ValueError(f"the table has no column {column!r}; pass feature_dla's table")
    frame = dla[dla["batch"] == batch] if "batch" in dla else dla
    shown = frame.reindex(frame["dla"].abs().sort_values(ascending=False).index).head(k)
    if feature is not None and feature not in set(shown["feature"]):
        shown = pd.concat([shown, frame[frame["feature"] == feature]])
    shown = shown.sort_values("dla")
    chosen = shown["feature"].to_numpy() == feature
    colours = np.where(chosen, LAST_POSITION, np.where(shown["dla"] >= 0, POSITIVE, NEGATIVE))
    fig = go.Figure(go.Bar(x=shown["dla"], y=[f"#{f}" for f in shown["feature"]], orientation="h",
                           marker_color=colours, customdata=shown["activation"],
                           hovertemplate="feature %{y}<br>DLA %{x:.3f}<br>activation %{customdata:.3f}<extra></extra>"))
    fig.update_layout(title=title or "Direct logit attribution of the firing features", template=_template(theme),
                      xaxis_title="direct logit attribution (logit units)", yaxis_title="feature",
                      height=max(260, 24 * len(shown) + 120), margin=dict(t=40))
    fig.update_yaxes(type="category")
    return fig


def token_values_figure(frame: pd.DataFrame, value: str, group: Optional[str] = None, title: str = "",
                        boundary: Optional[int] = None, units: str = "", theme: Optional[str] = "default",
                        colours: Optional[dict] = None) -> go.Figure:
    """A value per token (``project``'s projection, a feature's activation), one line per ``group``
    (e.g. clean and steered runs) against the position, each point hovering its token.
    ``boundary``: the first generated position, marked by a dashed line."""
    for column in ("pos", "token", value) + ((group,) if group else ()):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    fig = go.Figure()
    parts = frame.groupby(group, sort=False) if group else [("", frame)]
    for i, (name, part) in enumerate(parts):
        part = part.sort_values("pos")
        colour = (colours or {}).get(name, PAIR[i % 2] if group else POSITIVE)
        fig.add_scatter(x=part["pos"], y=part[value], mode="lines+markers", name=str(name), line=dict(color=colour),
                        text=part["token"].astype(str), hovertemplate=(f"{name}<br>" if group else "")
                        + "%{x}: %{text!r}<br>" + f"{value} " + "%{y:.3f}<extra></extra>")
    if boundary is not None:
        fig.add_vline(x=boundary - 0.5, line_dash="dash", line_color="#7f7f7f",
                      annotation_text="generated →", annotation_position="top right")
    fig.update_layout(title=title or value, template=_template(theme), xaxis_title="position",
                      yaxis_title=value + (f" ({units})" if units else ""), height=340, margin=dict(t=40),
                      showlegend=bool(group))
    return fig
