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
from typing import Any, Callable, Literal, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from workbench.analysis.batching import DataLike, as_token_batch, iter_batches, n_rows, real_positions
from workbench.analysis.common import (
    Metric,
    Progress,
    check_choice,
    check_head,
    check_layer,
    check_positions,
    unit_label,
)
from workbench.analysis.per_prompt import PromptScorer, data_lengths, to_start, with_meta
from workbench.analysis.resume import hook_name, needed_hooks, run_from_site
from workbench.padding import TokenBatch
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


class Reference:
    """A reference run's activations at some hooks, in real-position space (index ``k`` = each
    reference prompt's ``k``-th real token; pads never stored, so they never enter a mean).

    ``mean`` ablation keeps only the per-position sum and count of real tokens (memory bounded
    by one prompt, whatever the reference's size); ``resample`` keeps every row, since each
    ablated prompt draws a whole reference prompt."""

    def __init__(self, keep_rows: bool):
        self.keep_rows = keep_rows
        self.sums: dict[str, Tensor] = {}
        self.counts: Optional[Tensor] = None
        self.parts: dict[str, list[Tensor]] = {}
        self.lengths: list[Tensor] = []

    def add(self, acts: dict, mask: Tensor) -> None:
        mask = mask.bool()
        lengths = mask.sum(1)
        width = int(lengths.max())
        real = to_start(mask.long(), mask)[:, :width].bool()
        counts = real.sum(0).double().cpu()
        self.counts = counts if self.counts is None else _add_padded(self.counts, counts)
        for name, act in acts.items():
            aligned = to_start(act, mask)[:, :width]
            if self.keep_rows:
                self.parts.setdefault(name, []).append(aligned)
            else:
                masked = aligned.double() * real.view(real.shape + (1,) * (act.ndim - 2))
                total = masked.sum(0)
                self.sums[name] = total if name not in self.sums else _add_padded(self.sums[name], total)
        self.lengths.append(lengths.cpu())

    def mean(self, name: str) -> tuple[Tensor, Tensor]:
        """[L, ...] mean per real position, and how many reference tokens each holds."""
        counts = self.counts.to(self.sums[name].device)
        return self.sums[name] / counts.clamp(min=1).view((-1,) + (1,) * (self.sums[name].ndim - 1)), counts

    def rows(self, name: str) -> tuple[Tensor, Tensor]:
        """[n_ref, L, ...] every reference prompt in real-position space, and their lengths."""
        parts = self.parts[name]
        width = max(p.shape[1] for p in parts)
        padded = [torch.nn.functional.pad(p, (0, 0) * (p.ndim - 2) + (0, width - p.shape[1])) for p in parts]
        return torch.cat(padded), torch.cat(self.lengths)

    @property
    def n(self) -> int:
        return int(sum(len(x) for x in self.lengths))


def _add_padded(a: Tensor, b: Tensor) -> Tensor:
    """a + b along a first axis of possibly different lengths (the shorter counts as zeros)."""
    if a.shape[0] < b.shape[0]:
        a, b = b, a
    out = a.clone()
    out[: b.shape[0]] += b.to(out.device)
    return out


def references(model, data: DataLike, reference: Optional[DataLike], specs: Sequence[AblationSpec],
               batch_size: int, padding_side: str) -> dict[str, Reference]:
    """The ``Reference`` of every method the specs use (the data itself when ``reference`` is None),
    run in batches at the hooks those specs ablate."""
    needed = {s.method for s in specs} - {"zero"}
    if not needed:
        return {}
    source = data if reference is None else reference
    names = {s.hook for s in specs if s.method != "zero"}
    refs = {m: Reference(keep_rows=m == "resample") for m in needed}
    for batch in iter_batches(model, source, batch_size, padding_side):
        _, cache = model.run_with_cache(batch, names_filter=lambda name: name in names)
        for method, ref in refs.items():
            ref.add({name: cache[name] for name in names if any(s.hook == name and s.method == method for s in specs)},
                    batch.attention_mask)
    return refs


def ablated_positions(spec: AblationSpec, mask: Tensor, rows: Tensor) -> Tensor:
    """[batch, pos] bool: the real tokens ``spec`` ablates (``positions`` count within each prompt;
    one a row lacks is a ValueError naming the row)."""
    mask = mask.bool()
    if spec.positions is None:
        return mask
    lengths = mask.sum(1)
    short = (lengths <= max(spec.positions)).nonzero().flatten()
    if len(short):
        i = int(short[0])
        raise ValueError(f"row {int(rows[i])}: positions={list(spec.positions)} include position "
                         f"{max(spec.positions)}, but the prompt has {int(lengths[i])} tokens")
    within = real_positions(mask)
    return mask & torch.isin(within, torch.tensor(spec.positions, device=mask.device))


def source_activations(spec: AblationSpec, act: Optional[Tensor], mask: Tensor, rows: Tensor, refs: dict,
                       own: bool, n_data: int) -> Optional[Tensor]:
    """What replaces ``act`` (the activation of one batch at ``spec.hook``) at each real token:
    zeros, the reference's mean at the token's position within its prompt, or a drawn reference
    prompt's activation at that position. ``own``: the data is its own reference (resample then
    takes the next prompt of the data: prompt i gets prompt i + 1, the last gets the first).
    Only the zeros need ``act``: with ``act=None`` a zero ablation gives None, the others their
    source in the reference's dtype (what ``_hooks`` computes before the forward)."""
    if spec.method == "zero":
        return None if act is None else torch.zeros_like(act)
    mask = mask.bool()
    within = real_positions(mask)
    sel = ablated_positions(spec, mask, rows)
    ref = refs[spec.method]
    what = "the data" if own else "the reference"
    if spec.method == "mean":
        mean, counts = ref.mean(spec.hook)
        need = int(within[sel].max()) + 1 if bool(sel.any()) else 0
        if need > mean.shape[0]:
            row = int(rows[int((sel & (within >= mean.shape[0])).any(1).nonzero()[0])])
            raise ValueError(f"mean ablation: row {row} has a token at position {need - 1}, but no prompt of "
                             f"{what} is that long (the longest has {mean.shape[0]} tokens); pass a longer reference")
        source = mean[within.clamp(0, mean.shape[0] - 1)]
        return source if act is None else source.to(act.dtype)
    values, lengths = ref.rows(spec.hook)
    if own:
        src = (rows.cpu() + 1) % n_data
    else:
        gen = torch.Generator().manual_seed(spec.seed)
        src = torch.randint(0, len(lengths), (n_data,), generator=gen)[rows.cpu()]
    need = torch.where(sel, within, torch.full_like(within, -1)).max(1).values.cpu() + 1
    short = (lengths[src] < need).nonzero().flatten()
    if len(short):
        i = int(short[0])
        raise ValueError(f"resample ablation: row {int(rows[i])} is ablated at position {int(need[i]) - 1}, but the "
                         f"prompt of {what} it draws from (row {int(src[i])}) has {int(lengths[src[i]])} tokens; "
                         "pass a reference of prompts at least as long")
    src = src.to(values.device)
    source = values[src[:, None], within.clamp(0, values.shape[1] - 1)]
    return source if act is None else source.to(act.dtype)


def head_index(spec: AblationSpec) -> Optional[Tensor]:
    """The spec's head as a one-element tensor (None unless it ablates a head), made once, outside the
    hook: a hook that reads the head as a Python int is a graph per head under ``model.compile()``
    (the int is a constant of the traced graph); one that reads it from a tensor shares one graph."""
    return torch.tensor([spec.head]) if spec.target == "head" else None


def replacement(spec: AblationSpec, act: Tensor, source: Tensor, sel: Tensor, head: Optional[Tensor] = None) -> Tensor:
    """``act`` with the spec's part replaced by ``source`` at the tokens ``sel`` (a new tensor).
    ``head``: the spec's head as ``head_index`` gives it (computed from the spec when None)."""
    keep = sel.view(sel.shape + (1,))
    if spec.target == "head":
        head = head_index(spec) if head is None else head
        which = torch.zeros(act.shape[2], dtype=torch.bool, device=act.device).index_fill(0, head.to(act.device), True)
        return torch.where(keep[..., None] & which[:, None], source, act)  # [batch, pos, head, d_head]
    if spec.target == "neurons":
        idx = torch.as_tensor(list(spec.neurons), device=act.device)
        out = act.clone()
        out[..., idx] = torch.where(keep, source[..., idx], act[..., idx])
        return out
    if spec.target == "direction":
        direction = torch.tensor(spec.direction, dtype=torch.float64)
        unit = (direction / direction.norm()).to(act)
        changed = act - (act @ unit)[..., None] * unit + (source @ unit)[..., None] * unit
        return torch.where(keep, changed, act)
    return torch.where(keep, source, act)


def ablated(spec: AblationSpec, act: Tensor, batch: TokenBatch, refs: dict, own: bool, n_data: int) -> Tensor:
    """``act`` (one batch's activation at ``spec.hook``) with ``spec`` applied: what its hook returns."""
    (_, hook), = _hooks(spec, batch, refs, own, n_data)
    return hook(act, None)


def check_reference(n: int, reference: Optional[DataLike], methods) -> None:
    """Refuse mean/resample ablation of a single sequence with no reference: it would change nothing.

    Without ``reference`` the input is its own reference, and the mean of one row (or the
    "other" row of a batch of one) is that row itself, so the ablated run would equal the
    clean one and look like "this part does not matter".
    """
    needs_other_rows = sorted(set(methods) & {"mean", "resample"})
    if needs_other_rows and reference is None and n < 2:
        raise ValueError(
            f"method={needs_other_rows[0]!r} ablation of a single sequence with no reference would change "
            "nothing (the input is its own reference); pass reference=a batch of other inputs "
            "(or a batch of at least 2 sequences), or use method='zero'"
        )


def _hooks(spec: AblationSpec, batch: TokenBatch, refs: dict, own: bool, n_data: int) -> list:
    """The hook applying ``spec`` to ``batch``. Everything that depends on the mask and the reference
    alone (the head index, the ablated tokens, the mean or resampled source and its checks, which
    read values: ``.item()``, ``nonzero``) is computed here, before the forward, so the hook itself
    is tensor arithmetic only: under ``model.compile()`` it traces into the graph with no break
    (the checks inside it made about 16 graphs of one mean ablation)."""
    head = head_index(spec)
    rows = getattr(batch, "rows", None)
    rows = torch.arange(len(batch)) if rows is None else rows.cpu()
    source = source_activations(spec, None, batch.attention_mask, rows, refs, own, n_data)
    sel = ablated_positions(spec, batch.attention_mask, rows)

    def hook(act: Tensor, hook) -> Tensor:
        what = torch.zeros_like(act) if source is None else source.to(device=act.device, dtype=act.dtype)
        return replacement(spec, act, what, sel.to(act.device), head)
    return [(spec.hook, hook)]


def _check_spec(spec: Any) -> None:
    if not isinstance(spec, AblationSpec):
        several = isinstance(spec, (list, tuple))
        raise ValueError(f"spec must be one AblationSpec, got {type(spec).__name__}"
                         + ("; to score several, one at a time, use ablation_sweep(model, tokens, specs=[...])"
                            if several else ""))


def ablation_hooks(model, tokens: DataLike, spec: Any, reference: Optional[DataLike] = None) -> list:
    """``fwd_hooks`` for ``run_with_hooks`` on ``tokens`` (a token tensor, a padded ``TokenBatch``,
    texts) that apply ``spec``; the reference activations are computed here, once."""
    _check_spec(spec)
    batch = as_token_batch(model, tokens)
    spec = spec.validate(model, batch.shape[1])
    check_reference(len(batch), reference, [spec.method])
    refs = references(model, batch, reference, [spec], max(len(batch), 1), "left")
    return _hooks(spec, batch, refs, reference is None, len(batch))


@torch.no_grad()
def ablate(
    model,
    tokens: DataLike,
    spec: Any,  # one AblationSpec: checked by _check_spec, whose message says what to pass
    reference: Optional[DataLike] = None,
    return_type: str = "logits",
    *,
    metric: Optional[Metric] = None,
    batch_size: int = 32,
    padding_side: str = "left",
    progress: bool = False,
) -> Union[Tensor, pd.DataFrame]:
    """The model's output with ``spec`` ablated, via one hooked forward.

    ``tokens``: a token tensor, text(s), a padded ``TokenBatch`` or a ``PromptSet``. ``mean`` and
    ``resample`` draw from ``reference`` (any of those kinds; default: the input itself, so a
    single sequence needs a ``reference``; ValueError otherwise), over real tokens only.

    ``return_type``: ``logits`` or ``loss`` of the whole input as one (padded) batch; or
    ``"metric"``: a table with one row per prompt (prompt, clean, metric, delta, and a
    PromptSet's meta columns), streamed in batches of ``batch_size`` with a tqdm bar when
    ``progress``; ``metric`` scores each prompt (``workbench.analysis.per_prompt``).
    """
    _check_spec(spec)
    if return_type == "metric":
        table = ablation_sweep(model, tokens, specs=[spec], metric=metric, reference=reference,
                               batch_size=batch_size, padding_side=padding_side, progress=progress, per_prompt=True)
        return table[["prompt", "clean", "metric", "delta", *table.columns[table.columns.get_loc("delta") + 1:]]]
    batch = as_token_batch(model, tokens, padding_side)
    hooks = ablation_hooks(model, batch, spec, reference)
    return model.run_with_hooks(batch, fwd_hooks=hooks, return_type=return_type)


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
    tokens: DataLike,
    unit: str = "head",
    methods: Sequence[str] = ("zero",),
    metric: Optional[Metric] = None,
    reference: Optional[DataLike] = None,
    positions: Optional[Sequence[int]] = None,
    specs: Optional[Sequence[AblationSpec]] = None,
    stack: Optional[int] = None,
    naive: bool = False,
    progress: Union[bool, Callable[[int, int], object]] = False,
    *,
    batch_size: int = 32,
    padding_side: str = "left",
    per_prompt: bool = False,
) -> pd.DataFrame:
    """Ablate every head or layer in turn; one row per ablation, averaged over the prompts.

    ``tokens``: a token tensor, text(s) of any lengths, a padded ``TokenBatch`` or a
    ``PromptSet``, run ``batch_size`` prompts at a time (memory bounded by the batch).
    ``metric`` scores each prompt as if it ran alone (``workbench.analysis.per_prompt``: by
    default the answer's logit difference at each prompt's last token for a PromptSet with
    answers, else the prompt's mean next-token loss); the table reports the mean over prompts.
    A plain ``metric(logits)`` on a token tensor sees the whole batch's logits, as before.
    ``positions`` count within each prompt (0 = its first real token). ``stack`` ablations
    share one forward (default: 1 on CPU, where a forward already fills the cores, 16 on a
    GPU). ``progress``: True for a tqdm bar, or a callable ``progress(done, total)`` called as
    ablations finish (an app's own progress bar).

    Columns: target, layer, head, method, label, metric, clean, delta (means over prompts),
    delta_std (the spread of delta over prompts; NaN for one), n_prompts. ``per_prompt=True``:
    one row per (ablation, prompt) instead, with a ``prompt`` column and a PromptSet's meta.
    """
    scorer = PromptScorer(model, metric, tokens)
    n_data = n_rows(tokens)
    if scorer.whole:
        batch_size = n_data
    specs = [s.validate(model, max(data_lengths(model, tokens)))
             for s in (specs or sweep_specs(model, unit, methods, positions))]
    check_reference(n_data, reference, [s.method for s in specs])
    stack = (16 if model.device.type == "cuda" else 1) if stack is None else check_int("stack", stack, 1)
    with eval_mode(model):
        clean, values = _sweep_values(model, tokens, specs, scorer, reference, stack, naive, progress,
                                      batch_size, padding_side)
    info = [(s.target, s.layer, -1 if s.head is None else s.head, s.method, s.label) for s in specs]
    info_columns = ["target", "layer", "head", "method", "label"]
    if per_prompt:
        if scorer.whole:
            raise ValueError("per_prompt=True needs a metric that scores each prompt (None, an AnswerMetric, or "
                             "data other than a plain token tensor): a plain metric of a tensor scores the batch")
        rows = [(*info[i], p, values[i, p], clean[p], values[i, p] - clean[p])
                for i in range(len(specs)) for p in range(scorer.n)]
        frame = pd.DataFrame(rows, columns=info_columns + ["prompt", "metric", "clean", "delta"])
        return with_meta(frame, tokens)
    delta = values - clean[None]
    spread = delta.std(axis=1, ddof=1) if scorer.n > 1 else np.full(len(specs), np.nan)
    rows = [(*info[i], values[i].mean(), clean.mean(), delta[i].mean(), spread[i], scorer.n) for i in range(len(specs))]
    return pd.DataFrame(rows, columns=info_columns + ["metric", "clean", "delta", "delta_std", "n_prompts"])


def _sweep_values(model, data, specs, scorer, reference, stack, naive, progress, batch_size,
                  padding_side) -> tuple[np.ndarray, np.ndarray]:
    """Every prompt's clean score [n] and its score under every spec [n_specs, n]."""
    n_data = n_rows(data)
    refs = references(model, data, reference, specs, batch_size, padding_side)
    own = reference is None
    sites = needed_hooks(model)
    clean = np.zeros(scorer.n)
    values = np.zeros((len(specs), scorer.n))
    n_batches = -(-n_data // batch_size)
    bar = Progress(progress, len(specs) * n_batches, "ablation sweep")
    # Group the edits that resume at the same place, then run them `stack` at a time.
    groups: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault((spec.layer, _HOOKS[spec.target][1] or "hooked", spec.hook), []).append(i)
    for batch in iter_batches(model, data, batch_size, padding_side):
        rows = scorer.rows(batch)
        mask = batch.attention_mask
        if naive:
            clean[rows] = scorer.scores(model(batch), batch).float().cpu().numpy()
            for i, spec in enumerate(specs):
                logits = model.run_with_hooks(batch, fwd_hooks=_hooks(spec, batch, refs, own, n_data))
                values[i, rows] = scorer.scores(logits, batch).float().cpu().numpy()
                bar.update()
            continue
        clean_logits, cache = model.run_with_cache(batch, names_filter=lambda name: name in sites)
        clean[rows] = scorer.scores(clean_logits, batch).float().cpu().numpy()
        for (layer, site, hook), members in groups.items():
            for start in range(0, len(members), stack):
                chunk = members[start : start + stack]
                if site == "hooked":  # neurons: resume at the block, with the hook inside its MLP
                    logits = [model.run_with_hooks(cache[hook_name(layer, "resid_pre")], start_at_layer=layer,
                                                   attention_mask=mask,
                                                   fwd_hooks=_hooks(specs[i], batch, refs, own, n_data))
                              for i in chunk]
                else:
                    edits = [ablated(specs[i], cache[hook], batch, refs, own, n_data) for i in chunk]
                    logits = run_from_site(model, layer, site, torch.cat(edits), cache.cache_dict,
                                           attention_mask=mask).chunk(len(chunk))
                for i, lg in zip(chunk, logits):
                    values[i, rows] = scorer.scores(lg, batch).float().cpu().numpy()
                bar.update(len(chunk))
    bar.close()
    return clean, values


