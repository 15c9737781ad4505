"""A compiled HookedDecoder whose hooks torch.compile honours: ``model.compile()``.

    model.compile()                       # or wb.compile_model(model, backend="aot_eager", ...)
    model(tokens)                         # compiled
    with model.hooks(fwd_hooks=[...]):    # any hook, attached before or after compiling
        model(tokens)                     # compiled with the hook in its graph

Why plain ``torch.compile(model)`` loses hooks: dynamo traces a HookPoint's hooks into the graph
when they are there, but by default (``torch._dynamo.config.skip_nnmodule_hook_guards``) it puts
no guard on a module's *empty* hook dictionaries. A hook attached after compiling is then never
seen, and, since every block runs the same code, a graph traced for an unhooked layer is reused
for a hooked one: a hook attached before compiling is dropped too when it sits in any layer but
the first traced through that code. Nothing warns.

What this module does: each call of the compiled model runs with those guards on, so the
compiled code checks, on every call, which hook points carry hooks, and any change (a hook
attached, removed, moved to another layer, a dictionary spliced in) makes dynamo trace again,
with the hooks in the graph. Each configuration is compiled once and cached (up to
``recompile_limit`` configurations per model, by default dynamo's 8 plus two per block; past that
dynamo runs the model eagerly, still with every hook, and a warning says so once). A hook is traced like the rest of the model: a closure over a tensor (a
steering vector, a patch's clean activation) reads that tensor on every call, so new values of the
same shape do not recompile; a Python number in a closure (a head index) is a constant of the
graph, so another number compiles once more. Hooks that dynamo cannot trace (a ``print``, an
``.item()``) break the graph there and run eagerly: slower, never wrong.

Plain ``torch.compile(model)`` (or ``nn.Module.compile`` of a model that is not a HookedDecoder)
cannot give that guarantee, so a HookedDecoder compiled that way refuses to run while any hook is
attached, with an error naming the hook; without hooks it runs compiled as before.

Inside a compiled graph the model avoids the data-dependent branches of its eager path: the token
range check and the attention mask's checks (0/1 values, a real token in every row, whether any
pad is there at all) run here, before the graph; a padded batch is not packed (its real tokens
gathered, a data-dependent shape) but runs padded, as with a hook attached; and a non-finite query
or key (a broken weight) makes the attention's whole output NaN instead of switching to the
explicit path.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
from torch import Tensor, nn

from workbench.padding import TokenBatch, check_attention_mask, loss_targets, mask_is_padded


def hooked_points(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that carry a forward, pre-forward or backward hook."""
    return [name or "(the model itself)" for name, module in model.named_modules()
            if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
            or module._backward_pre_hooks]


def refuse_unguarded_hooks(model: nn.Module) -> None:
    """ValueError when ``model`` runs under a torch.compile that cannot see its hooks and has some.

    Run eagerly on every call (dynamo is told not to trace it), so a hook attached after compiling
    is seen too."""
    hooked = hooked_points(model)
    if hooked:
        more = f" (and {len(hooked) - 1} more)" if len(hooked) > 1 else ""
        raise ValueError(
            f"this HookedDecoder runs under plain torch.compile with a hook at {hooked[0]}{more}, which the "
            "compiled graph may not run (dynamo does not guard on hooks by default). Compile it with "
            "model.compile() (workbench.compiled), which runs every hook, or remove the hooks.")


def _tokens_of(args: tuple, kwargs: dict) -> list[Tensor]:
    """The token tensors of a forward call (the input unless it is a residual stream, and ``tokens=``)."""
    found = []
    candidates = [kwargs.get("tokens")]
    if kwargs.get("start_at_layer") is None:
        candidates.append(args[0] if args else kwargs.get("input"))
    for value in candidates:
        value = value.tokens if isinstance(value, TokenBatch) else value
        if isinstance(value, Tensor) and not (value.dtype.is_floating_point or value.dtype.is_complex):
            found.append(value)
    return found


def _check_padding(args: tuple, kwargs: dict) -> Optional[bool]:
    """The checks a forward makes of its attention mask's values, run eagerly (the same ValueErrors;
    inside the graph each is a graph break), and whether the call is padded: what the compiled
    forward then branches on, a Python bool dynamo guards on. None: no mask, or a call this cannot
    read (text, a bad argument), which the forward checks itself."""
    input = args[0] if args else kwargs.get("input")
    mask, tokens = kwargs.get("attention_mask"), kwargs.get("tokens")
    for batch in (input, tokens):
        if isinstance(batch, TokenBatch):
            mask = batch.attention_mask if mask is None else mask
    kv_cache = kwargs.get("kv_cache")
    if getattr(kv_cache, "step", None) is not None:
        return None  # a static cache's decode step: no mask here, the step carries it
    past = getattr(kv_cache, "attention_mask", None) if kv_cache is not None else None
    if mask is None and past is None:
        return None
    shaped = input.tokens if isinstance(input, TokenBatch) else input
    if not isinstance(shaped, Tensor) or shaped.ndim not in (1, 2, 3):
        return None
    shape = tuple(shaped.shape[:2]) if kwargs.get("start_at_layer") is not None else \
        ((1,) * (2 - shaped.ndim) + tuple(shaped.shape))[:2]
    offset = kv_cache.length if kv_cache is not None else 0
    padded = mask_is_padded(mask, shape, past, offset)
    if mask is not None and (args[1:2] or (kwargs.get("return_type"),))[0] in ("loss", "both"):
        loss_targets(check_attention_mask(mask, shape, require_real=False))
    return padded


class _GuardedCall:
    """The compiled ``_call_impl`` of a HookedDecoder, run with dynamo's hook guards on."""

    def __init__(self, model: nn.Module, compiled: Any, options: dict, recompile_limit: Optional[int]):
        self.model = model
        self.compiled = compiled
        self.options = options
        self.recompile_limit = default_recompile_limit(model) if recompile_limit is None else recompile_limit
        self.config = {"skip_nnmodule_hook_guards": False, "recompile_limit": self.recompile_limit}
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch._dynamo

        model = self.model
        for tokens in _tokens_of(args, kwargs):  # eager: a data-dependent check breaks the graph
            model._check_token_range(tokens)
        was = model._hooks_guarded, model._padded_call
        model._hooks_guarded, model._padded_call = True, _check_padding(args, kwargs)
        hits = _LIMIT_HITS.count
        try:
            with torch._dynamo.config.patch(**self.config):
                return self.compiled(*args, **kwargs)
        finally:
            model._hooks_guarded, model._padded_call = was
            if _LIMIT_HITS.count > hits and not self.warned:
                self.warned = True
                warnings.warn(
                    f"this compiled HookedDecoder reached its recompile limit ({self.recompile_limit} configurations of "
                    "hooks and shapes): new configurations run eagerly from now on (exact, but not compiled). For a "
                    "sweep over more, compile with model.compile(recompile_limit=N).", RuntimeWarning, stacklevel=2)


def compile_model(model: nn.Module, recompile_limit: Optional[int] = None, **options: Any) -> nn.Module:
    """Compile ``model`` (a HookedDecoder) in place with ``torch.compile(**options)``; returns it.

    Every call of the model (``model(...)``, ``run_with_cache``, ``run_with_hooks``, ``generate``,
    the analyses) then runs compiled, with every hook attached at that moment. ``options`` go to
    ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``fullgraph``, ``options``).
    ``recompile_limit``: how many hook configurations (and shapes) dynamo keeps compiled for this
    model before it runs it eagerly (exact, slower; a ``RuntimeWarning`` says so once). Default
    ``default_recompile_limit(model)``: dynamo's 8 plus two per block, enough for the library's
    sweeps over every layer; a sweep over more configurations needs a larger one.
    ``uncompile(model)`` restores the eager model.
    """
    if not hasattr(model, "_check_token_range"):
        raise ValueError(f"compile_model needs a workbench HookedDecoder, got {type(model).__name__}")
    if recompile_limit is not None and (not isinstance(recompile_limit, int) or recompile_limit < 1):
        raise ValueError(f"recompile_limit must be a positive integer, got {recompile_limit!r}")
    compiled = torch.compile(model._call_impl, **options)
    model._compiled_call_impl = _GuardedCall(model, compiled, dict(options), recompile_limit)
    return model


def uncompile(model: nn.Module) -> nn.Module:
    """The eager model again (its compiled code is dropped)."""
    model._compiled_call_impl = None
    return model


def is_compiled(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_compiled_call_impl", None), _GuardedCall)


def compile_counters() -> dict[str, int]:
    """Dynamo's running totals in this process: graphs traced (the first of a model's forward a
    compile, each later one a recompile for a new configuration), graph breaks, and eager
    fallbacks (a frame dynamo stopped compiling because its recompile limit was reached: from then
    on it runs eagerly, exact but slower). Running totals of the process: ``torch._dynamo.reset()``
    does not clear dynamo's counters (the fallbacks count from this module's import), so compare
    two readings' difference, as ``benchmarks/compiled.py`` and the tests do."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "eager_fallbacks": _LIMIT_HITS.count}


class _LimitHits(logging.Handler):
    """Counts dynamo's one warning when a frame reaches its recompile limit (dynamo keeps no counter
    of it): the only sign that a compiled model has started running eagerly."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage():
            self.count += 1


_LIMIT_HITS = _LimitHits()
logging.getLogger("torch._dynamo").addHandler(_LIMIT_HITS)


def default_recompile_limit(model: nn.Module) -> int:
    """How many configurations ``model.compile()`` keeps compiled per model unless told: dynamo's 8,
    plus one per block for a sweep that resumes at every layer (``start_at_layer`` is a constant of
    the graph) and one per block for a sweep that hooks every layer (which hook points carry a hook
    is guarded on), so the library's sweeps over every layer of any model stay compiled."""
    return 8 + 2 * len(getattr(model, "blocks", ()))


def compile_options(model: nn.Module) -> Optional[dict]:
    """The ``torch.compile`` options of a model compiled by ``compile_model`` (None: not compiled)."""
    call = getattr(model, "_compiled_call_impl", None)
    return dict(call.options) if isinstance(call, _GuardedCall) else None
