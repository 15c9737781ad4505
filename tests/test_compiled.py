"""A compiled HookedDecoder honours every hook, or refuses (workbench.compiled).

Each test builds two models with the same seed, compiles one (``model.compile``) and runs every
intervention the library makes on both: the compiled results must equal the eager ones to 1e-5.
Most of the matrix compiles with ``backend="eager"`` (dynamo's tracing and guards, where hooks are
kept or lost, without inductor's C++ compile, which takes tens of seconds per graph on this CPU);
``test_hooks_moved_changed_and_cached`` and the refusal test use ``"aot_eager"`` (AOT autograd as
inductor gets it), ``test_inductor_honours_hooks`` the real inductor backend. Each test checks that its model
really ran compiled (dynamo traced graphs), so a silent fallback to eager cannot pass.
"""

import jaxtyping
import numpy as np
import pandas as pd
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import Direction, activation_patching, attribution_patching, logit_diff_metric
from workbench.analysis.ablation import AblationSpec, ablate, ablation_hooks, ablation_sweep
from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary
from workbench.analysis.splice import spliced
from workbench.analysis.store import hook_shapes
from workbench.compiled import compile_counters, is_compiled, uncompile

ATOL = 1e-5
# Block layouts and component families: pre-norm, post-norm + ALiBi, parallel + RoPE + GQA + RMSNorm
# + SwiGLU, and a top-k MoE (whose routing breaks the graph: those parts run eagerly, hooks too).
CONFIGS = {
    "pre": {},
    "post-alibi": {"norm_placement": "post", "positional": "alibi"},
    "parallel-rope-gqa": {"parallel_residual": True, "positional": "rope", "n_kv_heads": 2,
                          "norm": "rmsnorm", "ffn": "swiglu"},
    "moe": {"ffn": "moe", "n_experts": 4, "experts_per_token": 2},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # The suite's jaxtyping shape checks (beartype) cannot check the fake tensors dynamo traces with:
    # off here, as they are for every user (they run in tests only).
    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    torch._dynamo.reset()  # no cache entries of another test's model
    # every test's graphs counted from zero: dynamo's reset keeps its running totals, so a test's
    # ``compile_counters()["graphs"] >= n`` held on the graphs of the tests before it
    torch._dynamo.utils.counters.clear()
    yield
    # past the recompile limit a compiled model runs eagerly, and a comparison with it compares eager with eager
    fell_back = compile_counters()["eager_fallbacks"]
    torch._dynamo.reset()
    jaxtyping.config.update("jaxtyping_disable", was)
    assert fell_back == 0, f"{fell_back} call(s) of the compiled model ran eagerly: raise its recompile_limit"


def pair(backend="eager", recompile_limit=None, **cfg):
    eager = wb.HookedDecoder(tiny(**cfg)).eval()
    compiled = wb.HookedDecoder(tiny(**cfg)).eval()
    compiled.compile(backend=backend, recompile_limit=recompile_limit)
    assert is_compiled(compiled) and not is_compiled(eager)
    return eager, compiled


def close(a, b, what=""):
    if isinstance(a, pd.DataFrame):
        num = a.select_dtypes("number").columns
        pd.testing.assert_frame_equal(a.drop(columns=num), b.drop(columns=num))
        np.testing.assert_allclose(a[num].to_numpy(float), b[num].to_numpy(float), atol=ATOL, rtol=0, err_msg=what)
        return
    assert a.shape == b.shape, what
    a, b = a.float(), b.float()
    err = torch.where(a == b, 0.0, (a - b).abs()).max().item()  # equal infinities (masked scores) agree
    assert err <= ATOL, f"{what}: compiled differs from eager by {err}"


def head_zero(layer, head):
    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0
        return z
    return (f"blocks.{layer}.attn.hook_z", hook)


def both(models, fn):
    return [fn(m) for m in models]


def tokens(seed=0, shape=(2, 9)):
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


def random_sae(kind, hook, hook_out="", d_in=32, seed=0):
    cfg = DictionaryConfig(kind=kind, d_in=d_in, d_sae=64, k=4, hook_name=hook, hook_name_out=hook_out)
    sae = make_dictionary(cfg)
    sae.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        sae.b_enc.copy_(torch.randn(sae.b_enc.shape, generator=g) * 0.1)
        sae.b_dec.copy_(torch.randn(sae.b_dec.shape, generator=g) * 0.1)
    return sae


def half(resid, hook):
    return resid * 0.5


@pytest.mark.parametrize("name", [name for name in CONFIGS if name != "pre"])  # pre: the test below
def test_every_layout_honours_hooks_before_and_after_compiling(name):
    eager = wb.HookedDecoder(tiny(**CONFIGS[name])).eval()
    compiled = wb.HookedDecoder(tiny(**CONFIGS[name])).eval()
    x = tokens()
    with torch.no_grad():
        for m in (eager, compiled):  # attached before compiling, in the second block (the code all blocks share)
            m.blocks[1].hook_resid_mid.add_perma_hook(half) if "resid_mid" in m.blocks[1].sites else \
                m.blocks[1].hook_resid_pre.add_perma_hook(half)
        compiled.compile(backend="eager")
        close(eager(x), compiled(x), "hook attached before compiling")
        with eager.hooks(fwd_hooks=[head_zero(1, 2)]), compiled.hooks(fwd_hooks=[head_zero(1, 2)]):
            a, b = eager(x), compiled(x)
        close(a, b, "hook attached after compiling")
        assert (a - eager(x)).abs().max() > 1e-4  # the ablation does change the logits
        for m in (eager, compiled):
            m.reset_hooks(including_permanent=True)
        close(eager(x), compiled(x), "every hook removed")
    assert compile_counters()["graphs"] >= 3


def test_hooks_moved_changed_and_cached():
    eager, compiled = pair(backend="aot_eager")
    x = tokens()
    with torch.no_grad():
        close(eager(x), compiled(x), "no hook")
        seen = []
        for layer, head in [(1, 1), (0, 1), (1, 2), (1, 3), (0, 1), (1, 1)]:
            with eager.hooks(fwd_hooks=[head_zero(layer, head)]), compiled.hooks(fwd_hooks=[head_zero(layer, head)]):
                a, b = eager(x), compiled(x)
            close(a, b, f"zero head {layer}.{head}")
            assert (a - eager(x)).abs().max() > 1e-4
            seen.append(compile_counters()["graphs"])
        close(eager(x), compiled(x), "hook removed")
        # each configuration compiled once: back at (0, 1) and (1, 1) nothing new is traced
        assert seen[-1] == seen[-2] == seen[-3], seen


def test_ablations_patching_and_resumed_sweeps():
    # 13 hook configurations in all, one over the 2-layer default: attribution patching, the last,
    # ran eagerly and compared the eager model with itself
    models = pair(recompile_limit=16, **CONFIGS["parallel-rope-gqa"])
    # the reference the same shape as the data: its runs of the compiled model add hook configurations,
    # not a batch size (a second size retraces every later graph with a symbolic batch, about twice the cost)
    x, ref = tokens(1, (2, 6)), tokens(2, (2, 6))
    metric = logit_diff_metric(3, 7)
    specs = [AblationSpec("head", 1, head=2), AblationSpec("mlp", 1, method="mean"),
             AblationSpec("resid", 1, method="resample", seed=3), AblationSpec("attn", 0, positions=(2, 3))]
    with torch.no_grad():
        for spec in specs:
            breaks = compile_counters()["graph_breaks"]
            a, b = both(models, lambda m: ablate(m, x, spec, reference=ref))
            close(a, b, str(spec))
            # the hook is tensor arithmetic only: the mean / resample checks (which read values) ran before
            # the forward (inside the hook they broke one mean ablation into about 16 graphs)
            assert compile_counters()["graph_breaks"] == breaks, f"{spec} broke the compiled graph"
        # the resumed sweep: each ablation starts from the clean run's cache at its block (Block.resume)
        a, b = both(models, lambda m: ablation_sweep(m, x, specs=specs, metric=metric, reference=ref))
        close(a, b, "resumed sweep")
        corrupted = x.clone()
        corrupted[:, 3] = (corrupted[:, 3] + 11) % 50
        a, b = both(models, lambda m: activation_patching(m, x, corrupted, metric, sites=("resid_pre", "head"),
                                                          positions=[3, -1]))
        close(a, b, "activation patching")
    # gradients through backward hooks (attribution patching)
    a, b = both(models, lambda m: attribution_patching(m, x, corrupted, metric))
    close(a, b, "attribution patching")
    assert compile_counters()["graphs"] >= 2


def test_steering_every_mode_and_generation():
    eager, compiled = pair(**CONFIGS["post-alibi"])
    x = tokens(3)
    v = torch.randn(32, generator=torch.Generator().manual_seed(4))
    direction = Direction(v, "blocks.0.hook_resid_post")
    with torch.no_grad():
        for mode, scale, positions in [("ablate", 1.0, "all"), ("clamp", [1.0, -3.0], [0, 2])]:
            batch = x.repeat(2, 1) if isinstance(scale, list) else x
            a, b = both((eager, compiled), lambda m: _steered(m, direction, scale, mode, positions, batch))
            close(a, b, f"steer {mode} {scale} {positions}")
        # a steered greedy generation with the KV cache, token for token
        a, b = both((eager, compiled), lambda m: _steered_generate(m, direction, x[:1, :5]))
        assert torch.equal(a, b)


def _steered(model, direction, scale, mode, positions, batch):
    with model.steer(direction, scale, mode, positions):
        return model(batch)


def _steered_generate(model, direction, prompt):
    with model.steer(direction, 3.0, "add", [5, 6, 7]):
        return model.generate(prompt, max_new_tokens=6)


def test_run_with_cache_and_dictionary_splices():
    eager, compiled = pair(**CONFIGS["pre"])
    x = tokens(5)
    with torch.no_grad():
        (la, ca), (lb, cb) = both((eager, compiled), lambda m: m.run_with_cache(x))
        close(la, lb, "run_with_cache logits")
        assert set(ca.keys()) == set(cb.keys())
        for key in ca.keys():
            close(ca[key], cb[key], key)
        sae = random_sae("topk", "blocks.0.hook_resid_post")
        transcoder = random_sae("transcoder", "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out")
        for dictionary, error_term in ((sae, False), (transcoder, True)):
            with spliced(eager, dictionary, error_term=error_term), spliced(compiled, dictionary, error_term=error_term):
                # the splice's own hooks cached (every other hook's caching is the first run_with_cache's)
                (la, ca), (lb, cb) = both((eager, compiled), lambda m: m.run_with_cache(x, names_filter=_spliced_hook))
                close(la, lb, f"{dictionary.cfg.kind} error_term={error_term}")
                assert set(ca.keys()) == set(cb.keys())
                for key in ca.keys():
                    close(ca[key], cb[key], f"{dictionary.cfg.kind} error_term={error_term} {key}")
                # no hook on the splice, no gradient: the k kept features are decoded sparsely
                a, b = both((eager, compiled), lambda m: m(x))
                close(a, b, f"{dictionary.cfg.kind} sparse decode error_term={error_term}")
                close(a, la, f"{dictionary.cfg.kind} sparse vs dense decode error_term={error_term}")
                acts = [k for k in ca.keys() if k.endswith("hook_sae_acts_post")]
                assert acts
                # a feature ablation is a hook on the spliced features
                a, b = both((eager, compiled), lambda m: m.run_with_hooks(x, fwd_hooks=[(acts[0], kill_features)]))
                close(a, b, f"{dictionary.cfg.kind} feature ablation error_term={error_term}")
                # and it does something: a compiled model that dropped this hook would give the unablated logits
                assert (b - lb).abs().max() > 1e-3, "the feature ablation changed nothing: the check could not fail"
        close(eager(x), compiled(x), "dictionaries removed")


def test_a_shape_probe_of_a_compiled_model_compiles_nothing():
    # hook_shapes (run by every splice and activation store) probes with a 1 x 2 batch: compiled, that was a
    # graph of its own (tens of seconds under inductor) that also made the model's later graphs dynamic
    model = wb.HookedDecoder(tiny()).eval().compile(backend="eager")
    before = compile_counters()["graphs"]  # a running total: dynamo's reset leaves it
    shapes = hook_shapes(model, ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"])
    assert shapes == {"blocks.0.hook_resid_post": (32,), "blocks.1.attn.hook_z": (4, 8)}
    assert compile_counters()["graphs"] == before and is_compiled(model)


def _spliced_hook(name):
    return ".hook_sae_" in name


def kill_features(acts, hook):
    acts = acts.clone()
    acts[..., ::2] = 0  # half of every token's features: some of its k active ones
    return acts


def test_plain_torch_compile_refuses_a_hooked_model():
    model = wb.HookedDecoder(tiny()).eval()
    x = tokens()
    plain = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        close(model(x), plain(x), "plain compile without hooks")
        with model.hooks(fwd_hooks=[head_zero(1, 1)]):
            with pytest.raises(ValueError, match=r"blocks\.1\.attn\.hook_z.*model\.compile\(\)"):
                plain(x)
        close(model(x), plain(x), "hook removed again")


def test_compiled_model_checks_tokens_and_uncompiles():
    with pytest.raises(ValueError, match="recompile_limit must be a positive integer"):
        wb.HookedDecoder(tiny()).compile(recompile_limit=0)
    with pytest.raises(ValueError, match="needs a workbench HookedDecoder"):
        wb.compile_model(torch.nn.Linear(2, 2))
    model = wb.HookedDecoder(tiny()).eval().compile(backend="aot_eager")
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        model(torch.tensor([[1, 2, 50]]))
    with torch.no_grad():
        x = tokens()
        out = model(x)
        assert torch.equal(uncompile(model)(x), out) and not is_compiled(model)


@pytest.mark.slow  # inductor writes and compiles C++ for each graph: tens of seconds on a loaded CPU
def test_inductor_honours_hooks():
    eager, compiled = pair(backend="inductor", **CONFIGS["parallel-rope-gqa"])
    x = tokens(6)
    with torch.no_grad():
        close(eager(x), compiled(x), "inductor, no hook")
        with eager.hooks(fwd_hooks=[head_zero(1, 2)]), compiled.hooks(fwd_hooks=[head_zero(1, 2)]):
            close(eager(x), compiled(x), "inductor, zero head 1.2 attached after compiling")
    assert compile_counters()["graphs"] >= 2


def test_training_compile_runs_the_hooks(monkeypatch):
    """``TrainConfig.compile`` trains through ``model.compile()``: a permanent hook in the second block
    (dropped by plain torch.compile) shapes the losses exactly as in eager training."""
    from workbench.data import get_task
    from workbench.training import TrainConfig, train

    monkeypatch.setattr(wb.HookedDecoder, "compile", lambda self, **kw: wb.compile_model(self, backend="eager"))
    task = get_task("stories", seed=0)
    config = TrainConfig(task="stories", steps=3, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=1, eval_every=0,
                         log_every=1, save_every=0)
    losses = {}
    for compiled in (False, True):
        model = wb.HookedDecoder(tiny(d_vocab=task.vocab_size, n_ctx=16))
        model.add_hook("blocks.1.hook_resid_pre", lambda r, hook: r * 0.0, is_permanent=True)
        result = train(config.replace(compile=compiled), model=model, progress=False)
        assert not is_compiled(result.model)  # handed back eager
        losses[compiled] = result.history["train_loss"].to_numpy()
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    assert compile_counters()["graphs"] >= 1


def test_run_with_hooks_runs_compiled_and_a_head_sweep_shares_one_graph():
    # TransformerLens' run_with_hooks calls .forward, which is the eager code of a compiled model: the
    # library's hooked runs (ablations, patching) never ran compiled. And the ablation hook held its head
    # as a Python int, a constant of the traced graph: one graph per head, eager past dynamo's limit of 8.
    # Now run_with_hooks calls the model, and the head is a tensor made outside the hook (head_index).
    eager, compiled = pair(n_heads=4)
    x = tokens(3, (2, 7))
    seen = []
    with torch.no_grad():
        for head in range(4):
            spec = AblationSpec("head", 1, head=head)
            a, b = (m.run_with_hooks(x, fwd_hooks=ablation_hooks(m, x, spec)) for m in (eager, compiled))
            close(a, b, f"zero ablation of head 1.{head}")
            assert (a - eager(x)).abs().max() > 1e-4, "the ablation changed nothing"
            seen.append(compile_counters()["graphs"])
    assert seen[0] >= 1 and seen[1:] == [seen[0]] * 3, f"graphs traced after each head: {seen}"


@pytest.mark.parametrize("change", ["data edit", "load_state_dict", "double"])
def test_a_compiled_model_reads_its_weights_as_they_are_now(change):
    """model.compile() traces the parameters as inputs of its graph, not as constants (aot_eager: the
    graph inductor is given; inductor's ``freezing`` option, off by default, would fold them in): a
    ``.data`` edit (no version bump), a load or a cast after the first compiled call is in the next one."""
    eager, compiled = pair(backend="aot_eager", n_kv_heads=2, positional="rope", norm="rmsnorm")
    x = tokens()
    with torch.no_grad():
        before = compiled(x)
        for m in (eager, compiled):
            if change == "data edit":
                m.blocks[0].attn.W_Q.data.mul_(-1.5)
                m.blocks[1].mlp.W_in.data.add_(0.1)
            elif change == "load_state_dict":
                m.load_state_dict(wb.HookedDecoder(tiny(n_kv_heads=2, positional="rope", norm="rmsnorm",
                                                        seed=3)).state_dict())
            else:
                m.double()
        after, expected = compiled(x), eager(x)
    assert after.dtype == expected.dtype
    close(expected, after, change)
    if change != "double":
        assert (before - expected).abs().max() > 1e-3  # the change does move the logits
