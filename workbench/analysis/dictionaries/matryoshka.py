"""Matryoshka BatchTopK (Bussmann et al. 2025, arXiv 2503.17547): BatchTopK with nested reconstructions.

The features are ordered in levels of growing width ``w_1 < w_2 < ... < d_sae``. Training adds,
for every inner level, the reconstruction error of the first ``w_i`` features alone (same
activations, ``b_dec`` included), so the early features must reconstruct on their own: general
features land there and are not absorbed by more specific ones. Inference is BatchTopK's (one
shared threshold), and so is the file: SAELens saves Matryoshka BatchTopK as a ``jumprelu`` with
that threshold; ``sae_meta.json`` brings the kind and the widths back here.

The loss follows SAELens 6.54's ``MatryoshkaBatchTopKTrainingSAE.training_forward_pass``: the
outer level is the ordinary BatchTopK loss (MSE + AuxK on the whole dictionary); each inner level
adds ``||x - (acts[:, :w] W_dec[:w] + b_dec)||^2`` summed over the hidden size, averaged over rows.
"""

from __future__ import annotations

from typing import Union

from torch import Tensor

from workbench.analysis.dictionaries.base import DictionaryConfig, SparseActs
from workbench.analysis.dictionaries.batchtopk import BatchTopKSAE


def default_widths(d_sae: int, levels: int = 4) -> list[int]:
    """Doubling widths ending at ``d_sae`` (e.g. 512 -> [64, 128, 256, 512])."""
    return sorted({max(1, d_sae >> i) for i in range(levels)})


class MatryoshkaBatchTopKSAE(BatchTopKSAE):
    kind = "matryoshka_batchtopk"
    architecture = "jumprelu"

    def __init__(self, cfg: DictionaryConfig):
        widths = cfg.extra.get("matryoshka_widths") or default_widths(cfg.d_sae)
        widths = [int(w) for w in widths]
        if widths[-1] != cfg.d_sae:
            widths.append(cfg.d_sae)  # SAELens adds the full width as the last level too
        if any(w <= 0 for w in widths) or any(a >= b for a, b in zip(widths, widths[1:])):
            raise ValueError(f"matryoshka_widths must be positive and strictly increasing up to d_sae={cfg.d_sae}, "
                             f"got {widths}")
        cfg = cfg.replace(extra={**cfg.extra, "matryoshka_widths": widths})
        super().__init__(cfg)

    @property
    def widths(self) -> list[int]:
        return list(self.cfg.extra["matryoshka_widths"])

    def inner_losses(self, acts: Union[Tensor, SparseActs], y: Tensor) -> dict[str, Tensor]:
        """The squared error of each inner level's reconstruction (the outer one is the trainer's MSE)."""
        dense = acts.dense(self.cfg.d_sae) if isinstance(acts, SparseActs) else acts
        out: dict[str, Tensor] = {}
        decoded = self.b_dec
        previous = 0
        for width in self.widths[:-1]:
            decoded = dense[:, previous:width] @ self.W_dec[previous:width] + decoded
            out[f"inner_mse_loss_{width}"] = (decoded - y).pow(2).sum(-1).mean()
            previous = width
        return out
