"""Stories: a small probabilistic grammar of simple English stories with known-answer sentences.

Each story has two named characters and a few sentences: fillers ("Mary was happy."),
indirect-object sentences (IOI, Wang et al. 2022: "When Mary and John went to the store,
John gave a drink to" -> Mary) and possession sentences ("Mary has a ball and John has a
cup. Mary plays with the" -> ball). The vocabulary is closed, so a ``WordTokenizer`` makes
every name, place and object a single token. Stories are separated by a newline token,
which also starts every sequence and every prompt (it plays the role of BOS).

Held out from training, fixed by the seed: a fifth of the unordered name pairs (no training
story pairs them) and a fifth of the IOI templates (a template is a combination of
connective, movement phrase and giving verb; each word also occurs in training templates).
``evaluate`` scores prompts built only from held-out pairs; IOI on held-out templates too.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.data.base import _EVAL_STREAM, Task, make_generator
from workbench.tokenizer import WordTokenizer
from workbench.utils import check_float, check_int, check_seed, eval_mode

NAMES = (
    "Mary John Anna Tom Lily Ben Sara Max Emma Jack Lucy Sam Mia Leo Kate Dan "
    "Rose Paul Amy Nick Ella Mark Zoe Carl Ruth Luke Jane Fred Ivy Adam Nora Owen"
).split()
PLACES = "store park school beach garden market river farm library zoo lake forest".split()
OBJECTS = "ball book drink apple cake toy hat flower letter kite cookie box pen cup".split()
CONNECTIVES = ["When", "While", "After", "Once"]
MOVES = [("went", "to"), ("arrived", "at"), ("were", "at"), ("walked", "to"), ("ran", "to"), ("stayed", "at")]
GIVES = ["gave", "handed", "threw", "passed", "sent", "showed", "brought"]
IOI_TEMPLATES = list(itertools.product(range(len(CONNECTIVES)), range(len(MOVES)), range(len(GIVES))))

INTROS = [
    "Once upon a time , {A} and {B} lived in a small town .",
    "{A} and {B} were friends .",
    "One day , {A} met {B} at the {place} .",
]
FILLERS = [
    "{A} was happy .",
    "{A} liked the {obj} .",
    "{A} and {B} played at the {place} .",
    "The {obj} was on the table .",
    "{A} said hello to {B} .",
    "{A} went home .",
    "It was a sunny day .",
    "{A} smiled at {B} .",
    "{A} found a {obj} at the {place} .",
]
ENDINGS = ["The end .", "They were happy .", "{A} and {B} went home ."]
NEWLINE = "\n"


def ioi_sentence(template: tuple[int, int, int], first: str, second: str, subject: str, place: str, obj: str) -> str:
    """The IOI prompt text (without the answer): names in order ``first, second``; ``subject`` gives."""
    c, m, g = template
    verb, prep = MOVES[m]
    return f"{CONNECTIVES[c]} {first} and {second} {verb} {prep} the {place} , {subject} {GIVES[g]} a {obj} to"


def possession_sentence(first: str, second: str, obj1: str, obj2: str, asked: str) -> str:
    return f"{first} has a {obj1} and {second} has a {obj2} . {asked} plays with the"


def _vocabulary() -> list[str]:
    words = set(NAMES + PLACES + OBJECTS + CONNECTIVES + GIVES + [w for m in MOVES for w in m] + [NEWLINE])
    for text in INTROS + FILLERS + ENDINGS + ["{A} gave a {obj} to {B} .", possession_sentence("", "", "", "", "")]:
        words.update(w for w in text.replace("{", " {").split() if not w.startswith("{"))
    return sorted(words)


@dataclass
class PromptBatch:
    """Prompts with a known answer, all the same length, as tensors ready for a forward pass.

    ``tokens`` [batch, pos] end right before the answer, so ``logits[:, -1]`` scores it;
    ``correct``/``wrong`` [batch] are the answer and the distractor token ids (IOI: the
    indirect object and the subject). ``corrupted`` has the same shape with the second subject
    mention replaced by a third name (the "ABC" baseline of activation patching). ``positions``
    maps role names ("IO", "S1", "S2", "end" for IOI) to [batch] position indices.
    """

    prompts: list[str]
    tokens: Int[Tensor, "batch pos"]
    corrupted: Int[Tensor, "batch pos"]
    correct: Int[Tensor, " batch"]
    wrong: Int[Tensor, " batch"]
    positions: dict[str, Int[Tensor, " batch"]]
    templates: list[str]


class StoriesTask(Task):
    name = "stories"
    description = "a toy grammar of two-character stories with IOI sentences; metric: IOI accuracy and logit difference on unseen name pairs"
    default_seq_len = 128

    def __init__(self, seed: int = 0, heldout_fraction: float = 0.2):
        super().__init__(seed)
        # 168 templates and 496 name pairs: within [0.01, 0.99] both splits keep at least two of each.
        self.heldout_fraction = check_float("heldout_fraction", heldout_fraction, 0.01, 0.99)
        self.tokenizer = WordTokenizer(_vocabulary())
        rng = random.Random(self.seed)
        pairs = list(itertools.combinations(NAMES, 2))
        rng.shuffle(pairs)
        n_pairs = round(heldout_fraction * len(pairs))
        self.heldout_pairs = sorted(pairs[:n_pairs])
        self.train_pairs = sorted(pairs[n_pairs:])
        templates = list(IOI_TEMPLATES)
        rng.shuffle(templates)
        n_templates = round(heldout_fraction * len(templates))
        self.heldout_templates = sorted(templates[:n_templates])
        self.train_templates = sorted(templates[n_templates:])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def options(self) -> dict[str, Any]:
        return {"seed": self.seed, "heldout_fraction": self.heldout_fraction}

    # ---- training text ------------------------------------------------------------
    def story(self, rng: random.Random) -> str:
        """One story (ending with a newline) about a training pair of names."""
        a, b = rng.choice(self.train_pairs)
        if rng.random() < 0.5:
            a, b = b, a
        fill = lambda text: text.format(A=a, B=b, place=rng.choice(PLACES), obj=rng.choice(OBJECTS))  # noqa: E731
        sentences = [fill(rng.choice(INTROS))] if rng.random() < 0.7 else []
        for _ in range(rng.randint(2, 5)):
            kind = rng.choices(("ioi", "possession", "filler"), weights=(3, 2, 3))[0]
            x, y = (a, b) if rng.random() < 0.5 else (b, a)  # x receives, y gives
            if kind == "ioi":
                first, second = (x, y) if rng.random() < 0.5 else (y, x)
                prompt = ioi_sentence(rng.choice(self.train_templates), first, second, y, rng.choice(PLACES), rng.choice(OBJECTS))
                sentences.append(f"{prompt} {x} .")
            elif kind == "possession":
                o1, o2 = rng.sample(OBJECTS, 2)
                asked, answer = (x, o1) if rng.random() < 0.5 else (y, o2)
                sentences.append(f"{possession_sentence(x, y, o1, o2, asked)} {answer} .")
            else:
                x_y = {"A": x, "B": y}
                sentences.append(rng.choice(FILLERS).format(**x_y, place=rng.choice(PLACES), obj=rng.choice(OBJECTS)))
        if rng.random() < 0.5:
            sentences.append(fill(rng.choice(ENDINGS)))
        return " ".join(sentences) + " " + NEWLINE

    def stories(self, n: int, seed: Optional[int] = None) -> Iterator[str]:
        """``n`` stories as canonical text, reproducible from ``seed`` (the task seed by default)."""
        n, seed = check_int("n", n, 0), check_seed("seed", seed, optional=True)
        rng = random.Random(self.seed if seed is None else seed)
        return (self.tokenizer.decode(self.tokenizer.encode(self.story(rng))) for _ in range(n))

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> Int[Tensor, "batch pos"]:
        rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=generator)))
        newline = self.tokenizer.stoi[NEWLINE]
        rows = []
        for _ in range(batch_size):
            ids = [newline]
            while len(ids) < seq_len:
                ids += self.tokenizer.encode(self.story(rng))
            rows.append(ids[:seq_len])
        return torch.tensor(rows, dtype=torch.long)

    # ---- known-answer prompts -------------------------------------------------------
    def ioi_prompts(self, n: int, split: str = "heldout", templates: Optional[str] = None, seed: Optional[int] = None) -> PromptBatch:
        """``n`` IOI prompts over ``split`` name pairs ("heldout" or "train").

        ``templates`` ("heldout" or "train") picks the template set; by default the same as
        ``split``. Every prompt is ``\\n When A and B went to the store , B gave a drink to``
        in shape (15 tokens), with the two names in either order (ABBA and BABA).
        """
        n, seed = check_int("n", n, 1), check_seed("seed", seed, optional=True)
        pairs, template_set = self._split(split, templates)
        rng = random.Random(int(make_generator(self.seed if seed is None else seed, _EVAL_STREAM).initial_seed()))
        prompts, corrupted, correct, wrong, names = [], [], [], [], []
        for _ in range(n):
            io, s = rng.sample(rng.choice(pairs), 2)
            c = rng.choice([m for m in NAMES if m not in (io, s)])
            first, second = (io, s) if rng.random() < 0.5 else (s, io)
            template, place, obj = rng.choice(template_set), rng.choice(PLACES), rng.choice(OBJECTS)
            prompts.append(NEWLINE + ioi_sentence(template, first, second, s, place, obj))
            corrupted.append(NEWLINE + ioi_sentence(template, first, second, c, place, obj))
            correct.append(io)
            wrong.append(s)
            names.append("ABBA" if first == io else "BABA")
        batch = self._batch(prompts, corrupted, correct, wrong, names)
        io_first = torch.tensor([t == "ABBA" for t in names])
        batch.positions = {
            "IO": torch.where(io_first, 2, 4),
            "S1": torch.where(io_first, 4, 2),
            "S2": torch.full((n,), 10),
            "end": torch.full((n,), batch.tokens.shape[1] - 1),
        }
        return batch

    def possession_prompts(self, n: int, split: str = "heldout", seed: Optional[int] = None) -> PromptBatch:
        """``n`` prompts "A has a ball and B has a cup . A plays with the" -> ball (wrong: cup)."""
        n, seed = check_int("n", n, 1), check_seed("seed", seed, optional=True)
        pairs, _ = self._split(split, None)
        rng = random.Random(int(make_generator(self.seed if seed is None else seed, _EVAL_STREAM, 1).initial_seed()))
        prompts, corrupted, correct, wrong, kinds = [], [], [], [], []
        for _ in range(n):
            x, y = rng.sample(rng.choice(pairs), 2)
            o1, o2 = rng.sample(OBJECTS, 2)
            asked_first = rng.random() < 0.5
            asked = x if asked_first else y
            prompts.append(NEWLINE + possession_sentence(x, y, o1, o2, asked))
            corrupted.append(NEWLINE + possession_sentence(x, y, o1, o2, y if asked_first else x))
            correct.append(o1 if asked_first else o2)
            wrong.append(o2 if asked_first else o1)
            kinds.append("asked-first" if asked_first else "asked-second")
        batch = self._batch(prompts, corrupted, correct, wrong, kinds)
        batch.positions = {"asked": torch.full((n,), 10), "end": torch.full((n,), batch.tokens.shape[1] - 1)}
        return batch

    def _split(self, split: str, templates: Optional[str]) -> tuple[list, list]:
        choices = {"heldout": (self.heldout_pairs, self.heldout_templates), "train": (self.train_pairs, self.train_templates)}
        for value in (split, templates):
            if value is not None and value not in choices:
                raise ValueError(f"split/templates must be 'heldout' or 'train', got {value!r}")
        return choices[split][0], choices[templates or split][1]

    def _batch(self, prompts, corrupted, correct, wrong, templates) -> PromptBatch:
        enc = self.tokenizer.encode
        return PromptBatch(
            prompts=[self.tokenizer.decode(enc(p)) for p in prompts],
            tokens=torch.tensor([enc(p) for p in prompts]),
            corrupted=torch.tensor([enc(p) for p in corrupted]),
            correct=torch.tensor([self.tokenizer.stoi[w] for w in correct]),
            wrong=torch.tensor([self.tokenizer.stoi[w] for w in wrong]),
            positions={},
            templates=templates,
        )

    # ---- metric ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, n: int = 256, seed: Optional[int] = None) -> dict[str, float]:
        """Accuracy (correct beats wrong) and mean logit difference, on unseen name pairs.

        ``ioi_*``: held-out pairs and held-out templates; ``ioi_seen_templates_*``: held-out
        pairs in training templates; ``possession_*``: held-out pairs. Chance accuracy is 0.5
        and chance logit difference 0.
        """
        out = {}
        batches = {
            "ioi": self.ioi_prompts(n, "heldout", seed=seed),
            "ioi_seen_templates": self.ioi_prompts(n, "heldout", templates="train", seed=seed),
            "possession": self.possession_prompts(n, "heldout", seed=seed),
        }
        with eval_mode(model):
            for name, batch in batches.items():
                out.update({f"{name}_{k}": v for k, v in answer_metrics(model, batch).items()})
        return out


@torch.no_grad()
def answer_metrics(model: torch.nn.Module, batch: PromptBatch) -> dict[str, float]:
    """``accuracy`` (correct logit > wrong logit), ``logit_diff`` (mean), ``top1`` (argmax is correct)."""
    logits = model(batch.tokens.to(model.device))[:, -1].float().cpu()
    rows = torch.arange(len(batch.correct))
    diff = logits[rows, batch.correct] - logits[rows, batch.wrong]
    return {
        "accuracy": float((diff > 0).float().mean()),
        "logit_diff": float(diff.mean()),
        "top1": float((logits.argmax(-1) == batch.correct).float().mean()),
    }
