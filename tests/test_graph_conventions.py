"""Where our attribution graphs may follow circuit-tracer 0.5.0's conventions, checked against references
written here from its definitions, not from our code.

(1) ``graph.scores()`` is ``compute_graph_scores`` (circuit_tracer/graph.py) transcribed on the dense
adjacency; (2) ``token_embedding="token"``: on a learned-position model a token node carries W_E of its
token alone (circuit-tracer's ``token_vectors = W_E[tokens]``) and each of its edges is the change when
that part of the embedding is removed; (3) ``held_positions=1``: no feature or error node at position 0
(circuit-tracer's ``zero_positions``), every edge still the intervention on a replacement model built
here by hand; (4) a hook on any norm leaves a float64 model's logits as they are.
"""

import pytest
import torch
from factories import tiny
from test_graphs import ATOL, _model, _pre_activation, _transcoders

import workbench as wb
from workbench.analysis.graphs import Graph, attribution_graph, capture, frozen_forward, live_forward, replacement_set


# ---- (1) completeness -------------------------------------------------------------------------------
def _circuit_tracer_scores(A: torch.Tensor, n_features: int, n_tokens: int, n_layers: int,
                           logit_probabilities: torch.Tensor) -> tuple[float, float]:
    """circuit-tracer 0.5.0's ``compute_graph_scores``, line for line, in float64."""
    n_logits = len(logit_probabilities)
    error_start = n_features
    error_end = error_start + n_tokens * n_layers
    token_end = error_end + n_tokens
    logit_weights = torch.zeros(A.shape[0], dtype=torch.float64)
    logit_weights[-n_logits:] = logit_probabilities.double()
    normalized = A.double().abs()
    normalized = normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)
    current = logit_weights @ normalized
    influence = current.clone()
    for _ in range(1000):
        current = current @ normalized
        if not current.any():
            break
        influence += current
    token_influence = influence[error_end:token_end].sum()
    error_influence = influence[error_start:error_end].sum()
    replacement = token_influence / (token_influence + error_influence)
    non_error = 1 - normalized[:, error_start:error_end].sum(dim=-1)
    output_influence = influence + logit_weights
    completeness = (non_error * output_influence).sum() / output_influence.sum()
    return float(replacement), float(completeness)


@pytest.mark.parametrize("overrides", [dict(), dict(norm="rmsnorm", positional="rope")])
def test_scores_are_circuit_tracers_compute_graph_scores(overrides):
    """Completeness used to weigh only nodes with incoming edges (0.663 against circuit-tracer's 0.798 on one
    audited graph): tokens and errors, complete by its definition, were left out of the weights."""
    model = _model(**overrides)
    graph = attribution_graph(model, _transcoders(model), torch.randint(0, 40, (1, 8),
                              generator=torch.Generator().manual_seed(1)), batch_size=32)
    n_features = int((graph.kind == 0).sum())
    logits = graph.nodes_of("logit")
    assert bool((logits == torch.arange(graph.n_nodes - len(logits), graph.n_nodes)).all())  # circuit-tracer's order
    replacement, completeness = _circuit_tracer_scores(graph.adjacency(), n_features, len(graph.tokens),
                                                       model.cfg.n_layers, graph.logit_weight[logits])
    scores = graph.scores()
    assert scores["replacement"] == pytest.approx(replacement, abs=1e-5)
    assert scores["completeness"] == pytest.approx(completeness, abs=1e-5)
    assert 0 < completeness < 1


# ---- shared: edges against interventions on a replacement model given by hand ---------------------------------------
def _check_edges_against(model, rs, cap, graph: Graph, token_part: torch.Tensor, n: int = 3) -> set:
    """Sampled edges of every (source kind, target kind) equal the change in the target when the source
    is removed in the frozen replacement model of ``cap`` (a token: ``token_part[pos]`` taken away)."""
    g = torch.Generator().manual_seed(0)
    t, s = graph.edge_target, graph.edge_source
    pairs = []
    for tk in (0, 3):
        for sk in (0, 1, 2):
            hit = ((graph.kind[t] == tk) & (graph.kind[s] == sk)).nonzero().squeeze(-1)
            pairs += [(int(t[i]), int(s[i])) for i in hit[torch.randperm(len(hit), generator=g)[:n]]]
    clean = frozen_forward(model, rs, cap)
    seen = set()
    with torch.no_grad():
        clean()
        for tgt, src in pairs:
            kind, layer, pos, feat = (int(graph.kind[src]), int(graph.layer[src]), int(graph.pos[src]),
                                      int(graph.feature[src]))
            acts, errors, embed = [a.clone() for a in cap.acts], [e.clone() for e in cap.errors], cap.embed.clone()
            if kind == 0:
                acts[layer][pos, feat] = 0.0
            elif kind == 1:
                errors[layer][pos] = 0.0
            else:
                embed[pos] -= token_part[pos]
            run = frozen_forward(model, rs, cap, acts=acts, errors=errors, embed=embed)
            run()
            change = _pre_activation(model, rs, clean, cap, tgt, graph) - _pre_activation(model, rs, run, cap, tgt, graph)
            assert graph.edge(tgt, src) == pytest.approx(change, abs=ATOL, rel=ATOL), (graph.node_ids()[src],
                                                                                       graph.node_ids()[tgt])
            seen.add((int(graph.kind[tgt]), kind))
    return seen


# ---- (2) token nodes on a learned-position model ----------------------------------------------------------
def test_token_nodes_can_carry_the_token_embedding_alone():
    model = _model()  # learned positions, added to the residual stream
    assert model.cfg.positional == "learned"
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(2))
    default = attribution_graph(model, tcs, tokens, batch_size=32)
    graph = attribution_graph(model, tcs, tokens, batch_size=32, token_embedding="token")
    assert default.meta["token_embedding"] == "token+position" and graph.meta["token_embedding"] == "token"
    rs = replacement_set(tcs)
    cap = capture(model, rs, tokens)[0]  # the default capture: the whole embedding is the forward's input
    W_E = model.embed.W_E.detach()[tokens[0]]  # circuit-tracer's token_vectors
    assert _check_edges_against(model, rs, cap, graph, W_E) >= {(0, 2), (3, 2), (0, 0), (3, 1)}
    tok = lambda g: g.edge_weight[g.kind[g.edge_source] == 2]
    assert not torch.allclose(tok(graph), tok(default))  # the position embedding is no longer in the token edges
    # the same feature and error edges: only what the token nodes carry differs
    inner = lambda g: g.edge_weight[g.kind[g.edge_source] != 2]
    torch.testing.assert_close(inner(graph), inner(default), atol=1e-6, rtol=0)


def test_token_embedding_is_the_same_either_way_under_rope():
    model = _model(norm="rmsnorm", positional="rope")
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(4))
    a = attribution_graph(model, tcs, tokens, batch_size=32)
    b = attribution_graph(model, tcs, tokens, batch_size=32, token_embedding="token")
    torch.testing.assert_close(a.edge_weight, b.edge_weight, atol=0, rtol=0)


# ---- (3) position 0 ---------------------------------------------------------------------------------------
def test_held_position_zero_has_no_feature_or_error_nodes():
    model = _model()
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(5))
    graph = attribution_graph(model, tcs, tokens, batch_size=32, held_positions=1, token_embedding="token")
    assert graph.meta["held_positions"] == 1
    assert attribution_graph(model, tcs, tokens, batch_size=32).meta["held_positions"] == 0
    features, errors = graph.kind == 0, graph.kind == 1
    assert not bool((features & (graph.pos == 0)).any()) and bool(features.any())
    err0 = (errors & (graph.pos == 0)).nonzero().squeeze(-1)
    assert len(err0) == model.cfg.n_layers and bool((graph.activation[err0] == 0).all())
    assert not bool(torch.isin(graph.edge_source, err0).any())  # circuit-tracer's zeroed error vectors
    # the reference replacement model, by hand: position 0's features held at zero, its MLP output a constant
    rs = replacement_set(tcs)
    cap = capture(model, rs, tokens)[0]
    for layer in range(rs.n_layers):
        cap.acts[layer][0] = 0
    cap.errors = [cap.mlp_out[l] - rs.decode(l, cap.acts, cap.x_in[l]) for l in range(rs.n_layers)]
    with torch.no_grad():  # it still gives the model's logits, frozen and live
        reference = model(tokens)[0]
        torch.testing.assert_close(frozen_forward(model, rs, cap)()[0], reference, atol=ATOL, rtol=0)
        held = graph._bound()[2]
        torch.testing.assert_close(live_forward(model, rs, held, lambda l, a: a)()[0], reference, atol=ATOL, rtol=0)
    W_E = model.embed.W_E.detach()[tokens[0]]
    assert len(_check_edges_against(model, rs, cap, graph, W_E)) == 6


def test_conventions_survive_a_file_and_are_refused_when_unknown(tmp_path):
    model = _model()
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(6))
    graph = attribution_graph(model, tcs, tokens, max_n_logits=1, held_positions=1, token_embedding="token")
    again = Graph.load(graph.save(tmp_path / "g.json")).bind(model, tcs)
    cap = again._bound()[2]
    assert cap.held == 1 and cap.token_vectors is not None
    torch.testing.assert_close(again.intervene([], direct_only=True), graph.intervene([], direct_only=True),
                               atol=ATOL, rtol=0)
    # head loadings take the token node's part of the embedding away: the measured total is the edge
    logit, token = int(graph.nodes_of("logit")[0]), int(graph.nodes_of("token")[3])
    frame = wb.analysis.head_loadings(graph, token, logit, 1)
    assert frame.attrs["total"] == pytest.approx(frame.attrs["edge"], abs=ATOL) and frame.attrs["edge"] != 0
    with pytest.raises(ValueError, match="held"):
        wb.analysis.head_loadings(graph, "E0.0", logit, 1)
    for bad in (dict(token_embedding="position"), dict(held_positions=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            attribution_graph(model, tcs, tokens, **bad)


# ---- (4) float64 and hooked norms ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(norm="rmsnorm", positional="rope", qk_norm="head"),
                                       dict(norm="gemma_rmsnorm", positional="rope", scale_embeddings=True),
                                       dict(norm="rmsnorm", positional="rope", fold=True), dict(fold=True)])
def test_a_hook_on_a_norm_leaves_a_float64_model_unchanged(overrides):
    """The hooked path computed the statistics in float32 (``x.float()``): a hook on a norm moved a float64
    model's logits by about 2e-6."""
    overrides = dict(overrides)
    fold = overrides.pop("fold", False)
    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, **overrides)).double().eval()
    if fold:
        model.process_weights(fold_ln=True)
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(7))
    names = [n for n in model.hook_dict if n.endswith("hook_scale") or n.endswith("hook_normalized")]
    assert names
    with torch.no_grad():
        plain = model(tokens)
        hooked = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n in names, lambda x, hook: x)])
    assert plain.dtype == torch.float64
    torch.testing.assert_close(hooked, plain, atol=1e-12, rtol=0)


def test_qk_parts_under_circuit_tracers_conventions():
    """QK attribution splits the stream into the graph's nodes: under token_embedding="token" the token row is
    W_E's and the position embedding goes to the constant row; a held position's error is constant too."""
    from workbench.analysis.graphs.qk import QKContext

    model = _model()
    tcs = _transcoders(model)
    tokens = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(8))
    graph = attribution_graph(model, tcs, tokens, max_n_logits=1, held_positions=1, token_embedding="token")
    ctx = QKContext(graph)
    _, cache = model.run_with_cache(tokens)
    for pos in (0, 3):
        parts = ctx.parts(1, pos)
        torch.testing.assert_close(parts.stack().sum(0).float(), cache["blocks.1.hook_resid_pre"][0, pos],
                                   atol=ATOL, rtol=0)
        # at layer 0 (no skip path through it yet) the token row is the token's embedding alone
        torch.testing.assert_close(ctx.parts(0, pos).rows[1].float(), model.embed.W_E[tokens[0, pos]], atol=ATOL,
                                   rtol=0)
        assert ("err L0" in parts.units) == (pos > 0)
    frame = wb.analysis.qk_attribution(graph, 1, 0, 6, 0, top=None, exact=0, context=ctx)
    assert frame.contribution.sum() == pytest.approx(frame.attrs["bilinear"], abs=ATOL)
