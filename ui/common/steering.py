"""The steering widgets the Steer page and the Features page ("steer with this feature") share: mode,
scale and length, then the clean and steered continuations side by side, from one cached
``steering_comparison`` per (model, prompt, direction, scale, mode, length)."""

from __future__ import annotations

import json
import math
from typing import Optional

import streamlit as st
import torch

from ui.common.drawing import show
from ui.common.loading import Checkpoint, model_for
from ui.common.targets import follow_default
from workbench import viz
from workbench.analysis import Direction, steering_comparison
from workbench.analysis.directions import MODES

# (min, max, default, step) of the scale slider per mode: add and clamp move by multiples of the
# vector; ablate's 1 removes the component along it.
SCALES = {"add": (-20.0, 20.0, 8.0, 0.5), "ablate": (0.0, 2.0, 1.0, 0.1), "clamp": (-20.0, 20.0, 0.0, 0.5)}
# add's default scale is relative to the residual stream: s·|v| = STREAM_SHARE x the median norm of the
# activation at the direction's hook over the prompt. A fixed s = 8 moved stories-2026 (|v| = 6.0 at
# blocks.1, median |x| = 39) but left SmolLM2-135M's text unchanged (|v| = 0.17, median |x| = 74: s·|v|
# was 2% of the stream). Measured on the Steer page's default prompt and direction, 12 new tokens:
# a share of 0.25 left SmolLM2 unchanged, 0.5 and 0.75 changed both models' text, 1 garbled SmolLM2's.
# The median, not the mean: SmolLM2's first position (the attention sink) is 3x the others.
STREAM_SHARE = 0.75
MODE_HELP = ("add: x + s·v.  ablate: x − s·(x·u)u (u = v/|v|; s = 1 removes the component along v).  "
             "clamp: the component along u set to s·|v|.")


def steer(ckpt: Checkpoint, ids: tuple[int, ...], direction: Direction, key: str) -> None:
    """Mode, scale and length widgets, then clean and steered side by side (the Features page's
    "steer with this feature" too)."""
    a, b, c = st.columns(3)
    mode = a.radio("Mode", MODES, horizontal=True, key=f"{key}_mode", persist_state="session", help=MODE_HELP)
    lo, hi, default, step = SCALES[mode]
    if mode == "add":  # relative to the stream at the direction's hook, following the direction
        lo, hi, default, step = add_scale(stream_norm(ckpt.key, ids, direction.hook), float(direction.vector.norm()))
        follow_default(f"{key}_scale_add", default, (ckpt.key, _direction_identity(direction)))
        if not lo <= st.session_state[f"{key}_scale_add"] <= hi:
            st.session_state[f"{key}_scale_add"] = default
        scale = b.slider("Scale", lo, hi, step=step, key=f"{key}_scale_add", persist_state="session",
                         help=f"Default: s·|v| = {STREAM_SHARE:g} x the median norm of the stream at "
                              f"`{direction.hook}` on the prompt, so it moves any model's output.")
    else:
        scale = b.slider("Scale", lo, hi, default, step, key=f"{key}_scale_{mode}", persist_state="session")
    n_new = new_tokens(ckpt, ids, c, key=f"{key}_new")
    if n_new is None:
        return
    try:
        out = compare(ckpt.key, ids, direction, float(scale), mode, n_new)
    except ValueError as e:
        st.error(f"Cannot steer with this direction: {e}")
        return
    side_by_side(ckpt, ids, out, "steered", key)
    show(viz.token_values_figure(
        out["tokens"], "projection", group="run", boundary=len(ids), colours=dict(zip(("clean", "steered"), viz.PAIR)),
        title="Projection on the direction per token (each text read by the unsteered model)"), key=f"{key}_projection")


def add_scale(norm: float, vector_norm: float) -> tuple[float, float, float, float]:
    """(min, max, default, step) of add's scale for a stream of median norm ``norm`` and a vector of norm
    ``vector_norm``: the default makes s·|v| = STREAM_SHARE x ``norm``, on a round step; the range is at
    least SCALES' and 4x the default either way."""
    lo, hi, _, step = SCALES["add"]
    if not (math.isfinite(norm) and math.isfinite(vector_norm)) or norm <= 0 or vector_norm <= 0:
        return lo, hi, SCALES["add"][2], step
    raw = STREAM_SHARE * norm / vector_norm
    step = 10.0 ** math.floor(math.log10(raw / 10))  # about a tenth of the default
    default = round(round(raw / step) * step, 6)
    hi = max(hi, math.ceil(4 * default / step) * step)
    return -hi, hi, default, step


@st.cache_data(max_entries=64, show_spinner="Measuring the residual stream at the direction's hook…")
def stream_norm(key: tuple[str, int], ids: tuple[int, ...], hook: str) -> float:
    """The median over the prompt's positions of the activation's norm at ``hook`` (nan if it has none)."""
    model, lock = model_for(key)
    with lock, torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([ids], device=model.device), names_filter=hook)
    return float(cache[hook][0].float().norm(dim=-1).median()) if hook in cache else float("nan")


def new_tokens(ckpt: Checkpoint, ids, where, key: str) -> Optional[int]:
    """A slider of how many tokens to generate, capped by the room the context leaves."""
    room = min(64, ckpt.cfg.n_ctx - len(ids))
    if room < 1:
        st.warning(f"The prompt fills the model's context ({ckpt.cfg.n_ctx} tokens): shorten it to leave room "
                   "for generated tokens.")
        return None
    if st.session_state.get(key, 0) > room:  # a longer prompt leaves less room than the last value
        st.session_state[key] = room
    return where.slider("New tokens (greedy)", 1, room, min(24, room), key=key, persist_state="session")


def side_by_side(ckpt: Checkpoint, ids, out: dict, label: str, key: str) -> None:
    """The two continuations, the prompt's loss clean and edited, and its per-token loss."""
    frame = out["tokens"]
    columns = st.columns(2)
    for col, run in zip(columns, ("clean", label)):
        generated = frame[(frame.run == run) & frame.generated].token_id.tolist()
        col.markdown(f"**{run}**")
        col.code(ckpt.tokenizer.decode(generated), language=None, wrap_lines=True)
    clean, edited = out["clean"].loss.mean(), out[label].loss.mean()
    st.metric(f"Mean loss of the prompt, clean → {label}", f"{clean:.3f} → {edited:.3f} nats",
              delta=f"{edited - clean:+.3f} nats", delta_color="inverse")
    if st.toggle(f"Per-token loss of the prompt, clean and {label}", key=f"{key}_show_loss", persist_state="session"):
        show(viz.token_loss_figure({"clean": out["clean"], label: out[label]},
                                          title=f"Per-token loss, clean and {label}"), key=f"{key}_loss")


def _direction_identity(direction: Direction) -> tuple:
    """What keys a Direction in ``st.cache_data``: its hook, the vector's bytes, its provenance."""
    return (direction.hook, direction.vector.numpy().tobytes(), json.dumps(direction.provenance, sort_keys=True,
                                                                           default=str))


@st.cache_data(max_entries=64, show_spinner="Generating…", hash_funcs={Direction: _direction_identity})
def compare(key: tuple[str, int], ids: tuple[int, ...], direction: Direction, scale: float, mode: str,
            max_new_tokens: int) -> dict:
    """``steering_comparison`` on the cached model (under its lock), keyed by value."""
    model, lock = model_for(key)
    with lock, torch.no_grad():
        return steering_comparison(model, torch.tensor([ids], device=model.device), direction, scale, mode,
                                   max_new_tokens=max_new_tokens)
