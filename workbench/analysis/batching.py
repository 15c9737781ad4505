"""Data in, padded batches out: the one loop every dataset-scale analysis runs.

    for batch in iter_batches(model, data, batch_size=32, progress=True, desc="logit lens"):
        logits = model(batch)            # batch: a PromptSetBatch (tokens, attention_mask, rows, answer, ...)
        ...                              # reduce on the fly: memory stays bounded by the batch

``data`` may be a text, a list of texts (any lengths), a token tensor [batch, pos] (every
position real), a ``TokenBatch`` (its mask kept), or a ``PromptSet`` (answers, wrong answers
and corrupted prompts ride along). Every batch says which rows of ``data`` it holds
(``rows``), so results are tables with one ``prompt`` column numbering the rows of ``data``
from 0, whatever the batching.

The conventions every mask-aware analysis keeps: pads never appear in a result table and
never enter a mean; a position is counted within its own prompt (``pos`` 0 is the prompt's
first real token, whatever the padding side), so a padded batch gives the same table as each
prompt alone.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from workbench.data.prompts import PromptSet, PromptSetBatch
from workbench.padding import PADDING_SIDES, TokenBatch, check_attention_mask

DataLike = Union[str, Sequence[str], Tensor, TokenBatch, PromptSet]


def n_rows(data: DataLike) -> int:
    """How many prompts ``data`` holds."""
    if isinstance(data, str):
        return 1
    if isinstance(data, Tensor):
        return 1 if data.ndim == 1 else data.shape[0]
    return len(data)


def check_not_empty(data: Any, name: str = "data") -> None:
    """ValueError when ``data`` holds no prompt (``[]``, a 0-row tensor, an empty PromptSet): an
    analysis of nothing would otherwise fail deep in pandas or answer zeros."""
    try:
        empty = n_rows(data) == 0 or (isinstance(data, Tensor) and data.numel() == 0)
    except TypeError:  # no len(): as_token_batch names the kinds it takes
        return
    if empty:
        raise ValueError(f"{name} holds no prompts (got an empty {type(data).__name__}); pass at least one text "
                         "or a token tensor [batch, pos] with batch >= 1 and pos >= 1")


def as_token_batch(model, data: Any, padding_side: str = "left", attention_mask: Optional[Tensor] = None) -> TokenBatch:
    """All of ``data`` (``DataLike``; anything else is a ValueError naming the kinds) as one ``TokenBatch`` on the model's device (a plain tensor gets a mask of
    ones, or ``attention_mask`` when given, as TransformerLens users pass one; a ``TokenBatch``
    keeps its own padding). For small data only: it is not streamed."""
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    check_not_empty(data)
    if attention_mask is not None:
        if not isinstance(data, Tensor):
            raise ValueError("attention_mask goes with a token tensor; a text, a TokenBatch or a PromptSet "
                             f"carries its own padding (got {type(data).__name__})")
        tokens = model._check_tokens(data)
        mask = check_attention_mask(attention_mask, tokens.shape).to(tokens.device).long()
        side = "right" if bool((mask[:, -1] == 0).any()) else "left"
        return TokenBatch(tokens, mask, side)
    if isinstance(data, PromptSet):
        (batch,) = data.batches(model, batch_size=len(data), padding_side=padding_side)
        return batch
    if isinstance(data, TokenBatch):
        return data.to(model.device)
    if isinstance(data, Tensor):
        tokens = model._check_tokens(data)
        return TokenBatch(tokens, torch.ones_like(tokens), padding_side)
    if isinstance(data, str):
        data = [data]
    if not isinstance(data, (list, tuple)) or not all(isinstance(t, str) for t in data):
        raise ValueError("data must be a text, a list of texts, a token tensor [batch, pos], a TokenBatch or a "
                         f"PromptSet, got {type(data).__name__}")
    tok = model._need_tokenizer()
    return TokenBatch.from_ids([tok.encode(t) for t in data], getattr(tok, "pad_id", 0), padding_side, model.device)


def iter_batches(
    model,
    data: DataLike,
    batch_size: int = 32,
    padding_side: str = "left",
    progress: bool = False,
    desc: str = "batches",
    attention_mask: Optional[Tensor] = None,
) -> Iterator[PromptSetBatch]:
    """``data`` in batches of at most ``batch_size`` rows, each a ``PromptSetBatch`` on the
    model's device with ``rows`` (indices into ``data``) set; a tqdm bar over prompts when
    ``progress``. Texts are tokenized one batch at a time, so a large list never sits in
    memory as one padded tensor. ``attention_mask``: the mask of a token tensor ``data``."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    check_not_empty(data)
    total = n_rows(data)
    bar = tqdm(total=total, desc=desc, unit="prompt", disable=not progress)
    try:
        if isinstance(data, PromptSet):
            for batch in data.batches(model, batch_size=batch_size, padding_side=padding_side):
                yield batch
                bar.update(len(batch))
            return
        texts = [data] if isinstance(data, str) else data
        is_texts = isinstance(texts, (list, tuple)) and all(isinstance(t, str) for t in texts)
        if attention_mask is not None and is_texts:
            as_token_batch(model, data, padding_side, attention_mask)  # raises: texts carry no mask
        whole = None if is_texts else as_token_batch(model, data, padding_side, attention_mask)
        for start in range(0, total, batch_size):
            stop = min(start + batch_size, total)
            part = (as_token_batch(model, list(texts[start:stop]), padding_side) if is_texts
                    else TokenBatch(whole.tokens[start:stop], whole.attention_mask[start:stop], whole.padding_side))
            yield PromptSetBatch(part.tokens, part.attention_mask, part.padding_side,
                                 rows=torch.arange(start, stop, device=part.tokens.device))
            bar.update(stop - start)
    finally:
        bar.close()


def real_positions(mask: Tensor) -> Int[Tensor, "batch pos"]:
    """Each column's position within its own prompt (0 = the first real token); -1 at pads."""
    mask = mask.bool()
    return torch.where(mask, mask.long().cumsum(dim=1) - 1, torch.full_like(mask, -1, dtype=torch.long))


def select_rows(data: DataLike, rows: Optional[Sequence[int]]) -> DataLike:
    """The chosen rows of ``data`` (all of it when ``rows`` is None), of the same kind."""
    if rows is None:
        return data
    rows = [int(r) for r in rows]
    if isinstance(data, PromptSet):
        return data[rows]
    if isinstance(data, TokenBatch):
        return TokenBatch(data.tokens[rows], data.attention_mask[rows], data.padding_side)
    if isinstance(data, Tensor):
        return (data[None] if data.ndim == 1 else data)[rows]
    texts: Any = [data] if isinstance(data, str) else data
    return [texts[r] for r in rows]


def next_real_index(mask: Tensor) -> Int[Tensor, "batch pos"]:
    """The column of each real token's next real token in its row; -1 at the last real token and at pads."""
    mask = mask.bool()
    width = mask.shape[1]
    cols = torch.arange(width, device=mask.device).expand_as(mask)
    at_or_after = torch.where(mask, cols, torch.full_like(cols, width)).flip(1).cummin(dim=1).values.flip(1)
    after = torch.full_like(cols, width)
    after[:, :-1] = at_or_after[:, 1:]
    return torch.where(mask & (after < width), after, torch.full_like(cols, -1))


def previous_real_index(mask: Tensor) -> Int[Tensor, "batch pos"]:
    """The column of each real token's previous real token in its row; -1 at the first real token and at pads."""
    mask = mask.bool()
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    at_or_before = torch.where(mask, cols, torch.full_like(cols, -1)).cummax(dim=1).values
    before = torch.full_like(cols, -1)
    before[:, 1:] = at_or_before[:, :-1]
    return torch.where(mask, before, torch.full_like(cols, -1))


def row_columns(mask: Tensor, pos: int, rows: Optional[Tensor] = None) -> Int[Tensor, " batch"]:
    """The column holding position ``pos`` of each row's own prompt (negative: from the prompt's
    end, so -1 is its last real token, whatever the padding side). A prompt too short for
    ``pos`` is a ValueError naming it (``rows``: the rows' numbers in the data)."""
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)):
        raise ValueError(f"pos must be an integer position within each prompt (negative: from its end), got {pos!r}")
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    wanted = lengths + int(pos) if pos < 0 else torch.full_like(lengths, int(pos))
    bad = ((wanted < 0) | (wanted >= lengths)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        row = int(rows[i]) if rows is not None else i
        raise ValueError(f"pos={int(pos)} is outside prompt {row}, which has {int(lengths[i])} tokens: "
                         f"pos must lie in [-{int(lengths[i])}, {int(lengths[i]) - 1}] for every prompt")
    return (real_positions(mask) == wanted[:, None]).long().argmax(dim=1)


def real_cells(mask: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, column, position within the prompt) of every real token of a batch, row by row, as numpy arrays."""
    mask = mask.bool()
    rows, cols = (t.cpu().numpy() for t in mask.nonzero(as_tuple=True))
    return rows, cols, real_positions(mask).cpu().numpy()[rows, cols]


def with_meta(frame: pd.DataFrame, data: DataLike) -> pd.DataFrame:
    """``frame`` (with a ``prompt`` column numbering the rows of ``data``) plus, when ``data`` is a
    ``PromptSet``, its meta columns for each row's prompt (a meta column whose name the table
    already uses gets a ``meta_`` prefix)."""
    if not isinstance(data, PromptSet) or data.meta.shape[1] == 0:
        return frame
    meta = data.meta.rename(columns={c: f"meta_{c}" for c in data.meta.columns if c in frame.columns})
    picked = meta.iloc[frame["prompt"].to_numpy()].reset_index(drop=True)
    return pd.concat([frame.reset_index(drop=True), picked], axis=1)
