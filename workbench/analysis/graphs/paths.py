"""Reading one route through an attribution graph, and checking its edges by intervention.

    path = widest_path(pruned, source, target)        # node indices, source first
    measured_edge(graph, source, target)              # the edge, re-measured on the replacement model

``widest_path`` answers "which chain of direct effects carries the most of ``target``'s input from
``source``": the product of normalised edge weights along a path is the share of the target's input
that reaches it through that path, in the same normalisation as the graph's influence.
``measured_edge`` checks that an edge is what it claims: the source's direct effect on the target in
the graph's frozen replacement model, where every other node is held.
"""

from __future__ import annotations

import heapq
import math

import torch

from workbench.analysis.graphs.graph import NODE_KINDS
from workbench.utils import is_int

__all__ = ["widest_path", "measured_edge"]


def _node(graph, i, name: str) -> int:
    if not is_int(i) or not 0 <= int(i) < graph.n_nodes:
        raise ValueError(f"{name} must be a node index of this graph (0 to {graph.n_nodes - 1}), got {i!r}")
    return int(i)


def widest_path(graph, source: int, target: int, through_features: bool = False) -> list[int]:
    """The path from node ``source`` to node ``target`` of largest product of normalised |edge| weights.

    Each node's incoming |weights| are divided by their sum (the normalisation of the graph's
    influence), so a path's product is the share of ``target``'s input that arrives along it; the
    path is found by Dijkstra's algorithm on the costs ``-log(weight)``. ``through_features``: every
    node strictly between the two is a feature (no error node on the way, no direct source ->
    target edge). Returns node indices from ``source`` to ``target``, or ``[]`` when no path joins
    them. Reads the dense adjacency: for pruned graphs (thousands of nodes), not a full one.
    """
    source, target = _node(graph, source, "source"), _node(graph, target, "target")
    A = graph.adjacency().abs().double()
    A = A / A.sum(1, keepdim=True).clamp_min(1e-30)
    feature = (graph.kind == NODE_KINDS.index("feature")).tolist()
    best, prev, heap = {source: 0.0}, {}, [(0.0, source)]
    while heap:
        cost, node = heapq.heappop(heap)
        if node == target:
            break
        if cost > best.get(node, math.inf):
            continue
        for nxt in torch.nonzero(A[:, node]).flatten().tolist():  # edges out of node: column node
            if through_features and not (feature[nxt] or (nxt == target and node != source)):
                continue
            c = cost - math.log(float(A[nxt, node]))
            if c < best.get(nxt, math.inf):
                best[nxt], prev[nxt] = c, node
                heapq.heappush(heap, (c, nxt))
    if target not in best:
        return []
    path = [target]
    while path[-1] != source:
        path.append(prev[path[-1]])
    return path[::-1]


@torch.no_grad()
def measured_edge(graph, source: int, target: int) -> float:
    """Minus the change of node ``target`` when node ``source`` is zeroed in the graph's frozen
    replacement model, every other node held (feature activations, error vectors, token
    embeddings, attention patterns and norm scales): that model is linear in its nodes, so this
    equals the edge ``graph.edge(target, source)`` (0 where the graph kept no edge, up to the
    weights ``attribution_graph`` dropped as too small).

    The graph must be bound to its model and transcoders (``attribution_graph`` binds the graph it
    returns; ``graph.bind(model, transcoders)`` a loaded one). A feature source: its activation
    zeroed; an error source: its error vector; a token source: what its node carries (the
    embedding, or the token part of it with ``token_embedding="token"``). A feature target: its
    encoder pre-activation; a logit target: the value the graph attributes (its target direction
    at the unembedding input, e.g. a token's logit minus the mean logit). A pruned graph
    (``prune``, ``subgraph``) keeps its binding: its own node indices work.
    """
    from workbench.analysis.graphs.replacement import final_read, frozen_forward

    model, rs, cap = graph._bound()
    source, target = _node(graph, source, "source"), _node(graph, target, "target")
    kind, t_kind = NODE_KINDS[int(graph.kind[source])], NODE_KINDS[int(graph.kind[target])]
    if kind == "logit":
        raise ValueError(f"node {source} is a logit node: it has no edges out")
    if t_kind in ("error", "token"):
        raise ValueError(f"node {target} is a {t_kind} node: no edge goes into it (only features and logits)")
    hooks, seen = [], {}
    if t_kind == "feature":
        t_layer, t_pos, feat = int(graph.layer[target]), int(graph.pos[target]), int(graph.feature[target])
        W = rs.encoder(t_layer)[0]

        def read(x, hook):  # the target's names are its own: the source's below must not shadow them
            seen["pre"] = float(x[0, t_pos].to(W.dtype) @ W[:, feat])
        hooks.append((rs.hook_in(t_layer), read))
    else:
        if graph.logit_vectors is None:
            raise ValueError("this graph records no logit target directions (logit_vectors): its logit edges cannot "
                             "be re-measured")
        vector = graph.logit_vectors[graph.nodes_of("logit").tolist().index(target)].double()
        w = final_read(model)[1].double()

    def value(acts=None, errors=None, embed=None) -> float:
        run = frozen_forward(model, rs, cap, acts=acts, errors=errors, embed=embed)
        run(1, extra_hooks=hooks)
        if t_kind == "feature":
            return seen["pre"]
        final = run.final[0, -1].double()  # the norm's bias and the unembedding's are constants: they cancel below
        return float((final * w.to(final.device)) @ vector.to(final.device))

    layer, pos = int(graph.layer[source]), int(graph.pos[source])
    before = value()
    if kind == "feature":
        acts = list(cap.acts)
        acts[layer] = acts[layer].clone()
        acts[layer][..., pos, int(graph.feature[source])] = 0
        after = value(acts=acts)
    elif kind == "error":
        errors = list(cap.errors)
        errors[layer] = errors[layer].clone()
        errors[layer][..., pos, :] = 0
        after = value(errors=errors)
    else:
        embed = cap.embed.clone()
        if cap.token_vectors is None:
            embed[..., pos, :] = 0
        else:
            embed[..., pos, :] -= cap.token_vectors[pos].to(embed)
        after = value(embed=embed)
    return before - after
