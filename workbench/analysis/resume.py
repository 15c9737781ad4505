"""Resume a forward pass from one replaced activation, reusing everything computed before it.

Ablation sweeps and activation patching change one activation of one block and look at
the logits. Everything upstream of that activation is the same as in a cached run, so
instead of a full forward with a hook we start from the cached values: the block's
remaining arithmetic (``finish_block``) and then ``model(resid, start_at_layer=l + 1)``.
For a head, only the attention output of that layer changes, so the layer's attention
itself is never recomputed: ``attn_out = z W_O + b_O`` from the edited ``z``.

``finish_block`` mirrors ``Block``'s layouts operation for operation, so the result equals
a hooked full forward to the last bit when the batch is the same (tests check it).
"""

from __future__ import annotations

from typing import Optional

from jaxtyping import Float
from torch import Tensor

SITES = ("resid_pre", "z", "attn_out", "resid_mid", "mlp_out")
CACHE_HOOKS = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "hook_mlp_out")


def hook_name(layer: int, site: str) -> str:
    return f"blocks.{layer}.{dict(zip(SITES, CACHE_HOOKS))[site]}"


def attn_out_from_z(model, layer: int, z: Float[Tensor, "batch pos head_index d_head"]) -> Float[Tensor, "batch pos d_model"]:
    """The attention output from per-head values: exactly the Attention module's final step."""
    attn = model.blocks[layer].attn
    return z.flatten(2) @ attn.W_O.flatten(0, 1) + attn.b_O


def finish_block(
    model,
    layer: int,
    resid_pre: Float[Tensor, "batch pos d_model"],
    attn_out: Optional[Tensor] = None,
    resid_mid: Optional[Tensor] = None,
    mlp_out: Optional[Tensor] = None,
) -> Float[Tensor, "batch pos d_model"]:
    """Block ``layer``'s output given its input and the activations already known.

    Pass ``attn_out`` (and, for a parallel block, the unchanged ``mlp_out``), or
    ``resid_mid``, or ``resid_mid`` and a replaced ``mlp_out``.
    """
    cfg, block = model.cfg, model.blocks[layer]
    if cfg.attn_only:
        x = resid_pre + attn_out
        return block.ln1(x) if cfg.norm_placement == "post" else x
    if cfg.parallel_residual:
        return resid_pre + attn_out + mlp_out
    post = cfg.norm_placement == "post"
    if resid_mid is None:
        resid_mid = block.ln1(resid_pre + attn_out) if post else resid_pre + attn_out
    if mlp_out is None:
        mlp_out = block.mlp(resid_mid if post else block.ln2(resid_mid))
    return block.ln2(resid_mid + mlp_out) if post else resid_mid + mlp_out


def run_from_site(
    model,
    layer: int,
    site: str,
    value: Tensor,
    cached: dict,
    return_type: str = "logits",
    tokens: Optional[Tensor] = None,
) -> Tensor:
    """Logits (or loss) with activation ``site`` of block ``layer`` replaced by ``value``.

    ``cached`` maps hook names to this run's activations at ``layer`` (batch may be a
    multiple of the cached batch when several edits run stacked: they are tiled).
    """
    repeat = value.shape[0] // cached[hook_name(layer, "resid_pre")].shape[0]

    def get(s: str) -> Tensor:
        t = cached[hook_name(layer, s)]
        return t.repeat(repeat, *([1] * (t.ndim - 1))) if repeat > 1 else t

    if site == "resid_pre":
        return model(value, start_at_layer=layer, tokens=tokens, return_type=return_type)
    if site in ("z", "attn_out"):
        attn_out = attn_out_from_z(model, layer, value) if site == "z" else value
        parallel_mlp = get("mlp_out") if model.cfg.parallel_residual else None
        resid = finish_block(model, layer, get("resid_pre"), attn_out=attn_out, mlp_out=parallel_mlp)
    elif site == "resid_mid":
        resid = finish_block(model, layer, get("resid_pre"), resid_mid=value)
    elif site == "mlp_out":
        if model.cfg.parallel_residual:
            resid = finish_block(model, layer, get("resid_pre"), attn_out=get("attn_out"), mlp_out=value)
        else:
            resid = finish_block(model, layer, get("resid_pre"), resid_mid=get("resid_mid"), mlp_out=value)
    else:
        raise ValueError(f"site={site!r} is not valid; choose one of {list(SITES)}")
    return model(resid, start_at_layer=layer + 1, tokens=tokens, return_type=return_type)


def needed_hooks(model) -> set[str]:
    """The hook names ``run_from_site`` reads, for every layer of this model."""
    names = set()
    for layer in range(model.cfg.n_layers):
        for site in SITES:
            if site == "resid_mid" and (model.cfg.attn_only or model.cfg.parallel_residual):
                continue
            if site == "mlp_out" and model.cfg.attn_only:
                continue
            names.add(hook_name(layer, site))
    return names
