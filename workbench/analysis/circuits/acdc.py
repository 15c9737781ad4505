"""ACDC-style greedy pruning (Conmy et al. 2023): remove every edge whose removal costs less than a threshold.

Starting from the whole graph, receivers are visited from the logits back to the first
layer, and each of a receiver's incoming edges (latest sender first) is tentatively
corrupted; it stays corrupted when the run moves away from the clean run by less than
``threshold``, else it is put back. Distance from the clean run is

* ``metric="kl"`` (or None): the mean KL(clean || run) of the next-token distributions, in nats;
* a task metric: |metric(run) - metric(clean)| / |metric(clean) - metric(corrupted)|, so the
  threshold is a fraction of the clean-corrupted gap and means the same on every task.

Visiting in reverse forward order means every node below the receiver still has all its
inputs, so each trial run starts at the receiver's stage from the clean run's outputs
(``EdgeRunner.run``): a trial near the logits costs almost nothing. A node none of whose
outputs is read any more is skipped whole (its inputs cannot matter), as ACDC does.

Each edge's ``score`` is the distance it added when tried (negative when removing it moved
the run closer to clean); ranking by it is how the benchmark scores ACDC without a
threshold sweep.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

from workbench.analysis.circuits.edges import EdgeRunner
from workbench.analysis.common import Progress, ProgressLike


def distance_fn(runner: EdgeRunner, metric: Callable[[Tensor], Tensor], kl: bool) -> Callable[[float], float]:
    """How far a metric value is from the clean run's (see the module docstring)."""
    if kl:
        return lambda value: value
    clean, corrupted = runner.endpoints(metric)
    gap = abs(clean - corrupted)
    if gap == 0:
        raise ValueError(f"the metric is {clean:.6g} on both the clean and the corrupted prompts, so no edge can matter; "
                         "pick prompts (or a metric) that tell the two apart")
    return lambda value: abs(value - clean) / gap


def acdc(runner: EdgeRunner, metric: Callable[[Tensor], Tensor], threshold: float, kl: bool,
         progress: ProgressLike = False, start: Optional[Tensor] = None) -> tuple[Tensor, np.ndarray]:
    """(the kept-edge mask [senders, receivers], each edge's score) after greedy pruning;
    ``progress`` (True: a tqdm bar; or ``progress(done, total)``) counts receivers visited.

    ``start``: a mask [senders, receivers] to prune from instead of the whole graph (its edges are
    the only ones tried; every other edge is corrupted from the start, and scores 0). On a model
    too large to try every edge, ACDC restricted to the top edges of a cheaper method's ranking."""
    runner.check_weights(full=True)  # once, not per trial: each run checks the cheap stamp only
    g = runner.graph
    distance = distance_fn(runner, metric, kl)
    keep = g.full_mask()
    if start is not None:
        if tuple(start.shape) != tuple(keep.shape):
            raise ValueError(f"start must be a mask of shape {tuple(keep.shape)} [senders, receivers], "
                             f"got {tuple(start.shape)}")
        keep = (start.to(keep) * g.adjacency > 0.5).to(keep.dtype)
    whole = None if start is not None else int(g.receiver_stage.max()) + 1  # the whole graph: the clean run
    current = distance(runner.metric_of(metric, keep, from_stage=whole))
    scores = np.zeros(g.n_edges)
    adjacency = g.adjacency.numpy()
    sender_of_node = {node: i for i, node in enumerate(g.senders)}
    bar = Progress(progress, len(g.receivers), "ACDC")
    for r in _counted(range(len(g.receivers) - 1, -1, -1), bar):
        senders = np.nonzero(adjacency[:, r] * keep[:, r].numpy())[0][::-1]
        node = g.node_of_receiver(r)
        if node[0] != "logits" and not bool(keep[sender_of_node[node]].any()):
            keep[senders.copy(), r] = 0.0  # nothing reads this node any more: its inputs cannot matter
            continue
        for s in senders:
            keep[s, r] = 0.0
            with torch.no_grad():
                trial = distance(runner.metric_of(metric, keep))
            e = g._edge_index[(int(s), int(r))]
            scores[e] = trial - current
            if trial - current < threshold:
                current = trial
            else:
                keep[s, r] = 1.0
    return keep, scores


def _counted(items, bar: Progress):
    """``items``, with ``bar`` moved on once each item's work is done (when the next is asked for)."""
    for item in items:
        yield item
        bar.update()
    bar.close()
