"""The Training page's view of a modular-addition run: the grokking paper's Fourier progress measures.

For a run of the ``modular`` task (its meta.json says so) the Training page shows this instead of
head scores: train, test, restricted and excluded loss over the snapshots with the phase boundaries
(``fourier.progress_measures``, ``fourier.phase_epochs``) and the step marked, and at the step the
embedding's norm per Fourier frequency and the key frequencies' share of the logits.

Caching: the task and the key frequencies (the last snapshot's) are a ``st.cache_resource`` per run
and stamp, so the same task object keys ``over_training``'s per-snapshot results in the series and
scrubbing computes nothing twice.
"""

from __future__ import annotations

import threading
from typing import Any

import streamlit as st

from ui import common
from workbench import viz
from workbench.analysis import fourier, over_training
from workbench.data.modular import ModularTask


def applies(meta: dict) -> bool:
    """True for a run of the modular task with an odd p (the Fourier basis here needs one)."""
    options = meta.get("task_options") or {}
    return meta.get("task") == "modular" and isinstance(options.get("p"), int) and options["p"] % 2 == 1


@st.cache_resource(max_entries=4, show_spinner="Finding the key frequencies…")
def _task_and_keys(path: str, stamp: int, options: tuple) -> tuple[ModularTask, tuple[int, ...]]:
    series, _, _ = common.snapshot_series(path, stamp)
    task = ModularTask(**dict(options))
    return task, tuple(fourier.key_frequencies(series.load(-1), task))


def render(name: str, series, lock: threading.Lock, path: str, stamp: int, step: int, meta: dict) -> None:
    st.subheader("Fourier progress measures")
    st.caption("Nanda et al. (2023): the model memorises, then forms a circuit on a few key frequencies "
               "(excluded loss rises, restricted loss falls), then cleans up the memorised part and the test "
               "loss drops. Key frequencies are the final snapshot's; dashed lines mark the phases.")
    task, keys = _task_and_keys(path, stamp, tuple(sorted(meta["task_options"].items())))
    bar = st.progress(0.0, text=f"progress measures of {name} at every snapshot…")
    with lock:
        curve = over_training(series, fourier.progress_measures, task=task, key_freqs=keys,
                              progress=lambda done, total: bar.progress(done / total, text=f"{name}: snapshot {done} of {total}"))
    bar.empty()
    phases = fourier.phase_epochs(curve)
    fig = viz.grokking_figure(curve, phases, columns=["train_loss", "test_loss", "restricted_loss", "excluded_loss"],
                              title=f"{name}: losses over training, step {step} marked")
    common.show(viz.mark_step(fig, step), key="training_fourier_losses")
    at = curve[curve.step == step].iloc[0]
    left, right = st.columns(2)
    with left:
        norms = _norms(series, lock, task, step)
        common.show(viz.fourier_norms_figure(norms, title=f"Embedding norm per frequency at step {step}"),
                    key="training_fourier_norms")
    with right:
        st.metric("Key frequencies", ", ".join(map(str, keys)) or "none yet")
        st.metric("Test accuracy at this step", f"{at.test_accuracy:.1%}")
        st.metric("Logit variance along the key frequencies", f"{at.logit_fraction_key:.1%}")
        st.metric("Gini of the embedding's Fourier norms", f"{at.gini_embed:.3f}")


def _norms(series, lock: threading.Lock, task: ModularTask, step: int) -> Any:
    with lock:
        table = over_training(series, fourier.embedding_norms, task=task, progress=False)
    return table[table.step == step].drop(columns="step")
