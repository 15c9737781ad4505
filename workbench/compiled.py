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
with the hooks in the graph. Each configuration is compiled once and cached (up to dynamo's
``recompile_limit`` configurations per code object; past that it runs that code eagerly, still
with every hook). A hook is traced like the rest of the model: a closure over a tensor (a
steering vector, a patch's clean activation) reads that tensor on every call, so new values of the
same shape do not recompile; a Python number in a closure (a head index) is a constant of the
graph, so another number compiles once more. Hooks that dynamo cannot trace (a ``print``, an
``.item()``) break the graph there and run eagerly: slower, never wrong.

Plain ``torch.compile(model)`` (or ``nn.Module.compile`` of a model that is not a HookedDecoder)
cannot give that guarantee, so a HookedDecoder compiled that way refuses to run while any hook is
attached, with an error naming the hook; without hooks it runs compiled as before.

Inside a compiled graph the model avoids two data-dependent branches of its eager path: the token
range check runs here, before the graph, and a non-finite query or key (a broken weight) makes the
attention's whole output NaN instead of switching to the explicit path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from workbench.padding import TokenBatch


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


class _GuardedCall:
    """The compiled ``_call_impl`` of a HookedDecoder, run with dynamo's hook guards on."""

    def __init__(self, model: nn.Module, compiled: Any, options: dict, recompile_limit: Optional[int]):
        self.model = model
        self.compiled = compiled
        self.options = options
        self.config = {"skip_nnmodule_hook_guards": False}
        if recompile_limit is not None:
            self.config["recompile_limit"] = recompile_limit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch._dynamo

        model = self.model
        for tokens in _tokens_of(args, kwargs):  # eager: a data-dependent check breaks the graph
            model._check_token_range(tokens)
        was = model._hooks_guarded
        model._hooks_guarded = True
        try:
            with torch._dynamo.config.patch(**self.config):
                return self.compiled(*args, **kwargs)
        finally:
            model._hooks_guarded = was


def compile_model(model: nn.Module, recompile_limit: Optional[int] = None, **options: Any) -> nn.Module:
    """Compile ``model`` (a HookedDecoder) in place with ``torch.compile(**options)``; returns it.

    Every call of the model (``model(...)``, ``run_with_cache``, ``run_with_hooks``, ``generate``,
    the analyses) then runs compiled, with every hook attached at that moment. ``options`` go to
    ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``fullgraph``, ``options``).
    ``recompile_limit``: how many hook configurations (and shapes) dynamo keeps compiled before it
    runs the model eagerly (its default: 8); a sweep over more layers than that needs a larger one.
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
    """Dynamo's running totals in this process: graphs compiled, frames recompiled, graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def compile_options(model: nn.Module) -> Optional[dict]:
    """The ``torch.compile`` options of a model compiled by ``compile_model`` (None: not compiled)."""
    call = getattr(model, "_compiled_call_impl", None)
    return dict(call.options) if isinstance(call, _GuardedCall) else None
