"""WorkbenchCache: TransformerLens' ``ActivationCache`` made exact on models whose norms keep weights.

TL's ``apply_ln_to_stack`` (behind ``logit_attrs`` and every ``apply_ln=True`` of
``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``stack_neuron_results``)
centres a stack (LayerNorm) and divides it by the run's cached scale, and stops there: it
assumes the norm's weight was folded into the weights that read the norm (TL's ``fold_ln``).
On a model that keeps its weights (every model here until ``process_weights``) the result is
off by that weight; on stories-2026 per-head DLA through ``logit_attrs`` was off by up to a few
logits. This cache multiplies by the weight of the norm the stack is fed to (``ln_final``, or
layer ``l``'s ``ln1``/``ln2``), so ``apply_ln_to_stack(stack, l) @ W`` is each component's
true contribution to what reads that norm, processed or not (a folded norm's weight is ones).

A LayerNorm's bias is a constant that belongs to no component; as in a TL model whose bias was
folded into ``b_U`` (and ``b_Q``, ``b_in``, ...), it is left out of the stack: the library's DLA
reports it as the ``final_bias`` part. The logit-lens path (``accumulated_resid(apply_ln=True)``
up to the final layer) recomputes the statistics and already runs ``model.ln_final`` itself,
weight and bias, which is what ``workbench.analysis.logit_lens`` does too.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from jaxtyping import Float
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice, SliceInput


class WorkbenchCache(ActivationCache):
    """An ``ActivationCache`` whose norm-applying methods include the norms' weights."""

    def _norm_weight(self, layer: int, mlp_input: bool) -> Optional[torch.Tensor]:
        if self.model.cfg.normalization_type is None:
            return None
        if layer == self.model.cfg.n_layers:
            return self.model.ln_final.w
        return getattr(self.model.blocks[layer], "ln2" if mlp_input else "ln1").w

    def apply_ln_to_stack(
        self,
        residual_stack: Float[torch.Tensor, "num_components *batch_and_pos_dims d_model"],
        layer: Optional[int] = None,
        mlp_input: bool = False,
        pos_slice: Union[Slice, SliceInput] = None,
        batch_slice: Union[Slice, SliceInput] = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> Float[torch.Tensor, "num_components *batch_and_pos_dims_out d_model"]:
        """TL's ``apply_ln_to_stack``, then times the target norm's weight (see the module docstring)."""
        n_layers = self.model.cfg.n_layers
        target = n_layers if layer is None or layer == -1 else layer
        if target < n_layers and self.model.cfg.normalization_type is not None:
            block = self.model.blocks[target]
            if not hasattr(block, "ln2" if mlp_input else "ln1"):  # OLMo 2's reordered block: norms after
                raise ValueError(f"layer {target}'s {'MLP' if mlp_input else 'attention'} reads the residual stream "
                                 f"un-normalised in the {block.layout!r} block layout (its norms follow the "
                                 "sublayer): there is no norm to apply; use the stack as it is")
        out = super().apply_ln_to_stack(
            residual_stack, layer, mlp_input, pos_slice, batch_slice, has_batch_dim, recompute_ln
        )
        weight = self._norm_weight(target, mlp_input)
        if weight is None or (recompute_ln and target == n_layers):  # TL ran the module, weight and all
            return out
        return out * weight

    def _stack_neuron_results_apply_ln_projected(self, layer, pos_slice, neuron_slice, project_2d, mlp_input=False):
        # TL's analytic path scales by the cached norm scale itself; LN_s(x) * w @ p = LN_s(x) @ (w p).
        weight = self._norm_weight(layer, mlp_input)
        if weight is not None:
            project_2d = weight[:, None].to(project_2d.dtype) * project_2d
        return super()._stack_neuron_results_apply_ln_projected(
            layer, pos_slice, neuron_slice, project_2d, mlp_input=mlp_input
        )

    def apply_slice_to_batch_dim(self, batch_slice: Union[Slice, SliceInput]) -> "WorkbenchCache":
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return WorkbenchCache(sliced.cache_dict, self.model, has_batch_dim=sliced.has_batch_dim)
