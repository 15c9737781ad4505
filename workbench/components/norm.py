"""Normalisation layers: LayerNorm, RMSNorm and none, each exposing ``hook_scale``.

The scale (the per-position divisor) is a hook so TransformerLens' ``apply_ln_to_stack``
can reuse the exact scale of a run. The arithmetic mirrors ``torch.nn.LayerNorm`` /
``torch.nn.RMSNorm`` (tests compare against them). As in attention, unused hooks cost
nothing: when neither hook is listened to, the fused ``F.layer_norm`` / ``F.rms_norm`` runs.
"""

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.config import ModelConfig


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
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale) * self.w + self.b


class RMSNorm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            return F.rms_norm(x, self.w.shape, self.w, self.eps)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale) * self.w


class NoNorm(nn.Module):
    """Identity: the residual stream goes through unnormalised (no hooks to fire)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return x


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "none": NoNorm}
