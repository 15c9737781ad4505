"""Components against independent references: PyTorch built-ins and hand-written equations."""

import math

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from factories import tiny
from workbench.components.block import Block
from workbench.components.norm import LayerNorm, RMSNorm
from workbench.components.positional import SinusoidalPositions, alibi_slopes


def test_layernorm_matches_torch():
    cfg = tiny()
    ours, ref = LayerNorm(cfg), torch.nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    with torch.no_grad():
        ours.w.normal_(), ours.b.normal_()
        ref.weight.copy_(ours.w), ref.bias.copy_(ours.b)
    x = torch.randn(3, 5, cfg.d_model) * 4 + 2
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_rmsnorm_matches_torch():
    cfg = tiny(norm="rmsnorm")
    ours, ref = RMSNorm(cfg), torch.nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    with torch.no_grad():
        ours.w.normal_()
        ref.weight.copy_(ours.w)
    x = torch.randn(3, 5, cfg.d_model) * 4 + 2
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def reference_attention(attn, x, n_kv_heads):
    """Attention written from the equation with PyTorch's scaled_dot_product_attention."""
    h = attn.cfg.n_heads
    q = torch.einsum("bpd,hde->bhpe", x, attn.W_Q) + attn.b_Q[None, :, None]
    k = torch.einsum("bpd,hde->bhpe", x, attn._W_K) + attn._b_K[None, :, None]
    v = torch.einsum("bpd,hde->bhpe", x, attn._W_V) + attn._b_V[None, :, None]
    k, v = k.repeat_interleave(h // n_kv_heads, 1), v.repeat_interleave(h // n_kv_heads, 1)
    z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, p, e]
    return torch.einsum("bhpe,hed->bpd", z, attn.W_O) + attn.b_O


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_matches_sdpa_reference(n_kv_heads):
    cfg = tiny(positional="none", n_kv_heads=n_kv_heads)
    model = wb.HookedDecoder(cfg)
    attn = model.blocks[0].attn
    with torch.no_grad():
        for b in (attn.b_Q, attn._b_K, attn._b_V, attn.b_O):
            b.normal_()
    x = torch.randn(2, 9, cfg.d_model)
    expected = reference_attention(attn, x, n_kv_heads)
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)
    # The explicit path (scores and pattern materialised) gives the same output.
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, hook: None)]):
        assert attn._explicit_needed()
        torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)
    assert not attn._explicit_needed()


def test_gqa_with_duplicated_kv_equals_mha():
    gqa_cfg = tiny(n_kv_heads=2, positional="rope")
    mha_cfg = gqa_cfg.replace(n_kv_heads=4)
    gqa, mha = wb.HookedDecoder(gqa_cfg), wb.HookedDecoder(mha_cfg)
    state = gqa.state_dict()
    for k in list(state):
        if k.endswith(("_W_K", "_W_V", "_b_K", "_b_V")):
            state[k] = state[k].repeat_interleave(2, dim=0)
    mha.load_state_dict(state)
    toks = torch.randint(0, 50, (2, 10))
    torch.testing.assert_close(gqa(toks), mha(toks), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gqa.W_K, mha.W_K)


def test_post_norm_block_follows_its_equation():
    cfg = tiny(norm_placement="post")
    block = Block(cfg, 0)
    wb.HookedDecoder(cfg)  # ensures construction works in a model too
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(2, 7, cfg.d_model)
    ln = lambda norm, y: F.layer_norm(y, (cfg.d_model,), norm.w, norm.b, cfg.norm_eps)
    mid = ln(block.ln1, x + block.attn(x))
    h = F.gelu(mid @ block.mlp.W_in + block.mlp.b_in) @ block.mlp.W_out + block.mlp.b_out
    torch.testing.assert_close(block(x), ln(block.ln2, mid + h), atol=1e-5, rtol=1e-5)


def test_parallel_block_follows_its_equation():
    cfg = tiny(parallel_residual=True)
    block = Block(cfg, 0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(2, 7, cfg.d_model)
    ln = lambda norm, y: F.layer_norm(y, (cfg.d_model,), norm.w, norm.b, cfg.norm_eps)
    h = F.gelu(ln(block.ln2, x) @ block.mlp.W_in + block.mlp.b_in) @ block.mlp.W_out + block.mlp.b_out
    torch.testing.assert_close(block(x), x + block.attn(ln(block.ln1, x)) + h, atol=1e-5, rtol=1e-5)


def test_swiglu_and_moe_follow_their_equations():
    cfg = tiny(ffn="swiglu", bias=False)
    mlp = Block(cfg, 0).mlp
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 5, cfg.d_model)
    torch.testing.assert_close(mlp(x), (F.silu(x @ mlp.W_gate) * (x @ mlp.W_in)) @ mlp.W_out, atol=1e-5, rtol=1e-5)

    cfg = tiny(ffn="moe", n_experts=3, experts_per_token=2, bias=False)
    moe = Block(cfg, 0).mlp
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    probs = torch.softmax(x @ moe.W_gate, -1)
    top = probs.topk(2, dim=-1)
    expected = torch.zeros_like(x)
    for slot in range(2):
        w = top.values[..., slot] / top.values.sum(-1)
        for e, expert in enumerate(moe.experts):
            chosen = (top.indices[..., slot] == e).float() * w
            expected += chosen[..., None] * ((F.silu(x @ expert.W_gate) * (x @ expert.W_in)) @ expert.W_out)
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)


def test_sinusoidal_table_and_alibi_slopes():
    cfg = tiny(positional="sinusoidal")
    table = SinusoidalPositions(cfg).W_pos
    pos, i = 5, 3
    assert math.isclose(table[pos, 2 * i].item(), math.sin(pos / 10000 ** (2 * i / cfg.d_model)), rel_tol=1e-5)
    assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(pos / 10000 ** (2 * i / cfg.d_model)), rel_tol=1e-5)
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(k + 1) for k in range(8)]))
    assert alibi_slopes(6).shape == (6,)


def test_rope_rotation_is_relative():
    """RoPE's defining property: q.k depends only on the distance between the two positions."""
    cfg = tiny(positional="rope")
    rot = wb.HookedDecoder(cfg).blocks[0].attn.position
    q, k = torch.randn(1, 1, 1, cfg.d_head), torch.randn(1, 1, 1, cfg.d_head)
    def score(i, j):
        return (rot.rotate(q, offset=i) * rot.rotate(k, offset=j)).sum().item()
    assert math.isclose(score(3, 1), score(10, 8), rel_tol=1e-4)
    assert not math.isclose(score(3, 1), score(3, 2), rel_tol=1e-3)


def test_loss_is_next_token_cross_entropy():
    model = wb.HookedDecoder(tiny())
    toks = torch.randint(0, 50, (2, 10))
    logits, loss = model(toks, return_type="both")
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), toks[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    per_token = model(toks, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 9)
    torch.testing.assert_close(per_token.mean(), expected)


def test_rope_frequencies_stay_float32_in_low_precision():
    cfg = tiny(positional="rope", n_ctx=4096)
    model = wb.HookedDecoder(cfg)
    exact = model.blocks[0].attn.position.cos_sin(1, 3000, torch.float32)
    model.to(torch.bfloat16)
    rot = model.blocks[0].attn.position
    assert rot.inv_freq.dtype == torch.float32
    cos, sin = rot.cos_sin(1, 3000, torch.float32)
    torch.testing.assert_close(cos, exact[0])
    torch.testing.assert_close(sin, exact[1])
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16
