"""TopK (Gao et al. 2024): keep each token's k largest pre-activations (then ReLU); SAELens' ``topk``.

Sparsity is set by k, not by a penalty, so nothing trades reconstruction for sparsity. Features
that stop firing get a second chance through the auxiliary loss (``aux_k_loss``): the top
``k_aux`` dead features alone try to reconstruct what the live ones missed.
"""

from __future__ import annotations

import torch
from torch import Tensor

import torch.nn.functional as F

from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig, SparseActs
from workbench.analysis.dictionaries.select import row_topk


def _chunk_width(n: int, k: int) -> int:
    """The chunk width ``c`` (a divisor of ``n`` with at least ``k`` chunks) that makes the two
    selections of ``chunked_topk`` smallest (``n / c + k * c`` elements, least near sqrt(n / k));
    0 when they would not scan under half of the ``n`` a plain top-k scans."""
    widths = [c for c in range(2, n // k + 1) if n % c == 0]
    best = min(widths, key=lambda c: (n // c + k * c, -c), default=0)  # on a tie the wider chunks (fewer gathers)
    return best if best and n // best + k * best <= n // 2 else 0


def chunked_topk(pre: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``pre.topk(k, dim=-1, sorted=False)``, the same elements (ties at the k-th value aside, where
    any choice is a top k), at about half the cost for a wide row and a small k.

    The row is cut into chunks of ``c``; the k chunks with the largest maxima hold every one of the
    row's k largest values (a value among them is at least the k-th largest chunk maximum, since k
    distinct chunks reach that, so its own chunk's maximum does too), so a top k over those ``k * c``
    candidates finds them. The two top-k calls scan ``n / c + k * c`` elements instead of ``n``;
    torch's CPU top-k costs about the same per element scanned, and the chunk maxima are one
    vectorised pass."""
    n, c = pre.shape[-1], _chunk_width(pre.shape[-1], k)
    if not c:
        return pre.topk(k, dim=-1, sorted=False)
    chunks = pre.unflatten(-1, (n // c, c))
    _, best = chunks.amax(-1).topk(k, dim=-1, sorted=False)
    candidates = chunks.gather(-2, best.unsqueeze(-1).expand(*best.shape, c)).flatten(-2)
    values, at = candidates.topk(k, dim=-1, sorted=False)
    return values, best.gather(-1, at // c) * c + at % c


def topk_sparse(pre: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` largest pre-activations (ReLU'd) and their feature indices (``select.row_topk``:
    a one-pass C kernel on one CPU thread, else ``chunked_topk``)."""
    values, indices = row_topk(pre, int(k))
    return values.relu(), indices


def topk_relu(pre: Tensor, k: int) -> Tensor:
    """Each row's ``k`` largest pre-activations (ReLU'd), zeros elsewhere."""
    values, indices = topk_sparse(pre, k)
    return torch.zeros_like(pre).scatter_(-1, indices, values)


class TopKSAE(Dictionary):
    kind = "topk"
    architecture = "topk"

    def __init__(self, cfg: DictionaryConfig):
        if not float(cfg.k).is_integer() or not 1 <= cfg.k <= cfg.d_sae:
            raise ValueError(f"a TopK dictionary needs an integer k in [1, d_sae={cfg.d_sae}], got k={cfg.k}")
        super().__init__(cfg.replace(k=int(cfg.k)))

    def activate(self, pre: Tensor) -> Tensor:
        return topk_relu(pre, self.cfg.k)

    def sparse_activate(self, pre: Tensor) -> tuple[Tensor, Tensor]:
        return topk_sparse(pre, self.cfg.k)

    def train_encode(self, pre: Tensor) -> SparseActs:
        k = int(self.cfg.k)
        values, indices = pre.topk(k, dim=-1, sorted=False)
        offsets = torch.arange(0, pre.shape[0] * k, k, device=pre.device)
        return SparseActs(values.relu().flatten(), indices.flatten(), offsets, pre.shape[0])


def aux_k_loss(sae: Dictionary, pre: Tensor, residual: Tensor, dead: Tensor) -> Tensor:
    """How well the ``k_aux = d_out // 2`` most active dead features reconstruct ``residual`` (no bias).

    Scaled down when fewer than ``k_aux`` features are dead (SAELens, sparsify); 0 when none are.
    """
    n_dead = int(dead.sum())
    if n_dead == 0:
        return pre.new_zeros(())
    k_aux = max(1, sae.cfg.d_out // 2)
    scale = min(n_dead / k_aux, 1.0)
    masked = torch.where(dead, pre, torch.full_like(pre, float("-inf")))
    k = min(k_aux, n_dead)
    values, indices = masked.topk(k, dim=-1, sorted=False)
    offsets = torch.arange(0, pre.shape[0] * k, k, device=pre.device)
    recons = F.embedding_bag(indices.flatten(), sae.W_dec, offsets, mode="sum", per_sample_weights=values.relu().flatten())
    return scale * (recons - residual.detach()).pow(2).sum(-1).mean()
