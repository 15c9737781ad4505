"""HookedDecoder invariants, parametrised over every registry entry of every component family."""

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.components.mla import ATTENTIONS
from workbench.components.mlp import FFNS
from workbench.components.norm import NORMS
from workbench.components.positional import POS_EMBEDDINGS

VARIANTS = {
    **{f"norm={k}": dict(norm=k) for k in NORMS},
    **{f"positional={k}": dict(positional=k) for k in POS_EMBEDDINGS},
    **{f"ffn={k}": dict(ffn=k) for k in FFNS},
    "post-norm": dict(norm_placement="post"),
    "post-norm-attn-only": dict(norm_placement="post", attn_only=True),
    "parallel": dict(parallel_residual=True, positional="rope"),
    "attn-only": dict(attn_only=True),
    "mqa": dict(n_kv_heads=1, positional="rope"),
    "gqa": dict(n_kv_heads=2, positional="alibi"),
    "untied-no-bias": dict(tie_embeddings=False, bias=False),
    "qkv-bias-only": dict(bias=False, qkv_bias=True, norm="rmsnorm"),
    "rope-partial-interleaved": dict(positional="rope", rotary_dim=4, rotary_interleaved=True),
    "moe-gqa-top1": dict(ffn="moe", n_experts=3, experts_per_token=1, n_kv_heads=2, moe_expert="gelu"),
    **{f"attention={k}": dict(attention=k, positional="rope") for k in ATTENTIONS},
    "mla-qlora-deepseek-moe": dict(attention="mla", positional="rope", q_lora_rank=12, ffn="moe", n_shared_experts=1,
                                   moe_first_dense=1, moe_router="sigmoid", moe_score_bias=True, moe_n_groups=2),
}


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def model(request):
    cfg = tiny(**VARIANTS[request.param])
    m = wb.HookedDecoder(cfg).eval()
    # Non-trivial norm gains and biases, so a wrong formula cannot hide behind init values.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def tokens(cfg, batch=2, pos=12):
    return torch.randint(0, cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(1))


def expected_hooks(cfg):
    names = {"hook_embed"}
    if cfg.positional in ("learned", "sinusoidal"):
        names.add("hook_pos_embed")
    if cfg.norm != "none":
        names.add("ln_final.hook_scale")
    for l in range(cfg.n_layers):
        b = f"blocks.{l}"
        names |= {f"{b}.hook_resid_pre", f"{b}.hook_attn_out", f"{b}.hook_resid_post"}
        names |= {f"{b}.attn.hook_{n}" for n in ("q", "k", "v", "attn_scores", "pattern", "z", "result")}
        if cfg.positional == "rope":
            names |= {f"{b}.attn.hook_rot_q", f"{b}.attn.hook_rot_k"}
        if cfg.norm != "none":
            names.add(f"{b}.ln1.hook_scale")
        if not cfg.attn_only:
            names.add(f"{b}.hook_mlp_out")
            if cfg.norm != "none":
                names.add(f"{b}.ln2.hook_scale")
            if not cfg.parallel_residual:
                names.add(f"{b}.hook_resid_mid")
            if cfg.ffn == "moe" and l >= cfg.moe_first_dense:  # DeepSeek's first layers are dense
                names |= {f"{b}.mlp.hook_router_logits", f"{b}.mlp.hook_expert_weights", f"{b}.mlp.hook_expert_indices"}
            else:
                names |= {f"{b}.mlp.hook_pre", f"{b}.mlp.hook_post"}
    return names


def test_shapes_and_cache_keys(model):
    cfg = model.cfg
    toks = tokens(cfg)
    logits, cache = model.run_with_cache(toks)
    assert logits.shape == (2, 12, cfg.d_vocab)
    assert expected_hooks(cfg) <= set(cache.keys())
    h, kv, e, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, h, 12, 12)
    assert cache["blocks.1.attn.hook_z"].shape == (2, 12, h, e)
    if cfg.attention == "mla":  # every head's key, nope + rope wide; and the latent the cache keeps
        assert cache["blocks.1.attn.hook_k"].shape == (2, 12, h, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        assert cache["blocks.1.attn.hook_kv_latent"].shape == (2, 12, cfg.kv_lora_rank)
    else:
        assert cache["blocks.1.attn.hook_k"].shape == (2, 12, kv, e)
    assert cache["blocks.0.attn.hook_result"].shape == (2, 12, h, d)
    assert cache["blocks.1.hook_resid_post"].shape == (2, 12, d)
    if "hook_pos_embed" in cache:
        assert cache["hook_pos_embed"].shape == (2, 12, d)
    pattern = cache["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(2, h, 12))
    assert torch.all(pattern.triu(1) == 0), "attention must be causal"


def test_fused_and_explicit_attention_agree(model):
    toks = tokens(model.cfg)
    fused = model(toks)  # nothing listens to scores/pattern: scaled_dot_product_attention
    explicit = model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda x, hook: None),
                                                     ("blocks.1.attn.hook_pattern", lambda x, hook: None)])
    torch.testing.assert_close(fused, explicit, atol=2e-5, rtol=1e-5)


def test_hooks_removed_after_run_with_hooks(model):
    toks = tokens(model.cfg)
    seen = []
    model.run_with_hooks(toks, fwd_hooks=[(lambda n: n.endswith("hook_resid_post"), lambda x, hook: seen.append(hook.name))])
    assert seen == [f"blocks.{l}.hook_resid_post" for l in range(model.cfg.n_layers)]
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
    assert all(not hp._forward_hooks for hp in model.hook_dict.values())


def test_zero_ablating_a_head_changes_logits(model):
    toks = tokens(model.cfg)

    def zero_head(z, hook):
        z[:, :, 1] = 0.0
        return z

    clean = model(toks)
    ablated = model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    assert (clean - ablated).abs().max() > 1e-4


def test_kv_cache_matches_full_recompute(model):
    toks = tokens(model.cfg, batch=2, pos=6)
    with_cache = model.generate(toks, max_new_tokens=10, use_kv_cache=True)
    without = model.generate(toks, max_new_tokens=10, use_kv_cache=False)
    assert torch.equal(with_cache, without)
    # Stronger than equal argmaxes: the cached logits equal the full forward's, step by step.
    full = model(with_cache)
    cache = model.make_kv_cache(2)
    steps = [model(with_cache[:, :6], kv_cache=cache)]
    for i in range(6, with_cache.shape[1]):
        steps.append(model(with_cache[:, i : i + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)


def test_logit_lens_at_last_layer_equals_logits(model):
    toks = tokens(model.cfg)
    logits, cache = model.run_with_cache(toks)
    resid, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels[-1] == "final_post"
    torch.testing.assert_close(resid[-1] @ model.W_U + model.b_U, logits, atol=1e-4, rtol=1e-4)


def test_decompose_resid_sums_to_final_residual(model):
    if model.cfg.norm_placement == "post":
        pytest.skip("post-norm renormalises the residual inside each block, so it is not a sum of writes")
    toks = tokens(model.cfg)
    _, cache = model.run_with_cache(toks)
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels[0] == "embed" and ("pos_embed" in labels) == (model.cfg.positional in ("learned", "sinusoidal"))
    torch.testing.assert_close(parts.sum(0), cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"], atol=1e-5, rtol=1e-5)


def test_stack_head_results_reproduce_attention_output(model):
    toks = tokens(model.cfg)
    _, cache = model.run_with_cache(toks)
    heads, labels = cache.stack_head_results(layer=1, return_labels=True)
    assert labels[:2] == ["L0H0", "L0H1"] and len(labels) == model.cfg.n_heads
    torch.testing.assert_close(
        heads.sum(0) + model.blocks[0].attn.b_O, cache["blocks.0.hook_attn_out"], atol=1e-5, rtol=1e-5
    )


def test_every_parameter_gets_a_gradient(model):
    model.train()
    loss = model(tokens(model.cfg), return_type="loss")
    loss.backward()
    # (requires_grad=False: a weight set outside backprop, such as DeepSeek-V3's router score bias)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


def test_start_and_stop_layers_are_checked_and_count_from_the_end():
    import workbench as wb
    from factories import tiny

    model = wb.HookedDecoder(tiny(n_layers=3)).eval()
    tokens = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        mid = model(tokens, stop_at_layer=-1)  # entering the last block
        torch.testing.assert_close(mid, model(tokens, stop_at_layer=2))
        torch.testing.assert_close(model(mid, start_at_layer=-1), model(tokens))
        torch.testing.assert_close(model(mid, start_at_layer=2), model(tokens))
        for bad in (dict(stop_at_layer=4), dict(stop_at_layer=-4), dict(start_at_layer=7), dict(start_at_layer=-4)):
            with pytest.raises(ValueError, match=next(iter(bad))):
                model(mid if "start_at_layer" in bad else tokens, **bad)
