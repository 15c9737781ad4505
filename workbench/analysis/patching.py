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
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from workbench.analysis.common import Metric, as_tokens, check_choice
from workbench.analysis.resume import hook_name, needed_hooks, run_from_site
from workbench.utils import check_int, eval_mode

PATCH_SITES = ("resid_pre", "resid_mid", "attn_out", "mlp_out", "head", "head_by_pos")


def _units(model, site: str, n_pos: int) -> list[tuple[int, int, int]]:
    """(layer, pos, head) of every patch; -1 where an axis does not apply. TL's index order."""
    layers, heads, positions = range(model.cfg.n_layers), range(model.cfg.n_heads), range(n_pos)
    if site == "head":
        return [(l, -1, h) for l in layers for h in heads]
    if site == "head_by_pos":
        return [(l, p, h) for l in layers for p in positions for h in heads]
    return [(l, p, -1) for l in layers for p in positions]


def _token_pair(model, clean_tokens, corrupted_tokens) -> tuple[Tensor, Tensor]:
    clean_tokens, corrupted_tokens = as_tokens(model, clean_tokens), as_tokens(model, corrupted_tokens)
    if clean_tokens.shape != corrupted_tokens.shape:
        raise ValueError(f"clean {tuple(clean_tokens.shape)} and corrupted {tuple(corrupted_tokens.shape)} "
                         "tokens must have the same shape")
    return clean_tokens, corrupted_tokens


def _patched(corrupted: Tensor, clean: Tensor, pos: int, head: int) -> Tensor:
    out = corrupted.clone()
    index = (slice(None), slice(None) if pos < 0 else pos) + (() if head < 0 else (head,))
    out[index] = clean[index]
    return out


@torch.no_grad()
def activation_patching(
    model,
    clean_tokens: Union[str, Int[Tensor, "batch pos"]],
    corrupted_tokens: Union[str, Int[Tensor, "batch pos"]],
    metric: Metric,
    sites: Union[str, Sequence[str]] = ("resid_pre", "attn_out", "mlp_out"),
    stack: Optional[int] = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Patch each clean activation into the corrupted run; one row per patch.

    ``sites``: ``resid_pre``, ``resid_mid``, ``attn_out``, ``mlp_out`` (per layer and
    position), ``head`` (every head's output, all positions) and ``head_by_pos``.
    Columns: site, layer, pos, head (-1 where not applicable), metric, corrupted, clean,
    and ``restored`` = (metric - corrupted) / (clean - corrupted).
    """
    sites = [sites] if isinstance(sites, str) else list(sites)
    for site in sites:
        check_choice("site", site, PATCH_SITES)
        block = model.blocks[0]
        if site in ("resid_mid", "mlp_out") and site not in block.sites:
            raise ValueError(f"site={site!r} does not exist in the {block.layout} block layout "
                             f"(its sites: {list(block.sites)})")
    clean_tokens, corrupted_tokens = _token_pair(model, clean_tokens, corrupted_tokens)
    stack = (16 if model.device.type == "cuda" else 1) if stack is None else check_int("stack", stack, 1)
    names = needed_hooks(model)
    clean_logits, clean_cache = model.run_with_cache(clean_tokens, names_filter=lambda n: n in names)
    corrupted_logits, cache = model.run_with_cache(corrupted_tokens, names_filter=lambda n: n in names)
    clean_value, corrupted_value = float(metric(clean_logits)), float(metric(corrupted_logits))

    rows = []
    for site in sites:
        resume_site = "z" if site.startswith("head") else site
        units = _units(model, site, corrupted_tokens.shape[1])
        by_layer: dict[int, list] = {}
        for unit in units:
            by_layer.setdefault(unit[0], []).append(unit)
        for layer, members in tqdm(by_layer.items(), disable=not progress, desc=f"patching {site}"):
            name = hook_name(layer, resume_site)
            for start in range(0, len(members), stack):
                chunk = members[start : start + stack]
                edits = torch.cat([_patched(cache[name], clean_cache[name], pos, head) for _, pos, head in chunk])
                logits = run_from_site(model, layer, resume_site, edits, cache.cache_dict).chunk(len(chunk))
                rows += [(site, l, p, h, float(metric(lg))) for (l, p, h), lg in zip(chunk, logits)]
    frame = pd.DataFrame(rows, columns=["site", "layer", "pos", "head", "metric"])
    frame["corrupted"], frame["clean"] = corrupted_value, clean_value
    gap = clean_value - corrupted_value
    frame["restored"] = (frame["metric"] - corrupted_value) / gap if gap != 0 else np.nan
    return frame


def attribution_patching(
    model,
    clean_tokens: Union[str, Int[Tensor, "batch pos"]],
    corrupted_tokens: Union[str, Int[Tensor, "batch pos"]],
    metric: Metric,
    by_pos: bool = False,
    exact: bool = False,
) -> pd.DataFrame:
    """Every head's estimated patching effect from one forward+backward on the corrupted input.

    Columns: layer, head, (pos when ``by_pos``), attribution (the estimated change of the
    metric when that head's clean output is patched in). With ``exact=True`` also
    ``exact`` (from ``activation_patching``), and ``frame.attrs["correlation"]`` (Pearson).
    """
    clean_tokens, corrupted_tokens = _token_pair(model, clean_tokens, corrupted_tokens)
    n = model.cfg.n_layers
    z_names = [f"blocks.{l}.attn.hook_z" for l in range(n)]
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean_tokens, names_filter=lambda name: name in z_names)
    corrupted_z: dict[str, Tensor] = {}

    def keep(act: Tensor, hook) -> None:
        corrupted_z[hook.name] = act

    def track(act: Tensor, hook) -> Tensor:
        # The gradient is taken with respect to activations, never parameters: a frozen model
        # (requires_grad=False everywhere, as an app or a notebook leaves it) still has one
        # once the embedding output is a leaf that requires it, and every path from a head to
        # the metric (through later heads too) stays in the graph.
        return act.detach().requires_grad_(True)

    with eval_mode(model), torch.enable_grad():
        logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[("hook_embed", track)]
                                      + [(name, keep) for name in z_names])
        if not logits.requires_grad:
            raise ValueError("attribution patching needs a metric of the logits that has a gradient")
        grads = torch.autograd.grad(metric(logits), [corrupted_z[name] for name in z_names])
    per_pos = torch.stack([
        ((clean_cache[name] - corrupted_z[name].detach()) * grad).sum(dim=(0, -1))  # [pos, head]
        for name, grad in zip(z_names, grads)
    ]).float().cpu()  # [layer, pos, head]
    if by_pos:
        l, p, h = np.meshgrid(np.arange(n), np.arange(per_pos.shape[1]), np.arange(model.cfg.n_heads), indexing="ij")
        frame = pd.DataFrame({"layer": l.ravel(), "pos": p.ravel(), "head": h.ravel(),
                              "attribution": per_pos.numpy().ravel()})
    else:
        l, h = np.meshgrid(np.arange(n), np.arange(model.cfg.n_heads), indexing="ij")
        frame = pd.DataFrame({"layer": l.ravel(), "head": h.ravel(), "attribution": per_pos.sum(1).numpy().ravel()})
    if exact:
        patched = activation_patching(model, clean_tokens, corrupted_tokens, metric,
                                      sites="head_by_pos" if by_pos else "head")
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
