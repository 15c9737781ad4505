"""Patch: activation patching and attribution patching on clean/corrupted prompt pairs.

The pairs are the checkpoint's own task pairs (the stories task's IOI "ABC" pairs: the
second mention of the subject replaced by a third name; or its possession pairs), or two
prompts typed here. The metric is the answer metric of ``common.target_picker`` (by
default the logit difference between the answer and the wrong token at the last
position). Each clean activation is patched into the corrupted run by layer x position
(residual stream, attention output, MLP output) and by head; attribution patching's
one-pass estimate of every head sits beside the exact head patching, with their correlation.

Everything is averaged over the pairs, each scored on its own answer as if it ran alone. A
clean and a corrupted prompt may differ in length: positions are then counted from each
prompt's end (the last position is every prompt's last token), and only the positions every
prompt has are patched.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import pandas as pd
import streamlit as st
import torch

from ui import common
from ui.common import pretrained
from workbench import viz
from workbench.analysis.per_prompt import default_positions
from workbench.padding import TokenBatch
from workbench.analysis import (
    TASK_PAIRS,
    AnswerMetric,
    activation_patching,
    attribution_patching,
    patching_agreement,
    task_pairs,
)

TYPED = "typed here"
SITES = {"resid_pre": "residual stream (entering the layer)", "attn_out": "attention output",
         "mlp_out": "MLP output"}
VALUES = {"fraction of the clean−corrupted gap restored": "restored", "metric after patching": "metric"}
# The metric picker's kinds that have a gradient (attribution patching needs one).
TASK_KINDS = {k: v for k, v in common.METRICS.items() if v in ("logit_diff", "prob", "logprob", "logit")}


def render() -> None:
    ckpt = common.page_checkpoint("Patch")
    if ckpt is None:
        return
    pairs = _pairs(ckpt)
    if pairs is None:
        return
    clean, corrupted, metric, labels = pairs
    sites = [s for s in SITES if s != "mlp_out" or not ckpt.cfg.attn_only]
    a, b = st.columns([3, 2])
    chosen = a.multiselect("Patch by layer and position", sites, default=sites, key="patch_sites",
                           persist_state="session",
                           format_func=lambda s: SITES[s])
    value = VALUES[b.radio("Show", list(VALUES), key="patch_value", persist_state="session")]
    sites_run = tuple(chosen) + ("head",)
    patched = _exact(ckpt, clean, corrupted, metric, sites_run, len(labels))
    with st.spinner(f"Scoring the {len(clean)} clean and corrupted prompt(s)…"):
        scores = common.analysis(pair_scores, ckpt.key, None, clean=clean, corrupted=corrupted, metric=metric)
    gaps = [c - r for c, r in zip(scores["clean"], scores["corrupted"])]
    gap, noise = gap_and_noise(gaps, metric.kind)
    c1, c2, c3 = st.columns(3)
    c1.metric("Metric on the clean prompts", f"{sum(scores['clean']) / len(gaps):.3f} {metric.units}")
    c2.metric("Metric on the corrupted prompts", f"{sum(scores['corrupted']) / len(gaps):.3f} {metric.units}")
    c3.metric("Gap that patching can restore", f"{gap:+.3f} {metric.units}",
              help=f"Mean over {len(gaps)} pair(s); noise level {noise:.3f} {metric.units} "
                   "(twice the standard error of the mean over pairs, or the metric's resolution).")
    if abs(gap) <= noise:
        # A fraction of a gap that is not there is noise divided by noise (values of 1.5 and more
        # appear): the raw metric is what can be read.
        st.warning(f"The clean and corrupted prompts score the same within noise (gap {gap:+.4f} {metric.units}, "
                   f"noise level {noise:.4f} over {len(gaps)} pair(s)), so the fraction of the gap restored is not "
                   "drawn: the figures show the metric after patching. Pick a corruption that changes the answer.")
        value = "metric"
    if patched is None:  # a large model: exact patching waits for the button; the one-pass estimate does not
        _heads(ckpt, clean, corrupted, metric, None, value)
        return
    for site in chosen:
        common.show(viz.patching_figure(patched, site, value=value, tokens=labels, units=metric.units),
                    key=f"patch_{site}")
    _heads(ckpt, clean, corrupted, metric, patched, value)


# Exact patching runs one patched forward (from the patched layer on) per site, layer and position
# and per head, for every pair. Above this many parameter-passes (parameters x patches x pairs) it
# waits for a click and shows a progress bar: SmolLM2-135M's one IOI pair of 14 tokens is 2e11
# (1,530 patches: 11.5 min on a 2-core machine at load 25, where one forward took 0.8 s), while
# stories-2026 with 32 task pairs is about 1e10 and runs as soon as the page opens.
EXACT_BUDGET = 5e10


def exact_cost(model, n_pos: int, n_pairs: int, sites) -> tuple[int, float]:
    """(patches, parameter-passes) of exact patching at ``sites`` over ``n_pos`` positions and ``n_pairs`` pairs."""
    cfg = model.cfg
    patches = sum(cfg.n_layers * (cfg.n_heads if site == "head" else n_pos) for site in sites)
    return patches, float(sum(p.numel() for p in model.parameters())) * patches * n_pairs


def _exact(ckpt: common.Checkpoint, clean, corrupted, metric: AnswerMetric, sites: tuple, n_pos: int):
    """The exact patching table at ``sites``; None (with a button that runs it) when it is long."""
    patches, cost = exact_cost(ckpt.model, n_pos, len(clean), sites)
    if cost <= EXACT_BUDGET:
        with st.spinner(f"Exact activation patching: {patches:,} patched forward passes over {len(clean)} pair(s)…"):
            return common.analysis(patch_pairs, ckpt.key, None, clean=clean, corrupted=corrupted, metric=metric,
                                   sites=sites)
    run = (ckpt.key, clean, corrupted, metric, sites)
    note = st.empty()
    if st.session_state.get("patch_exact") != run:
        # The estimate is this model's own forward of these prompts, timed in this process (cached per
        # model and prompts), times the patched forwards: a fixed phrase ("about a minute") was off by 3x.
        # On SmolLM2-135M's IOI pair (one thread, a loaded 2-core machine) a patched forward took 0.6-0.8 of
        # a full one (heads 0.18 s, resid_pre 0.14 s against 0.24 s), so the estimate is an upper one.
        seconds = common.analysis(forward_seconds, ckpt.key, None, clean=clean)
        with note.container():
            st.info(f"Exact patching of this model is {patches:,} patched forward passes over {len(clean)} pair(s) "
                    f"({ckpt.cfg.n_layers} layers x {n_pos} positions per site, and "
                    f"{ckpt.cfg.n_layers * ckpt.cfg.n_heads} heads): up to about {_duration(patches * seconds)}, an "
                    f"estimate from one full forward of these prompts, which took {seconds:.3f} s on this model "
                    "here (a patched forward runs only from the patched layer on, so it takes less; a busier "
                    "machine takes more). Attribution patching's one-pass estimate of every head is below "
                    "meanwhile.")
            clicked = st.button("Run exact patching", key="patch_run", type="primary")
        if not clicked:
            return None
    start = time.perf_counter()
    bar = st.progress(0.0, text="patching…")
    frames = []
    for i, site in enumerate(sites):  # one site at a time: each is cached on its own, and the bar moves
        bar.progress(i / len(sites), text=f"patching {SITES.get(site, 'each head')} ({i + 1} of {len(sites)})")
        frames.append(common.analysis(patch_pairs, ckpt.key, None, clean=clean, corrupted=corrupted, metric=metric,
                                      sites=(site,)))
    bar.empty()
    if st.session_state.get("patch_exact") != run:  # the run just made: the note says what was done, not what will be
        note.caption(f"Exact patching ran {patches:,} patched forward passes over {len(clean)} pair(s) in "
                     f"{_duration(time.perf_counter() - start)}.")
    st.session_state["patch_exact"] = run
    return pd.concat(frames, ignore_index=True)


def forward_seconds(model, clean) -> float:
    """Seconds one forward of the prompts ``clean`` takes on ``model`` (the faster of two: the first may
    pay for warming up), the unit of exact patching's estimate."""
    batch = _batch(model, clean)
    times = []
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            model(batch, return_type="logits")
            times.append(time.perf_counter() - start)
    return min(times)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _pairs(ckpt: common.Checkpoint):
    """(clean ids, corrupted ids, metric, position labels) from the widgets; None with a message."""
    sources = [k for k in TASK_PAIRS if _task_pairs(ckpt, k, 1) is not None]
    labels = {k: f"the task's {k} pairs" for k in sources} | {TYPED: "two prompts typed here"}
    source = st.radio("Prompt pairs", list(labels), format_func=labels.get, horizontal=True, key="patch_source",
                      persist_state="session")
    if source != TYPED:
        n = st.slider("Pairs", 2, 32, 8, key="patch_n", persist_state="session")
        pairs = _task_pairs(ckpt, source, n)
        st.caption(f"{pairs.description}; {n} pairs. The metric is averaged over them, each scored on its own "
                   "answer at its last position.")
        with st.expander("The pairs"):
            common.table({"clean": list(pairs.prompts), "corrupted": list(pairs.corrupted_prompts)})
        kind = TASK_KINDS[st.selectbox("Metric", list(TASK_KINDS), key="patch_task_kind", persist_state="session")]
        metric = AnswerMetric(kind, pairs.answer, pairs.wrong if kind == "logit_diff" else None, -1)
        return pairs.clean, pairs.corrupted, metric, _labels(ckpt, pairs.clean, pairs.corrupted)
    default = _task_pairs(ckpt, sources[0], 1) if sources else None
    left, right = st.columns(2)
    clean_default = default.prompts[0] if default else common.default_prompt(ckpt)
    # a real model's IOI sentence comes with its corruption (the subject's second mention swapped)
    corrupted_default = default.corrupted_prompts[0] if default else (
        pretrained.CORRUPTED if clean_default == pretrained.PROMPT else "")
    common.follow_default("patch_clean", clean_default, ckpt.path)
    common.follow_default("patch_corrupted", corrupted_default, ckpt.path)
    clean_text = left.text_area("Clean prompt", key="patch_clean", persist_state="session", height=80)
    corrupted_text = right.text_area("Corrupted prompt", key="patch_corrupted", persist_state="session", height=80)
    clean = common.prompt_ids(ckpt, clean_text, where=left)
    corrupted = common.prompt_ids(ckpt, corrupted_text, where=right)
    if clean is None or corrupted is None:
        return None
    if len(clean) != len(corrupted):
        st.caption(f"The clean prompt is {len(clean)} tokens and the corrupted one {len(corrupted)}: positions "
                   "are counted from each prompt's end, and heads are patched at those positions.")
    target = common.target_picker(ckpt, clean, key="patch_target")
    if target is None:
        return None
    if target.kind == "loss":
        st.info("Patching scores an answer: pick one of the answer metrics.")
        return None
    # the scored position counted from the end, so it is the same token of a corrupted prompt of another length
    metric = dataclasses.replace(target.metric(), pos=target.pos - len(clean))
    return (clean,), (corrupted,), metric, _labels(ckpt, (clean,), (corrupted,))


def _labels(ckpt: common.Checkpoint, clean, corrupted) -> list[str]:
    """Labels of the patched positions: the first clean prompt's tokens at them."""
    positions = _positions(clean, corrupted) or range(len(clean[0]))
    return [ckpt.tokenizer.token_str(clean[0][p]) for p in positions]


def _positions(clean, corrupted) -> Optional[list[int]]:
    """None when every prompt is equally long (every position, heads at all of them), else the
    positions from the end that every prompt has."""
    positions = default_positions([len(c) for c in clean], [len(c) for c in corrupted])
    return None if positions[0] >= 0 else positions


def _batch(model, rows) -> TokenBatch:
    return TokenBatch.from_ids([list(r) for r in rows], getattr(model.tokenizer, "pad_id", 0), "left", model.device)


def patch_pairs(model, clean, corrupted, metric, sites):
    """``activation_patching`` over the pairs (token ids as tuples: a cache key), padded as needed."""
    return activation_patching(model, _batch(model, clean), _batch(model, corrupted), metric, sites=sites,
                               positions=_positions(clean, corrupted))


def pair_scores(model, clean, corrupted, metric) -> dict[str, list[float]]:
    """Each pair's clean and corrupted metric, in pair order (one cheap patch site, scored per pair)."""
    table = activation_patching(model, _batch(model, clean), _batch(model, corrupted), metric, sites="resid_pre",
                                positions=[-1], per_prompt=True)
    first = table[table["layer"] == 0].sort_values("prompt")
    return {"clean": first["clean"].astype(float).tolist(), "corrupted": first["corrupted"].astype(float).tolist()}


def pair_gaps(model, clean, corrupted, metric) -> list[float]:
    """Each pair's clean minus corrupted metric (one cheap patch site, scored per pair)."""
    table = activation_patching(model, _batch(model, clean), _batch(model, corrupted), metric, sites="resid_pre",
                                positions=[-1], per_prompt=True)
    first = table[table["layer"] == 0].sort_values("prompt")
    return (first["clean"] - first["corrupted"]).astype(float).tolist()


# Below these a gap is the metric's resolution rather than an effect (one pair gives no spread).
RESOLUTION = {"logit_diff": 0.01, "logit": 0.01, "logprob": 0.01, "prob": 0.001, "rank": 0.5}


def gap_and_noise(gaps: list[float], kind: str) -> tuple[float, float]:
    """The mean clean-corrupted gap and the level under which it is noise: twice the standard error
    of the mean over pairs, never below the metric's resolution."""
    import statistics

    mean = statistics.fmean(gaps)
    se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0
    return mean, max(2 * se, RESOLUTION.get(kind, 0.01))


def attribute_pairs(model, clean, corrupted, metric):
    """``attribution_patching`` over the same pairs and positions."""
    return attribution_patching(model, _batch(model, clean), _batch(model, corrupted), metric,
                                positions=_positions(clean, corrupted))


def _task_pairs(ckpt: common.Checkpoint, kind: str, n: int):
    try:
        with st.spinner(f"Building the task's {kind} prompt pairs…"):
            return common.analysis(task_pairs, ckpt.key, None, meta=ckpt.meta, n=n, kind=kind)
    except ValueError:
        return None


def _heads(ckpt: common.Checkpoint, clean, corrupted, metric: AnswerMetric, patched, value: str) -> None:
    st.subheader("Heads: exact patching and attribution patching")
    left, right = st.columns(2)
    with left:
        if patched is not None:
            common.show(viz.patching_figure(patched, "head", value=value, units=metric.units), key="patch_heads")
        else:
            st.caption("Exact head patching: run it with the button above.")
    with right:
        if not metric.differentiable:
            st.info("Attribution patching follows the metric's gradient; a rank has none. Pick another metric.")
            return
        with st.spinner(f"Attribution patching: one forward and backward pass over {len(clean)} pair(s)…"):
            attribution = common.analysis(attribute_pairs, ckpt.key, None, clean=clean, corrupted=corrupted,
                                          metric=metric)
        fig = viz.layer_head_figure(attribution, value="attribution", units=f"estimated Δ {metric.units}",
                                    title="Attribution patching: each head's estimated effect")
        common.show(fig, key="patch_attribution")
    agreement = _agreement(attribution, patched) if patched is not None else None
    if agreement is not None:
        st.caption(f"Attribution patching estimates every head from one forward and backward pass; its estimates "
                   f"correlate with the exact effects (metric − corrupted) at r = {agreement:.3f}.")


def _agreement(attribution, patched) -> Optional[float]:
    try:
        return patching_agreement(attribution, patched).attrs["correlation"]
    except ValueError:
        return None
