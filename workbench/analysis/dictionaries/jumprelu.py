"""JumpReLU (Rajamanoharan et al. 2024): a feature fires when its pre-activation passes a learned threshold.

    acts = pre * [pre > threshold]        (SAELens' ``jumprelu``: relu(pre) * [pre > relu(threshold)])

The step has no useful gradient, so the threshold learns through straight-through estimators
with a rectangle kernel of width ``bandwidth``: the reconstruction pulls thresholds down, and an
L0 penalty (the expected count of firing features) pushes them up. The threshold is a plain
parameter kept non-negative by a ReLU, as in SAELens (a log-threshold barely moves under Adam
from a small start).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig

BANDWIDTH = 0.05  # SAELens' jumprelu_bandwidth, in the trainer's normalised units
INIT_THRESHOLD = 0.01  # SAELens' jumprelu_init_threshold


def _rectangle(x: Tensor) -> Tensor:
    return ((x > -0.5) & (x < 0.5)).to(x)


class _JumpReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        grad_x = (x > threshold) * grad
        grad_t = (-(threshold / bw) * _rectangle((x - threshold) / bw) * grad).reshape(-1, x.shape[-1]).sum(0)
        return grad_x, grad_t, None


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        grad_t = (-(1.0 / bw) * _rectangle((x - threshold) / bw) * grad).reshape(-1, x.shape[-1]).sum(0)
        return None, grad_t, None


class JumpReLUSAE(Dictionary):
    kind = "jumprelu"
    architecture = "jumprelu"

    def __init__(self, cfg: DictionaryConfig):
        super().__init__(cfg)
        self.threshold = nn.Parameter(torch.full((cfg.d_sae,), INIT_THRESHOLD))
        self.bandwidth = float(cfg.extra.get("bandwidth", BANDWIDTH))

    def activate(self, pre: Tensor) -> Tensor:
        return pre.relu() * (pre > self.threshold.relu())

    def train_activate(self, pre: Tensor) -> Tensor:
        return _JumpReLU.apply(pre, self.threshold.relu(), self.bandwidth)

    def sparsity_loss(self, acts: Tensor, pre: Tensor, coefficient: float) -> dict[str, Tensor]:
        l0 = _Step.apply(pre, self.threshold.relu(), self.bandwidth).sum(-1).mean()
        return {"l0": coefficient * l0}
