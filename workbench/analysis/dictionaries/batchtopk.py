"""BatchTopK (Bussmann et al. 2024): the k x rows largest activations of a whole batch survive.

Tokens that need more features get more, as long as the batch averages k. A batch-dependent
activation cannot run at inference (a token's features would depend on its neighbours), so
training keeps a running estimate of the smallest activation that survives, and inference fires a
feature when its pre-activation exceeds that threshold: a JumpReLU with one shared threshold.
That is also how SAELens saves BatchTopK dictionaries (architecture ``jumprelu``, a ``threshold``
vector), so ours load there as JumpReLU and come back here as BatchTopK (``sae_meta.json``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig, SparseActs

THRESHOLD_LR = 0.01  # SAELens' topk_threshold_lr: the running threshold's EMA rate


class BatchTopKSAE(Dictionary):
    kind = "batchtopk"
    architecture = "jumprelu"

    def __init__(self, cfg: DictionaryConfig):
        if not 0 < cfg.k <= cfg.d_sae:
            raise ValueError(f"a BatchTopK dictionary needs 0 < k <= d_sae={cfg.d_sae} (a mean per token), got k={cfg.k}")
        super().__init__(cfg)
        self.register_buffer("threshold", torch.zeros(cfg.d_sae))

    def activate(self, pre: Tensor) -> Tensor:
        return pre.relu() * (pre > self.threshold)

    def train_activate(self, pre: Tensor) -> Tensor:
        acts = pre.relu()
        flat = acts.flatten()
        keep = min(flat.numel(), max(1, round(self.cfg.k * acts[..., 0].numel())))
        values, indices = flat.topk(keep, sorted=False)
        return torch.zeros_like(flat).scatter_(-1, indices, values).view_as(acts)

    def train_encode(self, pre: Tensor) -> SparseActs:
        rows, d_sae = pre.shape
        flat = pre.relu().flatten()
        values, where = flat.topk(min(flat.numel(), max(1, round(self.cfg.k * rows))), sorted=False)
        where, order = where.sort()  # grouped by row, for the bags
        row_ids = where // d_sae
        counts = torch.bincount(row_ids, minlength=rows)
        return SparseActs(values[order], where % d_sae, torch.cumsum(counts, 0) - counts, rows)

    @torch.no_grad()
    def after_batch(self, acts) -> None:
        acts = acts.values if isinstance(acts, SparseActs) else acts
        positive = acts[acts > 0]
        if positive.numel():
            self.threshold.mul_(1 - THRESHOLD_LR).add_(THRESHOLD_LR * positive.min())
