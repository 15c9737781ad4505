"""Attribution graphs (Ameisen et al. 2025, "Circuit tracing"; the circuit-tracer library's method).

    replacement.py  the replacement model: transcoders (per layer or cross-layer) for the MLPs, norm
                    scales and attention queries/keys frozen by hooks, an error node per layer and position
    attribute.py    attribution_graph: direct effects by backward passes, sparse rows, influence-guided
                    choice of which features to expand
    graph.py        Graph: node table and edges, influence, pruning, DataFrames, JSON (ours and
                    circuit-tracer's), interventions on the replacement model
    qk.py           qk_attribution: an attention score split into (query node, key node) pairs
    loadings.py     head_loadings: a graph edge split over the heads of one attention layer
    paths.py        widest_path: the strongest chain of edges between two nodes; measured_edge: an edge
                    re-measured by zeroing its source in the frozen replacement model
    checks.py       what a graph checks before trusting its inputs: fingerprints and binding, dictionaries
                    of another model, QK contexts, non-finite weights and activations
"""

from workbench.analysis.graphs.attribute import attribution_graph, logit_targets
from workbench.analysis.graphs.checks import UnverifiedGraphWarning
from workbench.analysis.graphs.graph import (NODE_KINDS, Graph, PruneResult, Supernode, collapse_frames,
                                            compute_influence_sparse)
from workbench.analysis.graphs.loadings import head_loadings
from workbench.analysis.graphs.paths import measured_edge, widest_path
from workbench.analysis.graphs.qk import attention_entries, qk_attribution, qk_table
from workbench.analysis.graphs.replacement import (CLTView, TranscoderSet, capture, check_model, frozen_forward,
                                                   live_forward, replacement_set)

__all__ = ["attribution_graph", "qk_attribution", "qk_table", "attention_entries", "head_loadings", "logit_targets",
           "NODE_KINDS", "Graph", "PruneResult", "Supernode", "compute_influence_sparse",
           "collapse_frames", "CLTView", "TranscoderSet", "capture", "check_model", "frozen_forward", "live_forward", "replacement_set",
           "UnverifiedGraphWarning", "widest_path", "measured_edge"]
