"""A training run's snapshots as a lazy ``Series``, cached per version of its index: shared by the
Training page and its Fourier panel; and where the experiments' runs live (``runs_root``), which
the Sweeps and Training pages both list."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import streamlit as st

import workbench as wb
from ui.common.checkpoints import REPO


@st.cache_resource(max_entries=8, show_spinner="Reading the snapshots…")
def snapshot_series(path: str, stamp: int) -> tuple[Any, threading.Lock, list[str]]:
    """(the run's lazy Series, a lock for its per-snapshot results, load_series' warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        series = wb.load_series(path)
    return series, threading.Lock(), [str(w.message) for w in caught]


def runs_root(argv: Optional[list[str]] = None) -> Path:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--runs")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return Path(args.runs or os.environ.get("WORKBENCH_RUNS") or REPO / "runs").expanduser().resolve()
