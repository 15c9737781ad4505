"""What an intervention did to the answer: the metrics the field scores, and clean-minus-changed views.

A prompt's mean loss averages over every position, and never scores the last one (it has
no next token), which is where the answer to an IOI or induction prompt is decided:
ablating the heads that move the answer there leaves the mean loss unchanged. The
field's metrics read the logits at one position about an answer token instead
(Wang et al. 2022; Heimersheim & Nanda 2024): the logit difference between the answer
and a wrong token, the answer's probability, log-probability and rank.

``AnswerMetric`` is one of those as a frozen (hashable) callable ``logits -> scalar``,
accepted wherever a ``metric`` is (``ablation_sweep``, ``activation_patching``,
``attribution_patching``). ``answer_table`` lists them all for a run, ``answer_change``
sets two runs side by side, ``suggest_answer`` picks a sensible answer for a prompt
(the task's own answer when the prompt is one of its known-answer prompts, else the
model's top prediction), and ``lens_difference`` / ``dla_difference`` /
``pattern_difference`` give the clean-minus-changed view of a lens, a direct logit
attribution and the attention patterns.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.analysis.batching import DataLike, iter_batches, n_rows, real_positions, row_columns, with_meta
from workbench.analysis.common import as_tokens, check_choice, row_ids, str_tokens, vocab_labels
from workbench.data.prompts import PromptSet
from workbench.utils import check_index, check_int, check_token_ids

METRIC_KINDS = ("logit_diff", "logit", "prob", "logprob", "rank")
# What each kind is measured in, for axis and colour-bar titles.
METRIC_UNITS = {"logit_diff": "logits", "logit": "logits", "prob": "probability", "logprob": "nats",
                "rank": "rank (1 = top)", "loss": "nats"}
# Kinds whose value is higher when the model does better (rank: lower is better).
HIGHER_IS_BETTER = {"logit_diff": True, "logit": True, "prob": True, "logprob": True, "rank": False, "loss": False}
IdsLike = Union[int, np.integer, Sequence[int], Tensor]  # one id, or one per batch row


def _ids(name: str, value: Optional[IdsLike]) -> Union[None, int, tuple[int, ...]]:
    """One token id, or one per batch row (a tuple), checked for type and sign."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(check_token_ids(name, int(value), None))
    if isinstance(value, (list, tuple)) and value:
        return tuple(int(check_token_ids(name, int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                          else v, None)) for v in value)
    raise ValueError(f"{name} must be a token id or a non-empty sequence of ids (one per batch row), got {value!r}")


@dataclass(frozen=True)
class AnswerMetric:
    """A scalar read off the logits at position ``pos`` about the ``answer`` token.

    kind: ``logit_diff`` (logit[answer] - logit[wrong]; needs ``wrong``), ``logit``,
    ``prob``, ``logprob`` or ``rank`` (1 = the top token; not differentiable, so not for
    attribution patching). ``answer``/``wrong``: one id, or one per batch row (a task's
    prompts each have their own). ``pos``: the position scored (negative counts from
    the end; default the last). Calling it on logits ``[batch, pos, d_vocab]`` gives the
    batch mean; ``per_row`` gives one value per row. Frozen and hashable, so it can key
    a cache; ids are stored as ints or tuples of ints.
    """

    kind: str = "logit_diff"
    answer: IdsLike = 0
    wrong: Optional[IdsLike] = None
    pos: int = -1

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, METRIC_KINDS)
        object.__setattr__(self, "answer", _ids("answer", self.answer))
        object.__setattr__(self, "wrong", _ids("wrong", self.wrong))
        object.__setattr__(self, "pos", check_int("pos", self.pos))
        if self.kind == "logit_diff" and self.wrong is None:
            raise ValueError("kind='logit_diff' needs wrong=a token id (the answer's rival)")

    @property
    def units(self) -> str:
        return METRIC_UNITS[self.kind]

    @property
    def differentiable(self) -> bool:
        return self.kind != "rank"

    def _column(self, name: str, value, logits: Tensor) -> Tensor:
        batch, d_vocab = logits.shape[0], logits.shape[-1]
        ids = torch.as_tensor(value if isinstance(value, tuple) else [value], device=logits.device)
        check_token_ids(name, ids, d_vocab)
        if ids.numel() == 1:
            return ids.expand(batch)
        if ids.numel() != batch:
            raise ValueError(f"{name} has {ids.numel()} ids, one per batch row, but the logits have {batch} rows")
        return ids

    def per_row(self, logits: Float[Tensor, "batch pos d_vocab"]) -> Float[Tensor, " batch"]:
        n_pos = logits.shape[1]
        at = logits[:, check_index("pos", self.pos, n_pos, negative=True, of=f"{n_pos} positions")]
        rows = torch.arange(at.shape[0], device=at.device)
        answer = self._column("answer", self.answer, at)
        picked = at[rows, answer]
        if self.kind == "logit_diff":
            return picked - at[rows, self._column("wrong", self.wrong, at)]
        if self.kind == "logit":
            return picked
        if self.kind == "rank":
            return ((at > picked[:, None]).sum(-1) + 1).to(at.dtype)
        logp = at.float().log_softmax(-1)[rows, answer]
        return logp.exp() if self.kind == "prob" else logp

    def __call__(self, logits: Float[Tensor, "batch pos d_vocab"]) -> Tensor:
        return self.per_row(logits).mean()

    def describe(self, model) -> str:
        """``logit['Mary'] − logit['John'] at position -1`` (token names from the model's tokenizer)."""
        def name(value) -> str:
            if isinstance(value, tuple):
                return "answer" if value is self.answer else "wrong"
            return repr(str_tokens(model, [value])[0])

        answer = name(self.answer)
        what = {"logit_diff": f"logit[{answer}] − logit[{name(self.wrong)}]", "logit": f"logit[{answer}]",
                "prob": f"p({answer})", "logprob": f"log p({answer})", "rank": f"rank of {answer}"}[self.kind]
        return f"{what} at position {self.pos}"


@torch.no_grad()
def answer_table(
    model,
    data: DataLike,
    answer: Optional[IdsLike] = None,
    wrong: Optional[IdsLike] = None,
    pos: int = -1,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """Every answer metric at position ``pos`` of each prompt: one row per prompt.

    ``pos`` counts within each prompt (negative: from its end; the default -1 is its last
    real token, whatever the padding). ``data``: a text, texts of any lengths, token ids, a
    ``TokenBatch`` or a ``PromptSet``, run in batches of ``batch_size``. ``answer`` /
    ``wrong``: one id for every prompt, or one per prompt; without ``answer`` a PromptSet's
    own answer and wrong columns are used.

    Columns: batch, pos (the scored position within the prompt), answer, wrong (token
    strings; "" without a wrong token), logit, wrong_logit, logit_diff (NaN without one),
    prob, logprob, rank (1 = top), top (the top token), top_prob, prompt (= batch: the row
    of ``data``) and a PromptSet's meta columns.
    """
    n = n_rows(data)
    from_set = answer is None
    if from_set and not (isinstance(data, PromptSet) and data.answers is not None):
        raise ValueError("answer is needed: a token id or one id per prompt (or give a PromptSet with an 'answer' "
                         "column)")
    answer, wrong = _ids("answer", answer), _ids("wrong", wrong)
    labels = vocab_labels(model)
    frames = []
    for batch in iter_batches(model, data, batch_size, padding_side, progress, "answer table", attention_mask):
        rows = torch.arange(len(batch), device=batch.tokens.device)
        cols = row_columns(batch.attention_mask, pos, batch.rows)
        at = model(batch)[rows, cols].float()[:, None]  # [batch, 1, d_vocab]: each prompt's scored position
        answer_ids = _batch_ids(model, "answer", answer, batch, n)
        wrong_ids = _batch_ids(model, "wrong", wrong, batch, n) if (wrong is not None or from_set) else None
        values = {kind: AnswerMetric(kind, tuple(answer_ids.tolist()), None, -1).per_row(at).cpu().numpy()
                  for kind in ("logit", "prob", "logprob", "rank")}
        top_p, top_i = at[:, 0].softmax(-1).max(-1)
        frame = pd.DataFrame({
            "batch": batch.rows.cpu().numpy(),
            "pos": real_positions(batch.attention_mask)[rows, cols].cpu().numpy(),
            "answer": labels[answer_ids.cpu().numpy()],
            "wrong": "" if wrong_ids is None else labels[wrong_ids.cpu().numpy()],
            "logit": values["logit"],
        })
        if wrong_ids is not None:
            frame["wrong_logit"] = at[rows, 0, wrong_ids].cpu().numpy()
            frame["logit_diff"] = frame["logit"] - frame["wrong_logit"]
        else:
            frame["wrong_logit"], frame["logit_diff"] = np.nan, np.nan
        for kind in ("prob", "logprob", "rank"):
            frame[kind] = values[kind]
        frame["rank"] = frame["rank"].astype(int)
        frame["top"] = labels[top_i.cpu().numpy()]
        frame["top_prob"] = top_p.cpu().numpy()
        frame["prompt"] = frame["batch"]
        frames.append(frame)
    return with_meta(pd.concat(frames, ignore_index=True), data)


def _batch_ids(model, name: str, value, batch, n: int) -> Optional[Tensor]:
    """``value`` (one id, one per prompt of the data, or None: the PromptSet's own) for the rows of ``batch``."""
    if isinstance(value, tuple):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} ids, one per batch row, but the data has {n} prompts")
        value = torch.tensor(value)
    return row_ids(model, name, value, batch, n)


@torch.no_grad()
def logit_diff(
    model,
    data: DataLike,
    batch_size: int = 64,
    progress: bool = False,
    answer: Optional[IdsLike] = None,
    wrong: Optional[IdsLike] = None,
    pos: int = -1,
    padding_side: str = "left",
) -> pd.DataFrame:
    """logit[answer] - logit[wrong] at each prompt's last real token (or position ``pos``
    within it): one row per prompt, batch by batch (a tqdm bar with ``progress``).

    ``data`` is usually a ``PromptSet`` with answer and wrong columns (its rows' own tokens
    are used); ``answer``/``wrong`` override them (one id, or one per prompt). Columns:
    prompt, pos, answer, wrong, logit_diff, then the PromptSet's meta columns.
    """
    if wrong is None and not (isinstance(data, PromptSet) and data.wrong is not None and answer is None):
        raise ValueError("logit_diff needs wrong tokens: a PromptSet with 'answer' and 'wrong' columns, "
                         "or answer= and wrong= token ids")
    table = answer_table(model, data, answer, wrong, pos, batch_size, progress, padding_side)
    core = ["prompt", "pos", "answer", "wrong", "logit_diff"]
    meta = [c for c in table.columns if c not in ANSWER_TABLE_COLUMNS]
    return table[core + meta]


ANSWER_TABLE_COLUMNS = ("batch", "pos", "answer", "wrong", "logit", "wrong_logit", "logit_diff", "prob", "logprob",
                        "rank", "top", "top_prob", "prompt")


ANSWER_MEASURES = ("logit_diff", "logit", "prob", "logprob", "rank")


def answer_change(clean: pd.DataFrame, changed: pd.DataFrame) -> pd.DataFrame:
    """Two ``answer_table`` tables (e.g. clean and ablated), averaged over the batch.

    One row per measure (logit_diff, logit, prob, logprob, rank; logit_diff only when the
    tables have a wrong token): measure, units, clean, changed, difference (= clean -
    changed: how much of the measure the change took away).
    """
    for name, frame in (("clean", clean), ("changed", changed)):
        missing = {"batch", *ANSWER_MEASURES} - set(frame.columns)
        if missing:
            raise ValueError(f"{name} is not an answer_table: it lacks {sorted(missing)}")
    if len(clean) != len(changed):
        raise ValueError(f"clean has {len(clean)} rows and changed {len(changed)}: they must be the same prompts")
    rows = []
    for measure in ANSWER_MEASURES:
        if clean[measure].isna().all():
            continue
        a, b = float(clean[measure].mean()), float(changed[measure].mean())
        rows.append({"measure": measure, "units": METRIC_UNITS[measure], "clean": a, "changed": b, "difference": a - b})
    return pd.DataFrame(rows)


# ---- a sensible answer for a prompt --------------------------------------------------------
def _ioi_names(words: list[str], names: set[str]) -> Optional[tuple[str, str]]:
    """(indirect object, subject) of an IOI sentence: the last sentence ends with 'to', names two
    people, one once and one twice (the subject repeats); None for anything else."""
    if not words or words[-1].strip() != "to":
        return None
    start = max((i for i, w in enumerate(words) if w.strip() in (".", "\\n", "\n", "")), default=-1) + 1
    sentence = [w.strip() for w in words[start:]]
    counts = {n: sentence.count(n) for n in dict.fromkeys(w for w in sentence if w in names)}
    if len(counts) != 2 or sorted(counts.values()) != [1, 2]:
        return None
    once, twice = sorted(counts, key=counts.get)
    return once, twice


def task_answer(model, meta: Any, ids: Sequence[int]) -> Optional[tuple[int, int, str]]:
    """The answer the checkpoint's task defines for prompt ``ids``: (answer, wrong, why), or None.

    stories: an IOI sentence (``... Mary and John went to the store , John gave a drink to``)
    -> the indirect object (Mary) against the subject (John). induction: a prompt whose
    last token occurred before -> the token that followed it then, against the model's
    best other guess. Other tasks, and prompts that are not of these shapes, give None.
    """
    from workbench.analysis.reference import task_from_meta

    ids = [int(i) for i in ids]
    try:
        task = task_from_meta(meta)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if getattr(task, "name", None) == "stories" and getattr(model, "tokenizer", None) is not None:
        from workbench.data.stories import NAMES

        found = _ioi_tokens(model, ids, set(NAMES))
        if found is None:
            return None
        io, s, labels = found
        return io, s, f"the task's answer: the indirect object {labels[0]!r} against the subject {labels[1]!r}"
    if getattr(task, "name", None) == "induction" and len(ids) >= 2:
        last = ids[-1]
        earlier = [i for i in range(len(ids) - 1) if ids[i] == last]
        if not earlier:
            return None
        answer = ids[earlier[-1] + 1]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.device))[0, -1].float()
        logits[answer] = -float("inf")
        return answer, int(logits.argmax()), "the task's answer: the token that followed this one last time"
    return None


def ioi_answer(model, ids: Sequence[int]) -> Optional[tuple[int, int, str]]:
    """The answer of an IOI sentence in any model's own tokens: (indirect object, subject, why), or None.

    For a model whose checkpoint names no task (a pretrained model): the last sentence ends with
    "to" and names two people of the IOI name lists, one once and one twice. Each name is scored as
    the token it would be after "to": with a leading space when the tokenizer has that single token
    (``" Mary"`` in byte-level BPE), else as it is written in the prompt. None when a name is not one
    token, or the prompt is not of that shape."""
    if getattr(model, "tokenizer", None) is None:
        return None
    from workbench.analysis.circuits.ioi import IOI_NAMES
    from workbench.data.stories import NAMES

    found = _ioi_tokens(model, ids, set(IOI_NAMES) | set(NAMES))
    if found is None:
        return None
    io, s, labels = found
    return io, s, f"an IOI sentence: the indirect object {labels[0]!r} against the subject {labels[1]!r}"


def _ioi_tokens(model, ids: Sequence[int], names: set[str]) -> Optional[tuple[int, int, list[str]]]:
    """(indirect object, subject, their labels) of the IOI sentence ``ids`` over ``names``, each as the token
    it would be after "to": the spaced name when the tokenizer has it as one token, else the name's token
    as written in the prompt; None when ``ids`` is not such a sentence."""
    ids = [int(i) for i in ids]
    words = str_tokens(model, ids)
    found = _ioi_names(words, names)
    if found is None:
        return None
    picked = []
    for name in found:
        written = ids[max(i for i, w in enumerate(words) if w.strip() == name)]  # its last token in the prompt
        spaced = model.tokenizer.encode(" " + name)
        picked.append(spaced[0] if len(spaced) == 1 else written)
    return picked[0], picked[1], str_tokens(model, picked)


@torch.no_grad()
def suggest_answer(model, tokens: Union[str, Int[Tensor, "batch pos"]], pos: int = -1,
                   meta: Any = None) -> dict:
    """A default answer and rival for scoring position ``pos`` of a single prompt.

    At the last position of a task prompt, the task's answer (``task_answer``); at the last
    position of an IOI sentence, the indirect object against the subject (``ioi_answer``: a
    pretrained model's IOI prompt, which names no task); otherwise the model's own top prediction
    against its second. Returns a dict: answer, wrong (token ids), answer_str, wrong_str, source
    (one line saying where they came from).
    """
    tokens = as_tokens(model, tokens)
    if tokens.shape[0] != 1:
        raise ValueError(f"suggest_answer takes one prompt, got a batch of {tokens.shape[0]}")
    n_pos = tokens.shape[1]
    pos = check_index("pos", pos, n_pos, negative=True, of=f"a prompt of {n_pos} tokens")
    found = None
    if pos == n_pos - 1:
        found = task_answer(model, meta, tokens[0].tolist()) or ioi_answer(model, tokens[0].tolist())
    if found is not None:
        answer, wrong, source = found
    else:
        top = model(tokens[:, : pos + 1])[0, -1].float().topk(2).indices.tolist()
        answer, wrong, source = top[0], top[1], "the model's top prediction against its second"
    labels = str_tokens(model, [answer, wrong])
    return {"answer": int(answer), "wrong": int(wrong), "answer_str": labels[0], "wrong_str": labels[1],
            "source": source}


# ---- clean minus changed -----------------------------------------------------------------
def _merge(clean: pd.DataFrame, changed: pd.DataFrame, keys: list[str], what: str) -> pd.DataFrame:
    for name, frame in (("clean", clean), ("changed", changed)):
        missing = set(keys) - set(frame.columns)
        if missing:
            raise ValueError(f"{name} is not a {what} table: it lacks {sorted(missing)}")
    merged = clean.merge(changed, on=keys, suffixes=("_clean", "_changed"), how="inner", validate="one_to_one")
    if len(merged) != len(clean) or len(merged) != len(changed):
        raise ValueError(f"clean and changed {what} tables do not cover the same rows "
                         f"({len(clean)} and {len(changed)} rows, {len(merged)} in common)")
    return merged


LENS_VALUES = ("target_prob", "top1_prob", "kl_to_final", "entropy")


def lens_difference(clean: pd.DataFrame, changed: pd.DataFrame, value: str = "target_prob") -> pd.DataFrame:
    """Two lens tables (``logit_lens``/``tuned_lens``) of the same prompt, cell by cell.

    One row per (batch, layer, pos): layer_label, token, the lens' top token in each run
    (top1_clean, top1_changed), ``value`` in each run (clean, changed) and difference
    (= clean - changed).
    """
    check_choice("value", value, LENS_VALUES)
    merged = _merge(clean, changed, ["batch", "layer", "pos"], "lens")
    return pd.DataFrame({
        "batch": merged["batch"], "layer": merged["layer"], "layer_label": merged["layer_label_clean"],
        "pos": merged["pos"], "token": merged["token_clean"], "value": value,
        "top1_clean": merged["top1_clean"], "top1_changed": merged["top1_changed"],
        "clean": merged[f"{value}_clean"], "changed": merged[f"{value}_changed"],
        "difference": merged[f"{value}_clean"] - merged[f"{value}_changed"],
    })


def dla_difference(clean: pd.DataFrame, changed: pd.DataFrame) -> pd.DataFrame:
    """Two ``direct_logit_attribution`` tables, component by component.

    Columns: batch, granularity, component, kind, layer, head, clean, changed, difference
    (= clean - changed attribution), and total_clean / total_changed (each run's logit value).
    """
    keys = ["batch", "granularity", "component"]
    merged = _merge(clean, changed, keys, "direct logit attribution")
    out = merged[keys].copy()
    for column in ("kind", "layer", "head"):
        out[column] = merged[f"{column}_clean"]
    out["clean"], out["changed"] = merged["attribution_clean"], merged["attribution_changed"]
    out["difference"] = out["clean"] - out["changed"]
    out["total_clean"], out["total_changed"] = merged["total_clean"], merged["total_changed"]
    return out


def pattern_difference(clean: pd.DataFrame, changed: pd.DataFrame) -> pd.DataFrame:
    """Two ``attention_patterns`` tables: the same rows with ``attention`` = clean - changed
    (and attention_clean, attention_changed), so the pattern figures can draw the difference."""
    keys = ["batch", "layer", "head", "query_pos", "key_pos"]
    merged = _merge(clean, changed, keys, "attention pattern")
    out = clean.copy()
    ordered = clean[keys].merge(merged, on=keys, how="left")
    out["attention_clean"] = ordered["attention_clean"].to_numpy()
    out["attention_changed"] = ordered["attention_changed"].to_numpy()
    out["attention"] = out["attention_clean"] - out["attention_changed"]
    return out
