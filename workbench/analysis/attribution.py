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

from typing import Union

import numpy as np
import pandas as pd
import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor

from workbench.analysis.common import as_tokens, unit_label
from workbench.utils import check_index, check_token_ids


def _token_ids(model, name: str, value: Union[int, str, Tensor], batch: int) -> Int[Tensor, " batch"]:
    if isinstance(value, str):
        value = model.to_single_token(value)
    # No Python-style negatives: answer=-1 would silently pick the last vocabulary entry.
    ids = check_token_ids(name, value, model.cfg.d_vocab).to(model.device)
    if ids.ndim == 0:
        ids = ids.expand(batch)
    if ids.shape != (batch,):
        raise ValueError(f"{name} must be a token id or a [batch={batch}] tensor of ids, got shape {tuple(ids.shape)}")
    return ids


def _final_norm_linear(model, cache, components: Float[Tensor, "n batch d_model"], pos: int) -> Tensor:
    """The final norm applied to each component with this run's scale frozen (weight, no bias)."""
    norm = model.cfg.norm
    if norm == "none":
        return components
    if norm == "layernorm":
        components = components - components.mean(-1, keepdim=True)
    scale = cache["ln_final.hook_scale"][:, pos]  # [batch, 1]
    return components / scale * model.ln_final.w


@torch.no_grad()
def direct_logit_attribution(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    answer: Union[int, str, Int[Tensor, " batch"]],
    wrong: Union[int, str, Int[Tensor, " batch"], None] = None,
    pos: int = -1,
) -> pd.DataFrame:
    """DLA of logit[answer] - logit[wrong] (or logit[answer] alone) at position ``pos``
    (negative: counted from the end, as the default -1, the last position).

    One row per (batch, granularity, component). ``granularity="head"`` splits attention
    into every head plus each layer's output bias; ``granularity="layer"`` has one row per
    layer's attention and MLP. Both include the embeddings and a ``final_bias`` part (final
    norm bias and unembedding bias), and each sums to ``total`` (the model's own value).
    Columns: batch, granularity, component, kind, layer, head, attribution, total.
    """
    if model.cfg.norm_placement != "pre":
        raise ValueError("direct logit attribution needs norm_placement='pre': in a post-norm model "
                         "the final residual stream is not a sum of component outputs, and with output norms "
                         f"({model.cfg.norm_placement}) each attention output is normalised after its heads are "
                         "summed, so no head has a linear share of it")
    tokens = as_tokens(model, tokens)
    batch, n_pos = tokens.shape
    pos = check_index("pos", pos, n_pos, negative=True, of=f"a prompt of {n_pos} tokens")
    answer_ids = _token_ids(model, "answer", answer, batch)
    direction = model.W_U[:, answer_ids].T  # [batch, d_model]
    bias_u = model.b_U[answer_ids]
    if wrong is not None:
        wrong_ids = _token_ids(model, "wrong", wrong, batch)
        direction = direction - model.W_U[:, wrong_ids].T
        bias_u = bias_u - model.b_U[wrong_ids]

    logits, cache = model.run_with_cache(tokens)
    parts, meta = [], []  # meta: (granularity, component, kind, layer, head)

    def add(vector: Tensor, granularity: str, component: str, kind: str, layer=-1, head=-1):
        parts.append(vector)
        meta.append((granularity, component, kind, layer, head))

    for granularity in ("head", "layer"):
        add(cache["hook_embed"][:, pos], granularity, "embed", "embed")
        if "hook_pos_embed" in cache.cache_dict:
            add(cache["hook_pos_embed"][:, pos], granularity, "pos_embed", "pos_embed")
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        z = cache[f"blocks.{layer}.attn.hook_z"][:, pos]  # [batch, head, d_head]
        heads = einsum(z, attn.W_O, "batch head d_head, head d_head d_model -> head batch d_model")
        for head in range(model.cfg.n_heads):
            add(heads[head], "head", unit_label(layer, head=head), "head", layer, head)
        add(attn.b_O.expand(batch, -1), "head", unit_label(layer, part="attn bias"), "attn_bias", layer)
        add(heads.sum(0) + attn.b_O, "layer", unit_label(layer, part="attn"), "attn", layer)
        if not model.cfg.attn_only:
            mlp_out = cache[f"blocks.{layer}.hook_mlp_out"][:, pos]
            for granularity in ("head", "layer"):
                add(mlp_out, granularity, unit_label(layer, part="mlp"), "mlp", layer)

    stack = _final_norm_linear(model, cache, torch.stack(parts), pos)
    attribution = (stack * direction).sum(-1)  # [component, batch]
    final_bias = bias_u.clone()
    if model.cfg.norm == "layernorm":
        final_bias = final_bias + direction @ model.ln_final.b
    total = logits[torch.arange(batch), pos, answer_ids]
    if wrong is not None:
        total = total - logits[torch.arange(batch), pos, wrong_ids]

    frame = pd.DataFrame(meta * batch, columns=["granularity", "component", "kind", "layer", "head"])
    frame.insert(0, "batch", np.repeat(np.arange(batch), len(meta)))
    frame["attribution"] = attribution.T.float().cpu().numpy().ravel()
    bias_rows = pd.DataFrame({
        "batch": np.repeat(np.arange(batch), 2), "granularity": ["head", "layer"] * batch,
        "component": "final_bias", "kind": "final_bias", "layer": -1, "head": -1,
        "attribution": np.repeat(final_bias.float().cpu().numpy(), 2),
    })
    frame = pd.concat([frame, bias_rows], ignore_index=True).sort_values(["batch", "granularity"], kind="stable")
    frame["total"] = total.float().cpu().numpy()[frame["batch"].to_numpy()]
    return frame.reset_index(drop=True)
