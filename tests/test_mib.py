"""MIB's circuit metrics (workbench.analysis.circuits.mib) against hand computations, and its machinery
on the hand-built induction model (exact truth, no checkpoint needed)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from workbench.analysis.circuits import ComputationGraph, mib
from workbench.planted.hand import BOS, HALF, TRUTH, build_hand_induction
from workbench.planted import spec_prompts, spec_metric

FIVE = (0.2, 0.4, 0.6, 0.8, 1.0)  # on 5 edges: circuits of 1, 2, 3, 4 and 5 edges


def test_cpr_and_cmd_equal_a_hand_computation_on_five_edges():
    curve = pd.DataFrame({"fraction": FIVE, "faithfulness": [0.1, 0.5, 0.9, 1.2, 1.0]})
    # trapezoids of width 0.2: (0.1+0.5)/2, (0.5+0.9)/2, (0.9+1.2)/2, (1.2+1.0)/2 -> 0.06+0.14+0.21+0.22
    assert mib.cpr(curve) == pytest.approx(0.63)
    # |1 - f| = 0.9, 0.5, 0.1, 0.2, 0 -> 0.14 + 0.06 + 0.03 + 0.02
    assert mib.cmd(curve) == pytest.approx(0.25)


def test_auroc_equals_a_hand_computation_on_five_edges():
    scores = np.array([0.9, -0.5, 0.3, 0.1, -0.05])  # |score| order: edges 0, 1, 2, 3, 4
    positive = np.array([True, False, True, False, False])
    points = mib.roc_points(scores, positive, FIVE)
    # top 1..5 edges: TPR 1/2, 1/2, 1, 1, 1; FPR 0, 1/3, 1/3, 2/3, 1
    assert points["TPR"].tolist() == pytest.approx([0.5, 0.5, 1, 1, 1])
    assert points["FPR"].tolist() == pytest.approx([0, 1 / 3, 1 / 3, 2 / 3, 1])
    # trapezoids: 1/3 * 0.5, 0, 1/3 * 1, 1/3 * 1
    assert mib.roc_area(points["FPR"], points["TPR"]) == pytest.approx(5 / 6)
    assert mib.roc_area([0.1, 0.5], [0.2, 1.0]) == pytest.approx((1 - 0.2) * 0.6)  # FPRs divided by the last


@pytest.fixture(scope="module")
def hand():
    model = build_hand_induction()
    spec = {"kind": "repeat", "half": HALF, "vocab": BOS, "bos": BOS, "distinct": True}
    clean, corrupted = spec_prompts(spec, 4, 0, model.device)
    return model, (clean, corrupted), spec_metric(spec, clean)


def test_the_curve_runs_from_the_empty_circuit_to_the_model(hand):
    model, ds, metric = hand
    g = ComputationGraph(model)
    truth = np.isin(g.edges["edge"], TRUTH).astype(float)
    curve = mib.faithfulness_curve(model, ds, metric, truth, percentages=(len(TRUTH) / g.n_edges * 1.0001, 1.0))
    assert curve["faithfulness"].iloc[-1] == pytest.approx(1.0)  # every edge: the clean run
    assert curve["n_chosen"].iloc[0] == len(TRUTH)
    assert curve["faithfulness"].iloc[0] == pytest.approx(1.0, abs=0.05)  # the planted circuit does the task
    # a ranking that puts the truth last keeps nothing of the behaviour at the same size
    last = mib.faithfulness_curve(model, ds, metric, -truth, percentages=(len(TRUTH) / g.n_edges * 1.0001,))
    assert last["faithfulness"].iloc[0] < 0.5


def test_a_user_method_and_the_registry(hand):
    model, ds, metric = hand
    g = ComputationGraph(model)
    oracle = lambda m, d, f: np.isin(g.edges["edge"], TRUTH).astype(float)  # noqa: E731
    result = mib.score_method(model, ds, metric, oracle, truth=TRUTH)
    assert result["auroc_rank"] == pytest.approx(1.0)
    assert 0 <= result["cmd"] <= 1
    with pytest.raises(ValueError, match="registered"):
        mib.score_method(model, ds, metric, "nope")
    with pytest.raises(ValueError, match="edges"):
        mib.faithfulness_curve(model, ds, metric, np.ones(3))


def test_node_keep_is_public_and_keeps_the_edges_between_kept_nodes():
    """``mib.node_keep`` (tutorial 11 and experiments/real_ioi.py use it; ``_node_keep`` stays as an
    alias): MIB's node circuit. Every head scored, the best one kept: its edges and those of every
    unscored node (embedding, MLPs, logits) stay, as the graph's own adjacency has them; every edge
    into or out of a dropped head goes."""
    graph = ComputationGraph(build_hand_induction())
    heads = [(s[1], s[2]) for s in graph.senders if s[0] == "head"]
    assert len(heads) >= 2
    best = heads[-1]
    scores = {f"L{l}H{h}": float((l, h) == best) for l, h in heads}
    keep = mib.node_keep(graph, scores, 1)
    assert mib._node_keep is mib.node_keep and "node_keep" in mib.__all__
    dropped = lambda node: node[0] == "head" and tuple(node[1:3]) != best  # noqa: E731
    for s, sender in enumerate(graph.senders):
        for r in range(len(graph.receivers)):
            expected = 0.0 if dropped(sender) or dropped(graph.node_of_receiver(r)) else float(graph.adjacency[s, r])
            assert float(keep[s, r]) == expected, (sender, graph.receivers[r])
    assert 0 < keep.sum() < graph.adjacency.sum()
    full = mib.node_keep(graph, scores, len(heads))  # every head kept: the whole graph
    assert full.equal(graph.adjacency.to(full.dtype))
