"""Direct logit attribution bars (tables from ``analysis.attribution``) and their difference."""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from workbench.analysis.common import check_choice
from workbench.viz._common import NEGATIVE, PAIR, _one_batch, _template


DLA_KINDS = {"embed": "token embedding", "pos_embed": "position embedding", "head": "attention head",
             "attn_bias": "attention output bias", "attn": "attention layer", "mlp": "MLP",
             "final_bias": "final norm + unembedding bias"}
DLA_COLOURS = {"embed": "#7f7f7f", "pos_embed": "#bcbd22", "head": "#2f6db5", "attn_bias": "#9ecae1",
               "attn": "#2f6db5", "mlp": "#9467bd", "final_bias": "#8c564b"}


def _structural_zeros(frame: pd.DataFrame) -> pd.DataFrame:
    """Drop the bias parts that are exactly zero in every row: a model without biases still
    lists them (zero by structure, not by measurement), and a bar of 0 says nothing."""
    bias = frame["kind"].isin(["attn_bias", "final_bias"])
    zero = ~frame["attribution"].ne(0).groupby(frame["component"]).transform("any")
    return frame[~(bias & zero)]


def dla_figure(dla: pd.DataFrame, granularity: str = "layer", batch: Optional[int] = None,
               theme: Optional[str] = "default") -> go.Figure:
    """Direct logit attribution bars, one per component (averaged over the batch unless
    ``batch``), coloured by kind with a legend; bias parts that are zero by construction
    (no-bias models) are left out."""
    check_choice("granularity", granularity, ("head", "layer"))
    frame = _one_batch(dla, batch)
    frame = _structural_zeros(frame[frame["granularity"] == granularity])
    order = frame.drop_duplicates("component")["component"].tolist()
    kinds = frame.drop_duplicates("component").set_index("component")["kind"]
    mean = frame.groupby("component", sort=False)["attribution"].mean().reindex(order)
    total = frame.groupby("batch")["total"].first().mean()
    fig = go.Figure()
    for kind in dict.fromkeys(kinds.reindex(order)):
        names = [c for c in order if kinds[c] == kind]
        fig.add_bar(x=names, y=mean.reindex(names).to_numpy(), name=DLA_KINDS.get(kind, kind),
                    marker_color=DLA_COLOURS.get(kind), hovertemplate="%{x}<br>attribution %{y:.4f} logits<extra></extra>")
    fig.update_layout(title=f"Direct logit attribution (parts sum to {total:.3f})", template=_template(theme),
                      xaxis_title="component", yaxis_title="direct attribution (logits)", barmode="relative",
                      legend_title="part")
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig


def dla_difference_figure(diff: pd.DataFrame, granularity: str = "layer", batch: Optional[int] = None,
                          theme: Optional[str] = "default") -> go.Figure:
    """A ``dla_difference`` table: each component's attribution clean and changed (bars) and
    clean - changed (markers); structurally zero bias parts left out."""
    check_choice("granularity", granularity, ("head", "layer"))
    frame = _one_batch(diff, batch)
    frame = frame[frame["granularity"] == granularity]
    bias = frame["kind"].isin(["attn_bias", "final_bias"])
    zero = ~(frame["clean"].ne(0) | frame["changed"].ne(0)).groupby(frame["component"]).transform("any")
    frame = frame[~(bias & zero)]
    order = frame.drop_duplicates("component")["component"].tolist()
    mean = frame.groupby("component", sort=False)[["clean", "changed", "difference"]].mean().reindex(order)
    fig = go.Figure()
    fig.add_bar(x=order, y=mean["clean"], name="clean", marker_color=PAIR[0],
                hovertemplate="%{x}<br>clean %{y:.4f} logits<extra></extra>")
    fig.add_bar(x=order, y=mean["changed"], name="ablated", marker_color=PAIR[1],
                hovertemplate="%{x}<br>ablated %{y:.4f} logits<extra></extra>")
    fig.add_scatter(x=order, y=mean["difference"], name="clean − ablated", mode="markers",
                    marker=dict(symbol="diamond", size=10, color=NEGATIVE),
                    hovertemplate="%{x}<br>clean − ablated %{y:.4f} logits<extra></extra>")
    totals = frame.groupby("batch")[["total_clean", "total_changed"]].first().mean()
    fig.update_layout(title=f"Direct logit attribution: clean {totals['total_clean']:.3f}, "
                            f"ablated {totals['total_changed']:.3f}",
                      barmode="group", template=_template(theme), xaxis_title="component",
                      yaxis_title="direct attribution (logits)")
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig
