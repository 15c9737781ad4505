"""Gemma's components as registry choices: soft-capping, query_pre_attn_scalar, per-layer sliding
windows, the (1 + w) RMSNorm, scaled embeddings, GeGLU with tanh GELU, a local RoPE base.

References, independent of the workbench's modules: a plain-torch forward written here from the
formulas (a Python-loop mask, RoPE from its definition), and transformers' own Gemma modules
(``Gemma2RMSNorm``, ``Gemma2MLP``, ``ACT2FN["gelu_pytorch_tanh"]``). Then padding parity, KV-cache
decoding against recompute, save/load, weight folding, and one clear error per bad field.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from factories import tiny
from workbench.padding import TokenBatch

TOL = dict(atol=1e-5, rtol=1e-5)

GEMMA = dict(
    norm="gemma_rmsnorm", positional="rope", ffn="geglu_tanh", bias=False, n_kv_heads=2, n_layers=4,
    attn_logit_softcap=4.0, final_logit_softcap=3.0, query_pre_attn_scalar=5.0, sliding_window=3, global_every=2,
    rope_local_base=100.0, rope_base=10000.0, scale_embeddings=True, init_std=0.3, norm_eps=1e-6,
)
CASES = {
    "gemma3-like": {},
    "gemma2-like": dict(rope_local_base=None),
    "fused-window": dict(attn_logit_softcap=None),  # no soft-cap: the SDPA path with a window mask
    "every-layer-local": dict(global_every=0, rope_local_base=None, attn_logit_softcap=None),
    "window-only": dict(norm="rmsnorm", ffn="swiglu", attn_logit_softcap=None, final_logit_softcap=None,
                        query_pre_attn_scalar=None, rope_local_base=None, scale_embeddings=False),
    "softcap-alibi": dict(positional="alibi", rope_local_base=None, n_kv_heads=4),
}


def _cfg(case: str, **extra):
    return tiny(**{**GEMMA, **CASES[case], **extra})


def _model(case: str, **extra):
    model = wb.HookedDecoder(_cfg(case, **extra)).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the (1 + w) norms start at zero offset: give them something to scale by
        for name, p in model.named_parameters():
            if name.endswith(("w_offset", ".w")):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


# ---- the plain-torch reference --------------------------------------------------------------------
def _ref_norm(cfg, norm, x):
    xf = x.float()
    if cfg.norm == "gemma_rmsnorm":
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * (1 + norm.w_offset.float())).to(x.dtype)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * norm.w


def _ref_rope(x, base):  # x [pos, head, d]: rotate halves by position * base^(-2i/d)
    pos, d = x.shape[0], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(pos).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _ref_alibi_slopes(n):  # Press et al. for a power of two: 2^(-8/n), 2^(-16/n), ...
    return torch.tensor([2 ** (-8 * (i + 1) / n) for i in range(n)])


def reference_logits(model, tokens):
    """One unpadded sequence [pos] -> logits [pos, vocab], from the formulas (no workbench module runs)."""
    cfg = model.cfg
    n = tokens.shape[0]
    x = model.embed.W_E[tokens]
    if cfg.scale_embeddings:
        x = x * torch.tensor(math.sqrt(cfg.d_model), dtype=x.dtype)
    for layer, block in enumerate(model.blocks):
        a = block.attn
        h = _ref_norm(cfg, block.ln1, x)
        q = torch.einsum("pd,hde->phe", h, a.W_Q)
        k = torch.einsum("pd,hde->phe", h, a.W_K)
        v = torch.einsum("pd,hde->phe", h, a.W_V)
        local = cfg.sliding_window is not None and (cfg.global_every == 0 or (layer + 1) % cfg.global_every != 0)
        if cfg.positional == "rope":
            base = cfg.rope_local_base if local and cfg.rope_local_base is not None else cfg.rope_base
            q, k = _ref_rope(q, base), _ref_rope(k, base)
        scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.d_head
        scores = torch.einsum("qhe,khe->hqk", q, k) / math.sqrt(scalar)
        if cfg.attn_logit_softcap is not None:
            scores = cfg.attn_logit_softcap * torch.tanh(scores / cfg.attn_logit_softcap)
        if cfg.positional == "alibi":
            dist = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(max=0).float()
            scores = scores + _ref_alibi_slopes(cfg.n_heads)[:, None, None] * dist
        mask = torch.tensor([[j <= i and (not local or i - j < cfg.sliding_window) for j in range(n)] for i in range(n)])
        pattern = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        z = torch.einsum("hqk,khe->qhe", pattern, v)
        x = x + torch.einsum("qhe,hed->qd", z, a.W_O)
        h = _ref_norm(cfg, block.ln2, x)
        m = block.mlp
        act = F.gelu(h @ m.W_gate, approximate="tanh") if cfg.ffn == "geglu_tanh" else F.silu(h @ m.W_gate)
        x = x + (act * (h @ m.W_in)) @ m.W_out
    logits = _ref_norm(cfg, model.ln_final, x) @ model.W_U
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * torch.tanh(logits / cfg.final_logit_softcap)
    return logits


def _explicit(model, tokens, **kw):
    hooks = [(f"blocks.{b.layer}.attn.hook_pattern", lambda t, hook: t) for b in model.blocks]
    return model.run_with_hooks(tokens, fwd_hooks=hooks, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_the_plain_torch_reference_on_both_attention_paths(case):
    model = _model(case)
    tokens = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.stack([reference_logits(model, row) for row in tokens])
        torch.testing.assert_close(model(tokens), expected, **TOL)
        torch.testing.assert_close(_explicit(model, tokens), expected, **TOL)


def test_each_option_changes_the_logits():
    """Every option acts (so the equalities above mean something): turning one off moves the logits."""
    tokens = torch.randint(0, 50, (1, 11), generator=torch.Generator().manual_seed(1))
    base = _model("gemma3-like")
    with torch.no_grad():
        ref = base(tokens)
        for field, off in [("attn_logit_softcap", None), ("final_logit_softcap", None), ("query_pre_attn_scalar", None),
                           ("rope_local_base", None), ("scale_embeddings", False), ("global_every", 0)]:
            other = wb.HookedDecoder(base.cfg.replace(**{field: off})).eval()
            other.load_state_dict(base.state_dict())
            assert not torch.allclose(other(tokens), ref, atol=1e-3), field
        # the window itself: a window as long as the context cuts nothing
        wide = wb.HookedDecoder(base.cfg.replace(sliding_window=24)).eval()
        wide.load_state_dict(base.state_dict())
        assert not torch.allclose(wide(tokens), ref, atol=1e-3)
        assert torch.allclose(wide(tokens[:, :3]), ref[:, :3], atol=1e-6)  # within the window: the same


def test_local_and_global_layers_follow_transformers_layer_types():
    from transformers import Gemma2Config, Gemma3TextConfig

    for hf, every in ((Gemma2Config(num_hidden_layers=7), 2), (Gemma3TextConfig(num_hidden_layers=13), 6)):
        cfg = tiny(n_layers=hf.num_hidden_layers, sliding_window=4, global_every=every)
        ours = ["sliding_attention" if cfg.layer_is_local(i) else "full_attention" for i in range(cfg.n_layers)]
        assert ours == list(hf.layer_types)
    assert not any(tiny(sliding_window=None).layer_is_local(i) for i in range(2))


# ---- against transformers' own Gemma modules --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hooked", [False, True])
def test_gemma_rmsnorm_matches_transformers(dtype, hooked):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    cfg = tiny(norm="gemma_rmsnorm", norm_eps=1e-6)
    ours = wb.HookedDecoder(cfg).ln_final
    theirs = Gemma2RMSNorm(cfg.d_model, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ours.w_offset.copy_(torch.randn(cfg.d_model, generator=g))
        theirs.weight.copy_(ours.w_offset)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(2, 5, cfg.d_model, generator=g) * 3).to(dtype)
    if hooked:
        ours.hook_scale.add_hook(lambda t, hook: t)
    try:
        out = ours(x)
    finally:
        ours.hook_scale.remove_hooks()
    assert out.dtype == dtype
    tol = TOL if dtype == torch.float32 else dict(atol=0, rtol=0)  # bf16: the same single rounding
    torch.testing.assert_close(out, theirs(x), **tol)
    torch.testing.assert_close(ours.w, 1 + ours.w_offset)  # readers of .w see the scale


def test_geglu_tanh_matches_transformers_gemma_mlp():
    from transformers import Gemma2Config
    from transformers.activations import ACT2FN
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    assert ACT2FN["gelu_pytorch_tanh"](torch.tensor([0.7])).item() == F.gelu(torch.tensor([0.7]), approximate="tanh").item()
    cfg = tiny(ffn="geglu_tanh", bias=False, d_mlp=48)
    ours = wb.HookedDecoder(cfg).blocks[0].mlp
    theirs = Gemma2MLP(Gemma2Config(hidden_size=32, intermediate_size=48, hidden_activation="gelu_pytorch_tanh"))
    with torch.no_grad():
        theirs.gate_proj.weight.copy_(ours.W_gate.T)
        theirs.up_proj.weight.copy_(ours.W_in.T)
        theirs.down_proj.weight.copy_(ours.W_out.T)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    assert cfg.gated_mlp and cfg.act_fn == "gelu_pytorch_tanh"


def test_scaled_embedding_rounds_the_factor_to_the_weights_dtype():
    cfg = tiny(d_model=3072, n_heads=4, d_mlp=8, scale_embeddings=True, n_layers=1)
    model = wb.HookedDecoder(cfg).to(torch.bfloat16)
    tokens = torch.tensor([[1, 2, 3]])
    factor = torch.tensor(3072**0.5, dtype=torch.bfloat16)
    assert factor.item() == 55.5  # the rounding HF's comment describes
    torch.testing.assert_close(model.embed(tokens), model.W_E[tokens] * factor, atol=0, rtol=0)


# ---- padding, KV cache, save/load, folding ------------------------------------------------------------
@pytest.mark.parametrize("case", ["gemma3-like", "fused-window", "softcap-alibi"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_their_prompts_alone(case, side):
    model = _model(case)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (7, 2, 11, 5)]
    batch = TokenBatch.from_ids(rows, pad_id=0, padding_side=side)
    with torch.no_grad():
        packed = model(batch)  # no hooks: pads are packed away
        explicit = _explicit(model, batch)
        for i, row in enumerate(rows):
            alone = model(torch.tensor([row]))[0]
            cols = batch.attention_mask[i].bool()
            torch.testing.assert_close(packed[i][cols], alone, **TOL)
            torch.testing.assert_close(explicit[i][cols], alone, **TOL)


@pytest.mark.parametrize("case", ["gemma3-like", "fused-window", "every-layer-local", "softcap-alibi"])
def test_kv_cache_decoding_equals_recompute(case):
    model = _model(case)
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(3))
    cached = model.generate(prompt, max_new_tokens=10)
    assert cached.equal(model.generate(prompt, max_new_tokens=10, use_kv_cache=False))
    with torch.no_grad():  # each decode step's logits equal the full forward's, past the window too
        full = model(cached)
        cache = model.make_kv_cache(2, cached.shape[1])
        steps = [model(cached[:, :4], kv_cache=cache)]
        steps += [model(cached[:, i : i + 1], kv_cache=cache) for i in range(4, cached.shape[1])]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
    # a left-padded batch decodes as its rows alone
    batch = TokenBatch.from_ids([[5, 6, 7, 8, 9], [3, 4]], padding_side="left")
    out = model.generate(batch, max_new_tokens=8)
    for i, row in enumerate(([5, 6, 7, 8, 9], [3, 4])):
        alone = model.generate(torch.tensor([row]), max_new_tokens=8)[0]
        assert out.tokens[i][out.attention_mask[i].bool()].equal(alone)


def test_save_and_load_keep_every_option(tmp_path):
    model = _model("gemma3-like")
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    wb.save_checkpoint(model, tmp_path / "m")
    loaded = wb.load_checkpoint(tmp_path / "m")[0].eval()
    assert loaded.cfg == model.cfg
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), atol=0, rtol=0)
    assert wb.ModelConfig.from_json(model.cfg.to_json()) == model.cfg


def test_fold_ln_folds_the_one_plus_w_scale():
    model = _model("gemma2-like")
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(tokens)
        model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False, fold_value_biases=True)
        torch.testing.assert_close(model(tokens), before, **TOL)
    assert model.cfg.folded_ln and model.cfg.normalization_type == "RMSPre"
    with pytest.raises(ValueError, match="center_unembed=True.*final_logit_softcap"):
        _model("gemma2-like").process_weights(center_unembed=True)


def test_run_with_cache_sees_capped_scores_and_windowed_patterns():
    model = _model("gemma3-like")
    tokens = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(7))
    _, cache = model.run_with_cache(tokens)
    scores, pattern = cache["blocks.0.attn.hook_attn_scores"], cache["blocks.0.attn.hook_pattern"]
    finite = scores[scores.isfinite()]
    assert finite.abs().max() <= model.cfg.attn_logit_softcap
    assert pattern[0, :, 7, :5].abs().max() == 0  # layer 0 is local (window 3): keys 0..4 unseen from 7
    assert (cache["blocks.1.attn.hook_pattern"][0, :, 7, :5] > 0).all()  # layer 1 is global


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(attn_logit_softcap=0.0), "attn_logit_softcap must be a finite number > 0"),
    (dict(final_logit_softcap=-1.0), "final_logit_softcap must be a finite number > 0"),
    (dict(query_pre_attn_scalar=float("inf")), "query_pre_attn_scalar must be a finite number"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1"),
    (dict(sliding_window=4, global_every=-1), "global_every must be an integer >= 0"),
    (dict(global_every=2), "global_every=2 needs sliding_window"),
    (dict(rope_local_base=100.0, sliding_window=4), "rope_local_base=100.0 needs positional='rope'"),
    (dict(rope_local_base=1.0, sliding_window=4, positional="rope"), "rope_local_base must be a finite number > 1"),
    (dict(norm="gemma"), "ModelConfig.norm='gemma' is not a valid choice"),
    (dict(scale_embeddings=1), "scale_embeddings must be true or false"),
])
def test_bad_fields_raise_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        tiny(**fields)
