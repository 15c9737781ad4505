"""The cached call into the library that every analysis goes through (``analysis``), its
variant for long analyses that report progress, and :func:`one_forward`, under which the analyses
of one prompt that miss the cache share a single forward."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import threading
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import streamlit as st
import torch

from workbench.analysis import AblationSpec, ablation_hooks
from workbench.analysis.shared import SharedForward, inspect_hooks
from workbench.padding import TokenBatch
from ui.common.loading import model_for


# ---- analyses, cached ----------------------------------------------------------------------------
Ablation = tuple[AblationSpec, ...]  # frozen dataclasses: hashable, so they key the cache as they are


def _qualified_name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


@dataclass(frozen=True)
class TokenRows:
    """A batch of token ids as nested tuples: a hashable argument for :func:`analysis`, handed
    to ``fn`` as a tensor (e.g. the corrupted prompts of activation patching)."""

    rows: tuple[tuple[int, ...], ...]

    def to_data(self, model) -> Any:
        """A tensor when the rows are equally long, else a left-padded ``TokenBatch`` (prompts of
        different lengths, each computed as it is alone)."""
        if len({len(r) for r in self.rows}) == 1:
            return torch.tensor(self.rows, device=model.device)
        pad_id = getattr(model.tokenizer, "pad_id", 0)
        return TokenBatch.from_ids(self.rows, pad_id, "left", model.device)


@dataclass
class _Shared:
    """The prompt whose analyses share one forward (see :func:`one_forward`), and that forward once made."""

    key: tuple[str, int]
    ids: tuple[int, ...]
    model: Optional[SharedForward] = None


_SHARED: contextvars.ContextVar[Optional[_Shared]] = contextvars.ContextVar("workbench_shared_forward", default=None)


@contextlib.contextmanager
def one_forward(key: tuple[str, int], ids: Optional[tuple[int, ...]]):
    """Within: every :func:`analysis` of prompt ``ids`` on checkpoint ``key`` that misses the cache (and
    ablates nothing) runs on ``workbench.analysis.one_forward``'s stand-in for the model, so together
    they make one forward (``run_with_cache`` of the hooks ``inspect_hooks`` names) instead of one each.

    Inspect's first run on SmolLM2-135M made six forwards of the 135M model (the loss, the attention,
    the norms, the suggested answer, the attribution, the lens: about 1 s each on the loaded 2-core
    machine). The stand-in lives for the block only (a long prompt's attention patterns are large),
    and is made on the first miss: a run whose analyses are all cached makes no forward. The results
    are those of that one run, equal to each analysis' own to float32 rounding (see the library's
    module); ``st.cache_data`` keeps them under the same keys either way.
    """
    token = _SHARED.set(_Shared(key, ids) if ids and not isinstance(ids[0], tuple) else None)
    try:
        yield
    finally:
        _SHARED.reset(token)


def _model_for_run(key: tuple[str, int], ids, ablation: Ablation, model):
    """The model ``fn`` runs on: the shared forward's stand-in inside :func:`one_forward` for its prompt."""
    shared = _SHARED.get()
    if shared is None or ablation or shared.key != key or shared.ids != ids:
        return model
    if shared.model is None:
        shared.model = SharedForward(model, torch.tensor([ids], device=model.device), inspect_hooks(model))
    return shared.model


def _run(fn: Callable, key: tuple[str, int], ids: Optional[tuple[int, ...]], ablation: Ablation,
         reference: Optional[tuple[tuple[int, ...], ...]], progress: Optional[Callable[[int, int], Any]],
         kwargs: dict) -> Any:
    """The body of :func:`analysis` and :func:`analysis_with_progress`: ``fn`` on the cached model."""
    model, lock = model_for(key)
    model = _model_for_run(key, ids, ablation, model)
    params = inspect.signature(fn).parameters
    kwargs = {k: v.to_data(model) if isinstance(v, TokenRows) else v for k, v in kwargs.items()}
    if progress is not None and "progress" in params:
        kwargs["progress"] = progress
    with lock, torch.no_grad():
        if ids is None:
            return fn(model, **kwargs)
        # one prompt (a tuple of ids), or a batch of equally long ones (a tuple of such tuples)
        tokens = torch.tensor(ids if isinstance(ids[0], tuple) else [ids], device=model.device)
        ref = torch.tensor(reference, device=model.device) if reference is not None else None
        if "reference" in params:
            kwargs["reference"] = ref
        hooks = [hook for spec in ablation for hook in ablation_hooks(model, tokens, spec, ref)]
        with model.hooks(fwd_hooks=hooks):
            return fn(model, tokens, **kwargs)


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs={types.FunctionType: _qualified_name})
def analysis(
    fn: Callable,
    key: tuple[str, int],
    ids: Optional[tuple[int, ...]],
    ablation: Ablation = (),
    reference: Optional[tuple[tuple[int, ...], ...]] = None,
    **kwargs,
) -> Any:
    """``fn(model, tokens, **kwargs)`` (a ``workbench.analysis`` function) on the cached model
    ``key`` and prompt ``ids``; ``fn(model, **kwargs)`` when ``ids`` is None.

    Cached by value (the function's qualified name, checkpoint identity, token ids,
    arguments), so a rerun with the same widgets costs nothing and a widget that changes
    only the drawing recomputes nothing. With ``ablation``, ``fn`` runs on the model with
    those units ablated (the hooks of ``workbench.analysis.ablation_hooks`` stay attached
    while it runs). ``reference`` is the batch that mean and resample ablations draw from:
    the ablation's, and ``fn``'s own when it takes a ``reference`` (as ``ablation_sweep``
    does). No callback ever goes in here: Streamlit replays the elements a cached function
    drew on a cache hit, and a progress bar made outside it cannot be replayed (see
    :func:`analysis_with_progress`).
    """
    return _run(fn, key, ids, ablation, reference, None, kwargs)


class _ResultStore:
    """A small process-wide LRU of results, shared by every session (as ``st.cache_data`` is)."""

    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self.lock = threading.Lock()
        self.items: OrderedDict = OrderedDict()

    def get(self, key) -> Any:
        with self.lock:
            if key not in self.items:
                return None
            self.items.move_to_end(key)
            return copy.deepcopy(self.items[key])

    def put(self, key, value) -> None:
        with self.lock:
            self.items[key] = copy.deepcopy(value)
            self.items.move_to_end(key)
            while len(self.items) > self.max_entries:
                self.items.popitem(last=False)


@st.cache_resource(show_spinner=False)
def _progress_results() -> _ResultStore:
    return _ResultStore()


def analysis_with_progress(
    fn: Callable,
    key: tuple[str, int],
    ids: Optional[tuple[int, ...]],
    progress: Callable[[int, int], Any],
    reference: Optional[tuple[tuple[int, ...], ...]] = None,
    **kwargs,
) -> Any:
    """:func:`analysis` for a long ``fn`` that reports ``progress(done, total)`` (the sweep).

    The callback draws into the page, so this is not an ``st.cache_data`` function (a cache
    hit there replays the drawing into a block that no longer exists: CacheReplayClosureError);
    results are kept in a store of their own, keyed by the same values, and shared by
    every session. A hit returns at once without calling ``progress``.
    """
    cache_key = (_qualified_name(fn), key, ids, reference, tuple(sorted(kwargs.items())))
    store = _progress_results()
    result = store.get(cache_key)
    if result is None:
        result = _run(fn, key, ids, (), reference, progress, dict(kwargs))
        store.put(cache_key, result)
    return result
