"""A circuit: a set of edges of one model's graph that can be saved, loaded, checked, scored and drawn.

    circuit = discover_circuit(model, ds, metric, method="acdc", threshold=0.01)
    faithfulness(model, circuit, ds, metric)     # the metric kept with only the circuit's edges
    evaluate_circuit(model, circuit, ds, metric) # faithfulness, completeness, minimality in one row
    circuit.save("ioi.json"); Circuit.load("ioi.json", model)
    edge_auroc(scores, truth)                    # how well a score table ranks known edges

Running "only the circuit" means every edge outside it reads the sender's corrupted
output (the run on the corrupted prompts), so with no edges it is the corrupted run and
with all of them the clean run. The three numbers, with m(.) the metric of such a run, G the
whole graph and 0 no edges:

* faithfulness = (m(C) - m(0)) / (m(G) - m(0)): the share of the behaviour the circuit keeps;
* completeness = (m(G) - m(G \\ C)) / (m(G) - m(0)): the share lost when only the circuit's
  edges are corrupted (1: nothing outside the circuit does the job as well);
* minimality = the fraction of the circuit's edges whose removal from it moves the metric by
  more than ``tol`` of the gap (1: no passenger edges).

A circuit file records the model it was found on (name, graph sizes, a hash of the
weights); loading it against another model is refused with both named.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from workbench.analysis.circuits.acdc import acdc
from workbench.analysis.circuits.edges import EdgeRunner, MetricLike
from workbench.analysis.circuits.eap import EDGE_METHODS, edge_attribution
from workbench.analysis.circuits.graph import ComputationGraph, EdgeSpec, _as_tuple, receiver_label, sender_label
from workbench.analysis.common import ProgressLike, check_choice
from workbench.utils import check_float, check_int

CIRCUIT_FORMAT = "workbench.circuit"
DISCOVERY_METHODS = ("acdc", *EDGE_METHODS)


def model_fingerprint(model) -> str:
    """sha256 of the weights (names, shapes and bytes, in name order): which trained model this is."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(t.shape)};".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def _describe(model_info: dict) -> str:
    g = model_info["graph"]
    name = model_info.get("name") or "(unnamed)"
    return f"{name!r} ({g['n_layers']} layers x {g['n_heads']} heads, {g['layout']} layout)"


@dataclass
class Circuit:
    """Edges (labels like ``L0H3 -> L1H4.k``) of the model described by ``model``."""

    edges: list[str]
    model: dict
    method: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    # ---- building ------------------------------------------------------------------------
    @classmethod
    def from_edges(cls, model, edges: Sequence[EdgeSpec], method: str = "", scores: Optional[dict] = None,
                   meta: Optional[dict] = None, graph: Optional[ComputationGraph] = None) -> "Circuit":
        """A circuit of ``model`` made of ``edges`` (labels, (sender, receiver) tuples or indices)."""
        graph = ComputationGraph(model) if graph is None else graph
        idx = sorted(set(graph.edge_indices(edges)))
        info = {"name": model.cfg.name, "graph": graph.signature(), "fingerprint": model_fingerprint(model)}
        return cls([graph.edge_labels[i] for i in idx], info, method, dict(scores or {}), dict(meta or {}))

    @classmethod
    def from_mask(cls, model, graph: ComputationGraph, keep: Tensor, **kwargs) -> "Circuit":
        keep = (keep * graph.adjacency) > 0.5
        idx = [i for i, (s, r) in enumerate(zip(graph.edge_sender, graph.edge_receiver)) if bool(keep[s, r])]
        return cls.from_edges(model, idx, graph=graph, **kwargs)

    def __len__(self) -> int:
        return len(self.edges)

    def __repr__(self) -> str:
        return f"Circuit({len(self.edges)} edges of {_describe(self.model)}, method={self.method!r})"

    @property
    def nodes(self) -> list[str]:
        """Every node an edge of the circuit touches (heads named without their q/k/v input)."""
        found = []
        for edge in self.edges:
            sender, receiver = (part.strip() for part in edge.split("->"))
            for label in (sender, receiver.split(".")[0]):
                if label not in found:
                    found.append(label)
        return found

    def mask(self, graph: ComputationGraph) -> Tensor:
        return graph.mask_of(self.edges) if self.edges else torch.zeros(graph.adjacency.shape)

    def to_frame(self) -> pd.DataFrame:
        """One row per edge: edge, sender, receiver, sender_layer/head, receiver_layer/head, input, score."""
        rows = []
        for edge in self.edges:
            s, r = (_as_tuple(part.strip()) for part in edge.split("->"))
            rows.append({
                "edge": edge, "sender": sender_label(s), "receiver": receiver_label(r),
                "sender_layer": ComputationGraph._layer(s), "sender_head": ComputationGraph._head(s),
                "receiver_layer": ComputationGraph._layer(r), "receiver_head": ComputationGraph._head(r),
                "input": ComputationGraph._input(r), "score": self.scores.get(edge, np.nan),
            })
        columns = ["edge", "sender", "receiver", "sender_layer", "sender_head", "receiver_layer", "receiver_head",
                   "input", "score"]
        frame = pd.DataFrame(rows, columns=columns)
        frame.attrs.update(n_layers=self.model["graph"]["n_layers"], n_heads=self.model["graph"]["n_heads"])
        return frame

    # ---- checking it belongs to a model ----------------------------------------------------
    def check(self, model, check_weights: bool = True, source: str = "the circuit") -> ComputationGraph:
        """The model's graph, after checking the circuit was found on this model (ValueError if not)."""
        graph = ComputationGraph(model)
        here = {"name": model.cfg.name, "graph": graph.signature()}
        if self.model.get("graph") != here["graph"]:
            raise ValueError(f"{source} was found on model {_describe(self.model)}; this model is {_describe(here)}: "
                             "its edges name nodes of that model's graph, not this one's")
        if check_weights and self.model.get("fingerprint") not in (None, model_fingerprint(model)):
            raise ValueError(f"{source} was found on model {_describe(self.model)} with weights "
                             f"{self.model['fingerprint'][:12]}; this model's weights are {model_fingerprint(model)[:12]} "
                             "(another training, or edited weights): pass check_weights=False to apply it anyway")
        graph.edge_indices(self.edges)  # every edge names a node of this graph
        return graph

    # ---- files ---------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"format": CIRCUIT_FORMAT, "version": 1, "model": self.model, "method": self.method,
                           "edges": self.edges, "scores": self.scores, "meta": self.meta}, indent=2, default=float)

    def save(self, path: Union[str, Path], *, overwrite: bool = False) -> Path:
        """Write the circuit file ``path`` (by rename). A file there is replaced only when it is a circuit
        file; any other raises ValueError, nothing written, unless ``overwrite=True``."""
        from workbench.overwrite import is_json_with, refuse_foreign, write_atomic

        path = Path(path)
        refuse_foreign([path], lambda p: is_json_with(p, format=CIRCUIT_FORMAT), overwrite=overwrite,
                       what="saving the circuit")
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: Union[str, Path], model=None, check_weights: bool = True) -> "Circuit":
        """Read a circuit file; with ``model``, check it was found on that model (ValueError naming both if not)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"circuit file {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a circuit file: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != CIRCUIT_FORMAT:
            raise ValueError(f"{path} is not a circuit file (no \"format\": \"{CIRCUIT_FORMAT}\")")
        missing = [k for k in ("model", "edges") if k not in data]
        if missing or not isinstance(data["edges"], list) or not isinstance(data["model"], dict) \
                or "graph" not in data["model"]:
            raise ValueError(f"{path} is not a complete circuit file: missing {missing or ['model.graph']}")
        try:
            circuit = cls([str(e) for e in data["edges"]], data["model"], data.get("method", ""),
                          {str(k): float(v) for k, v in data.get("scores", {}).items()}, data.get("meta", {}))
        except (TypeError, AttributeError, ValueError) as e:  # a field of the wrong type
            raise ValueError(f"{path} is not a valid circuit file ({type(e).__name__}: {e})") from None
        if model is not None:
            circuit.check(model, check_weights, source=f"the circuit in {path}")
        return circuit


# ---- pruning -----------------------------------------------------------------------------------
def prune(graph: ComputationGraph, keep: Tensor) -> Tensor:
    """``keep`` without edges that cannot matter: into a node whose output no kept edge reads, and
    out of a node none of whose inputs is kept (it computes its corrupted output either way)."""
    keep = (keep * graph.adjacency).clone()
    receivers_of = {}
    for r in range(len(graph.receivers)):
        receivers_of.setdefault(graph.node_of_receiver(r), []).append(r)
    changed = True
    while changed:
        changed = False
        for s, node in enumerate(graph.senders):
            if node[0] == "embed":
                continue
            inputs = receivers_of[node]
            read = bool(keep[s].any())
            fed = bool(keep[:, inputs].any())
            if read and not fed:
                keep[s] = 0.0
                changed = True
            if fed and not read:
                keep[:, inputs] = 0.0
                changed = True
    return keep


# ---- evaluation ----------------------------------------------------------------------------------
def _runner_for(model, circuit: Circuit, ds, check_weights: bool) -> EdgeRunner:
    graph = circuit.check(model, check_weights)
    return EdgeRunner(model, ds, graph)


def faithfulness(model, circuit: Circuit, ds, metric: MetricLike = None, check_weights: bool = True) -> float:
    """(m(circuit) - m(corrupted)) / (m(clean) - m(corrupted)): 1 keeps all the behaviour, 0 none."""
    runner = _runner_for(model, circuit, ds, check_weights)
    fn = runner.resolve_metric(metric)
    clean, corrupted = runner.endpoints(fn)
    value = runner.metric_of(fn, circuit.mask(runner.graph))
    return (value - corrupted) / (clean - corrupted) if clean != corrupted else float("nan")


def evaluate_circuit(model, circuit: Circuit, ds, metric: MetricLike = None, tol: float = 0.01,
                     minimality: bool = True, check_weights: bool = True) -> pd.DataFrame:
    """One row: n_edges, n_nodes, the metric of the clean, corrupted, circuit-only and
    circuit-removed runs, faithfulness, completeness and (when ``minimality``, one run per edge)
    minimality. ``attrs["edges"]``: each edge's own contribution (faithfulness lost without it)."""
    tol = check_float("tol", tol, 0)
    runner = _runner_for(model, circuit, ds, check_weights)
    g = runner.graph
    fn = runner.resolve_metric(metric)
    clean, corrupted = runner.endpoints(fn)
    gap = clean - corrupted
    mask = circuit.mask(g)
    with_circuit = runner.metric_of(fn, mask)
    without = runner.metric_of(fn, g.full_mask() - mask)
    row = {"n_edges": len(circuit), "n_nodes": len(circuit.nodes), "metric_clean": clean,
           "metric_corrupted": corrupted, "metric_circuit": with_circuit, "metric_without_circuit": without,
           "faithfulness": (with_circuit - corrupted) / gap if gap else np.nan,
           "completeness": (clean - without) / gap if gap else np.nan}
    contributions = pd.DataFrame(columns=["edge", "contribution"])
    if minimality:
        drops = []
        for edge in circuit.edges:
            e = g.edge_index(edge)
            trial = mask.clone()
            trial[g.edge_sender[e], g.edge_receiver[e]] = 0.0
            drops.append((with_circuit - runner.metric_of(fn, trial)) / gap if gap else np.nan)
        contributions = pd.DataFrame({"edge": circuit.edges, "contribution": drops})
        row["minimality"] = float((contributions["contribution"].abs() > tol).mean()) if len(drops) else np.nan
    frame = pd.DataFrame([row])
    frame.attrs["edges"] = contributions
    return frame


# ---- discovery ---------------------------------------------------------------------------------------
def discover_circuit(
    model,
    ds,
    metric: MetricLike = None,
    method: str = "acdc",
    threshold: float = 0.01,
    top_k: Optional[int] = None,
    steps: int = 16,
    progress: ProgressLike = False,
) -> Circuit:
    """A circuit found by ``method``, pruned of edges that cannot matter (``prune``).

    ``acdc``: greedy pruning at ``threshold`` (see ``workbench.analysis.circuits.acdc``).
    ``exact``, ``eap``, ``eap-ig``: the edges whose |score| is at least ``threshold`` of the
    clean-corrupted gap of the metric (of the corrupted run's KL with the KL metric), or, when
    ``top_k`` is given (1 .. the graph's edge count), the ``top_k`` edges of largest |score|,
    equal scores taken in the graph's edge order; pruning may then drop some of them.
    ``circuit.scores`` keeps every edge's score; ``circuit.meta`` the settings and the time taken.
    """
    check_choice("method", method, DISCOVERY_METHODS)
    threshold = check_float("threshold", threshold, 0)
    graph = ComputationGraph(model)
    if top_k is not None:
        if method == "acdc":  # its pruning decides edge by edge; there is no ranking to cut at k
            raise ValueError("top_k applies to the scoring methods (exact, eap, eap-ig); acdc keeps the edges "
                             "its greedy pruning at threshold keeps: pass top_k=None with method='acdc'")
        top_k = check_int("top_k", top_k, 1, graph.n_edges)
    started = time.perf_counter()
    runner = EdgeRunner(model, ds, graph)
    g = runner.graph
    kl = metric is None or (isinstance(metric, str) and metric == "kl")
    fn = runner.resolve_metric(metric)
    if method == "acdc":
        keep, scores = acdc(runner, fn, threshold, kl, progress)
    else:
        table = edge_attribution(model, (runner.clean, runner.corrupted), metric, method, steps, graph=g,
                                 progress=progress)
        scores = table["score"].to_numpy()
        clean, corrupted = table.attrs["clean"], table.attrs["corrupted"]
        gap = abs(clean - corrupted) or 1.0
        chosen = (np.argsort(-np.abs(scores), kind="stable")[:top_k] if top_k is not None
                  else np.nonzero(np.abs(scores) / gap >= threshold)[0])
        keep = g.mask_from_vector(torch.from_numpy(np.isin(np.arange(g.n_edges), chosen)).float())
    keep = prune(g, keep)
    meta = {"threshold": threshold, "top_k": top_k, "metric": "kl" if kl else getattr(fn, "__name__", "metric"),
            "seconds": time.perf_counter() - started, "batch": int(runner.clean.shape[0]),
            "n_pos": int(runner.clean.shape[1])}
    if method == "eap-ig":
        meta["steps"] = steps
    return Circuit.from_mask(model, g, keep, method=method, meta=meta,
                             scores={label: float(v) for label, v in zip(g.edge_labels, scores)})


# ---- scoring a method against known edges --------------------------------------------------------
def auroc(scores: Union[np.ndarray, pd.Series, Sequence[float]],
          positive: Union[np.ndarray, pd.Series, Sequence[bool]]) -> float:
    """Area under the ROC curve of ``scores`` for the ``positive`` labels (ties count half);
    NaN when either class is empty. The Mann-Whitney statistic over average ranks."""
    scores, positive = np.asarray(scores, dtype=float), np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = pd.Series(scores).rank(method="average").to_numpy()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def edge_auroc(table: pd.DataFrame, truth: Sequence[str], exclude: Sequence[str] = (),
               column: str = "abs_score") -> float:
    """AUROC of ``table[column]`` (one row per edge, an ``edge`` column) for the edges in ``truth``,
    leaving out the edges in ``exclude`` (those the ground truth does not decide)."""
    unknown = sorted((set(truth) | set(exclude)) - set(table["edge"]))
    if unknown:
        raise ValueError(f"edges {unknown[:3]} are not in the table (it has {len(table)} edges)")
    rows = table[~table["edge"].isin(set(exclude))]
    return auroc(rows[column].to_numpy(), rows["edge"].isin(set(truth)).to_numpy())


def node_scores(table: pd.DataFrame, column: str = "abs_score") -> pd.DataFrame:
    """Per head, the largest ``column`` of any edge into or out of it: node, layer, head, abs_score."""
    heads = {}
    for sender, receiver, value in zip(table["sender"], table["receiver"], table[column]):
        for label in (sender, receiver.split(".")[0]):
            if "H" in label:
                heads[label] = max(heads.get(label, 0.0), float(abs(value)))
    rows = [(label, int(label[1:label.index("H")]), int(label[label.index("H") + 1:]), value)
            for label, value in heads.items()]
    return pd.DataFrame(rows, columns=["node", "layer", "head", "abs_score"]).sort_values(["layer", "head"],
                                                                                           ignore_index=True)


def truth_nodes(truth: Sequence[str]) -> set[str]:
    """The heads the edges in ``truth`` touch."""
    found = set()
    for edge in truth:
        for part in edge.split("->"):
            label = part.strip().split(".")[0]
            if "H" in label:
                found.add(label)
    return found


__all__ = ["Circuit", "prune", "faithfulness", "evaluate_circuit", "discover_circuit", "auroc", "edge_auroc",
           "node_scores", "truth_nodes", "model_fingerprint"]
