"""The attribution graph: a node table, sparse weighted edges, influence, pruning, files, interventions.

    graph.to_frame()                  # (nodes, edges) DataFrames
    graph.prune(0.8, 0.98)            # the subgraph carrying 80% of node / 98% of edge influence
    graph.save("g.json"); Graph.load("g.json")
    graph.to_circuit_tracer("out/", slug="ioi")    # the JSON circuit-tracer's and Neuronpedia's viewers open
    graph.intervene([(1, 12, 345)], value=0.0)     # logits [pos, d_vocab] of the replacement model

Nodes are features (layer, position, feature id, activation), error nodes (layer, position: what
the transcoders miss), token embeddings (position, token id) and logit targets (their value and
weight), in circuit-tracer's order. An edge ``source -> target`` is the source's direct effect on
the target's pre-activation in the frozen replacement model. Influence is circuit-tracer's: with
``A`` the absolute adjacency normalised so each target's incoming weights sum to one and ``w`` the
logit weights (probabilities), a node's influence is ``w (A + A^2 + ...)`` = ``w ((I - A)^-1 - I)``,
the share of the logits' input that reaches it along all paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from workbench.analysis.graphs import files
from workbench.utils import is_int, weights_signature

NODE_KINDS = ("feature", "error", "token", "logit")
_ARRAYS = ("kind", "layer", "pos", "feature", "activation", "logit_weight", "edge_target", "edge_source",
           "edge_weight", "tokens")


def compute_influence_sparse(edges: tuple[Tensor, Tensor, Tensor], n: int, logit_weights: Tensor,
                             max_iter: int = 1000) -> Tensor:
    """Each node's influence ``w (A + A^2 + ...)`` on the weighted logits, over sparse ``(target, source, weight)``."""
    return _influence(lambda: [edges], n, logit_weights, max_iter)


def _influence(chunks: Callable[[], Iterable[tuple[Tensor, Tensor, Tensor]]], n: int, logit_weights: Tensor,
               max_iter: int = 1000) -> Tensor:
    """``compute_influence_sparse`` over edges given chunk by chunk (``chunks()`` iterates them
    afresh each pass: one pass per path length, so at most one chunk is held at a time)."""
    row_sum = torch.zeros(n, dtype=torch.float64)
    for target, _, weight in chunks():
        row_sum.index_add_(0, target, weight.abs().double())
    row_sum.clamp_min_(1e-10)

    def step(at_target: Tensor) -> Tensor:
        out = torch.zeros(n, dtype=torch.float64)
        for target, source, weight in chunks():
            out.index_add_(0, source, weight.abs().double() / row_sum[target] * at_target[target])
        return out

    current = step(logit_weights.double())
    influence = current.clone()
    for _ in range(max_iter):
        current = step(current)
        if not current.any():
            return influence.float()
        influence += current
    raise RuntimeError(f"influence did not converge in {max_iter} iterations: the graph has a cycle")


def _file_length(path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("weight").get_shape()[0]


def _threshold(scores: Tensor, fraction: float) -> Tensor:
    """The score above which the largest scores hold ``fraction`` of the total (circuit-tracer's find_threshold)."""
    if not len(scores):  # a graph without edges (a file may hold one): nothing to keep
        return torch.tensor(float("inf"))
    ordered = scores.sort(descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum().clamp_min(1e-30)
    i = min(int(torch.searchsorted(cumulative, torch.tensor(fraction, dtype=cumulative.dtype))), len(ordered) - 1)
    return ordered[i]


def collapse_frames(nodes, edges, groups: dict[str, Sequence[str]]):
    """``Graph.to_frame()``'s tables with each group of feature ids (``{name: ["F1.4.7", ...]}``)
    collapsed into one ``supernode`` row: its activation and influence are the members' sums, its
    layer and position their influence-weighted means (rounded); edges into or out of the members
    become one edge whose weight is their sum, and edges among the members are dropped."""
    import pandas as pd

    where = {node_id: i for i, node_id in enumerate(nodes["id"])}
    member = {}
    for name, ids in groups.items():
        if name in where:
            raise ValueError(f"the group name {name!r} is already a node id; pick another")
        for node_id in ids:
            if node_id not in where or nodes["kind"].iloc[where[node_id]] != "feature":
                raise ValueError(f"{node_id!r} is not a feature node of this graph")
            if node_id in member:
                raise ValueError(f"{node_id!r} is in two groups ({member[node_id]!r} and {name!r})")
            member[node_id] = name
    keep = nodes[~nodes["id"].isin(member)].reset_index(drop=True)
    rows = []
    for name, ids in groups.items():
        part = nodes[nodes["id"].isin(list(ids))]
        w = part["influence"].clip(lower=0) + 1e-12
        rows.append({**{c: part[c].iloc[0] for c in nodes.columns}, "id": name, "kind": "supernode", "feature": -1,
                     "layer": int(round(float((part["layer"] * w).sum() / w.sum()))),
                     "pos": int(round(float((part["pos"] * w).sum() / w.sum()))), "label": name,
                     "activation": float(part["activation"].sum()), "influence": float(part["influence"].sum())})
    out = pd.concat([keep, pd.DataFrame(rows, columns=nodes.columns)], ignore_index=True)
    index = {node_id: i for i, node_id in enumerate(out["id"])}
    new = [index[member.get(node_id, node_id)] for node_id in nodes["id"]]
    moved = pd.DataFrame({"source": [new[s] for s in edges["source"]], "target": [new[t] for t in edges["target"]],
                          "weight": edges["weight"].to_numpy()})
    moved = moved[moved["source"] != moved["target"]]
    return out, moved.groupby(["source", "target"], as_index=False)["weight"].sum()


@dataclass(frozen=True)
class Supernode:
    """A named group of features (what ``collapse_frames`` and the Graph page's supernodes collapse):
    ``members`` are node ids (``"F1.4.7"``), feature node indices or (layer, pos, feature) triples.
    ``graph.intervene([Supernode("say Ella", ["F0.2.5", "F1.2.7"])], 0.0)`` sets every member. One triple
    is a list of one: ``Supernode("x", [(1, 4, 7)])``; ``Supernode("x", (1, 4, 7))`` is three node indices."""

    name: str
    members: tuple

    def __init__(self, name: str, members: Sequence) -> None:
        if isinstance(members, (str, bytes)) or not len(members):
            raise ValueError(f"supernode {name!r} needs a non-empty list of member features")
        object.__setattr__(self, "name", str(name))
        object.__setattr__(self, "members", tuple(members))


class PruneResult(NamedTuple):
    node_mask: Tensor  # [n_nodes] bool
    edge_mask: Tensor  # [n_edges] bool
    cumulative_scores: Tensor  # [n_nodes]: the share of influence held by the nodes at least as influential


@dataclass
class Graph:
    kind: Tensor  # [n] index into NODE_KINDS
    layer: Tensor  # [n] feature/error: layer; token: -1; logit: n_layers
    pos: Tensor  # [n]
    feature: Tensor  # [n] feature id; token: token id; logit: vocab id (-1: not a single token); error: -1
    activation: Tensor  # [n] feature activation; error: the error vector's norm; logit: its value; token: 0
    logit_weight: Tensor  # [n] logits: their weight (probability) in the influence; others 0
    logit_labels: list[str]
    edge_target: Optional[Tensor]  # [e] node index, int32 or int64 (None: in edge_files)
    edge_source: Optional[Tensor]  # [e]
    edge_weight: Optional[Tensor]  # [e]
    tokens: Tensor  # [pos]
    str_tokens: list[str]
    n_layers: int
    logit_vectors: Optional[Tensor] = None  # [n_logits, d_model] target directions at the unembedding input
    meta: dict = field(default_factory=dict)
    qk: Any = None  # a DataFrame of the kept attention entries' QK pairs (attribution_graph(..., qk=True))
    # a spilled graph (attribution_graph's spill_dir): its edges live in these safetensors files (target,
    # source, weight), one chunk each, and the three edge fields are None; influence, pruning and
    # subgraphs read the chunks one at a time; reading edge_target / edge_source / edge_weight loads them all
    edge_files: tuple = ()

    def __post_init__(self) -> None:
        self._context = None
        if self.edge_files and self.__dict__.get("_edge_weight") is not None:
            raise ValueError("a graph has its edges in memory or in edge_files, not both")
        self._n_spilled = sum(_file_length(p) for p in self.edge_files)

    def _edge_chunks(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """``(target, source, weight)`` chunk by chunk: the edges in memory as one chunk, or each edge file."""
        if not self.edge_files:
            yield self.edge_target, self.edge_source, self.edge_weight  # int32 or int64 node indices
            return
        from safetensors.torch import load_file

        for path in self.edge_files:
            d = load_file(str(path))
            yield d["target"], d["source"], d["weight"]

    def _load_edges(self, i: int) -> Tensor:
        parts = [chunk[i] for chunk in self._edge_chunks()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32 if i == 2 else torch.long)

    # ---- shape --------------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return len(self.kind)

    @property
    def n_edges(self) -> int:
        return self._n_spilled if self.edge_files else len(self.edge_weight)

    def nodes_of(self, kind: str) -> Tensor:
        return (self.kind == NODE_KINDS.index(kind)).nonzero().squeeze(-1)

    def node_index(self, layer: int, pos: int, feature: int) -> int:
        """The node index of feature ``feature`` at (layer, pos); a ValueError if it is not in the graph."""
        hit = ((self.kind == 0) & (self.layer == layer) & (self.pos == pos) & (self.feature == feature)).nonzero()
        if not len(hit):
            raise ValueError(f"feature {feature} at layer {layer}, position {pos} is not a node of this graph")
        return int(hit[0])

    def node_ids(self) -> list[str]:
        names = []
        for k, l, p, f in zip(self.kind.tolist(), self.layer.tolist(), self.pos.tolist(), self.feature.tolist()):
            names.append((f"F{l}.{p}.{f}", f"E{l}.{p}", f"T{p}", f"L{len(names)}")[k])
        logits = self.nodes_of("logit").tolist()
        for j, i in enumerate(logits):
            names[i] = f"L{j}"
        return names

    def adjacency(self) -> Tensor:
        """The dense [n_nodes, n_nodes] matrix, rows = targets, columns = sources (small graphs only)."""
        A = torch.zeros(self.n_nodes, self.n_nodes)
        A[self.edge_target, self.edge_source] = self.edge_weight
        return A

    def edge(self, target: int, source: int) -> float:
        hit = ((self.edge_target == target) & (self.edge_source == source)).nonzero()
        return float(self.edge_weight[hit[0]]) if len(hit) else 0.0

    # ---- influence and pruning ----------------------------------------------------------------------------
    def influence(self) -> Tensor:
        """[n_nodes]: each node's influence on the weighted logits (0 for the logits themselves)."""
        return _influence(self._edge_chunks, self.n_nodes, self.logit_weight)

    def edge_scores(self, node_mask: Optional[Tensor] = None) -> Tensor:
        """[n_edges]: each edge's share of influence (normalised weight x the influence reaching its target)."""
        def chunks():
            for t, s, w in self._edge_chunks():
                yield t, s, (w if node_mask is None else w * (node_mask[t] & node_mask[s]))

        influence = _influence(chunks, self.n_nodes, self.logit_weight).double() + self.logit_weight.double()
        row = torch.zeros(self.n_nodes, dtype=torch.float64)
        for t, _, w in chunks():
            row.index_add_(0, t, w.abs().double())
        row.clamp_min_(1e-10)
        parts = [(w.abs().double() / row[t] * influence[t]).float() for t, _, w in chunks()]
        return torch.cat(parts) if parts else torch.zeros(0)

    def prune_masks(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> PruneResult:
        """circuit-tracer's ``prune_graph`` on sparse edges: keep the nodes holding ``node_threshold``
        of the influence (tokens and logits always), then the edges holding ``edge_threshold`` of
        the edge influence among them, then drop features left without an input or an output."""
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        influence = self.influence()
        node_mask = influence >= _threshold(influence, node_threshold)
        always = (self.kind == NODE_KINDS.index("token")) | (self.kind == NODE_KINDS.index("logit"))
        node_mask |= always
        scores = self.edge_scores(node_mask)
        edge_mask = scores >= _threshold(scores, edge_threshold)
        edge_mask &= scores > 0
        feature = self.kind == 0
        inner = (self.kind == 0) | (self.kind == 1)
        while True:
            has_out = torch.zeros(self.n_nodes, dtype=torch.bool)
            has_in = torch.zeros(self.n_nodes, dtype=torch.bool)
            at = 0
            for t, s, _ in self._edge_chunks():
                m = edge_mask[at:at + len(t)]
                m &= node_mask[t] & node_mask[s]
                has_out[s[m]] = True
                has_in[t[m]] = True
                at += len(t)
            new = node_mask & (~inner | has_out) & (~feature | has_in)
            if torch.equal(new, node_mask):
                break
            node_mask = new
        order = influence.argsort(descending=True)
        cumulative = torch.zeros_like(influence)
        cumulative[order] = influence[order].cumsum(0) / influence.sum().clamp_min(1e-30)
        return PruneResult(node_mask, edge_mask, cumulative)

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> "Graph":
        """The pruned subgraph (a new Graph; interventions still work on it)."""
        result = self.prune_masks(node_threshold, edge_threshold)
        sub = self.subgraph(result.node_mask, result.edge_mask)
        sub.meta = {**sub.meta, "node_threshold": node_threshold, "edge_threshold": edge_threshold}
        return sub

    def subgraph(self, node_mask: Tensor, edge_mask: Optional[Tensor] = None) -> "Graph":
        keep = node_mask.nonzero().squeeze(-1)
        new = torch.full((self.n_nodes,), -1, dtype=torch.long)
        new[keep] = torch.arange(len(keep))
        parts, at = [], 0
        for t, s, w in self._edge_chunks():  # a spilled graph's subgraph is in memory: read chunk by chunk
            t, s = new[t], new[s]
            e = (t >= 0) & (s >= 0) & (edge_mask[at:at + len(t)] if edge_mask is not None else True)
            parts.append((t[e], s[e], w[e]))
            at += len(w)
        t, s, w = (torch.cat([p[i] for p in parts]) for i in range(3)) if parts else (
            torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0))
        logit_nodes = self.nodes_of("logit").tolist()
        labels = [self.logit_labels[j] for j, i in enumerate(logit_nodes) if bool(node_mask[i])]
        vectors = None
        if self.logit_vectors is not None:
            vectors = self.logit_vectors[[j for j, i in enumerate(logit_nodes) if bool(node_mask[i])]]
        sub = Graph(self.kind[keep], self.layer[keep], self.pos[keep], self.feature[keep], self.activation[keep],
                    self.logit_weight[keep], labels, t, s, w, self.tokens, self.str_tokens,
                    self.n_layers, vectors, dict(self.meta))
        sub._context = self._context
        sub.qk = self.qk
        return sub

    def scores(self) -> dict[str, float]:
        """circuit-tracer's ``compute_graph_scores``: the replacement score (the tokens' share of the token
        and error influence) and the completeness score, the mean over every node, weighted by its
        influence plus its logit weight, of the share of its incoming absolute edge weight that does not
        come from error nodes. As there, a node without incoming edges (tokens, errors) counts as
        complete: it is in the weights, with share 1."""
        influence = self.influence()
        err, tok = self.kind == 1, self.kind == 2
        row = torch.zeros(self.n_nodes, dtype=torch.float64)
        from_err = torch.zeros(self.n_nodes, dtype=torch.float64)
        for t, _, w in self._edge_chunks():
            row.index_add_(0, t.long(), w.abs().double())
        row.clamp_min_(1e-10)
        for t, s, w in self._edge_chunks():
            t, s = t.long(), s.long()
            from_err.index_add_(0, t, w.abs().double() * err[s] / row[t])
        # (counting only nodes with incoming edges, as this did before, gave 0.663 where circuit-tracer gives
        # 0.798 on the same adjacency)
        weight = influence.double() + self.logit_weight.double()
        completeness = float(((1 - from_err) * weight).sum() / weight.sum().clamp_min(1e-30))
        replacement = float(influence[tok].sum() / (influence[tok].sum() + influence[err].sum()).clamp_min(1e-30))
        return {"replacement": replacement, "completeness": completeness}

    # ---- frames and files --------------------------------------------------------------------------------
    def to_frame(self):
        """``(nodes, edges)`` DataFrames; edges name their nodes by index into ``nodes``."""
        import pandas as pd

        nodes = pd.DataFrame({"id": self.node_ids(), "kind": [NODE_KINDS[k] for k in self.kind.tolist()],
                              "layer": self.layer.tolist(), "pos": self.pos.tolist(), "feature": self.feature.tolist(),
                              "activation": self.activation.tolist(), "influence": self.influence().tolist(),
                              "logit_weight": self.logit_weight.tolist()})
        token = nodes["kind"] == "token"
        nodes["label"] = ""
        nodes.loc[token, "label"] = [self.str_tokens[p] for p in nodes.loc[token, "pos"]]
        nodes.loc[nodes["kind"] == "logit", "label"] = self.logit_labels
        edges = pd.DataFrame({"source": self.edge_source.tolist(), "target": self.edge_target.tolist(),
                              "weight": self.edge_weight.tolist()})
        return nodes, edges

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"format": "workbench-attribution-graph", "version": 1}
        for name in _ARRAYS:
            out[name] = getattr(self, name).tolist()
        out.update(logit_labels=self.logit_labels, str_tokens=self.str_tokens, n_layers=self.n_layers,
                   logit_vectors=None if self.logit_vectors is None else self.logit_vectors.tolist(), meta=self.meta)
        if self.qk is not None:
            out["qk"] = {"columns": list(self.qk.columns), "rows": self.qk.astype(object).where(self.qk.notna(), None)
                         .values.tolist()}
        return out

    def save(self, path: Union[str, Path], overwrite: bool = False) -> Path:
        """Write the graph to ``path`` (JSON), atomically. A file there is replaced only when it is a graph
        file of ours, or with ``overwrite=True``; a graph the loader would refuse (a NaN, say) is not written."""
        return files.save_graph(self, path, overwrite)

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        """The graph of ``to_dict``'s dict, checked as ``load`` checks a file (a ValueError naming the field)."""
        return cls(**files.graph_fields(d))

    @classmethod
    def load(cls, path: Union[str, Path], max_bytes: Optional[int] = files.DEFAULT_MAX_BYTES) -> "Graph":
        """Read a file ``save`` wrote. Everything is checked (types, shapes, finite numbers, indices, unique
        nodes, edges between existing nodes in layer order); a file over ``max_bytes`` (256 MiB; None: no cap)
        is refused before it is read. Any failure is one ValueError naming the file and the field."""
        return cls(**files.load_graph(path, max_bytes))

    # ---- circuit-tracer's graph JSON (what its local server and Neuronpedia open) -----------------------------
    def to_circuit_tracer_dict(self, slug: str = "graph", scan: str = "workbench", node_threshold: float = 0.8,
                               edge_threshold: float = 0.98, prune: bool = True) -> dict:
        """The graph file ``circuit_tracer.utils.create_graph_files`` writes (pruned as it prunes)."""
        if prune:
            result = self.prune_masks(node_threshold, edge_threshold)
            node_mask, edge_mask, cumulative = result
        else:
            node_mask = torch.ones(self.n_nodes, dtype=torch.bool)
            edge_mask = torch.ones(self.n_edges, dtype=torch.bool)
            cumulative = torch.zeros(self.n_nodes)
        d_vocab = self.meta.get("d_vocab")  # meta is kept as a file had it: use it only when it is a count
        vocab = int(d_vocab) if is_int(d_vocab) and int(d_vocab) > 0 else (int(self.feature.max()) if self.n_nodes else 0) + 1
        nodes: dict[int, dict] = {}
        t_all, s_all = self.edge_target[edge_mask], self.edge_source[edge_mask]
        linked = node_mask[t_all] & node_mask[s_all]
        kept_features = torch.zeros(self.n_nodes, dtype=torch.bool)  # the feature nodes the file will hold
        kept_features[t_all[linked]] = True
        kept_features[s_all[linked]] = True
        kept_features &= self.kind == 0
        feature_ids = {f"{l}_{f}_{p}" for l, f, p in zip(self.layer[kept_features].tolist(),
                                                         self.feature[kept_features].tolist(),
                                                         self.pos[kept_features].tolist())}
        logit_rank = {int(i): j for j, i in enumerate(self.nodes_of("logit"))}
        for i in node_mask.nonzero().squeeze(-1).tolist():
            k, l, p, f = int(self.kind[i]), int(self.layer[i]), int(self.pos[i]), int(self.feature[i])
            base = dict(run_idx=0, reverse_ctx_idx=0, clerp="", token_prob=0.0, is_target_logit=False,
                        influence=float(cumulative[i]), activation=None, ctx_idx=p)
            if k == 0:
                base.update(node_id=f"{l}_{f}_{p}", feature=(l + f) * (l + f + 1) // 2 + f, layer=str(l),
                            feature_type="cross layer transcoder", jsNodeId=f"{l}_{f}-0",
                            activation=float(self.activation[i]))
            elif k == 1:
                # circuit-tracer's error id "0_{layer}_{pos}" is also the id of feature `layer` of layer 0 at
                # that position: when both are kept, the error node gets an id no other node can have
                clash = f"0_{l}_{p}" in feature_ids
                base.update(node_id=f"err_{l}_{p}" if clash else f"0_{l}_{p}", feature=-1, layer=str(l),
                            feature_type="mlp reconstruction error", jsNodeId=f"{l}_{p}-0")
            elif k == 2:
                base.update(node_id=f"E_{f}_{p}", feature=p, layer="E", feature_type="embedding", jsNodeId=f"E_{f}-{p}")
            else:
                j = logit_rank[i]
                v = f if f >= 0 else vocab + j  # circuit-tracer's virtual index for a target that is not a token
                prob = float(self.logit_weight[i])
                layer = str(self.n_layers + 1)
                base.update(node_id=f"{layer}_{v}_{p}", feature=v, layer=layer, feature_type="logit",
                            token_prob=prob, is_target_logit=j == 0, jsNodeId=f"L_{v}-{p}", influence=None,
                            clerp=f'Output "{self.logit_labels[j]}" (p={prob:.3f})')
            nodes[i] = base
        links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": float(w)}
                 for t, s, w in zip(self.edge_target[edge_mask].tolist(), self.edge_source[edge_mask].tolist(),
                                    self.edge_weight[edge_mask].tolist()) if s in nodes and t in nodes]
        used = {x for link in links for x in (link["source"], link["target"])}
        kept = [n for n in nodes.values() if n["node_id"] in used or n["feature_type"] in ("embedding", "logit")]
        meta = dict(slug=slug, scan=scan, transcoder_list=[], prompt_tokens=list(self.str_tokens),
                    prompt="".join(self.str_tokens), node_threshold=node_threshold, schema_version=1)
        qparams = dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos="")
        return {"metadata": meta, "qParams": qparams, "nodes": kept, "links": links}

    def to_circuit_tracer(self, folder: Union[str, Path], slug: str = "graph", scan: str = "workbench",
                          node_threshold: float = 0.8, edge_threshold: float = 0.98, overwrite: bool = False) -> Path:
        """Write ``{folder}/{slug}.json`` and add it to ``{folder}/graph-metadata.json``, as circuit-tracer does.

        Only those two files are written, each atomically. ``slug`` must be a plain name (no path separators,
        no ``..``, not the listing's name). A file ``{slug}.json`` that is not this folder's earlier export of
        ``slug`` is refused unless ``overwrite=True``; a damaged listing is refused before anything is written."""
        files.check_slug(slug)  # before the work of pruning
        return files.write_circuit_tracer(self.to_circuit_tracer_dict(slug, scan, node_threshold, edge_threshold),
                                          folder, overwrite)

    @classmethod
    def from_circuit_tracer(cls, source: Union[str, Path, dict],
                            max_bytes: Optional[int] = files.DEFAULT_MAX_BYTES) -> "Graph":
        """Read a circuit-tracer graph JSON (its pruned nodes and links) back as a Graph, checked as ``load``
        checks (a link to a node the file does not have, or two nodes of one id, is refused, not dropped)."""
        return cls(**files.load_circuit_tracer(source, max_bytes))

    # ---- the model behind it -----------------------------------------------------------------------------
    def bind(self, model, transcoders, cap=None) -> "Graph":
        """Attach the model and transcoders the graph was made from (after ``load``), for ``intervene``.

        A ValueError naming what differs unless their weights are the ones the graph recorded
        (``meta["fingerprint"]``): a loaded graph bound to other weights answered with its old edges
        beside runs of the new ones. A graph that records none binds with an ``UnverifiedGraphWarning``."""
        from workbench.analysis.graphs.checks import check_binding, warn_trained_elsewhere
        from workbench.analysis.graphs.replacement import check_model, replacement_set

        rs = replacement_set(transcoders, model)
        check_model(model, rs)
        check_binding(self, model, rs)
        recorded = self.meta.get("fingerprint")
        warn_trained_elsewhere(model, rs, recorded.get("model") if isinstance(recorded, dict) else None)
        return self._attach(model, rs, cap)

    def _attach(self, model, rs, cap=None) -> "Graph":
        """``bind`` without its checks (``attribution_graph`` made them): re-capture the prompt unless given."""
        from workbench.analysis.graphs.replacement import capture

        if cap is None:
            if bool((self.tokens < 0).any()):
                raise ValueError("this graph does not record its prompt's token ids; it cannot be re-run")
            was = model.training
            model.eval()
            try:
                cap = capture(model, rs, self.tokens.to(model.device)[None], **self._conventions())[0]
            finally:
                model.train(was)
        self._context = (model, rs, cap, weights_signature(model, rs))
        return self

    def _conventions(self) -> dict:
        """The node conventions this graph was computed with (``attribution_graph``'s ``token_embedding`` and
        ``held_positions``; a graph file without them: the defaults)."""
        return dict(token_embedding=self.meta.get("token_embedding", "token+position"),
                    held_positions=int(self.meta.get("held_positions", 0)))

    def _bound(self) -> tuple:
        """(model, replacement set, capture) this graph was bound to, after checking that neither the
        model's nor the transcoders' weights changed since: a `.data` edit, a load or a cast would mix
        the graph's capture with runs of other weights, silently."""
        if self._context is None:
            raise ValueError("this graph is not bound to a model: call graph.bind(model, transcoders) first")
        model, rs, cap, signature = self._context
        if weights_signature(model, rs) != signature:
            raise ValueError("the model's or the transcoders' weights changed since this graph was built (an edit, a "
                             "load or a cast): build the graph again from the new weights, or put the old ones back")
        return model, rs, cap

    def intervene(self, features: Sequence, value: Union[float, Sequence[float]] = 0.0, *,
                  freeze_attention: bool = False, direct_only: bool = False,
                  supernodes: Optional[dict[str, Sequence]] = None) -> Tensor:
        """Logits [pos, d_vocab] of the replacement model with ``features`` set to ``value``.

        ``features``: (layer, pos, feature id) triples, node indices or node ids (``"F1.4.7"``) of
        this graph, or supernodes: a ``Supernode``, or the name of a group in ``supernodes``
        (``{name: [member features]}``, the groups ``collapse_frames`` takes); a supernode's value
        (one per item of ``features``) goes to each of its members. By default
        every other feature is re-encoded from its live input (errors held at their values on
        this prompt) and attention and norms run live; ``freeze_attention`` holds them as the
        graph does; ``direct_only`` also holds every other feature (the graph's own frozen model,
        where changing a feature moves the logits by exactly its direct edges).
        """
        from workbench.analysis.graphs.replacement import frozen_forward, live_forward

        model, rs, cap = self._bound()
        items = list(features)
        values = [float(value)] * len(items) if isinstance(value, (int, float)) else [float(v) for v in value]
        if len(values) != len(items):
            raise ValueError(f"{len(items)} features but {len(values)} values")
        setting: dict[tuple[int, int, int], float] = {}
        for item, v in zip(items, values):
            for triple in self._members(item, supernodes or {}):
                if setting.get(triple, v) != v:
                    raise ValueError(f"feature {triple} is set twice, to {setting[triple]} and {v}")
                setting[triple] = v
        for triple in setting:  # a layer past the last would never match an edit, a negative position wraps
            _check_feature(triple, rs, cap)
        triples, values = list(setting), list(setting.values())

        def edit(layer: int, acts: Tensor) -> Tensor:
            mine = [(p, f, v) for (l, p, f), v in zip(triples, values) if l == layer]
            if not mine:
                return acts
            acts = acts.clone()
            for p, f, v in mine:
                acts[..., p, f] = v
            return acts

        with torch.no_grad():
            if direct_only:
                acts = [edit(l, a[None])[0] for l, a in enumerate(cap.acts)]
                run = frozen_forward(model, rs, cap, acts=acts)
            else:
                run = live_forward(model, rs, cap, edit, freeze=freeze_attention)
            return run()[0]

    def _members(self, item, supernodes: dict[str, Sequence]) -> list[tuple[int, int, int]]:
        """The (layer, pos, feature) triples an item of ``intervene``'s ``features`` stands for."""
        if isinstance(item, str) and item in supernodes:
            item = Supernode(item, supernodes[item])
        if isinstance(item, Supernode):
            return [self._triple(m) for m in item.members]
        return [self._triple(item)]

    def _triple(self, f) -> tuple[int, int, int]:
        if isinstance(f, str):
            parts = f[1:].split(".")
            if not (f.startswith("F") and len(parts) == 3 and all(p.lstrip("-").isdigit() for p in parts)):
                raise ValueError(f"{f!r} is neither a feature node id (\"F<layer>.<pos>.<feature>\") nor a supernode "
                                 "named in supernodes=")
            return int(parts[0]), int(parts[1]), int(parts[2])
        if is_int(f):  # numpy's too: a node index read off a DataFrame
            f = int(f)
            if not 0 <= f < self.n_nodes or int(self.kind[f]) != 0:
                raise ValueError(f"node {f} is not a feature node of this graph")
            return int(self.layer[f]), int(self.pos[f]), int(self.feature[f])
        if isinstance(f, (tuple, list)) and len(f) == 3:
            return int(f[0]), int(f[1]), int(f[2])
        raise ValueError(f"a feature is a (layer, pos, feature id) triple, a feature node index, a node id or a "
                         f"supernode, got {f!r}")

    def __repr__(self) -> str:
        counts = {k: int((self.kind == i).sum()) for i, k in enumerate(NODE_KINDS)}
        return (f"Graph({len(self.tokens)} tokens, {counts['feature']} features, {counts['error']} errors, "
                f"{counts['logit']} logits, {self.n_edges} edges)")


def _check_feature(triple: tuple[int, int, int], rs, cap) -> None:
    """A ValueError unless (layer, pos, feature) names a feature the replacement model has on this prompt."""
    layer, pos, feature = triple
    if not rs.n_layers:
        raise ValueError(f"feature {triple}: this graph has no features to set (an attention-only model has no "
                         "transcoders; its nodes are tokens and logits)")
    n_pos = len(cap.tokens)
    for name, value, hi in (("layer", layer, rs.n_layers), ("position", pos, n_pos),
                            ("feature id", feature, cap.acts[layer].shape[-1] if 0 <= layer < rs.n_layers else 0)):
        if not 0 <= value < hi:
            raise ValueError(f"feature {triple}: its {name} must lie in [0, {hi}) (the transcoders cover "
                             f"{rs.n_layers} layers, the prompt has {n_pos} positions)")


def _edge_field(i: int, name: str) -> property:
    """A Graph edge field: the tensor given, or for a spilled graph every edge file's column, loaded on each read."""
    def get(self) -> Tensor:
        value = self.__dict__.get("_" + name)
        return value if value is not None or not self.__dict__.get("edge_files") else self._load_edges(i)

    def put(self, value) -> None:
        self.__dict__["_" + name] = value

    return property(get, put)


for _i, _name in enumerate(("edge_target", "edge_source", "edge_weight")):
    setattr(Graph, _name, _edge_field(_i, _name))
