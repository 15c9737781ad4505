"""Transcoders (Dunefsky et al. 2024): sparse features that read an MLP's input and write its output.

    acts = relu(x W_enc + b_enc)        x: the MLP's input (``blocks.{l}.ln2.hook_normalized``)
    y    = acts W_dec + b_dec           y: the MLP's output (``blocks.{l}.hook_mlp_out``)

A skip-transcoder (Paulo et al. 2025) adds a dense linear path ``x W_skip^T`` (zero at the start)
so the features only carry what a linear map cannot. Both train with ReLU + L1 and match
SAELens' ``transcoder`` / ``skip_transcoder`` (no ``b_dec`` subtracted from the input, whose
width may differ from the output's).

With ``k`` set in the config (``DictionaryConfig(kind="transcoder", ..., k=16)``) the activation is
TopK instead of ReLU: each token keeps its k largest pre-activations, the form circuit-tracer's
TopK transcoders take (they are built in code; its files hold ReLU and JumpReLU ones). ``train_sae``
trains one with ``activation="topk"`` and ``k`` (or just ``k=`` given to it): no L1 then, AuxK for
dead features as for TopK SAEs, and training decodes only the kept entries.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from workbench.analysis.dictionaries.topk import topk_relu, topk_sparse
from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig, SparseActs


class Transcoder(Dictionary):
    kind = "transcoder"
    architecture = "transcoder"
    is_transcoder = True

    def __init__(self, cfg: DictionaryConfig):
        if cfg.k and (not float(cfg.k).is_integer() or not 1 <= cfg.k <= cfg.d_sae):
            raise ValueError(f"a TopK transcoder needs an integer k in [1, d_sae={cfg.d_sae}], got k={cfg.k}")
        super().__init__(cfg.replace(apply_b_dec_to_input=False, k=int(cfg.k)))

    def activate(self, pre: Tensor) -> Tensor:
        if self.cfg.k:
            return topk_relu(pre, self.cfg.k)
        return pre.relu()

    def sparse_activate(self, pre: Tensor) -> Optional[tuple[Tensor, Tensor]]:
        return topk_sparse(pre, self.cfg.k) if self.cfg.k else None

    def train_encode(self, pre: Tensor):
        if not self.cfg.k:
            return self.train_activate(pre)
        k = int(self.cfg.k)  # TopK: the kept entries only, as TopKSAE trains
        values, indices = pre.topk(k, dim=-1, sorted=False)
        offsets = torch.arange(0, pre.shape[0] * k, k, device=pre.device)
        return SparseActs(values.relu().flatten(), indices.flatten(), offsets, pre.shape[0])

    def sparsity_loss(self, acts, pre: Tensor, coefficient: float) -> dict[str, Tensor]:
        if self.cfg.k:  # TopK: k sets the sparsity, no penalty
            return {}
        return {"l1": coefficient * acts.abs().sum(-1).mean()}


class SkipTranscoder(Transcoder):
    kind = "skip_transcoder"
    architecture = "skip_transcoder"

    def __init__(self, cfg: DictionaryConfig):
        super().__init__(cfg)
        self.W_skip = nn.Parameter(torch.zeros(cfg.d_out, cfg.d_in))

    def decode(self, acts: Tensor, x: Optional[Tensor] = None) -> Tensor:
        if x is None:
            raise ValueError("a skip-transcoder's output depends on its input: call decode(acts, x)")
        return acts @ self.W_dec + self.b_dec + x.to(self.W_skip.dtype) @ self.W_skip.T

    def train_decode(self, acts, x: Tensor) -> Tensor:
        if isinstance(acts, SparseActs):  # the base decodes the bags; the skip path is added here
            return super().train_decode(acts, x) + x.to(self.W_skip.dtype) @ self.W_skip.T
        return self.decode(acts, x)

    def decode_sparse(self, values: Tensor, indices: Tensor, x: Optional[Tensor] = None) -> Tensor:
        if x is None:
            raise ValueError("a skip-transcoder's output depends on its input: call decode_sparse(values, indices, x)")
        return super().decode_sparse(values, indices) + x.to(self.W_skip.dtype) @ self.W_skip.T
