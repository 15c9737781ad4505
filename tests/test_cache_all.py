"""Caching every hook: what the cache-all path computes (explicit attention, per-head results, bias-free
projections, one RoPE table per layer) equals an independent computation from the cached inputs, equals
TransformerLens' own caching path and the unhooked forward, keeps gradients, and holds what the forward saw."""

import pytest
import torch
import torch.nn.functional as F
from transformer_lens import HookedRootModule

import workbench as wb
from factories import tiny
from workbench.components.registry import bias_term

CONFIGS = {
    # the benchmark's shape in small: grouped-query, RoPE, RMSNorm, SwiGLU, no biases
    "llama-gqa": dict(n_kv_heads=2, positional="rope", norm="rmsnorm", ffn="swiglu", bias=False),
    "mqa-biases": dict(n_kv_heads=1, positional="rope"),
    "alibi-gqa": dict(n_kv_heads=2, positional="alibi"),  # a score bias added to the scores
    "softcap": dict(attn_logit_softcap=5.0, positional="rope", n_kv_heads=2),
}


def _model(overrides, dtype=torch.float32):
    model = wb.HookedDecoder(tiny(**overrides)).eval()
    with torch.no_grad():  # non-trivial biases and gains, so a bias left out cannot hide behind zeros
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0, 0.5)
    return model.to(dtype)


def _tokens(batch=2, pos=11):
    return torch.randint(0, 50, (batch, pos), generator=torch.Generator().manual_seed(1))


def _by_hand(model, cache, layer):
    """Scores, pattern, z, per-head result and attn_out of one layer from its cached rotated queries and
    keys and its values (einsum, repeat_interleave, softmax: none of the layer's own code)."""
    attn = model.blocks[layer].attn
    cfg = model.cfg
    q = cache[f"blocks.{layer}.attn.hook_{'rot_q' if attn.position.rotates else 'q'}"].double()
    k = cache[f"blocks.{layer}.attn.hook_{'rot_k' if attn.position.rotates else 'k'}"].double()
    v = cache[f"blocks.{layer}.attn.hook_v"].double()
    k, v = k.repeat_interleave(attn.group, dim=2), v.repeat_interleave(attn.group, dim=2)
    n = q.shape[1]
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / cfg.d_head**0.5
    if cfg.attn_logit_softcap is not None:
        scores = torch.tanh(scores / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    bias = attn.position.score_bias(n, n, 0, None)
    if bias is not None:
        scores = scores + bias.double()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    pattern = scores.softmax(-1)
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    result = torch.einsum("bqhe,hed->bqhd", z, attn.W_O.double())
    attn_out = result.sum(2) + attn.b_O.double()
    return dict(attn_scores=scores, pattern=pattern, z=z, result=result, attn_out=attn_out)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_all_equals_a_computation_by_hand_and_tls_path(name):
    model, toks = _model(CONFIGS[name]), _tokens()
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
        tl_logits, tl_cache = HookedRootModule.run_with_cache(model, toks)
        plain = model(toks)  # nothing hooked: fused attention, the o-projection as one matmul
    assert set(cache.keys()) == set(tl_cache.keys()) == set(model.hook_dict)
    for key in cache.keys():  # TransformerLens' hooks and ours store the same tensors
        torch.testing.assert_close(cache[key], tl_cache[key], atol=0, rtol=0, msg=key)
    torch.testing.assert_close(logits, tl_logits, atol=0, rtol=0)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    for layer in range(model.cfg.n_layers):
        expected = _by_hand(model, cache, layer)
        for site, value in expected.items():
            key = f"blocks.{layer}.hook_attn_out" if site == "attn_out" else f"blocks.{layer}.attn.hook_{site}"
            got = cache[key].double()
            if site == "attn_scores":  # -inf above the diagonal in both
                assert torch.equal(torch.isinf(got), torch.isinf(value)), key
                got, value = got.nan_to_num(neginf=0.0), value.nan_to_num(neginf=0.0)
            torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-5, msg=key)


def test_cache_all_on_a_padded_batch_equals_each_prompt_alone():
    model = _model(CONFIGS["llama-gqa"])
    toks = _tokens(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, attention_mask=mask)
        _, alone = model.run_with_cache(toks[1:, 3:])
    for site in ("attn.hook_pattern", "attn.hook_result", "attn.hook_z", "hook_attn_out"):
        got = cache[f"blocks.1.{site}"][1:]
        got = got[..., 3:, 3:] if site.endswith("pattern") else got[:, 3:]
        torch.testing.assert_close(got, alone[f"blocks.1.{site}"], atol=1e-5, rtol=1e-5, msg=site)


@pytest.mark.parametrize("name", ["llama-gqa", "softcap"])
def test_gradients_through_the_cached_path_equal_the_fused_ones(name):
    """The in-place scale and mask of the explicit scores leave autograd's saved tensors intact."""
    model, toks = _model(CONFIGS[name]), _tokens()
    listen = [(f"blocks.{l}.attn.hook_{s}", lambda x, hook: None) for l in range(2) for s in ("pattern", "result")]

    def grads(hooks):
        model.zero_grad()
        model.run_with_hooks(toks, return_type="loss", fwd_hooks=hooks).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused, explicit = grads([]), grads(listen)
    assert set(fused) == set(explicit)
    for n in fused:
        torch.testing.assert_close(explicit[n], fused[n], atol=1e-5, rtol=1e-4, msg=n)


def test_a_hook_that_edits_the_scores_in_place_is_honoured():
    model, toks = _model(CONFIGS["llama-gqa"]), _tokens()

    def only_first_key(scores, hook):
        scores[..., 1:] = float("-inf")

    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_attn_scores", only_first_key)])
        z = cache["blocks.0.attn.hook_z"]
        seen = {}
        model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_attn_scores", only_first_key),
                                              ("blocks.0.attn.hook_z", lambda x, hook: seen.update(z=x.clone()))])
    v = cache["blocks.0.attn.hook_v"].repeat_interleave(model.blocks[0].attn.group, dim=2)
    torch.testing.assert_close(seen["z"], v[:, :1].expand_as(z), atol=1e-6, rtol=1e-6)  # every query reads key 0


def test_the_cache_holds_what_the_forward_saw_after_a_weight_edit():
    model, toks = _model(CONFIGS["llama-gqa"]), _tokens()
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        before = {k: v.clone() for k, v in cache.items()}
        for p in model.parameters():
            p.data.mul_(2.0)  # a .data edit bumps no version counter
        _, after = model.run_with_cache(toks)
    for key in before:
        assert torch.equal(cache[key], before[key]), key
    assert not torch.allclose(after["blocks.1.attn.hook_result"], before["blocks.1.attn.hook_result"])


def test_fixed_zero_biases_are_left_out_and_learned_ones_kept():
    free, biased = _model(dict(bias=False, qkv_bias=False)), _model(dict(bias=True, qkv_bias=True))
    attn, mlp = free.blocks[0].attn, free.blocks[0].mlp
    assert all(bias_term(attn, n) is None for n in ("b_Q", "_b_K", "_b_V", "b_O"))
    assert bias_term(mlp, "b_in") is None and bias_term(free.unembed, "b_U") is None
    assert bias_term(biased.blocks[0].attn, "b_O") is biased.blocks[0].attn.b_O
    assert bias_term(biased.blocks[0].mlp, "b_out") is biased.blocks[0].mlp.b_out
    # the bias-free model equals the same weights with learned biases of zero (its checkpoint holds no biases)
    biased.load_state_dict(free.state_dict(), strict=False)
    toks = _tokens()
    with torch.no_grad():
        for name, p in biased.named_parameters():
            if name.rsplit(".", 1)[-1].startswith(("b_", "_b_")):
                p.zero_()
        torch.testing.assert_close(free(toks), biased(toks), atol=1e-5, rtol=1e-5)
        biased.blocks[0].mlp.b_out.normal_()  # and a learned bias is added (not a constant: LayerNorm centres it away)
        assert (free(toks) - biased(toks)).abs().max() > 1e-3


@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_one_rope_table_serves_queries_and_keys(scaling):
    model = _model(dict(positional="rope", n_kv_heads=2, rope_scaling=scaling, rope_scaling_factor=2.0))
    attn, toks = model.blocks[0].attn, _tokens()
    assert (attn.position.scaling != 1.0) == (scaling == "yarn")
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
    pos = torch.arange(q.shape[1], dtype=torch.float32)
    angles = torch.outer(pos, attn.position.inv_freq)
    angles = torch.cat([angles, angles], -1)[:, None]  # [pos, 1, d_head]
    cos, sin = angles.cos() * attn.position.scaling, angles.sin() * attn.position.scaling
    for x, key in ((q, "rot_q"), (k, "rot_k")):
        x1, x2 = x.chunk(2, -1)
        expected = x * cos + torch.cat([-x2, x1], -1) * sin
        torch.testing.assert_close(cache[f"blocks.0.attn.hook_{key}"], expected, atol=1e-6, rtol=1e-6)
    assert F.cosine_similarity(cache["blocks.0.attn.hook_rot_q"].flatten(), q.flatten(), dim=0) < 0.999
