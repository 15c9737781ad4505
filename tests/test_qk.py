"""QK attribution and head loadings, against independent references, on tiny fp32 models and the planted ones.

- The pairs sum to the score: against the model's own queries and keys (``attn.hook_q``/``hook_k``
  through its QK-norm and RoPE hooks), its scale, an independent ALiBi formula and the tanh
  derivative of a soft-cap (whose residual is reported); the node writes sum to ``hook_resid_pre``.
- ``pattern_change`` equals a re-run done another way: the node's write subtracted from the key
  position's ln1 input (``hook_resid_pre``) with the norm scales held.
- A padded batch gives each prompt the QK table it gets alone; the table survives the graph JSON.
- Head loadings sum to the graph's edge (which came from backward passes) on skip-transcoders with
  LayerNorm and its bias, a cross-layer transcoder and an attention-only model, and equal a hand
  computation of circuit-tracer's definition (the source's write carried through the frozen
  attention layers and split at one of them) where that definition applies.
- On the planted models the K-composition is the induction head's top pair.
"""

import math

import pytest
import torch
from factories import tiny
from test_graphs import _check_edges, _clt, _transcoders

import workbench as wb
from workbench import analysis as an
from workbench.analysis.graphs import Graph, qk_table
from workbench.analysis.graphs.planted_qk import planted_qk_pairs, score_planted_qk
from workbench.analysis.graphs.qk import QKContext
from workbench.components.positional import alibi_slopes
from workbench.padding import TokenBatch

TOL = 1e-5

CONFIGS = {  # (model overrides, replacement)
    "pre-rmsnorm-rope-gqa": (dict(norm="rmsnorm", positional="rope", ffn="swiglu", n_kv_heads=2), "skip_transcoder"),
    "layernorm-bias-learned-clt": (dict(qkv_bias=True), "clt"),
    "alibi": (dict(positional="alibi", ffn="relu"), "transcoder"),
    "qknorm-softcap": (dict(norm="rmsnorm", positional="rope", qk_norm="head", attn_logit_softcap=5.0), "transcoder"),
    "attn-only": (dict(attn_only=True, positional="rope"), None),
    "parallel-gemma-norm-scalar": (dict(parallel_residual=True, norm="gemma_rmsnorm", positional="rope", bias=False,
                                        query_pre_attn_scalar=12), "skip_transcoder"),
}


def _setup(name, n_tokens=7, seed=1):
    overrides, kind = CONFIGS[name]
    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, n_layers=3, **overrides)).eval()
    tcs = None if kind is None else _clt("topk", True) if kind == "clt" else _transcoders(model, kind)
    tokens = torch.randint(0, 40, (1, n_tokens), generator=torch.Generator().manual_seed(seed))
    return model, tcs, tokens


def _reference_score(model, cache, layer, head, q, k):
    """(bilinear, score) from the model's own queries and keys, scale, ALiBi slopes and soft-cap."""
    attn, pre = model.blocks[layer].attn, f"blocks.{layer}.attn"
    which = "hook_rot_{}" if attn.position.rotates else "hook_{}_normed" if model.cfg.qk_norm != "none" else "hook_{}"
    query = cache[f"{pre}.{which.format('q')}"][0, q, head]
    key = cache[f"{pre}.{which.format('k')}"][0, k, head // attn.group]
    raw = float(query.double() @ key.double()) / math.sqrt(model.cfg.query_pre_attn_scalar or model.cfg.d_head)
    score, bilinear = raw, raw
    if attn.softcap is not None:
        score = attn.softcap * math.tanh(raw / attn.softcap)
        bilinear = raw * (1 - math.tanh(raw / attn.softcap) ** 2)
    if model.cfg.positional == "alibi":
        shift = float(alibi_slopes(model.cfg.n_heads)[head]) * (k - q)
        score, bilinear = score + shift, bilinear + shift
    return bilinear, score


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pairs_sum_to_the_score(name):  # the parallel layout's MLP reads the block's input, not resid_mid
    model, tcs, tokens = _setup(name)
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=8)  # QK reads every active feature anyway
    ctx = QKContext(graph)
    _, cache = model.run_with_cache(tokens)
    for layer in range(3):
        for pos in (0, 3, 6):  # the node writes are the residual stream
            parts = ctx.parts(layer, pos).stack().sum(0).float()
            torch.testing.assert_close(parts, cache[f"blocks.{layer}.hook_resid_pre"][0, pos], atol=TOL, rtol=0)
    for pos in (0, 3, 6):  # the token node (at layer 0: no skip path through it yet) is the token's
        # embedding plus the position's (learned or sinusoidal) where the model adds one
        embed = cache["hook_embed"][0, pos] + (cache["hook_pos_embed"][0, pos] if "hook_pos_embed" in cache else 0)
        torch.testing.assert_close(ctx.parts(0, pos).rows[1].float(), embed, atol=TOL, rtol=0)
    assert ("hook_pos_embed" in cache) == (model.cfg.positional in ("learned", "sinusoidal"))
    softcap = model.blocks[0].attn.softcap is not None
    for layer, head, q, k in [(0, 0, 6, 2), (1, 3, 6, 6), (2, 1, 5, 0), (2, 2, 4, 3)]:
        frame = an.qk_attribution(graph, layer, head, q, k, top=None, exact=0, context=ctx)
        bilinear, score = _reference_score(model, cache, layer, head, q, k)
        a = frame.attrs
        assert frame.contribution.sum() == pytest.approx(a["bilinear"], abs=TOL)
        assert a["bilinear"] == pytest.approx(bilinear, abs=TOL, rel=TOL)
        assert a["score"] == pytest.approx(score, abs=TOL, rel=TOL)
        assert a["residual"] == pytest.approx(score - bilinear, abs=TOL)
        if not softcap:
            assert abs(a["residual"]) < TOL
        assert set(frame.query_kind) | set(frame.key_kind) <= {"token", "feature", "error", "head", "bias"}
        assert (frame.contribution.abs().diff().dropna() <= 1e-12).all()  # sorted by |contribution|
    if softcap:  # scores of size ~ the cap: the linearisation misses something, and it is reported
        assert abs(an.qk_attribution(graph, 2, 2, 4, 3, context=ctx).attrs["residual"]) > 1e-3


def _write(graph, cache, model, kind, layer, index, pos):
    """A node's write into the residual stream at ``pos``, from the cache and the graph's capture."""
    _, rs, cap = graph._bound()
    if kind == "token":
        return cap.embed[pos]
    if kind == "head":
        return cache[f"blocks.{layer}.attn.hook_z"][0, pos, index] @ model.blocks[layer].attn.W_O[index]
    if kind == "error":
        return cap.errors[layer][pos]
    return cap.acts[layer][pos, index] * rs.decoder(layer, layer)[index]


def test_the_node_columns_name_each_node_without_its_position_and_find_its_write():
    model, tcs, tokens = _setup("alibi")
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=8)
    ctx = QKContext(graph)
    _, cache = model.run_with_cache(tokens)
    frame = an.qk_attribution(graph, 2, 1, 6, 3, top=None, exact=0, context=ctx)
    assert set(frame.key_kind) == {"token", "feature", "error", "head", "bias"}
    for side, pos in (("query", 6), ("key", 3)):
        parts = ctx.parts(2, pos)
        assert (frame[f"{side}_node_pos"] == pos).all()
        for node, unit, kind, layer, index in frame[[f"{side}_{c}" for c in ("node", "unit", "kind", "layer",
                                                                               "index")]].itertuples(index=False):
            assert node == (unit if kind == "bias" else f"{unit} @{pos}")
            assert unit == {"token": f"tok {graph.str_tokens[pos]!r}", "head": f"L{layer} H{index}",
                            "feature": f"F{layer}:{index}", "error": f"err L{layer}", "bias": "bias"}[kind]
            assert (index >= 0) == (kind in ("head", "feature"))
            if kind != "bias":
                torch.testing.assert_close(parts.rows[parts.labels.index(node)].float(),
                                           _write(graph, cache, model, kind, layer, index, pos), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["alibi", "qknorm-softcap"])
def test_pattern_change_equals_an_edit_of_the_ln1_input(name):
    model, tcs, tokens = _setup(name)
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=8)
    _, cache = model.run_with_cache(tokens)
    layer, head, q, k = 2, 1, 6, 3
    frame = an.qk_attribution(graph, layer, head, q, k, top=12, exact=12)
    assert frame.pattern_change.notna().all() and frame.pattern_change.abs().max() > 1e-4
    held = [n for n in cache if n.startswith(f"blocks.{layer}.") and n.endswith("hook_scale")]
    clean = float(cache[f"blocks.{layer}.attn.hook_pattern"][0, head, q, k])
    checked = 0
    for row in frame.itertuples():
        if row.key_kind == "bias":  # b_K is not in the residual stream
            continue
        vector = _write(graph, cache, model, row.key_kind, row.key_layer, row.key_index, k).detach()
        got = {}

        def edit(resid, hook):
            resid = resid.clone()
            resid[0, k] -= vector
            return resid

        hooks = [(f"blocks.{layer}.hook_resid_pre", edit)] + [(n, lambda a, hook: cache[hook.name]) for n in held]

        def read(pattern, hook):
            got["p"] = float(pattern[0, head, q, k])

        hooks.append((f"blocks.{layer}.attn.hook_pattern", read))
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=hooks)
        assert row.pattern_change == pytest.approx(got["p"] - clean, abs=TOL), row.key_node
        checked += 1
    assert checked >= 8


def test_padded_batch_gives_each_prompt_its_qk_table(tmp_path):
    model, tcs, _ = _setup("pre-rmsnorm-rope-gqa")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 40, (n,), generator=g) for n in (7, 5)]
    alone = [an.attribution_graph(model, tcs, row, qk=True, qk_entries=1, max_feature_nodes=8) for row in rows]
    batch = TokenBatch.from_ids([r.tolist() for r in rows], 0, "left", torch.device("cpu"))
    for graph, single in zip(an.attribution_graph(model, tcs, batch, qk=True, qk_entries=1, max_feature_nodes=8), alone):
        assert len(graph.qk) == len(single.qk) > 0
        assert (graph.qk[["layer", "head", "query_pos", "key_pos", "query_node", "key_node"]]
                .equals(single.qk[["layer", "head", "query_pos", "key_pos", "query_node", "key_node"]]))
        assert (graph.qk.contribution - single.qk.contribution).abs().max() < TOL
    loaded = Graph.load(alone[0].save(tmp_path / "g.json"))  # the table is in the graph's JSON
    assert loaded.qk.drop(columns="pattern_change").equals(alone[0].qk.drop(columns="pattern_change"))
    assert alone[0].prune().qk is alone[0].qk


@pytest.mark.parametrize("name", ["layernorm-bias-learned-clt", "pre-rmsnorm-rope-gqa", "attn-only"])
def test_head_loadings_sum_to_the_edge(name):
    model, tcs, tokens = _setup(name, n_tokens=6)
    if name == "pre-rmsnorm-rope-gqa":  # skip-transcoders on LayerNorm with its bias
        model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, n_layers=3)).eval()
        tcs = _transcoders(model, "skip_transcoder")
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=10)
    nodes, edges = graph.to_frame()
    checked = 0
    for row in edges.reindex(edges.weight.abs().sort_values(ascending=False).index).head(3).itertuples():
        s_layer = -1 if nodes.kind[row.source] == "token" else int(nodes.layer[row.source])
        t_layer = 2 if nodes.kind[row.target] == "logit" else int(nodes.layer[row.target])
        for layer in range(s_layer + 1, t_layer + 1):
            frame = an.head_loadings(graph, int(row.source), int(row.target), layer)
            assert list(frame.part) == [f"L{layer} H{h}" for h in range(4)] + ["bypass"]
            assert frame.loading.sum() == pytest.approx(row.weight, abs=TOL, rel=TOL)
            assert frame.attrs["edge"] == pytest.approx(row.weight)
            checked += 1
    assert checked >= 3
    if name == "attn-only":
        assert _check_edges(model, graph) == 1  # token -> logit edges equal a zeroing in the frozen model


def test_head_loadings_equal_circuit_tracers_definition():
    """circuit-tracer's split, computed by hand: the source's write carried through the frozen
    attention layers (RMSNorm scale held, values through the frozen pattern), split at one layer
    into each head's write and the rest, each part carried on to the target's MLP input."""
    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, n_layers=3, norm="rmsnorm", positional="rope")).eval()
    tcs = _transcoders(model, "transcoder")
    tokens = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(2))
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=40)
    _, cache = model.run_with_cache(tokens)

    def attention(layer, delta, per_head=False):
        attn = model.blocks[layer].attn
        x = delta * model.blocks[layer].ln1.w / cache[f"blocks.{layer}.ln1.hook_scale"][0]
        values = torch.einsum("pd,hde->hpe", x, attn.W_V)
        moved = torch.einsum("hqp,hpe->hqe", cache[f"blocks.{layer}.attn.hook_pattern"][0], values)
        written = torch.einsum("hqe,hed->hqd", moved, attn.W_O)
        return written if per_head else written.sum(0)

    nodes, edges = graph.to_frame()
    pick = edges[(nodes.kind[edges.source].to_numpy() == "feature") & (nodes.kind[edges.target].to_numpy() == "feature")
                 & (nodes.layer[edges.target].to_numpy() == 2) & (nodes.layer[edges.source].to_numpy() == 0)]
    row = pick.loc[pick.weight.abs().idxmax()]
    s, t = int(row.source), int(row.target)
    delta = torch.zeros(6, 32)
    delta[int(nodes.pos[s])] = float(nodes.activation[s]) * tcs[0].W_dec[int(nodes.feature[s])]
    reader = tcs[2].W_enc[:, int(nodes.feature[t])]

    def read(part):
        mid = part + attention(2, part)
        return float((mid / cache["blocks.2.ln2.hook_scale"][0])[int(nodes.pos[t])] @ reader)

    with torch.no_grad():
        for layer in (1, 2):
            arriving = delta + attention(1, delta) if layer == 2 else delta
            heads = attention(layer, arriving, per_head=True)
            if layer == 2:
                by_hand = [float((heads[h] / cache["blocks.2.ln2.hook_scale"][0])[int(nodes.pos[t])] @ reader)
                           for h in range(4)]
                by_hand.append(float((arriving / cache["blocks.2.ln2.hook_scale"][0])[int(nodes.pos[t])] @ reader))
            else:
                by_hand = [read(heads[h]) for h in range(4)] + [read(arriving)]
            frame = an.head_loadings(graph, s, t, layer)
            assert frame.loading.tolist() == pytest.approx(by_hand, abs=TOL, rel=TOL)
            assert sum(by_hand) == pytest.approx(row.weight, abs=TOL, rel=TOL)


def _induction_prompts(p, n, seed):
    clean, _ = p.prompts(n, seed=seed)
    half, start = p.prompt_spec["half"], 1 if p.prompt_spec.get("bos") is not None else 0
    return clean, [(q, q - half + 1) for q in range(start + half, start + 2 * half - 1)]


@pytest.mark.parametrize("name, head, prev", [("hand-induction", (1, 0), "L0 H0"), ("iit-induction", (1, 1), "L0 H2")])
def test_k_composition_is_the_induction_heads_top_pair(name, head, prev):
    from workbench.planted import load_planted

    p = load_planted(name)
    clean, entries = _induction_prompts(p, 2, seed=7)
    for graph in an.attribution_graph(p.model, None, clean, max_n_logits=1):
        ctx = QKContext(graph)
        for i, (q, k) in enumerate(entries):
            frame = an.qk_attribution(graph, *head, q, k, top=3, exact=int(i < 2), context=ctx)
            top = frame.iloc[0]
            assert (top.query_kind, top.query_node.split(" @")[1]) == ("token", str(q))
            assert top.key_node == f"{prev} @{k}"
            assert top.contribution > 0.5 * frame.attrs["bilinear"]
            if i < 2:  # without the previous-token head's write the head stops attending there
                assert top.pattern_change < -0.5
    if name == "hand-induction":  # written by hand: the match is exactly SOFT = 12, and nothing else scores
        assert top.contribution == pytest.approx(12.0, abs=1e-4) and abs(frame.contribution.iloc[1]) < 1e-4


def test_planted_pairs_and_score():
    from workbench.planted import load_planted
    from workbench.planted.hand import TRUTH

    assert planted_qk_pairs(TRUTH) == {"L1H0": ({("embed", "L0H0")}, set())}
    p = load_planted("iit-induction")
    assert planted_qk_pairs(p.truth, p.unscored) == {"L1H1": ({("embed", "L0H2")}, {("embed", "embed")})}
    summary, entries = score_planted_qk(p, n_prompts=1, seed=0)
    assert summary["qk_precision"] >= 0.9 and summary["qk_recall"] >= 0.9 and len(entries) == 9


def test_bad_input_is_refused():
    model, tcs, tokens = _setup("alibi")
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=4)
    for args, match in [((3, 0, 4, 2), "layer"), ((0, 4, 4, 2), "head"), ((0, 0, 7, 2), "query_pos"),
                        ((0, 0, 4, -1), "key_pos"), ((0, 0, 2, 4), "causal")]:
        with pytest.raises(ValueError, match=match):
            an.qk_attribution(graph, *args)
    with pytest.raises(ValueError, match="top"):
        an.qk_attribution(graph, 0, 0, 4, 2, top=0)
    with pytest.raises(ValueError, match="entries"):  # was pandas' head(-1): every entry of a head but its last
        qk_table(graph, entries=-1)
    with pytest.raises(ValueError, match="not bound"):
        an.qk_attribution(Graph.from_dict(graph.to_dict()), 0, 0, 4, 2)
    feature = int(graph.nodes_of("feature")[0])
    logit = int(graph.nodes_of("logit")[0])
    with pytest.raises(ValueError, match="layer must be"):
        an.head_loadings(graph, feature, logit, int(graph.layer[feature]))
    with pytest.raises(ValueError, match="target must be"):
        an.head_loadings(graph, feature, int(graph.nodes_of("token")[0]), 2)
    with pytest.raises(ValueError, match="not a node id"):
        an.head_loadings(graph, "F9.9.9", logit, 2)


def test_a_dataframe_rows_numpy_integers_open_the_entry_they_name():
    """attention_entries' rows are numpy int64: they were refused ("layer must be an integer ..., got
    np.int64(1)"), as were numpy node indices and layers in head_loadings; now they equal the int call."""
    import numpy as np

    model, tcs, tokens = _setup("alibi")
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=4)
    ctx = QKContext(graph)
    entries = an.attention_entries(graph, ctx)
    e = {c: entries[c].iloc[0] for c in ("layer", "head", "query_pos", "key_pos")}  # a column's value: numpy
    assert isinstance(e["layer"], np.integer)
    got = an.qk_attribution(graph, e["layer"], e["head"], e["query_pos"], e["key_pos"], top=np.int64(4),
                            exact=np.int64(2), context=ctx)
    want = an.qk_attribution(graph, int(e["layer"]), int(e["head"]), int(e["query_pos"]), int(e["key_pos"]), top=4,
                             exact=2, context=ctx)
    assert got.equals(want) and got.attrs == want.attrs and type(got.attrs["layer"]) is int
    token, logit = graph.nodes_of("token")[2].item(), graph.nodes_of("logit")[0].item()
    a = an.head_loadings(graph, np.int64(token), np.int64(logit), np.int64(1))
    assert a.equals(an.head_loadings(graph, token, logit, 1))


def test_mqa_with_sliding_local_layers_on_a_left_padded_batch_and_mla_refused():
    """One key head for all (MQA), Gemma 3's local layers (window 3, their own RoPE base) beside a global
    one, on a left-padded batch: each prompt's pairs sum to the score its own unpadded run gives, at
    positions counted in its real tokens; a key outside the window is refused by name, and so is MLA."""
    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, n_layers=3, attn_only=True, norm="gemma_rmsnorm",
                                  positional="rope", n_kv_heads=1, sliding_window=3, global_every=2,
                                  rope_local_base=10.0)).eval()
    assert [model.cfg.layer_is_local(layer) for layer in range(3)] == [True, False, True]
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 40, (n,), generator=g) for n in (9, 5)]
    batch = TokenBatch.from_ids([r.tolist() for r in rows], 0, "left", torch.device("cpu"))
    for graph, row in zip(an.attribution_graph(model, None, batch), rows):
        n = len(row)
        assert graph.meta["replacement"] == "none (attention only)"  # it said "transcoders"
        _, cache = model.run_with_cache(row[None])
        for layer, head, q, k in [(0, 3, n - 1, n - 3), (1, 2, n - 1, 0), (2, 1, n - 2, n - 3)]:
            frame = an.qk_attribution(graph, layer, head, q, k, top=None, exact=0)
            bilinear, score = _reference_score(model, cache, layer, head, q, k)
            assert frame.attrs["score"] == pytest.approx(score, abs=TOL) and frame.contribution.sum() == pytest.approx(
                bilinear, abs=TOL)
        with pytest.raises(ValueError, match="sliding window"):
            an.qk_attribution(graph, 2, 0, n - 1, n - 4)  # 3 back: outside the local layer's window of 3
        assert math.isfinite(an.qk_attribution(graph, 1, 0, n - 1, n - 4).attrs["score"])  # the global layer sees it
    mla = wb.HookedDecoder(tiny(attention="mla", positional="rope", attn_only=True, d_vocab=40)).eval()
    with pytest.raises(ValueError, match="MLA"):
        an.qk_attribution(an.attribution_graph(mla, None, torch.randint(0, 40, (1, 6))), 1, 0, 5, 2)


def test_attention_entry_weights_sum_to_a_head_ablation_in_the_frozen_model():
    """Over keys, an entry's weight sums to the change of the graph's weighted targets when that head's
    output at the query is zeroed in the frozen replacement model (linear there, so exactly)."""
    from workbench.analysis.graphs.replacement import final_read, frozen_forward

    model, tcs, tokens = _setup("pre-rmsnorm-rope-gqa", n_tokens=6)
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=4)
    entries = an.attention_entries(graph)
    _, rs, cap = graph._bound()
    weights = graph.logit_weight[graph.nodes_of("logit")]

    def objective(hooks):
        run = frozen_forward(model, rs, cap)
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            run()
        return float(((graph.logit_vectors @ (run.final[0, -1] * final_read(model)[1])) * weights).sum())

    clean = objective([])
    for layer, head, q in [(2, 1, 5), (1, 3, 5), (0, 0, 2)]:
        def zero(result, hook):
            result = result.clone()
            result[0, q, head] = 0
            return result

        change = clean - objective([(f"blocks.{layer}.attn.hook_result", zero)])
        mine = entries[(entries.layer == layer) & (entries["head"] == head) & (entries.query_pos == q)].weight.sum()
        assert mine == pytest.approx(change, abs=TOL, rel=TOL)
    assert entries.weight.abs().is_monotonic_decreasing
