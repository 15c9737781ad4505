"""PromptSet: prompts with known answers, read from files or built from a task, batched with padding.

    ds = wb.PromptSet.from_csv("prompts.csv")         # columns prompt, answer, wrong (+ corrupted, + any others)
    ds = wb.PromptSet.from_jsonl(path)                 # one JSON object per line, same fields
    ds = wb.PromptSet.from_records([{...}, ...])       # or from_dataframe(df), or from_task(get_task("stories"))
    ds.clean, ds.corrupted, ds.answers, ds.wrong       # lists of strings (corrupted / answers / wrong may be None)
    ds.meta                                            # DataFrame of every other column, one row per prompt
    for batch in ds.batches(model, batch_size=32):     # PromptSetBatch, a TokenBatch: tokens + attention_mask,
        logits = model(batch)                          # answer / wrong ids [batch], rows (indices into ds),
        ...                                            # corrupted (a TokenBatch of the same width, or None)

Prompts may tokenize to different lengths: batches are padded (on the left by default, so
``logits[:, -1]`` scores every row's answer and ``generate`` takes the batch as it is), and
the model computes each row as its prompt alone. Rows are numbered from 0 as in ``ds.meta``.

Answers and wrong answers must be one token each; a row where one is not raises an error that
names the row and the field. Leading spaces: byte-level BPE tokenizers (GPT-2's, Llama's)
spell a word after a space as its own token (" Mary"), often different from "Mary" at the
start of a text. Answers are encoded exactly as written unless ``answer_space=True``, which
prepends a space to every answer that lacks one; the error for a multi-token answer says when
the spaced form would have been one token. Word and character tokenizers ignore the question.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.padding import PADDING_SIDES, TokenBatch

FIELDS = ("prompt", "answer", "wrong", "corrupted")


@dataclasses.dataclass
class PromptSetBatch(TokenBatch):
    """One batch of a ``PromptSet``: the padded clean prompts, plus which rows they are
    (``rows``, indices into the set), their answer and wrong-answer ids (None when the set
    has none), and the corrupted prompts padded to the same width on the same side."""

    rows: Optional[Int[Tensor, " batch"]] = None
    answer: Optional[Int[Tensor, " batch"]] = None
    wrong: Optional[Int[Tensor, " batch"]] = None
    corrupted: Optional[TokenBatch] = None


class PromptSet:
    """Prompts (and optionally corrupted prompts, answers, wrong answers) plus per-row metadata."""

    def __init__(
        self,
        prompts: Sequence[str],
        answers: Optional[Sequence[str]] = None,
        wrong: Optional[Sequence[str]] = None,
        corrupted: Optional[Sequence[str]] = None,
        meta: Optional[pd.DataFrame] = None,
    ):
        self.clean = _strings(prompts, "prompt", len(prompts))
        n = len(self.clean)
        if n == 0:
            raise ValueError("a PromptSet needs at least one prompt")
        self.answers = None if answers is None else _strings(answers, "answer", n)
        self.wrong = None if wrong is None else _strings(wrong, "wrong", n)
        self.corrupted = None if corrupted is None else _strings(corrupted, "corrupted", n)
        if meta is None:
            meta = pd.DataFrame(index=range(n))
        if len(meta) != n:
            raise ValueError(f"meta has {len(meta)} rows but there are {n} prompts")
        self.meta = meta.reset_index(drop=True)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_dataframe(cls, frame: pd.DataFrame, **columns: str) -> "PromptSet":
        """From a DataFrame with a ``prompt`` column and optional ``answer``, ``wrong``, ``corrupted``
        columns (other names via ``prompt="text"``, ...); every other column becomes ``meta``."""
        names = _column_names(columns)
        if names["prompt"] not in frame.columns:
            raise ValueError(f"no {names['prompt']!r} column: the columns are {list(frame.columns)}")
        frame = frame.reset_index(drop=True)
        get = lambda field: frame[names[field]].tolist() if names[field] in frame.columns else None  # noqa: E731
        meta = frame.drop(columns=[c for c in names.values() if c in frame.columns])
        return cls(get("prompt"), get("answer"), get("wrong"), get("corrupted"), meta)

    @classmethod
    def from_records(cls, records: Sequence[dict], **columns: str) -> "PromptSet":
        """From a list of dicts, one per prompt (keys as the columns of ``from_dataframe``)."""
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise ValueError(f"row {i}: expected a dict with a 'prompt' key, got {type(record).__name__}")
        return cls.from_dataframe(pd.DataFrame(list(records)), **columns)

    @classmethod
    def from_csv(cls, path: Union[str, Path], **columns: str) -> "PromptSet":
        """From a CSV file with a header row. Text fields are read verbatim (a leading space
        stays, "NA" is a word, an empty cell is an error); other columns get pandas' types."""
        names = _column_names(columns)
        try:
            frame = pd.read_csv(path)
            text = [c for c in names.values() if c in frame.columns]
            raw = pd.read_csv(path, dtype={c: str for c in text}, keep_default_na=False, usecols=text)
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a readable CSV of prompts ({type(e).__name__}: {e}); it needs a "
                             f"header row naming the columns ({', '.join(names.values())}) and one row per "
                             "prompt, as UTF-8 text") from None
        frame[text] = raw[text]
        return cls.from_dataframe(frame, **columns)

    @classmethod
    def from_jsonl(cls, path: Union[str, Path], **columns: str) -> "PromptSet":
        """From a JSON Lines file: one object per line (blank lines skipped)."""
        records = []
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
        return cls.from_records(records, **columns)

    @classmethod
    def from_task(cls, task: Any, n: int = 64, kind: str = "ioi", **options: Any) -> "PromptSet":
        """Known-answer prompts of a task: the stories task's ``"ioi"`` (corrupted = the ABC
        baseline) or ``"possession"`` prompts; ``options`` go to the task's prompt builder
        (``split``, ``templates``, ``seed``). Roles' positions land in ``meta`` as ``pos_<role>``."""
        builders = {"ioi": getattr(task, "ioi_prompts", None), "possession": getattr(task, "possession_prompts", None)}
        if kind not in builders:
            raise ValueError(f"kind must be one of {sorted(builders)}, got {kind!r}")
        if builders[kind] is None:
            raise ValueError(f"task {getattr(task, 'name', task)!r} has no {kind} prompts (the stories task has)")
        batch = builders[kind](n, **options)
        tok = task.tokenizer
        meta = pd.DataFrame({"template": batch.templates, **{f"pos_{k}": v.tolist() for k, v in batch.positions.items()}})
        return cls(
            prompts=list(batch.prompts),
            answers=[tok.token_str(i) for i in batch.correct.tolist()],
            wrong=[tok.token_str(i) for i in batch.wrong.tolist()],
            corrupted=[tok.decode(row) for row in batch.corrupted.tolist()],
            meta=meta,
        )

    # ---- access -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.clean)

    def __getitem__(self, index: Union[int, slice, Sequence[int]]) -> "PromptSet":
        """A PromptSet of the chosen rows, renumbered from 0."""
        rows = list(range(len(self))[index]) if isinstance(index, slice) else (
            [index] if isinstance(index, int) else [int(i) for i in index])
        pick = lambda values: None if values is None else [values[i] for i in rows]  # noqa: E731
        return PromptSet(pick(self.clean), pick(self.answers), pick(self.wrong), pick(self.corrupted),
                         self.meta.iloc[rows])

    def __repr__(self) -> str:
        fields = [f for f, v in zip(FIELDS, (self.clean, self.answers, self.wrong, self.corrupted)) if v is not None]
        return f"PromptSet({len(self)} prompts; fields {fields}; meta columns {list(self.meta.columns)})"

    def to_frame(self) -> pd.DataFrame:
        """Every field and the metadata as one DataFrame (what ``from_dataframe`` reads back)."""
        values = dict(zip(FIELDS, (self.clean, self.answers, self.wrong, self.corrupted)))
        return pd.concat([pd.DataFrame({k: v for k, v in values.items() if v is not None}), self.meta], axis=1)

    # ---- tokens -------------------------------------------------------------------------
    def answer_ids(self, tokenizer: Any, field: str = "answer", answer_space: bool = False) -> Int[Tensor, " n"]:
        """The id of every row's ``field`` ("answer" or "wrong"), each checked to be one known token."""
        if field not in ("answer", "wrong"):
            raise ValueError(f"field must be 'answer' or 'wrong', got {field!r}")
        values = self.answers if field == "answer" else self.wrong
        if values is None:
            raise ValueError(f"this PromptSet has no {field!r} field")
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a model carries its tokenizer
        return torch.tensor([_one_token(tokenizer, v, i, field, answer_space) for i, v in enumerate(values)])

    def batches(
        self,
        model: Any,
        batch_size: int = 32,
        padding_side: str = "left",
        answer_space: bool = False,
        sort_by_length: bool = False,
    ) -> Iterator[PromptSetBatch]:
        """Padded batches of ``batch_size`` rows, on the model's device (``model`` may be a bare
        tokenizer: the batches then stay on the CPU). Every answer is checked before the first
        batch. ``sort_by_length`` groups prompts of similar length (fewer pads, less compute);
        each batch's ``rows`` says which prompts it holds either way."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        tokenizer = getattr(model, "tokenizer", model)
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise ValueError("batches needs a model with a tokenizer attached (or a tokenizer)")
        device = getattr(model, "device", None) if hasattr(model, "tokenizer") else None
        clean = _encode_all(tokenizer, self.clean, "prompt")
        corrupted = None if self.corrupted is None else _encode_all(tokenizer, self.corrupted, "corrupted")
        answer = None if self.answers is None else self.answer_ids(tokenizer, "answer", answer_space)
        wrong = None if self.wrong is None else self.answer_ids(tokenizer, "wrong", answer_space)
        pad_id = getattr(tokenizer, "pad_id", 0)
        order = sorted(range(len(self)), key=lambda i: len(clean[i])) if sort_by_length else list(range(len(self)))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(ids[i]) for ids in (clean, corrupted) if ids is not None for i in rows)
            tokens = TokenBatch.from_ids([clean[i] for i in rows], pad_id, padding_side, device, width)
            index = torch.tensor(rows, device=device)
            yield PromptSetBatch(
                tokens.tokens, tokens.attention_mask, padding_side, rows=index,
                answer=None if answer is None else answer.to(device)[index],
                wrong=None if wrong is None else wrong.to(device)[index],
                corrupted=None if corrupted is None else TokenBatch.from_ids(
                    [corrupted[i] for i in rows], pad_id, padding_side, device, width),
            )


def _column_names(columns: dict) -> dict:
    unknown = set(columns) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}: the fields are {list(FIELDS)} (value: the column name)")
    return {field: columns.get(field, field) for field in FIELDS}


def _strings(values: Sequence[Any], field: str, n: int) -> list[str]:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"field {field!r} has {len(values)} values but there are {n} prompts")
    for i, v in enumerate(values):
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"row {i}: field {field!r} must be a non-empty string, got {v!r}")
    return values


def _encode_all(tokenizer: Any, texts: list[str], field: str) -> list[list[int]]:
    ids = [tokenizer.encode(t) for t in texts]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"row {i}: field {field!r} = {texts[i]!r} tokenizes to no tokens")
    return ids


def _one_token(tokenizer: Any, text: str, row: int, field: str, answer_space: bool) -> int:
    spaced = text if text.startswith(" ") else " " + text
    encode = getattr(tokenizer, "encode_piece", tokenizer.encode)  # no BOS: an answer is a piece of text
    ids = encode(spaced if answer_space else text)
    unknown = tokenizer.unknown_pieces(text) if hasattr(tokenizer, "unknown_pieces") else []
    if unknown:
        raise ValueError(f"row {row}: field {field!r} = {text!r} is not in the tokenizer's vocabulary ({unknown})")
    if len(ids) != 1:
        pieces = [tokenizer.token_str(i) for i in ids] if hasattr(tokenizer, "token_str") else ids
        hint = ""
        if not answer_space and len(encode(spaced)) == 1:
            hint = f"; with a leading space ({spaced!r}) it is one token: pass answer_space=True"
        raise ValueError(
            f"row {row}: field {field!r} = {text!r} is {len(ids)} tokens {pieces}, not one; "
            f"answers must be single tokens{hint}"
        )
    return int(ids[0])
