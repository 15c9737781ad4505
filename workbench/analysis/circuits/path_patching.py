"""Path patching (Wang et al. 2022; Goldowsky-Dill et al. 2023): a sender's corrupted output along direct paths only.

    path_patching(model, ds, sender=("head", 0, 3), receivers=[("head", 1, 4, "k")])

The receivers read the sender's corrupted output; every other reader of the sender, and
every other input of the receivers, stays clean, and everything downstream of the receivers
is recomputed. In the edge graph that is the set of edges sender -> receiver corrupted
together, so one sender into one receiver input is exactly that edge's patch
(``edge_patching``); several receivers are patched at once, which single edges cannot do.
With ``sender=None`` every sender that can reach all the receivers is tried, one row each
(the IOI paper's "which heads write into the name movers' queries").
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd

from workbench.analysis.circuits.edges import EdgeRunner, MetricLike
from workbench.analysis.circuits.graph import ComputationGraph


def path_patching(
    model,
    ds,
    metric: MetricLike = None,
    sender=None,
    receivers: Optional[Sequence] = None,
    graph: Optional[ComputationGraph] = None,
) -> pd.DataFrame:
    """The metric with ``sender``'s corrupted output fed only to ``receivers`` (default: the logits).

    ``metric``: a function of the logits, or None / ``"kl"`` for the mean KL from the clean run.
    One row per sender: sender, receivers (labels joined by ", "), metric, clean, corrupted,
    score (metric - clean) and restored-style ``fraction`` = score / (corrupted - clean).
    """
    runner = EdgeRunner(model, ds, graph)
    g = runner.graph
    fn = runner.resolve_metric(metric)
    if receivers is None:
        receivers = [("logits",)]
    elif isinstance(receivers, (str, tuple)):
        receivers = [receivers]
    r_idx = [g.receiver_index(r) for r in receivers]
    if not r_idx:
        raise ValueError("receivers is empty: name at least one receiver (e.g. ('head', 1, 4, 'k') or 'logits')")
    if sender is None:
        s_idx = [s for s in range(len(g.senders)) if all(bool(g.adjacency[s, r]) for r in r_idx)]
    else:
        s_idx = [g.sender_index(sender)]
        for r in r_idx:
            g.edge_index((g.senders[s_idx[0]], g.receivers[r]))  # names the edge if it does not exist
    clean, corrupted = runner.endpoints(fn)
    rows = []
    for s in s_idx:
        keep = g.full_mask()
        keep[s, r_idx] = 0.0
        value = runner.metric_of(fn, keep)
        rows.append((g.sender_labels[s], ", ".join(g.receiver_labels[r] for r in r_idx), value))
    frame = pd.DataFrame(rows, columns=["sender", "receivers", "metric"])
    frame["clean"], frame["corrupted"] = clean, corrupted
    frame["score"] = frame["metric"] - clean
    gap = corrupted - clean
    frame["fraction"] = frame["score"] / gap if gap != 0 else float("nan")
    return frame
