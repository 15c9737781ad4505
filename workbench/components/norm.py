"""Normalisation layers: LayerNorm, RMSNorm and none, each exposing ``hook_scale``.

The scale (the per-position divisor) is a hook so TransformerLens' ``apply_ln_to_stack``
can reuse the exact scale of a run. The arithmetic mirrors ``torch.nn.LayerNorm`` /
``torch.nn.RMSNorm`` (tests compare against them). As in attention, unused hooks cost
nothing: when neither hook is listened to, the fused ``F.layer_norm`` / ``F.rms_norm`` runs.

In bfloat16 / float16 the statistics are computed in float32, as the references do:
``F.layer_norm`` (what HF's GPT-2 and GPT-NeoX call) works in float32 and rounds once at the
end; HF's Llama-family RMSNorm normalises in float32, rounds to the input dtype, then multiplies
by the weight. Each form here rounds where its reference rounds, so a bf16 import reproduces
the bf16 reference, not just the float32 one. ``hook_scale`` is then float32 (TransformerLens
does the same).

Once ``process_weights(fold_ln=True)`` has moved the weights into the layers that read a
norm (``cfg.folded_ln``), the registry builds the weightless forms TransformerLens calls
LNPre (centre, then divide by the scale) and RMSPre (divide by the scale). They keep ``w``
(ones) and, for LayerNorm, ``b`` (zeros) as non-persistent buffers, so code that reads
``norm.w`` sees the folded norm's true, identity weight and checkpoints store nothing for it.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.config import ModelConfig


def _wide(x: Tensor) -> bool:
    return x.dtype in (torch.float32, torch.float64)


def _stat(x: Tensor) -> Tensor:
    """``x`` in the dtype its statistics are computed in: float32 for half precision, else its own.
    (``x.float()`` here rounded a float64 model's stream to float32 whenever a hook listened, so a
    hook on a norm moved a float64 model's logits by about 2e-6.)"""
    return x if _wide(x) else x.float()


class LayerNorm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            return F.layer_norm(x, self.w.shape, self.w, self.b, self.eps)
        xf = _stat(x)
        xf = xf - xf.mean(-1, keepdim=True)
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return (self.hook_normalized(xf / scale) * self.w + self.b).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, cfg: ModelConfig, dim: Optional[int] = None):
        super().__init__()
        self.eps = cfg.norm_eps
        self.w = nn.Parameter(torch.ones(cfg.d_model if dim is None else dim))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self._normalize(x)

    def _normalize(self, x: Tensor) -> Tensor:
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            if _wide(x):
                return F.rms_norm(x, self.w.shape, self.w, self.eps)
            return F.rms_norm(x.float(), self.w.shape, None, self.eps).to(x.dtype) * self.w
        xf = _stat(x)
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized((xf / scale).to(x.dtype)) * self.w


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the scale is (1 + w_offset), so the learned parameter starts at zero.

    ``w`` is the scale itself (1 + w_offset), so code that reads a norm's weight (folding,
    ``apply_ln_to_stack``, attributions) sees what multiplies the normalised input. Rounding
    follows HF's Gemma, not Llama: normalise and scale in float32, round once at the end.
    ``dim`` (default d_model) is d_head for a QK-norm.
    """

    def __init__(self, cfg: ModelConfig, dim: Optional[int] = None):
        super().__init__()
        self.eps = cfg.norm_eps
        self.w_offset = nn.Parameter(torch.zeros(cfg.d_model if dim is None else dim))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    @property
    def w(self) -> Float[Tensor, " d_model"]:
        return 1.0 + self.w_offset

    def forward(self, x: Float[Tensor, "*batch dim"]) -> Float[Tensor, "*batch dim"]:
        xf = _stat(x)
        scale = 1.0 + self.w_offset.to(xf.dtype)
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            return (F.rms_norm(xf, scale.shape, None, self.eps) * scale).to(x.dtype)
        rms = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return (self.hook_normalized(xf / rms) * scale).to(x.dtype)


class QKNorm(RMSNorm):
    """QK-norm: RMSNorm over the last axis of queries or keys (``cfg.qk_norm``), before RoPE.

    ``dim`` is d_head (per head: [batch, pos, head, d_head], one weight shared by the heads) or
    n_heads * d_head (over the projection: [batch, pos, n_heads * d_head]). In bf16/fp16 it rounds
    as HF's Qwen3 norm does (before the weight; OLMo 2's rounds after it, one rounding apart). It
    is never folded: RoPE sits between it and the scores, so its weight has no linear reader.
    """

    def __init__(self, cfg: ModelConfig, dim: int):
        super().__init__(cfg, dim)

    def forward(self, x: Float[Tensor, "*batch dim"]) -> Float[Tensor, "*batch dim"]:
        return self._normalize(x)


class _Folded(nn.Module):
    has_bias = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.register_buffer("w", torch.ones(cfg.d_model), persistent=False)
        if self.has_bias:
            self.register_buffer("b", torch.zeros(cfg.d_model), persistent=False)
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def _hooked(self) -> bool:
        return self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()


class LayerNormPre(_Folded):
    """LayerNorm whose weight and bias were folded away: (x - mean) / sqrt(var + eps)."""

    has_bias = True

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if not self._hooked():
            return F.layer_norm(x, self.w.shape, None, None, self.eps)
        xf = _stat(x)
        xf = xf - xf.mean(-1, keepdim=True)
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(xf / scale).to(x.dtype)


class RMSNormPre(_Folded):
    """RMSNorm whose weight was folded away: x / sqrt(mean(x^2) + eps)."""

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if not self._hooked():
            return F.rms_norm(x if _wide(x) else x.float(), self.w.shape, None, self.eps).to(x.dtype)
        xf = _stat(x)
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized((xf / scale).to(x.dtype))


class NoNorm(nn.Module):
    """Identity: the residual stream goes through unnormalised (no hooks to fire)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return x


def _unless_folded(full: type, folded: type):
    """One ``norm`` choice: the module with weights, or its weightless form once ``cfg.folded_ln``."""

    def build(cfg: ModelConfig) -> nn.Module:
        return folded(cfg) if cfg.folded_ln else full(cfg)

    build.__name__ = full.__name__
    return build


# The output norms of the sandwich and reordered layouts (``ln1_post``, ``ln2_post``): their output
# is written to the residual stream, so no weight folds into a reader and they keep it when folded.
OUTPUT_NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "gemma_rmsnorm": GemmaRMSNorm, "none": NoNorm}

NORMS = {
    "layernorm": _unless_folded(LayerNorm, LayerNormPre),
    "rmsnorm": _unless_folded(RMSNorm, RMSNormPre),
    "gemma_rmsnorm": _unless_folded(GemmaRMSNorm, RMSNormPre),
    "none": NoNorm,
}
