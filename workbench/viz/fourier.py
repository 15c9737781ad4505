"""The grokking paper's figures (``analysis.fourier``): the progress measures with their phases, and
the Fourier norms of the embedding."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz._common import PALETTE, POSITIVE, _template, subplot_spacing


# ---- the grokking paper's figures (workbench.analysis.fourier) ------------------------------------
PHASE_LABELS = {"memorised": "memorised", "excluded_min": "circuit forms", "grokked": "grokked",
                "cleaned": "cleaned up"}


def _phase_lines(fig: go.Figure, phases: Optional[dict]) -> None:
    for i, (name, label) in enumerate(PHASE_LABELS.items()):
        step = (phases or {}).get(name)
        if step is not None and np.isfinite(step):  # labels alternate sides, so two phases at one step both read
            fig.add_vline(x=step, line=dict(color="#7f7f7f", width=1, dash="dash"), annotation_text=label,
                          annotation_position="top left" if i % 2 == 0 else "top right", annotation_font_size=10)


def grokking_figure(curve: pd.DataFrame, phases: Optional[dict] = None, columns: Optional[list] = None,
                    title: str = "", log_x: bool = False, theme: Optional[str] = "default") -> go.Figure:
    """Losses against epoch on a log axis (``fourier.progress_measures`` over training): by default train
    and test loss, or any ``columns`` (the restricted and excluded loss); one colour per column, one dash per
    ``seed`` when the table holds several; ``phases`` (``fourier.phase_epochs``) drawn as dashed lines."""
    columns = columns or ["train_loss", "test_loss"]
    missing = [c for c in ["step", *columns] if c not in curve]
    if missing:
        raise ValueError(f"the table has no column(s) {missing}; make it with over_training(series, "
                         "fourier.progress_measures, ...)")
    fig = go.Figure()
    groups = list(curve.groupby("seed", sort=True)) if "seed" in curve else [(None, curve)]
    dashes = ("solid", "dot", "dash", "dashdot", "longdash")
    for g, (seed, part) in enumerate(groups):
        part = part.sort_values("step")
        for c, column in enumerate(columns):
            name = column if seed is None else f"{column}, seed {seed}"
            fig.add_trace(go.Scatter(x=part["step"], y=part[column], mode="lines", name=name,
                                     line=dict(color=PALETTE[c % len(PALETTE)], dash=dashes[g % len(dashes)]),
                                     hovertemplate="epoch %{x}<br>%{y:.4g}<extra>" + name + "</extra>"))
    _phase_lines(fig, phases)
    fig.update_layout(title=title or "Loss over training", xaxis_title="epoch", yaxis_title="loss",
                      yaxis_type="log", template=_template(theme), legend=dict(orientation="h", y=-0.2))
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def fourier_norms_figure(norms: pd.DataFrame, matrix: str = "embed", title: str = "",
                         theme: Optional[str] = "default") -> go.Figure:
    """Bars of a matrix's norm per Fourier frequency (``fourier.embedding_norms``), one panel per ``step``
    when the table has a step column (the embedding at a few points of training)."""
    if not {"matrix", "frequency", "norm"} <= set(norms.columns):
        raise ValueError(f"the table has no matrix/frequency/norm columns (make it with fourier.embedding_norms); "
                         f"it has {list(norms.columns)}")
    part = norms[norms.matrix == matrix]
    if part.empty:
        raise ValueError(f"no rows for matrix={matrix!r}; the table has {sorted(norms.matrix.unique())}")
    steps = sorted(part.step.unique()) if "step" in part else [None]
    fig = make_subplots(rows=len(steps), cols=1, shared_xaxes=True, vertical_spacing=subplot_spacing(len(steps), 1, 0.08)[1],
                        subplot_titles=[f"epoch {s}" if s is not None else "" for s in steps])
    for i, step in enumerate(steps, start=1):
        rows = part if step is None else part[part.step == step]
        fig.add_trace(go.Bar(x=rows["frequency"], y=rows["norm"], marker_color=POSITIVE, showlegend=False,
                             hovertemplate="frequency %{x}<br>norm %{y:.3g}<extra></extra>"), row=i, col=1)
    fig.update_xaxes(title_text="frequency k (0: constant)", row=len(steps), col=1)
    fig.update_layout(title=title or f"Norm of W_{'E' if matrix == 'embed' else 'U'} per Fourier frequency",
                      template=_template(theme), height=max(300, 220 * len(steps)))
    return fig
