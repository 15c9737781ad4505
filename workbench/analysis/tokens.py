"""Per-position views of a prompt: the loss of each next-token prediction (and how it
changes between two runs), and the size of the residual stream at every layer.

These are the first tables to look at for any prompt (where is the model surprised? does
the stream grow layer by layer?), so they live here rather than in each page that shows
them. Both take any data (token ids, texts of any lengths, a ``TokenBatch``, a
``PromptSet``), run it in batches, and return one row per real token of every prompt (x
layer for the norms), positions counted within the prompt; ``loss_summary`` turns the
losses into one row per prompt.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from workbench.analysis.batching import DataLike, iter_batches, next_real_index, real_cells, real_positions, with_meta
from workbench.analysis.common import vocab_labels
from workbench.analysis.lens import _layer_labels, _stack


@torch.no_grad()
def token_losses(
    model,
    data: DataLike,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """The loss of each next-token prediction: one row per real token that has a next real
    token in its prompt (pads never appear), run in batches of ``batch_size``.

    Columns: batch, pos (the position predicting, within the prompt), token (the token
    there), next_token (the token to predict), loss (``-log p(next_token)`` in nats), prob,
    predicted (the top token), correct (whether the top token is the next token), prompt
    (= batch: the row of ``data``) and a PromptSet's meta columns.
    """
    labels = vocab_labels(model)
    frames = []
    for batch in iter_batches(model, data, batch_size, padding_side, progress, "token losses", attention_mask):
        logp = model(batch).float().log_softmax(-1)
        after = next_real_index(batch.attention_mask)
        has_next = after >= 0
        targets = batch.tokens.gather(1, after.clamp(min=0))
        target_logp = logp.gather(-1, targets[..., None]).squeeze(-1)
        top = logp.argmax(-1)
        b, c, p = real_cells(has_next)
        where = (torch.as_tensor(b, device=logp.device), torch.as_tensor(c, device=logp.device))
        prompt = batch.rows.cpu().numpy()[b]
        lp = target_logp[where].cpu().numpy()
        frames.append(pd.DataFrame({
            "batch": prompt,
            "pos": real_positions(batch.attention_mask)[where].cpu().numpy(),
            "token": labels[batch.tokens[where].cpu().numpy()],
            "next_token": labels[targets[where].cpu().numpy()],
            "loss": -lp,
            "prob": np.exp(lp),
            "predicted": labels[top[where].cpu().numpy()],
            "correct": (top == targets)[where].cpu().numpy(),
            "prompt": prompt,
        }))
    return with_meta(pd.concat(frames, ignore_index=True), data)


def loss_summary(losses: pd.DataFrame) -> pd.DataFrame:
    """A ``token_losses`` table per prompt: prompt, predictions (how many next tokens were
    scored), loss (their mean, nats) and accuracy (the fraction the top token got right); a
    PromptSet's meta columns follow when the table has them."""
    missing = {"prompt", "loss", "correct"} - set(losses.columns)
    if missing:
        raise ValueError(f"losses is not a token_losses table: it lacks {sorted(missing)}")
    per = losses.groupby("prompt", sort=True).agg(predictions=("loss", "size"), loss=("loss", "mean"),
                                                  accuracy=("correct", "mean")).reset_index()
    core = set(_TOKEN_LOSS_COLUMNS)
    meta = [c for c in losses.columns if c not in core]
    if meta:
        per = per.merge(losses.groupby("prompt", sort=True)[meta].first().reset_index(), on="prompt")
    return per


_TOKEN_LOSS_COLUMNS = ("batch", "pos", "token", "next_token", "loss", "prob", "predicted", "correct", "prompt")


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
def residual_norms(
    model,
    data: DataLike,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """L2 norm of the residual stream entering each block, and of the final stream, at every
    real token of every prompt (pads never appear), run in batches of ``batch_size``.

    Columns: batch, layer (``n_layers`` = the final stream, before the final norm),
    layer_label (``resid_pre {l}`` or ``final``), pos (within the prompt), token, norm,
    prompt (= batch: the row of ``data``) and a PromptSet's meta columns.
    """
    labels = vocab_labels(model)
    frames = []
    for batch in iter_batches(model, data, batch_size, padding_side, progress, "residual norms", attention_mask):
        resid, _ = _stack(model, batch)  # [layer, batch, pos, d_model]
        b, c, p = real_cells(batch.attention_mask)
        bt, ct = torch.as_tensor(b, device=resid.device), torch.as_tensor(c, device=resid.device)
        norms = resid[:, bt, ct].float().norm(dim=-1).cpu().numpy()  # [layer, n_real]
        n_layer = norms.shape[0]
        layer = np.repeat(np.arange(n_layer), len(b))
        prompt = np.tile(batch.rows.cpu().numpy()[b], n_layer)
        frames.append(pd.DataFrame({
            "batch": prompt,
            "layer": layer,
            "layer_label": _layer_labels(model, layer),
            "pos": np.tile(p, n_layer),
            "token": labels[np.tile(batch.tokens[bt, ct].cpu().numpy(), n_layer)],
            "norm": norms.ravel(),
            "prompt": prompt,
        }))
    frame = pd.concat(frames, ignore_index=True).sort_values(["layer", "batch", "pos"], kind="stable")
    return with_meta(frame.reset_index(drop=True), data)
