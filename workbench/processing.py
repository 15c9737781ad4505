"""Weight processing: TransformerLens' four rewrites of a model's weights, on our models.

Each rewrite leaves what the model predicts unchanged and moves weights to where analysis
reads them; they run in TransformerLens' order (``ProcessWeights.process_weights``):

fold_ln -- a norm's weight (and LayerNorm's bias) moves into the weights that read the norm.
    For a reader ``y = norm(x) @ W + c`` with ``xhat`` the normalised input:
      LayerNorm  norm(x) = xhat * w + b,  xhat = (x - mean(x)) / sqrt(var(x) + eps)
                 y = xhat @ (w[:, None] * W) + (c + b @ W)
                 and, since xhat has zero mean over d_model, W is also centred along d_model.
                 The norm that remains is TL's "LNPre": centre, then divide by the scale.
      RMSNorm    norm(x) = xhat * w,  xhat = x / sqrt(mean(x^2) + eps)
                 y = xhat @ (w[:, None] * W); no centring (xhat does not have zero mean).
                 What remains is "RMSPre": divide by the scale.
                 Gemma's RMSNorm (norm='gemma_rmsnorm') scales by 1 + w_offset: that is its w.
      none       nothing to fold; the switch does nothing.
    The readers: ln1 -> W_Q, W_K, W_V (keys and values as stored, once per KV head);
    ln2 -> W_in, W_gate of the MLP, or of MoE the router and every expert (all read ln2's
    output); ln_final -> W_U, b_U. A parallel block (GPT-J/NeoX) has ln1 in front of attention
    and its own ln2 in front of the MLP, both reading resid_pre, so each folds into its own
    reader exactly as in a sequential block. RoPE rotates q and k after the projection and
    ALiBi adds to the scores, so neither interacts with the fold. The config records
    ``folded_ln=True``: the norms are rebuilt weightless, ``cfg.normalization_type`` reads
    "LNPre"/"RMSPre", and TL's cache methods (which assume a folded norm) are then exact.
    Post-norm cannot be folded: there the norm's output *is* the residual stream, read by the
    next block and by the skip connection alike, so its weight has no single reader to move
    into. The output norms of the sandwich and reordered layouts (``ln1_post``, ``ln2_post``)
    are the same case and keep their weights: a sandwich model folds ln1, ln2 and ln_final, a
    reordered (OLMo 2) model only ln_final. QK-norm weights stay (RoPE sits between them and
    the scores). Post-norm is refused, as is a LayerNorm bias in front of an MoE router (the router has no
    bias to absorb ``b @ W_router``, and a per-expert offset changes the routing).

center_writing_weights -- with a LayerNorm in front of every reader, LN(x + s * 1) = LN(x):
    the mean over d_model of what a component writes never reaches anyone. W_E, a learned
    W_pos, W_O, b_O, W_out and b_out (every expert's) lose that mean. Only valid for pre-norm
    LayerNorm models (RMSNorm keeps the mean; so does a post-norm block's skip path), so it is
    refused otherwise. A sinusoidal table is no weight and stays as it is.

center_unembed -- W_U and b_U lose their mean over the vocabulary: every logit at a position
    shifts by the same amount, so softmax, log-probabilities and logit differences are
    unchanged (logits themselves are not). Refused with ``final_logit_softcap``: cap * tanh(l / cap)
    is not shift-invariant, so the centred logits would predict differently.

fold_value_biases -- attention rows sum to one, so a head's value bias reaches the output as
    the constant b_V[h] @ W_O[h]: b_O += sum_h b_V[h] @ W_O[h] and b_V = 0. With grouped
    keys/values, query head h reads KV head h // group (``_b_V`` is stored per KV head).
    hook_v and hook_z then no longer include the bias (as in TransformerLens).

Tied embeddings: W_U is W_E transposed, one tensor. Folding the final norm into W_U, centring
W_E or centring W_U changes one side only, so such a model is untied first (TransformerLens'
HookedTransformer always holds W_U apart): ``tie_embeddings`` becomes False and checkpoints
then store W_U. Biases: a model built with ``bias=False`` holds its biases as fixed zeros; a
LayerNorm fold writes ``b @ W`` into them, so the processed config has ``bias=qkv_bias=True``
(TL creates the biases too), and folding value biases into a model with q/k/v biases only
(Qwen2) makes ``b_O`` a weight. A folded LayerNorm model keeps its unembedding bias.

The arithmetic runs in float32 on a copy of the weights; the model is rebuilt from the new
config in place (its device, dtype and train/eval mode kept), so hooks attached before are
removed and an optimizer holding the old parameters must be rebuilt.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig

State = dict[str, Tensor]


def process_state(
    cfg: ModelConfig,
    state: State,
    *,
    fold_ln: bool = True,
    center_writing_weights: Optional[bool] = None,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
) -> tuple[ModelConfig, State]:
    """The processed config and weights for ``(cfg, state)``; ``state`` is not modified.

    ``state`` holds every weight under its module name, biases that are fixed zeros included,
    the unembedding as ``unembed.W_U`` ([d_model, d_vocab]) and ``unembed.b_U`` even when tied
    (``model_state`` builds it). ``center_writing_weights=None`` means "where valid" (pre-norm
    LayerNorm); True on any other model raises.
    """
    fold_ln = fold_ln and cfg.norm != "none" and not cfg.folded_ln
    if fold_ln and cfg.norm_placement == "post":
        raise ValueError(
            "fold_ln=True is impossible with norm_placement='post': the norm's output is the residual "
            "stream itself (the next block and the skip connection both read it), so its weight has no "
            "single reader to fold into; pass fold_ln=False"
        )
    centring_valid = cfg.norm == "layernorm" and cfg.norm_placement == "pre"
    if center_unembed and cfg.final_logit_softcap is not None:
        raise ValueError(
            f"center_unembed=True changes the logits of a model with final_logit_softcap={cfg.final_logit_softcap}: "
            "the soft-cap's tanh is not shift-invariant as the softmax is; pass center_unembed=False"
        )
    if center_writing_weights is None:
        center_writing_weights = centring_valid
    elif center_writing_weights and not centring_valid:
        raise ValueError(
            "center_writing_weights=True needs norm='layernorm' with norm_placement='pre' (only a LayerNorm in "
            "front of every reader removes the residual stream's mean); this model has "
            f"norm={cfg.norm!r}, norm_placement={cfg.norm_placement!r}: pass center_writing_weights=False"
        )
    state = {k: v.detach().float().clone() for k, v in state.items()}
    changes: dict = {}
    if cfg.tie_embeddings and (fold_ln or center_writing_weights or center_unembed):
        changes["tie_embeddings"] = False
    if fold_ln:
        _fold_norms(cfg, state)
        changes["folded_ln"] = True
        if cfg.norm == "layernorm":
            changes.update(bias=True, qkv_bias=True)
    if center_writing_weights:
        _center_writing(cfg, state)
    if center_unembed:
        state["unembed.W_U"] -= state["unembed.W_U"].mean(-1, keepdim=True)
        state["unembed.b_U"] -= state["unembed.b_U"].mean()
    if fold_value_biases:
        _fold_value_biases(cfg, state)
        if cfg.qkv_bias and not changes.get("bias", cfg.bias):
            changes["bias"] = True
    return (cfg.replace(**changes) if changes else cfg), state


def _fold_into(state: State, w: Tensor, b: Optional[Tensor], weight: str, bias: Optional[str], centre: bool) -> None:
    """Fold ``norm(x) = xhat * w + b`` into the reader ``xhat @ W + c``; W's d_model axis is -2."""
    W = state[weight]
    if b is not None:
        if bias is None:
            raise AssertionError(f"{weight} has no bias to absorb the norm's bias")
        state[bias] = state[bias] + torch.einsum("d,...do->...o", b, W)
    W = W * w[:, None]
    state[weight] = W - W.mean(-2, keepdim=True) if centre else W


def _fold_norms(cfg: ModelConfig, state: State) -> None:
    layer_norm = cfg.norm == "layernorm"

    def take(norm: str) -> tuple[Tensor, Optional[Tensor]]:
        if f"{norm}.w_offset" in state:  # Gemma's RMSNorm scales by 1 + w_offset
            state[f"{norm}.w"] = 1.0 + state.pop(f"{norm}.w_offset")
        w = state[f"{norm}.w"]
        b = state.get(f"{norm}.b") if layer_norm else None
        state[f"{norm}.w"] = torch.ones_like(w)
        if b is not None:
            state[f"{norm}.b"] = torch.zeros_like(b)
        return w, b

    for layer in range(cfg.n_layers * (cfg.norm_placement != "reordered")):  # reordered: no norm reads into a layer
        p = f"blocks.{layer}"
        w, b = take(f"{p}.ln1")
        for weight, bias in _ln1_readers(cfg):
            _fold_into(state, w, b, f"{p}.attn.{weight}", f"{p}.attn.{bias}", layer_norm)
        if cfg.attn_only:
            continue
        w, b = take(f"{p}.ln2")
        if cfg.ffn == "moe" and layer >= cfg.moe_first_dense:
            if b is not None and bool(b.any()):
                raise ValueError(
                    f"fold_ln cannot fold layer {layer}'s LayerNorm bias into the MoE router: the router has no "
                    "bias, and the per-expert offset b @ W_gate changes which experts are chosen; pass fold_ln=False"
                )
            _fold_into(state, w, None, f"{p}.mlp.W_gate", None, layer_norm)
        readers = _mlps(cfg, layer)
        for mlp in readers:
            _fold_into(state, w, b, f"{mlp}.W_in", f"{mlp}.b_in", layer_norm)
            if f"{mlp}.W_gate" in state:
                _fold_into(state, w, b, f"{mlp}.W_gate", f"{mlp}.b_gate", layer_norm)
    w, b = take("ln_final")
    _fold_into(state, w, b, "unembed.W_U", "unembed.b_U", layer_norm)


def _center_writing(cfg: ModelConfig, state: State) -> None:
    def centre(name: str) -> None:
        state[name] = state[name] - state[name].mean(-1, keepdim=True)

    centre("embed.W_E")
    if cfg.positional == "learned":
        centre("pos_embed.W_pos")
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        centre(f"{p}.attn.W_O")
        centre(f"{p}.attn.b_O")
        if cfg.attn_only:
            continue
        for mlp in _mlps(cfg, layer):
            centre(f"{mlp}.W_out")
            centre(f"{mlp}.b_out")


def _ln1_readers(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(weight, bias) of the attention that read ln1's output (MLA: its down-projections)."""
    if cfg.attention == "mha":
        return (("W_Q", "b_Q"), ("_W_K", "_b_K"), ("_W_V", "_b_V"))
    query = (("W_Q", "b_Q"),) if cfg.q_lora_rank is None else (("W_DQ", "b_DQ"),)
    return query + (("W_DKV", "b_DKV"), ("W_KR", "b_KR"))


def _mlps(cfg: ModelConfig, layer: int) -> list[str]:
    """The dense MLPs of a layer's FFN: itself, or a MoE's routed and shared experts."""
    p = f"blocks.{layer}.mlp"
    if cfg.ffn != "moe" or layer < cfg.moe_first_dense:
        return [p]
    shared = [f"{p}.shared_experts"] if cfg.n_shared_experts else []
    return [f"{p}.experts.{e}" for e in range(cfg.n_experts)] + shared


def _fold_value_biases(cfg: ModelConfig, state: State) -> None:
    if cfg.attention == "mla":
        return  # MLA's values have no bias (they are read from the latent without one)
    group = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        b_V = state[f"{p}._b_V"].repeat_interleave(group, dim=0)  # [head, d_head], per query head
        state[f"{p}.b_O"] = state[f"{p}.b_O"] + torch.einsum("he,hed->d", b_V, state[f"{p}.W_O"])
        state[f"{p}._b_V"] = torch.zeros_like(state[f"{p}._b_V"])


# ---- on a model -----------------------------------------------------------------------------
def model_state(model) -> State:
    """Every weight of ``model`` by name, the fixed-zero biases and ``unembed.W_U``/``b_U`` included."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name, buf in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith(("b_", "_b_")) or leaf in ("w", "b"):  # biases and folded norms, not tables
            state.setdefault(name, buf.detach())
    state.pop("unembed.W_U_param", None)
    state["unembed.W_U"] = model.W_U.detach()
    return state


@torch.no_grad()
def process_weights(
    model,
    fold_ln: bool = True,
    center_writing_weights: Optional[bool] = None,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
):
    """Apply the processing to ``model`` in place and return it (see the module docstring)."""
    from workbench.model import HookedDecoder

    cfg, state = process_state(
        model.cfg, model_state(model), fold_ln=fold_ln, center_writing_weights=center_writing_weights,
        center_unembed=center_unembed, fold_value_biases=fold_value_biases,
    )
    param = model.W_E
    fresh = HookedDecoder(cfg, model.tokenizer)
    if not cfg.tie_embeddings:
        state["unembed.W_U_param"] = state.pop("unembed.W_U")
    persistent = fresh.state_dict()
    fresh.load_state_dict({k: state[k] for k in persistent}, strict=True)
    for name, buf in fresh.named_buffers():
        # A weight the new config still holds as a fixed buffer (a zero bias, a folded norm's
        # ones) must already have that value, or the rebuild would silently change the model.
        if name not in persistent and name in state and not torch.equal(state[name], buf):
            raise AssertionError(f"weight processing left {name} non-trivial but the processed config fixes it")
    fresh.to(device=param.device, dtype=param.dtype)
    fresh.train(model.training)
    model.reset_hooks(including_permanent=True)
    model.cfg = cfg
    for name in ("embed", "pos_embed", "blocks", "ln_final", "unembed"):
        setattr(model, name, getattr(fresh, name))
    model.setup()
    return model
