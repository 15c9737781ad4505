"""ReLU + L1: the original sparse autoencoder (Bricken et al. 2023); SAELens' ``standard``.

With unit-norm decoder rows the L1 penalty on activations is the decoder-norm-weighted L1 of
Anthropic's April 2024 update. The coefficient ramps up over the trainer's sparsity warm-up, so
early training can find directions before the penalty starts pruning them.
"""

from __future__ import annotations

from torch import Tensor

from workbench.analysis.dictionaries.base import Dictionary


class ReLUSAE(Dictionary):
    kind = "relu"
    architecture = "standard"

    def activate(self, pre: Tensor) -> Tensor:
        return pre.relu()

    def sparsity_loss(self, acts: Tensor, pre: Tensor, coefficient: float) -> dict[str, Tensor]:
        return {"l1": coefficient * acts.abs().sum(-1).mean()}
