"""Attention heads: patterns as tables, and what kind of head each one is.

Head scores follow TransformerLens' ``head_detector`` detection patterns (previous-token,
duplicate-token, induction) plus first-token attention, computed for every head of every
layer from one cached run. A score is the attention a head puts on the positions its
pattern names, averaged over the query positions that have such a position, so a perfect
induction head scores 1 on repeated random tokens (TL's ``"mul"`` score averages over every
query row instead; the tests convert one into the other).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from workbench.analysis.batching import (
    DataLike, iter_batches, n_rows, previous_real_index, real_positions, select_rows, with_meta,
)
from workbench.analysis.common import check_choice, check_head, check_layer, str_tokens
from workbench.utils import check_index, check_int, check_seed, is_int

SCORE_KINDS = ("previous_token", "duplicate_token", "induction", "first_token")


def _pattern_cache(model, batch, layers: Sequence[int]):
    wanted = {f"blocks.{l}.attn.hook_pattern" for l in layers}
    _, cache = model.run_with_cache(batch, names_filter=lambda name: name in wanted)
    return cache


@torch.no_grad()
def attention_patterns(
    model,
    data: DataLike,
    layers: Optional[Sequence[int]] = None,
    heads: Optional[Sequence[int]] = None,
    batch_index: Optional[int] = 0,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """Attention weights between real tokens, one row per (prompt, layer, head, query_pos,
    key_pos) with key <= query; positions count within each prompt (pads never appear).

    Columns: batch, layer, head, query_pos, key_pos, query_token, key_token, attention,
    prompt (= batch: the row of ``data``) and a PromptSet's meta columns. ``batch_index``
    picks one prompt of ``data`` (default the first); ``None`` keeps every prompt, run in
    batches of ``batch_size``.
    """
    layers = list(range(model.cfg.n_layers)) if layers is None else [check_layer(model, l, name="layers") for l in layers]
    heads = list(range(model.cfg.n_heads)) if heads is None else [check_head(model, h, name="heads") for h in heads]
    picked = data
    if batch_index is not None:
        n = n_rows(data)
        batch_index = check_index("batch_index", batch_index, n, of=f"a batch of {n}")
        picked = select_rows(data, [batch_index])
    frames = []
    for batch in iter_batches(model, picked, batch_size, padding_side, progress, "attention patterns", attention_mask):
        cache = _pattern_cache(model, batch, layers)
        real = batch.attention_mask.bool()
        rp = real_positions(real)
        # real query and real key, key not after the query (in the prompt's own positions)
        keep = (real[:, :, None] & real[:, None, :] & (rp[:, None, :] <= rp[:, :, None]))[:, None]  # [b, 1, q, k]
        labels = np.array(model_labels(model, batch.tokens), dtype=object)
        rows = batch.rows.cpu().numpy() if batch_index is None else np.full(len(batch), batch_index)
        rp = rp.cpu().numpy()
        for layer in layers:
            pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, heads].float()  # [b, h, q, k]
            b, h, q, k = (t.cpu().numpy() for t in keep.expand_as(pattern).nonzero(as_tuple=True))
            frames.append(pd.DataFrame({
                "batch": rows[b], "layer": layer, "head": np.asarray(heads)[h],
                "query_pos": rp[b, q], "key_pos": rp[b, k],
                "query_token": labels[b, q], "key_token": labels[b, k],
                "attention": pattern.cpu().numpy()[b, h, q, k],
                "prompt": rows[b],
            }))
    frame = pd.concat(frames, ignore_index=True)
    frame = frame.sort_values(["layer", "batch", "head", "query_pos", "key_pos"], kind="stable")
    return with_meta(frame.reset_index(drop=True), data)


def model_labels(model, tokens: Int[Tensor, "batch pos"]) -> list[list[str]]:
    """``str_tokens`` of every row of ``tokens`` (pads get the pad id's label; no table shows them)."""
    return [str_tokens(model, row) for row in tokens]


# ---- detection patterns, as TransformerLens' head_detector defines them ------------------------
def detection_mask(
    kind: str, tokens: Int[Tensor, "batch pos"], attention_mask: Optional[Tensor] = None
) -> Bool[Tensor, "batch query_pos key_pos"]:
    """Where a head of ``kind`` should attend: [batch, query, key], causal (key <= query).

    With ``attention_mask`` (1 = real token) pads are neither queries nor keys, and "previous"
    and "first" mean within each prompt: the patterns of a padded row are those of its prompt alone.
    """
    check_choice("kind", kind, SCORE_KINDS)
    real = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    rp = real_positions(real)
    q, k = rp[:, :, None], rp[:, None, :]
    both = real[:, :, None] & real[:, None, :]
    if kind == "previous_token":
        mask = k == q - 1
    elif kind == "first_token":
        mask = (k == 0) & (q > 0)
    elif kind == "duplicate_token":  # an earlier copy of the current token
        mask = (tokens[:, :, None] == tokens[:, None, :]) & (k < q)
    else:  # induction: the token after an earlier copy of the current token
        before = previous_real_index(real)  # the column of each key's previous real token
        prev_token = torch.where(before >= 0, tokens.gather(1, before.clamp(min=0)), torch.full_like(tokens, -1))
        mask = (prev_token[:, None, :] == tokens[:, :, None]) & (before[:, None, :] >= 0) & (k - 1 < q)
    return mask & both


def repeated_random_tokens(
    model, seq_len: int = 20, batch: int = 8, seed: int = 0, prefix: Optional[int] = None
) -> Int[Tensor, "batch pos"]:
    """Random tokens repeated once: ``[prefix?] r_1..r_n r_1..r_n`` (the induction test input)."""
    longest = (model.cfg.n_ctx - (prefix is not None)) // 2
    if not (is_int(seq_len) and 1 <= seq_len <= longest):
        raise ValueError(f"seq_len must be an integer in [1, {longest}] (2 * seq_len{' + 1' if prefix is not None else ''} "
                         f"<= n_ctx={model.cfg.n_ctx}), got {seq_len!r}: pick a shorter seq_len")
    batch, seed = check_int("batch", batch, 1), check_seed("seed", seed)
    if prefix is not None:
        check_index("prefix", prefix, model.cfg.d_vocab, of=f"d_vocab={model.cfg.d_vocab}")
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(0, model.cfg.d_vocab, (batch, seq_len), generator=gen)
    tokens = torch.cat([half, half], dim=1)
    if prefix is not None:
        tokens = torch.cat([torch.full((batch, 1), prefix), tokens], dim=1)
    return tokens.to(model.device)


@torch.no_grad()
def head_scores(
    model,
    data: Optional[DataLike] = None,
    kinds: Sequence[str] = SCORE_KINDS,
    seq_len: Optional[int] = None,
    batch: int = 8,
    seed: int = 0,
    wide: bool = False,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """Every head's score for each kind: columns layer, head, kind, score (0..1).

    Without ``data``, the scores are measured on repeated random tokens
    (``repeated_random_tokens``, ``seq_len`` up to 20, at most half the context), where
    induction and duplicate-token heads show themselves. ``data`` (texts of any lengths,
    token ids, a ``TokenBatch`` or a ``PromptSet``) runs in batches of ``batch_size``; a score
    averages over the real query positions that have a target among the real keys of their
    prompt, summed batch by batch (pads never count), so a padded batch scores what the
    prompts score alone. A score belongs to the layout it was measured on (on fresh layouts
    the best induction head of a model can change), so the returned frame's
    ``attrs["layout"]`` says which: ``source`` ("repeated_random_tokens" or "tokens"),
    ``batch`` (prompts), ``n_pos`` (the longest prompt) and ``repeats`` (real positions
    holding a token seen earlier in their prompt), plus ``seq_len`` and ``seed`` for the
    repeated random tokens. ``wide=True``: one row per head (layer, head) and a column per
    kind instead (same ``attrs``).
    """
    for kind in kinds:
        check_choice("kind", kind, SCORE_KINDS)
    if data is None:
        seq_len = min(20, model.cfg.n_ctx // 2) if seq_len is None else seq_len
        data = repeated_random_tokens(model, seq_len, batch, seed)
        layout = {"source": "repeated_random_tokens", "seq_len": seq_len, "seed": seed}
    else:
        layout = {"source": "tokens"}
    layers = range(model.cfg.n_layers)
    # float64 running sums: the scores of a dataset do not depend on how it was batched
    on_target = {kind: torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64) for kind in kinds}
    n_queries = {kind: 0 for kind in kinds}
    repeats = n_prompts = longest = 0
    for part in iter_batches(model, data, batch_size, padding_side, progress, "head scores", attention_mask):
        cache = _pattern_cache(model, part, layers)
        patterns = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"] for l in layers]).double()  # [l, b, h, q, k]
        for kind in kinds:
            mask = detection_mask(kind, part.tokens, part.attention_mask).double()  # [b, q, k]
            has_target = mask.sum(-1) > 0  # [b, q]; pad queries have none
            hit = (patterns * mask[None, :, None]).sum(-1)  # [l, b, h, q]
            on_target[kind] += (hit * has_target[None, :, None]).sum(dim=(1, 3)).cpu()
            n_queries[kind] += int(has_target.sum())
        repeats += int(detection_mask("duplicate_token", part.tokens, part.attention_mask).any(-1).sum())
        n_prompts += len(part)
        longest = max(longest, int(part.lengths.max()))
    rows = []
    for kind in kinds:
        score = on_target[kind] / max(n_queries[kind], 1)
        for layer in layers:
            for head in range(model.cfg.n_heads):
                rows.append((layer, head, kind, float(score[layer, head])))
    frame = pd.DataFrame(rows, columns=["layer", "head", "kind", "score"])
    layout = {**layout, "batch": n_prompts, "n_pos": longest, "repeats": repeats}
    if wide:
        frame = frame.pivot(index=["layer", "head"], columns="kind", values="score")[list(kinds)]
        frame = frame.reset_index().rename_axis(columns=None)
    frame.attrs["layout"] = layout
    return frame


def attention_change(clean: pd.DataFrame, changed: pd.DataFrame, tol: float = 1e-6) -> pd.DataFrame:
    """Which heads' patterns differ between two ``attention_patterns`` tables of the same tokens
    (e.g. a model clean and ablated): the largest absolute change of any weight, per head.

    Columns: layer, head, max_change; only heads whose change exceeds ``tol``, largest first
    (empty when nothing changed).
    """
    keys = ["batch", "layer", "head", "query_pos", "key_pos"]
    if len(clean) != len(changed) or not clean[keys].reset_index(drop=True).equals(changed[keys].reset_index(drop=True)):
        raise ValueError("the two attention tables must cover the same batch, layers, heads and positions")
    frame = clean[["layer", "head"]].reset_index(drop=True)
    frame["max_change"] = np.abs(changed["attention"].to_numpy() - clean["attention"].to_numpy())
    per_head = frame.groupby(["layer", "head"], as_index=False)["max_change"].max()
    per_head = per_head[per_head["max_change"] > tol]
    return per_head.sort_values("max_change", ascending=False, kind="stable").reset_index(drop=True)
