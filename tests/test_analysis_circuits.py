"""Circuits: the edge graph, exact edge patching against a hand-written run_with_hooks patch, the
node-by-node runner against the model's own runs, EAP against exact patching, ACDC and the metrics
on the hand-built model whose circuit is known exactly, circuit files, path patching, bad input."""

import os

import numpy as np
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import (
    Circuit,
    ComputationGraph,
    discover_circuit,
    edge_attribution,
    edge_auroc,
    edge_patching,
    evaluate_circuit,
    faithfulness,
    node_attribution,
    path_patching,
)
from workbench.analysis.circuits import EdgeRunner, prune
from workbench.planted.hand import BOS, HALF, TRUTH, build_hand_induction

# The three layouts with edges, with the other components varied across them.
LAYOUTS = {
    "pre": dict(),
    "parallel": dict(parallel_residual=True, norm="rmsnorm", positional="rope", ffn="swiglu"),
    "attn_only_pre": dict(attn_only=True, positional="alibi", norm="layernorm"),
}


# Attention options the node-by-node runner must reproduce (each was silently off before: up to 0.08 logits).
ATTENTION_OPTIONS = {
    "gqa": dict(n_kv_heads=2, positional="rope"),
    "qk-norm-per-head": dict(qk_norm="head", positional="rope", norm="rmsnorm"),
    "qk-norm-projection-gqa": dict(qk_norm="projection", n_kv_heads=2, positional="rope", norm="rmsnorm"),
    "window-softcap-scalar": dict(sliding_window=3, attn_logit_softcap=0.5, query_pre_attn_scalar=2,
                                  positional="rope", norm="gemma_rmsnorm"),
}


def _model(**overrides):
    return wb.HookedDecoder(tiny(**overrides)).eval()


def _pair(batch=2, n_pos=6, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n_pos), generator=gen), torch.randint(0, vocab, (batch, n_pos), generator=gen)


def _weighted_logits(d_vocab=50, seed=1):
    """A metric that moves with every logit, so a wrong patch anywhere shows."""
    weights = torch.randn(d_vocab, generator=torch.Generator().manual_seed(seed))

    def metric(logits):
        return (logits.float() @ weights).mean()

    return metric


# ---- a hand-written reference: one run_with_hooks per edge, with the model's own attention ------------
def _sender_output(model, cache, node):
    if node[0] == "embed":
        return cache["hook_embed"] + (cache["hook_pos_embed"] if "hook_pos_embed" in cache.cache_dict else 0)
    if node[0] == "head":
        return cache[f"blocks.{node[1]}.attn.hook_z"][:, :, node[2]] @ model.blocks[node[1]].attn.W_O[node[2]]
    return cache[f"blocks.{node[1]}.hook_mlp_out"]


def _hooked_edge_patch(model, clean, caches, sender, receiver):
    """Logits of the clean run with ``receiver`` reading ``sender``'s corrupted output, by hooks
    (``caches``: the clean and the corrupted run's)."""
    clean_cache, corrupted_cache = caches
    delta = _sender_output(model, corrupted_cache, sender) - _sender_output(model, clean_cache, sender)
    seen = {}

    def keep(act, hook):
        seen[hook.name] = act

    if receiver[0] == "head":
        _, layer, head, kind = receiver
        block = model.blocks[layer]

        def replace(act, hook):
            x = block.ln1(seen[f"blocks.{layer}.hook_resid_pre"] + delta)
            weight, bias = {"q": (block.attn.W_Q, block.attn.b_Q), "k": (block.attn.W_K, block.attn.b_K),
                            "v": (block.attn.W_V, block.attn.b_V)}[kind]
            act = act.clone()
            act[:, :, head] = x @ weight[head] + bias[head]
            return act

        hooks = [(f"blocks.{layer}.hook_resid_pre", keep), (f"blocks.{layer}.attn.hook_{kind}", replace)]
    elif receiver[0] == "mlp":
        layer = receiver[1]
        block = model.blocks[layer]
        source = f"blocks.{layer}.hook_resid_pre" if block.layout == "parallel" else f"blocks.{layer}.hook_resid_mid"
        hooks = [(source, keep),
                 (f"blocks.{layer}.hook_mlp_out", lambda act, hook: block.mlp(block.ln2(seen[source] + delta)))]
    else:
        hooks = [(f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", lambda act, hook: act + delta)]
    with torch.no_grad():
        return model.run_with_hooks(clean, fwd_hooks=hooks)


# ---- the graph ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_graph_has_an_edge_from_every_earlier_writer_to_every_reader(name):
    model = _model(n_layers=3, **LAYOUTS[name])
    g = ComputationGraph(model)
    L, H = 3, 4
    mlp = not model.cfg.attn_only
    assert len(g.senders) == 1 + L * H + (L if mlp else 0)
    assert len(g.receivers) == L * 3 * H + (L if mlp else 0) + 1
    table = g.edges
    assert len(table) == g.n_edges and table.edge.is_unique
    # A head's q, k and v are separate receivers of every earlier sender; never of its own layer.
    into = table[table.receiver == "L2H1.k"]
    assert set(into.sender) == {"embed", *(f"L{l}H{h}" for l in (0, 1) for h in range(H)),
                                *((f"L{l} mlp" for l in (0, 1)) if mlp else ())}
    assert set(table[table.sender == "embed"].receiver) == set(g.receiver_labels)
    if mlp:  # the sequential MLP reads its own layer's heads; the parallel one does not
        same_layer = table[(table.receiver == "L1 mlp") & (table.sender_layer == 1)]
        assert len(same_layer) == (0 if name == "parallel" else H)
    assert g.edge_index("L0H3 -> L1H0.q") == g.edge_index((("head", 0, 3), ("head", 1, 0, "q")))


@pytest.mark.parametrize("placement", [dict(norm_placement="post"), dict(norm_placement="post", attn_only=True)])
def test_post_norm_layouts_are_refused_by_name(placement):
    with pytest.raises(ValueError, match="post.*normalises after each write"):
        ComputationGraph(_model(**placement))


def test_mla_is_refused_by_name():
    with pytest.raises(ValueError, match="MLA"):
        ComputationGraph(_model(attention="mla", positional="rope", norm="rmsnorm"))


def test_bad_edges_and_nodes_are_named():
    g = ComputationGraph(_model())
    with pytest.raises(ValueError, match="edge L1H0 -> L0H3.k does not exist"):
        g.edge_index("L1H0 -> L0H3.k")
    with pytest.raises(ValueError, match="head 7 does not exist \\(n_heads=4\\)"):
        g.edge_index((("head", 0, 7), "logits"))
    with pytest.raises(ValueError, match="name its input: q, k or v"):
        g.edge_index(("embed", ("head", 1, 0)))
    with pytest.raises(ValueError, match="'L0H1 to logits' is not an edge"):
        g.edge_index("L0H1 to logits")
    with pytest.raises(ValueError, match="attention-only; it has no MLPs"):
        ComputationGraph(_model(attn_only=True)).edge_index(("embed", ("mlp", 0)))


# ---- exact edge patching -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*LAYOUTS, "qk-norm-per-head", "window-softcap-scalar"])
def test_exact_edge_patch_equals_a_hand_written_hooked_patch(name):
    model = _model(**(LAYOUTS[name] if name in LAYOUTS else ATTENTION_OPTIONS[name]))
    clean, corrupted = _pair()
    metric = _weighted_logits()
    g = ComputationGraph(model)
    mlp = not model.cfg.attn_only
    edges = ["embed -> L0H1.q", "embed -> L1H2.k", "L0H3 -> L1H0.v", "L0H0 -> L1H1.k", "L1H2 -> logits",
             "embed -> logits"] + (["L0H2 -> L0 mlp", "L0 mlp -> L1H3.q", "L1 mlp -> logits"] if mlp else [])
    if name == "parallel":
        edges.remove("L0H2 -> L0 mlp")
        edges.append("embed -> L1 mlp")
    ours = edge_patching(model, (clean, corrupted), metric, edges=edges)
    with torch.no_grad():
        caches = (model.run_with_cache(clean)[1], model.run_with_cache(corrupted)[1])
    for edge, value in zip(edges, ours.metric):
        sender, receiver = (g.senders[g.edge_sender[g.edge_index(edge)]], g.receivers[g.edge_receiver[g.edge_index(edge)]])
        reference = float(metric(_hooked_edge_patch(model, clean, caches, sender, receiver)))
        assert value == pytest.approx(reference, abs=1e-5), edge
    assert (ours.score.abs() > 1e-7).all()  # every one of these patches changes something


@pytest.mark.parametrize("name", [*LAYOUTS, *ATTENTION_OPTIONS])
def test_runner_keeping_every_edge_is_clean_and_none_is_corrupted(name):
    model = _model(**(LAYOUTS[name] if name in LAYOUTS else ATTENTION_OPTIONS[name]))
    runner = EdgeRunner(model, _pair())
    g = runner.graph
    with torch.no_grad():
        torch.testing.assert_close(runner.run(g.full_mask(), from_stage=0), runner.clean_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(runner.run(torch.zeros_like(g.full_mask())), runner.corrupted_logits, atol=1e-5, rtol=0)
    # One edge at a time, the node-by-node runner and the resumed patch agree.
    metric = _weighted_logits()
    some = list(range(0, g.n_edges, 15))
    exact = edge_patching(model, (runner.clean, runner.corrupted), metric, edges=some, graph=g)
    for e, value in zip(some, exact.metric):
        keep = g.full_mask()
        keep[g.edge_sender[e], g.edge_receiver[e]] = 0.0
        assert runner.metric_of(metric, keep) == pytest.approx(value, abs=1e-5)


# ---- the runner's fast path (one buffer of changes) against the stacked reference and hooked node patches ----
def _hooked_node_patch(model, clean, corrupted_cache, nodes):
    """Logits of the clean run with each of ``nodes`` writing its corrupted output (to every reader), by hooks."""
    hooks = []
    for node in nodes:
        if node[0] == "embed":
            names = ["hook_embed"] + (["hook_pos_embed"] if "hook_pos_embed" in corrupted_cache.cache_dict else [])
            hooks += [(name, lambda act, hook: corrupted_cache[hook.name]) for name in names]
        elif node[0] == "head":
            def patch(act, hook, head=node[2]):
                act = act.clone()
                act[:, :, head] = corrupted_cache[hook.name][:, :, head]
                return act

            hooks.append((f"blocks.{node[1]}.attn.hook_z", patch))
        else:
            hooks.append((f"blocks.{node[1]}.hook_mlp_out", lambda act, hook: corrupted_cache[hook.name]))
    with torch.no_grad():
        return model.run_with_hooks(clean, fwd_hooks=hooks)


def _random_masks(g, seed=0):
    """Masks of every density the fast path treats apart: nearly none kept (the corrupted stream less the kept
    edges), nearly all kept (the dropped rows gathered), half (every row multiplied in place), and weights
    between 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    full = g.full_mask()
    masks = [(torch.rand(full.shape, generator=gen) < p).float() * full for p in (0.02, 0.3, 0.5, 0.97)]
    masks.append(torch.rand(full.shape, generator=gen) * full)
    return masks


@pytest.mark.parametrize("name", [*LAYOUTS, *ATTENTION_OPTIONS, "no-biases-batch-5"])
def test_fast_runner_equals_the_stacked_runner_and_hooked_node_patches(name):
    overrides = {**LAYOUTS, **ATTENTION_OPTIONS, "no-biases-batch-5": dict(bias=False)}[name]
    model = _model(n_layers=3, **overrides)
    clean, corrupted = _pair(batch=5 if name.endswith("batch-5") else 2)
    runner = EdgeRunner(model, (clean, corrupted))
    g = runner.graph
    with torch.no_grad():
        masks = _random_masks(g)
        for keep in masks:
            torch.testing.assert_close(runner.run(keep), runner.run_stacked(keep), atol=2e-5, rtol=0)
        fast, stacked = [], []  # an explicit start, and the inputs each stage's receivers read
        torch.testing.assert_close(runner.run(masks[2], 4, collect=fast),
                                   runner.run_stacked(masks[2], 4, collect=stacked), atol=2e-5, rtol=0)
        assert len(fast) == len(stacked) == len([t for t in runner.stages if t >= 4])
        for a, b in zip(fast, stacked):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
        embed = runner.clean_out[0] + 0.3 * runner.delta[0]  # an EAP-IG point
        torch.testing.assert_close(runner.run(masks[1], embed=embed), runner.run_stacked(masks[1], embed=embed),
                                   atol=2e-5, rtol=0)
        # Every edge out of a set of nodes corrupted is those nodes writing their corrupted outputs: few of
        # them (the dropped rows gathered) and all but two (the corrupted stream less the kept rows).
        corrupted_cache = model.run_with_cache(corrupted)[1]
        few = [("head", 0, 1), ("mlp", 1) if g.has_mlp else ("head", 1, 3), ("head", 2, 0)]
        for nodes in (few, [n for n in g.senders if n not in (("head", 1, 2), ("head", 0, 3))]):
            keep = g.full_mask()
            keep[[g.sender_index(n) for n in nodes]] = 0.0
            torch.testing.assert_close(runner.run(keep), _hooked_node_patch(model, clean, corrupted_cache, nodes),
                                       atol=2e-5, rtol=0)


def test_a_mean_ablated_runner_reads_its_own_changes_on_the_fast_path():
    # ioi.mean_ablation_runner swaps corrupted_out and delta on a shallow copy: nothing derived from them
    # may be kept from the original.
    from workbench.analysis.circuits.ioi import mean_ablation_runner

    model = _model(n_layers=3)
    runner = EdgeRunner(model, _pair(batch=4))
    ablated = mean_ablation_runner(runner, [0, 1, 0, 1])
    with torch.no_grad():
        runner.run(_random_masks(runner.graph)[0])  # the original's lazily built state, if any, comes first
        for keep in _random_masks(runner.graph, seed=1):
            torch.testing.assert_close(ablated.run(keep), ablated.run_stacked(keep), atol=2e-5, rtol=0)


def test_stacked_patches_equal_one_at_a_time():
    model = _model()
    clean, corrupted = _pair()
    metric = _weighted_logits()
    some = list(range(0, 110, 10))
    one = edge_patching(model, (clean, corrupted), metric, edges=some, stack=1)
    stacked = edge_patching(model, (clean, corrupted), metric, edges=some, stack=7)
    np.testing.assert_allclose(stacked.metric, one.metric, atol=1e-5)


# ---- attribution ---------------------------------------------------------------------------------------
def test_eap_tracks_exact_patching_on_a_nearly_linear_model():
    # No norms and small weights: attention is nearly uniform and every path nearly linear.
    model = _model(norm="none", attn_only=True, init_std=0.05, n_heads=2)
    clean, corrupted = _pair()
    metric = _weighted_logits()
    exact = edge_attribution(model, (clean, corrupted), metric, "exact")
    for method in ("eap", "eap-ig"):
        estimate = edge_attribution(model, (clean, corrupted), metric, method, steps=4)
        assert np.corrcoef(estimate.score, exact.score)[0, 1] > 0.99, method
    assert exact.attrs["method"] == "exact" and len(exact) == ComputationGraph(model).n_edges


def test_node_attribution_equals_corrupting_every_edge_out_of_the_head():
    model = _model()
    clean, corrupted = _pair()
    metric = _weighted_logits()
    nodes = node_attribution(model, (clean, corrupted), metric, "activation")
    runner = EdgeRunner(model, (clean, corrupted))
    g = runner.graph
    clean_value = runner.endpoints(metric)[0]
    for row in nodes.itertuples():
        keep = g.full_mask()
        keep[g.sender_index(("head", row.layer, row.head))] = 0.0
        assert row.score == pytest.approx(runner.metric_of(metric, keep) - clean_value, abs=1e-5)
    estimate = node_attribution(model, (clean, corrupted), metric, "attribution")
    assert np.corrcoef(estimate.score, nodes.score)[0, 1] > 0.8


@pytest.mark.parametrize("name", [*LAYOUTS, *ATTENTION_OPTIONS])
def test_eap_scores_equal_the_kept_gradients_reference(name):
    # receiver_scores reduces each stage's gradient as it goes (a few heads at a time past 4 d_model / pos
    # tokens: 40 positions here, one head per group); receiver_grads keeps them all, as EAP once did.
    model = _model(d_model=16, n_ctx=48, **{**LAYOUTS, **ATTENTION_OPTIONS}[name])
    clean, corrupted = _pair(n_pos=40)
    metric = _weighted_logits()
    runner = EdgeRunner(model, (clean, corrupted))
    g = runner.graph
    for embed in (None, runner.clean_out[0] + 0.3 * runner.delta[0]):  # EAP, and one EAP-IG point
        reference = runner.delta.flatten(1) @ runner.receiver_grads(metric, embed).flatten(1).T
        scores = runner.receiver_scores(metric, embed)
        torch.testing.assert_close(scores[g.edge_sender, g.edge_receiver], reference[g.edge_sender, g.edge_receiver],
                                   rtol=0, atol=1e-6)
    if name != "pre":
        return
    ig = edge_attribution(model, (clean, corrupted), metric, "eap-ig", steps=3).score.to_numpy()
    points = [runner.clean_out[0] + (k + 0.5) / 3 * runner.delta[0] for k in range(3)]
    mean_grads = sum(runner.receiver_grads(metric, e) for e in points) / 3
    reference = (runner.delta.flatten(1) @ mean_grads.flatten(1).T)[g.edge_sender, g.edge_receiver]
    np.testing.assert_allclose(ig, reference.numpy(), rtol=0, atol=1e-6)


_EAP_MEMORY = """
import ctypes, gc, json
import torch
import workbench as wb
from workbench.analysis.circuits import edge_attribution
from workbench.analysis.common import logit_diff_metric

torch.set_num_threads(1)
trim = ctypes.CDLL("libc.so.6").malloc_trim

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def peak(fn):  # the peak resident memory while fn runs, over the memory resident before it
    gc.collect()
    trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    before = rss()
    fn()
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM")).split()[1]) * 1024 - before

model = wb.HookedDecoder(wb.ModelConfig(d_model=64, n_layers=4, n_heads=8, d_vocab=50, n_ctx=256, seed=0)).eval()
gen = torch.Generator().manual_seed(0)
clean, corrupted = (torch.randint(0, 50, (8, 256), generator=gen) for _ in range(2))
metric = logit_diff_metric(1, 2)
for n in (8, 256):  # first calls allocate once for good (thread pools, kernels): not the methods' memory
    metric(model(clean[:, :n])).backward()
    edge_attribution(model, (clean[:, :n], corrupted[:, :n]), metric, "eap")
model.zero_grad(set_to_none=True)
print(json.dumps({"forward_backward": peak(lambda: metric(model(clean)).backward()),
                  "eap": peak(lambda: edge_attribution(model, (clean, corrupted), metric, "eap")),
                  "eap_ig": peak(lambda: edge_attribution(model, (clean, corrupted), metric, "eap-ig", steps=2))}))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
def test_eap_memory_does_not_scale_with_receivers():
    # EAP kept every receiver's gradient, [receivers, batch, pos, d_model] (201 receivers per 73 senders
    # on 8 layers x 8 heads): 8.4x the memory of one forward and backward here, 105 GiB at 4,096 tokens
    # on a 300M model. Measured as resident memory in a fresh process, every large tensor mmapped so
    # that a freed one leaves the count at once; a count of bytes, never a time.
    import json
    import subprocess
    import sys

    from factories import python_env

    out = subprocess.run([sys.executable, "-c", _EAP_MEMORY], capture_output=True, text=True, timeout=600,
                         env=python_env(MALLOC_MMAP_THRESHOLD_="65536"))
    assert out.returncode == 0, out.stderr[-2000:]
    peak = json.loads(out.stdout.strip().splitlines()[-1])
    assert peak["forward_backward"] > 10 * 2**20, peak  # the measurement sees the tensors at all
    assert peak["eap"] <= 3 * peak["forward_backward"], peak
    assert peak["eap_ig"] <= 3 * peak["forward_backward"], peak


# ---- the hand-built model: the truth is exact ---------------------------------------------------------
@pytest.fixture(scope="module")
def hand():
    model = build_hand_induction()
    gen = torch.Generator().manual_seed(3)

    def prompts():
        r = torch.stack([torch.randperm(BOS, generator=gen)[:HALF] for _ in range(8)])
        return torch.cat([torch.full((8, 1), BOS), r, r], dim=1)

    clean, corrupted = prompts(), prompts()
    targets = clean[:, HALF + 2:]

    def metric(logits):
        return logits[:, HALF + 1:2 * HALF].log_softmax(-1).gather(-1, targets[..., None]).mean()

    return model, (clean, corrupted), metric


@pytest.fixture(scope="module")
def hand_exact(hand):
    model, ds, metric = hand
    return edge_attribution(model, ds, metric, "exact")


def test_exact_methods_recover_the_hand_built_circuit(hand, hand_exact):
    model, ds, metric = hand
    exact = hand_exact
    assert edge_auroc(exact, TRUTH) == 1.0
    assert set(exact.nlargest(len(TRUTH), "abs_score").edge) == set(TRUTH)
    circuit = discover_circuit(model, ds, metric, "acdc", threshold=0.01)
    assert set(circuit.edges) == set(TRUTH)
    row = evaluate_circuit(model, circuit, ds, metric).iloc[0]
    assert row.faithfulness == pytest.approx(1.0, abs=1e-4) and row.completeness == pytest.approx(1.0, abs=1e-4)
    assert row.minimality == 1.0
    # Without its key edge (K-composition) the induction head attends nowhere useful.
    broken = Circuit.from_edges(model, [e for e in TRUTH if e != "L0H0 -> L1H0.k"])
    assert faithfulness(model, broken, ds, metric) < 0.5


def test_eap_ig_gets_closer_than_eap_through_a_saturated_softmax(hand, hand_exact):
    # The induction head's match is a softmax at 12 against 0: almost no gradient at the clean run.
    model, ds, metric = hand
    exact = hand_exact.set_index("edge").score[TRUTH]
    eap = edge_attribution(model, ds, metric, "eap").set_index("edge").score[TRUTH]
    ig = edge_attribution(model, ds, metric, "eap-ig", steps=8).set_index("edge").score[TRUTH]
    assert (abs(ig - exact) < abs(eap - exact)).all()
    assert abs(eap["L0H0 -> L1H0.k"]) < 1e-3 * abs(exact["L0H0 -> L1H0.k"])  # EAP all but misses K-composition


def test_pruning_drops_only_edges_that_cannot_matter(hand):
    model, ds, metric = hand
    runner = EdgeRunner(model, ds)
    g = runner.graph
    keep = torch.bernoulli(torch.full(g.adjacency.shape, 0.5), generator=torch.Generator().manual_seed(0))
    keep = keep * g.adjacency
    pruned = prune(g, keep)
    assert pruned.sum() < keep.sum() and bool((pruned <= keep).all())
    assert runner.metric_of(metric, pruned) == pytest.approx(runner.metric_of(metric, keep), abs=1e-5)


def test_path_patching_is_the_edge_patch_and_patches_receivers_together(hand):
    model, ds, metric = hand
    single = path_patching(model, ds, metric, sender=("head", 0, 0), receivers=[("head", 1, 0, "k")])
    exact = edge_patching(model, ds, metric, edges=["L0H0 -> L1H0.k"])
    assert single.metric[0] == pytest.approx(exact.metric[0], abs=1e-5)
    both = path_patching(model, ds, metric, sender="L0H0", receivers=["L1H0.k", "L1H1.k"])
    assert both.receivers[0] == "L1H0.k, L1H1.k" and both.metric[0] == pytest.approx(single.metric[0], abs=1e-5)
    sweep = path_patching(model, ds, metric, receivers=[("head", 1, 0, "k")])
    assert list(sweep.sender) == ["embed", "L0H0", "L0H1", "L0H2"]
    assert sweep.set_index("sender").score.abs().idxmax() == "L0H0"
    with pytest.raises(ValueError, match="edge L1H0 -> L1H1.q does not exist"):
        path_patching(model, ds, metric, sender="L1H0", receivers=["L1H1.q"])


# ---- circuit files and bad input -----------------------------------------------------------------------
def test_circuit_round_trips_and_refuses_another_model(hand, tmp_path):
    model, ds, metric = hand
    circuit = Circuit.from_edges(model, TRUTH, method="hand", scores={TRUTH[0]: 1.5})
    path = circuit.save(tmp_path / "c.json")
    loaded = Circuit.load(path, model)
    assert loaded.edges == circuit.edges and loaded.scores == {TRUTH[0]: 1.5} and loaded.method == "hand"
    assert set(loaded.nodes) == {"embed", "L0H0", "L1H0", "logits"}
    assert list(loaded.to_frame().input) == ["v", "q", "k", "v", "logits"]
    with pytest.raises(ValueError, match="found on model 'planted-hand-induction' \\(2 layers x 3 heads.*this model is"):
        Circuit.load(path, _model())
    edited = build_hand_induction()
    with torch.no_grad():
        edited.blocks[0].attn.W_O.add_(1e-3)
    with pytest.raises(ValueError, match="another training, or edited weights.*check_weights=False"):
        Circuit.load(path, edited)
    assert Circuit.load(path, edited, check_weights=False).edges == circuit.edges
    (tmp_path / "bad.json").write_text('{"edges": []}')
    with pytest.raises(ValueError, match="is not a circuit file"):
        Circuit.load(tmp_path / "bad.json")


def test_metric_of_the_wrong_shape_and_mismatched_prompts_are_named(hand):
    model, (clean, corrupted), metric = hand
    with pytest.raises(ValueError, match="metric must return one number for the batch.*got shape \\(8,\\)"):
        edge_attribution(model, (clean, corrupted), lambda logits: logits[:, -1, 0], "eap")
    with pytest.raises(ValueError, match="must have one shape"):
        edge_patching(model, (clean, corrupted[:, :-1]), metric)
    with pytest.raises(ValueError, match="method='fast' is not valid"):
        edge_attribution(model, (clean, corrupted), metric, "fast")
    with pytest.raises(ValueError, match="KL metric scores every edge 0"):
        edge_attribution(model, (clean, corrupted), "kl", "eap")


def test_discovery_by_scores_keeps_the_top_edges(hand):
    model, ds, metric = hand
    circuit = discover_circuit(model, ds, metric, "eap-ig", top_k=len(TRUTH), steps=4)
    assert set(circuit.edges) == set(TRUTH) and len(circuit.scores) == ComputationGraph(model).n_edges
    assert circuit.meta["steps"] == 4
    kl = discover_circuit(model, ds, None, "acdc", threshold=0.05)  # the KL from the clean run
    assert set(kl.edges) <= set(ComputationGraph(model).edge_labels) and faithfulness(model, kl, ds, metric) > 0.9


def test_top_k_keeps_the_largest_scores_with_ties_in_edge_order(hand, hand_exact):
    model, ds, metric = hand
    g = ComputationGraph(model)
    circuit = discover_circuit(model, ds, metric, "exact", top_k=len(TRUTH) + 1)
    # By hand from the exact scores: |score| descending, equal scores in the graph's edge order.
    # Only the 5 planted edges score non-zero, so the 6th is the first zero-scored edge.
    scores = dict(zip(hand_exact.edge, hand_exact.score))
    ranked = sorted(range(g.n_edges), key=lambda i: (-abs(scores[g.edge_labels[i]]), i))
    expected = {g.edge_labels[i] for i in ranked[:len(TRUTH) + 1]}
    first_zero = next(e for e in g.edge_labels if scores[e] == 0.0)
    assert expected == set(TRUTH) | {first_zero} and first_zero == "embed -> L0H0.q"
    assert set(circuit.edges) == expected  # each of them is fed and read, so pruning keeps all six
    assert circuit.meta["top_k"] == len(TRUTH) + 1
    assert discover_circuit(model, ds, metric, "eap", top_k=g.n_edges).meta["top_k"] == g.n_edges  # the bound
    for bad in (0, g.n_edges + 1):
        with pytest.raises(ValueError, match=f"top_k must be an integer in \\[1, {g.n_edges}\\], got {bad}"):
            discover_circuit(model, ds, metric, "exact", top_k=bad)
    with pytest.raises(ValueError, match="top_k applies to the scoring methods.*top_k=None with method='acdc'"):
        discover_circuit(model, ds, metric, "acdc", top_k=3)


def test_circuit_figure_draws_every_edge_coloured_by_input(hand):
    from workbench import viz

    model, ds, metric = hand
    circuit = Circuit.from_edges(model, TRUTH, scores={e: float(i + 1) for i, e in enumerate(TRUTH)})
    fig = viz.circuit_figure(circuit.to_frame())
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == len(TRUTH)
    k_line = next(t for t in lines if t.line.color == viz.INPUT_COLOURS["k"])
    assert list(k_line.x) == [1.0, 3.0] and list(k_line.y) == [0.0, 0.0]  # L0H0 -> L1H0, by K-composition
    assert {t.name for t in lines} == {"q", "k", "v", "logits"}
    assert len(fig.data[0].x) == 6  # every head of the model, faint
    with pytest.raises(ValueError, match="needs columns sender, receiver and input"):
        viz.circuit_figure(circuit.to_frame().drop(columns="input"))


def test_auroc_counts_ties_half_and_takes_series():
    import pandas as pd

    from workbench.analysis.circuits import auroc

    # pairs (positive, negative) ranked right: (0.4>0.1), (0.4>0.35), (0.8>0.1), (0.8>0.35) = 4 of 4
    assert auroc(pd.Series([0.1, 0.4, 0.35, 0.8]), pd.Series([False, True, False, True])) == 1.0
    assert auroc(np.array([0.5, 0.5, 0.2]), [True, False, False]) == 0.75  # a tie counts half
    assert np.isnan(auroc([1.0, 2.0], [True, True]))
