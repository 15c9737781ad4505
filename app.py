"""`streamlit run app.py [-- --checkpoints DIR]`: the workbench app.

This file only wires the pages in ``ui/`` together: each page module has a ``render()``.
The checkpoints folder is ``--checkpoints DIR`` (after ``--``), else $WORKBENCH_CHECKPOINTS,
else ``checkpoints/`` next to this file.
"""

import os

import streamlit as st

from ui import serve

# The browser fetches and compiles plotly.js (Streamlit's 4.7 MB PlotlyChart chunk) only when a page's
# first figure arrives. A session's first run sends a 10-pixel figure with nothing visible before
# importing torch and the pages (or waiting for ``python -m ui.serve``'s preload of them), taken away
# once the page is drawn, so the browser does that while the server imports, instead of after. The
# placeholder is there on every run, so the page's elements keep their places. Under ``python -m
# ui.serve`` the preload thread imports pandas and plotly first: the figure waits for those two
# (serve.wait_for_light), not for torch.
WARM_FIGURE = {"data": [{"type": "scatter", "x": [0], "y": [0], "mode": "markers", "marker": {"size": 1}}],
               "layout": {"height": 10, "width": 10, "margin": {"l": 0, "r": 0, "t": 0, "b": 0},
                          "xaxis": {"visible": False}, "yaxis": {"visible": False}}}
serve.wait_for_light()
_plotly_warm = st.empty()
if "_plotly_warmed" not in st.session_state:
    st.session_state["_plotly_warmed"] = True
    _plotly_warm.plotly_chart(WARM_FIGURE, config={"staticPlot": True, "displayModeBar": False}, width="content")
# Under ``python -m ui.serve`` the imports below and the default checkpoint are being preloaded on
# a thread that started with the server: an early first session waits for it here (at once otherwise).
serve.wait_for_preload()
serve.mark("script start")
from ui import tl_import  # noqa: E402

# TransformerLens's hook points without its package's imports of datasets and transformers (1.1 s of a
# first page under plain ``streamlit run``); after ui.serve's preload, or on a later run, this does nothing.
tl_import.import_core()

import torch  # noqa: E402

from ui import ablate, build_train, circuit, common, compare, features, graph, inspect, patch, steer, sweeps, training  # noqa: E402,E501
from workbench import viz  # noqa: E402

PAGES = {
    "Inspect": inspect.render,
    "Ablate": ablate.render,
    "Patch": patch.render,
    "Steer": steer.render,
    "Features": features.render,
    "Compare": compare.render,
    "Build & train": build_train.render,
    "Sweeps": sweeps.render,
    "Training": training.render,
    "Circuit": circuit.render,
    "Graph": graph.render,
}

# One thread: the app's forwards are small and latency-bound, and extra threads only
# contend with Streamlit's own (and with other work on a shared machine).
torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", "1")))
# Figures take Streamlit's light or dark theme (common.show), so none builds a plotly template.
viz.set_default_theme(None)
st.set_page_config(page_title="Transformer workbench", page_icon="🔬", layout="wide")
st.sidebar.title("Workbench")
# A link can open a page: ?page=Patch (on a session's first run only; the radio rules after that).
asked = st.query_params.get("page") if "page" not in st.session_state else None
if asked in PAGES:
    st.session_state["page"] = asked
page = st.sidebar.radio("Page", list(PAGES), key="page")
if asked is not None and asked not in PAGES:  # a mistyped or stale link: say so rather than open Inspect silently
    st.warning(f"The link asks for a page named {asked!r}, which the app does not have; it opened {page}. "
               f"The pages: {', '.join(PAGES)}.")
# Streamlit forgets a widget's value on a run that does not draw it; re-setting these keys
# keeps the checkpoint and the prompt when the user goes to another page and comes back (the
# other pages' widgets say persist_state="session", which does the same).
for key in (common.PERSISTENT + build_train.PERSISTENT + training.PERSISTENT + circuit.PERSISTENT + inspect.PERSISTENT
            + compare.PERSISTENT):
    if key in st.session_state:
        st.session_state[key] = st.session_state[key]
st.sidebar.caption(f"Checkpoints folder: `{common.checkpoints_root()}`")
PAGES[page]()
_plotly_warm.empty()
serve.mark("script end")
