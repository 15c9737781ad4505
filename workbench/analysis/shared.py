"""Several analyses of one prompt from one forward: :func:`one_forward`.

Each analysis of this package runs its own forward (``model(batch)`` or ``model.run_with_cache``
with the hooks it reads). A page that shows six of them on one prompt (the app's Inspect page:
the loss, the attention, the norms, the suggested answer, the attribution, the lens) paid six
forwards; on SmolLM2-135M that was most of its first page. :func:`one_forward` gives a stand-in
for the model that answers every forward of *those* tokens from a single ``run_with_cache``
(made on the first one asked for, caching the hooks named), and passes anything else (other
tokens, other arguments, a hook it did not cache) to the model itself::

    shared = an.one_forward(model, tokens, names=hooks)
    losses = an.token_losses(shared, tokens)
    lens = an.logit_lens(shared, tokens)          # no second forward
    assert shared.forwards == 1

The values are those of that one run. A forward that listens to ``hook_pattern`` or to a norm's
``hook_scale`` computes attention and the norm explicitly rather than through the fused kernels
an unhooked forward takes, so a result can differ from the same analysis run alone in the last
bits of float32 (well under 1e-5 on the shipped checkpoints and on SmolLM2; the tests compare).
Hooks attached to the model (ablations, steering) act on the one run as on any; do not attach
or remove any between two analyses that share it.

Weights changed between two analyses are seen where a cheap check can see them: before answering,
the stand-in compares every parameter's and buffer's identity, dtype, device, shape, storage
address and version counter with the run's, and runs again when any differs (a
``load_state_dict``, a cast such as ``model.double()``, a move, ``param.data = ...``, an in-place
op on a parameter, an optimizer step). An in-place edit through ``.data`` (``p.data.mul_(2)``) bumps
no version counter and is not seen: only a pass over every weight would see it, as long as the
forward this saves. After such an edit, make a new ``one_forward``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from workbench.cache import WorkbenchCache
from workbench.padding import TokenBatch
from workbench.utils import weights_stamp


class SharedForward:
    """The model, whose forwards on ``tokens`` are answered from one ``run_with_cache``.

    Every attribute but the two forwards is the model's (``cfg``, ``W_U``, ``blocks``, the
    tokenizer...). ``forwards`` counts the runs this stand-in made itself (0 or 1); runs passed
    on to the model are the model's.
    """

    def __init__(self, model, tokens: Tensor, names: Iterable[str]):
        tokens = torch.as_tensor(tokens)
        self.model = model
        self.tokens = (tokens[None] if tokens.ndim == 1 else tokens).to(model.device)
        unknown = sorted(set(names) - set(model.hook_dict))
        if unknown:
            raise ValueError(f"one_forward: no hook point named {unknown[:3]} in this model "
                             f"(its hook names are model.hook_dict's keys)")
        self.names = frozenset(names)
        self.forwards = 0
        self._run: Optional[tuple[Tensor, dict]] = None
        self._stamp: Optional[tuple] = None  # weights_stamp(model) right after the run

    def __getattr__(self, name: str) -> Any:  # only what this object lacks: everything but the forwards
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"SharedForward({type(self.model).__name__}, tokens {tuple(self.tokens.shape)}, {len(self.names)} hooks)"

    def _is_ours(self, input: Any, kwargs: dict) -> bool:
        """Whether a forward of ``input`` with ``kwargs`` is the one run: the same tokens, unpadded,
        and no option that changes what a forward returns."""
        if kwargs:
            return False
        if isinstance(input, TokenBatch):
            if not bool(input.attention_mask.bool().all()):
                return False
            input = input.tokens
        return (isinstance(input, Tensor) and input.shape == self.tokens.shape
                and input.device == self.tokens.device and torch.equal(input, self.tokens))

    def _the_run(self) -> tuple[Tensor, dict]:
        if self._run is None or weights_stamp(self.model) != self._stamp:
            logits, cache = self.model.run_with_cache(self.tokens, names_filter=lambda name: name in self.names)
            self._run = (logits, dict(cache.cache_dict))
            self._stamp = weights_stamp(self.model)  # after the run: a buffer it fills lazily is not an edit
            self.forwards += 1
        return self._run

    def __call__(self, input: Any = None, **kwargs: Any) -> Any:
        if not self._is_ours(input, kwargs):
            return self.model(input, **kwargs)
        # a copy: a caller may write into what it gets (task_answer masks the answer's logit)
        return self._the_run()[0].clone()

    forward = __call__

    def run_with_cache(self, input: Any = None, names_filter: Any = None, **kwargs: Any):
        """The model's ``run_with_cache``, from the one run when these tokens and every hook asked
        for are in it (``names_filter`` as the model takes it); a ``WorkbenchCache`` either way."""
        if names_filter is None or not self._is_ours(input, kwargs):
            return self.model.run_with_cache(input, names_filter=names_filter, **kwargs)
        wanted = set(self.model.hook_names_of(names_filter))
        if not wanted <= self.names:
            return self.model.run_with_cache(input, names_filter=names_filter, **kwargs)
        logits, stored = self._the_run()
        cache = WorkbenchCache({name: stored[name].clone() for name in wanted}, self.model, has_batch_dim=True)
        cache.attention_mask = self.model._mask_of((input,), {})  # as the model's own run_with_cache sets it
        return logits.clone(), cache


def one_forward(model, tokens: Tensor, names: Iterable[str]) -> SharedForward:
    """A stand-in for ``model`` whose forwards on ``tokens`` (one prompt [pos] or an unpadded
    batch [batch, pos]) share one ``run_with_cache`` caching the hooks ``names``; see the module
    docstring. Pass it to the analyses in place of the model."""
    return SharedForward(model, tokens, names)


def inspect_hooks(model) -> list[str]:
    """The hooks the per-prompt analyses of one prompt read: the stream entering every block and
    the final one (the logit lens, the residual norms), every attention pattern, and what direct
    logit attribution decomposes the final stream into (the embeddings, every head's z and
    MLP output, the final norm's scale). The token losses and the suggested answer read the logits."""
    n = model.cfg.n_layers
    wanted = {f"blocks.{n - 1}.hook_resid_post", "hook_embed", "hook_pos_embed", "ln_final.hook_scale"}
    for layer in range(n):
        wanted |= {f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_pattern",
                   f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_mlp_out"}
    return [name for name in model.hook_dict if name in wanted]
