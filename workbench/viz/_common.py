"""What every figure shares: the themes (``set_default_theme``) and the colours, the batch and
square-matrix helpers of the heatmaps, and the spacing of subplot grids."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from workbench.analysis.common import check_choice, unique_labels


THEMES = {"light": "plotly_white", "dark": "plotly_dark"}
SEQUENTIAL = "Viridis"
DIVERGING = "RdBu"
POSITIVE, NEGATIVE = "#2f6db5", "#d1495b"  # a blue and a red that read on white and on black
CORRECT, WRONG = "#2ca02c", "#d62728"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
PAIR = ("#1f77b4", "#ff7f0e")  # model A and model B (or clean and ablated), the same on every figure
LAST_POSITION = "#e377c2"  # the frame around the position a prompt's answer is predicted at


_default_theme: Optional[str] = "light"


def set_default_theme(theme: Optional[str]) -> None:
    """The theme of figures whose call names none (``theme="default"``): "light", "dark", or None.

    None builds no template at all, for a program that styles figures itself (the app: its
    figures take Streamlit's light or dark theme). It also stops plotly from copying its own
    default template into every new figure, which costs more than building a small figure.
    """
    global _default_theme
    if theme is not None:
        check_choice("theme", theme, list(THEMES))
    _default_theme = theme
    pio.templates.default = "plotly" if theme is not None else None


def _template(theme: Optional[str]) -> Optional[str]:
    """The plotly template of ``theme`` ("default": the one ``set_default_theme`` chose; None: none)."""
    theme = _default_theme if theme == "default" else theme
    if theme is None:
        return None
    check_choice("theme", theme, list(THEMES))
    return THEMES[theme]


def _one_batch(frame: pd.DataFrame, batch: Optional[int]) -> pd.DataFrame:
    if "batch" not in frame or batch is None:
        return frame
    if batch not in set(frame["batch"]):
        raise ValueError(f"batch={batch} is not in the table; it has batches {sorted(set(frame['batch']))}")
    return frame[frame["batch"] == batch]


def _square(frame: pd.DataFrame) -> tuple[np.ndarray, list[str], list[str]]:
    """An attention pattern [query, key] (NaN above the diagonal) with unique token labels."""
    n = int(frame["query_pos"].max()) + 1
    z = np.full((n, n), np.nan)
    z[frame["query_pos"].to_numpy(), frame["key_pos"].to_numpy()] = frame["attention"].to_numpy()
    tokens = frame.drop_duplicates("query_pos").sort_values("query_pos")["query_token"].tolist()
    labels = unique_labels(tokens)
    return z, labels, labels


def _cell_points(fig: go.Figure, xs: list, ys: list, customdata: list, hovertemplate: str) -> None:
    """A clickable scatter point on every cell of a heatmap: plotly heatmaps emit no selection
    events, scatter points do, so a click on a cell selects its point (``customdata`` is what a
    page's selection event returns). Invisible until selected; hover moves from the heatmap here."""
    n_x, n_y = len(fig.data[0].x), len(fig.data[0].y)  # the heatmap's cells fill the axes: no padding for markers
    fig.update_xaxes(range=[-0.5, n_x - 0.5], autorange=False)
    fig.update_yaxes(range=[n_y - 0.5, -0.5] if fig.layout.yaxis.autorange == "reversed" else [-0.5, n_y - 0.5],
                     autorange=False)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", customdata=customdata, hovertemplate=hovertemplate,
                             marker=dict(symbol="square-open", size=18, color="white", line=dict(width=3), opacity=0),
                             selected=dict(marker=dict(opacity=1)), unselected=dict(marker=dict(opacity=0)),
                             showlegend=False, name="cells"))
    fig.data[0].hoverinfo = "skip"
    fig.update_layout(hovermode="closest", hoverdistance=-1, clickmode="event+select", dragmode=False)


def subplot_spacing(rows: int, cols: int, vertical: float = 0.12, horizontal: float = 0.08) -> tuple[float, float]:
    """(horizontal_spacing, vertical_spacing) for ``make_subplots`` with ``rows`` x ``cols`` panels:
    the wanted gaps, narrowed as the panels grow in number so that all the gaps of a direction
    together take at most 40% of the figure. Plotly refuses a gap of 1 / (n - 1) or more
    (``ValueError: Vertical spacing cannot be greater than (1 / (rows - 1))``), which a fixed gap
    reaches at 10 rows of 0.12; a single row or column has no gap to size (its wanted value is kept).
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"a figure needs at least one row and one column of panels; got {rows} x {cols}")

    def fit(want: float, n: int) -> float:
        return want if n < 2 else min(want, 0.4 / (n - 1))

    return fit(horizontal, cols), fit(vertical, rows)


# The training curve an over_training table carries (its ``history``): read by dynamics and graphs.
def _history_of(frame: pd.DataFrame, history: Optional[pd.DataFrame]) -> pd.DataFrame:
    history = frame.attrs.get("history") if history is None else history
    if isinstance(history, dict):  # over_training keeps the curve as columns (see there)
        history = pd.DataFrame(history)
    return history if isinstance(history, pd.DataFrame) else pd.DataFrame(columns=["step"])


# The colour of a marked step (``mark_step``), the same on every figure that marks one.
STEP_MARK = "#e377c2"
