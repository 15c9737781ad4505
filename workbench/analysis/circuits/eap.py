"""Scores for every edge at once: exact patching, edge attribution patching (EAP) and EAP-IG.

    scores = edge_attribution(model, ds, metric, method="eap-ig", steps=16)   # one row per edge

Every method estimates the same number: ``score`` = metric(clean run with that one edge
corrupted) - metric(clean run). ``exact`` measures it (``edge_patching``, one resumed
partial forward per edge). ``eap`` (Syed et al. 2023) takes the first-order estimate from
one forward and one backward pass on the clean run: (corrupted - clean output of the
sender) . d metric / d (receiver input). ``eap-ig`` (Hanna et al. 2024) averages that
gradient over ``steps`` runs whose input embeddings lie between the clean and the corrupted
ones (midpoints of ``steps`` equal intervals), which helps where the first-order estimate
fails: a saturated softmax has almost no gradient at the clean point even when moving the
key changes everything.

``node_attribution`` puts the node-level methods of ``workbench.analysis.patching``
(activation patching, attribution patching) on the same footing: one row per head, the same
sign convention (corrupt that head in the clean run).
"""

from __future__ import annotations

import time
from typing import Optional

import pandas as pd
import torch

from workbench.analysis.circuits.edges import EdgeRunner, MetricLike, default_stack, edge_effects, prompt_pair
from workbench.analysis.circuits.graph import ComputationGraph
from workbench.analysis.common import Progress, ProgressLike, check_choice
from workbench.analysis.patching import activation_patching, attribution_patching
from workbench.utils import check_int

EDGE_METHODS = ("exact", "eap", "eap-ig")
NODE_METHODS = ("activation", "attribution")


def edge_attribution(
    model,
    ds,
    metric: MetricLike,
    method: str = "eap",
    steps: int = 16,
    stack: Optional[int] = None,
    progress: ProgressLike = False,
    graph: Optional[ComputationGraph] = None,
) -> pd.DataFrame:
    """Every edge's effect on ``metric`` by ``method`` (``exact``, ``eap``, ``eap-ig``).

    Columns: those of ``ComputationGraph.edges``, then score (the metric's change when the
    edge alone is corrupted, measured or estimated) and abs_score. ``attrs``: method,
    clean and corrupted (the metric of the two runs), seconds.
    """
    check_choice("method", method, EDGE_METHODS)
    steps = check_int("steps", steps, 1)
    if method == "eap" and (metric is None or (isinstance(metric, str) and metric == "kl")):
        raise ValueError("method='eap' with the KL metric scores every edge 0: the clean run is the KL's minimum, "
                         "so its gradient there vanishes; pass a task metric (e.g. logit_diff_metric) or use "
                         "method='eap-ig' or 'exact'")
    started = time.perf_counter()
    runner = EdgeRunner(model, ds, graph)
    fn = runner.resolve_metric(metric)
    clean, corrupted = runner.endpoints(fn)
    g = runner.graph
    if method == "exact":
        scores = torch.from_numpy(edge_effects(runner, fn, range(g.n_edges), default_stack(model, stack), progress) - clean)
    else:
        scores = _gradient_scores(runner, fn, 1 if method == "eap" else steps, method == "eap-ig", progress)
    frame = g.edges
    frame["score"] = scores.numpy().astype(float)
    frame["abs_score"] = frame["score"].abs()
    frame.attrs.update(method=method, clean=clean, corrupted=corrupted, seconds=time.perf_counter() - started)
    if method == "eap-ig":
        frame.attrs["steps"] = steps
    return frame


def _gradient_scores(runner: EdgeRunner, metric, steps: int, integrated: bool,
                     progress: ProgressLike = False) -> torch.Tensor:
    """(corrupted - clean sender output) . mean receiver-input gradient, for every edge.

    Each run's gradient is reduced to [senders, receivers] scores stage by stage
    (``EdgeRunner.receiver_scores``), never kept whole ([receivers, batch, pos, d_model] took
    7x the memory of a forward and backward at 1,024 tokens in benchmarks/eap_memory.py); the mean over the EAP-IG steps
    is taken of the scores, which are linear in the gradient.
    """
    g = runner.graph
    bar = Progress(progress, steps, "EAP-IG" if integrated else "EAP")
    if integrated:
        clean_embed, change = runner.clean_out[0], runner.delta[0]
        full = 0
        for k in range(steps):
            full = full + runner.receiver_scores(metric, clean_embed + (k + 0.5) / steps * change)
            bar.update()
        full = full / steps
    else:
        full = runner.receiver_scores(metric)
        bar.update()
    bar.close()
    return full[g.edge_sender, g.edge_receiver].float().cpu()


def node_attribution(model, ds, metric, method: str = "activation") -> pd.DataFrame:
    """Per-head scores from the node-level methods, with the edge methods' sign convention.

    ``activation``: exact activation patching of each head's output (all positions);
    ``attribution``: its gradient estimate. Both corrupt one head in the clean run, so score =
    metric(that run) - metric(clean). Columns: node (``L0H3``), layer, head, score, abs_score.
    """
    check_choice("method", method, NODE_METHODS)
    started = time.perf_counter()
    clean, corrupted = prompt_pair(model, ds)
    # The patching functions put the first prompt's activations into the second's run.
    if method == "activation":
        table = activation_patching(model, corrupted, clean, metric, sites="head")
        score = table["metric"] - table["corrupted"]
    else:
        table = attribution_patching(model, corrupted, clean, metric)
        score = table["attribution"]
    frame = pd.DataFrame({"node": [f"L{l}H{h}" for l, h in zip(table["layer"], table["head"])],
                          "layer": table["layer"].to_numpy(), "head": table["head"].to_numpy(),
                          "score": score.to_numpy().astype(float)})
    frame["abs_score"] = frame["score"].abs()
    frame.attrs.update(method=method, seconds=time.perf_counter() - started)
    return frame
