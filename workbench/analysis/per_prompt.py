"""What the interventions (ablation, patching) share over a dataset: scores per prompt, positions
aligned per row, clean/corrupted pairs in batches, and activations in real-position space.

A padded row holds its prompt somewhere among pads (left or right), so "position 3" and "the
last position" are different columns in different rows. Everything here works in each
prompt's own coordinates instead: real position ``k`` is the prompt's ``k``-th real token
(0 = the first), ``-1`` its last. An intervention computed this way gives, for every row,
what the prompt gives run alone, whatever the padding side and the batch size.

Scoring (``PromptScorer``): one value per prompt, then the mean over prompts, so a long prompt
counts as much as a short one. ``metric`` may be

- None: the logit difference answer - wrong at each prompt's last real token when the data
  has answers (a ``PromptSet``; without wrong answers, the answer's logit), else the prompt's
  mean next-token loss over its real tokens;
- an ``AnswerMetric``: scored at its ``pos`` counted within each prompt (negative: from the
  prompt's end), with one answer id, or one per row of the data (a tuple as long as the data);
- any other callable ``logits -> scalar``: applied to each prompt's own logits ``[1, n_real,
  d_vocab]``, pads dropped, as if the prompt ran alone. Only with a plain token tensor (or one
  text) as data is it called once on the whole batch's logits, as before datasets existed
  (then the table has one "prompt": the batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from workbench.analysis.batching import DataLike, as_token_batch, iter_batches, n_rows
from workbench.data.prompts import PromptSet, PromptSetBatch
from workbench.padding import TokenBatch

END = "END"  # the named position of each row's last real token
Position = Union[int, str]


def is_whole_batch(metric: Any, data: DataLike) -> bool:
    """A plain metric of the whole batch's logits on a plain token tensor or text: the old contract."""
    from workbench.analysis.metrics import AnswerMetric

    return metric is not None and not isinstance(metric, AnswerMetric) and isinstance(data, (Tensor, str))


def column_of(mask: Bool[Tensor, "batch pos"], k: Int[Tensor, " batch"]) -> Int[Tensor, " batch"]:
    """The column of each row's real position ``k`` (0 = its first real token); ``k`` must exist."""
    order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)  # real columns first, in order
    return order.gather(1, k.long().to(mask.device)[:, None])[:, 0]


def to_start(x: Tensor, mask: Bool[Tensor, "batch pos"]) -> Tensor:
    """``x`` [batch, pos, ...] with each row's real tokens moved to the front (in order): index ``k``
    is then real position ``k`` in every row; what lies past a row's length means nothing."""
    order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)
    return x.gather(1, order.view(order.shape + (1,) * (x.ndim - 2)).expand_as(x))


def to_end(x: Tensor, mask: Bool[Tensor, "batch pos"]) -> Tensor:
    """``x`` with each row's real tokens moved to the end: index ``-1`` is every row's last real token."""
    order = torch.argsort(mask.bool().to(torch.int8), dim=1, stable=True)  # pads first, then the real columns
    return x.gather(1, order.view(order.shape + (1,) * (x.ndim - 2)).expand_as(x))


class PromptScorer:
    """``metric`` over ``data``: ``scores(logits, batch)`` gives one value per prompt of the batch
    (a differentiable tensor), ``n`` is how many prompts there are (1 in whole-batch mode)."""

    def __init__(self, model, metric: Any, data: DataLike):
        from workbench.analysis.metrics import AnswerMetric

        self.model, self.metric = model, metric
        self.whole = is_whole_batch(metric, data)
        self.n = 1 if self.whole else n_rows(data)
        self.answer_metric = isinstance(metric, AnswerMetric)
        if self.answer_metric:
            for name in ("answer", "wrong"):
                ids = getattr(metric, name)
                if isinstance(ids, tuple) and len(ids) not in (1, self.n):
                    raise ValueError(f"metric.{name} has {len(ids)} ids: give one, or one per prompt ({self.n})")

    def rows(self, batch: PromptSetBatch) -> np.ndarray:
        """Which prompts (indices into the data) the batch's scores belong to."""
        return np.zeros(1, dtype=np.int64) if self.whole else batch.rows.cpu().numpy()

    def scores(self, logits: Tensor, batch: TokenBatch) -> Tensor:
        if self.whole:
            return self.metric(logits).reshape(1)
        mask = batch.attention_mask.bool()
        if self.metric is None:
            return self._default(logits, batch, mask)
        if self.answer_metric:
            return self._answer(logits, batch, mask)
        values = [self.metric(logits[i][mask[i]][None]) for i in range(len(batch))]
        for i, v in enumerate(values):
            if v.numel() != 1:
                raise ValueError(f"the metric gave {v.numel()} values for prompt {int(batch.rows[i])}: "
                                 "it must map one prompt's logits [1, pos, d_vocab] to a scalar")
        return torch.stack([v.reshape(()) for v in values])

    def _default(self, logits: Tensor, batch: TokenBatch, mask: Tensor) -> Tensor:
        answer = getattr(batch, "answer", None)
        if answer is not None:
            last = to_end(logits, mask)[:, -1]
            picked = last.gather(1, answer[:, None].to(last.device))[:, 0]
            wrong = getattr(batch, "wrong", None)
            return picked if wrong is None else picked - last.gather(1, wrong[:, None].to(last.device))[:, 0]
        short = (mask.sum(1) < 2).nonzero().flatten()
        if len(short):
            raise ValueError(f"prompt {int(batch.rows[int(short[0])])} has one token: the default metric (mean "
                             "next-token loss) needs at least 2; give answers (a PromptSet) or a metric")
        losses = self.model.loss_fn(logits, batch.tokens, per_token=True, attention_mask=mask)
        counted = (mask[:, 1:] & mask[:, :-1]).to(losses.dtype)
        return losses.sum(1) / counted.sum(1)

    def _answer(self, logits: Tensor, batch: TokenBatch, mask: Tensor) -> Tensor:
        metric, lengths = self.metric, mask.sum(1)
        need = -metric.pos if metric.pos < 0 else metric.pos + 1
        short = (lengths < need).nonzero().flatten()
        if len(short):
            i = int(short[0])
            raise ValueError(f"prompt {int(batch.rows[i])} has {int(lengths[i])} tokens: metric position "
                             f"pos={metric.pos} does not exist in it")
        aligned = to_end(logits, mask) if metric.pos < 0 else to_start(logits, mask)
        rows = batch.rows.cpu()

        def ids(value):
            if isinstance(value, tuple) and len(value) == self.n and self.n > 1:
                return tuple(value[int(r)] for r in rows)
            return value

        per_batch = dataclasses.replace(metric, answer=ids(metric.answer), wrong=ids(metric.wrong))
        return per_batch.per_row(aligned)


def iter_pairs(
    model,
    clean: DataLike,
    corrupted: Optional[DataLike],
    batch_size: int,
    padding_side: str = "left",
    progress: bool = False,
    desc: str = "pairs",
) -> Iterator[PromptSetBatch]:
    """Batches of clean prompts with their corrupted partners in ``batch.corrupted`` (each
    padded on its own: the two may tokenize to different lengths). ``corrupted`` None takes
    the corrupted prompts of a ``PromptSet``."""
    if corrupted is None:
        if not isinstance(clean, PromptSet) or clean.corrupted is None:
            raise ValueError("corrupted_tokens is missing: pass corrupted prompts, or a PromptSet with a "
                             "'corrupted' column as the clean data")
        yield from iter_batches(model, clean, batch_size, padding_side, progress, desc)
        return
    if n_rows(clean) != n_rows(corrupted):
        raise ValueError(f"clean has {n_rows(clean)} prompts but corrupted has {n_rows(corrupted)}: "
                         "one corrupted prompt per clean one")
    others = iter_batches(model, corrupted, batch_size, padding_side)
    for batch, other in zip(iter_batches(model, clean, batch_size, padding_side, progress, desc), others):
        yield dataclasses.replace(batch, corrupted=TokenBatch(other.tokens, other.attention_mask, other.padding_side))


def data_lengths(model, data: DataLike) -> list[int]:
    """Real tokens of every prompt of ``data`` (tokenized, not run)."""
    if isinstance(data, PromptSet):
        tok = model._need_tokenizer()
        return [len(tok.encode(t)) for t in data.clean]
    if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
        tok = model._need_tokenizer()
        return [len(tok.encode(t)) for t in data]
    return as_token_batch(model, data).lengths.tolist()


def pair_lengths(model, clean: DataLike, corrupted: Optional[DataLike]) -> tuple[list[int], list[int]]:
    """Lengths of the clean and the corrupted prompts of every pair."""
    other = corrupted if corrupted is not None else (clean.corrupted if isinstance(clean, PromptSet) else None)
    if other is None:
        raise ValueError("corrupted_tokens is missing: pass corrupted prompts, or a PromptSet with a 'corrupted' column")
    return data_lengths(model, clean), data_lengths(model, other)


def default_positions(clean_lengths: Sequence[int], corrupted_lengths: Sequence[int]) -> list[int]:
    """Every position when all prompts are equally long (0 .. n-1), else the positions from the
    end that every prompt has (-m .. -1, m = the shortest prompt)."""
    lengths = set(clean_lengths) | set(corrupted_lengths)
    if len(lengths) == 1:
        return list(range(lengths.pop()))
    return list(range(-min(lengths), 0))


def check_position_names(positions: Sequence[Position], data: DataLike) -> None:
    """Named positions need ``pos_<NAME>`` columns in a PromptSet's meta (``END`` needs none)."""
    names = [p for p in positions if isinstance(p, str) and p != END]
    if not names:
        return
    if not isinstance(data, PromptSet):
        raise ValueError(f"named positions {names} need a PromptSet whose meta has pos_<NAME> columns "
                         f"(like PromptSet.from_task's pos_IO, pos_S2); only {END!r} works on other data")
    missing = [n for n in names if f"pos_{n}" not in data.meta.columns]
    if missing:
        have = [c[4:] for c in data.meta.columns if c.startswith("pos_")] + [END]
        raise ValueError(f"position {missing[0]!r} has no 'pos_{missing[0]}' column in the PromptSet's meta; "
                         f"the named positions are {have}")


def check_positions_arg(positions: Any) -> Optional[list[Position]]:
    if positions is None:
        return None
    if isinstance(positions, (int, str)):
        positions = [positions]
    out = []
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, (int, str)) and not hasattr(p, "__index__"):
            raise ValueError(f"positions must be ints (negative: from each prompt's end) or names (IO, S2, END), "
                             f"got {p!r}")
        out.append(p if isinstance(p, str) else int(p))
    if not out:
        raise ValueError("positions is empty: give at least one position")
    return out


def aligned_columns(
    position: Position,
    mask: Bool[Tensor, "batch pos"],
    rows: Tensor,
    meta: Optional[pd.DataFrame],
    which: str,
    same_length: Optional[Tensor] = None,
) -> Int[Tensor, " batch"]:
    """The column, in each row of a batch, of ``position`` (an int: real position, negative from the
    row's end; ``END``: the last real token; another name: the PromptSet's ``pos_<NAME>``, in the
    clean prompt; the corrupted prompt reads ``corrupted_pos_<NAME>`` when there is such a column,
    else the clean one's, which needs the pair to be equally long). A position a row does not have
    is a ValueError naming the row."""
    mask = mask.bool()
    lengths = mask.sum(1).cpu()
    if position == END:
        k = lengths - 1
    elif isinstance(position, str):
        column = f"pos_{position}"
        if which == "corrupted" and f"corrupted_pos_{position}" in meta.columns:
            column = f"corrupted_pos_{position}"
        elif which == "corrupted" and same_length is not None and not bool(same_length.all()):
            row = int(rows[int((~same_length).nonzero()[0])])
            raise ValueError(f"row {row}: its clean and corrupted prompts differ in length, so position "
                             f"{position!r} (pos_{position}, counted in the clean prompt) cannot be carried over: "
                             f"add a 'corrupted_pos_{position}' column")
        k = torch.tensor([int(meta[column].iloc[int(r)]) for r in rows.tolist()])
    else:
        k = torch.full_like(lengths, int(position)) + (lengths if position < 0 else 0)
    bad = ((k < 0) | (k >= lengths)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"row {int(rows[i])}: position {position!r} does not exist in its {which} prompt "
                         f"({int(lengths[i])} tokens)")
    return column_of(mask, k)


def meta_of(data: DataLike) -> Optional[pd.DataFrame]:
    return data.meta if isinstance(data, PromptSet) else None


def with_meta(frame: pd.DataFrame, data: DataLike) -> pd.DataFrame:
    """A per-prompt table with the PromptSet's meta columns joined on ``prompt``."""
    meta = meta_of(data)
    if meta is None or meta.empty or not len(meta.columns):
        return frame
    meta = meta.drop(columns=[c for c in meta.columns if c in frame.columns]).reset_index(drop=True)
    return frame.merge(meta, left_on="prompt", right_index=True, how="left")
