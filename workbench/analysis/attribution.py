"""Direct logit attribution (DLA): how much each component writes the answer's logit directly.

The final residual stream is a sum of component outputs (embeddings, every head, every
attention bias, every MLP). The final norm is linear once its scale is frozen at the value
of this run (``ln_final.hook_scale``), so each component's share of the logit (difference)
is ``norm_linear(component) . (W_U[:, answer] - W_U[:, wrong])``; the norm's bias and the
unembedding bias make one more part, and the parts sum to the model's own logit difference.
This needs the residual stream to be a sum, so post-norm models (where every block
renormalises the stream) are refused.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import pandas as pd
import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor

from workbench.analysis.batching import DataLike, iter_batches, n_rows, real_positions, row_columns, with_meta
from workbench.analysis.common import row_ids, token_ids, unit_label
from workbench.data.prompts import PromptSet


_token_ids = token_ids  # features.py's DLA of a feature takes it from here


def _final_norm_linear(model, cache, components: Float[Tensor, "n batch d_model"], rows: Tensor, cols: Tensor) -> Tensor:
    """The final norm applied to each component with this run's scale frozen (weight, no bias)."""
    norm = model.cfg.norm
    if norm == "none":
        return components
    if norm == "layernorm":
        components = components - components.mean(-1, keepdim=True)
    scale = cache["ln_final.hook_scale"][rows, cols]  # [batch, 1]
    return components / scale * model.ln_final.w


def _wanted(name: str) -> bool:
    return (name in ("hook_embed", "hook_pos_embed", "ln_final.hook_scale")
            or name.endswith(("attn.hook_z", "hook_mlp_out")))


def _dla_batch(model, batch, answer_ids: Tensor, wrong_ids: Optional[Tensor], pos: int) -> pd.DataFrame:
    """The DLA table of one padded batch, each row scored at position ``pos`` of its own prompt."""
    n = len(batch)
    rows, cols = torch.arange(n, device=batch.tokens.device), row_columns(batch.attention_mask, pos, batch.rows)
    direction = model.W_U[:, answer_ids].T  # [batch, d_model]
    bias_u = model.b_U[answer_ids]
    if wrong_ids is not None:
        direction = direction - model.W_U[:, wrong_ids].T
        bias_u = bias_u - model.b_U[wrong_ids]

    logits, cache = model.run_with_cache(batch, names_filter=_wanted)
    parts, meta = [], []  # meta: (granularity, component, kind, layer, head)

    def add(vector: Tensor, granularity: str, component: str, kind: str, layer=-1, head=-1):
        parts.append(vector)
        meta.append((granularity, component, kind, layer, head))

    for granularity in ("head", "layer"):
        add(cache["hook_embed"][rows, cols], granularity, "embed", "embed")
        if "hook_pos_embed" in cache.cache_dict:
            add(cache["hook_pos_embed"][rows, cols], granularity, "pos_embed", "pos_embed")
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        z = cache[f"blocks.{layer}.attn.hook_z"][rows, cols]  # [batch, head, d_head]
        heads = einsum(z, attn.W_O, "batch head d_head, head d_head d_model -> head batch d_model")
        for head in range(model.cfg.n_heads):
            add(heads[head], "head", unit_label(layer, head=head), "head", layer, head)
        add(attn.b_O.expand(n, -1), "head", unit_label(layer, part="attn bias"), "attn_bias", layer)
        add(heads.sum(0) + attn.b_O, "layer", unit_label(layer, part="attn"), "attn", layer)
        if not model.cfg.attn_only:
            mlp_out = cache[f"blocks.{layer}.hook_mlp_out"][rows, cols]
            for granularity in ("head", "layer"):
                add(mlp_out, granularity, unit_label(layer, part="mlp"), "mlp", layer)

    stack = _final_norm_linear(model, cache, torch.stack(parts), rows, cols)
    attribution = (stack * direction).sum(-1)  # [component, batch]
    final_bias = bias_u.clone()
    if model.cfg.norm == "layernorm":
        final_bias = final_bias + direction @ model.ln_final.b
    total = logits[rows, cols, answer_ids]
    if wrong_ids is not None:
        total = total - logits[rows, cols, wrong_ids]

    prompt = batch.rows.cpu().numpy()
    frame = pd.DataFrame(meta * n, columns=["granularity", "component", "kind", "layer", "head"])
    frame.insert(0, "batch", np.repeat(prompt, len(meta)))
    frame["attribution"] = attribution.T.float().cpu().numpy().ravel()
    bias_rows = pd.DataFrame({
        "batch": np.repeat(prompt, 2), "granularity": ["head", "layer"] * n,
        "component": "final_bias", "kind": "final_bias", "layer": -1, "head": -1,
        "attribution": np.repeat(final_bias.float().cpu().numpy(), 2),
    })
    frame = pd.concat([frame, bias_rows], ignore_index=True).sort_values(["batch", "granularity"], kind="stable")
    index = pd.Series(np.arange(n), index=prompt)[frame["batch"].to_numpy()].to_numpy()  # each row's place in the batch
    frame["total"] = total.float().cpu().numpy()[index]
    frame["prompt"] = frame["batch"]
    frame["pos"] = real_positions(batch.attention_mask)[rows, cols].cpu().numpy()[index]
    return frame


@torch.no_grad()
def direct_logit_attribution(
    model,
    data: DataLike,
    answer: Union[int, str, Int[Tensor, " batch"], None] = None,
    wrong: Union[int, str, Int[Tensor, " batch"], None] = None,
    pos: int = -1,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """DLA of logit[answer] - logit[wrong] (or logit[answer] alone) at position ``pos`` of each
    prompt, counted within the prompt (negative: from its end, as the default -1, its last
    real token), whatever the padding.

    ``data``: a text, texts of any lengths, token ids, a ``TokenBatch`` or a ``PromptSet``,
    run in batches of ``batch_size``. ``answer`` / ``wrong``: a token id or a single-token
    text for every prompt, or a [batch] tensor with one id per prompt; without ``answer`` a
    PromptSet's own answer and wrong columns are used (per row).

    One row per (prompt, granularity, component). ``granularity="head"`` splits attention
    into every head plus each layer's output bias; ``granularity="layer"`` has one row per
    layer's attention and MLP. Both include the embeddings and a ``final_bias`` part (final
    norm bias and unembedding bias), and each sums to ``total`` (the model's own value).
    Columns: batch, granularity, component, kind, layer, head, attribution, total, prompt
    (= batch: the row of ``data``), pos (the scored position within the prompt) and a
    PromptSet's meta columns.
    """
    if model.cfg.norm_placement != "pre":
        raise ValueError("direct logit attribution needs norm_placement='pre': in a post-norm model "
                         "the final residual stream is not a sum of component outputs, and with output norms "
                         f"({model.cfg.norm_placement}) each attention output is normalised after its heads are "
                         "summed, so no head has a linear share of it")
    n = n_rows(data)
    from_set = answer is None
    if from_set and not (isinstance(data, PromptSet) and data.answers is not None):
        raise ValueError("answer is needed: a token id, a single-token text or one id per prompt "
                         "(or give a PromptSet with an 'answer' column)")
    frames = []
    for batch in iter_batches(model, data, batch_size, padding_side, progress, "direct logit attribution",
                              attention_mask):
        answer_ids = row_ids(model, "answer", answer, batch, n)
        wrong_ids = row_ids(model, "wrong", wrong, batch, n) if (wrong is not None or from_set) else None
        frames.append(_dla_batch(model, batch, answer_ids, wrong_ids, pos))
    frame = pd.concat(frames, ignore_index=True)
    return with_meta(frame, data)
