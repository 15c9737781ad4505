"""What a page scores: the position, the answer and its rival, and the metric (``Target``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import streamlit as st

from workbench.analysis import AnswerMetric, suggest_answer
from workbench.analysis.metrics import METRIC_UNITS
from ui.common.analyses import analysis
from ui.common.loading import Checkpoint


# ---- what a page scores ----------------------------------------------------------------------------
# The metric picker's choices: label -> AnswerMetric kind ("loss": the prompt's mean next-token loss).
METRICS = {
    "logit difference (answer − wrong)": "logit_diff",
    "answer probability": "prob",
    "answer log-probability": "logprob",
    "answer rank": "rank",
    "answer logit": "logit",
    "mean loss over the prompt": "loss",
}


@dataclass(frozen=True)
class Target:
    """What a page scores: the answer (and its rival) at one position, and the metric kind."""

    pos: int
    answer: int
    wrong: Optional[int]
    answer_str: str
    wrong_str: str
    kind: str = "logit_diff"

    def metric(self) -> Optional[AnswerMetric]:
        """The library metric (None for the prompt's mean loss, which the library uses by default)."""
        if self.kind == "loss":
            return None
        kind = self.kind if self.kind != "logit_diff" or self.wrong is not None else "logit"
        return AnswerMetric(kind, self.answer, self.wrong, self.pos)

    @property
    def units(self) -> str:
        return METRIC_UNITS[self.kind if self.kind != "logit_diff" or self.wrong is not None else "logit"]

    def describe(self) -> str:
        if self.kind == "loss":
            return "the prompt's mean loss"
        a, w = repr(self.answer_str), repr(self.wrong_str)
        what = {"logit_diff": f"logit[{a}] − logit[{w}]" if self.wrong is not None else f"logit[{a}]",
                "logit": f"logit[{a}]", "prob": f"p({a})", "logprob": f"log p({a})", "rank": f"rank of {a}"}
        return f"{what[self.kind]} at position {self.pos}"


def follow_default(key: str, default: Any, context: Any) -> None:
    """Set widget ``key`` to ``default`` whenever ``context`` (the prompt, the position) changes,
    or when the widget has no value yet: a default computed for one prompt never outlives it."""
    if key not in st.session_state or st.session_state.get(f"{key}__context") != context:
        st.session_state[key] = default
    st.session_state[f"{key}__context"] = context


def token_id(ckpt: Checkpoint, text: str, what: str) -> int:
    """The id of one token typed as text; ValueError naming ``what`` otherwise."""
    try:
        return ckpt.model.to_single_token(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def suggested(ckpt: Checkpoint, ids: tuple[int, ...], pos: int) -> dict:
    """``workbench.analysis.suggest_answer`` at position ``pos`` of prompt ``ids`` (cached)."""
    return analysis(suggest_answer, ckpt.key, ids, pos=pos, meta=ckpt.meta)


def default_target(ckpt: Checkpoint, ids: tuple[int, ...]) -> Optional[Target]:
    """What :func:`target_picker` returns before the user changes anything: the suggested answer and
    rival at the last position (None when a suggested token does not read back as one token)."""
    pos = len(ids) - 1
    suggestion = suggested(ckpt, ids, pos)
    try:
        answer = token_id(ckpt, suggestion["answer_str"], "Answer token")
        wrong_text = suggestion["wrong_str"]
        wrong = token_id(ckpt, wrong_text, "Wrong token") if wrong_text.strip() else None
    except ValueError:
        return None
    return Target(pos, answer, wrong, suggestion["answer_str"], wrong_text if wrong is not None else "")


def target_picker(ckpt: Checkpoint, ids: tuple[int, ...], key: str, where=st, kinds: bool = True,
                  kind_default: str = "logit_diff") -> Optional[Target]:
    """Position, answer, wrong token (and, with ``kinds``, the metric) for prompt ``ids``.

    The answer and wrong token default to ``workbench.analysis.suggest_answer`` (the task's
    answer for a task prompt, else the model's top two predictions) and follow the prompt
    and the position: a new prompt never keeps the last one's answer. None (with a message)
    when a typed token is not one token of this vocabulary.
    """
    tokens = [ckpt.tokenizer.token_str(i) for i in ids]
    cols = where.columns([2, 2, 2, 3] if kinds else [2, 2, 2])
    follow_default(f"{key}_pos", len(ids) - 1, ids)
    pos = cols[0].selectbox("At position", range(len(ids)), key=f"{key}_pos", persist_state="session",
                            format_func=lambda p: f"{p}: {tokens[p]!r}" + (" (last)" if p == len(ids) - 1 else ""))
    suggestion = suggested(ckpt, ids, pos)
    follow_default(f"{key}_answer", suggestion["answer_str"], (ids, pos))
    follow_default(f"{key}_wrong", suggestion["wrong_str"], (ids, pos))
    answer_text = cols[1].text_input("Answer token", key=f"{key}_answer", persist_state="session",
                                     help=f"Default: {suggestion['source']}.")
    wrong_text = cols[2].text_input("Wrong token (optional)", key=f"{key}_wrong", persist_state="session",
                                    help="The rival of the logit difference; empty: the answer's logit alone.")
    kind = kind_default
    if kinds:
        labels = list(METRICS)
        follow_default(f"{key}_kind", next(k for k, v in METRICS.items() if v == kind_default), None)
        kind = METRICS[cols[3].selectbox("Metric", labels, key=f"{key}_kind", persist_state="session")]
    try:
        answer = token_id(ckpt, answer_text, "Answer token")
        wrong = token_id(ckpt, wrong_text, "Wrong token") if wrong_text.strip() else None
    except ValueError as e:
        where.warning(str(e))
        return None
    where.caption(f"Scored at position {pos} ({tokens[pos]!r}, predicting the next token); default answer: "
                  f"{suggestion['source']}.")
    return Target(int(pos), answer, wrong, answer_text, wrong_text if wrong is not None else "", kind)
