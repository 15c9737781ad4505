"""The computation graph of a model: which node's output each downstream input reads.

    g = ComputationGraph(model)
    g.senders      # ("embed",), ("head", l, h), ("mlp", l): everything that writes to the residual stream
    g.receivers    # ("head", l, h, "q"|"k"|"v"), ("mlp", l), ("logits",): everything that reads it
    g.edges        # one row per edge: sender -> receiver, with layers, heads and the input kind

In a pre-norm model the residual stream a component reads is the sum of every earlier
component's output (plus constant biases), so the input of each receiver can be split into
one term per sender: those terms are the edges. A head's query, key and value inputs are
separate receivers (each reads its own copy of the stream, normed on its own), so "L0H3 ->
L1H4.k" is K-composition and "L0H3 -> L1H4.q" is Q-composition. An MLP reads the heads of
its own layer in the sequential layouts and only earlier layers in the parallel one.

Post-norm blocks normalise the sum after adding each output, so the stream is not a sum of
node outputs and there are no edges to cut: the graph refuses them, naming the layout.

Labels follow ``workbench.analysis.common``: ``embed``, ``L0H3``, ``L1 mlp``, ``logits`` for
nodes, ``L1H4.k`` for one input of a head, ``L0H3 -> L1H4.k`` for an edge. Every public
function that takes a node or an edge accepts the label, the tuple, or (edges) an index.
"""

from __future__ import annotations

import re
from typing import Sequence, Union

import numpy as np
import pandas as pd
import torch

from workbench.analysis.common import unit_label

Node = tuple
EdgeSpec = Union[int, str, tuple]
QKV = ("q", "k", "v")
_SUPPORTED = ("pre", "parallel", "attn_only_pre")


def sender_label(node: Node) -> str:
    """``embed``, ``L0H3`` or ``L1 mlp``."""
    if node[0] == "embed":
        return "embed"
    if node[0] == "head":
        return unit_label(node[1], node[2])
    return unit_label(node[1], part="mlp")


def receiver_label(node: Node) -> str:
    """``L1H4.k``, ``L1 mlp`` or ``logits``."""
    if node[0] == "logits":
        return "logits"
    if node[0] == "head":
        return f"{unit_label(node[1], node[2])}.{node[3]}"
    return unit_label(node[1], part="mlp")


_HEAD = re.compile(r"L(\d+)H(\d+)(?:\.([qkv]))?")
_MLP = re.compile(r"L(\d+)\s+mlp")


def _parse_label(text: str) -> Node:
    text = text.strip()
    if text in ("embed", "logits"):
        return (text,)
    if (m := _HEAD.fullmatch(text)) is not None:
        layer, head, kind = m.groups()
        return ("head", int(layer), int(head)) + ((kind,) if kind else ())
    if (m := _MLP.fullmatch(text)) is not None:
        return ("mlp", int(m.group(1)))
    raise ValueError(f"{text!r} is not a node: write embed, L<layer>H<head> (e.g. L0H3), L<layer>H<head>.q|k|v "
                     "(one input of a head), L<layer> mlp, or logits")


def _as_tuple(node) -> Node:
    if isinstance(node, str):
        return _parse_label(node)
    if isinstance(node, (tuple, list)) and node and isinstance(node[0], str):
        node = tuple(node)
        kind = node[0]
        sizes = {"embed": 1, "logits": 1, "mlp": 2}
        if (kind in sizes and len(node) == sizes[kind]) or (kind == "head" and len(node) in (3, 4)):
            if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in node[1:3]):
                return (kind, *(int(x) for x in node[1:3]), *node[3:])
    raise ValueError(f"{node!r} is not a node: write ('embed',), ('head', layer, head), ('head', layer, head, 'q'|'k'|'v'), "
                     "('mlp', layer), ('logits',) or their labels (embed, L0H3, L1H4.k, L1 mlp, logits)")


class ComputationGraph:
    """Nodes and edges of a pre-norm model (see the module docstring)."""

    def __init__(self, model):
        layout = model.blocks[0].layout
        if layout not in _SUPPORTED:
            raise ValueError(f"circuits need a residual stream that is a sum of node outputs; the {layout!r} block "
                             f"layout normalises after each write, so it has no edges (supported layouts: "
                             f"{list(_SUPPORTED)})")
        cfg = model.cfg
        if cfg.attention == "mla":
            raise ValueError("circuits do not support MLA attention yet: a head's keys and values come from a "
                             "latent shared by every head, so its q/k/v inputs are not separate edges here")
        self.n_layers, self.n_heads = cfg.n_layers, cfg.n_heads
        self.layout = layout
        self.has_mlp = "mlp_out" in model.blocks[0].sites
        self.parallel = layout == "parallel"
        self.model_name = cfg.name
        # Stages order the writes: embed 0; layer l's heads 2l+1; its MLP 2l+2 (2l+1 when parallel);
        # a receiver at stage t reads every sender of a stage below t.
        mlp_stage = (lambda l: 2 * l + 1) if self.parallel else (lambda l: 2 * l + 2)
        senders, sender_stage, receivers, receiver_stage = [("embed",)], [0], [], []
        for l in range(self.n_layers):
            senders += [("head", l, h) for h in range(self.n_heads)]
            sender_stage += [2 * l + 1] * self.n_heads
            receivers += [("head", l, h, kind) for kind in QKV for h in range(self.n_heads)]
            receiver_stage += [2 * l + 1] * 3 * self.n_heads
            if self.has_mlp:
                senders.append(("mlp", l))
                sender_stage.append(mlp_stage(l))
                receivers.append(("mlp", l))
                receiver_stage.append(mlp_stage(l))
        receivers.append(("logits",))
        receiver_stage.append(2 * self.n_layers + 1)
        self.senders, self.receivers = senders, receivers
        self.sender_stage = np.array(sender_stage)
        self.receiver_stage = np.array(receiver_stage)
        self.sender_labels = [sender_label(n) for n in senders]
        self.receiver_labels = [receiver_label(n) for n in receivers]
        self._sender_index = {n: i for i, n in enumerate(senders)}
        self._receiver_index = {n: i for i, n in enumerate(receivers)}
        self.adjacency = torch.from_numpy(self.sender_stage[:, None] < self.receiver_stage[None, :])  # [S, R]
        # Edges receiver by receiver (forward order), senders in forward order within each.
        r_idx, s_idx = np.nonzero(self.adjacency.numpy().T)
        self.edge_sender, self.edge_receiver = s_idx, r_idx
        self._edge_index = {(int(s), int(r)): i for i, (s, r) in enumerate(zip(s_idx, r_idx))}
        self.edge_labels = [f"{self.sender_labels[s]} -> {self.receiver_labels[r]}" for s, r in zip(s_idx, r_idx)]

    # ---- sizes and tables --------------------------------------------------------------
    @property
    def n_edges(self) -> int:
        return len(self.edge_labels)

    @property
    def edges(self) -> pd.DataFrame:
        """One row per edge: edge, sender, receiver, sender_layer/head, receiver_layer/head, input
        (q, k, v, mlp or logits); layer and head are -1 where they do not apply (embed, logits, MLPs)."""
        s, r = self.edge_sender, self.edge_receiver
        senders, receivers = self.senders, self.receivers
        return pd.DataFrame({
            "edge": self.edge_labels,
            "sender": np.array(self.sender_labels, dtype=object)[s],
            "receiver": np.array(self.receiver_labels, dtype=object)[r],
            "sender_layer": np.array([self._layer(n) for n in senders])[s],
            "sender_head": np.array([self._head(n) for n in senders])[s],
            "receiver_layer": np.array([self._layer(n) for n in receivers])[r],
            "receiver_head": np.array([self._head(n) for n in receivers])[r],
            "input": np.array([self._input(n) for n in receivers], dtype=object)[r],
        })

    @staticmethod
    def _layer(node: Node) -> int:
        return node[1] if node[0] in ("head", "mlp") else -1

    @staticmethod
    def _head(node: Node) -> int:
        return node[2] if node[0] == "head" else -1

    @staticmethod
    def _input(node: Node) -> str:
        return node[3] if node[0] == "head" else node[0]

    def __repr__(self) -> str:
        return (f"ComputationGraph({self.n_layers} layers x {self.n_heads} heads, {self.layout} layout: "
                f"{len(self.senders)} senders, {len(self.receivers)} receivers, {self.n_edges} edges)")

    # ---- lookups, with errors that name what is wrong -------------------------------------
    def _check_node(self, node: Node) -> None:
        if node[0] in ("head", "mlp") and not 0 <= node[1] < self.n_layers:
            raise ValueError(f"{node!r}: layer {node[1]} does not exist (n_layers={self.n_layers})")
        if node[0] == "head" and not 0 <= node[2] < self.n_heads:
            raise ValueError(f"{node!r}: head {node[2]} does not exist (n_heads={self.n_heads})")
        if node[0] == "head" and len(node) == 4 and node[3] not in QKV:
            raise ValueError(f"{node!r}: a head's input is 'q', 'k' or 'v', got {node[3]!r}")
        if node[0] == "mlp" and not self.has_mlp:
            raise ValueError(f"{node!r}: this model is attention-only; it has no MLPs")

    def sender_index(self, node) -> int:
        node = _as_tuple(node)
        self._check_node(node)
        if node not in self._sender_index:
            raise ValueError(f"{receiver_label(node) if node[0] != 'embed' else 'embed'} is not a sender: senders are "
                             "embed, heads (L0H3) and MLPs (L1 mlp); a head's q/k/v and the logits only receive")
        return self._sender_index[node]

    def receiver_index(self, node) -> int:
        node = _as_tuple(node)
        self._check_node(node)
        if node not in self._receiver_index:
            hint = " (name its input: q, k or v, e.g. L1H4.k)" if node[0] == "head" else ""
            raise ValueError(f"{sender_label(node)} is not a receiver{hint}: receivers are a head's q, k or v input, "
                             "an MLP's input and the logits")
        return self._receiver_index[node]

    def edge_index(self, edge: EdgeSpec) -> int:
        """The index of ``edge``: an index, ``"L0H3 -> L1H4.k"``, or ``(sender, receiver)``."""
        if isinstance(edge, (int, np.integer)) and not isinstance(edge, bool):
            if not 0 <= edge < self.n_edges:
                raise ValueError(f"edge index {edge} is out of range: the graph has {self.n_edges} edges")
            return int(edge)
        if isinstance(edge, str):
            if "->" not in edge:
                raise ValueError(f"{edge!r} is not an edge: write '<sender> -> <receiver>', e.g. 'L0H3 -> L1H4.k'")
            edge = tuple(part.strip() for part in edge.split("->", 1))
        if not isinstance(edge, (tuple, list)) or len(edge) != 2:
            raise ValueError(f"{edge!r} is not an edge: give an index, 'L0H3 -> L1H4.k', or (sender, receiver)")
        s, r = self.sender_index(edge[0]), self.receiver_index(edge[1])
        if (s, r) not in self._edge_index:
            raise ValueError(f"edge {self.sender_labels[s]} -> {self.receiver_labels[r]} does not exist in this graph: "
                             "a receiver reads only the senders written before it (earlier layers; an MLP also its own "
                             f"layer's heads unless the layout is parallel); the graph has {self.n_edges} edges "
                             "(ComputationGraph.edges lists them)")
        return self._edge_index[(s, r)]

    def edge_indices(self, edges: Sequence[EdgeSpec]) -> list[int]:
        if isinstance(edges, (str, tuple)) or not hasattr(edges, "__iter__"):
            edges = [edges]
        return [self.edge_index(e) for e in edges]

    # ---- masks: which receiver reads which sender's clean (1) or corrupted (0) value ------------
    def full_mask(self) -> torch.Tensor:
        """Every edge kept: [senders, receivers] floats, 1 on edges and 0 where there is none."""
        return self.adjacency.float()

    def mask_of(self, edges: Sequence[EdgeSpec]) -> torch.Tensor:
        """A mask that keeps only ``edges``."""
        mask = torch.zeros(self.adjacency.shape)
        idx = self.edge_indices(edges)
        mask[self.edge_sender[idx], self.edge_receiver[idx]] = 1.0
        return mask

    def mask_from_vector(self, keep: torch.Tensor) -> torch.Tensor:
        """[senders, receivers] from one value per edge (in ``edges`` order)."""
        mask = torch.zeros(self.adjacency.shape, dtype=keep.dtype)
        mask[self.edge_sender, self.edge_receiver] = keep
        return mask

    def vector_from_mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask[self.edge_sender, self.edge_receiver]

    def signature(self) -> dict:
        """What makes two graphs the same: the layout and the sizes (circuit files store it)."""
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "layout": self.layout, "n_edges": self.n_edges}

    def node_of_receiver(self, r: int) -> Node:
        """The node a receiver belongs to (a head for its q/k/v input)."""
        node = self.receivers[r]
        return node[:3] if node[0] == "head" else node
