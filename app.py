"""`streamlit run app.py [-- --checkpoints DIR]`: the workbench app.

This file only wires the pages in ``ui/`` together: each page module has a ``render()``.
The checkpoints folder is ``--checkpoints DIR`` (after ``--``), else $WORKBENCH_CHECKPOINTS,
else ``checkpoints/`` next to this file.
"""

import streamlit as st

from ui import ablate, build_train, common, compare, inspect, sweeps

PAGES = {
    "Inspect": inspect.render,
    "Ablate": ablate.render,
    "Compare": compare.render,
    "Build & train": build_train.render,
    "Sweeps": sweeps.render,
}

st.set_page_config(page_title="Transformer workbench", page_icon="🔬", layout="wide")
st.sidebar.title("Workbench")
page = st.sidebar.radio("Page", list(PAGES), key="page")
st.sidebar.caption(f"Checkpoints folder: `{common.checkpoints_root()}`")
PAGES[page]()
