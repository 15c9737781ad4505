"""Attention heads: patterns as tables, and what kind of head each one is.

Head scores follow TransformerLens' ``head_detector`` detection patterns (previous-token,
duplicate-token, induction) plus first-token attention, computed for every head of every
layer from one cached run. A score is the attention a head puts on the positions its
pattern names, averaged over the query positions that have such a position, so a perfect
induction head scores 1 on repeated random tokens (TL's ``"mul"`` score averages over every
query row instead; the tests convert one into the other).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from workbench.analysis.common import as_tokens, check_choice, check_head, check_layer, str_tokens
from workbench.utils import check_index, check_int, check_seed, is_int

SCORE_KINDS = ("previous_token", "duplicate_token", "induction", "first_token")


def _pattern_cache(model, tokens: Tensor, layers: Sequence[int]):
    wanted = {f"blocks.{l}.attn.hook_pattern" for l in layers}
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)
    return cache


@torch.no_grad()
def attention_patterns(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    layers: Optional[Sequence[int]] = None,
    heads: Optional[Sequence[int]] = None,
    batch_index: Optional[int] = 0,
) -> pd.DataFrame:
    """Attention weights, one row per (batch, layer, head, query_pos, key_pos) with key <= query.

    Columns: batch, layer, head, query_pos, key_pos, query_token, key_token, attention.
    ``batch_index=None`` keeps every sequence of the batch.
    """
    tokens = as_tokens(model, tokens)
    layers = list(range(model.cfg.n_layers)) if layers is None else [check_layer(model, l, name="layers") for l in layers]
    heads = list(range(model.cfg.n_heads)) if heads is None else [check_head(model, h, name="heads") for h in heads]
    if batch_index is not None:
        batch_index = check_index("batch_index", batch_index, tokens.shape[0], of=f"a batch of {tokens.shape[0]}")
        tokens = tokens[batch_index : batch_index + 1]
    cache = _pattern_cache(model, tokens, layers)
    frames = []
    labels = np.empty(tokens.shape, dtype=object)
    labels[:] = [str_tokens(model, row) for row in tokens]
    for layer in layers:
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, heads].float().cpu().numpy()  # [b, h, q, k]
        causal = np.broadcast_to(np.tril(np.ones(pattern.shape[-2:], dtype=bool)), pattern.shape)
        b, h, q, k = np.nonzero(causal)
        frames.append(pd.DataFrame({
            "batch": b if batch_index is None else batch_index,
            "layer": layer,
            "head": np.asarray(heads)[h],
            "query_pos": q,
            "key_pos": k,
            "query_token": labels[b, q],
            "key_token": labels[b, k],
            "attention": pattern[b, h, q, k],
        }))
    return pd.concat(frames, ignore_index=True)


# ---- detection patterns, as TransformerLens' head_detector defines them ------------------------
def detection_mask(kind: str, tokens: Int[Tensor, "batch pos"]) -> Bool[Tensor, "batch query_pos key_pos"]:
    """Where a head of ``kind`` should attend: [batch, query, key], causal (key <= query)."""
    check_choice("kind", kind, SCORE_KINDS)
    batch, pos = tokens.shape
    q = torch.arange(pos, device=tokens.device)[:, None]
    k = torch.arange(pos, device=tokens.device)[None, :]
    if kind == "previous_token":
        mask = (k == q - 1).expand(batch, -1, -1)
    elif kind == "first_token":
        mask = ((k == 0) & (q > 0)).expand(batch, -1, -1)
    elif kind == "duplicate_token":  # an earlier copy of the current token
        mask = (tokens[:, :, None] == tokens[:, None, :]) & (k < q)
    else:  # induction: the token after an earlier copy of the current token
        same = tokens[:, :, None] == tokens[:, None, :]  # [b, q, k']
        shifted = torch.zeros_like(same)
        shifted[:, :, 1:] = same[:, :, :-1]  # key k where token[k-1] == token[q]
        mask = shifted & (k - 1 < q) & (k <= q)
    return mask


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
    tokens: Union[str, Int[Tensor, "batch pos"], None] = None,
    kinds: Sequence[str] = SCORE_KINDS,
    seq_len: Optional[int] = None,
    batch: int = 8,
    seed: int = 0,
    wide: bool = False,
) -> pd.DataFrame:
    """Every head's score for each kind: columns layer, head, kind, score (0..1).

    Without ``tokens``, the scores are measured on repeated random tokens
    (``repeated_random_tokens``, ``seq_len`` up to 20, at most half the context), where
    induction and duplicate-token heads show themselves. A score belongs to the layout it was
    measured on (on fresh layouts the best induction head of a model can change), so the
    returned frame's ``attrs["layout"]`` says which: ``source`` ("repeated_random_tokens" or
    "tokens"), ``batch``, ``n_pos`` and ``repeats`` (positions holding a token seen earlier in
    their row), plus ``seq_len`` and ``seed`` for the repeated random tokens. ``wide=True``: one row per head
    (layer, head) and a column per kind instead (same ``attrs``).
    """
    for kind in kinds:
        check_choice("kind", kind, SCORE_KINDS)
    if tokens is None:
        seq_len = min(20, model.cfg.n_ctx // 2) if seq_len is None else seq_len
        tokens = repeated_random_tokens(model, seq_len, batch, seed)
        layout = {"source": "repeated_random_tokens", "seq_len": seq_len, "seed": seed}
    else:
        tokens, layout = as_tokens(model, tokens), {"source": "tokens"}
    layers = range(model.cfg.n_layers)
    cache = _pattern_cache(model, tokens, layers)
    patterns = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"] for l in layers]).float()  # [l, b, h, q, k]
    rows = []
    for kind in kinds:
        mask = detection_mask(kind, tokens).float()  # [b, q, k]
        has_target = mask.sum(-1) > 0  # [b, q]
        on_target = (patterns * mask[None, :, None]).sum(-1)  # [l, b, h, q]
        n_rows = has_target.sum().clamp(min=1)
        score = (on_target * has_target[None, :, None]).sum(dim=(1, 3)) / n_rows  # [l, h]
        for layer in layers:
            for head in range(model.cfg.n_heads):
                rows.append((layer, head, kind, float(score[layer, head])))
    frame = pd.DataFrame(rows, columns=["layer", "head", "kind", "score"])
    repeats = int(detection_mask("duplicate_token", tokens).any(-1).sum())
    layout = {**layout, "batch": int(tokens.shape[0]), "n_pos": int(tokens.shape[1]), "repeats": repeats}
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
