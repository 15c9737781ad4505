"""Resume a forward pass from one replaced activation, reusing everything computed before it.

Ablation sweeps and activation patching change one activation of one block and look at
the logits. Everything upstream of that activation is the same as in a cached run, so
instead of a full forward with a hook we start from the cached values: the block's
remaining arithmetic (``Block.resume``, which runs the block's own layout method) and then
``model(resid, start_at_layer=l + 1)``. For a head, only the attention output of that
layer changes, so the layer's attention itself is never recomputed: ``attn_out = z W_O + b_O``
from the edited ``z``. This module only picks the site and reads the cache; the block
decides what the replacement leaves unchanged (``Block.unaffected_by``), so the result
equals a hooked full forward to the last bit when the batch is the same (tests check it
on every layout in ``workbench.components.block.LAYOUTS``).

A padded batch resumes with its ``attention_mask``: the rest of the block (MoE routing skips
pads) and every later layer (no query sees a pad key; positions come from the mask) then
compute what the full forward of the padded batch computes, so each row is still its prompt
alone. Without the mask the later layers would attend to pads and count them as positions.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from workbench.padding import Padding, check_attention_mask

SITES = ("resid_pre", "z", "attn_out", "resid_mid", "mlp_out")
CACHE_HOOKS = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "hook_mlp_out")


def hook_name(layer: int, site: str) -> str:
    return f"blocks.{layer}.{dict(zip(SITES, CACHE_HOOKS))[site]}"


def attn_out_from_z(model, layer: int, z: Float[Tensor, "batch pos head_index d_head"]) -> Float[Tensor, "batch pos d_model"]:
    """The attention output from per-head values: the same call as the Attention module's final step,
    then the block's output norm where its layout has one (sandwich, reordered: ``ln1_post``)."""
    attn = model.blocks[layer].attn
    out = F.linear(rearrange(z, "batch pos head d_head -> batch pos (head d_head)"),
                   rearrange(attn.W_O, "head d_head d_model -> d_model (head d_head)"), attn.b_O)
    post = getattr(model.blocks[layer], "ln1_post", None)
    return out if post is None else post(out)


def run_from_site(
    model,
    layer: int,
    site: str,
    value: Tensor,
    cached: dict,
    return_type: str = "logits",
    tokens: Optional[Tensor] = None,
    attention_mask: Optional[Tensor] = None,
) -> Tensor:
    """Logits (or loss) with activation ``site`` of block ``layer`` replaced by ``value``.

    ``cached`` maps hook names to this run's activations at ``layer`` (batch may be a
    multiple of the cached batch when several edits run stacked: they are tiled, and so is
    ``attention_mask``, the cached run's [batch, pos] mask when it was padded).
    """
    if site not in SITES:
        raise ValueError(f"site={site!r} is not valid; choose one of {list(SITES)}")
    repeat = value.shape[0] // cached[hook_name(layer, "resid_pre")].shape[0]
    mask = None
    if attention_mask is not None:
        mask = check_attention_mask(attention_mask, cached[hook_name(layer, "resid_pre")].shape[:2]).to(value.device)
        mask = mask.repeat(repeat, 1) if repeat > 1 else mask
    if site == "resid_pre":
        return model(value, start_at_layer=layer, tokens=tokens, return_type=return_type, attention_mask=mask)

    def get(s: str) -> Tensor:
        t = cached[hook_name(layer, s)]
        return t.repeat(repeat, *([1] * (t.ndim - 1))) if repeat > 1 else t

    block = model.blocks[layer]
    if site == "z":
        site, value = "attn_out", attn_out_from_z(model, layer, value)
    unchanged = {s: get(s) for s in block.unaffected_by(site)}
    padding = None if mask is None or bool(mask.all()) else Padding(mask)
    # hooks on this block's later sites read each row's own positions, as in a full forward
    model.row_positions = None if padding is None else padding.key_positions[:, padding.offset:]
    try:
        resid = block.resume(get("resid_pre"), **unchanged, **{site: value}, padding=padding)
    finally:
        model.row_positions = None
    return model(resid, start_at_layer=layer + 1, tokens=tokens, return_type=return_type, attention_mask=mask)


def needed_hooks(model) -> set[str]:
    """The hook names ``run_from_site`` reads, for every layer of this model."""
    return {hook_name(block.layer, site) for block in model.blocks for site in ("resid_pre", "z", *block.sites)}
