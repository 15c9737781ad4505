"""Over training (tables from ``analysis.dynamics.over_training``): a measure per snapshot, layer x
head over training, runs compared, and a step marked on any figure."""

from __future__ import annotations

from typing import Optional, Union

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz._common import PALETTE, SEQUENTIAL, STEP_MARK, _history_of, _template, subplot_spacing


def over_training_figure(frame: pd.DataFrame, value: Union[str, list, None] = None,
                         history: Optional[pd.DataFrame] = None, losses: Optional[pd.DataFrame] = None,
                         title: str = "", theme: str = "light") -> go.Figure:
    """A metric against training step above the loss curve, on one shared step axis.

    ``frame`` is ``analysis.over_training``'s table. With ``layer`` and ``head`` columns (head
    scores), each line is the best head at each step, one line per ``kind`` (hover names the
    head); otherwise one line per ``value`` column (default: ``score``, else every numeric
    column). The lower panel draws the run's loss curve (``history``, default the one
    ``over_training`` attached) and any columns of ``losses`` (a table with a ``step`` column,
    e.g. the loss on repeated tokens measured at each snapshot).
    """
    if "step" not in frame:
        raise ValueError(f"the table has no 'step' column (make it with analysis.over_training); it has {list(frame.columns)}")
    per_head = {"layer", "head"} <= set(frame.columns)
    skip = {"step", "layer", "head", "batch"}
    if value is None:
        value = "score" if "score" in frame else [c for c in frame.columns
                                                   if c not in skip and pd.api.types.is_numeric_dtype(frame[c])]
    values = [value] if isinstance(value, str) else list(value)
    for column in values:
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.06)
    for column in values:
        groups = frame.groupby("kind", sort=False) if per_head and "kind" in frame else [(column, frame)]
        for name, part in groups:
            if per_head:  # the best head at each step, and which one it is
                best = part.loc[part.groupby("step")[column].idxmax()].sort_values("step")
                label = [f"L{l}H{h}" for l, h in zip(best["layer"], best["head"])]
                fig.add_trace(go.Scatter(x=best["step"], y=best[column], mode="lines+markers", name=f"{name} (best head)",
                                         text=label, hovertemplate="step %{x}<br>%{text}: %{y:.3f}<extra>" + str(name) + "</extra>"),
                              row=1, col=1)
            else:
                part = part.groupby("step", as_index=False)[column].mean()
                fig.add_trace(go.Scatter(x=part["step"], y=part[column], mode="lines+markers", name=column), row=1, col=1)
    curve = _history_of(frame, history)
    for column, dash in (("train_loss", "solid"), ("val_loss", "dot")):
        if column in curve and curve[column].notna().any():
            rows = curve[curve[column].notna()]
            fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines", name=column,
                                     line=dict(dash=dash, width=1.5)), row=2, col=1)
    for column in ([] if losses is None else [c for c in losses.columns if c != "step"]):
        rows = losses[losses[column].notna()]
        fig.add_trace(go.Scatter(x=rows["step"], y=rows[column], mode="lines+markers", name=column), row=2, col=1)
    fig.update_yaxes(title_text=values[0] if len(values) == 1 else "value", row=1, col=1)
    fig.update_yaxes(title_text="loss", row=2, col=1)
    fig.update_xaxes(title_text="training step", row=2, col=1)
    fig.update_layout(title=title or f"{', '.join(values)} over training", template=_template(theme),
                      hovermode="x unified", height=560)
    return fig


def layer_head_over_training(frame: pd.DataFrame, value: str = "score", title: str = "",
                             theme: str = "light") -> go.Figure:
    """A layer x head heatmap of ``value`` per training step, with a slider over the steps.

    ``frame`` is ``analysis.over_training(series, analysis.head_scores, ...)``'s table; with a
    ``kind`` column, one panel per kind. The colour scale is fixed across steps, so a head
    that lights up is one that changed.
    """
    for column in ("step", "layer", "head", value):
        if column not in frame:
            raise ValueError(f"the table has no column {column!r}; it has {list(frame.columns)}")
    kinds = list(dict.fromkeys(frame["kind"])) if "kind" in frame else [None]
    steps = sorted(frame["step"].unique())
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[str(k) for k in kinds] if kinds[0] else None,
                        horizontal_spacing=subplot_spacing(1, len(kinds))[0])
    for i, step in enumerate(steps):
        for c, kind in enumerate(kinds, 1):
            part = frame[(frame["step"] == step) & ((frame["kind"] == kind) if kind is not None else True)]
            grid = part.pivot_table(index="layer", columns="head", values=value, aggfunc="mean")
            fig.add_trace(go.Heatmap(z=grid.to_numpy(), x=[f"H{h}" for h in grid.columns],
                                     y=[f"L{l}" for l in grid.index], coloraxis="coloraxis", visible=i == 0,
                                     hovertemplate=f"step {step}<br>" + "%{y} %{x}<br>" + value
                                                   + " %{z:.3f}<extra></extra>"), row=1, col=c)
    n = len(kinds)
    slider = [dict(method="update", label=str(step),
                   args=[{"visible": [j // n == i for j in range(len(steps) * n)]}, {"title.text": f"{title or value} at step {step}"}])
              for i, step in enumerate(steps)]
    low, high = float(frame[value].min()), float(frame[value].max())
    fig.update_layout(coloraxis=dict(colorscale=SEQUENTIAL, cmin=min(0.0, low), cmax=max(high, 1e-9),
                                     colorbar=dict(title=value)),
                      sliders=[dict(active=0, steps=slider, currentvalue=dict(prefix="step "), pad=dict(t=40))],
                      title=f"{title or value} at step {steps[0]}" if steps else title, template=_template(theme))
    fig.update_yaxes(autorange="reversed")
    return fig


def mark_step(fig: go.Figure, step: Union[int, float], label: Optional[str] = None) -> go.Figure:
    """``fig`` with a dashed vertical line at ``step`` on its x axis, through every row of a
    figure whose rows share that axis (the loss curve under a score over training)."""
    fig.add_shape(type="line", xref="x", yref="paper", x0=step, x1=step, y0=0, y1=1,
                  line=dict(color=STEP_MARK, width=2, dash="dash"))
    fig.add_annotation(x=step, xref="x", y=1, yref="paper", yanchor="bottom", showarrow=False,
                       text=label if label is not None else f"step {step}", font=dict(color=STEP_MARK))
    return fig


def _best_per_step(frame: pd.DataFrame, value: str) -> pd.DataFrame:
    """The row of the highest ``value`` at each step (the best head, for per-head tables)."""
    return frame.loc[frame.groupby("step")[value].idxmax()].sort_values("step")


def runs_over_training_figure(tables: dict, value: str = "score", step: Union[int, float, None] = None, title: str = "",
                              theme: str = "light") -> go.Figure:
    """Several runs' ``over_training`` tables on one step axis: per run and ``kind``, the best
    head's ``value`` at each step (one colour per run, one dash per kind) above each run's
    training loss (from the tables' ``attrs["history"]``); ``step`` is marked when given."""
    if not tables:
        raise ValueError("tables is empty: pass {run name: over_training table}")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.06)
    dashes = ("solid", "dash", "dot", "dashdot")
    for i, (run, frame) in enumerate(tables.items()):
        for column in ("step", "layer", "head", value):
            if column not in frame:
                raise ValueError(f"the table of {run!r} has no column {column!r}; it has {list(frame.columns)}")
        colour = PALETTE[i % len(PALETTE)]
        groups = frame.groupby("kind", sort=False) if "kind" in frame else [(value, frame)]
        for j, (kind, part) in enumerate(groups):
            best = _best_per_step(part, value)
            fig.add_trace(go.Scatter(x=best["step"], y=best[value], mode="lines+markers", name=f"{run}: {kind}",
                                     line=dict(color=colour, dash=dashes[j % len(dashes)]), legendgroup=run,
                                     text=[f"L{l}H{h}" for l, h in zip(best["layer"], best["head"])],
                                     hovertemplate="step %{x}<br>%{text}: %{y:.3f}<extra>" + f"{run}: {kind}</extra>"),
                          row=1, col=1)
        curve = _history_of(frame, None)
        if "train_loss" in curve and curve["train_loss"].notna().any():
            rows = curve[curve["train_loss"].notna()]
            fig.add_trace(go.Scatter(x=rows["step"], y=rows["train_loss"], mode="lines", name=f"{run}: train_loss",
                                     line=dict(color=colour, width=1.5), legendgroup=run), row=2, col=1)
    fig.update_yaxes(title_text=f"best head's {value}", row=1, col=1)
    fig.update_yaxes(title_text="loss", row=2, col=1)
    fig.update_xaxes(title_text="training step", row=2, col=1)
    fig.update_layout(title=title or f"{value} over training, {len(tables)} runs aligned by step",
                      template=_template(theme), hovermode="x unified", height=560)
    return mark_step(fig, step) if step is not None else fig
