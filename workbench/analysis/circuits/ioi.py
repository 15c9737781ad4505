"""Indirect object identification (Wang et al. 2022) for any tokenizer: prompts, corruptions, metric.

    prompts = ioi_prompts(model, n=32, seed=0)        # templates x single-token names, one length
    clean, corrupted = prompts.tokens()               # ABC: the second S replaced by a third name
    metric = prompts.metric()                         # mean logit(IO) - logit(S) at the last token
    prompts.positions["S2"]                           # per row: where the second S stands
    mean = mean_ablation_runner(EdgeRunner(model, prompts.tokens()), prompts.template)

A prompt is a template with two names, the indirect object (IO) and the subject (S), where S
appears twice: ``"Then, Mary and John went to the store. John gave a drink to"`` (ABBA: IO first)
or ``"Then, John and Mary ... John gave a drink to"`` (BABA); the answer is IO. Its corrupted
twin replaces the second S by a third name C (``"... Emma gave a drink to"``), so nothing tells
IO from S any more: the ABC corruption. Names are kept only when the tokenizer makes each one
token with its leading space (`` Mary``), and every template must give prompts of one token
length, so the positions (IO, S1, S1+1, S2, END) are per row but every row has the same length:
the edge machinery (``EdgeRunner``) needs one shape.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from workbench.analysis.metrics import AnswerMetric
from workbench.utils import check_int

# Templates in the style of Wang et al. 2022 (BABA/ABBA by the order of {A} and {B}); each is 15
# tokens under SmolLM2's tokenizer with single-token names.
IOI_TEMPLATES = (
    "Then, {A} and {B} went to the store. {S} gave a drink to",
    "Then, {A} and {B} went to the park. {S} gave a ball to",
    "Then, {A} and {B} had a long argument, and afterwards {S} said to",
    "While {A} and {B} were working at the office, {S} gave a report to",
    "While {A} and {B} were commuting to the school, {S} gave a book to",
)
# Common English first names; ``single_token_names`` keeps those a tokenizer makes one token.
IOI_NAMES = (
    "Mary", "John", "Alice", "Bob", "Tom", "James", "Sarah", "Anna", "David", "Michael", "Emma", "Lisa",
    "Paul", "Mark", "Kate", "Jack", "Laura", "Peter", "Susan", "Robert", "Daniel", "Rachel", "Sam", "Ben",
    "Joe", "Adam", "Emily", "Jane", "Chris", "Kevin", "Steve", "Amy", "Dan", "Matt", "George", "Henry",
    "Lucy", "Grace", "Alex", "Ryan", "Eric", "Brian", "Helen", "Linda", "Nancy", "Karen", "Jason", "Tim",
)
POSITIONS = ("IO", "S1", "S1+1", "S2", "END")


def single_token_names(tokenizer, names: Sequence[str] = IOI_NAMES) -> list[str]:
    """The ``names`` that ``tokenizer`` encodes as one token with a leading space (`` Mary``), in order."""
    return [n for n in names if len(tokenizer.encode(" " + n)) == 1]


@dataclass(frozen=True)
class IOIPrompts:
    """IOI prompt pairs of one token length: ids as tuples, one entry per row everywhere."""

    clean: tuple[tuple[int, ...], ...]
    corrupted: tuple[tuple[int, ...], ...]
    io: tuple[int, ...]          # the answer's token id
    s: tuple[int, ...]           # the subject's (the wrong answer)
    c: tuple[int, ...]           # the third name, at S2 in the corrupted prompt
    template: tuple[int, ...]    # index into ``templates``
    order: tuple[str, ...]       # "ABBA" (IO first) or "BABA"
    positions: dict              # name in POSITIONS -> tuple of one position per row
    texts: tuple[str, ...]
    templates: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.clean)

    def tokens(self, device=None) -> tuple[Tensor, Tensor]:
        """(clean, corrupted) token ids [n, pos]."""
        return torch.tensor(self.clean, device=device), torch.tensor(self.corrupted, device=device)

    def metric(self, kind: str = "logit_diff") -> AnswerMetric:
        """logit(IO) - logit(S) at the last position, the batch mean (``kind``: any AnswerMetric kind)."""
        return AnswerMetric(kind, self.io, self.s if kind == "logit_diff" else None, -1)

    def pos(self, name: str, device=None) -> Tensor:
        """One position per row of ``name`` (IO, S1, S1+1, S2, END), on ``device`` (default: the CPU)."""
        if name not in self.positions:
            raise ValueError(f"position must be one of {list(self.positions)}, got {name!r}")
        return torch.tensor(self.positions[name], device=device)


def ioi_prompts(model_or_tokenizer, n: int, seed: int = 0, templates: Sequence[str] = IOI_TEMPLATES,
                names: Optional[Sequence[str]] = None) -> IOIPrompts:
    """``n`` IOI prompt pairs drawn with ``seed``: a template, ABBA or BABA, and three distinct names
    (IO, S, C) per row, uniformly. ``names`` default: the single-token names of ``IOI_NAMES``.

    Refused (ValueError, naming what is wrong): a template without ``{A}``, ``{B}`` and ``{S}``; a name
    that is not one token; fewer than three names; templates whose prompts differ in token length."""
    tok = getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)
    if tok is None or not hasattr(tok, "encode"):
        raise ValueError("ioi_prompts needs a tokenizer (or a model with one) to make its prompts")
    n = check_int("n", n, 1)
    templates = tuple(templates)
    if not templates:
        raise ValueError("templates is empty: give at least one template with {A}, {B} and {S}")
    for t in templates:
        if any("{" + k + "}" not in t for k in "ABS"):
            raise ValueError(f"template {t!r} must contain {{A}}, {{B}} and {{S}} (the two names and the second S)")
    if names is None:
        names = single_token_names(tok)
    names = list(dict.fromkeys(names))
    multi = [m for m in names if len(tok.encode(" " + m)) != 1]
    if multi:
        raise ValueError(f"names {multi[:5]} are not one token with a leading space under this tokenizer; "
                         "use single_token_names(tokenizer, names) to keep those that are")
    if len(names) < 3:
        raise ValueError(f"IOI needs at least three single-token names (IO, S and the corruption's C), got {names}")
    a, b = names[0], names[1]
    lengths = {t: len(tok.encode(t.format(A=a, B=b, S=b))) for t in templates}
    if len(set(lengths.values())) > 1:
        raise ValueError("the templates give prompts of different token lengths "
                         f"{ {t: k for t, k in lengths.items()} }; circuits need one length: keep templates of one length")
    ids = {m: tok.encode(" " + m)[0] for m in names}
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.randrange(len(templates))
        order = rng.choice(("ABBA", "BABA"))
        io, s, c = rng.sample(names, 3)
        first, second = (io, s) if order == "ABBA" else (s, io)
        text = templates[t].format(A=first, B=second, S=s)
        clean = tok.encode(text)
        corrupted = tok.encode(templates[t].format(A=first, B=second, S=c))
        where = {m: [i for i, x in enumerate(clean) if x == ids[m]] for m in (io, s)}
        diff = [i for i, (x, y) in enumerate(zip(clean, corrupted)) if x != y]
        if len(clean) != len(corrupted) or len(where[io]) != 1 or len(where[s]) != 2 or diff != [where[s][1]]:
            raise ValueError(f"template {templates[t]!r} with names {first}, {second}, {s} -> {c} does not tokenize "
                             "with each name as its own token at one place (the name pieces merge with their "
                             "neighbours): choose another template")
        s1, s2 = where[s]
        rows.append((clean, corrupted, ids[io], ids[s], ids[c], t, order,
                     {"IO": where[io][0], "S1": s1, "S1+1": s1 + 1, "S2": s2, "END": len(clean) - 1}, text))
    return IOIPrompts(
        clean=tuple(tuple(r[0]) for r in rows), corrupted=tuple(tuple(r[1]) for r in rows),
        io=tuple(r[2] for r in rows), s=tuple(r[3] for r in rows), c=tuple(r[4] for r in rows),
        template=tuple(r[5] for r in rows), order=tuple(r[6] for r in rows),
        positions={k: tuple(r[7][k] for r in rows) for k in POSITIONS}, texts=tuple(r[8] for r in rows),
        templates=templates)


def mean_ablation_runner(runner, groups: Sequence[int]):
    """A copy of ``runner`` (an ``EdgeRunner``) whose "corrupted" value of every sender is its mean over
    the corrupted prompts of the row's group (one group id per row, e.g. ``IOIPrompts.template``),
    position by position: running it with an edge dropped mean-ablates that edge over the ABC
    distribution (Wang et al. 2022's mean ablation, taken per template), instead of patching each row
    from its own corrupted twin. The clean run and its caches are shared, not copied."""
    groups = torch.as_tensor(list(groups))
    out = runner.corrupted_out  # [senders, batch, pos, d_model]
    if groups.shape != (out.shape[1],):
        raise ValueError(f"groups needs one id per prompt ({out.shape[1]}), got {tuple(groups.shape)}")
    mean = torch.empty_like(out)
    for g in groups.unique():
        rows = (groups == g).nonzero().flatten().to(out.device)
        mean[:, rows] = out[:, rows].mean(1, keepdim=True)
    ablated = copy.copy(runner)
    ablated.corrupted_out = mean
    ablated.delta = mean - runner.clean_out
    return ablated


def logit_diff_direct_effects(runner, io: Sequence[int], s: Sequence[int]) -> Tensor:
    """Path patching of every sender into the logits, all at once: for each sender (``runner.graph``
    order), the mean over rows of logit(IO) - logit(S) at the last position when only the logits read
    that sender's corrupted value, minus the clean value. The final norm is recomputed on the patched
    stream, so each entry equals ``path_patching(model, ds, metric, sender, "logits")``'s score."""
    runner.check_weights(full=True)
    model = runner.model
    # the ids go to the unembedding's device once: indexing a GPU matrix by CPU ids copies them each time
    io, s = (torch.as_tensor(list(ids), device=model.W_U.device) for ids in (io, s))
    last = runner.clean_out[:, :, -1].sum(0)  # the clean stream entering the logits at END, without biases
    last = last + runner._bias_before(runner.stages[-1])
    direction = (model.W_U[:, io] - model.W_U[:, s]).T  # [batch, d_model]
    bias = (model.b_U[io] - model.b_U[s]) if getattr(model, "b_U", None) is not None else 0.0

    def diff(x: Tensor) -> Tensor:  # [n, batch, d_model] -> [n, batch]
        return (model.ln_final(x) * direction).sum(-1) + bias

    with torch.no_grad():
        clean = diff(last[None])[0].mean()
        patched = diff(last + runner.delta[:, :, -1]).mean(-1)  # [senders]
    return (patched - clean).cpu()


__all__ = ["IOI_TEMPLATES", "IOI_NAMES", "POSITIONS", "IOIPrompts", "single_token_names", "ioi_prompts",
           "mean_ablation_runner", "logit_diff_direct_effects"]
