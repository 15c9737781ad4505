"""Drawing figures and tables in the app's own theme."""

from __future__ import annotations

from typing import Any, Optional

import streamlit as st


# ---- drawing --------------------------------------------------------------------------------------
def show(fig, key: Optional[str] = None, **kwargs) -> Any:
    """Draw a plotly figure in the app's own light or dark theme.

    Streamlit's chart theme sets backgrounds, fonts and grid colours from the theme the user
    picked, over whatever plotly template the figure carries; the fixed template of
    ``workbench.viz`` is dropped so it is not sent to the browser at all. The data's colour
    scales (perceptually uniform, chosen by viz) stay.
    """
    fig.layout.template = None
    _colorbar_titles_aside(fig)
    return st.plotly_chart(fig, theme="streamlit", key=key, **kwargs)


def _colorbar_titles_aside(fig) -> None:
    """Colour-bar titles along the bar's right side: on top (plotly's default) a title wider than
    the bar runs into the top tick label."""
    for trace in fig.data:  # only bars a figure has: reading trace.colorbar would create one
        spec = trace.to_plotly_json()
        if "colorbar" in spec:
            trace.colorbar.title.side = "right"
        if "colorbar" in spec.get("marker", {}):
            trace.marker.colorbar.title.side = "right"
    for name, value in fig.layout.to_plotly_json().items():
        if name.startswith("coloraxis") and "colorbar" in value:
            fig.layout[name].colorbar.title.side = "right"


def clicked_node(event) -> Optional[str]:
    """The node label a click on a graph of nodes (the Circuit page's, the Graph page's) selected (its point's ``customdata``), else None."""
    points = (event or {}).get("selection", {}).get("points", [])
    for point in points:
        data = point.get("customdata")
        if isinstance(data, dict):  # a typed array's row, as a browser serialises it
            data = data.get("0")
        if isinstance(data, (list, tuple)):
            data = data[0] if data else None
        if isinstance(data, str):
            return data
    return None


def table(df, **kwargs) -> None:
    st.dataframe(df, hide_index=True, **kwargs)
