"""Decoding with a static KV cache (workbench.static_cache), eager and under ``model.compile()``.

The reference is the dynamic KV cache's eager generation (itself checked against full recompute in
test_core_generate): the static cache must give the same tokens, greedy and sampled with a fixed seed,
padded prompts, steering and recording hooks included, and under ``model.compile()`` every decode
step must run on one traced graph (dynamo's counters say how many it traced). The compiled tests use
``backend="eager"`` (dynamo's tracing and guards, where a recompile per token would show) and, once,
``"aot_eager"`` (also AOT autograd's functionalisation of the in-place cache writes, as inductor gets
them), without inductor's C++ compile; ``benchmarks/compiled.py --decode`` runs inductor.
"""

import jaxtyping
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import Direction
from workbench.compiled import compile_counters

CONFIGS = {
    "pre-learned": {},
    "parallel-rope-gqa": {"parallel_residual": True, "positional": "rope", "n_kv_heads": 2, "norm": "rmsnorm",
                          "ffn": "swiglu"},
    "post-sinusoidal-qknorm": {"norm_placement": "post", "positional": "sinusoidal", "qk_norm": "head"},
    "moe": {"ffn": "moe", "n_experts": 4, "experts_per_token": 2, "n_ctx": 40},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # jaxtyping's test-only shape checks cannot check dynamo's fake tensors: off, as for every user
    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    jaxtyping.config.update("jaxtyping_disable", was)


def prompt(seed=0, shape=(1, 5)):
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


def model_of(name, **extra):
    return wb.HookedDecoder(tiny(**CONFIGS[name], **extra)).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_static_cache_generates_what_the_dynamic_cache_generates(name):
    model = model_of(name)
    x = prompt(1, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    variants = ({}, {"temperature": 0.8, "top_k": 10, "seed": [1, 2]},
                {"attention_mask": mask, "temperature": 1.0, "seed": 3})
    for kwargs in variants[:1] if name == "moe" else variants:  # MoE: the cache is the same, its FFN slow eagerly
        dynamic = model.generate(x, max_new_tokens=10, **kwargs)
        static = model.generate(x, max_new_tokens=10, static_cache=True, **kwargs)
        assert torch.equal(dynamic, static), f"{name} {kwargs}"


def test_a_wrong_static_cache_shows():
    """The buffer's written columns are the dynamic cache's keys; unwritten columns are never seen;
    a corrupted written column changes the next logits (so the equality tests can fail)."""
    model = model_of("parallel-rope-gqa")
    x = prompt(2)
    with torch.no_grad():
        dynamic, static = model.make_kv_cache(1, 24), model.make_kv_cache(1, 24, static=True)
        model(x, kv_cache=dynamic)
        model(x, kv_cache=static)
        static.start_decoding()
        step = x[:, -1:]
        for _ in range(4):
            a, b = model(step, kv_cache=dynamic)[:, -1], model(step, kv_cache=static)[:, -1]
            static.advance()
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
            step = a.argmax(-1, keepdim=True)
        n = dynamic.length
        assert int(static.step.column) == n
        for d, s in zip(dynamic.entries, static.entries):
            torch.testing.assert_close(s.k[:, :, :n], d.k[:, :, :n], atol=1e-6, rtol=0)  # RoPE from a tensor: rounding
            torch.testing.assert_close(s.v[:, :, :n], d.v[:, :, :n], atol=1e-6, rtol=0)
            assert not s.k[:, :, n:].any()
        reference = model(step, kv_cache=dynamic)[:, -1]
        for s in static.entries:  # the future columns: masked, whatever they hold
            s.k[:, :, n + 1:] = 1e4
            s.v[:, :, n + 1:] = -1e4
        torch.testing.assert_close(model(step, kv_cache=static)[:, -1], reference, atol=1e-6, rtol=0)
        static.entries[1].v[:, :, 2] += 10.0  # a written column gone wrong
        assert (model(step, kv_cache=static)[:, -1] - reference).abs().max() > 1e-3


def _recorder(model, buffer):
    """A caching hook a compiled decode keeps in its graph: it writes each position into a preallocated
    [batch, pos, d_model] tensor (``model.pos_offset``: a Python int in the prompt's forward, the
    column tensor in a static decode step)."""
    def hook(act, hook):
        at = model.pos_offset
        if isinstance(at, int):
            buffer[:, at:at + act.shape[1]] = act
        else:
            buffer.index_copy_(1, at, act)
    return hook


def _last_pattern(store):
    def hook(pattern, hook):
        store["pattern"] = pattern
    return hook


@pytest.mark.parametrize("name,backend", [("pre-learned", "eager"), ("parallel-rope-gqa", "aot_eager")])
def test_compiled_static_decode_is_one_graph_and_equals_eager(name, backend):
    eager, compiled = model_of(name), model_of(name).compile(backend=backend)
    x = prompt(3)
    greedy = eager.generate(x, max_new_tokens=16)
    before = compile_counters()  # running totals of the process
    assert torch.equal(compiled.generate(x, max_new_tokens=16, static_cache=True), greedy)
    first = compile_counters()
    assert first["graphs"] - before["graphs"] == 2  # the prompt's forward and one decode step
    assert first["graph_breaks"] == before["graph_breaks"]
    # another generation of the same batch and buffer: every step on the graphs already traced
    sampled = eager.generate(x, max_new_tokens=12, temperature=1.0, seed=7)
    assert torch.equal(compiled.generate(x, max_new_tokens=12, temperature=1.0, seed=7, static_cache=True), sampled)
    assert compile_counters()["graphs"] == first["graphs"]
    assert not torch.equal(sampled, greedy[:, :17])

    direction = Direction(torch.randn(32, generator=torch.Generator().manual_seed(4)), "blocks.0.hook_resid_post")
    recorded = {m: torch.zeros(1, 24, 32) for m in ("eager", "compiled")}
    patterns = {"eager": {}, "compiled": {}}
    outs = {}
    for label, model in (("eager", eager), ("compiled", compiled)):
        hooks = [("blocks.1.hook_resid_post", _recorder(model, recorded[label])),
                 ("blocks.1.attn.hook_pattern", _last_pattern(patterns[label]))]
        with model.steer(direction, 3.0, "add", [5, 6, 7]), model.hooks(fwd_hooks=hooks):
            outs[label] = model.generate(x, max_new_tokens=16, static_cache=label == "compiled")
    assert torch.equal(outs["eager"], outs["compiled"])
    assert not torch.equal(outs["eager"], greedy)  # the steering took
    assert compile_counters()["graphs"] == first["graphs"] + 2  # one prompt forward, one decode step, hooks in them
    n = 5 + 16 - 1  # positions fed: the last token is never fed back
    torch.testing.assert_close(recorded["compiled"][:, :n], recorded["eager"][:, :n], atol=1e-5, rtol=0)
    assert recorded["eager"][:, n - 1].abs().sum() > 0
    # a static step's pattern spans the whole buffer: the visible columns as the dynamic cache's, the rest 0
    dynamic, static = patterns["eager"]["pattern"], patterns["compiled"]["pattern"]
    assert static.shape[-1] == 24 and dynamic.shape[-1] == n
    torch.testing.assert_close(static[..., :n], dynamic, atol=1e-5, rtol=0)
    assert not static[..., n:].any()


def test_static_cache_refuses_what_it_cannot_decode():
    for extra, says in (({"positional": "alibi"}, "ALiBi"), ({"sliding_window": 4, "n_kv_heads": 2}, "sliding"),
                        ({"attention": "mla", "positional": "rope", "norm": "rmsnorm"}, "latent"),
                        ({"positional": "rope", "rope_scaling": "dynamic", "rope_scaling_factor": 2.0}, "dynamic")):
        model = wb.HookedDecoder(tiny(**extra)).eval()
        with pytest.raises(ValueError, match=says):
            model.generate(prompt(), max_new_tokens=3, static_cache=True)
        model.generate(prompt(), max_new_tokens=3)  # the dynamic cache handles it
    model = model_of("pre-learned")
    with pytest.raises(ValueError, match="use_kv_cache"):
        model.generate(prompt(), max_new_tokens=3, static_cache=True, use_kv_cache=False)
    cache = model.make_kv_cache(1, 24, static=True)
    with torch.no_grad():
        model(prompt(), kv_cache=cache)
        cache.start_decoding()
        with pytest.raises(ValueError, match="attention_mask"):
            model(prompt()[:, :1], kv_cache=cache, attention_mask=torch.ones(1, 1))
        with pytest.raises(ValueError, match="one token"):
            model(prompt()[:, :2], kv_cache=cache)


def test_a_full_static_cache_refuses_the_next_step_as_the_dynamic_cache_does():
    """Filled to its last column, a static cache's ``length`` counts as the dynamic cache's and the next
    step is a ValueError (an index past the buffer would be a device-side assert on a GPU)."""
    model = model_of("parallel-rope-gqa")
    x = prompt(5, (2, 6))
    with torch.no_grad():
        dynamic, static = model.make_kv_cache(2, 8), model.make_kv_cache(2, 8, static=True)
        model(x, kv_cache=dynamic)
        model(x, kv_cache=static)
        static.start_decoding()
        for _ in range(2):  # the last two columns
            a, b = model(x[:, :1], kv_cache=dynamic), model(x[:, :1], kv_cache=static)
            static.advance()
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
            assert static.length == dynamic.length
        assert static.length == 8
        for cache in (dynamic, static):
            with pytest.raises(ValueError, match="KV cache full"):
                model(x[:, :1], kv_cache=cache)


def test_generate_runs_one_forward_per_token_it_keeps():
    """max_new_tokens=n is the prompt's forward and n - 1 steps (the last token's logits would be thrown
    away, so it is not fed), with every cache and without one; a static step's pos_offset is the column,
    the dynamic step's offset, as a tensor (kept by a clone: the cache advances it in place)."""
    model = model_of("pre-learned")
    x = prompt(6, (2, 5))
    for n in (1, 2, 7):
        seen = {}
        for kind, kwargs in (("dynamic", {}), ("static", {"static_cache": True}), ("recompute", {"use_kv_cache": False})):
            offsets = seen.setdefault(kind, [])
            def keep(act, hook):
                at = model.pos_offset
                offsets.append(at if isinstance(at, int) else int(at.clone()))
            with model.hooks(fwd_hooks=[("hook_embed", keep)]):
                model.generate(x, max_new_tokens=n, **kwargs)
        assert seen["dynamic"] == seen["static"] == [0] + list(range(5, 5 + n - 1)), n
        assert seen["recompute"] == [0] * n


def test_a_non_finite_key_shows_in_a_compiled_static_step():
    """Under compile a static step's attention is written out (``Attention._static_step``), not SDPA: a NaN
    key in the buffer makes the layer's output NaN there as eagerly (no branch in the graph hides it)."""
    eager, compiled = model_of("parallel-rope-gqa"), model_of("parallel-rope-gqa").compile(backend="eager")
    x = prompt(7)
    logits = {}
    with torch.no_grad():
        for label, model in (("eager", eager), ("compiled", compiled)):
            cache = model.make_kv_cache(1, 24, static=True)
            model(x, kv_cache=cache)
            cache.start_decoding()
            clean = model(x[:, -1:], kv_cache=cache)[:, -1]
            cache.advance()
            cache.entries[1].k[:, :, 2] = float("nan")  # a written, visible column
            logits[label] = clean, model(x[:, -1:], kv_cache=cache)[:, -1]
    torch.testing.assert_close(logits["compiled"][0], logits["eager"][0], atol=1e-5, rtol=0)
    assert torch.isfinite(logits["compiled"][0]).all()
    assert torch.isnan(logits["eager"][1]).all() and torch.isnan(logits["compiled"][1]).all()


def test_a_compiled_static_step_keeps_float64():
    """A float64 model's compiled static decode step computes its attention in float64, as the eager
    step does (it accumulated in float32 before, which left a 1e-8 gap where float64 promises 1e-15)."""
    eager = model_of("parallel-rope-gqa").double()
    compiled = model_of("parallel-rope-gqa").double().compile(backend="eager")
    x = prompt(7)
    steps = {}
    with torch.no_grad():
        for label, model in (("eager", eager), ("compiled", compiled)):
            cache = model.make_kv_cache(1, 24, static=True)  # in the weights' dtype
            model(x, kv_cache=cache)
            cache.start_decoding()
            steps[label] = model(x[:, -1:], kv_cache=cache)[:, -1]
    assert steps["compiled"].dtype == torch.float64
    torch.testing.assert_close(steps["compiled"], steps["eager"], atol=1e-12, rtol=0)
