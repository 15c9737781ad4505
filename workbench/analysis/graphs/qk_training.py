"""Why a head attends, through training: QK attribution at every snapshot of a run, summarised per step.

    tokens, q, k = induction_qk_prompts(d_vocab=64, n=16, seed=0)      # [r, r[:m]]: the query reads r[m]
    table = an.over_training(series, qk_pairs, tokens=tokens, layer=1, head=0, query_pos=q, key_pos=k)
    summary = qk_summary(table, pair=("token", "L0H2"))                 # one row per step, intervals over prompts
    viz.qk_over_training_figure(summary, phase=loss_drop(series.history))

``qk_pairs`` is an ordinary analysis (``model -> DataFrame``), so ``over_training`` maps it over the
snapshots like any other. At each snapshot it takes the attribution graph of each prompt with the
model itself as the replacement model: the models this is for are attention-only, so there is no
MLP to replace and no dictionary to fit per snapshot (nor one fitted at the end and reused, which
would read early snapshots through features they never had). Every node is then exact: the token
embedding, each earlier head's output, the biases. Nodes are named without their position
(``node_label``: ``token``, ``L0H2``, ``bias``, ``F1.37``, ``error L1``) so pairs can be counted
across prompts whose positions differ.

The phase change is where the training loss falls fastest (``loss_drop``): the window of steps
where the smoothed loss falls at more than half its steepest rate.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from workbench.stats import t_interval
from workbench.utils import check_int, check_seed

from workbench.analysis.graphs.attribute import attribution_graph
from workbench.analysis.graphs.qk import QKContext, _attribution


def node_label(kind: str, layer: int, index: int) -> str:
    """A node named without its position, from ``qk_attribution``'s ``*_kind``, ``*_layer`` and ``*_index``
    columns: ``token``, ``L0H2`` (head 2's output), ``bias``, ``F1.37`` (feature 37 of layer 1), ``error L1``."""
    if kind in ("token", "bias"):
        return kind
    if kind == "error":
        return f"error L{layer}"
    if kind == "head":
        return f"L{layer}H{index}"
    if kind == "feature":
        return f"F{layer}.{index}"
    raise ValueError(f"unknown node kind {kind!r}: one of bias, error, feature, head, token")


def _per_prompt(value, n: int, what: str) -> list[int]:
    values = [value] * n if isinstance(value, (int, np.integer)) else list(value)
    if len(values) != n:
        raise ValueError(f"{what} needs one position per prompt ({n}), got {len(values)}")
    return [int(v) for v in values]


def _prompts(tokens) -> list[Tensor]:
    if isinstance(tokens, Tensor):
        if tokens.ndim == 1:
            return [tokens]
        if tokens.ndim == 2:
            return list(tokens)
    elif isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, Tensor) and t.ndim == 1 for t in tokens):
        return list(tokens)
    raise ValueError("tokens must be a [pos] or [batch, pos] tensor of token ids, or a list of [pos] tensors")


def qk_pairs(model, tokens, layer: int, head: Union[int, Sequence[int]], query_pos, key_pos, *,
             top: Optional[int] = None, exact: int = 0, transcoders=None) -> pd.DataFrame:
    """The QK attribution of head(s) ``head`` of ``layer`` reading ``key_pos`` from ``query_pos`` on each prompt.

    ``tokens``: one prompt ([pos]), a batch ([batch, pos]) or a list of prompts of different lengths;
    ``query_pos`` / ``key_pos``: one position for all, or one per prompt. One row per (prompt, head,
    pair) with ``qk_attribution``'s columns, plus ``prompt``, ``layer``, ``head``, ``query_pos``,
    ``key_pos``, ``rank`` (1 = the largest |contribution|), ``query_label`` / ``key_label``
    (``node_label``), and the score, its bilinear part and residual. ``top`` None keeps every pair (so a
    pair's rank is known however low it sits). ``transcoders``: None for an attention-only model (the
    model is its own replacement), else what ``attribution_graph`` takes.
    """
    prompts = _prompts(tokens)
    queries, keys = _per_prompt(query_pos, len(prompts), "query_pos"), _per_prompt(key_pos, len(prompts), "key_pos")
    heads = [head] if isinstance(head, (int, np.integer)) else list(head)
    layer = check_int("layer", layer, 0, model.cfg.n_layers - 1)
    for h in heads:
        check_int("head", h, 0, model.cfg.n_heads - 1)
    frames = []
    for i, (ids, q, k) in enumerate(zip(prompts, queries, keys)):
        if not 0 <= k <= q < len(ids):
            raise ValueError(f"prompt {i}: need 0 <= key_pos <= query_pos < {len(ids)} (causal attention), "
                             f"got query {q}, key {k}")
        graph = attribution_graph(model, transcoders, ids.to(model.device))
        context = QKContext(graph)  # one clean run per prompt, whatever the number of heads
        for h in heads:
            # the context was just made: no weight check per head (qk_attribution would make one each)
            table = _attribution(context, layer, int(h), q, k, top, exact)
            frame = table.reset_index(drop=True).assign(
                prompt=i, layer=layer, head=int(h), query_pos=q, key_pos=k, rank=np.arange(1, len(table) + 1),
                score=table.attrs["score"], bilinear=table.attrs["bilinear"], residual=table.attrs["residual"])
            for side in ("query", "key"):
                frame[f"{side}_label"] = [node_label(*node) for node in zip(
                    frame[f"{side}_kind"], frame[f"{side}_layer"], frame[f"{side}_index"])]
            frames.append(frame)
    first = ["prompt", "layer", "head", "query_pos", "key_pos", "rank", "query_label", "key_label"]
    out = pd.concat(frames, ignore_index=True)
    return out[first + [c for c in out.columns if c not in first]]


def induction_qk_prompts(d_vocab: int, n: int = 16, half: int = 16, seed: int = 0, *,
                         n_ctx: Optional[int] = None, bos: Optional[int] = None) -> tuple[list[Tensor], list[int], list[int]]:
    """``n`` prompts ``[bos?, r, r[:m]]`` (``r``: ``half`` distinct tokens below ``d_vocab``, ``m`` drawn from
    2..half), each ending where an induction head should attend: the query is the last token, ``r[m-1]``
    again, and the key the token after its first occurrence, ``r[m]``. Returns (prompts, query
    positions, key positions)."""
    n, half, seed = check_int("n", n, 1), check_int("half", half, 2), check_seed("seed", seed)
    # r never holds the BOS id, wherever it lies (below d_vocab - 1 too); with it last or absent, ids are unchanged
    ids = torch.tensor([i for i in range(d_vocab) if i != bos])
    vocab = len(ids)
    if half > vocab:
        raise ValueError(f"half ({half}) must be at most the {vocab} tokens to draw distinct ones from")
    offset = 0 if bos is None else 1
    if n_ctx is not None and offset + 2 * half > n_ctx:
        raise ValueError(f"prompts of {offset + 2 * half} tokens do not fit the context ({n_ctx}): lower half")
    gen = torch.Generator().manual_seed(seed)
    prompts, queries, keys = [], [], []
    for _ in range(n):
        r = ids[torch.randperm(vocab, generator=gen)[:half]]
        m = int(torch.randint(2, half + 1, (1,), generator=gen))
        parts = ([torch.tensor([bos])] if bos is not None else []) + [r, r[:m]]
        prompts.append(torch.cat(parts))
        queries.append(offset + half + m - 1)
        keys.append(offset + m)
    return prompts, queries, keys


def _interval(values, confidence: float) -> tuple[float, float, float]:
    iv = t_interval(values, confidence)
    return iv.mean, iv.low, iv.high


def _family(pairs) -> list[tuple[str, str]]:
    if isinstance(pairs, tuple) and len(pairs) == 2 and all(isinstance(p, str) for p in pairs):
        return [pairs]
    family = [tuple(p) for p in pairs]
    if not family or any(len(p) != 2 for p in family):
        raise ValueError("pair must be (query label, key label), e.g. ('token', 'L0H2'), or a list of such pairs")
    return family


def pair_name(pairs) -> str:
    """``token x L0H2`` for one pair; ``token x L0H2/L0H3`` for pairs sharing their query node."""
    family = _family(pairs)
    if len({q for q, _ in family}) == 1:
        return f"{family[0][0]} x {'/'.join(k for _, k in family)}"
    return " + ".join(f"{q} x {k}" for q, k in family)


def qk_summary(table: pd.DataFrame, pair=None, confidence: float = 0.95) -> pd.DataFrame:
    """One row per (step, layer, head) of ``over_training(series, qk_pairs, ...)``'s table.

    ``score``: the attention score; ``top_contribution``: each prompt's rank-1 pair's contribution
    (``top_pair``: the commonest rank-1 pair, ``top_pair_share``: on what share of prompts);
    ``pair_contribution``: the summed contribution of ``pair`` = (query label, key label), or of a list
    of such pairs (the K-composition pairs of several previous-token heads), ``pair_best_contribution``:
    the contribution of the highest-ranked of them (to compare with the top pair's), ``pair_rank``: the best
    rank any of them reaches (median over prompts), ``pair_is_top``: the share of prompts where one of
    them is the top pair. ``_low`` / ``_high``: the Student-t interval of the mean over prompts at
    ``confidence``. ``pair`` None: the commonest top pair at the last step.
    """
    need = {"step", "prompt", "layer", "head", "rank", "query_label", "key_label", "contribution", "score"}
    missing = need - set(table.columns)
    if missing:
        raise ValueError(f"the table lacks {sorted(missing)}: make it with over_training(series, qk_pairs, ...)")
    labels = table["query_label"] + " x " + table["key_label"]
    if pair is None:
        last = table[(table["step"] == table["step"].max()) & (table["rank"] == 1)]
        pair = tuple(labels[last.index].mode().iloc[0].split(" x "))
    family = {f"{q} x {k}" for q, k in _family(pair)}
    rows = []
    for (step, layer, head), part in table.assign(pair_label=labels).groupby(["step", "layer", "head"], sort=True):
        prompts = sorted(part["prompt"].unique())
        tops = part[part["rank"] == 1]
        commonest = tops["pair_label"].value_counts()
        mine = part[part["pair_label"].isin(family)].sort_values("rank")
        ours = mine.groupby("prompt").agg(contribution=("contribution", "sum"), rank=("rank", "min"),
                                          best=("contribution", "first")).reindex(prompts)
        # A pair below the table's `top` on a prompt: contribution unknown (NaN), rank past the last kept.
        ranks = ours["rank"].fillna(part.groupby("prompt")["rank"].max() + 1)
        row = dict(step=step, layer=layer, head=head, prompts=len(prompts), pair=pair_name(pair), top_pair=commonest.index[0],
                   top_pair_share=commonest.iloc[0] / len(prompts))
        for key, values in (("score", part.groupby("prompt")["score"].first()),
                            ("top_contribution", tops["contribution"]),
                            ("pair_contribution", ours["contribution"]),
                            ("pair_best_contribution", ours["best"])):
            row[key], row[f"{key}_low"], row[f"{key}_high"] = _interval(values.to_numpy(float), confidence)
        row["pair_rank"] = float(ranks.median())
        row["pair_is_top"] = float((ours["rank"] == 1).sum() / len(prompts))
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs.update({k: v for k, v in table.attrs.items() if k in ("history", "source")}, pair=pair_name(pair),
                     confidence=confidence)
    return out


def loss_drop(history: pd.DataFrame, column: str = "train_loss", window: int = 5) -> dict:
    """The phase change as the loss curve shows it: ``{"start", "steepest", "end"}`` steps of the window
    where the loss (a centred rolling mean over ``window`` logged points) falls at more than half its
    steepest rate (per step), around the steepest fall; ``drop``: the smoothed loss lost across it."""
    if column not in history or history[column].notna().sum() < window + 2:
        raise ValueError(f"the history needs a {column!r} column with at least {window + 2} values (metrics.csv)")
    rows = history[["step", column]].dropna().sort_values("step")
    smooth = rows[column].rolling(window, center=True, min_periods=1).mean().to_numpy()
    steps = rows["step"].to_numpy(float)
    slope = -np.gradient(smooth, steps)  # positive where the loss falls
    peak = int(np.argmax(slope))
    lo = hi = peak
    while lo > 0 and slope[lo - 1] > slope[peak] / 2:
        lo -= 1
    while hi < len(slope) - 1 and slope[hi + 1] > slope[peak] / 2:
        hi += 1
    return {"start": int(steps[lo]), "steepest": int(steps[peak]), "end": int(steps[hi]),
            "drop": float(smooth[lo] - smooth[hi])}
