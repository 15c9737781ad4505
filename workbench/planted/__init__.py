"""Models whose circuits are known, to score circuit-finding methods against.

    from workbench.planted import load_planted, PLANTED
    p = load_planted("hand-induction")        # or "iit-induction", "iit-modular", "induction-attn2l"
    clean, corrupted = p.prompts(32, seed=0)  # a prompt set of one length
    metric = p.metric(clean)                  # mean log-probability of the right next token
    p.truth, p.unscored                       # the circuit's edges; edges the truth does not decide

    hand.py   a model whose weights are written, not trained: the truth is exact
    iit.py    models trained with strict interchange intervention training onto chosen heads

``induction-attn2l`` is the shipped, ordinarily trained induction model; its circuit is not
known by construction but *established by ACDC* with exact edge interventions at threshold 0.01
(an edge is pruned when removing it moves the metric by less than 0.01 of the clean-corrupted gap) on
64 prompts of seed 1000 (``scripts/make_planted.py``; 53 of 257 edges kept), stored in
``checkpoints/induction-attn2l/circuit.json``, whose ``meta`` records the method, the threshold and
the prompts. Scoring ACDC against it is circular, and the benchmark says so.

Weights live in ``checkpoints/planted-*`` (``scripts/make_planted.py`` writes them; a checkpoint
loads with ``workbench.load_checkpoint``), and each checkpoint's ``meta.json`` holds
``"planted"``: the truth, the unscored edges, how the truth was established and the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from workbench.checkpoint import CheckpointError, load_checkpoint, read_meta
from workbench.utils import check_int, check_seed

PLANTED = ("hand-induction", "iit-induction", "iit-modular", "induction-attn2l")
CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
ESTABLISHED_CIRCUIT = "circuit.json"


def checkpoint_dir(name: str) -> str:
    """The folder name under checkpoints/ of a planted model."""
    return name if name == "induction-attn2l" else f"planted-{name}"


@dataclass
class Planted:
    """A model with a known circuit, and the prompts and metric the circuit is defined on."""

    name: str
    model: object
    truth: list[str]
    unscored: list[str]
    established_by: str
    prompt_spec: dict
    meta: dict = field(default_factory=dict)

    def prompts(self, batch: int = 32, seed: int = 0) -> tuple[Tensor, Tensor]:
        """(clean, corrupted) token ids [batch, pos]: clean prompts show the behaviour, corrupted
        ones are drawn independently from the same distribution."""
        return spec_prompts(self.prompt_spec, batch, seed, self.model.device)

    def metric(self, clean: Tensor) -> Callable[[Tensor], Tensor]:
        """Mean log-probability of the clean prompts' right next tokens where the behaviour acts."""
        return spec_metric(self.prompt_spec, clean)


def spec_prompts(spec: dict, batch: int = 32, seed: int = 0, device=None) -> tuple[Tensor, Tensor]:
    """(clean, corrupted) token ids [batch, pos] of a prompt spec (``{"kind": "repeat", "half",
    "vocab", "bos", "distinct"}`` or ``{"kind": "modular", "p"}``): clean prompts show the
    behaviour, corrupted ones are drawn independently from the same distribution."""
    batch, seed = check_int("batch", batch, 1), check_seed("seed", seed)
    kinds = {"repeat": _repeat_prompts, "modular": _modular_prompts}
    if spec.get("kind") not in kinds:
        raise ValueError(f"spec kind must be one of {list(kinds)}, got {spec.get('kind')!r}")
    gen = torch.Generator().manual_seed(seed)
    make = kinds[spec["kind"]]
    clean, corrupted = make(spec, batch, gen), make(spec, batch, gen)
    return clean.to(device), corrupted.to(device)


def spec_metric(spec: dict, clean: Tensor) -> Callable[[Tensor], Tensor]:
    """Mean log-probability of ``clean``'s right next tokens where the spec's behaviour acts."""
    positions, targets = _answer_positions(spec, clean)

    def metric(logits: Tensor) -> Tensor:
        logp = logits[:, positions].float().log_softmax(-1)
        return logp.gather(-1, targets[..., None]).mean()

    metric.__name__ = "answer_logprob"
    return metric


def answer_position(spec: dict, clean: Tensor) -> tuple[int, Tensor]:
    """The last position where the spec's behaviour acts, and each row's right next token there."""
    positions, targets = _answer_positions(spec, clean)
    last = range(clean.shape[1])[positions][-1]
    return last, targets[:, -1]


def _repeat_prompts(spec: dict, batch: int, gen: torch.Generator) -> Tensor:
    """``[bos?, r, r]``, ``r`` of ``half`` tokens below ``vocab`` (distinct within a row when asked)."""
    half, vocab = spec["half"], spec["vocab"]
    if spec.get("distinct", False):
        first = torch.stack([torch.randperm(vocab, generator=gen)[:half] for _ in range(batch)])
    else:
        first = torch.randint(0, vocab, (batch, half), generator=gen)
    parts = [first, first]
    if spec.get("bos") is not None:
        parts.insert(0, torch.full((batch, 1), spec["bos"]))
    return torch.cat(parts, dim=1)


def _modular_prompts(spec: dict, batch: int, gen: torch.Generator) -> Tensor:
    p = spec["p"]
    pairs = torch.randint(0, p, (batch, 2), generator=gen)
    return torch.stack([pairs[:, 0], torch.full((batch,), p), pairs[:, 1], torch.full((batch,), p + 1)], dim=1)


def _answer_positions(spec: dict, clean: Tensor) -> tuple[slice, Tensor]:
    """The positions whose next token the behaviour predicts, and those tokens."""
    if spec["kind"] == "modular":
        return slice(-1, None), ((clean[:, 0] + clean[:, 2]) % spec["p"])[:, None]
    half, start = spec["half"], 1 if spec.get("bos") is not None else 0
    # Second copy, first token to second-to-last: each predicts the next token of the copy.
    first_query = start + half
    return slice(first_query, start + 2 * half - 1), clean[:, first_query + 1: start + 2 * half]


def load_planted(name: str, root: Optional[Union[str, Path]] = None, device=None) -> Planted:
    """A planted model by name (one of ``PLANTED``) from ``root`` (default: the repo's checkpoints/)."""
    if name not in PLANTED:
        raise ValueError(f"unknown planted model {name!r}; valid names are {list(PLANTED)}")
    path = Path(root or CHECKPOINTS) / checkpoint_dir(name)
    if not path.is_dir():
        raise CheckpointError(f"planted model {name!r} is not at {path}: build it with scripts/make_planted.py")
    model, _ = load_checkpoint(path, device=device)
    known = known_circuit(model, path)
    if known is None:
        raise CheckpointError(f"{path}/meta.json has no \"planted\" entry: rebuild it with scripts/make_planted.py")
    truth, info = known
    return Planted(name, model, list(truth), list(info.get("unscored", [])), info["established_by"],
                   dict(info["prompts"]), info)


def known_circuit(model, path: Union[str, Path]) -> Optional[tuple[list[str], dict]]:
    """(the circuit's edges, its "planted" entry: unscored, established_by, prompts) of the
    checkpoint at ``path``: from its meta.json (a planted model), else from the circuit.json
    beside it (checked against ``model``); None when it has neither."""
    path = Path(path)
    info = read_meta(path).get("planted")
    if isinstance(info, dict) and "truth" in info:
        return list(info["truth"]), info
    if (path / ESTABLISHED_CIRCUIT).is_file():
        from workbench.analysis.circuits import Circuit

        circuit = Circuit.load(path / ESTABLISHED_CIRCUIT, model)
        if isinstance(circuit.meta.get("planted"), dict):
            return list(circuit.edges), circuit.meta["planted"]
    return None
