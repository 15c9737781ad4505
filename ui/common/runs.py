"""A training run's snapshots as a lazy ``Series``, cached per version of its index: shared by the
Training page and its Fourier panel."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import streamlit as st

import workbench as wb


@st.cache_resource(max_entries=8, show_spinner="Reading the snapshots…")
def snapshot_series(path: str, stamp: int) -> tuple[Any, threading.Lock, list[str]]:
    """(the run's lazy Series, a lock for its per-snapshot results, load_series' warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        series = wb.load_series(path)
    return series, threading.Lock(), [str(w.message) for w in caught]
