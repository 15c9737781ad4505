"""MIB's circuit-localization metrics (the Mechanistic Interpretability Benchmark): CPR, CMD, AUROC.

    curve = faithfulness_curve(model, (clean, corrupted), metric, scores)      # one row per circuit size
    cpr(curve), cmd(curve)                                                   # MIB's two numbers
    mib_auroc(scores, graph, truth)                                          # against a known circuit
    score_method(model, (clean, corrupted), metric, "eap-ig")                 # all three for a method

The definitions follow MIB's own code (github.com/hannamw/MIB-circuit-track,
``MIB_circuit_track/evaluation.py`` and ``print_results.py``, with the graph operations of
its EAP-IG library, ``eap/graph.py``):

- A method gives every edge a score. For each fraction p of the edges in
  ``PERCENTAGES`` = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)%, the circuit is the
  ``int(p * n_edges)`` best-scored edges (``apply_topn``), pruned of edges no path from the
  input to the logits uses (``prune``). Everything outside the circuit is patched to the
  corrupted run's value (MIB's default ``--ablation patching``), and the circuit's
  faithfulness is f = (m(circuit) - m(empty)) / (m(model) - m(empty)).
- **CPR** (higher is better) is the area under f(p), by the trapezoid rule on the linear
  fractions, for circuits chosen by the *signed* score (``--absolute`` off). **CMD** (lower
  is better) is the area under |1 - f(p)| for circuits chosen by the *absolute* score
  (``--absolute`` on): ``print_results.py`` takes each from the run with that setting.
- **AUROC** against a known circuit: for each fraction of ``PERCENTAGES`` the true- and
  false-positive rates of the chosen edges, and the trapezoid area under (FPR, TPR) with the
  FPRs divided by the last one (``print_results.area_under_curve``). The curve starts at the
  0.1% point, not at (0, 0), as MIB's does.

Readings we had to choose, where MIB's text or code leaves a choice:

- **Sign.** MIB ranks by "higher score = more important" (``absolute=False`` keeps the
  largest). The workbench's edge scores are metric(edge corrupted) - metric(clean), negative
  for an edge that carries the behaviour, so methods here hand MIB ``importance`` =
  (metric(clean) - metric(edge corrupted)) x sign(m(clean) - m(corrupted)): positive when the
  edge moves the metric toward the clean run.
- **Choosing edges for AUROC.** MIB's AUROC grows its circuit with ``apply_greedy`` (edge by
  edge from the logits backwards); we take the top-n by |score| as for CMD (the edges scored
  by a method are ranked the same way for both), and also report the plain rank AUROC
  (``workbench.analysis.circuits.auroc``) beside it.
- **Node-level methods** (activation and attribution patching score heads, not edges):
  MIB's ``apply_topn(level="node")``: the top-n scored nodes, with every node a method does
  not score (embedding, MLPs, logits) kept, and every edge between kept nodes; the fractions
  are then of the scored nodes.
- **Tied scores** are broken in the graph's edge order (a stable sort), where MIB's
  ``torch.argsort`` leaves them in an unspecified order.

A new method is a function ``(model, ds, metric) -> scores`` (one number per edge, in
``ComputationGraph(model).edges`` order, larger = more important), passed as ``method=``
to ``score_method``; ``METHODS`` lists the built-in ones.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from workbench.analysis.circuits.circuit import auroc, prune
from workbench.analysis.circuits.edges import EdgeRunner
from workbench.analysis.circuits.graph import ComputationGraph

PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's evaluation.py

EdgeScorer = Callable[..., np.ndarray]
Numbers = Union[Sequence[float], np.ndarray, pd.Series]  # what the curves hand over


# ---- the areas -----------------------------------------------------------------------------------
def area_under(x: Numbers, y: Numbers, log_scale: bool = False) -> float:
    """MIB's trapezoid sum over consecutive points (``evaluate_area_under_curve``)."""
    x, y = list(map(float, x)), list(map(float, y))
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"area_under needs two or more (x, y) points of equal count, got {len(x)} and {len(y)}")
    total = 0.0
    for i in range(len(x) - 1):
        x1, x2 = (math.log(x[i]), math.log(x[i + 1])) if log_scale else (x[i], x[i + 1])
        total += (x2 - x1) * (y[i] + y[i + 1]) / 2
    return total


def cpr(curve: pd.DataFrame) -> float:
    """Circuit performance ratio: the area under faithfulness over the edge fractions (higher is better).
    ``curve``: ``faithfulness_curve``'s, for circuits chosen by the signed score."""
    return area_under(curve["fraction"], curve["faithfulness"])


def cmd(curve: pd.DataFrame) -> float:
    """Circuit-model distance: the area under |1 - faithfulness| (lower is better). ``curve``:
    ``faithfulness_curve``'s, for circuits chosen by the absolute score."""
    return area_under(curve["fraction"], (1.0 - curve["faithfulness"]).abs())


def roc_area(fpr: Numbers, tpr: Numbers) -> float:
    """MIB's ``print_results.area_under_curve``: trapezoids over (FPR, TPR), the FPRs divided by the last."""
    fpr = [float(f) for f in fpr]
    if not fpr or fpr[-1] == 0:
        return float("nan")
    return area_under([f / fpr[-1] for f in fpr], tpr)


# ---- circuits of each size ----------------------------------------------------------------------
def _top(values: np.ndarray, n: int, absolute: bool) -> np.ndarray:
    key = np.abs(values) if absolute else values
    return np.argsort(-key, kind="stable")[:n]


def node_keep(graph: ComputationGraph, node_scores: dict, n: int, absolute: bool = False) -> torch.Tensor:
    """MIB's ``apply_topn(level="node")``: a node circuit as an edge mask [senders, receivers].

    ``node_scores`` maps node labels (``"L3H1"``, ``"L3 mlp"``) to scores; the ``n`` best (by value,
    or by |value| with ``absolute``) are kept, and so is every node with no score (the embedding,
    the logits, any MLP left out); every edge between two kept nodes is kept."""
    names = list(node_scores)
    values = np.array([node_scores[k] for k in names], dtype=float)
    kept = {names[i] for i in _top(values, n, absolute)}

    def on(node) -> bool:
        label = _node_label(node)
        return label not in node_scores or label in kept

    keep = torch.zeros_like(graph.adjacency)
    for s, sender in enumerate(graph.senders):
        if not on(sender):
            continue
        for r in range(len(graph.receivers)):
            if graph.adjacency[s, r] and on(graph.node_of_receiver(r)):
                keep[s, r] = 1.0
    return keep


_node_keep = node_keep  # the old private name, kept for code that imported it


def _node_label(node) -> str:
    if node[0] == "head":
        return f"L{node[1]}H{node[2]}"
    if node[0] == "mlp":
        return f"L{node[1]} mlp"
    return node[0]


def faithfulness_curve(
    model,
    ds,
    metric: Callable,
    scores: Union[np.ndarray, dict],
    absolute: bool = False,
    percentages: Sequence[float] = PERCENTAGES,
    graph: Optional[ComputationGraph] = None,
    runner: Optional[EdgeRunner] = None,
) -> pd.DataFrame:
    """Faithfulness of the circuit of each size: one row per fraction, with the edges asked for
    (``n_chosen``), the edges left after pruning (``n_edges``) and ``faithfulness``.

    ``scores``: one importance per edge (graph order), or a dict of node label -> importance for
    a node-level method (fractions are then of the scored nodes). ``absolute``: rank by |score|.
    ``runner``: an ``EdgeRunner`` of ``ds`` already built (its clean and corrupted runs are reused;
    ``ds`` and ``graph`` are then not read). ``attrs``: clean, corrupted (the metric of the two runs)."""
    runner = EdgeRunner(model, ds, graph) if runner is None else runner
    g = runner.graph
    clean, corrupted = runner.endpoints(metric)
    if clean == corrupted:
        raise ValueError(f"the metric is {clean:.6g} on both the clean and the corrupted prompts: faithfulness "
                         "is undefined; pick prompts (or a metric) that tell the two apart")
    by_node = isinstance(scores, dict)
    if not by_node:
        scores = np.asarray(scores, dtype=float).reshape(-1)
        if scores.shape[0] != g.n_edges:
            raise ValueError(f"scores has {scores.shape[0]} entries; the model's graph has {g.n_edges} edges")
        if not np.isfinite(scores).all():
            raise ValueError("scores holds NaN or infinite values; every edge needs a finite score")
    total = len(scores) if by_node else g.n_edges
    rows = []
    for p in percentages:
        if not 0 < p <= 1:
            raise ValueError(f"percentages are fractions in (0, 1], got {p}")
        n = int(p * total)  # MIB's int(pct * n_scored_items)
        if by_node:
            keep = node_keep(g, scores, n, absolute)
        else:
            chosen = torch.zeros(g.n_edges)
            chosen[torch.from_numpy(_top(scores, n, absolute).copy())] = 1.0
            keep = g.mask_from_vector(chosen)
        keep = prune(g, keep)
        value = runner.metric_of(metric, keep)
        rows.append({"fraction": float(p), "n_chosen": n, "n_edges": int(keep.sum()),
                     "metric": value, "faithfulness": (value - corrupted) / (clean - corrupted)})
    frame = pd.DataFrame(rows)
    frame.attrs.update(clean=clean, corrupted=corrupted, absolute=absolute)
    return frame


def roc_points(scores: Numbers, positive: Numbers, percentages: Sequence[float] = PERCENTAGES,
               exclude: Optional[np.ndarray] = None) -> pd.DataFrame:
    """TPR and FPR of the top-n edges by |score| at each fraction (MIB's ``evaluate_area_under_roc``,
    with top-n for its greedy growth); ``exclude``: edges the truth does not decide, left out."""
    scores, positive = np.asarray(scores, dtype=float), np.asarray(positive, dtype=bool)
    if exclude is not None:
        scores, positive = scores[~exclude], positive[~exclude]
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUROC needs edges in and out of the circuit: {n_pos} in, {n_neg} out")
    rows = []
    for p in percentages:
        chosen = np.zeros(len(scores), dtype=bool)
        chosen[_top(scores, int(p * len(scores)), True)] = True
        rows.append({"fraction": float(p), "TPR": (chosen & positive).sum() / n_pos,
                     "FPR": (chosen & ~positive).sum() / n_neg})
    return pd.DataFrame(rows)


def mib_auroc(scores: Numbers, graph: ComputationGraph, truth: Sequence[str], exclude: Sequence[str] = (),
              percentages: Sequence[float] = PERCENTAGES) -> dict:
    """MIB's AUROC of edge ``scores`` against the ``truth`` edges (labels), and the plain rank AUROC."""
    labels = list(graph.edges["edge"])
    unknown = sorted((set(truth) | set(exclude)) - set(labels))
    if unknown:
        raise ValueError(f"edges {unknown[:3]} are not in the model's graph ({len(labels)} edges)")
    positive = np.isin(labels, list(truth))
    skip = np.isin(labels, list(exclude))
    points = roc_points(scores, positive, percentages, skip)
    return {"auroc_mib": roc_area(points["FPR"], points["TPR"]),
            "auroc_rank": auroc(np.abs(np.asarray(scores, dtype=float))[~skip], positive[~skip])}


# ---- methods -------------------------------------------------------------------------------------
def _toward_clean(table: pd.DataFrame) -> np.ndarray:
    """Importance from the workbench's score (metric(edge corrupted) - metric(clean)): positive when the
    edge moves the metric toward the clean run."""
    gap = table.attrs["clean"] - table.attrs["corrupted"]
    return -table["score"].to_numpy(dtype=float) * (1.0 if gap >= 0 else -1.0)


def _edge_method(name: str, steps: int = 8) -> EdgeScorer:
    def score(model, ds, metric) -> np.ndarray:
        from workbench.analysis.circuits.eap import edge_attribution

        return _toward_clean(edge_attribution(model, ds, metric, name, steps=steps))

    score.__name__ = name
    return score


def _acdc(model, ds, metric, threshold: float = 0.01) -> np.ndarray:
    """ACDC's per-edge score: the distance from the clean run an edge added when ACDC tried removing it."""
    from workbench.analysis.circuits.acdc import acdc

    runner = EdgeRunner(model, ds)
    _, scores = acdc(runner, metric, threshold, kl=False)
    return np.asarray(scores, dtype=float)


def _node_method(name: str) -> Callable:
    def score(model, ds, metric) -> dict:
        from workbench.analysis.circuits.eap import node_attribution

        table = node_attribution(model, ds, metric, name)
        clean_minus_corrupted = np.sign(_gap(model, ds, metric)) or 1.0
        return {node: -float(s) * clean_minus_corrupted for node, s in zip(table["node"], table["score"])}

    score.__name__ = name
    return score


def _gap(model, ds, metric) -> float:
    clean, corrupted = EdgeRunner(model, ds).endpoints(metric)
    return clean - corrupted


# Path patching of one sender into one receiver input is that edge's exact patch (path_patching's
# docstring), so at edge level "path-patching" scores every edge by it: the same numbers as "exact".
METHODS: dict[str, Callable] = {
    "exact": _edge_method("exact"),
    "path-patching": _edge_method("exact"),
    "eap": _edge_method("eap"),
    "eap-ig": _edge_method("eap-ig"),
    "acdc": _acdc,
    "activation": _node_method("activation"),
    "attribution": _node_method("attribution"),
}
NODE_LEVEL = ("activation", "attribution")


def method_scores(model, ds, metric, method: Union[str, Callable]) -> Union[np.ndarray, dict]:
    """A method's importance per edge (or per node, for a node-level method): a registered name or a
    function ``(model, ds, metric) -> scores``."""
    if isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"unknown circuit method {method!r}; registered: {sorted(METHODS)} (or pass a function "
                             "(model, ds, metric) -> one score per edge)")
        method = METHODS[method]
    elif not callable(method):
        raise ValueError(f"method must be a registered name ({sorted(METHODS)}) or a function, got {method!r}")
    return method(model, ds, metric)


def score_method(model, ds, metric, method: Union[str, Callable], truth: Optional[Sequence[str]] = None,
                 exclude: Sequence[str] = (), percentages: Sequence[float] = PERCENTAGES,
                 eval_ds=None, eval_metric: Optional[Callable] = None) -> dict:
    """CPR, CMD (and, with ``truth``, MIB's AUROC and the rank AUROC) of one method.

    The method scores edges on ``ds`` with ``metric``; the circuits are evaluated on ``eval_ds``
    with ``eval_metric`` (default: the same prompts), as MIB finds circuits on one split and
    scores them on another. Also returned: the two curves, ``curve_signed`` and ``curve_absolute``."""
    scores = method_scores(model, ds, metric, method)
    eval_ds = ds if eval_ds is None else eval_ds
    eval_metric = metric if eval_metric is None else eval_metric
    signed = faithfulness_curve(model, eval_ds, eval_metric, scores, absolute=False, percentages=percentages)
    absolute = faithfulness_curve(model, eval_ds, eval_metric, scores, absolute=True, percentages=percentages)
    out = {"cpr": cpr(signed), "cmd": cmd(absolute), "curve_signed": signed, "curve_absolute": absolute}
    if truth is not None:
        if isinstance(scores, dict):
            out.update(auroc_mib=float("nan"), auroc_rank=float("nan"))  # node scores: no edge ranking to compare
        else:
            out.update(mib_auroc(scores, ComputationGraph(model), truth, exclude, percentages))
    return out


__all__ = ["PERCENTAGES", "METHODS", "NODE_LEVEL", "area_under", "cpr", "cmd", "roc_area", "roc_points",
           "faithfulness_curve", "node_keep", "mib_auroc", "method_scores", "score_method"]
