"""widest_path against a brute-force search over every path of small random graphs; measured_edge
against the graph's own edges (computed by backward passes, not by this forward intervention) and
against the intervention done by hand on the plain model with hooks."""

from __future__ import annotations

import math

import pytest
import torch
from factories import tiny
from test_graphs import _transcoders  # random skip-transcoders at a realistic scale, about a third firing

import workbench as wb
from workbench.analysis.graphs import Graph, attribution_graph, measured_edge, widest_path
from workbench.analysis.graphs.graph import NODE_KINDS


def _random_graph(n: int, seed: int, p: float = 0.45) -> Graph:
    """A random DAG of n nodes: two tokens, then features and an error node in order, the logit last;
    an edge i -> j (i < j) with probability p, weights of either sign."""
    g = torch.Generator().manual_seed(seed)
    kinds = [2, 2] + [1 if i == n // 2 else 0 for i in range(2, n - 1)] + [3]
    kind = torch.tensor(kinds)
    src, tgt = [], []
    for j in range(2, n):
        for i in range(j):
            if float(torch.rand(1, generator=g)) < p:
                src.append(i), tgt.append(j)
    weight = torch.randn(len(src), generator=g)
    zeros = torch.zeros(n, dtype=torch.long)
    return Graph(kind, zeros, zeros, zeros, torch.zeros(n), torch.zeros(n), ["logit"], torch.tensor(tgt),
                 torch.tensor(src), weight, torch.zeros(2, dtype=torch.long), ["a", "b"], 1)


def _brute_force(graph: Graph, source: int, target: int, through_features: bool) -> tuple[float, list]:
    """The best product of normalised |weights| over every simple path, by enumerating them all."""
    w = {}
    totals = [0.0] * graph.n_nodes
    for t, s, x in zip(graph.edge_target.tolist(), graph.edge_source.tolist(), graph.edge_weight.tolist()):
        w[(s, t)] = w.get((s, t), 0.0) + abs(x)
        totals[t] += abs(x)
    best = (0.0, [])

    def walk(path: list[int], product: float) -> None:
        nonlocal best
        node = path[-1]
        if node == target:
            inner = path[1:-1]
            if through_features and (not inner or any(graph.kind[i] != 0 for i in inner)):
                return
            if product > best[0]:
                best = (product, list(path))
            return
        for nxt in range(graph.n_nodes):
            if (node, nxt) in w and nxt not in path:
                walk(path + [nxt], product * w[(node, nxt)] / totals[nxt])

    walk([source], 1.0)
    return best


def _product(graph: Graph, path: list[int]) -> float:
    A = graph.adjacency().abs().double()
    A = A / A.sum(1, keepdim=True).clamp_min(1e-30)
    return math.prod(float(A[t, s]) for s, t in zip(path, path[1:]))


@pytest.mark.parametrize("through_features", [False, True])
def test_widest_path_is_the_best_of_every_path(through_features):
    checked = 0
    for seed in range(30):
        graph = _random_graph(9, seed)
        for source in (0, 1, 2):
            product, path = _brute_force(graph, source, 8, through_features)
            found = widest_path(graph, source, 8, through_features=through_features)
            if not path:
                assert found == []
                continue
            assert found[0] == source and found[-1] == 8
            assert all(graph.edge(t, s) != 0 for s, t in zip(found, found[1:]))  # a path of the graph's edges
            assert _product(graph, found) == pytest.approx(product, rel=1e-9)
            assert found == path  # random weights: no ties
            checked += 1
    assert checked > 50


def test_widest_path_refuses_a_node_the_graph_does_not_have():
    graph = _random_graph(6, 0)
    with pytest.raises(ValueError, match="target must be a node index of this graph"):
        widest_path(graph, 0, 6)
    with pytest.raises(ValueError, match="source must be a node index"):
        widest_path(graph, -1, 5)


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40)).eval()  # LayerNorm, learned positions, GELU
    tcs = _transcoders(model, d_sae=24)
    tokens = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(1))
    return model, tcs, tokens


def _kind(graph, i) -> str:
    return NODE_KINDS[int(graph.kind[i])]


@pytest.mark.parametrize("token_embedding", ["token+position", "token"])
def test_measured_edge_is_the_graphs_edge_for_every_kind_of_edge(built, token_embedding):
    """Each (source kind, target kind) pair: the forward intervention gives the edge the backward passes
    computed; the logit target is a logit difference, which measured_edge reads from the graph.
    With token_embedding="token" a token node is the token's embedding alone (this model adds learned
    position embeddings): zeroing the whole residual stream at that position would miss the edge."""
    model, tcs, tokens = built
    graph = attribution_graph(model, tcs, tokens, target=(3, 5), token_embedding=token_embedding)
    seen = {}
    for t, s, w in zip(graph.edge_target.tolist(), graph.edge_source.tolist(), graph.edge_weight.tolist()):
        pair = (_kind(graph, s), _kind(graph, t))
        if abs(w) > 1e-3 and len(seen.setdefault(pair, [])) < 3:
            seen[pair].append((s, t, w))
    assert set(seen) == {(a, b) for a in ("feature", "error", "token") for b in ("feature", "logit")}
    for edges in seen.values():
        for s, t, w in edges:
            assert measured_edge(graph, s, t) == pytest.approx(w, abs=1e-5, rel=1e-4)
    pruned = graph.prune(0.8, 0.98)  # a pruned graph keeps its binding and its own node numbers
    s, t = int(pruned.edge_source[0]), int(pruned.edge_target[0])
    assert measured_edge(pruned, s, t) == pytest.approx(pruned.edge(t, s), abs=1e-5, rel=1e-4)


@torch.no_grad()
def test_measured_edge_is_the_intervention_done_by_hand_with_hooks(built):
    """On the plain model, with the replacement model's freezing written out as hooks: attention
    patterns and norm scales held at their clean values, layer 0's MLP output less one feature's
    decoder row (that feature zeroed), layer 1's MLP output its clean value plus what its skip path
    adds (every feature held), read at layer 1's encoder (a feature target) or at the logits (the
    demeaned logit of the answer: a token target)."""
    model, tcs, tokens = built
    answer = 11
    graph = attribution_graph(model, tcs, tokens, target=answer)
    _, cache = model.run_with_cache(tokens)
    frozen = [n for n in cache.cache_dict if n.endswith(("hook_scale", "hook_pattern"))]

    def run(remove: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen = {}

        def hold(x, hook):
            return cache[hook.name]

        def minus(x, hook):
            x = x.clone()
            x[0, pos] -= remove
            return x

        def read(x, hook):
            seen["x"] = x

        def held_features(out, hook):  # the skip path is linear in the live input; the features are held
            return cache[hook.name] + (seen["x"] - cache["blocks.1.ln2.hook_normalized"]) @ tcs[1].W_skip.T

        hooks = [(n, hold) for n in frozen] + [("blocks.0.hook_mlp_out", minus), ("blocks.1.ln2.hook_normalized", read),
                                               ("blocks.1.hook_mlp_out", held_features)]
        with model.hooks(fwd_hooks=hooks):
            logits = model(tokens)
        return seen["x"][0], logits[0, -1]

    features = [i for i in range(graph.n_nodes) if _kind(graph, i) == "feature" and int(graph.layer[i]) == 0]
    later = [i for i in range(graph.n_nodes) if _kind(graph, i) == "feature" and int(graph.layer[i]) == 1]
    logit = int(graph.nodes_of("logit")[0])
    clean_x, clean_logits = run(torch.zeros(model.cfg.d_model), 0)
    checked = 0
    for s in features[:6]:
        pos, feat = int(graph.pos[s]), int(graph.feature[s])
        act = float(graph.activation[s])
        x, logits = run(act * tcs[0].W_dec[feat], pos)
        demeaned = (clean_logits[answer] - clean_logits.mean()) - (logits[answer] - logits.mean())
        assert measured_edge(graph, s, logit) == pytest.approx(float(demeaned), abs=1e-5, rel=1e-4)
        for t in [t for t in later if int(graph.pos[t]) >= pos][:3]:
            t_pos, t_feat = int(graph.pos[t]), int(graph.feature[t])
            change = float((clean_x[t_pos] - x[t_pos]) @ tcs[1].W_enc[:, t_feat])
            assert measured_edge(graph, s, t) == pytest.approx(change, abs=1e-5, rel=1e-4)
            checked += 1
    assert checked >= 6


def test_measured_edge_refuses_what_has_no_edge(built):
    model, tcs, tokens = built
    graph = attribution_graph(model, tcs, tokens, target=3)
    logit, token = int(graph.nodes_of("logit")[0]), int(graph.nodes_of("token")[0])
    with pytest.raises(ValueError, match="no edge goes into it"):
        measured_edge(graph, logit - 1 if _kind(graph, logit - 1) != "logit" else 0, token)
    with pytest.raises(ValueError, match="is a logit node"):
        measured_edge(graph, logit, 0)
    with pytest.raises(ValueError, match="target must be a node index"):
        measured_edge(graph, 0, graph.n_nodes)
    loaded = Graph.from_dict(graph.to_dict())  # not bound to a model
    with pytest.raises(ValueError, match="not bound"):
        measured_edge(loaded, 0, logit)
