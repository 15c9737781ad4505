"""The vocabulary (tables from ``analysis.vocab``): the direct path of a token and its neighbours."""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from workbench.viz._common import NEGATIVE, PAIR, POSITIVE, _template


# ---- the vocabulary (tables from analysis.vocab) ------------------------------------------------
def direct_path_figure(path: pd.DataFrame, token: str = "", theme: Optional[str] = "default") -> go.Figure:
    """Horizontal bars of the next tokens the direct path after ``token`` promotes (blue) and
    demotes (red), from ``analysis.direct_path``: logit minus the vocabulary's mean."""
    frame = path.sort_values("centred_logit")
    fig = go.Figure(go.Bar(
        x=frame["centred_logit"], y=[f"{t!r} ({i})" for t, i in zip(frame["token"], frame["id"])], orientation="h",
        marker_color=[POSITIVE if v >= 0 else NEGATIVE for v in frame["centred_logit"]],
        hovertemplate="%{y}: %{x:.3f} logits above the mean<extra></extra>"))
    fig.update_layout(title=f"Direct path after {token!r}: next tokens promoted and demoted", template=_template(theme),
                      xaxis_title="logit − mean logit (logits)", yaxis_title="next token",
                      height=max(300, 22 * len(frame) + 120), margin=dict(l=10))
    return fig


def neighbours_figure(neighbours: pd.DataFrame, token: str = "", space: str = "embed",
                      theme: Optional[str] = "default") -> go.Figure:
    """Bars of cosine similarity to ``token`` for its nearest tokens, from ``analysis.token_neighbours``."""
    frame = neighbours.sort_values("cosine")
    fig = go.Figure(go.Bar(x=frame["cosine"], y=[f"{t!r} ({i})" for t, i in zip(frame["token"], frame["id"])],
                           orientation="h", marker_color=PAIR[0],
                           hovertemplate="%{y}: cosine %{x:.3f}<extra></extra>"))
    fig.update_layout(title=f"Nearest tokens to {token!r} ({space}ding)", template=_template(theme),
                      xaxis_title="cosine similarity", yaxis_title="token", xaxis_range=[min(0.0, float(frame.cosine.min())), 1],
                      height=max(300, 22 * len(frame) + 120), margin=dict(l=10))
    return fig
