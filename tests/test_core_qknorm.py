"""QK-norm and the output-norm layouts (sandwich, reordered) against a hand-written reference.

The reference below is plain torch, written from the equations (Qwen3 / OLMo 2 / Gemma's
papers and HF's modelling code), not from the workbench's modules: RMSNorm, half-split RoPE,
grouped-query causal softmax attention, SwiGLU, every norm weight random. Then the contracts
every component keeps: padded rows equal prompts alone, the KV cache, hooks, fold_ln (exact
where it folds, refused or skipped where it cannot), checkpoints and parameter counts.
"""

import pytest
import torch
from factories import tiny

import workbench as wb

PLACEMENTS = ["pre", "sandwich", "reordered"]
QK = ["none", "head", "projection"]


def _cfg(placement: str, qk: str, **overrides) -> wb.ModelConfig:
    base = dict(norm="rmsnorm", positional="rope", ffn="swiglu", n_kv_heads=2, d_head=12, bias=False,
                tie_embeddings=False, norm_placement=placement, qk_norm=qk, norm_eps=1e-6)
    return tiny(**{**base, **overrides})


def _randomised(cfg: wb.ModelConfig) -> wb.HookedDecoder:
    """A model whose norm weights (residual, output and QK) are random too, so none is a no-op."""
    model = wb.HookedDecoder(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, base):
    """Half-split rotary embedding of [batch, pos, head, d] at positions 0..pos-1."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)[None, :, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def _reference_logits(model: wb.HookedDecoder, tokens: torch.Tensor) -> torch.Tensor:
    cfg, s = model.cfg, dict(model.state_dict())
    h, kv, e, eps = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.norm_eps
    x = s["embed.W_E"][tokens]
    n = tokens.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}."

        def pre(name, y):
            return y if cfg.norm_placement == "reordered" else _rms(y, s[p + name + ".w"], eps)  # noqa: B023

        def post(name, y):
            return _rms(y, s[p + name + ".w"], eps) if cfg.norm_placement != "pre" else y  # noqa: B023

        a = pre("ln1", x)
        q = torch.einsum("bpd,hde->bphe", a, s[p + "attn.W_Q"])
        k = torch.einsum("bpd,hde->bphe", a, s[p + "attn._W_K"])
        v = torch.einsum("bpd,hde->bphe", a, s[p + "attn._W_V"])
        if cfg.qk_norm == "head":
            q, k = _rms(q, s[p + "attn.q_norm.w"], eps), _rms(k, s[p + "attn.k_norm.w"], eps)
        elif cfg.qk_norm == "projection":
            q = _rms(q.flatten(2), s[p + "attn.q_norm.w"], eps).view_as(q)
            k = _rms(k.flatten(2), s[p + "attn.k_norm.w"], eps).view_as(k)
        q, k = _rope(q, cfg.rope_base), _rope(k, cfg.rope_base)
        k, v = k.repeat_interleave(h // kv, 2), v.repeat_interleave(h // kv, 2)
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / e**0.5
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
        x = x + post("ln1_post", torch.einsum("bqhe,hed->bqd", z, s[p + "attn.W_O"]))
        m = pre("ln2", x)
        act = torch.nn.functional.silu(m @ s[p + "mlp.W_gate"]) * (m @ s[p + "mlp.W_in"])
        x = x + post("ln2_post", act @ s[p + "mlp.W_out"])
    return _rms(x, s["ln_final.w"], eps) @ model.W_U.detach()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("qk", QK)
def test_matches_hand_written_reference(placement, qk):
    model = _randomised(_cfg(placement, qk))
    tokens = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        explicit, cache = model.run_with_cache(tokens)  # the explicit attention path
    reference = _reference_logits(model, tokens)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk", ["head", "projection"])
def test_qk_hooks_are_the_projection_then_the_norm(qk):
    """hook_q/hook_k: the projections (as TL's bridge); hook_q_normed/hook_k_normed: after the
    norm, before RoPE (hook_rot_q/hook_rot_k)."""
    model = _randomised(_cfg("pre", qk))
    tokens = torch.randint(0, 50, (1, 6))
    _, cache = model.run_with_cache(tokens)
    attn, eps = model.blocks[1].attn, model.cfg.norm_eps
    q, k = cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_k"]
    assert q.shape == (1, 6, 4, 12) and k.shape == (1, 6, 2, 12)
    x = cache["blocks.1.ln1.hook_normalized"] * model.blocks[1].ln1.w
    torch.testing.assert_close(q, torch.einsum("bpd,hde->bphe", x, attn.W_Q), atol=1e-5, rtol=1e-5)
    flat = (lambda t: t) if qk == "head" else (lambda t: t.flatten(2))
    for name, raw, norm in (("q", q, attn.q_norm), ("k", k, attn.k_norm)):
        normed = cache[f"blocks.1.attn.hook_{name}_normed"]
        torch.testing.assert_close(flat(normed), _rms(flat(raw), norm.w, eps), atol=1e-6, rtol=1e-5)
        assert not torch.allclose(cache[f"blocks.1.attn.hook_rot_{name}"][:, 1:], normed[:, 1:])


def test_weight_shapes_and_parameter_counts():
    cfg_head, cfg_proj = _cfg("reordered", "head"), _cfg("sandwich", "projection")
    attn = wb.HookedDecoder(cfg_head).blocks[0].attn
    assert attn.q_norm.w.shape == attn.k_norm.w.shape == (12,)  # one d_head weight shared by every head
    model = wb.HookedDecoder(cfg_proj)
    assert model.blocks[0].attn.q_norm.w.shape == (4 * 12,) and model.blocks[0].attn.k_norm.w.shape == (2 * 12,)
    assert {"ln1", "ln1_post", "ln2", "ln2_post"} <= set(dict(model.blocks[0].named_children()))
    reordered = dict(wb.HookedDecoder(cfg_head).blocks[0].named_children())
    assert "ln1" not in reordered and "ln2" not in reordered and "ln1_post" in reordered
    base = wb.count_params(_cfg("pre", "none"))
    # per layer: q/k norms (d_head each, or the projections), and two d_model output norms
    assert wb.count_params(cfg_head)["total"] == base["total"] + 2 * (2 * 12)
    assert wb.count_params(cfg_proj)["total"] == base["total"] + 2 * (4 * 12 + 2 * 12 + 2 * 32)
    assert wb.count_params(cfg_proj)["norms"] == base["norms"] + 2 * 2 * 32


@pytest.mark.parametrize("placement", ["sandwich", "reordered"])
def test_padded_rows_and_kv_cache_equal_prompts_alone(placement):
    model = _randomised(_cfg(placement, "projection" if placement == "reordered" else "head"))
    prompts = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 4)]
    batch = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        batch[i, 7 - len(p):], mask[i, 7 - len(p):] = p, 1
    with torch.no_grad():
        padded = model(batch, attention_mask=mask)
        out = model.generate(batch, attention_mask=mask, max_new_tokens=4)
        for i, p in enumerate(prompts):
            alone = model(p[None])
            torch.testing.assert_close(padded[i, 7 - len(p):], alone[0], atol=1e-5, rtol=1e-5)
            gen = model.generate(p[None], max_new_tokens=4)
            assert out[i, 7:].equal(gen[0, len(p):])
            assert gen.equal(model.generate(p[None], max_new_tokens=4, use_kv_cache=False))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_fold_ln_is_exact_and_keeps_output_and_qk_norms(placement, norm):
    model = _randomised(_cfg(placement, "head", norm=norm, bias=norm == "layernorm"))
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model(tokens).log_softmax(-1)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "q_norm" in k or "_post" in k}
    model.process_weights(fold_ln=True, center_writing_weights=False)
    assert model.cfg.folded_ln
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).log_softmax(-1), before, atol=1e-5, rtol=1e-5)
    after = model.state_dict()
    for k, v in weights.items():  # the output norms and QK-norms keep their weights
        assert torch.equal(after[k], v), k
    if placement != "reordered":
        assert "blocks.0.ln1.w" not in after  # folded into W_Q, W_K, W_V
    assert "ln_final.w" not in after


@pytest.mark.parametrize("placement", ["sandwich", "reordered"])
def test_centring_is_refused_with_output_norms(placement):
    model = _randomised(_cfg(placement, "none", norm="layernorm"))
    with pytest.raises(ValueError, match="center_writing_weights=True needs norm='layernorm' with norm_placement='pre'"):
        model.process_weights(center_writing_weights=True)


def test_checkpoint_round_trip(tmp_path):
    model = _randomised(_cfg("sandwich", "projection"))
    tokens = torch.randint(0, 50, (1, 8))
    wb.save_checkpoint(model, tmp_path / "m")
    loaded, _ = wb.load_checkpoint(tmp_path / "m")
    assert loaded.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens), model(tokens))


def test_bad_choices_name_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig.qk_norm='rms' is not a valid choice; valid choices are \['none'"):
        _cfg("pre", "rms")
    with pytest.raises(ValueError, match="parallel_residual=True needs norm_placement='pre'"):
        _cfg("sandwich", "none", parallel_residual=True)
    with pytest.raises(ValueError, match="folded_ln=True needs a pre-norm model"):
        _cfg("post", "none", folded_ln=True)


@pytest.mark.parametrize("placement", ["sandwich", "reordered"])
def test_direct_logit_attribution_is_refused_with_output_norms(placement):
    """Heads are summed before ln1_post normalises them: a per-head share would be made up."""
    from workbench.analysis import direct_logit_attribution

    model = _randomised(_cfg(placement, "none"))
    with pytest.raises(ValueError, match=f"needs norm_placement='pre'.*\\({placement}\\)"):
        direct_logit_attribution(model, torch.zeros(1, 3, dtype=torch.long), 1)


@pytest.mark.parametrize("mode,kv", [("head", 4), ("projection", 2)])
def test_qk_circuit_includes_the_qk_norm_gains(mode, kv):
    """The scores equal ln1(x) QK ln1(x)^T / sqrt(d_head), each query's and key's 1/rms applied by
    hand (no rotation here: positional='none'), for random non-unit gains."""
    model = wb.HookedDecoder(tiny(qk_norm=mode, n_kv_heads=kv, positional="none", norm="rmsnorm")).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in model.blocks:
            for norm in (block.attn.q_norm, block.attn.k_norm):
                norm.w.copy_(1 + 0.5 * torch.randn(norm.w.shape, generator=gen))
            block.attn.b_Q.zero_()  # the QK circuit is the weights' (TransformerLens' convention)
            block.attn._b_K.zero_()
    tokens = torch.randint(0, 50, (1, 6), generator=gen)
    _, cache = model.run_with_cache(tokens)
    layer, eps = 1, model.cfg.norm_eps
    x = model.blocks[layer].ln1(cache[f"blocks.{layer}.hook_resid_pre"])[0]  # [pos, d_model]
    q, k = cache[f"blocks.{layer}.attn.hook_q"][0], cache[f"blocks.{layer}.attn.hook_k"][0]  # [pos, heads, d_head]
    if mode == "projection":
        q, k = q.flatten(-2)[:, None], k.flatten(-2)[:, None]
    inv_q = q.pow(2).mean(-1).add(eps).rsqrt()  # [pos, 1 or heads]
    inv_k = k.pow(2).mean(-1).add(eps).rsqrt()
    if mode == "head" and kv != model.cfg.n_heads:
        inv_k = inv_k.repeat_interleave(model.cfg.n_heads // kv, dim=1)
    QK = model.QK[layer].AB  # [heads, d_model, d_model]
    bilinear = torch.einsum("qd,hde,ke->hqk", x, QK, x)
    expected = bilinear * inv_q.T[:, :, None] * inv_k.T[:, None, :] / model.cfg.d_head ** 0.5
    scores = cache[f"blocks.{layer}.attn.hook_attn_scores"][0]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(scores[:, causal], expected.expand_as(scores)[:, causal], atol=1e-4, rtol=1e-4)
