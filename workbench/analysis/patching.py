"""Activation patching (clean -> corrupted) and its gradient approximation, attribution patching.

Activation patching runs the corrupted input, puts one clean activation back (the residual
stream, a layer's attention or MLP output, or a head's output, at one position or all), and
records a metric of the logits: how much of the clean behaviour that one activation restores.
It gives the same numbers as ``transformer_lens.patching`` (the tests compare them), but each
patched run resumes from the corrupted run's cached activations at the patched layer
(``workbench.analysis.resume``) instead of running the whole model again.

Attribution patching (Nanda 2023) estimates every head's patching effect at once from one
forward and backward pass on the corrupted input: effect ~ grad(metric) . (clean - corrupted)
at ``hook_z``. ``attribution_patching(..., exact=True)`` adds the exact effects and their
correlation with the estimate; ``patching_agreement`` sets the two side by side.
``task_pairs`` builds clean/corrupted pairs from a checkpoint's own task (IOI's "ABC").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from workbench.analysis.batching import DataLike, n_rows, real_positions
from workbench.analysis.common import Metric, check_choice
from workbench.analysis.per_prompt import (
    Position,
    PromptScorer,
    aligned_columns,
    check_position_names,
    check_positions_arg,
    default_positions,
    iter_pairs,
    meta_of,
    pair_lengths,
    with_meta,
)
from workbench.analysis.resume import hook_name, needed_hooks, run_from_site
from workbench.data.prompts import PromptSetBatch
from workbench.utils import check_int, eval_mode

PATCH_SITES = ("resid_pre", "resid_mid", "attn_out", "mlp_out", "head", "head_by_pos")
ALL = None  # the "position" of a head patched at every position at once (site "head")


def _check_sites(model, sites) -> list[str]:
    sites = [sites] if isinstance(sites, str) else list(sites)
    for site in sites:
        check_choice("site", site, PATCH_SITES)
        block = model.blocks[0]
        if site in ("resid_mid", "mlp_out") and site not in block.sites:
            raise ValueError(f"site={site!r} does not exist in the {block.layout} block layout "
                             f"(its sites: {list(block.sites)})")
    return sites


def _positions(model, clean, corrupted, positions) -> list[Position]:
    """The positions patched: as given (checked), or every position every pair has (``default_positions``)."""
    positions = check_positions_arg(positions)
    if positions is None:
        return default_positions(*pair_lengths(model, clean, corrupted))
    check_position_names(positions, clean)
    return positions


def _units(model, site: str, positions: Sequence[Position], all_at_once: bool) -> list[tuple]:
    """(layer, pos, head) of every patch; head -1 where it does not apply; pos ``ALL`` for a head
    patched at every position (or at every one of ``positions`` when they were given). TL's order."""
    layers, heads = range(model.cfg.n_layers), range(model.cfg.n_heads)
    if site == "head":
        return [(l, ALL if all_at_once else tuple(positions), h) for l in layers for h in heads]
    if site == "head_by_pos":
        return [(l, p, h) for l in layers for p in positions for h in heads]
    return [(l, p, -1) for l in layers for p in positions]


class _Pairing:
    """Where each patched position lies in one batch's clean and corrupted rows (columns per row)."""

    def __init__(self, batch, meta):
        self.clean_mask = batch.attention_mask.bool()
        self.corrupted_mask = batch.corrupted.attention_mask.bool()
        self.rows = batch.rows.cpu()
        self.meta = meta
        self.same_length = self.clean_mask.sum(1).cpu() == self.corrupted_mask.sum(1).cpu()
        self._columns: dict = {}

    def columns(self, position: Position) -> tuple[Tensor, Tensor]:
        if position not in self._columns:
            self._columns[position] = tuple(
                aligned_columns(position, mask, self.rows, self.meta, which, self.same_length)
                for mask, which in ((self.clean_mask, "clean"), (self.corrupted_mask, "corrupted")))
        return self._columns[position]

    def every_position(self) -> Tensor:
        """[batch, corrupted pos]: the clean column of the same real position as each corrupted column
        (pairs must be equally long: a head patched "at every position" means the same positions)."""
        if not bool(self.same_length.all()):
            i = int((~self.same_length).nonzero()[0])
            raise ValueError(f"row {int(self.rows[i])}: the clean prompt has {int(self.clean_mask[i].sum())} tokens "
                             f"and the corrupted one {int(self.corrupted_mask[i].sum())}; patching a head at every "
                             "position needs pairs of equal length: pass positions=[...] (from the end, or names)")
        order = torch.argsort((~self.clean_mask).to(torch.int8), dim=1, stable=True)
        return order.gather(1, real_positions(self.corrupted_mask).clamp(min=0))


def _patched(corrupted: Tensor, clean: Tensor, pairing: _Pairing, pos, head: int) -> Tensor:
    """The corrupted activation with the clean one put back at ``pos`` (one position, several, or
    ``ALL``), for one head or the whole site."""
    out = corrupted.clone()
    rows = torch.arange(out.shape[0], device=out.device)
    at = (slice(None),) * 2 + (() if head < 0 else (head,))
    if pos is ALL:
        source = clean.gather(1, pairing.every_position().view(out.shape[:2] + (1,) * (clean.ndim - 2))
                              .expand((-1, -1) + tuple(clean.shape[2:])))
        keep = pairing.corrupted_mask.view(out.shape[:2] + (1,) * (out.ndim - 2))
        out[at] = torch.where(keep, source, corrupted)[at]
        return out
    for p in pos if isinstance(pos, tuple) else (pos,):
        clean_col, corrupted_col = (c.to(out.device) for c in pairing.columns(p))
        inner = () if head < 0 else (head,)
        out[(rows, corrupted_col) + inner] = clean[(rows, clean_col) + inner]
    return out


def _label(pos) -> Union[int, str]:
    """The ``pos`` column: -1 for a head at every position (TL's convention), else the position."""
    if pos is ALL or isinstance(pos, tuple):
        return -1 if pos is ALL or len(pos) != 1 else pos[0]
    return pos


@torch.no_grad()
def activation_patching(
    model,
    clean_tokens: DataLike,
    corrupted_tokens: Optional[DataLike] = None,
    metric: Optional[Metric] = None,
    sites: Union[str, Sequence[str]] = ("resid_pre", "attn_out", "mlp_out"),
    stack: Optional[int] = None,
    progress: bool = False,
    *,
    positions: Optional[Sequence[Position]] = None,
    batch_size: int = 32,
    padding_side: str = "left",
    per_prompt: bool = False,
) -> pd.DataFrame:
    """Patch each clean activation into the corrupted run; one row per patch, averaged over pairs.

    ``clean_tokens``/``corrupted_tokens``: token tensors, texts, padded ``TokenBatch``es, or one
    ``PromptSet`` with a ``corrupted`` column (then ``corrupted_tokens`` is None), run
    ``batch_size`` pairs at a time. ``sites``: ``resid_pre``, ``resid_mid``, ``attn_out``,
    ``mlp_out`` (per layer and position), ``head`` (every head's output at every position) and
    ``head_by_pos``. ``metric`` scores each pair's prompts as if run alone
    (``workbench.analysis.per_prompt``; default: the answer's logit difference at the last token).

    Positions are aligned per row, never by column: an int is a position within each prompt
    (negative: from the prompt's end, so -1 is every row's last real token), a name is read per
    row from a PromptSet's ``pos_<NAME>`` column (``END``: the last real token). A clean and a
    corrupted prompt may tokenize to different lengths: the clean activation at the clean
    prompt's position goes to the same position of the corrupted prompt, each counted in its
    own prompt (a name counts in the clean prompt; ``corrupted_pos_<NAME>`` overrides it for the
    corrupted one); a position a row lacks is a ValueError naming the row. ``positions`` None:
    every position when all prompts are equally long, else the positions from the end that
    every prompt has. ``head`` patches the head at every position (pairs of equal length), or
    at all of ``positions`` together when they are given.

    Columns: site, layer, pos (an int or a name; -1 for ``head``), head (-1 where not
    applicable), metric, corrupted, clean (means over pairs), and ``restored`` = (metric -
    corrupted) / (clean - corrupted). ``per_prompt=True``: one row per patch and pair, with
    ``prompt`` and a PromptSet's meta.
    """
    sites = _check_sites(model, sites)
    scorer = PromptScorer(model, metric, clean_tokens)
    n_data = n_rows(clean_tokens)
    if scorer.whole:
        batch_size = n_data
    stack = (16 if model.device.type == "cuda" else 1) if stack is None else check_int("stack", stack, 1)
    given = positions is not None
    positions = _positions(model, clean_tokens, corrupted_tokens, positions) if any(
        s != "head" for s in sites) or given else []
    units = [(site, unit) for site in sites for unit in _units(model, site, positions, not given)]
    names = needed_hooks(model)
    clean_values, corrupted_values = np.zeros(scorer.n), np.zeros(scorer.n)
    values = np.zeros((len(units), scorer.n))
    meta = meta_of(clean_tokens)
    # Group the patches that resume at the same layer and site, to run them `stack` at a time.
    groups: dict[tuple, list[int]] = {}
    for i, (site, (layer, _, _)) in enumerate(units):
        groups.setdefault((layer, "z" if site.startswith("head") else site), []).append(i)
    batches = iter_pairs(model, clean_tokens, corrupted_tokens, batch_size, padding_side, progress, "patching")
    for batch in batches:
        rows = scorer.rows(batch)
        corrupted = batch.corrupted
        clean_logits, clean_cache = model.run_with_cache(batch, names_filter=lambda n: n in names)
        corrupted_logits, cache = model.run_with_cache(corrupted, names_filter=lambda n: n in names)
        clean_values[rows] = scorer.scores(clean_logits, batch).float().cpu().numpy()
        corrupted_values[rows] = scorer.scores(corrupted_logits, corrupted_scored(batch)).float().cpu().numpy()
        pairing = _Pairing(batch, meta)
        for (layer, resume_site), members in groups.items():
            name = hook_name(layer, resume_site)
            for start in range(0, len(members), stack):
                chunk = members[start : start + stack]
                edits = torch.cat([_patched(cache[name], clean_cache[name], pairing, units[i][1][1], units[i][1][2])
                                   for i in chunk])
                logits = run_from_site(model, layer, resume_site, edits, cache.cache_dict,
                                       attention_mask=corrupted.attention_mask).chunk(len(chunk))
                for i, lg in zip(chunk, logits):
                    values[i, rows] = scorer.scores(lg, corrupted_scored(batch)).float().cpu().numpy()
    info = [(site, layer, _label(pos), head) for site, (layer, pos, head) in units]
    columns = ["site", "layer", "pos", "head"]
    if per_prompt:
        _need_prompts(scorer)
        frame = pd.DataFrame([(*info[i], p, values[i, p], corrupted_values[p], clean_values[p])
                              for i in range(len(units)) for p in range(scorer.n)],
                             columns=columns + ["prompt", "metric", "corrupted", "clean"])
        gap = frame["clean"] - frame["corrupted"]
        frame["restored"] = ((frame["metric"] - frame["corrupted"]) / gap).where(gap != 0)
        return with_meta(frame, clean_tokens)
    frame = pd.DataFrame(info, columns=columns)
    frame["metric"] = values.mean(axis=1)
    corrupted_value, clean_value = float(corrupted_values.mean()), float(clean_values.mean())
    frame["corrupted"], frame["clean"] = corrupted_value, clean_value
    gap = clean_value - corrupted_value
    frame["restored"] = (frame["metric"] - corrupted_value) / gap if gap != 0 else np.nan
    return frame


def corrupted_scored(batch: PromptSetBatch) -> PromptSetBatch:
    """The corrupted prompts of a pair batch, scored like the clean ones (same rows, same answers)."""
    c = batch.corrupted
    return PromptSetBatch(c.tokens, c.attention_mask, c.padding_side, rows=batch.rows, answer=batch.answer,
                          wrong=batch.wrong)


def _need_prompts(scorer: PromptScorer) -> None:
    if scorer.whole:
        raise ValueError("per_prompt=True needs a metric that scores each prompt (None, an AnswerMetric, or data "
                         "other than a plain token tensor): a plain metric of a tensor scores the whole batch")


def attribution_patching(
    model,
    clean_tokens: DataLike,
    corrupted_tokens: Optional[DataLike] = None,
    metric: Optional[Metric] = None,
    by_pos: bool = False,
    exact: bool = False,
    *,
    positions: Optional[Sequence[Position]] = None,
    batch_size: int = 32,
    padding_side: str = "left",
    progress: bool = False,
    per_prompt: bool = False,
) -> pd.DataFrame:
    """Every head's estimated patching effect from one forward+backward per batch of corrupted prompts.

    Data, metric and positions as in ``activation_patching`` (positions aligned per row). Without
    ``by_pos`` a head's estimate sums over every position (pairs of equal length), or over
    ``positions`` when given.

    Columns: layer, head, (pos when ``by_pos``), attribution (the estimated change of the
    metric when that head's clean output is patched in; the mean over pairs). With ``exact=True``
    also ``exact`` (from ``activation_patching``), and ``frame.attrs["correlation"]`` (Pearson).
    ``per_prompt=True``: one row per head (and position) and pair, with ``prompt`` and meta.
    """
    scorer = PromptScorer(model, metric, clean_tokens)
    n_data = n_rows(clean_tokens)
    if scorer.whole:
        batch_size = n_data
    given = positions is not None
    positions = _positions(model, clean_tokens, corrupted_tokens, positions) if by_pos or given else []
    n, n_heads = model.cfg.n_layers, model.cfg.n_heads
    z_names = [f"blocks.{l}.attn.hook_z" for l in range(n)]
    meta = meta_of(clean_tokens)
    n_pos = len(positions) if by_pos else 1
    totals = np.zeros((scorer.n, n, n_pos, n_heads))

    def track(act: Tensor, hook) -> Tensor:
        # The gradient is taken with respect to activations, never parameters: a frozen model
        # (requires_grad=False everywhere, as an app or a notebook leaves it) still has one
        # once the embedding output is a leaf that requires it, and every path from a head to
        # the metric (through later heads too) stays in the graph.
        return act.detach().requires_grad_(True)

    for batch in iter_pairs(model, clean_tokens, corrupted_tokens, batch_size, padding_side, progress, "attribution"):
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(batch, names_filter=lambda name: name in z_names)
        corrupted_z: dict[str, Tensor] = {}

        def keep(act: Tensor, hook) -> None:
            corrupted_z[hook.name] = act  # noqa: B023 (called within this iteration)

        with eval_mode(model), torch.enable_grad():
            logits = model.run_with_hooks(batch.corrupted, fwd_hooks=[("hook_embed", track)]
                                          + [(name, keep) for name in z_names])
            if not logits.requires_grad:
                raise ValueError("attribution patching needs a metric of the logits that has a gradient")
            # Each prompt's score depends on its own row only, so the gradient of the sum is each one's own.
            grads = torch.autograd.grad(scorer.scores(logits, corrupted_scored(batch)).sum(),
                                        [corrupted_z[name] for name in z_names])
        pairing = _Pairing(batch, meta)
        per_layer = []
        for name, grad in zip(z_names, grads):
            clean_z, corrupted = clean_cache[name], corrupted_z[name].detach()
            if given or by_pos:
                parts = []
                for p in positions:
                    cc, kc = (c.to(grad.device) for c in pairing.columns(p))
                    r = torch.arange(len(batch), device=grad.device)
                    parts.append(((clean_z[r, cc] - corrupted[r, kc]) * grad[r, kc]).sum(-1))  # [batch, head]
                effect = torch.stack(parts, 1)  # [batch, pos, head]
                effect = effect if by_pos else effect.sum(1, keepdim=True)
            else:
                source = _patched(corrupted, clean_z, pairing, ALL, -1)
                effect = ((source - corrupted) * grad).sum(dim=(1, -1))[:, None]  # [batch, 1, head]
            per_layer.append(effect)
        effect = torch.stack(per_layer, 1).double().cpu().numpy()  # [batch, layer, pos, head]
        if scorer.whole:
            totals[0] += effect.sum(0)
        else:
            totals[scorer.rows(batch)] = effect
    pos_labels = list(positions) if by_pos else [None]
    l, p, h = np.meshgrid(np.arange(n), np.arange(len(pos_labels)), np.arange(n_heads), indexing="ij")
    keys = {"layer": l.ravel(), **({"pos": [pos_labels[i] for i in p.ravel()]} if by_pos else {}), "head": h.ravel()}
    if per_prompt:
        _need_prompts(scorer)
        frame = pd.concat([pd.DataFrame({**keys, "prompt": i, "attribution": totals[i].ravel()})
                           for i in range(scorer.n)], ignore_index=True)
        frame = with_meta(frame, clean_tokens)
    else:
        frame = pd.DataFrame({**keys, "attribution": totals.mean(0).ravel()})
    if exact:
        patched = activation_patching(model, clean_tokens, corrupted_tokens, metric,
                                      sites="head_by_pos" if by_pos else "head",
                                      positions=positions if given or by_pos else None, batch_size=batch_size,
                                      padding_side=padding_side, per_prompt=per_prompt)
        frame["exact"] = (patched["metric"] - patched["corrupted"]).to_numpy()
        frame.attrs["correlation"] = float(np.corrcoef(frame["attribution"], frame["exact"])[0, 1])
    return frame


def patching_agreement(attribution: pd.DataFrame, patched: pd.DataFrame) -> pd.DataFrame:
    """Attribution patching beside exact patching of each head (``site="head"`` rows of an
    ``activation_patching`` table): layer, head, attribution, exact (= metric - corrupted),
    with ``attrs["correlation"]`` (Pearson; NaN when either side is constant)."""
    heads = patched[patched["site"] == "head"] if "site" in patched else patched
    if heads.empty or "attribution" not in attribution:
        raise ValueError("patching_agreement takes an attribution_patching table and an activation_patching "
                         "table with site='head' rows")
    exact = heads.assign(exact=heads["metric"] - heads["corrupted"])[["layer", "head", "exact"]]
    frame = attribution[["layer", "head", "attribution"]].merge(exact, on=["layer", "head"], validate="one_to_one")
    if len(frame) != len(attribution):
        raise ValueError("the two tables do not cover the same heads")
    a, b = frame["attribution"].to_numpy(), frame["exact"].to_numpy()
    frame.attrs["correlation"] = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
    return frame


@dataclass(frozen=True)
class PatchingPairs:
    """Clean/corrupted prompt pairs with their answers, as tuples (hashable: they can key a cache).

    ``clean``/``corrupted``: token ids, one row per pair, all the same length; ``answer``/``wrong``:
    one id per pair; ``prompts``/``corrupted_prompts``: the text; ``description`` says what they are.
    """

    clean: tuple[tuple[int, ...], ...]
    corrupted: tuple[tuple[int, ...], ...]
    answer: tuple[int, ...]
    wrong: tuple[int, ...]
    prompts: tuple[str, ...]
    corrupted_prompts: tuple[str, ...]
    description: str


TASK_PAIRS = {"ioi": "IOI prompts, corrupted by a third name in place of the second subject (ABC)",
              "possession": "possession prompts, corrupted by asking about the other person"}


def task_pairs(model, meta, n: int = 8, kind: str = "ioi", seed: int = 0) -> PatchingPairs:
    """``n`` known-answer clean/corrupted pairs from the task a checkpoint's meta.json names.

    The stories task has IOI pairs (its "ABC" corruption: the second mention of the subject
    becomes a third name) and possession pairs; the texts are re-encoded with the model's own
    tokenizer. ValueError when the task has no such pairs or the model cannot read them.
    """
    from workbench.analysis.reference import task_from_meta

    check_choice("kind", kind, tuple(TASK_PAIRS))
    n = check_int("n", n, 1)
    task = task_from_meta(meta)
    if not hasattr(task, f"{kind}_prompts"):
        raise ValueError(f"the {getattr(task, 'name', type(task).__name__)} task has no {kind} prompt pairs; "
                         "type a clean and a corrupted prompt instead")
    batch = getattr(task, f"{kind}_prompts")(n, seed=seed)
    corrupted_text = [task.tokenizer.decode(row.tolist()) for row in batch.corrupted]
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("the model has no tokenizer to read the task's prompts")
    clean = [model.tokenizer.encode(p) for p in batch.prompts]
    corrupted = [model.tokenizer.encode(p) for p in corrupted_text]
    if any(c != t.tolist() for c, t in zip(clean, batch.tokens)) or \
            any(c != t.tolist() for c, t in zip(corrupted, batch.corrupted)):
        raise ValueError("the model's tokenizer reads the task's prompts differently from the task: "
                         "it was not trained on this task's vocabulary")
    return PatchingPairs(tuple(map(tuple, clean)), tuple(map(tuple, corrupted)), tuple(batch.correct.tolist()),
                         tuple(batch.wrong.tolist()), tuple(batch.prompts), tuple(corrupted_text), TASK_PAIRS[kind])
