"""A graph is bound only to the weights it was computed with (issue 34, items 3 to 6).

Each test is one defect of the outside audit, and fails on the code before its fix: a loaded graph
bound to other weights, transcoders of another model taken without a word, a QK context of
another prompt or model answering under this graph's name, NaN weights giving a graph of NaN
edges (or a runaway one), and an edge store with no ceiling once it spills.
"""

import json

import pytest
import torch
from test_graphs import _clt, _model, _transcoders

import workbench as wb
from workbench.analysis.graphs import Graph, attribution_graph
from workbench.analysis.graphs.checks import UnverifiedGraphWarning
from workbench.analysis.graphs.qk import QKContext, qk_table
from workbench.analysis.splice import DictionaryMismatchWarning
from workbench.checkpoint import model_fingerprint


def _setup(seed: int = 0):
    model = _model(norm="rmsnorm", positional="rope", seed=seed)
    return model, _transcoders(model, seed=seed)


def _tokens(seed: int, n: int = 7) -> torch.Tensor:
    return torch.randint(0, 40, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_loaded_graph_refuses_other_weights_and_names_what_differs(tmp_path):
    model, tcs = _setup()
    graph = attribution_graph(model, tcs, _tokens(1), max_n_logits=1, max_feature_nodes=6)
    assert graph.meta["fingerprint"]["model"] == model_fingerprint(model)  # the checkpoint's hash, recorded
    path = graph.save(tmp_path / "g.json")
    clean = graph.intervene([])

    back = Graph.load(path).bind(model, tcs)  # its own weights: no warning, and the same answers
    torch.testing.assert_close(back.intervene([]), clean, atol=1e-5, rtol=0)

    other, other_tcs = _setup(seed=1)  # another model altogether (its own transcoders too)
    with pytest.raises(ValueError, match=r"model's weights.*transcoders'"):
        Graph.load(path).bind(other, other_tcs)
    with pytest.raises(ValueError, match=r"transcoders' \(or CLT's\) weights \(fingerprint"):
        Graph.load(path).bind(model, other_tcs)  # the model's own, but other transcoders
    edited = _model(norm="rmsnorm", positional="rope")
    edited.load_state_dict(model.state_dict())
    with torch.no_grad():
        edited.blocks[1].attn.W_O.data[0, 0, 0] += 0.25  # one weight of the same model, edited
    with pytest.raises(ValueError, match=r"model's weights \(fingerprint [0-9a-f]{16}, the graph's [0-9a-f]{16}\)"):
        Graph.load(path).bind(edited, tcs)

    # the graph in memory refuses too: bind() to the edited weights, and head loadings keep to the old ones
    with pytest.raises(ValueError, match="model's weights"):
        graph.bind(edited, tcs)
    feature, logit = int(graph.nodes_of("feature")[0]), int(graph.nodes_of("logit")[0])
    with torch.no_grad():
        model.blocks[1].attn.W_O.data[0, 0, 0] += 0.25
    with pytest.raises(ValueError, match="weights changed"):
        wb.analysis.head_loadings(graph, feature, logit, 1)
    with pytest.raises(ValueError, match="model's weights"):
        graph.bind(model, tcs)

    # a file saved before graphs recorded a fingerprint binds, with a warning that nothing is checked
    d = json.loads(path.read_text())
    del d["meta"]["fingerprint"]
    with pytest.warns(UnverifiedGraphWarning, match="no fingerprint"):
        Graph.from_dict(d).bind(edited, tcs)


def test_transcoders_or_a_clt_of_another_model_warn_as_add_sae_does():
    model, tcs = _setup()
    other = _model(norm="rmsnorm", positional="rope", seed=1)
    foreign = model_fingerprint(other)
    for tc in tcs:
        tc.cfg = tc.cfg.replace(model_fingerprint=model_fingerprint(model))
    import warnings

    with warnings.catch_warnings():  # their own model's fingerprint: nothing to say
        warnings.simplefilter("error", DictionaryMismatchWarning)
        graph = attribution_graph(model, tcs, _tokens(2), max_n_logits=1, max_feature_nodes=6)
    tcs[1].cfg = tcs[1].cfg.replace(model_fingerprint=foreign)
    with pytest.warns(DictionaryMismatchWarning, match=f"transcoder 1: .*fingerprint {foreign}"):
        attribution_graph(model, tcs, _tokens(2), max_n_logits=1, max_feature_nodes=6)
    with pytest.warns(DictionaryMismatchWarning, match=f"transcoder 1: .*{foreign}"):
        graph.bind(model, tcs)  # cfg is not a weight: the binding holds, and warns as the graph did

    clt_model = _model(n_layers=3, norm="rmsnorm", positional="rope", ffn="swiglu", name="small-a")
    clt = _clt("jumprelu", False)
    clt.cfg = clt.cfg.replace(model_name="small-b")
    with pytest.warns(DictionaryMismatchWarning, match="the CLT: .*'small-b', not on 'small-a'"):
        attribution_graph(clt_model, clt, _tokens(3, 5), max_n_logits=1, max_feature_nodes=6)
    with pytest.warns(DictionaryMismatchWarning, match="'small-b', not on 'small-a'"):
        clt_model.add_sae(clt)  # the CLT path of add_sae: the same check
    clt_model.remove_sae()


def test_a_qk_context_of_another_prompt_or_model_is_refused():
    model, tcs = _setup()
    graph = attribution_graph(model, tcs, _tokens(4), max_n_logits=1, max_feature_nodes=6)
    ctx = QKContext(graph)
    pruned = graph.prune(0.9, 0.99)  # the same prompt and weights: its context is the full graph's
    expected = wb.analysis.qk_attribution(graph, 1, 0, 6, 2, context=ctx)
    torch.testing.assert_close(torch.tensor(wb.analysis.qk_attribution(pruned, 1, 0, 6, 2, context=ctx)
                                            ["contribution"].to_numpy()),
                               torch.tensor(expected["contribution"].to_numpy()))

    elsewhere = attribution_graph(model, tcs, _tokens(5), max_n_logits=1, max_feature_nodes=6)  # another prompt
    with pytest.raises(ValueError, match="another prompt"):
        wb.analysis.qk_attribution(elsewhere, 1, 0, 6, 2, context=ctx)
    with pytest.raises(ValueError, match="another prompt"):
        wb.analysis.attention_entries(elsewhere, context=ctx)
    other, other_tcs = _setup(seed=1)  # the same prompt on another model
    theirs = attribution_graph(other, other_tcs, _tokens(4), max_n_logits=1, max_feature_nodes=6)
    with pytest.raises(ValueError, match="other weights than this graph: the model's weights"):
        wb.analysis.qk_attribution(theirs, 1, 0, 6, 2, context=ctx)
    with pytest.raises(ValueError, match="other weights"):
        wb.analysis.attention_entries(theirs, context=ctx)


def test_non_finite_weights_or_activations_are_refused_before_the_graph():
    model, tcs = _setup()
    with torch.no_grad():
        tcs[1].W_dec.data[3, 5] = float("nan")  # one NaN made every edge NaN, then prune() saw a "cycle"
    with pytest.raises(ValueError, match=r"transcoder 1 weight W_dec \(1 NaN, 0 inf"):
        attribution_graph(model, tcs, _tokens(6), max_n_logits=1, max_feature_nodes=6)
    model, tcs = _setup()
    with torch.no_grad():
        model.blocks[0].mlp.W_in.data[0, 0] = float("inf")  # one bad model weight: every feature fired
    with pytest.raises(ValueError, match=r"model weight blocks\.0\.mlp\.W_in \(0 NaN, 1 inf"):
        attribution_graph(model, tcs, _tokens(6), max_n_logits=1, max_feature_nodes=6)
    model, tcs = _setup()
    tokens = _tokens(6)
    with torch.no_grad():  # finite weights that overflow float32 on this prompt
        model.embed.W_E.data[int(tokens[0, 2])] = 3e38
    with pytest.raises(ValueError, match="the clean run's .* is not finite on this prompt"):
        attribution_graph(model, tcs, tokens, max_n_logits=1, max_feature_nodes=6)


def test_the_edge_store_has_a_ceiling_when_it_spills(tmp_path, monkeypatch):
    """The in-memory store was bounded by its buffer; the spilled one grew without limit. Its ceiling is
    rows x sources; a graph with more edges than that would be a bug, and is refused as one."""
    import workbench.analysis.graphs.attribute as attribute

    model, tcs = _setup()
    graph = attribution_graph(model, tcs, _tokens(7), max_n_logits=2, spill_dir=tmp_path / "a", edge_chunk=64)
    assert graph.n_edges > 64  # spilled over several chunks
    monkeypatch.setattr(attribute, "_capacity", lambda *args: graph.n_edges // 2)
    with pytest.raises(RuntimeError, match=f"ceiling of {graph.n_edges // 2}"):
        attribution_graph(model, tcs, _tokens(7), max_n_logits=2, spill_dir=tmp_path / "b", edge_chunk=64)


def _change(model, tcs, how: str) -> None:
    """One of the ways a user changes weights in place after a QK context was made."""
    with torch.no_grad():
        if how == "model .data":  # bumps no version counter
            model.blocks[0].attn.W_Q.data.mul_(-2.0)
        elif how == "transcoder .data":
            tcs[0].W_dec.data.mul_(3.0)
        elif how == "load_state_dict":
            model.load_state_dict(_model(norm="rmsnorm", positional="rope", seed=7).state_dict())
        elif how == "double":
            model.double()
            for tc in tcs:
                tc.double()


@pytest.mark.parametrize("how", ["model .data", "transcoder .data", "load_state_dict", "double"])
def test_a_qk_context_refuses_weights_changed_since_it_was_made(how):
    """A context passed as context= was checked against the graph's prompt and fingerprint only: after an
    edit it answered with its clean run of the old weights (the old score) where the model now scores
    otherwise. Now every call given it re-checks the weights, as the graph's own runs do."""
    model, tcs = _setup()
    tokens = _tokens(6, 8)
    graph = attribution_graph(model, tcs, tokens, max_n_logits=1, max_feature_nodes=6)
    ctx = QKContext(graph)
    before = wb.analysis.qk_attribution(graph, 1, 0, 7, 3, exact=1, context=ctx)
    _change(model, tcs, how)

    # the independent reference: a graph made afresh from the changed weights, and the model's own score
    fresh = attribution_graph(model, tcs, tokens, max_n_logits=1, max_feature_nodes=6)
    after = wb.analysis.qk_attribution(fresh, 1, 0, 7, 3, exact=1)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens.to(model.device))
    live = float(cache["blocks.1.attn.hook_attn_scores"][0, 0, 7, 3])
    assert after.attrs["score"] == pytest.approx(live, abs=1e-5)
    if how in ("model .data", "load_state_dict"):  # the old context's answer is of other weights
        assert before.attrs["score"] != pytest.approx(live, abs=1e-3)
    for call in (lambda: wb.analysis.qk_attribution(graph, 1, 0, 7, 3, context=ctx),
                 lambda: wb.analysis.attention_entries(graph, context=ctx),
                 lambda: qk_table(graph, context=ctx)):
        with pytest.raises(ValueError, match="weights changed since this QK context was made"):
            call()
    with pytest.raises(ValueError, match="weights changed"):  # without a context: the graph's own check
        wb.analysis.qk_attribution(graph, 1, 0, 7, 3)


def test_a_qk_context_answers_again_once_the_old_weights_are_back():
    model, tcs = _setup()
    graph = attribution_graph(model, tcs, _tokens(6, 8), max_n_logits=1, max_feature_nodes=6)
    ctx = QKContext(graph)
    before = wb.analysis.qk_attribution(graph, 1, 0, 7, 3, exact=1, context=ctx)
    saved = model.blocks[0].attn.W_Q.detach().clone()
    model.blocks[0].attn.W_Q.data.mul_(-2.0)
    with pytest.raises(ValueError, match="weights changed"):
        wb.analysis.qk_attribution(graph, 1, 0, 7, 3, context=ctx)
    model.blocks[0].attn.W_Q.data.copy_(saved)
    again = wb.analysis.qk_attribution(graph, 1, 0, 7, 3, exact=1, context=ctx)
    torch.testing.assert_close(torch.tensor(again["contribution"].to_numpy()),
                               torch.tensor(before["contribution"].to_numpy()), atol=0, rtol=0)


def test_the_weights_check_does_not_depend_on_the_thread_count():
    """The weights' signature summed each parameter in float64 across threads: with another
    torch.set_num_threads its last bits moved, and an untouched graph refused to run ("weights
    changed"). Its partial sums are now one thread's each, added exactly."""
    threads = torch.get_num_threads()
    from factories import tiny

    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=8000, d_model=128, norm="rmsnorm", positional="rope")).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ids the prompt never reads, of magnitudes 2^-60 to 2^0: a float64 sum's rounding shows
        spread = torch.randint(-60, 1, (7960, 128), generator=g).float()
        model.embed.W_E[40:] = torch.randn(7960, 128, generator=g) * torch.exp2(spread)
    tcs = _transcoders(model)
    try:
        torch.set_num_threads(1)
        graph = attribution_graph(model, tcs, _tokens(8), max_n_logits=1, max_feature_nodes=6)
        ctx = QKContext(graph)
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            graph.intervene([])
            wb.analysis.qk_attribution(graph, 1, 0, 6, 2, exact=0, context=ctx)
        with torch.no_grad():
            model.embed.W_E.data[20, 127] += 1e-3  # one value of the largest tensor (1M values), under 4 threads
        with pytest.raises(ValueError, match="weights changed"):
            graph.intervene([])
    finally:
        torch.set_num_threads(threads)
