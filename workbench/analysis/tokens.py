"""Per-position views of a prompt: the loss of each next-token prediction (and how it
changes between two runs), and the size of the residual stream at every layer.

These are the first tables to look at for any prompt (where is the model surprised? does
the stream grow layer by layer?), so they live here rather than in each page that shows
them. Both take token ids ``[batch, pos]`` (or text) and return one row per
``batch x position`` (x layer for the norms).
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.analysis.common import as_tokens, str_tokens
from workbench.analysis.lens import residual_stack


@torch.no_grad()
def token_losses(model, tokens: Union[str, Sequence[str], Int[Tensor, "batch pos"]]) -> pd.DataFrame:
    """The loss of each next-token prediction: one row per position that has a next token.

    Columns: batch, pos (the position predicting), token (the token there), next_token (the
    token to predict), loss (``-log p(next_token)`` in nats), prob, predicted (the top
    token), correct (whether the top token is the next token).
    """
    tokens = as_tokens(model, tokens)
    logits = model(tokens)[:, :-1].float()
    logp = logits.log_softmax(-1)
    targets = tokens[:, 1:]
    target_logp = logp.gather(-1, targets[..., None]).squeeze(-1)
    top = logits.argmax(-1)
    batch, n = targets.shape
    b, p = (g.ravel() for g in np.meshgrid(np.arange(batch), np.arange(n), indexing="ij"))
    return pd.DataFrame({
        "batch": b,
        "pos": p,
        "token": str_tokens(model, tokens[:, :-1]),
        "next_token": str_tokens(model, targets),
        "loss": -target_logp.cpu().numpy().ravel(),
        "prob": target_logp.exp().cpu().numpy().ravel(),
        "predicted": str_tokens(model, top),
        "correct": (top == targets).cpu().numpy().ravel(),
    })


def token_loss_change(clean: pd.DataFrame, changed: pd.DataFrame) -> pd.DataFrame:
    """Two ``token_losses`` tables of the same tokens side by side (e.g. clean and ablated).

    One row per predicted token: batch, pos (of the token predicted, as the loss figures
    place it), after (the token before it), next_token, predicted_clean, predicted_changed,
    loss_clean, loss_changed, change (= loss_changed - loss_clean), prediction_changed.
    Rows whose top prediction changed come first, in position order within each group.
    """
    keys = ["batch", "pos", "next_token"]
    if len(clean) != len(changed) or not clean[keys].reset_index(drop=True).equals(changed[keys].reset_index(drop=True)):
        raise ValueError("the two token_losses tables must be of the same tokens")
    clean, changed = clean.reset_index(drop=True), changed.reset_index(drop=True)
    frame = pd.DataFrame({
        "batch": clean["batch"], "pos": clean["pos"] + 1, "after": clean["token"], "next_token": clean["next_token"],
        "predicted_clean": clean["predicted"], "predicted_changed": changed["predicted"],
        "loss_clean": clean["loss"], "loss_changed": changed["loss"], "change": changed["loss"] - clean["loss"],
    })
    frame["prediction_changed"] = frame["predicted_clean"] != frame["predicted_changed"]
    return frame.sort_values("prediction_changed", ascending=False, kind="stable").reset_index(drop=True)


@torch.no_grad()
def residual_norms(model, tokens: Union[str, Sequence[str], Int[Tensor, "batch pos"]]) -> pd.DataFrame:
    """L2 norm of the residual stream entering each block, and of the final stream, per position.

    Columns: batch, layer (``n_layers`` = the final stream, before the final norm),
    layer_label (``resid_pre {l}`` or ``final``), pos, token, norm.
    """
    tokens = as_tokens(model, tokens)
    resid, _ = residual_stack(model, tokens)  # [layer, batch, pos, d_model]
    norms = resid.float().norm(dim=-1).cpu().numpy()
    n_layer, batch, n_pos = norms.shape
    layer, b, p = (g.ravel() for g in np.meshgrid(np.arange(n_layer), np.arange(batch), np.arange(n_pos), indexing="ij"))
    labels = np.array(str_tokens(model, tokens), dtype=object).reshape(batch, n_pos)
    n = model.cfg.n_layers
    return pd.DataFrame({
        "batch": b,
        "layer": layer,
        "layer_label": np.where(layer == n, "final", np.char.add("resid_pre ", layer.astype(str))),
        "pos": p,
        "token": labels[b, p],
        "norm": norms.ravel(),
    })
