"""IOI prompts for any tokenizer (workbench.analysis.circuits.ioi), against hand-worked positions and
independent references: mean ablation against a hook that writes each head's per-template mean z,
all-heads-at-once path patching into the logits against ``path_patching`` one head at a time, ACDC
from a start set against ACDC on the whole graph, and the real model's prompt set (real_model)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.analysis.circuits import ComputationGraph, EdgeRunner, mib, path_patching
from workbench.analysis.circuits.acdc import acdc
from workbench.analysis.circuits.ioi import (
    IOI_TEMPLATES, ioi_prompts, logit_diff_direct_effects, mean_ablation_runner, single_token_names,
)
from workbench.tokenizer import WordTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

TEMPLATE = "Then , {A} and {B} went . {S} gave it to"
NAMES = ["Mary", "John", "Anna", "Bob", "Kate"]


def word_tokenizer():
    return WordTokenizer.from_text(TEMPLATE + " " + " ".join(NAMES) + " " + " ".join(IOI_TEMPLATES))


def test_prompts_match_positions_worked_by_hand():
    tok = word_tokenizer()
    p = ioi_prompts(tok, 20, seed=3, templates=[TEMPLATE], names=NAMES)
    # Then(0) ,(1) A(2) and(3) B(4) went(5) .(6) S(7) gave(8) it(9) to(10)
    for i in range(len(p)):
        words = [tok.decode([x]) for x in p.clean[i]]
        io, s, c = (tok.decode([x]) for x in (p.io[i], p.s[i], p.c[i]))
        assert len({io, s, c}) == 3
        if p.order[i] == "ABBA":
            assert (p.positions["IO"][i], p.positions["S1"][i], p.positions["S1+1"][i]) == (2, 4, 5)
            assert words[2] == io and words[4] == s
        else:
            assert (p.positions["IO"][i], p.positions["S1"][i], p.positions["S1+1"][i]) == (4, 2, 3)
            assert words[4] == io and words[2] == s
        assert p.positions["S2"][i] == 7 and p.positions["END"][i] == 10 and words[7] == s
        corrupted = [tok.decode([x]) for x in p.corrupted[i]]
        assert corrupted[7] == c and corrupted[:7] == words[:7] and corrupted[8:] == words[8:]
    assert set(p.order) == {"ABBA", "BABA"}
    again = ioi_prompts(tok, 20, seed=3, templates=[TEMPLATE], names=NAMES)
    assert again == p and ioi_prompts(tok, 20, seed=4, templates=[TEMPLATE], names=NAMES) != p
    logits = torch.zeros(20, 11, tok.vocab_size)
    logits[torch.arange(20), -1, torch.tensor(p.io)] = 2.0
    assert float(p.metric()(logits)) == pytest.approx(2.0)  # logit(IO) - logit(S) at the last token


def test_bad_inputs_are_refused_by_name():
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="different token lengths"):
        ioi_prompts(tok, 4, templates=[TEMPLATE, "Then {A} and {B} went . {S} gave it to"], names=NAMES)
    with pytest.raises(ValueError, match="must contain"):
        ioi_prompts(tok, 4, templates=["Then {A} and {B} went to"], names=NAMES)
    with pytest.raises(ValueError, match="at least three"):
        ioi_prompts(tok, 4, templates=[TEMPLATE], names=NAMES[:2])
    with pytest.raises(ValueError, match="not one token"):
        ioi_prompts(tok, 4, templates=[TEMPLATE], names=NAMES + ["Mary Ann"])
    assert single_token_names(tok, NAMES + ["Mary Ann"]) == NAMES


def tiny_model(seed=0, n_layers=2, n_heads=4):
    tok = word_tokenizer()
    cfg = wb.ModelConfig(d_model=32, n_layers=n_layers, n_heads=n_heads, n_kv_heads=2, d_vocab=tok.vocab_size, n_ctx=32,
                         norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, seed=seed)
    return wb.HookedDecoder(cfg, tokenizer=tok).eval()


@torch.no_grad()
def test_mean_ablation_runner_is_a_hook_writing_each_heads_mean_z_per_template():
    model = tiny_model(1)
    p = ioi_prompts(model, 10, seed=0, templates=IOI_TEMPLATES[:2], names=NAMES)
    clean, corrupted = p.tokens()
    metric = p.metric()
    runner = mean_ablation_runner(EdgeRunner(model, (clean, corrupted)), p.template)
    g = runner.graph
    layer, head = 1, 2
    keep = g.full_mask()
    keep[g.sender_index(("head", layer, head))] = 0.0  # every reader of the head gets its mean
    ours = runner.metric_of(metric, keep)
    _, cache = model.run_with_cache(corrupted, names_filter=f"blocks.{layer}.attn.hook_z")
    z = cache[f"blocks.{layer}.attn.hook_z"]
    groups = torch.tensor(p.template)
    mean = z.clone()
    for t in groups.unique():
        mean[groups == t] = z[groups == t].mean(0, keepdim=True)

    def write_mean(value, hook):
        value[:, :, head] = mean[:, :, head]
        return value

    reference = model.run_with_hooks(clean, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", write_mean)])
    assert ours == pytest.approx(float(metric(reference)), abs=1e-5)
    with pytest.raises(ValueError, match="one id per prompt"):
        mean_ablation_runner(runner, [0, 1])


@torch.no_grad()
def test_direct_effects_equal_path_patching_into_the_logits_one_head_at_a_time():
    model = tiny_model(2)
    p = ioi_prompts(model, 6, seed=1, names=NAMES)
    ds, metric = p.tokens(), p.metric()
    runner = EdgeRunner(model, ds)
    ours = logit_diff_direct_effects(runner, p.io, p.s)
    g = runner.graph
    for sender in [("embed",), ("head", 0, 1), ("head", 1, 3), ("mlp", 1)]:
        reference = path_patching(model, ds, metric, sender=sender, receivers=["logits"])["score"].iloc[0]
        assert float(ours[g.sender_index(sender)]) == pytest.approx(reference, abs=1e-5)


def test_acdc_from_a_start_set_tries_only_its_edges():
    model = tiny_model(3, n_layers=1, n_heads=2)  # 13 edges: ACDC on the whole graph stays cheap
    p = ioi_prompts(model, 6, seed=2, names=NAMES)
    metric = p.metric()
    runner = EdgeRunner(model, p.tokens())
    g = runner.graph
    whole_keep, whole_scores = acdc(runner, metric, 0.05, kl=False)
    keep, scores = acdc(runner, metric, 0.05, kl=False, start=g.full_mask())
    assert torch.equal(keep, whole_keep) and np.allclose(scores, whole_scores)
    start = torch.zeros_like(g.adjacency)
    chosen = np.argsort(-np.abs(whole_scores))[:6]
    start[g.edge_sender[chosen], g.edge_receiver[chosen]] = 1.0
    keep, scores = acdc(runner, metric, 0.05, kl=False, start=start)
    assert bool((keep <= start).all())
    outside = ~start.bool()[g.edge_sender, g.edge_receiver].numpy()
    assert (scores[outside] == 0).all() and (scores[~outside] != 0).any()
    # the score of the first edge tried is the distance its removal adds to the start set's run
    gap = abs(runner.endpoints(metric)[0] - runner.endpoints(metric)[1])
    base = abs(runner.metric_of(metric, start) - runner.endpoints(metric)[0]) / gap
    last = max(chosen, key=lambda e: (g.edge_receiver[e], g.edge_sender[e]))
    trial = start.clone()
    trial[g.edge_sender[last], g.edge_receiver[last]] = 0.0
    assert scores[last] == pytest.approx(abs(runner.metric_of(metric, trial) - runner.endpoints(metric)[0]) / gap - base,
                                         abs=1e-6)
    with pytest.raises(ValueError, match="start must be a mask"):
        acdc(runner, metric, 0.05, kl=False, start=torch.ones(2, 2))


def test_faithfulness_curve_reuses_a_runner():
    model = tiny_model(4)
    p = ioi_prompts(model, 4, seed=5, names=NAMES)
    ds, metric = p.tokens(), p.metric()
    scores = np.random.default_rng(0).normal(size=ComputationGraph(model).n_edges)
    fresh = mib.faithfulness_curve(model, ds, metric, scores, percentages=(0.01, 0.1, 1.0))
    reused = mib.faithfulness_curve(model, None, metric, scores, percentages=(0.01, 0.1, 1.0),
                                    runner=EdgeRunner(model, ds))
    assert np.allclose(fresh["faithfulness"], reused["faithfulness"])


def test_real_model_prompt_set_is_valid(real_model):
    tok = real_model.tokenizer
    names = single_token_names(tok)
    assert len(names) >= 40 and all(len(tok.encode(" " + n)) == 1 for n in names)
    p = ioi_prompts(real_model, 24, seed=0)
    clean, corrupted = p.tokens()
    assert clean.shape == (24, 15)
    differs = clean != corrupted
    assert differs.sum(1).tolist() == [1] * 24
    assert differs.float().argmax(1).tolist() == list(p.positions["S2"])
    assert (clean[torch.arange(24), p.pos("IO")] == torch.tensor(p.io)).all()
    assert (clean[torch.arange(24), p.pos("S1")] == torch.tensor(p.s)).all()
    assert (corrupted[torch.arange(24), p.pos("S2")] == torch.tensor(p.c)).all()
    with torch.no_grad():
        last = real_model(clean)[:, -1]
    diff = last[torch.arange(24), torch.tensor(p.io)] - last[torch.arange(24), torch.tensor(p.s)]
    assert float((diff > 0).float().mean()) >= 0.8  # the model gets most prompts right


def test_ioi_pipeline_makes_no_host_tensor_that_meets_the_data(device):
    """Prompts, path patching, mean ablation, the head classes' evidence (experiments/real_ioi.py) and the
    faithfulness helpers under ``HostTensorGuard`` on a RoPE GQA model: on a GPU no tensor the code makes
    without ``device=`` meets the model's. The head evidence compared ids made on the CPU with the
    logits' argmax; its accuracy is checked here against the logits computed outside the guard."""
    import real_ioi
    from device_guard import HostTensorGuard

    model = tiny_model(1, n_layers=3).to(device)
    p = ioi_prompts(model, 8, seed=0, templates=IOI_TEMPLATES[:2], names=NAMES)
    ds = p.tokens(device)
    metric = p.metric()
    scores = np.random.default_rng(0).normal(size=ComputationGraph(model).n_edges)
    with torch.no_grad(), HostTensorGuard():
        runner = EdgeRunner(model, ds)
        g = runner.graph
        mean = mean_ablation_runner(runner, p.template)
        direct = logit_diff_direct_effects(runner, p.io, p.s)
        patched = path_patching(model, ds, metric, sender=("head", 0, 1), receivers=[("head", 2, 0, "q")])
        behaviour, heads = real_ioi.head_evidence(model, p)
        sinh = real_ioi.sinh_effects(runner, metric, [(0, 1), (1, 2)], [(2, 0), (2, 1)])
        circuits = [real_ioi.node_mask(g, [(0, 1), (2, 0)]), real_ioi.top_mask(g, scores, 10)]
        faith = [mean.metric_of(metric, keep) for keep in circuits]
        curve = mib.faithfulness_curve(model, None, metric, scores, absolute=False, runner=runner, percentages=(0.1, 1.0))
    with torch.no_grad():
        last = model(ds[0])[:, -1].cpu()
    rows = torch.arange(len(p))
    diff = last[rows, torch.tensor(p.io)] - last[rows, torch.tensor(p.s)]
    assert behaviour["accuracy"] == pytest.approx(float((diff > 0).float().mean()))
    assert behaviour["top1_io"] == pytest.approx(float((last.argmax(-1) == torch.tensor(p.io)).float().mean()))
    assert behaviour["logit_diff"] == pytest.approx(float(diff.mean()), abs=1e-5)
    assert len(heads) == 3 * 4 and direct.shape == (len(g.senders),) and len(patched) == 1
    assert len(sinh) == 2 and all(np.isfinite(faith)) and len(curve) == 2


def test_real_model_fast_runner_equals_the_stacked_runner_and_hooked_node_patches(real_model):
    # 30 layers, 9 heads on 3 KV heads, RoPE, no biases: the depth at which restacking every earlier
    # sender's change at each stage made ACDC and faithfulness slow. A random 1% circuit, and every edge
    # out of a few nodes (or out of all but a few) corrupted, which is those nodes writing their corrupted
    # outputs: a hook on their z (or MLP output, or embedding) in one plain forward.
    p = ioi_prompts(real_model, 2, seed=0)
    clean, corrupted = p.tokens()
    runner = EdgeRunner(real_model, (clean, corrupted))
    g = runner.graph
    circuit = g.mask_from_vector((torch.rand(g.n_edges, generator=torch.Generator().manual_seed(0)) < 0.01).float())
    with torch.no_grad():
        torch.testing.assert_close(runner.run(circuit), runner.run_stacked(circuit), atol=1e-4, rtol=0)
        cache = real_model.run_with_cache(corrupted)[1]
        few = [("head", 3, 1), ("head", 14, 7), ("mlp", 20), ("head", 29, 0)]
        spared = {("head", 5, 2), ("head", 20, 4), ("mlp", 11)}
        for nodes in (few, [n for n in g.senders if n not in spared]):
            keep = g.full_mask()
            keep[[g.sender_index(n) for n in nodes]] = 0.0
            heads = {}
            for node in nodes:
                if node[0] == "head":
                    heads.setdefault(node[1], []).append(node[2])

            def patch_z(act, hook):
                act = act.clone()
                index = heads[int(hook.name.split(".")[1])]
                act[:, :, index] = cache[hook.name][:, :, index]
                return act

            hooks = [(f"blocks.{layer}.attn.hook_z", patch_z) for layer in heads]
            hooks += [(f"blocks.{n[1]}.hook_mlp_out", lambda act, hook: cache[hook.name]) for n in nodes if n[0] == "mlp"]
            hooks += [("hook_embed", lambda act, hook: cache[hook.name])] if ("embed",) in nodes else []
            torch.testing.assert_close(runner.run(keep), real_model.run_with_hooks(clean, fwd_hooks=hooks),
                                       atol=1e-4, rtol=0)
