"""Multi-head latent attention (attention='mla') and the DeepSeek MoE options.

The reference for the attention is a from-scratch loop over heads written here from the
DeepSeek-V2 paper's equations (latent, decoupled RoPE key, per-head up-projections), reading the
module's weights; Hugging Face's DeepSeek-V2/V3 are the outside reference (tests/test_interop.py).
The KV-cache decode, which attends over the latent with W_UK and W_UV absorbed, is checked
against the full recompute.
"""

import math

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.accounting import count_params, forward_flops_per_token, kv_cache_bytes_per_token
from workbench.components.mla import MLA, MLACacheEntry

TOL = dict(atol=1e-5, rtol=1e-5)
MLA_CASES = {
    "plain": dict(),
    "q-compressed-untied": dict(q_lora_rank=12, tie_embeddings=False, bias=False),
    "interleaved-wide-rope": dict(qk_rope_head_dim=6, kv_lora_rank=20, qk_nope_head_dim=4, rotary_interleaved=True),
    "moe-shared-dense-first": dict(ffn="moe", n_shared_experts=1, moe_first_dense=1, moe_d_mlp=24, q_lora_rank=8),
}


def _model(**overrides) -> wb.HookedDecoder:
    model = wb.HookedDecoder(tiny(attention="mla", positional="rope", norm="rmsnorm", **overrides)).eval()
    with torch.no_grad():  # non-trivial gains and biases
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model


def _tokens(batch=2, pos=9, seed=0):
    return torch.randint(0, 50, (batch, pos), generator=torch.Generator().manual_seed(seed))


def _reference_attention(attn: MLA, x: torch.Tensor) -> torch.Tensor:
    """The MLA equations, one head and one query at a time, from the module's weights."""
    cfg = attn.cfg
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim

    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rotate(v, pos):  # v [..., rope] at absolute position pos
        inv = 1.0 / cfg.rope_base ** (torch.arange(0, rope, 2).float() / rope)
        cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
        if cfg.rotary_interleaved:
            a, b = v[..., 0::2], v[..., 1::2]
            return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
        a, b = v[..., : rope // 2], v[..., rope // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    batch, n, _ = x.shape
    c = rms(x @ attn.W_DKV + attn.b_DKV, attn.kv_norm.w)  # [batch, pos, rank]
    k_r = torch.stack([rotate(x[:, j] @ attn.W_KR + attn.b_KR, j) for j in range(n)], 1)
    if cfg.q_lora_rank is None:
        q = torch.einsum("bpd,hde->bphe", x, attn.W_Q) + attn.b_Q
    else:
        q = torch.einsum("bpr,hre->bphe", rms(x @ attn.W_DQ + attn.b_DQ, attn.q_norm.w), attn.W_UQ)
    out = torch.zeros(batch, n, cfg.d_model)
    for h in range(cfg.n_heads):
        k = torch.cat([c @ attn.W_UK[h], k_r], -1)
        v = c @ attn.W_UV[h]
        for i in range(n):
            qi = torch.cat([q[:, i, h, :nope], rotate(q[:, i, h, nope:], i)], -1)
            scores = (k[:, : i + 1] @ qi[:, :, None])[..., 0] / math.sqrt(nope + rope)
            out[:, i] += (scores.softmax(-1)[:, :, None] * v[:, : i + 1]).sum(1) @ attn.W_O[h]
    return out + attn.b_O


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_attention_equals_the_equations(case):
    model = _model(**MLA_CASES[case])
    x = torch.randn(2, 7, model.cfg.d_model, generator=torch.Generator().manual_seed(3))
    attn = model.blocks[0].attn
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _reference_attention(attn, x), **TOL)


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_fused_explicit_cache_and_recompute_agree(case):
    model, tokens = _model(**MLA_CASES[case]), _tokens()
    with torch.no_grad():
        fused = model(tokens)
        explicit, cache = model.run_with_cache(tokens)  # hook_pattern listened to: the explicit path
        torch.testing.assert_close(explicit, fused, **TOL)
        kv = model.make_kv_cache(2)
        steps = [model(tokens[:, :4], kv_cache=kv)] + [model(tokens[:, i : i + 1], kv_cache=kv) for i in range(4, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), fused, **TOL)
        # the decode also through the explicit form of the absorbed path (scores listened to)
        kv = model.make_kv_cache(2)
        with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", lambda t, hook: None)]):
            steps = [model(tokens[:, :5], kv_cache=kv), model(tokens[:, 5:], kv_cache=kv)]
        torch.testing.assert_close(torch.cat(steps, 1), fused, **TOL)
    cfg = model.cfg
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert cache["blocks.0.attn.hook_kv_latent"].shape == (2, 9, cfg.kv_lora_rank)
    assert cache["blocks.0.attn.hook_q"].shape == cache["blocks.0.attn.hook_k"].shape == (2, 9, 4, qk)
    assert cache["blocks.0.attn.hook_v"].shape == cache["z", 0].shape == (2, 9, 4, cfg.d_head)
    assert cache["pattern", 0].shape == (2, 4, 9, 9)
    assert ("blocks.0.attn.hook_q_latent" in cache) == (cfg.q_lora_rank is not None)
    if cfg.q_lora_rank is not None:
        assert cache["blocks.0.attn.hook_q_latent"].shape == (2, 9, cfg.q_lora_rank)
    # TransformerLens' cache methods work on the MLA heads
    assert cache.stack_head_results(layer=1).shape == (4, 2, 9, cfg.d_model)


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_generate_same_tokens_with_the_latent_cache(case):
    model, tokens = _model(**MLA_CASES[case]), _tokens(seed=1)
    cached = model.generate(tokens[:, :4], max_new_tokens=10)
    assert cached.equal(model.generate(tokens[:, :4], max_new_tokens=10, use_kv_cache=False))
    batch = wb.TokenBatch.from_ids([[5, 7, 9, 11, 2], [3, 4]], pad_id=0, padding_side="left")
    out = model.generate(batch, max_new_tokens=6)
    for i, row in enumerate([[5, 7, 9, 11, 2], [3, 4]]):
        alone = model.generate(torch.tensor([row]), max_new_tokens=6)[0]
        assert out.tokens[i][out.attention_mask[i].bool()].equal(alone)


def test_cache_holds_the_latent_only_and_accounting_counts_it():
    model = _model(q_lora_rank=12)
    cfg = model.cfg
    kv = model.make_kv_cache(3, max_len=10)
    entry = kv[0]
    assert isinstance(entry, MLACacheEntry) and not hasattr(entry, "k") and not hasattr(entry, "v")
    held = sum(t.numel() * t.element_size() for e in kv.entries for t in (e.latent, e.k_rope))
    # hand count: 2 layers x (latent 32 + RoPE key 4) values x 4 bytes (fp32) per token per row
    assert cfg.kv_lora_rank == 32 and cfg.qk_rope_head_dim == 4
    assert held == 3 * 10 * 2 * (32 + 4) * 4 == 3 * 10 * kv_cache_bytes_per_token(cfg, bytes_per_value=4)
    assert kv_cache_bytes_per_token(cfg) == 2 * 36 * 2
    mha = cfg.replace(attention="mha", q_lora_rank=None)
    assert kv_cache_bytes_per_token(mha) == 2 * 2 * 4 * 8 * 2  # layers x (k, v) x heads x d_head x bf16
    # FLOPs: the attention term reads qk (12) for the scores and d_head (8) for the values
    # (2 FLOPs per multiply-add x layers x context x heads x (12 + 8))
    assert forward_flops_per_token(cfg, context=5) - forward_flops_per_token(cfg, context=0) == 2 * 2 * 5 * 4 * (12 + 8)


def test_hook_edits_under_the_cache():
    model, tokens = _model(), _tokens(seed=2)

    def halve(t, hook):
        return t * 0.5

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.attn.hook_kv_latent", halve)]):
        full = model(tokens)
        kv = model.make_kv_cache(2)
        steps = torch.cat([model(tokens[:, :6], kv_cache=kv), model(tokens[:, 6:], kv_cache=kv)], 1)
    torch.testing.assert_close(steps, full, **TOL)  # the latent edit is what the cache stores
    seen = []
    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.attn.hook_v", lambda t, hook: seen.append(t.shape))]):
        model(tokens[:, :3], kv_cache=model.make_kv_cache(2))
    assert seen == [(2, 3, 4, 8)]  # read-only hooks still report the new positions
    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.attn.hook_k", halve)]):
        model(tokens)  # fine without a cache: keys are materialised and read
        with pytest.raises(ValueError, match="hook_kv_latent"):
            model(tokens, kv_cache=model.make_kv_cache(2))


def test_mla_trains_and_every_weight_gets_a_gradient():
    model = _model(q_lora_rank=12).train()
    loss = model(_tokens(), return_type="loss")
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert missing == []


@pytest.mark.parametrize("bad, match", [
    (dict(kv_lora_rank=8), "attention='mla'"),  # an MLA size on an MHA model
    (dict(attention="mla", positional="alibi"), "positional='rope'"),
    (dict(attention="mla", positional="rope", n_kv_heads=2), "n_kv_heads=2"),
    (dict(attention="mla", positional="rope", qk_rope_head_dim=3), "qk_rope_head_dim must be even"),
    (dict(attention="mla", positional="rope", d_head=8, v_head_dim=6), "v_head_dim=6 must equal d_head=8"),
    (dict(attention="mla", positional="rope", rotary_dim=2), "rotary_dim=2 must equal qk_rope_head_dim=4"),
    (dict(attention="mla", positional="rope", kv_lora_rank=0), "kv_lora_rank"),
    (dict(attention="gqa"), "valid choices are"),
    (dict(ffn="moe", moe_n_groups=3), "moe_n_groups=3 must divide n_experts=4"),
    (dict(ffn="moe", moe_n_groups=2, moe_topk_groups=3), "moe_topk_groups"),
    (dict(ffn="moe", moe_n_groups=4, moe_topk_groups=1), "experts_per_token=2 exceeds"),
    (dict(ffn="moe", moe_first_dense=3), "moe_first_dense"),
    (dict(ffn="moe", n_shared_experts=-1), "n_shared_experts"),
    (dict(ffn="moe", moe_routed_scale=0.0), "moe_routed_scale"),
    (dict(ffn="moe", moe_router="relu"), "valid choices are"),
])
def test_bad_config_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def test_config_derives_mla_sizes_and_round_trips():
    cfg = tiny(attention="mla", positional="rope", v_head_dim=16)
    assert (cfg.d_head, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rotary_dim) == (16, 64, 16, 8, 8)
    assert wb.ModelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.replace(attention="mha").kv_lora_rank is None
    assert tiny().kv_lora_rank is None and tiny().attention == "mha"


def test_moe_routing_options_against_a_loop():
    """Grouped, biased, sigmoid routing with shared experts: the layer equals a per-token loop."""
    cfg = tiny(ffn="moe", n_experts=8, experts_per_token=3, moe_router="sigmoid", moe_n_groups=4, moe_topk_groups=2,
               moe_group_score="top2_sum", moe_score_bias=True, moe_norm_topk=True, moe_routed_scale=2.5,
               n_shared_experts=2, moe_d_mlp=12, moe_first_dense=1, norm="rmsnorm", positional="rope")
    model = _model_plain(cfg)
    assert not hasattr(model.blocks[0].mlp, "experts") and model.blocks[0].mlp.W_in.shape == (32, 128)
    moe = model.blocks[1].mlp
    assert moe.shared_experts.W_in.shape == (32, 24) and moe.experts[0].W_in.shape == (32, 12)
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = moe(x)
        for i in range(6):
            t = x[0, i]
            scores = torch.sigmoid(t @ moe.W_gate)
            biased = scores + moe.b_score
            groups = biased.view(4, 2).sort(-1, descending=True).values[:, :2].sum(-1)
            allowed = torch.zeros(8, dtype=torch.bool)
            for g in groups.argsort(descending=True)[:2].tolist():
                allowed[2 * g : 2 * g + 2] = True
            chosen = biased.masked_fill(~allowed, -math.inf).argsort(descending=True)[:3].tolist()
            w = scores[chosen] / scores[chosen].sum() * 2.5
            want = sum(w[j] * moe.experts[e](t[None, None])[0, 0] for j, e in enumerate(chosen))
            want = want + moe.shared_experts(t[None, None])[0, 0]
            torch.testing.assert_close(got[0, i], want, **TOL)


def _model_plain(cfg):
    model = wb.HookedDecoder(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return model


def test_active_params_count_routed_experts_only():
    cfg = tiny(ffn="moe", n_experts=4, experts_per_token=1, n_shared_experts=1, moe_first_dense=1, moe_d_mlp=16,
               norm="rmsnorm", positional="rope", bias=False)
    counts = count_params(cfg)
    expert = 3 * 32 * 16  # gate, up, down of one routed expert (SwiGLU, no biases)
    assert counts["total"] - counts["active"] == 3 * expert  # one MoE layer, 3 of 4 experts idle
