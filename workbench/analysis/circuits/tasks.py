"""A checkpoint's own prompt sets for circuit work, the metrics that fit them, and one method run.

    prompt_sources(meta, cfg, path)        # {"repeat": "repeated random tokens ...", "ioi": ...}
    prompts = circuit_prompts(model, meta, "repeat", n=16, seed=0, path=path)
    prompts.metrics                        # ("answer_logprob", "kl"), or the answer metrics of task pairs
    run = run_method(model, prompts, "answer_logprob", method="eap-ig", threshold=0.05, steps=8)
    run.circuit, run.table, run.faithfulness
    circuit_agreement(run.circuit, other.circuit)   # shared edges, Jaccard, rank correlation

Where a prompt set comes from:

* ``repeat``: repeated random tokens ``[bos?, r, r]`` (corrupted: another ``r``), the induction
  layout. The spec is the one the checkpoint's circuit was defined on (a planted model's
  meta.json, or the ``circuit.json`` beside the checkpoint); any other induction-task
  checkpoint gets halves of min(16, n_ctx / 2) tokens of its vocabulary. The metric is the
  mean log-probability of the right next token over the second copy (``answer_logprob``).
* ``modular``: ``[a, +, b, =]`` prompts of a planted modular-addition model (its meta.json).
* ``ioi``, ``possession``: the stories task's clean/corrupted pairs (``task_pairs``); metrics
  are the answer metrics at the last position, each pair scored on its own answer.

Every set also offers ``kl``: the KL divergence from the clean run's next-token distributions.
A prompt set is a frozen dataclass of tuples, so it can key a cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from workbench.analysis.circuits.circuit import DISCOVERY_METHODS, Circuit, discover_circuit, faithfulness
from workbench.analysis.circuits.edges import MetricLike
from workbench.analysis.circuits.graph import ComputationGraph
from workbench.analysis.common import ProgressLike, check_choice
from workbench.analysis.metrics import AnswerMetric
from workbench.analysis.patching import TASK_PAIRS, task_pairs
from workbench.planted import ESTABLISHED_CIRCUIT, answer_position, spec_metric, spec_prompts
from workbench.utils import check_int

SPEC_SOURCES = {
    "repeat": "repeated random tokens [r, r], corrupted by another r; scored on the second copy",
    "modular": "a + b mod p prompts, corrupted by other operands; scored on the answer",
}
PROMPT_SOURCES = {**SPEC_SOURCES, **TASK_PAIRS}
SPEC_METRICS = ("answer_logprob", "kl")
PAIR_METRICS = ("logit_diff", "logprob", "prob", "kl")
METRIC_LABELS = {
    "answer_logprob": "log-probability of the right next token",
    "logit_diff": "logit difference (answer − wrong)",
    "logprob": "answer log-probability",
    "prob": "answer probability",
    "kl": "KL divergence from the clean run (nats)",
}


@dataclass(frozen=True)
class CircuitPrompts:
    """Clean/corrupted prompts of one length (token ids as tuples) and what scores them."""

    source: str
    description: str
    clean: tuple[tuple[int, ...], ...]
    corrupted: tuple[tuple[int, ...], ...]
    spec: tuple[tuple[str, Any], ...] = ()  # the prompt spec's items (repeat, modular)
    answer: tuple[int, ...] = ()            # one per pair (ioi, possession)
    wrong: tuple[int, ...] = ()

    @property
    def metrics(self) -> tuple[str, ...]:
        return SPEC_METRICS if self.spec else PAIR_METRICS

    def tokens(self, device=None) -> tuple[Tensor, Tensor]:
        return torch.tensor(self.clean, device=device), torch.tensor(self.corrupted, device=device)

    def metric(self, kind: str) -> MetricLike:
        """The metric ``kind`` (one of :attr:`metrics`): a function of the logits, or ``"kl"``."""
        check_choice("kind", kind, self.metrics)
        if kind == "kl":
            return "kl"
        if self.spec:
            return spec_metric(dict(self.spec), torch.tensor(self.clean))
        return AnswerMetric(kind, self.answer, self.wrong if kind == "logit_diff" else None, -1)

    def target(self, row: int = 0) -> tuple[int, int, Optional[int]]:
        """(position, answer, wrong or None) where prompt ``row``'s answer is decided: what its
        direct logit attribution should explain."""
        row = check_int("row", row, 0, len(self.clean) - 1)
        if self.spec:
            pos, answers = answer_position(dict(self.spec), torch.tensor(self.clean[row: row + 1]))
            return int(pos), int(answers[0]), None
        return len(self.clean[row]) - 1, self.answer[row], self.wrong[row]


def _circuit_file_spec(path: Optional[Union[str, Path]]) -> Optional[dict]:
    """The prompt spec a circuit.json beside the checkpoint was found on (None without one)."""
    if path is None or not (Path(path) / ESTABLISHED_CIRCUIT).is_file():
        return None
    try:
        data = json.loads((Path(path) / ESTABLISHED_CIRCUIT).read_text())
    except (OSError, ValueError):
        return None
    spec = (data.get("meta") or {}).get("planted", {}).get("prompts") if isinstance(data, dict) else None
    return spec if isinstance(spec, dict) else None


def prompt_spec(meta: dict, cfg, path: Optional[Union[str, Path]] = None) -> Optional[dict]:
    """The repeat/modular prompt spec of a checkpoint: its planted meta's, its circuit.json's, or
    (an induction-task model) repeated halves of min(16, n_ctx // 2) tokens; None otherwise."""
    planted = meta.get("planted")
    if isinstance(planted, dict) and isinstance(planted.get("prompts"), dict):
        return dict(planted["prompts"])
    spec = _circuit_file_spec(path)
    if spec is not None:
        return spec
    if meta.get("task") == "induction":
        vocab = min(int((meta.get("task_options") or {}).get("vocab", cfg.d_vocab)), cfg.d_vocab)
        half = min(16, cfg.n_ctx // 2)
        return {"kind": "repeat", "half": half, "vocab": vocab, "bos": None, "distinct": half <= vocab}
    return None


def prompt_sources(meta: dict, cfg, path: Optional[Union[str, Path]] = None) -> dict[str, str]:
    """The prompt sets this checkpoint offers (name -> description); empty when none."""
    from workbench.data import TASKS

    spec = prompt_spec(meta, cfg, path)
    found = {spec["kind"]: SPEC_SOURCES[spec["kind"]]} if spec and spec.get("kind") in SPEC_SOURCES else {}
    task = TASKS.get(meta.get("task"))
    found.update({k: v for k, v in TASK_PAIRS.items() if task is not None and hasattr(task, f"{k}_prompts")})
    return found


def circuit_prompts(model, meta: dict, source: str, n: int = 16, seed: int = 0,
                    path: Optional[Union[str, Path]] = None) -> CircuitPrompts:
    """``n`` clean/corrupted prompts of ``source`` (one of :func:`prompt_sources`) for this checkpoint."""
    n = check_int("n", n, 1)
    offered = prompt_sources(meta, model.cfg, path)
    if source not in offered:
        raise ValueError(f"source must be one of the prompt sets this checkpoint offers {list(offered)}, "
                         f"got {source!r}")
    if source in SPEC_SOURCES:
        spec = prompt_spec(meta, model.cfg, path)
        clean, corrupted = spec_prompts(spec, n, seed)
        desc = f"{SPEC_SOURCES[source]} ({n} pairs of {clean.shape[1]} tokens, seed {seed})"
        return CircuitPrompts(source, desc, tuple(map(tuple, clean.tolist())), tuple(map(tuple, corrupted.tolist())),
                              spec=tuple(sorted(spec.items())))
    pairs = task_pairs(model, meta, n=n, kind=source, seed=seed)
    lengths = {len(row) for row in pairs.clean}
    if len(lengths) > 1:
        raise ValueError(f"the {source} prompts are of {len(lengths)} lengths {sorted(lengths)}; circuits need "
                         "prompts of one length")
    return CircuitPrompts(source, f"{pairs.description} ({n} pairs of {lengths.pop()} tokens, seed {seed})",
                          pairs.clean, pairs.corrupted, answer=pairs.answer, wrong=pairs.wrong)


@dataclass
class MethodRun:
    """One method on one prompt set: the circuit it keeps, every edge's score, and how faithful it is."""

    method: str
    circuit: Circuit
    table: pd.DataFrame  # ComputationGraph.edges + score, abs_score
    faithfulness: float
    seconds: float


def run_method(model, prompts: CircuitPrompts, metric: str, method: str = "eap", threshold: float = 0.05,
               steps: int = 8, top_k: Optional[int] = None, progress: ProgressLike = False) -> MethodRun:
    """``discover_circuit`` with ``method`` on ``prompts`` scored by ``metric`` (a kind of
    :attr:`CircuitPrompts.metrics`), with every edge's score as a table and the circuit's
    faithfulness on the same prompts. ``progress``: True (tqdm) or ``progress(done, total)``."""
    check_choice("method", method, DISCOVERY_METHODS)
    fn = prompts.metric(metric)
    ds = prompts.tokens(model.device)
    started = time.perf_counter()
    circuit = discover_circuit(model, ds, fn, method=method, threshold=threshold, top_k=top_k, steps=steps,
                               progress=progress)
    seconds = time.perf_counter() - started
    table = ComputationGraph(model).edges
    table["score"] = table["edge"].map(circuit.scores).astype(float)
    table["abs_score"] = table["score"].abs()
    kept = faithfulness(model, circuit, ds, fn, check_weights=False) if len(circuit) else 0.0
    return MethodRun(method, circuit, table, float(kept), seconds)


def circuit_agreement(a: Circuit, b: Circuit) -> dict[str, Union[int, float]]:
    """How two circuits of one model agree: edges in both, in one only, their Jaccard index, and
    the Spearman correlation of their scores over the edges both scored (NaN when either is constant)."""
    if a.model.get("graph") != b.model.get("graph"):
        raise ValueError("the two circuits are of different models' graphs; compare circuits of one model")
    first, second = set(a.edges), set(b.edges)
    union = first | second
    common = sorted(set(a.scores) & set(b.scores))
    rho = float("nan")
    if len(common) > 1:
        x = pd.Series([a.scores[e] for e in common]).rank().to_numpy()
        y = pd.Series([b.scores[e] for e in common]).rank().to_numpy()
        if x.std() > 0 and y.std() > 0:
            rho = float(np.corrcoef(x, y)[0, 1])
    return {"shared": len(first & second), "only_a": len(first - second), "only_b": len(second - first),
            "jaccard": len(first & second) / len(union) if union else float("nan"), "spearman": rho}


__all__ = ["PROMPT_SOURCES", "METRIC_LABELS", "CircuitPrompts", "MethodRun", "prompt_spec", "prompt_sources",
           "circuit_prompts", "run_method", "circuit_agreement"]
