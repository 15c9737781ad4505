"""Head loadings: which heads of one attention layer carried a graph edge.

    frame = head_loadings(graph, source, target, layer)   # a row per head of `layer`, plus "bypass"

An edge of an attribution graph is a direct effect in the frozen replacement model, where every
path from the source to the target is linear. At one attention layer those paths split: each
head moves part of the source's signal (its value path, through the frozen pattern), and the rest
reaches the target without passing through that layer's heads (the residual stream around them,
and, for a cross-layer transcoder, the source's writes into MLP outputs at or after that layer).
With everything linear the parts sum to the edge exactly.

Each part is measured by forward runs of the frozen replacement model, independent of the
backward passes that made the edge: with the source node set to zero, putting back head h's
clean output at ``layer`` (all positions) restores exactly the part of the target that flows
through head h; putting back every head's output leaves what flows around them missing, which is
the bypass. circuit-tracer's development branch (``circuit_tracer/attribution/head_loadings.py``)
defines the same split by propagating the source's write through the frozen attention layers; it
handles per-layer transcoders without skip paths on RMSNorm models and refuses the rest. Here the
frozen model itself carries the signal, so skip paths, cross-layer transcoders (a target's entry
point is its layer's MLP input), LayerNorm with its bias (a constant, which cancels between the
two runs) and attention-only models need nothing special.
"""

from __future__ import annotations

from numbers import Integral  # int and numpy's integers
from typing import Union

import torch
from torch import Tensor

from workbench.analysis.graphs.graph import NODE_KINDS
from workbench.utils import is_int


def _node(graph, node: Union[Integral, str]) -> int:
    if isinstance(node, str):
        ids = graph.node_ids()
        if node not in ids:
            raise ValueError(f"{node!r} is not a node id of this graph (ids look like 'F1.4.7', 'E0.3', 'T2', 'L0')")
        return ids.index(node)
    if not is_int(node) or not 0 <= node < graph.n_nodes:
        raise ValueError(f"a node is an id string or an index in [0, {graph.n_nodes}), got {node!r}")
    return int(node)


def head_loadings(graph, source: Union[Integral, str], target: Union[Integral, str], layer: Integral):
    """The edge ``source -> target`` of ``graph`` split over the heads of attention layer ``layer``.

    ``source``: a feature, error or token node; ``target``: a feature or logit node (node indices
    or ids as ``graph.node_ids()`` names them). ``layer`` must lie after the source's layer and at
    or before the target's (a feature reads its own layer's MLP input, after that layer's attention).
    A DataFrame, a row per head (``part`` "L{layer} H{h}", ``head``) and a last ``bypass`` row
    (``head`` -1), columns ``loading`` (their sum is the edge) and ``share`` (loading / edge);
    ``attrs``: ``edge`` (the graph's edge weight), ``total`` (the same effect measured by the
    forward runs), ``layer``, ``source``, ``target`` (node ids).
    """
    import pandas as pd

    from workbench.analysis.graphs.replacement import final_read, frozen_forward

    model, rs, cap = graph._bound()
    s, t = _node(graph, source), _node(graph, target)
    s_kind, t_kind = NODE_KINDS[int(graph.kind[s])], NODE_KINDS[int(graph.kind[t])]
    if s_kind == "logit":
        raise ValueError("a logit node is a target, not a source")
    if t_kind not in ("feature", "logit"):
        raise ValueError(f"the target must be a feature or logit node, got a {t_kind} node")
    s_layer = -1 if s_kind == "token" else int(graph.layer[s])
    t_layer = model.cfg.n_layers - 1 if t_kind == "logit" else int(graph.layer[t])
    if not is_int(layer) or not s_layer < layer <= t_layer:
        raise ValueError(f"layer must be an attention layer after the source's ({s_layer}) and at or before the "
                         f"target's ({t_layer}): an integer in [{s_layer + 1}, {t_layer}], got {layer!r}")
    layer = int(layer)
    pos, t_pos = int(graph.pos[s]), int(graph.pos[t])
    if s_kind == "error" and pos < cap.held:
        raise ValueError(f"the error at position {pos} is held constant (held_positions={cap.held}): it is not a source")
    acts, errors, embed = [a.clone() for a in cap.acts], [e.clone() for e in cap.errors], cap.embed.clone()
    if s_kind == "feature":
        acts[s_layer][pos, int(graph.feature[s])] = 0.0
    elif s_kind == "error":
        errors[s_layer][pos] = 0.0
    else:  # the token node's part of the embedding (all of it unless token_embedding="token")
        embed[pos] = embed[pos] - cap.token_part[pos]
    if t_kind == "feature":
        W, _ = rs.encoder(int(graph.layer[t]))
        reader, where = W[:, int(graph.feature[t])].detach(), int(graph.layer[t])
    else:
        j = int((graph.nodes_of("logit") == t).nonzero())
        reader, where = (graph.logit_vectors[j].to(cap.embed) * final_read(model)[1]), None
    name = f"blocks.{layer}.attn.hook_result"
    H = model.cfg.n_heads
    kept: dict[str, Tensor] = {}

    def keep(act: Tensor, hook) -> None:
        kept["clean"] = act.detach().clone()

    def restore(act: Tensor, hook) -> Tensor:
        act = act.clone()
        for h in range(H):
            act[h + 1, :, h] = kept["clean"][0, :, h]
        act[H + 1] = kept["clean"][0]
        return act

    def value(run) -> Tensor:
        x = run.final if where is None else run.x[where]
        return x[:, t_pos].flatten(1).double() @ reader.double()

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            clean = frozen_forward(model, rs, cap)
            with model.hooks(fwd_hooks=[(name, keep)]):
                clean()
            f_clean = value(clean)[0]
            off = frozen_forward(model, rs, cap, acts=acts, errors=errors, embed=embed)
            with model.hooks(fwd_hooks=[(name, restore)]):
                off(H + 2)  # copy 0: source off; copy h + 1: head h put back; copy H + 1: every head put back
            f_off = value(off)
    finally:
        model.train(was)
    loading = torch.cat([f_off[1:H + 1] - f_off[0], (f_clean - f_off[H + 1])[None]])
    total = float(f_clean - f_off[0])
    edge = graph.edge(t, s)
    ids = graph.node_ids()
    frame = pd.DataFrame({"part": [f"L{layer} H{h}" for h in range(H)] + ["bypass"], "head": list(range(H)) + [-1],
                          "loading": loading.tolist()})
    frame["share"] = frame["loading"] / edge if edge else float("nan")
    frame.attrs.update(edge=edge, total=total, layer=layer, source=ids[s], target=ids[t])
    return frame
