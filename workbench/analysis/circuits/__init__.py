"""Circuits: edges between components, the interventions on them, and the methods that find them.

    graph.py          ComputationGraph: senders (embed, heads, MLPs), receivers (each head's q, k, v;
                      each MLP; the logits) and the edges between them; labels and masks
    edges.py          EdgeRunner (node-by-node forward with any edges corrupted) and exact single-edge
                      patching resumed from the receiver (workbench.analysis.resume, Block.resume)
    eap.py            edge_attribution: exact, EAP, EAP-IG, one row per edge; node_attribution for the
                      node-level methods of patching.py
    acdc.py           ACDC-style greedy pruning
    path_patching.py  a sender's corrupted output along direct paths to chosen receivers
    circuit.py        Circuit (JSON save/load, checked against the model), prune, faithfulness,
                      evaluate_circuit, discover_circuit, AUROC against known edges
    tasks.py          a checkpoint's own prompt sets and metrics for circuit work, one method run with
                      its score table and faithfulness (run_method), two circuits' agreement
"""

from workbench.analysis.circuits.circuit import (
    Circuit,
    auroc,
    discover_circuit,
    edge_auroc,
    evaluate_circuit,
    faithfulness,
    model_fingerprint,
    node_scores,
    prune,
    truth_nodes,
)
from workbench.analysis.circuits.eap import EDGE_METHODS, NODE_METHODS, edge_attribution, node_attribution
from workbench.analysis.circuits.edges import EdgeRunner, edge_patching, head_z, kl_metric, metric_value, prompt_pair
from workbench.analysis.circuits.graph import ComputationGraph
from workbench.analysis.circuits.path_patching import path_patching
from workbench.analysis.circuits.tasks import (
    METRIC_LABELS,
    PROMPT_SOURCES,
    CircuitPrompts,
    MethodRun,
    circuit_agreement,
    circuit_prompts,
    prompt_sources,
    prompt_spec,
    run_method,
)

__all__ = [
    "ComputationGraph", "EdgeRunner", "edge_patching", "head_z", "kl_metric", "metric_value", "prompt_pair",
    "EDGE_METHODS", "NODE_METHODS", "edge_attribution", "node_attribution", "path_patching",
    "Circuit", "prune", "faithfulness", "evaluate_circuit", "discover_circuit", "auroc", "edge_auroc",
    "node_scores", "truth_nodes", "model_fingerprint",
    "PROMPT_SOURCES", "METRIC_LABELS", "CircuitPrompts", "MethodRun", "prompt_spec", "prompt_sources",
    "circuit_prompts", "run_method", "circuit_agreement",
]
