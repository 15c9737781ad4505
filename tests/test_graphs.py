"""Attribution graphs, proven edge by edge on tiny fp32 models of every layout that has MLPs.

(a) the frozen replacement model with its error nodes gives the model's logits; (b) sampled
edges of every kind (and sampled non-edges) equal the change in the target's pre-activation
when the source is zeroed in the frozen replacement model, a forward computation independent of
the backward passes that made the graph; (c) each prompt of a padded batch gets the graph it
gets alone. Influence is checked against ``(I - A)^-1`` and pruning against a dense transcription
of circuit-tracer's ``prune_graph``; the sparse graph against the dense one.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis.dictionaries import DictionaryConfig
from workbench.analysis.dictionaries.clt import CrossLayerTranscoder
from workbench.analysis.dictionaries.registry import make_dictionary
from workbench.analysis.graphs import Graph, attribution_graph, capture, frozen_forward, live_forward, replacement_set
from workbench.analysis.graphs.replacement import final_read
from workbench.padding import TokenBatch

ATOL = 1e-5

# Every layout with MLPs the replacement model supports, and the components around them.
LAYOUTS = {
    "pre-layernorm-learned-gelu": dict(),
    "pre-rmsnorm-rope-swiglu-gqa": dict(norm="rmsnorm", positional="rope", ffn="swiglu", n_kv_heads=2),
    "pre-layernorm-alibi-relu": dict(positional="alibi", ffn="relu"),
    "parallel-rope": dict(parallel_residual=True, positional="rope"),
    "qknorm-softcap-window": dict(norm="rmsnorm", positional="rope", qk_norm="head", attn_logit_softcap=20.0,
                                  sliding_window=4, global_every=2, final_logit_softcap=15.0),
    "moe": dict(norm="rmsnorm", positional="rope", ffn="moe", n_experts=4, experts_per_token=2),
    "gemma-rmsnorm-untied-nobias": dict(norm="gemma_rmsnorm", positional="rope", bias=False, tie_embeddings=False,
                                        scale_embeddings=True),
    "mla": dict(attention="mla", norm="rmsnorm", positional="rope", kv_lora_rank=16, q_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


def _transcoders(model, kind: str = "skip_transcoder", d_sae: int = 48, seed: int = 0, k: int = 0) -> list:
    """Random transcoders at a realistic scale: decoders sized to the MLP's output, about a third firing."""
    g = torch.Generator().manual_seed(seed)
    out = []
    d = model.cfg.d_model
    for layer in range(model.cfg.n_layers):
        tc = make_dictionary(DictionaryConfig(kind=kind, d_in=d, d_sae=d_sae, d_out=d, k=k,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        tc.init_weights(g)
        with torch.no_grad():
            tc.W_enc.mul_(1.5)
            tc.b_enc.copy_(-0.4 * torch.rand(d_sae, generator=g))
            tc.W_dec.mul_(0.3)
            if hasattr(tc, "W_skip"):
                tc.W_skip.copy_(0.1 * torch.randn(d, d, generator=g))
        out.append(tc.eval())
    return out


def _model(**overrides):
    cfg = tiny(init_std=0.1, d_vocab=40, **overrides)
    return wb.HookedDecoder(cfg).eval()


def _pre_activation(model, rs, run, cap, node: int, graph: Graph) -> float:
    """The target node's pre-activation in the last run of ``run``: an encoder row or a logit direction."""
    layer, pos = int(graph.layer[node]), int(graph.pos[node])
    if int(graph.kind[node]) == 0:
        W, b = rs.encoder(layer)
        x = run.x[layer][0, pos].flatten()
        return float(x @ W[:, int(graph.feature[node])] + b[int(graph.feature[node])])
    j = int((graph.nodes_of("logit") == node).nonzero())
    _, w = final_read(model)
    return float((run.final[0, pos] * w) @ graph.logit_vectors[j])


def _zeroed(model, rs, cap, graph: Graph, source: int):
    """The frozen replacement model with source node ``source`` set to zero, every other node held."""
    kind, layer, pos, feat = (int(graph.kind[source]), int(graph.layer[source]), int(graph.pos[source]),
                              int(graph.feature[source]))
    acts = [a.clone() for a in cap.acts]
    errors = [e.clone() for e in cap.errors]
    embed = cap.embed.clone()
    if kind == 0:
        acts[layer][pos, feat] = 0.0
    elif kind == 1:
        errors[layer][pos] = 0.0
    else:
        embed[pos] = 0.0
    return frozen_forward(model, rs, cap, acts=acts, errors=errors, embed=embed)


def _check_edges(model, graph: Graph, n_per_kind: int = 2, n_random: int = 4, seed: int = 0) -> int:
    """Compare sampled edges (each source-kind x target-kind pair) and random pairs to perturbations."""
    _, rs, cap = graph._bound()
    g = torch.Generator().manual_seed(seed)
    pairs = []
    t, s = graph.edge_target, graph.edge_source
    for tk in (0, 3):
        for sk in (0, 1, 2):
            hit = ((graph.kind[t] == tk) & (graph.kind[s] == sk)).nonzero().squeeze(-1)
            pick = hit[torch.randperm(len(hit), generator=g)[:n_per_kind]]
            pairs += [(int(t[i]), int(s[i])) for i in pick]
    targets = ((graph.kind == 0) | (graph.kind == 3)).nonzero().squeeze(-1)
    sources = (graph.kind != 3).nonzero().squeeze(-1)
    for _ in range(n_random):  # mostly pairs with no edge: the change must be zero too
        pairs.append((int(targets[torch.randint(len(targets), (1,), generator=g)]),
                      int(sources[torch.randint(len(sources), (1,), generator=g)])))
    clean = frozen_forward(model, rs, cap)
    with torch.no_grad():
        clean()
        base = {tgt: _pre_activation(model, rs, clean, cap, tgt, graph) for tgt, _ in pairs}
        for tgt, src in pairs:
            run = _zeroed(model, rs, cap, graph, src)
            run()
            change = base[tgt] - _pre_activation(model, rs, run, cap, tgt, graph)
            assert graph.edge(tgt, src) == pytest.approx(change, abs=ATOL, rel=ATOL), (graph.node_ids()[src], graph.node_ids()[tgt])
    kinds = {(int(graph.kind[a]), int(graph.kind[b])) for a, b in pairs if graph.edge(a, b) != 0}
    return len(kinds)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replacement_model_and_edges(name):
    model = _model(**LAYOUTS[name])
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 7))
    rs = replacement_set(tcs)
    cap = capture(model, rs, tokens)[0]
    reference = model(tokens)[0].detach()
    with torch.no_grad():  # (a) frozen and live replacement models, errors included, give the model's logits
        torch.testing.assert_close(frozen_forward(model, rs, cap)()[0], reference, atol=ATOL, rtol=0)
        torch.testing.assert_close(live_forward(model, rs, cap, lambda l, a: a)()[0], reference, atol=ATOL, rtol=0)
    graph = attribution_graph(model, tcs, tokens, batch_size=32)
    assert graph.meta["n_active_features"] > 20
    assert _check_edges(model, graph) == 6  # (b) all six source-kind x target-kind pairs have edges that were checked


@pytest.mark.parametrize("kind", ["transcoder", "skip_transcoder"])
def test_topk_transcoder_graph_edges_are_interventions(kind):
    """TopK transcoders (circuit-tracer's form): once the graph freezes each token's active set, the
    map is linear, so every edge is still the direct effect of zeroing its source."""
    model = _model(**LAYOUTS["pre-rmsnorm-rope-swiglu-gqa"])
    tcs = _transcoders(model, kind=kind, k=6)
    tokens = torch.randint(0, 40, (1, 7))
    rs = replacement_set(tcs)
    cap = capture(model, rs, tokens)[0]
    assert all(((a > 0).sum(-1) <= 6).all() and ((a > 0).sum(-1) >= 1).all() for a in cap.acts)
    torch.testing.assert_close(cap.acts[0], tcs[0].encode(cap.x_in[0]))
    with torch.no_grad():
        torch.testing.assert_close(frozen_forward(model, rs, cap)()[0], model(tokens)[0], atol=ATOL, rtol=0)
    graph = attribution_graph(model, tcs, tokens, batch_size=32)
    assert _check_edges(model, graph) == 6


def _clt(activation: str, skip: bool, seed: int = 0) -> CrossLayerTranscoder:
    clt = CrossLayerTranscoder(n_layers=3, d_in=32, d_sae=40, activation=activation, k=6, skip=skip)
    clt.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        clt.W_enc.mul_(1.5)
        for W in clt.W_dec:
            W.mul_(0.3)
        if skip:
            clt.W_skip.normal_(0, 0.1)
        if activation == "jumprelu":
            clt.threshold.fill_(0.1)
    return clt.eval()


@pytest.mark.parametrize("activation, skip", [("topk", True), ("jumprelu", False)])
def test_cross_layer_transcoder_edges_and_frozen_logits(activation, skip):
    model = _model(n_layers=3, norm="rmsnorm", positional="rope", ffn="swiglu")
    clt = _clt(activation, skip)
    tokens = torch.randint(0, 40, (1, 6))
    rs = replacement_set(clt)
    cap = capture(model, rs, tokens)[0]
    with torch.no_grad():
        torch.testing.assert_close(frozen_forward(model, rs, cap)()[0], model(tokens)[0], atol=ATOL, rtol=0)
    graph = attribution_graph(model, clt, tokens, batch_size=32)
    assert _check_edges(model, graph) == 6
    # a layer-0 feature writes into layer 2's MLP output directly: an edge into a layer-2 feature at its position
    t, s = graph.edge_target, graph.edge_source
    far = (graph.kind[t] == 0) & (graph.kind[s] == 0) & (graph.layer[t] - graph.layer[s] == 2)
    assert far.any()


def test_every_backward_and_read_path_gives_the_same_checked_graph():
    """TopK transcoders (each layer's features read as a [pos, k] grid), the backward through stored
    patterns and through frozen queries and keys, one layer or mixed layers per batch: one graph."""
    model = _model(**LAYOUTS["pre-rmsnorm-rope-swiglu-gqa"])
    g = torch.Generator().manual_seed(1)
    tcs = []
    for layer in range(model.cfg.n_layers):
        tc = make_dictionary(DictionaryConfig(kind="skip_transcoder", d_in=32, d_sae=64, d_out=32, k=4,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        tc.init_weights(g)
        with torch.no_grad():
            tc.W_dec.mul_(0.3)
            tc.W_skip.copy_(0.1 * torch.randn(32, 32, generator=g))
        tcs.append(tc.eval())
    tokens = torch.randint(0, 40, (1, 9))
    stored = attribution_graph(model, tcs, tokens, stored_patterns=True)
    assert stored._context[2].patterns and _check_edges(model, stored) == 6
    for kw in (dict(stored_patterns=False, batch_size=5), dict(stored_patterns=True, batch_size=7)):
        other = attribution_graph(model, tcs, tokens, **kw)
        assert not other._context[2].patterns or kw["stored_patterns"]
        torch.testing.assert_close(other.adjacency(), stored.adjacency(), atol=ATOL, rtol=ATOL)
    # rows chosen by influence: batches that mix layers
    budget = attribution_graph(model, tcs, tokens, max_feature_nodes=20, batch_size=6, stored_patterns=False)
    keep = torch.tensor([(l, p, f) in set(zip(budget.layer.tolist(), budget.pos.tolist(), budget.feature.tolist()))
                         for l, p, f in zip(stored.layer.tolist(), stored.pos.tolist(), stored.feature.tolist())])
    keep |= stored.kind != 0
    sub = stored.subgraph(keep)
    rows = torch.unique(budget.edge_target)
    torch.testing.assert_close(budget.adjacency()[rows], sub.adjacency()[rows], atol=ATOL, rtol=ATOL)


def test_target_kinds():
    model = _model()
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 7))
    direction = torch.randn(32)
    graph = attribution_graph(model, tcs, tokens, target=[3, (5, 7), direction, torch.randn(40)])
    assert graph.logit_labels[1:] == ["5 - 7", "direction", "direction"]
    _check_edges(model, graph, n_per_kind=2, n_random=2)
    top = attribution_graph(model, tcs, tokens, max_n_logits=3, desired_logit_prob=0.99)
    probs = model(tokens)[0, -1].softmax(-1)
    assert top.feature[top.nodes_of("logit")].tolist() == probs.argsort(descending=True)[:3].tolist()
    with pytest.raises(ValueError, match="target"):
        attribution_graph(model, tcs, tokens, target=[torch.randn(7)])


def test_padded_batch_gives_each_prompt_its_own_graph():
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    rows = [torch.randint(0, 40, (n,)) for n in (7, 4, 6)]
    singles = [attribution_graph(model, tcs, row, batch_size=32) for row in rows]
    for side in ("right", "left"):
        batch = TokenBatch.from_ids([r.tolist() for r in rows], 0, side, torch.device("cpu"))
        graphs = attribution_graph(model, tcs, batch, batch_size=32)
        for graph, alone in zip(graphs, singles):
            assert torch.equal(graph.kind, alone.kind) and torch.equal(graph.feature, alone.feature)
            torch.testing.assert_close(graph.adjacency(), alone.adjacency(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides, name", [(dict(norm_placement="post"), "post"),
                                             (dict(norm_placement="sandwich"), "sandwich"),
                                             (dict(norm_placement="reordered"), "reordered")])
def test_other_layouts_refused_by_name(overrides, name):
    model = _model(**overrides)
    with pytest.raises(ValueError, match=f"'{name}'"):
        attribution_graph(model, _transcoders(model), torch.randint(0, 40, (1, 5)))
    attn_only = _model(attn_only=True)
    with pytest.raises(ValueError, match="no MLPs"):
        attribution_graph(attn_only, _transcoders(_model()), torch.randint(0, 40, (1, 5)))


def test_a_half_precision_model_is_refused_by_name():
    """A bf16 or fp16 model, or transcoders in another dtype than the model's, used to crash inside the
    backward passes (a RuntimeError about dtypes); a float64 model with float64 transcoders works."""
    for dtype in (torch.bfloat16, torch.float16):
        model = _model(attn_only=True).to(dtype)
        with pytest.raises(ValueError, match="float32"):
            attribution_graph(model, None, torch.randint(0, 40, (1, 5)))
    graph = attribution_graph(_model(attn_only=True).double(), None, torch.randint(0, 40, (1, 5)))
    assert graph.n_edges > 0
    model = _model(norm="rmsnorm")  # float32, with bf16 transcoders: the same RuntimeError, now refused by name
    with pytest.raises(ValueError, match="transcoders' weights are torch.bfloat16"):
        attribution_graph(model, [tc.to(torch.bfloat16) for tc in _transcoders(model)], torch.randint(0, 40, (1, 5)))
    model = model.double()
    graph = attribution_graph(model, [tc.double() for tc in _transcoders(model)], torch.randint(0, 40, (1, 5)))
    assert graph.n_edges > 0


def test_bad_settings_are_refused_before_any_work():
    """max_feature_nodes=-1 shrank the edge buffer below the logit rows (a RuntimeError), max_edges_per_node=0
    kept no edge (an empty graph), update_interval=0 picked no rows and looped for ever."""
    model = _model(norm="rmsnorm")
    tcs, tokens = _transcoders(model), torch.randint(0, 40, (1, 6))
    for kw, says in ((dict(max_feature_nodes=-1), "max_feature_nodes"), (dict(max_edges_per_node=0), "max_edges_per_node"),
                     (dict(update_interval=0, max_feature_nodes=4), "update_interval")):
        with pytest.raises(ValueError, match=says):
            attribution_graph(model, tcs, tokens, **kw)


def test_bad_transcoders_refused():
    model = _model()
    tcs = _transcoders(model)
    with pytest.raises(ValueError, match="one per MLP layer"):
        attribution_graph(model, tcs[:1], torch.randint(0, 40, (1, 5)))
    with pytest.raises(ValueError, match="in order"):
        attribution_graph(model, tcs[::-1], torch.randint(0, 40, (1, 5)))


def _dense_prune(A: torch.Tensor, logit_weights: torch.Tensor, is_feature, is_inner, always, node_t, edge_t):
    """circuit-tracer 0.5's prune_graph, transcribed on a dense matrix (its graph.py)."""
    def normalize(m):
        m = m.abs()
        return m / m.sum(1, keepdim=True).clamp(min=1e-10)

    def influence(m, w):
        cur = w @ m
        total = cur.clone()
        while cur.any():
            cur = cur @ m
            total += cur
        return total

    def threshold(scores, f):
        s = scores.sort(descending=True).values
        c = s.cumsum(0) / s.sum()
        return s[min(int(torch.searchsorted(c, f)), len(c) - 1)]

    node_inf = influence(normalize(A), logit_weights)
    node_mask = (node_inf >= threshold(node_inf, node_t)) | always
    P = A.clone()
    P[~node_mask] = 0
    P[:, ~node_mask] = 0
    Pn = normalize(P)
    scores = Pn * (influence(Pn, logit_weights) + logit_weights)[:, None]
    edge_mask = scores >= threshold(scores.flatten(), edge_t)
    old = None
    while old is None or not torch.equal(old, node_mask):
        old = node_mask.clone()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask &= ~is_inner | edge_mask.any(0)
        node_mask &= ~is_feature | edge_mask.any(1)
    return node_mask, edge_mask, node_inf


def test_influence_and_pruning_match_dense_references(tmp_path):
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    graph = attribution_graph(model, tcs, torch.randint(0, 40, (1, 8)))
    A = graph.adjacency().double()
    An = A.abs() / A.abs().sum(1, keepdim=True).clamp(min=1e-10)
    w = graph.logit_weight.double()
    exact = w @ (torch.linalg.inv(torch.eye(len(w), dtype=torch.float64) - An) - torch.eye(len(w), dtype=torch.float64))
    torch.testing.assert_close(graph.influence().double(), exact, atol=1e-6, rtol=1e-4)
    is_feature, is_inner = graph.kind == 0, graph.kind <= 1
    always = graph.kind >= 2
    for node_t, edge_t in ((0.8, 0.98), (0.5, 0.9)):
        nodes, edges, _ = _dense_prune(A.float(), graph.logit_weight, is_feature, is_inner, always, node_t, edge_t)
        result = graph.prune_masks(node_t, edge_t)
        assert torch.equal(result.node_mask, nodes)
        assert torch.equal(result.edge_mask, edges[graph.edge_target, graph.edge_source])
    pruned = graph.prune(0.8, 0.98)
    assert 0 < int((pruned.kind == 0).sum()) < int((graph.kind == 0).sum())
    scores = graph.scores()
    assert 0 < scores["replacement"] <= 1 and 0 < scores["completeness"] <= 1


def test_sparse_rows_keep_the_influence_of_the_dense_graph():
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 12))
    dense = attribution_graph(model, tcs, tokens, batch_size=32)
    # each row keeps its largest edges up to 99% of its absolute mass: every target keeps >= 99% of
    # the influence reaching it, so the graph keeps >= 99% of the dense graph's edge influence
    sparse = attribution_graph(model, tcs, tokens, edge_mass=0.99, batch_size=32)
    assert sparse.n_edges < 0.8 * dense.n_edges
    kept = torch.zeros(dense.n_nodes, dense.n_nodes, dtype=torch.bool)
    kept[sparse.edge_target, sparse.edge_source] = True
    scores = dense.edge_scores()
    share = float(scores[kept[dense.edge_target, dense.edge_source]].sum() / scores.sum())
    assert share >= 0.99, share
    # a budget of features, chosen by influence, holds most of the features' influence
    budget = attribution_graph(model, tcs, tokens, max_feature_nodes=int((dense.kind == 0).sum()) // 3, batch_size=16)
    inf = dense.influence()
    chosen = {(l, p, f) for l, p, f in zip(budget.layer.tolist(), budget.pos.tolist(), budget.feature.tolist())}
    is_chosen = torch.tensor([(l, p, f) in chosen for l, p, f in
                              zip(dense.layer.tolist(), dense.pos.tolist(), dense.feature.tolist())]) & (dense.kind == 0)
    assert float(inf[is_chosen].sum() / inf[dense.kind == 0].sum()) > 0.6


def test_frames_files_and_circuit_tracer_json(tmp_path):
    model = _model()
    tcs = _transcoders(model)
    graph = attribution_graph(model, tcs, torch.randint(0, 40, (1, 6)))
    nodes, edges = graph.to_frame()
    assert len(nodes) == graph.n_nodes and len(edges) == graph.n_edges
    assert set(nodes["kind"]) == {"feature", "error", "token", "logit"}
    back = Graph.load(graph.save(tmp_path / "g.json"))
    for name in ("kind", "layer", "pos", "feature", "edge_target", "edge_source"):
        assert torch.equal(getattr(back, name), getattr(graph, name))
    torch.testing.assert_close(back.edge_weight, graph.edge_weight)
    back.bind(model, tcs)
    torch.testing.assert_close(back.intervene([]), model(graph.tokens[None])[0].detach(), atol=ATOL, rtol=0)

    path = graph.to_circuit_tracer(tmp_path / "ct", slug="tiny")
    d = json.loads(path.read_text())
    listing = json.loads((tmp_path / "ct" / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listing["graphs"]] == ["tiny"]
    models = Path("/work/extra/ct-src/circuit_tracer/frontend/graph_models.py")
    if models.exists():  # circuit-tracer's own pydantic schema, where its source is at hand
        spec = importlib.util.spec_from_file_location("ct_graph_models", models)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.Model(**d)
    for node in d["nodes"]:
        assert {"node_id", "feature", "layer", "ctx_idx", "feature_type", "jsNodeId"} <= set(node)
    pruned = graph.prune()
    again = Graph.from_circuit_tracer(path)
    assert again.n_edges == pruned.n_edges == len(d["links"])
    assert sorted(again.edge_weight.tolist()) == pytest.approx(sorted(pruned.edge_weight.tolist()))
    feats = lambda g: sorted(zip(g.layer[g.kind == 0].tolist(), g.pos[g.kind == 0].tolist(), g.feature[g.kind == 0].tolist()))
    assert feats(again) == feats(pruned)


def test_intervention_direct_effect_is_the_edge():
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    graph = attribution_graph(model, tcs, torch.randint(0, 40, (1, 8)), max_n_logits=1)
    logit = int(graph.nodes_of("logit")[0])
    into = graph.edge_source[(graph.edge_target == logit) & (graph.kind[graph.edge_source] == 0)]
    node = int(into[graph.edge_weight[(graph.edge_target == logit) & (graph.kind[graph.edge_source] == 0)].abs().argmax()])
    vec = graph.logit_vectors[0] * final_read(model)[1]
    before = graph.intervene([], direct_only=True)
    after = graph.intervene([node], 0.0, direct_only=True)
    # the logit node's value moves by minus its direct edge (W_U's demeaned column: the logit minus the mean logit)
    token = int(graph.feature[logit])
    change = (before[-1, token] - before[-1].mean()) - (after[-1, token] - after[-1].mean())
    assert float(change) == pytest.approx(graph.edge(logit, node), abs=ATOL)
    assert vec.shape == (32,)
    live = graph.intervene([node], 0.0)
    assert not torch.allclose(live, before)
    with pytest.raises(ValueError, match="not a feature node"):
        graph.intervene([int(graph.nodes_of("error")[0])])


def test_intervention_refuses_a_feature_the_model_does_not_have():
    """A layer past the transcoders' used to match no edit (the clean logits came back as if the feature did
    not matter) and a negative position edited the last one; each is one ValueError, as a bad feature id is."""
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    graph = attribution_graph(model, tcs, torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(3)),
                              max_n_logits=1)
    n_pos, d_sae = 8, tcs[0].cfg.d_sae
    for bad, says in (((2, 0, 0), "layer"), ((-1, 0, 0), "layer"), ((0, 8, 0), "position"), ((0, -1, 0), "position"),
                      ((1, 0, d_sae), "feature id"), ("F2.0.0", "layer"), ("F0.-1.0", "position")):
        with pytest.raises(ValueError, match=says):
            graph.intervene([bad], 5.0)
    with pytest.raises(ValueError, match="layer"):
        graph.intervene([wb.analysis.Supernode("past", [(0, 1, 2), (5, 1, 2)])], 5.0)
    # the last position by its own index still works, and moves the logits there
    before, after = graph.intervene([]), graph.intervene([(1, n_pos - 1, 0)], 5.0)
    assert not torch.allclose(before[-1], after[-1])
    node = int(graph.nodes_of("feature")[0])  # a node index as numpy gives it (a DataFrame's) is the same node
    import numpy as np
    torch.testing.assert_close(graph.intervene([np.int64(node)], 5.0), graph.intervene([node], 5.0), atol=0, rtol=0)
    attn_only = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, attn_only=True)).eval()
    g = attribution_graph(attn_only, None, torch.randint(0, 40, (1, 6)))
    with pytest.raises(ValueError, match="attention-only"):
        g.intervene([(0, 1, 2)], 1.0)


def test_a_graph_refuses_to_run_on_weights_edited_after_it_was_built():
    """An edit through .data (which no version counter sees), of the model or of a transcoder, made
    intervene and the QK and loading tables mix the graph's capture with runs of the new weights; each is
    now refused, and so is bind() to the new weights (the graph's edges are of the old ones)."""
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(3))
    graph = attribution_graph(model, tcs, tokens, max_n_logits=1)
    clean = graph.intervene([])
    for edit in (model.blocks[0].attn.W_Q, next(tcs[1].parameters())):
        saved = edit.detach().clone()
        with torch.no_grad():
            edit.data[0] += 0.5
        with pytest.raises(ValueError, match="weights changed since this graph was built"):
            graph.intervene([])
        with pytest.raises(ValueError, match="weights changed"):
            wb.analysis.qk_attribution(graph, 0, 0, 7, 3)
        edit.data.copy_(saved)
    torch.testing.assert_close(graph.intervene([]), clean, atol=1e-6, rtol=0)  # the same weights again: allowed
    with torch.no_grad():
        model.blocks[1].mlp.W_in.data.mul_(2.0)  # the first transcoder of a real MLP layer sees another input
    with pytest.raises(ValueError, match="model's weights"):
        graph.bind(model, tcs)


def test_supernode_intervention_sets_every_member():
    from workbench.analysis.graphs import Supernode

    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    graph = attribution_graph(model, tcs, torch.randint(0, 40, (1, 8)), max_n_logits=1)
    logit = int(graph.nodes_of("logit")[0])
    into = (graph.edge_target == logit) & (graph.kind[graph.edge_source] == 0)
    members = graph.edge_source[into][graph.edge_weight[into].abs().argsort(descending=True)[:3]].tolist()
    ids = [graph.node_ids()[m] for m in members]
    group = Supernode("group", ids)
    for kw in (dict(), dict(freeze_attention=True), dict(direct_only=True)):
        one_by_one = graph.intervene(members, 0.0, **kw)
        torch.testing.assert_close(graph.intervene([group], 0.0, **kw), one_by_one, atol=0, rtol=0)
        torch.testing.assert_close(graph.intervene(["group"], [0.0], supernodes={"group": ids}, **kw), one_by_one,
                                   atol=0, rtol=0)
    # in the graph's own frozen model the target moves by minus the members' summed direct edges
    before, after = graph.intervene([], direct_only=True), graph.intervene([group], 0.0, direct_only=True)
    token = int(graph.feature[logit])
    change = (before[-1, token] - before[-1].mean()) - (after[-1, token] - after[-1].mean())
    assert float(change) == pytest.approx(sum(graph.edge(logit, m) for m in members), abs=ATOL)
    mixed = graph.intervene([Supernode("two", ids[:2]), ids[2]], [0.0, 0.0], direct_only=True)
    torch.testing.assert_close(mixed, after, atol=0, rtol=0)
    with pytest.raises(ValueError, match="set twice"):
        graph.intervene([group, ids[0]], [0.0, 1.0])
    with pytest.raises(ValueError, match="supernode"):
        graph.intervene(["nobody"])
    with pytest.raises(ValueError, match="non-empty"):
        Supernode("empty", [])


def test_a_spilled_attribution_never_holds_more_than_a_chunk_of_edges(tmp_path, monkeypatch):
    """The rows chosen by influence (max_feature_nodes): each influence update read the spilled edges chunk
    by chunk, not all of them joined (which held every edge in memory at once, what spill_dir is for)."""
    import workbench.analysis.graphs.attribute as attribute

    model = _model(norm="rmsnorm", positional="rope")
    tokens = torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(0))
    seen = []

    def watch(fn):
        def wrapped(edges_or_chunks, *args):
            parts = [edges_or_chunks] if isinstance(edges_or_chunks, tuple) else list(edges_or_chunks())
            seen.extend(len(p[0]) for p in parts)
            return fn(edges_or_chunks, *args)
        return wrapped

    monkeypatch.setattr(attribute, "compute_influence_sparse", watch(attribute.compute_influence_sparse))
    if hasattr(attribute, "_influence"):
        monkeypatch.setattr(attribute, "_influence", watch(attribute._influence))
    graph = attribution_graph(model, _transcoders(model), tokens, spill_dir=tmp_path, edge_chunk=200,
                              max_feature_nodes=30, batch_size=8)
    assert graph.n_edges > 600 and seen and max(seen) <= 200


def test_spilled_edges_give_the_in_memory_graph(tmp_path, monkeypatch):
    import workbench.analysis.graphs.attribute as attribute

    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 8))
    for kw in (dict(), dict(max_feature_nodes=30, batch_size=8)):  # all rows; rows chosen by influence from the files
        folder = tmp_path / str(len(kw))
        memory = attribution_graph(model, tcs, tokens, **kw)
        with monkeypatch.context() as m:  # no room to reserve one buffer: chunks of 500 edges, joined at the end
            m.setattr(attribute, "_reserve_limit", lambda: 0)
            chunked = attribution_graph(model, tcs, tokens, edge_chunk=500, **kw)
        for name in ("edge_target", "edge_source", "edge_weight"):
            assert torch.equal(getattr(chunked, name), getattr(memory, name))
        spilled = attribution_graph(model, tcs, tokens, spill_dir=folder, edge_chunk=500, **kw)
        assert len(spilled.edge_files) > 3 and spilled.__dict__["_edge_weight"] is None
        assert sorted(p.name for p in folder.iterdir()) == [p.name for p in spilled.edge_files]  # raw chunks removed
        assert spilled.n_edges == memory.n_edges
        for name in ("edge_target", "edge_source", "edge_weight"):  # read back from the files
            assert torch.equal(getattr(spilled, name), getattr(memory, name))
        torch.testing.assert_close(spilled.influence(), memory.influence(), atol=1e-7, rtol=1e-5)
        a, b = spilled.prune_masks(0.8, 0.98), memory.prune_masks(0.8, 0.98)
        assert torch.equal(a.node_mask, b.node_mask) and torch.equal(a.edge_mask, b.edge_mask)
        p, q = spilled.prune(), memory.prune()
        assert not p.edge_files and torch.equal(p.adjacency(), q.adjacency())
        assert spilled.scores() == pytest.approx(memory.scores(), abs=1e-6)
    with pytest.raises(ValueError, match="already holds edge files"):
        attribution_graph(model, tcs, tokens, spill_dir=tmp_path / "0")
