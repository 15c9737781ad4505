"""The logit and tuned lens, as the pages draw them (a tuned lens when the checkpoint ships one)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from workbench.analysis import logit_lens, tuned_lens
from workbench.analysis.lens import TUNED_LENS_WEIGHTS, TunedLens
from workbench.analysis.reference import reference_batch as library_reference_batch
from workbench.analysis.reference import reference_source as library_reference_source
from ui.common.analyses import Ablation, analysis
from ui.common.loading import Checkpoint, _load, app_device, weights_stamp


# ---- lenses ----------------------------------------------------------------------------------------
LENSES = {"logit lens": "logit", "tuned lens": "tuned"}


def has_tuned_lens(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint ships a tuned lens (``tuned_lens.safetensors`` beside its weights)."""
    return (Path(ckpt.path) / TUNED_LENS_WEIGHTS).is_file()


@st.cache_resource(max_entries=8, show_spinner=False)
def _tuned_lens(path: str, stamp: int) -> TunedLens:
    model, _, _, _ = _load(path, weights_stamp(path), app_device())
    return TunedLens.load(path, model)


def tuned_lens_of(model, tokens, path: str, k: int = 3):
    """``workbench.analysis.tuned_lens`` with the lens the checkpoint at ``path`` ships
    (loaded once per file version); a plain function of values, so :func:`analysis` caches it."""
    stamp = Path(path, TUNED_LENS_WEIGHTS).stat().st_mtime_ns
    return tuned_lens(model, tokens, _tuned_lens(path, stamp), k=k)


def lens_picker(ckpt: Checkpoint, key: str, where=st) -> str:
    """'logit' or 'tuned': a choice offered wherever a lens is drawn, when the checkpoint has a tuned lens."""
    if not has_tuned_lens(ckpt):
        where.caption("Logit lens (this checkpoint ships no tuned lens: `python -m workbench tuned-lens` trains one).")
        return "logit"
    return LENSES[where.radio("Lens", list(LENSES), horizontal=True, key=key, persist_state="session",
                              help="The tuned lens passes each layer's stream through a learned affine map "
                                   "first (Belrose et al. 2023), which removes most of the logit lens' "
                                   "bias at early layers.")]


def lens_table(ckpt: Checkpoint, ids, which: str, ablation: Ablation = (), reference=None, k: int = 3):
    """The logit or tuned lens of prompt ``ids`` (cached), optionally ablated."""
    if which == "tuned":
        return analysis(tuned_lens_of, ckpt.key, ids, ablation=ablation, reference=reference, path=ckpt.path, k=k)
    return analysis(logit_lens, ckpt.key, ids, ablation=ablation, reference=reference, k=k)


@st.cache_data(max_entries=32, show_spinner=False)
def reference_batch(key: tuple[str, int], ids: tuple[int, ...], rows: int = 16) -> tuple[tuple[int, ...], ...]:
    """``workbench.analysis.reference_batch`` for checkpoint ``key`` (its meta.json names the
    task), as tuples so it can key ``analysis``."""
    model, _, meta, _ = _load(*key, app_device())
    return tuple(tuple(row) for row in library_reference_batch(model, meta, ids, rows=rows).tolist())


@st.cache_data(max_entries=32, show_spinner=False)
def reference_source(key: tuple[str, int], ids: tuple[int, ...], rows: int = 16) -> str:
    """What ``reference_batch`` (same arguments) draws, in words (``workbench.analysis.reference_source``)."""
    model, _, meta, _ = _load(*key, app_device())
    return library_reference_source(model, meta, ids, rows=rows)
