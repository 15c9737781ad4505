"""Training: a run's weight snapshots, scrubbed by step.

Pick a run with snapshots (a checkpoint in the checkpoints folder, or a run under the runs
folder that the Sweeps page reads); a slider snaps to the snapshot steps. At that step: the
loss curve with the step marked, every head's scores as a layer x head heatmap, and, on a
prompt, one head's attention pattern and the logit lens. Head scores over the whole run
(``analysis.over_training``: the induction-head phase change) sit above, with the step
marked; a second run can be compared, aligned by step (its nearest snapshot). For an
attention-only run, a toggle adds why a head attends over training: the QK attribution of the
head's induction edge at every snapshot (``graphs.qk_training``), its top pair and the
K-composition pairs above the loss curve, the loss drop shaded.

Caching: a run's ``Series`` is a ``st.cache_resource`` keyed by the folder and its snapshot
index's mtime; the library keeps each snapshot's head scores in it (``over_training``),
so scrubbing loads nothing twice. Each snapshot's model is a ``st.cache_resource`` keyed by
(run, stamp, step), and analyses on it are ``st.cache_data`` keyed by plain values. The
progress bar's callback goes into ``over_training`` directly, never into a cached function.
"""

from __future__ import annotations

import functools
import threading
import types
from pathlib import Path
from typing import Any, Callable, Optional

import streamlit as st
import torch

import workbench as wb
from ui import common, fourier_panel
from ui.common.runs import runs_root
from ui.common import pretrained
from workbench import viz
from workbench.analysis import attention_patterns, head_scores, logit_lens, over_training
from workbench.analysis.graphs import qk_training
from workbench.checkpoint import read_meta
from workbench.snapshots import INDEX_FILE, SNAPSHOT_DIR
from workbench.tokenizer import IdTokenizer

NONE = "(none)"

# Kept when the user visits another page and comes back (app.py re-sets them every run).
PERSISTENT = ("training_run", "training_compare", "training_step", "training_prompt", "training_layer", "training_head")


def list_runs(checkpoints: Path, runs: Path) -> dict[str, str]:
    """Every checkpoint in the checkpoints folder, then every run under the runs folder that
    holds snapshots (named ``runs/<path>``): name -> folder."""
    found = dict(common.list_checkpoints(checkpoints))
    if runs.is_dir():
        for folder in sorted(runs.rglob(SNAPSHOT_DIR)):
            if folder.is_dir() and ((folder / INDEX_FILE).exists() or any(folder.glob("step-*.safetensors"))):
                found[f"runs/{folder.parent.relative_to(runs)}"] = str(folder.parent)
    return found


def has_snapshots(path: str) -> bool:
    folder = Path(path) / SNAPSHOT_DIR
    return folder.is_dir() and ((folder / INDEX_FILE).exists() or any(folder.glob("step-*.safetensors")))


def _stamp(path: str) -> int:
    folder = Path(path) / SNAPSHOT_DIR
    try:
        return max(p.stat().st_mtime_ns for p in [folder, *folder.glob(INDEX_FILE)])
    except (OSError, ValueError):
        return 0


def load_run(path: str, where=st) -> Optional[tuple[Any, threading.Lock]]:
    """The run's (series, lock), or None with the reason shown in ``where``."""
    if not has_snapshots(path):
        where.info(f"`{path}` has no snapshots, so there is nothing to scrub through: train with "
                   "`TrainConfig(snapshots=\"log:24\")` (or `--snapshots log:24`) to record weights during "
                   "training. The shipped `induction-attn2l` has 24.")
        return None
    try:
        series, lock, notes = common.snapshot_series(path, _stamp(path))
    except (ValueError, wb.CheckpointError) as e:
        where.error(f"Cannot read the snapshots of `{path}`: {e}")
        return None
    for note in notes:
        where.warning(note)
    return series, lock


@st.cache_resource(max_entries=4, show_spinner="Loading the snapshot…")
def _snapshot(path: str, stamp: int, step: int) -> tuple[Any, threading.Lock]:
    """The model at ``step`` of the run at ``path`` (its tokenizer, else one of token ids)."""
    series, _, _ = common.snapshot_series(path, stamp)
    model = series.load(next(s for s in series if s.step == step))
    if model.tokenizer is None:  # abstract-id tasks (induction): prompts are typed as token ids
        model.tokenizer = IdTokenizer(model.cfg.d_vocab)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, threading.Lock()


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs={types.FunctionType: common._qualified_name})
def at_step(fn: Callable, path: str, stamp: int, step: int, ids: tuple[int, ...], **kwargs) -> Any:
    """``fn(model at step, prompt ids, **kwargs)`` (a ``workbench.analysis`` function), cached by value."""
    model, lock = _snapshot(path, stamp, step)
    with lock, torch.no_grad():
        return fn(model, torch.tensor([ids], device=model.device), **kwargs)


def scores_over_training(name: str, series, lock: threading.Lock):
    """Every head's scores at every snapshot, with a progress bar while snapshots load (the
    series keeps each snapshot's scores, so a second call loads nothing)."""
    bar = st.progress(0.0, text=f"head scores of {name} at every snapshot…")
    with lock:
        table = over_training(series, head_scores,
                              progress=lambda done, total: bar.progress(done / total, text=f"{name}: snapshot {done} of {total}"))
    bar.empty()
    return table


def render() -> None:
    st.header("Training")
    if st.session_state.get("ckpt") == pretrained.LABEL:  # chosen on another page: say why it is not here
        st.info(f"**{pretrained.LABEL}** is not listed: it was trained elsewhere and ships no snapshots of its "
                "training, so there is nothing to scrub through. This page lists the checkpoints folder's models "
                "and the runs with snapshots.")
    runs = list_runs(common.checkpoints_root(), runs_root())
    if not runs:
        st.info("No checkpoints or runs found. Train one with snapshots: `python -m workbench train ... --snapshots log:24`.")
        return
    with_snapshots = [name for name, path in runs.items() if has_snapshots(path)]
    a, b = st.columns(2)
    if st.session_state.get("training_run") not in runs:
        st.session_state["training_run"] = with_snapshots[0] if with_snapshots else next(iter(runs))
    name = a.selectbox("Run", list(runs), key="training_run",
                       help="Checkpoints in the checkpoints folder, and runs with snapshots under the runs folder.")
    others = [NONE] + [n for n in with_snapshots if n != name]
    if st.session_state.get("training_compare") not in others:
        st.session_state["training_compare"] = NONE
    other = b.selectbox("Compare with (optional)", others, key="training_compare")
    loaded = load_run(runs[name])
    if loaded is None:
        return
    series, lock = loaded
    path, stamp = runs[name], _stamp(runs[name])
    st.caption(f"**{name}** · {len(series)} snapshots, steps {series.steps[0]} to {series.steps[-1]} · `{path}`")
    meta = read_meta(path) if Path(path, "meta.json").is_file() else {}
    if fourier_panel.applies(meta):  # a modular-addition run: the grokking paper's measures, not head scores
        fourier_panel.render(name, series, lock, path, stamp, _step_slider(series), meta)
        return
    scores = scores_over_training(name, series, lock)
    compared = None
    if other != NONE:
        loaded_b = load_run(runs[other])
        if loaded_b is not None:
            compared = (other, loaded_b[0], scores_over_training(other, *loaded_b))
    step = _step_slider(series)
    _over_training(name, scores, step, compared)
    _qk_over_training(name, series, lock, scores, step)
    _at_step(name, series, path, stamp, scores, step, compared)


def _step_slider(series) -> int:
    if st.session_state.get("training_step") not in series.steps:
        st.session_state["training_step"] = series.steps[-1]
    return st.select_slider("Step", options=series.steps, key="training_step",
                            help="Snaps to the steps at which the run saved its weights.")


def _over_training(name: str, scores, step: int, compared) -> None:
    st.subheader("Head scores over training")
    st.caption("Each line is the best head of one kind at each snapshot (hover names it), measured on repeated "
               "random tokens; an induction head forming shows as a jump of the induction score while the "
               "loss drops (the phase change).")
    if compared is None:
        fig = viz.over_training_figure(scores, title=f"{name}: head scores and loss over training")
        common.show(viz.mark_step(fig, step), key="training_over")
    else:
        other, _, scores_b = compared
        fig = viz.runs_over_training_figure({name: scores, other: scores_b}, step=step,
                                            title=f"{name} and {other}: head scores and loss, aligned by step")
        common.show(fig, key="training_over_compare")


def _qk_over_training(name: str, series, lock: threading.Lock, scores, step: int) -> None:
    st.subheader("Why a head attends, over training")
    cfg = series.config
    if not cfg.attn_only:
        st.caption("QK attribution over training needs the replacement model at every snapshot: an attention-only "
                   "model is its own; a model with MLPs would need transcoders fitted per snapshot.")
        return
    if cfg.n_layers < 2 or not st.toggle("QK pairs of a head's induction edge at every snapshot", key="training_qk_open",
                                         help="At each snapshot: the attribution graph of each prompt (the model "
                                              "is its own replacement) and the QK attribution of the edge."):
        return
    last = scores[scores["step"] == scores["step"].max()]
    induction = last[(last["kind"] == "induction") & (last["layer"] > 0)]
    best = induction.loc[induction["score"].idxmax()] if len(induction) else None
    prev = last[(last["kind"] == "previous_token") & (last["layer"] == 0) & (last["score"] >= 0.5)]
    a, b, c = st.columns(3)
    layer = a.selectbox("QK layer", range(1, cfg.n_layers), key="training_qk_layer",
                        index=int(best["layer"]) - 1 if best is not None else 0)
    head = b.selectbox("QK head", range(cfg.n_heads), key="training_qk_head",
                       index=int(best["head"]) if best is not None else 0,
                       help="Default: the best induction head at the last snapshot.")
    n = c.number_input("Prompts", 2, 64, 4, key="training_qk_prompts",
                       help="Induction prompts [r, r[:m]] of seed 0; more prompts, a tighter interval, a longer wait.")
    half = max(2, min(16, (cfg.n_ctx - 1) // 2, cfg.d_vocab - 1))
    prompts, queries, keys = qk_training.induction_qk_prompts(cfg.d_vocab, n=int(n), half=half, seed=0, n_ctx=cfg.n_ctx)
    analysis = functools.partial(qk_training.qk_pairs, tokens=prompts, layer=layer, head=[head], query_pos=queries,
                                 key_pos=keys)
    bar = st.progress(0.0, text="QK pairs at every snapshot…")
    with lock:
        table = over_training(series, analysis,
                              progress=lambda done, total: bar.progress(done / total, text=f"snapshot {done} of {total}"))
    bar.empty()
    pairs = [("token", f"L0H{int(h)}") for h in prev["head"]] or None  # the K-composition pairs, else the top one
    summary = qk_training.qk_summary(table, pair=pairs)
    try:
        phase = qk_training.loss_drop(series.history)
    except ValueError:  # no metrics.csv to find the loss drop in
        phase = None
    fig = viz.qk_over_training_figure(summary, head=head, phase=phase,
                                      title=f"{name}, L{layer}H{head}: the top QK pair and {summary.attrs['pair']} "
                                            f"over training ({int(n)} prompts)")
    common.show(viz.mark_step(fig, step), key="training_qk")
    st.caption(f"Followed: {summary.attrs['pair']}"
               + (" (the current token at the query x a previous-token head's output at the key: K-composition)"
                  if pairs else " (the commonest top pair at the last snapshot)")
               + ". Bands: 95% interval of the mean over the prompts."
               + (f" Shaded: the loss drop, steps {phase['start']} to {phase['end']}." if phase else ""))


def _at_step(name: str, series, path: str, stamp: int, scores, step: int, compared) -> None:
    st.subheader(f"At step {step}")
    left, right = st.columns(2)
    with left:
        history = series.history
        if history.empty or "train_loss" not in history:
            st.info(f"No training log (train loss) was saved with `{name}`, so there is no loss curve to mark the step on.")
        else:
            fig = viz.loss_curves(history, title=f"Loss, step {step} marked")
            common.show(viz.mark_step(fig, step), key="training_loss")
    with right:
        fig = viz.head_scores_figure(scores[scores["step"] == step].drop(columns="step"))
        fig.update_layout(title=f"Head scores at step {step}")
        common.show(fig, key="training_scores")
    if compared is not None:
        other, series_b, scores_b = compared
        near = series_b.nearest(step).step
        fig = viz.head_scores_figure(scores_b[scores_b["step"] == near].drop(columns="step"))
        fig.update_layout(title=f"{other}: head scores at step {near} (its snapshot nearest to {step})")
        common.show(fig, key="training_scores_b")
    _on_a_prompt(name, series, path, stamp, step)


def _on_a_prompt(name: str, series, path: str, stamp: int, step: int) -> None:
    st.subheader("On a prompt")
    model, lock = _snapshot(path, stamp, step)
    meta = read_meta(path) if Path(path, "meta.json").is_file() else {}
    run = common.Checkpoint(name, path, stamp, model, model.tokenizer, meta, lock)
    text = common.prompt_box(run, key="training_prompt")
    ids = common.prompt_ids(run, text)
    if ids is None:
        return
    a, b = st.columns(2)
    layer = a.selectbox("Layer", range(series.config.n_layers), key="training_layer")
    head = b.selectbox("Head", range(series.config.n_heads), key="training_head")
    left, right = st.columns(2)
    with left:
        patterns = at_step(attention_patterns, path, stamp, step, ids)
        fig = viz.attention_figure(patterns, layer, head)
        fig.update_layout(title=f"Attention L{layer}H{head} at step {step}")
        viz.thin_ticks(fig, 10)  # half the page wide: every label would pile onto its neighbours
        common.show(fig, key="training_attention")
    with right:
        lens = at_step(logit_lens, path, stamp, step, ids, k=3)
        fig = viz.logit_lens_figure(lens, color="target_prob")
        fig.update_layout(title=f"Logit lens at step {step}")
        viz.thin_ticks(fig, 10)
        common.show(fig, key="training_lens")
