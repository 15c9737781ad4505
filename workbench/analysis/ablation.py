"""Ablation: knock out part of the model and measure what changes.

One ``AblationSpec`` says *what* (a head, a layer's attention, a layer's MLP, some MLP
neurons, the residual stream, or one direction in it; optionally only at some positions)
and *how* (``zero``; ``mean`` over a reference batch, per position; ``resample`` from
other inputs). ``ablate`` runs one ablation with a hook; ``ablation_sweep`` runs one for
every head or every layer. The sweep starts each ablated run from the clean run's cached
activations at the ablated layer (``workbench.analysis.resume``): nothing below the layer,
and for heads not even that layer's attention, is recomputed; on a GPU it also stacks
several ablations into one forward. ``naive=True`` runs the plain one-hooked-forward-per-unit
loop instead (the reference the tests and ``benchmarks/sweep.py`` compare against).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.analysis.common import (
    Metric,
    Progress,
    as_tokens,
    check_choice,
    check_head,
    check_layer,
    check_positions,
    loss_metric,
    unit_label,
)
from workbench.analysis.resume import hook_name, needed_hooks, run_from_site
from workbench.utils import check_index, check_int, eval_mode

TARGETS = ("head", "attn", "mlp", "neurons", "resid", "direction")
METHODS = ("zero", "mean", "resample")
# target -> (hook, site run_from_site resumes at; None = resume a hooked run at the block)
_HOOKS = {
    "head": ("attn.hook_z", "z"),
    "attn": ("hook_attn_out", "attn_out"),
    "mlp": ("hook_mlp_out", "mlp_out"),
    "neurons": ("mlp.hook_post", None),
    "resid": ("hook_resid_pre", "resid_pre"),
    "direction": ("hook_resid_pre", "resid_pre"),
}


@dataclass(frozen=True)
class AblationSpec:
    """What to ablate and how: frozen and hashable, so it can key a cache or a set.

    target: ``head`` (needs ``head``), ``attn``, ``mlp``, ``neurons`` (needs ``neurons``,
    indices into ``mlp.hook_post``), ``resid`` (the stream entering ``layer``) or
    ``direction`` (the component of that stream along ``direction``).
    positions: only these positions are ablated (all when None).
    method: ``zero``, ``mean`` (over the reference batch, per position) or ``resample``
    (each sequence takes the activation of another: the next one in the batch when no
    reference is given, else a random reference row drawn with ``seed``).
    Sequences are stored as tuples (``direction`` as a tuple of floats), so two specs that
    say the same thing are equal and hash the same.
    """

    target: Literal["head", "attn", "mlp", "neurons", "resid", "direction"]
    layer: Union[int, np.integer]  # numpy ints too: specs are often built from DataFrame rows
    head: Optional[Union[int, np.integer]] = None
    neurons: Optional[Sequence[int]] = None
    direction: Optional[Union[Tensor, Sequence[float]]] = None
    positions: Optional[Sequence[int]] = None
    method: Literal["zero", "mean", "resample"] = "zero"
    seed: int = 0

    def __post_init__(self) -> None:
        # Frozen and hashable: every field normalised once, here. int() would turn layer=1.5 into 1
        # silently, so only integers (numpy ones too) are accepted.
        def ints(name, values):
            return None if values is None else tuple(check_int(name, v) for v in values)

        direction = self.direction
        if isinstance(direction, Tensor):
            if direction.ndim != 1:
                raise ValueError(f"direction must be a [d_model] vector, got shape {tuple(direction.shape)}")
            direction = direction.detach().double().cpu().tolist()
        fields = {"layer": check_int("layer", self.layer),
                  "head": None if self.head is None else check_int("head", self.head),
                  "seed": check_int("seed", self.seed),
                  "neurons": ints("neurons", self.neurons), "positions": ints("positions", self.positions),
                  "direction": None if direction is None else tuple(float(x) for x in direction)}
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def validate(self, model, n_pos: Optional[int] = None) -> "AblationSpec":
        """This spec checked against ``model`` (and ``positions`` against an input of ``n_pos``
        tokens, or the context when not given); a copy with a negative ``layer`` counted from the end."""
        check_choice("target", self.target, TARGETS)
        check_choice("method", self.method, METHODS)
        layer = check_layer(model, self.layer)
        if self.target == "head":
            if self.head is None:
                raise ValueError(f"target='head' needs head=an index in [0, {model.cfg.n_heads})")
            check_head(model, self.head)
        if self.target in ("mlp", "neurons") and model.cfg.attn_only:
            raise ValueError(f"target={self.target!r} needs an MLP, but this model is attention-only")
        if self.target == "neurons" and model.cfg.ffn == "moe":
            raise ValueError("target='neurons' needs a dense MLP; a mixture of experts has no single hidden layer")
        if self.target == "neurons" and not self.neurons:
            raise ValueError("target='neurons' needs neurons=[indices into the MLP hidden layer]")
        if self.target == "neurons":
            for neuron in self.neurons:
                check_index("neurons", neuron, model.cfg.d_mlp, of=f"d_mlp={model.cfg.d_mlp}")
        check_positions("positions", self.positions, model.cfg.n_ctx if n_pos is None else n_pos)
        if self.target == "direction":
            if self.direction is None or len(self.direction) != model.cfg.d_model:
                raise ValueError(f"target='direction' needs direction=a [d_model={model.cfg.d_model}] tensor")
        # The hook name is built from the layer: blocks.-1.* names no hook (and the caller's spec stays as given).
        return self if layer == self.layer else replace(self, layer=layer)

    @property
    def hook(self) -> str:
        return f"blocks.{self.layer}.{_HOOKS[self.target][0]}"

    @property
    def label(self) -> str:
        where = unit_label(self.layer, head=self.head) if self.target == "head" else unit_label(self.layer, part=self.target)
        return f"{where} ({self.method})"


def replacement(spec: AblationSpec, act: Tensor, ref_act: Optional[Tensor]) -> Tensor:
    """``act`` with the spec's part ablated (a new tensor; ``act`` is left alone)."""
    batch, n_pos = act.shape[:2]
    if spec.method == "zero":
        source = torch.zeros_like(act)
    elif spec.method == "mean":
        if ref_act.shape[1] < n_pos:
            raise ValueError(f"the reference has {ref_act.shape[1]} positions, fewer than the input's {n_pos}")
        source = ref_act[:, :n_pos].mean(0, keepdim=True).expand_as(act)
    else:
        if ref_act.shape[1] < n_pos:
            raise ValueError(f"the reference has {ref_act.shape[1]} positions, fewer than the input's {n_pos}")
        source = ref_act[_resample_rows(spec, batch, ref_act.shape[0], ref_act.device), :n_pos]
    out = act.clone()
    pos = slice(None) if spec.positions is None else torch.as_tensor(list(spec.positions), device=act.device)
    if spec.target == "head":
        out[:, pos, spec.head] = source[:, pos, spec.head]
    elif spec.target == "neurons":
        idx = torch.as_tensor(list(spec.neurons), device=act.device)
        # Two index tensors would pair up one-to-one (advanced indexing); a column of positions
        # against a row of neurons broadcasts to every (position, neuron) combination instead.
        pos = pos if spec.positions is None else pos[:, None]
        out[:, pos, ..., idx] = source[:, pos, ..., idx]
    elif spec.target == "direction":
        direction = torch.tensor(spec.direction, dtype=torch.float64)
        unit = (direction / direction.norm()).to(act)
        along = (act[:, pos] @ unit)[..., None] * unit
        out[:, pos] = act[:, pos] - along + (source[:, pos] @ unit)[..., None] * unit
    else:
        out[:, pos] = source[:, pos]
    return out


def _resample_rows(spec: AblationSpec, batch: int, ref_batch: int, device) -> Tensor:
    if spec.seed < 0:  # the input is its own reference: every row takes the next row's activation
        if batch < 2:
            raise ValueError("resample ablation without a reference needs a batch of at least 2 sequences")
        return (torch.arange(batch) + 1) % batch
    gen = torch.Generator().manual_seed(spec.seed)
    return torch.randint(0, ref_batch, (batch,), generator=gen).to(device)


def check_reference(tokens: Tensor, reference: Optional[Tensor], methods) -> None:
    """Refuse mean/resample ablation of a single sequence with no reference: it would change nothing.

    Without ``reference`` the input is its own reference, and the mean of one row (or the
    "other" row of a batch of one) is that row itself, so the ablated run would equal the
    clean one and look like "this part does not matter".
    """
    needs_other_rows = sorted(set(methods) & {"mean", "resample"})
    if needs_other_rows and reference is None and tokens.shape[0] < 2:
        raise ValueError(
            f"method={needs_other_rows[0]!r} ablation of a single sequence with no reference would change "
            "nothing (the input is its own reference); pass reference=a batch of other inputs "
            "(or a batch of at least 2 sequences), or use method='zero'"
        )


def _reference_acts(model, tokens: Tensor, reference: Optional[Tensor], names: set[str], method: str):
    """The reference run's activations at ``names`` (the input itself when no reference)."""
    if method == "zero":
        return {}
    ref = tokens if reference is None else as_tokens(model, reference)
    _, cache = model.run_with_cache(ref, names_filter=lambda name: name in names)
    return cache.cache_dict


def _effective(spec: AblationSpec, reference: Optional[Tensor]) -> AblationSpec:
    if spec.method == "resample" and reference is None:
        return replace(spec, seed=-1)
    return spec


def ablation_hooks(model, tokens: Tensor, spec: AblationSpec, reference: Optional[Tensor] = None) -> list:
    """``fwd_hooks`` for ``run_with_hooks`` that apply ``spec`` (reference activations precomputed)."""
    spec = spec.validate(model, tokens.shape[1])
    check_reference(tokens, reference, [spec.method])
    refs = {spec.method: _reference_acts(model, tokens, reference, {spec.hook}, spec.method)}
    return _spec_hook(spec, refs, reference)


@torch.no_grad()
def ablate(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    spec: AblationSpec,
    reference: Optional[Int[Tensor, "ref_batch ref_pos"]] = None,
    return_type: str = "logits",
) -> Tensor:
    """The model's output (logits, or loss) with ``spec`` ablated, via one hooked forward.

    ``mean`` and ``resample`` draw from ``reference`` (default: the input batch itself, so a
    single sequence needs a ``reference``; ValueError otherwise).
    """
    tokens = as_tokens(model, tokens)
    hooks = ablation_hooks(model, tokens, spec, reference)
    return model.run_with_hooks(tokens, fwd_hooks=hooks, return_type=return_type)


def sweep_specs(model, unit: str, methods: Sequence[str], positions=None) -> list[AblationSpec]:
    """Every head (``unit="head"``) or every layer's attention and MLP (``unit="layer"``)."""
    check_choice("unit", unit, ("head", "layer"))
    specs = []
    for method in methods:
        check_choice("method", method, METHODS)
        for layer in range(model.cfg.n_layers):
            if unit == "head":
                specs += [AblationSpec("head", layer, head=h, method=method, positions=positions)
                          for h in range(model.cfg.n_heads)]
            else:
                specs.append(AblationSpec("attn", layer, method=method, positions=positions))
                if not model.cfg.attn_only:
                    specs.append(AblationSpec("mlp", layer, method=method, positions=positions))
    return specs


@torch.no_grad()
def ablation_sweep(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    unit: str = "head",
    methods: Sequence[str] = ("zero",),
    metric: Optional[Metric] = None,
    reference: Optional[Int[Tensor, "ref_batch ref_pos"]] = None,
    positions: Optional[Sequence[int]] = None,
    specs: Optional[Sequence[AblationSpec]] = None,
    stack: Optional[int] = None,
    naive: bool = False,
    progress: Union[bool, Callable[[int, int], object]] = False,
) -> pd.DataFrame:
    """Ablate every head or layer in turn; one row per ablation.

    ``metric`` maps logits to a scalar (default: the mean next-token loss of ``tokens``).
    ``stack`` ablations share one forward (default: 1 on CPU, where a forward already fills
    the cores, 16 on a GPU). ``progress``: True for a tqdm bar, or a callable
    ``progress(done, total)`` called as ablations finish (an app's own progress bar).
    Columns: target, layer, head, method, label, metric, clean, delta.
    """
    tokens = as_tokens(model, tokens)
    metric = loss_metric(tokens) if metric is None else metric
    specs = [s.validate(model, tokens.shape[1]) for s in (specs or sweep_specs(model, unit, methods, positions))]
    check_reference(tokens, reference, [s.method for s in specs])
    stack = (16 if model.device.type == "cuda" else 1) if stack is None else check_int("stack", stack, 1)
    with eval_mode(model):
        clean, values = _sweep_values(model, tokens, specs, metric, reference, stack, naive, progress)
    rows = [(s.target, s.layer, -1 if s.head is None else s.head, s.method, s.label, values[i], clean, values[i] - clean)
            for i, s in enumerate(specs)]
    return pd.DataFrame(rows, columns=["target", "layer", "head", "method", "label", "metric", "clean", "delta"])


def _sweep_values(model, tokens, specs, metric, reference, stack, naive, progress) -> tuple[float, dict[int, float]]:
    """The clean metric and the metric of every spec's ablated run."""
    sites = needed_hooks(model)
    clean_logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name in sites)
    clean = float(metric(clean_logits))
    ref_names = {s.hook for s in specs}
    refs = {m: _reference_acts(model, tokens, reference, ref_names, m) for m in {s.method for s in specs}}

    values: dict[int, float] = {}
    bar = Progress(progress, len(specs), "ablation sweep")
    if naive:
        for i, spec in enumerate(specs):
            values[i] = float(metric(ablate(model, tokens, spec, reference)))
            bar.update()
    else:
        # Group the edits that resume at the same place, then run them `stack` at a time.
        groups: dict[tuple, list[int]] = {}
        for i, spec in enumerate(specs):
            groups.setdefault((spec.layer, _HOOKS[spec.target][1] or "hooked", spec.hook), []).append(i)
        for (layer, site, hook), members in groups.items():
            for start in range(0, len(members), stack):
                chunk = members[start : start + stack]
                if site == "hooked":  # neurons: resume at the block, with the hook inside its MLP
                    logits = [model.run_with_hooks(cache[hook_name(layer, "resid_pre")], start_at_layer=layer,
                                                   fwd_hooks=_spec_hook(specs[i], refs, reference)) for i in chunk]
                else:
                    edits = [replacement(_effective(specs[i], reference), cache[hook], refs[specs[i].method].get(hook))
                             for i in chunk]
                    logits = run_from_site(model, layer, site, torch.cat(edits), cache.cache_dict).chunk(len(chunk))
                for i, lg in zip(chunk, logits):
                    values[i] = float(metric(lg))
                bar.update(len(chunk))
    bar.close()
    return clean, values


def _spec_hook(spec: AblationSpec, refs: dict, reference) -> list:
    eff = _effective(spec, reference)
    ref_act = refs[spec.method].get(spec.hook)
    return [(spec.hook, lambda act, hook: replacement(eff, act, ref_act))]
