"""What an attribution graph checks before it trusts its inputs, in one place.

    fingerprint(model, rs)               # {"model": ..., "dictionaries": ...}: what a graph records in meta
    check_binding(graph, model, rs)      # ValueError unless they are the weights the graph was computed with
    warn_trained_elsewhere(model, rs)    # DictionaryMismatchWarning for transcoders of another model
    check_finite(model, rs) / check_capture_finite(cap)   # ValueError naming the first NaN or inf tensor
    check_context(ctx, graph)            # ValueError for a QK context of another prompt or model

A graph's edges are facts about one model, one set of transcoders (or a CLT) and one prompt.
Bound to other weights, its interventions, head loadings and QK pairs would mix the graph's
edges with runs of the other weights and still answer, so each of these is refused up front.
The fingerprints are ``workbench.checkpoint.model_fingerprint`` (the hash stores, directions and
dictionaries record of the model they were made on) and the same hash of the dictionaries'
weights (``weights_fingerprint``): a pass over the weights, computed once per graph and once
per ``bind``; the cheaper in-memory signature of ``Graph._bound`` covers edits after that.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor


class UnverifiedGraphWarning(UserWarning):
    """A graph with no recorded fingerprint (a file saved before graphs recorded one, or read from
    circuit-tracer's JSON) was bound to a model: nothing can tell whether it is the model and the
    dictionaries the graph was computed with."""


# ---- fingerprints and binding ------------------------------------------------------------------------
def dictionaries_of(rs) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of each dictionary behind a replacement set: one per transcoder, or the CLT."""
    if getattr(rs, "cross_layer", False) and hasattr(rs, "clt"):
        return [("the CLT", rs.clt)]
    return [(f"transcoder {i}", tc) for i, tc in enumerate(getattr(rs, "transcoders", ()))]


def dictionaries_fingerprint(rs) -> str:
    """The hash of the transcoders' (or the CLT's) weights: each tensor's name, shape, sum and sum of squares."""
    from workbench.checkpoint import weights_fingerprint

    return weights_fingerprint({f"{name}.{key}": value for name, module in dictionaries_of(rs)
                                for key, value in module.state_dict().items()})


def fingerprint(model, rs) -> dict[str, str]:
    """What a graph records of the weights it was computed with (``graph.meta["fingerprint"]``)."""
    from workbench.checkpoint import model_fingerprint

    return {"model": model_fingerprint(model), "dictionaries": dictionaries_fingerprint(rs)}


def check_binding(graph, model, rs) -> None:
    """A ValueError naming what differs unless ``model`` and ``rs`` have the weights ``graph`` recorded;
    an ``UnverifiedGraphWarning`` when it recorded none."""
    recorded = graph.meta.get("fingerprint") if isinstance(graph.meta, dict) else None
    if not isinstance(recorded, dict) or not recorded:
        warnings.warn("this graph records no fingerprint of the weights it was computed with (a file saved before "
                      "graphs recorded one, or circuit-tracer's JSON): nothing checks that this model and these "
                      "transcoders are the ones its edges came from", UnverifiedGraphWarning, stacklevel=3)
        return
    differs = _differs(recorded, fingerprint(model, rs))
    if differs:
        raise ValueError(f"this graph was computed with other weights: {differs}. Its edges would be mixed with "
                         "runs of these weights; build the graph again from this model and these transcoders")


def _differs(recorded: dict, have: dict) -> str:
    what = {"model": "the model's weights", "dictionaries": "the transcoders' (or CLT's) weights"}
    parts = [f"{what.get(key, key)} (fingerprint {have.get(key)}, the graph's {recorded.get(key)})"
             for key in ["model", "dictionaries", *sorted(set(recorded) | set(have) - set(what))] if recorded.get(key) != have.get(key)]
    return " and ".join(parts)


# ---- dictionaries trained on another model -------------------------------------------------------------
def trained_elsewhere(cfg, model, have: Optional[str] = None) -> Optional[str]:
    """Why a dictionary (its config ``cfg``) was trained on another model than ``model`` (another name, or
    another fingerprint recorded): a sentence, or None. ``have``: the model's fingerprint, when known.

    What ``add_sae``, the attribution graph, ``Graph.bind`` and ``add_clt`` all check; a mismatch
    only warns, since casting or processing a model after the dictionary was trained (fold_ln,
    bf16) changes the fingerprint too, and the dictionary still reads it."""
    name = getattr(model.cfg, "name", None)
    if cfg.model_name and name and cfg.model_name != name:
        return (f"the dictionary was trained on {cfg.model_name!r}, not on {name!r}: "
                "its features may mean nothing here")
    if cfg.model_fingerprint:
        if have is None:
            from workbench.checkpoint import model_fingerprint

            have = model_fingerprint(model)
        if cfg.model_fingerprint != have:
            return (f"the dictionary was trained on other weights of {cfg.model_name or 'this model'!r} (fingerprint "
                    f"{cfg.model_fingerprint}; this model's is {have}): if the checkpoint was retrained or replaced "
                    "since, retrain the dictionary on it; a cast or processed (folded) copy of the same model also "
                    "differs")
    return None


def warn_trained_elsewhere(model, rs, have: Optional[str] = None, stacklevel: int = 3) -> None:
    """One ``DictionaryMismatchWarning`` naming every transcoder (or the CLT) trained on another model."""
    from workbench.analysis.splice import DictionaryMismatchWarning

    said = []
    for name, module in dictionaries_of(rs):
        why = trained_elsewhere(module.cfg, model, have)
        if why:
            said.append(f"{name}: {why}")
    if said:
        warnings.warn("; ".join(said[:3]) + (f"; and {len(said) - 3} more" if len(said) > 3 else ""),
                      DictionaryMismatchWarning, stacklevel=stacklevel)


# ---- non-finite values -------------------------------------------------------------------------------
def first_non_finite(named: Iterable[tuple[str, Tensor]]) -> Optional[str]:
    """The first ``name`` whose tensor holds NaN or inf, with its counts; None when all are finite."""
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            return f"{name} ({nan} NaN, {inf} inf of {tensor.numel()})"
    return None


def check_finite(model, rs) -> None:
    """A ValueError naming the first weight of the model, then of the dictionaries, that holds NaN or inf.

    One NaN in a transcoder made every edge NaN (and ``prune`` then reported a cycle); one in a
    model weight made every feature fire, and the graph grew to 116M edges on 14 tokens."""
    named = [(f"model weight {n}", t) for n, t in model.state_dict().items()]
    named += [(f"{name} weight {n}", t) for name, module in dictionaries_of(rs) for n, t in module.state_dict().items()]
    bad = first_non_finite(named)
    if bad:
        raise ValueError(f"{bad} is not finite: an attribution graph of it would be NaN (or every feature active); "
                         "fix or reload the weights")


def _capture_tensors(cap) -> Iterator[tuple[str, Tensor]]:
    yield "the clean run's embeddings (the residual stream entering block 0)", cap.embed
    for l, x in enumerate(cap.x_in):
        yield f"the clean run's transcoder input at layer {l}", x
    for l, a in enumerate(cap.acts):
        yield f"the clean run's feature activations at layer {l}", a
    for l, e in enumerate(cap.errors):
        yield f"the clean run's error at layer {l}", e
    for hook, value in cap.frozen.items():
        yield f"the clean run's {hook}", value
    yield "the clean run's final residual stream", cap.final
    yield "the clean run's logits", cap.logits


def check_capture_finite(cap) -> None:
    """A ValueError naming the first activation of the clean run that holds NaN or inf (finite weights
    can still overflow on a prompt)."""
    bad = first_non_finite(_capture_tensors(cap))
    if bad:
        raise ValueError(f"{bad} is not finite on this prompt: the graph would be NaN; check the model's weights "
                         "and the prompt")


# ---- QK contexts --------------------------------------------------------------------------------------
def check_context(ctx, graph) -> None:
    """A ValueError unless the QK context ``ctx`` was computed for ``graph``'s prompt, model and dictionaries.

    A context of another graph gave that prompt's scores under this graph's name."""
    if ctx.graph is graph:
        return
    tokens = graph.tokens.reshape(-1).cpu()
    if ctx.tokens.shape != tokens.shape or not torch.equal(ctx.tokens, tokens):
        raise ValueError(f"this context was computed for another prompt ({len(ctx.tokens)} tokens "
                         f"{ctx.str_tokens[:6]!r}...), not this graph's ({len(tokens)} tokens "
                         f"{list(graph.str_tokens[:6])!r}...): make it with QKContext(graph)")
    mine = graph.meta.get("fingerprint") if isinstance(graph.meta, dict) else None
    if isinstance(ctx.fingerprint, dict) and isinstance(mine, dict) and ctx.fingerprint and mine:
        differs = _differs(mine, ctx.fingerprint)
        if differs:
            raise ValueError(f"this context was computed with other weights than this graph: {differs}; make it "
                             "with QKContext(graph)")
        return
    bound = graph._context[0] if graph._context is not None else None
    if bound is not ctx.model:  # no fingerprints to compare: the bound model itself must be the context's
        raise ValueError("this context was computed with another model than the one this graph is bound to (and "
                         "no fingerprint says they have the same weights): make it with QKContext(graph)")
