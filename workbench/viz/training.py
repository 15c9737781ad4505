"""Loss: curves from a checkpoint's ``metrics.csv``, a live training curve, and per-token loss bars
(one run or several side by side)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench.analysis.common import unique_labels
from workbench.viz._common import CORRECT, PAIR, PALETTE, WRONG, _one_batch, _template


def loss_curves(metrics: Union[str, Path, pd.DataFrame], title: str = "Loss", log_x: bool = False,
                theme: Optional[str] = "default", colours: Optional[dict] = None) -> go.Figure:
    """Train and validation loss against step, from ``metrics.csv`` (a path, a checkpoint
    directory, or its DataFrame: step, train_loss, val_loss, ...). A ``run`` column gives
    one pair of curves per run, in one colour per run (train solid, validation dashed);
    ``colours`` maps run names to colours (default: plotly's sequence)."""
    if not isinstance(metrics, pd.DataFrame):
        from workbench.training import read_metrics  # the one reader of metrics.csv, beside its writer

        metrics = read_metrics(metrics)
    if "step" not in metrics:
        raise ValueError(f"metrics need a 'step' column; got {list(metrics.columns)}")
    runs = metrics.groupby("run", sort=False) if "run" in metrics else [("", metrics)]
    fig = go.Figure()
    for i, (run, part) in enumerate(runs):
        colour = (colours or {}).get(run, PALETTE[i % len(PALETTE)])
        for column, dash in (("train_loss", "solid"), ("val_loss", "dash")):
            if column in part and part[column].notna().any():
                rows = part[part[column].notna()]
                name = f"{run} {column}".strip()
                fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines", name=name,
                                         line=dict(dash=dash, color=colour), legendgroup=str(run)))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss (nats)", template=_template(theme),
                      xaxis_type="log" if log_x else None)
    return fig


def token_loss_figure(losses: Union[pd.DataFrame, dict[str, pd.DataFrame]], title: str = "Per-token loss",
                      batch: Optional[int] = 0, theme: Optional[str] = "default", colours: Optional[dict] = None) -> go.Figure:
    """Bars of the loss of predicting each token, placed at the token predicted (``"4: cat"``).

    ``losses``: a ``token_losses`` table (bars green where the top prediction was right, red
    where not; hover names the token before and the prediction), or a dict name -> table of
    the same tokens (grouped bars, one colour per name: e.g. clean and ablated, or two models;
    ``colours`` maps names to colours, so a model keeps its colour across figures).
    """
    single = isinstance(losses, pd.DataFrame)
    fig = go.Figure()
    for i, (name, frame) in enumerate(({"": losses} if single else losses).items()):
        frame = _one_batch(frame, batch)
        x = unique_labels(frame["next_token"].tolist(), positions=(frame["pos"] + 1).tolist())
        if not single:
            fig.add_bar(x=x, y=frame["loss"], name=name, marker_color=(colours or {}).get(name, PAIR[i % 2]),
                        hovertemplate=f"{name}<br>" + "%{x}<br>loss %{y:.3f} nats<extra></extra>")
            continue
        fig.add_bar(x=x, y=frame["loss"], marker_color=np.where(frame["correct"], CORRECT, WRONG),
                    customdata=np.stack([frame["predicted"], frame["token"]], axis=-1),
                    hovertemplate="%{x}<br>loss %{y:.3f}<br>after %{customdata[1]!r}, "
                                  "top prediction %{customdata[0]!r}<extra></extra>")
    fig.update_layout(title=title, barmode="group", yaxis_title="loss (nats)", template=_template(theme),
                      xaxis_title="token predicted" + (" (green: top-1 correct)" if single else ""),
                      height=340, margin=dict(t=40, b=10))
    fig.update_xaxes(type="category", tickangle=-60)
    return fig


def live_loss_figure(history: list[dict], total_steps: int, max_points: int = 400,
                     theme: Optional[str] = "default", chance: Optional[float] = None) -> go.Figure:
    """The loss of a run in progress: ``history`` rows (``step``, ``train_loss``) on an x axis of
    the whole run (0 to ``total_steps``) from the first point, lines and markers so one point shows,
    at most ``max_points`` drawn (evenly thinned; the last row always). ``chance`` (ln of the
    vocabulary: a uniform guess, where an untrained model starts) is drawn as a dashed line, so a
    curve that has not left it reads as a model that has learned nothing yet."""
    if not history:
        raise ValueError("no rows yet: draw the figure once the run has logged a step")
    every = -(-len(history) // max_points)
    rows = history[::every] + ([history[-1]] if (len(history) - 1) % every else [])
    fig = go.Figure(go.Scatter(x=[r["step"] for r in rows], y=[r["train_loss"] for r in rows],
                               mode="lines+markers" if len(rows) < 60 else "lines", name="train loss",
                               hovertemplate="step %{x}<br>loss %{y:.4f}<extra></extra>"))
    fig.update_xaxes(title="step", range=[0, max(1, total_steps)], tickformat="d")
    fig.update_yaxes(title="train loss (nats)", rangemode="tozero")
    if chance is not None:
        fig.add_hline(y=chance, line=dict(color="#7f7f7f", dash="dash", width=1),
                      annotation_text=f"chance (uniform guess): {chance:.2f}", annotation_position="bottom right")
    fig.update_layout(title=f"Training loss, step {history[-1]['step']} of {total_steps}", height=280,
                      template=_template(theme), margin=dict(t=40, b=40))
    return fig
