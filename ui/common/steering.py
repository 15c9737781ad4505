"""The steering widgets the Steer page and the Features page ("steer with this feature") share: mode,
scale and length, then the clean and steered continuations side by side, from one cached
``steering_comparison`` per (model, prompt, direction, scale, mode, length)."""

from __future__ import annotations

import json
from typing import Optional

import streamlit as st
import torch

from ui.common.drawing import show
from ui.common.loading import Checkpoint, model_for
from workbench import viz
from workbench.analysis import Direction, steering_comparison
from workbench.analysis.directions import MODES

# (min, max, default, step) of the scale slider per mode: add and clamp move by multiples of the
# vector; ablate's 1 removes the component along it.
SCALES = {"add": (-20.0, 20.0, 8.0, 0.5), "ablate": (0.0, 2.0, 1.0, 0.1), "clamp": (-20.0, 20.0, 0.0, 0.5)}
MODE_HELP = ("add: x + s·v.  ablate: x − s·(x·u)u (u = v/|v|; s = 1 removes the component along v).  "
             "clamp: the component along u set to s·|v|.")


def steer(ckpt: Checkpoint, ids: tuple[int, ...], direction: Direction, key: str) -> None:
    """Mode, scale and length widgets, then clean and steered side by side (the Features page's
    "steer with this feature" too)."""
    a, b, c = st.columns(3)
    mode = a.radio("Mode", MODES, horizontal=True, key=f"{key}_mode", persist_state="session", help=MODE_HELP)
    lo, hi, default, step = SCALES[mode]
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
