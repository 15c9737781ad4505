"""The model card: config, parameter counts, meta.json, the training curve and the vocabulary browser."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st

import workbench as wb
from workbench.accounting import count_model_params
from workbench.training import read_metrics
from ui.common import pretrained, vocabulary
from ui.common.drawing import show, table
from ui.common.loading import Checkpoint


# ---- the model card ---------------------------------------------------------------------------------
@st.cache_data(max_entries=32, show_spinner=False)
def _read_metrics(path: str, stamp: int) -> pd.DataFrame:
    return read_metrics(path)


def _metrics_stamp(path) -> int:
    p = Path(path)
    csv = p / "metrics.csv" if p.is_dir() else p
    try:
        return csv.stat().st_mtime_ns
    except OSError:
        return 0


def training_curve(path, where=st) -> Optional[pd.DataFrame]:
    """metrics.csv under ``path`` (``workbench.training.read_metrics``, cached per file version);
    None, with a message in ``where`` when it is unreadable, when there is none or it is empty."""
    try:
        metrics = _read_metrics(str(path), _metrics_stamp(path))
    except ValueError as e:
        where.warning(f"Cannot draw the training curve: {e}")
        return None
    if metrics.attrs.get("skipped_rows"):
        where.warning(f"metrics.csv has {metrics.attrs['skipped_rows']} malformed row(s) (not numbers); "
                      "they are left out of the curve.")
    return None if metrics.empty or "step" not in metrics else metrics


@st.cache_data(max_entries=64, show_spinner=False)
def param_counts(cfg: wb.ModelConfig) -> dict[str, int]:
    """``workbench.count_params`` (it builds the model on the meta device), cached per config."""
    return wb.count_params(cfg)


def config_table(cfg: wb.ModelConfig) -> pd.DataFrame:
    return pd.DataFrame({"field": list(cfg.to_dict()), "value": [str(v) for v in cfg.to_dict().values()]})


def no_curve_message(ckpt: Checkpoint) -> str:
    """Why the card draws no training curve, in the reader's terms (not the file that is missing)."""
    if pretrained.is_text_model(ckpt.path, ckpt.meta if isinstance(ckpt.meta, dict) else None):
        return f"{ckpt.name} is a pretrained model that was not trained here, so there is no training curve."
    return "No training log was saved with this checkpoint, so there is no training curve."


def model_card(ckpt: Checkpoint) -> None:
    """Config, parameter counts, what meta.json says, and the training curve."""
    from workbench import viz

    counts = count_model_params(ckpt.model)  # the loaded model: nothing to build
    cols = st.columns(4)
    cols[0].metric("Parameters", f"{counts['total']:,}")
    cols[1].metric("Non-embedding", f"{counts['non_embedding']:,}")
    cols[2].metric("Layers × heads", f"{ckpt.cfg.n_layers} × {ckpt.cfg.n_heads}")
    cols[3].metric("Context", f"{ckpt.cfg.n_ctx} tokens")
    left, right = st.columns([1, 2])
    with left:
        table(config_table(ckpt.cfg), height=300)
    with right:
        metrics = training_curve(ckpt.path)
        if metrics is not None:
            show(viz.loss_curves(metrics, title=f"Training curve of {ckpt.name}"), key=f"curve_{ckpt.path}")
        else:
            st.info(no_curve_message(ckpt))
    shown = {k: v for k, v in ckpt.meta.items() if k not in ("metrics",)}
    with st.expander("meta.json"):
        st.json(shown, expanded=False)
    with st.expander("Vocabulary browser"):
        vocabulary.render(ckpt)
