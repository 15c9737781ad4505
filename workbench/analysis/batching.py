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

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from workbench.data.prompts import PromptSet, PromptSetBatch
from workbench.padding import PADDING_SIDES, TokenBatch

DataLike = Union[str, Sequence[str], Tensor, TokenBatch, PromptSet]


def n_rows(data: DataLike) -> int:
    """How many prompts ``data`` holds."""
    if isinstance(data, str):
        return 1
    if isinstance(data, Tensor):
        return 1 if data.ndim == 1 else data.shape[0]
    return len(data)


def as_token_batch(model, data: Any, padding_side: str = "left") -> TokenBatch:
    """All of ``data`` (``DataLike``; anything else is a ValueError naming the kinds) as one ``TokenBatch`` on the model's device (a plain tensor gets a mask of
    ones; a ``TokenBatch`` keeps its own padding). For small data only: it is not streamed."""
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
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
) -> Iterator[PromptSetBatch]:
    """``data`` in batches of at most ``batch_size`` rows, each a ``PromptSetBatch`` on the
    model's device with ``rows`` (indices into ``data``) set; a tqdm bar over prompts when
    ``progress``. Texts are tokenized one batch at a time, so a large list never sits in
    memory as one padded tensor."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
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
        whole = None if is_texts else as_token_batch(model, data, padding_side)
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
