"""Whatever a user does to a weight, the next forward sees it; fast and explicit paths agree.

Regression tests for two silent wrong answers: a cached Q/K/V concatenation that outlived
``.data`` edits (they do not bump ``Tensor._version``), and CPU SDPA returning 0 where the
explicit softmax gives NaN. Then a seeded property test over random configs from every
registry entry: no-grad == grad == explicit attention == a freshly loaded copy, after random
in-place edits.
"""

import random

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.config import ModelConfig


def _fresh_copy(model):
    copy = wb.HookedDecoder(model.cfg)
    copy.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return copy.eval()


def _explicit(model, tokens):
    """The explicit attention path: a listener on every pattern forces it."""
    hooks = [(f"blocks.{b.layer}.attn.hook_pattern", lambda t, hook: t) for b in model.blocks]
    return model.run_with_hooks(tokens, fwd_hooks=hooks)


EDITS = {
    "data.mul_": lambda p, g: p.data.mul_(1.5),
    "data.add_": lambda p, g: p.data.add_(torch.randn(p.shape, generator=g) * 0.05),
    "data slice": lambda p, g: p.data.__setitem__((0,), p.data[0] * -2 + 0.01),
    "data =": lambda p, g: setattr(p, "data", p.data * 0.5 + 0.01),
    "copy_ (no_grad)": lambda p, g: torch.no_grad()(p.copy_)(torch.randn(p.shape, generator=g) * 0.05),
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("param", ["W_Q", "_W_K", "_W_V", "b_Q"])
def test_attention_weight_edits_are_seen(edit, param):
    model = wb.HookedDecoder(tiny(n_kv_heads=2, qkv_bias=True)).eval()
    tokens = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        model(tokens)  # a first no-grad forward (which once cached the fused weights)
        model.run_with_cache(tokens)
    EDITS[edit](getattr(model.blocks[0].attn, param), torch.Generator().manual_seed(1))
    ref = _fresh_copy(model)
    with torch.no_grad():
        expected = ref(tokens)
        torch.testing.assert_close(model(tokens), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(model.run_with_cache(tokens)[0], expected, atol=1e-6, rtol=0)


def test_generate_sees_edits_between_calls():
    model = wb.HookedDecoder(tiny(init_std=0.3)).eval()  # large weights: greedy tokens react to edits
    prompt = torch.randint(0, 50, (1, 6))
    before = model.generate(prompt, max_new_tokens=8)
    model.blocks[1].attn.W_Q.data.mul_(-3)
    model.blocks[0].attn._W_V.data.mul_(4)
    after = model.generate(prompt, max_new_tokens=8)
    torch.testing.assert_close(after, _fresh_copy(model).generate(prompt, max_new_tokens=8))
    assert model.generate(prompt, max_new_tokens=8, use_kv_cache=False).equal(after)
    assert not after.equal(before)  # the edit changed something, so the equality above means something


@pytest.mark.parametrize("param", ["W_Q", "_W_K", "_W_V", "W_O"])
def test_nan_weights_give_nan_on_both_attention_paths(param):
    model = wb.HookedDecoder(tiny(positional="rope")).eval()
    with torch.no_grad():
        getattr(model.blocks[0].attn, param)[0, 1, 0] = float("nan")
    tokens = torch.randint(0, 50, (1, 4))
    with torch.no_grad():
        fast = model(tokens)
        slow = _explicit(model, tokens)
        cached, _ = model.run_with_cache(tokens)
    assert fast.isnan().any(), "a NaN weight must not give finite logits"
    assert fast.isnan().equal(slow.isnan())
    assert fast.isnan().equal(cached.isnan())


CHOICES = dict(
    norm=["layernorm", "rmsnorm", "gemma_rmsnorm", "none"],
    norm_placement=["pre", "post", "sandwich", "reordered"],
    positional=["learned", "sinusoidal", "rope", "alibi", "none"],
    ffn=["relu", "gelu", "gelu_new", "swiglu", "geglu", "geglu_tanh", "moe"],
    attn_only=[False, True],
    parallel_residual=[False, True],
    tie_embeddings=[True, False],
    bias=[True, False],
    n_kv_heads=[4, 2, 1],
    qk_norm=["none", "head", "projection"],
    attention=["mha", "mla"],
    # Gemma's options (rope_local_base needs RoPE and a window: combinations without them are redrawn)
    attn_logit_softcap=[None, 4.0],
    final_logit_softcap=[None, 3.0],
    query_pre_attn_scalar=[None, 5.0],
    sliding_window=[None, 3],
    global_every=[0, 2],
    rope_local_base=[None, 100.0],
    scale_embeddings=[False, True],
)


def _random_configs(n: int, seed: int = 0) -> list[ModelConfig]:
    """Seeded random valid configs; every choice of every registry appears at least once."""
    rng = random.Random(seed)
    configs = []
    # First one config per value of each field (the rest random), then fully random ones.
    wanted = [(field, value) for field, values in CHOICES.items() for value in values]
    while len(configs) < n:
        fields = {f: rng.choice(v) for f, v in CHOICES.items()}
        if wanted:
            field, value = wanted[0]
            fields[field] = value
        try:
            cfg = tiny(**fields, seed=rng.randrange(1000))
        except ValueError:
            continue  # an invalid combination (e.g. post-norm with a parallel residual)
        if wanted:
            wanted.pop(0)
        configs.append(cfg)
    return configs


@pytest.mark.parametrize("cfg", _random_configs(40), ids=lambda c: f"{c.norm}-{c.norm_placement}-{c.positional}-{c.ffn}-kv{c.n_kv_heads}-qk{c.qk_norm}-{c.attention}")
def test_random_configs_all_paths_agree_after_edits(cfg, tmp_path):
    model = wb.HookedDecoder(cfg).eval()
    tokens = torch.randint(0, cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(cfg.seed))
    with torch.no_grad():
        model(tokens)
        model.generate(tokens[:1, :4], max_new_tokens=3)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    params = list(model.named_parameters())
    for i in torch.randperm(len(params), generator=g)[:4].tolist():
        edit = list(EDITS)[torch.randint(len(EDITS), (1,), generator=g).item()]
        EDITS[edit](params[i][1], g)
    with torch.no_grad():
        no_grad = model(tokens)
        explicit = _explicit(model, tokens)
        wb.save_checkpoint(model, tmp_path / "m")
        loaded = wb.load_checkpoint(tmp_path / "m")[0].eval()(tokens)
    with_grad = model(tokens)
    for other in (explicit, loaded, with_grad.detach()):
        torch.testing.assert_close(other, no_grad, atol=2e-5, rtol=1e-5)
    # the KV-cache decode sees the edits too
    assert model.generate(tokens[:1, :4], max_new_tokens=3).equal(
        model.generate(tokens[:1, :4], max_new_tokens=3, use_kv_cache=False)
    )
