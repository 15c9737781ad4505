"""TransformerLens-style weight properties of an MLA model (W_V, OV, W_Q_nope, W_K_nope, QK_nope)
against the MLA equations written out here in torch from the module's raw weights, and one clear
error for the ones with no fixed matrix (W_K, QK: the RoPE key is rotated by its position)."""

import pytest
import torch
from factories import tiny
from test_mla import _model, _tokens

import workbench as wb

TOL = dict(atol=1e-5, rtol=1e-5)
CASES = {"plain": dict(bias=False), "q-compressed": dict(q_lora_rank=12, bias=False)}


def _latent_rms(y: torch.Tensor, eps: float) -> torch.Tensor:
    return (y.pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("case", list(CASES))
def test_effective_weights_reproduce_the_heads_up_to_the_latent_rms(case):
    model, tokens = _model(**CASES[case]), _tokens()
    _, cache = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        attn, nope = model.blocks[layer].attn, model.cfg.qk_nope_head_dim
        x = model.blocks[layer].ln1(cache[f"blocks.{layer}.hook_resid_pre"]).detach()  # what attention reads
        # By hand: the latent before its norm, and its per-token 1/rms (the factor no matrix holds)
        rms = _latent_rms(x @ attn.W_DKV + attn.b_DKV, attn.kv_norm.eps)
        with torch.no_grad():
            W_V, W_K, W_Q = model.W_V[layer], model.W_K_nope[layer], model.W_Q_nope[layer]
            by_hand_V = torch.stack([attn.W_DKV @ torch.diag(attn.kv_norm.w) @ attn.W_UV[h] for h in range(4)])
            torch.testing.assert_close(W_V, by_hand_V, **TOL)
            v = torch.einsum("bpd,hde->bphe", x, W_V) / rms[:, :, None]
            torch.testing.assert_close(v, cache[f"blocks.{layer}.attn.hook_v"], **TOL)
            k_nope = torch.einsum("bpd,hde->bphe", x, W_K) / rms[:, :, None]
            torch.testing.assert_close(k_nope, cache[f"blocks.{layer}.attn.hook_k"][..., :nope], **TOL)
            q_nope = torch.einsum("bpd,hde->bphe", x, W_Q)
            if model.cfg.q_lora_rank is None:
                q_nope = q_nope + attn.b_Q[:, :nope]
            else:
                q_nope = q_nope / _latent_rms(x @ attn.W_DQ + attn.b_DQ, attn.q_norm.eps)[:, :, None]
            torch.testing.assert_close(q_nope, cache[f"blocks.{layer}.attn.hook_q"][..., :nope], **TOL)
            # OV: each head's output is its pattern-weighted sum of (x_s OV / rms_s) over sources s
            OV = model.OV[layer].AB
            pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # [batch, head, query, key]
            result = torch.einsum("bhqk,bkd,hde->bqhe", pattern, x / rms, OV)
            _, cache_r = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_result"))
            torch.testing.assert_close(result, cache_r[f"blocks.{layer}.attn.hook_result"], **TOL)
            # QK_nope: the content part of the scores, q_nope . k_nope, before the 1/sqrt(d) scale
            scores = torch.einsum("bqhe,bkhe->bhqk", q_nope, k_nope)
            assert model.QK_nope[layer].AB.shape == (4, 32, 32)
            by_QK = torch.einsum("bqd,hde,bke->bhqk", x, model.QK_nope[layer].AB, x / rms)
            if model.cfg.q_lora_rank is None:
                by_QK = by_QK + torch.einsum("he,bkhe->bhk", attn.b_Q[:, :nope], k_nope)[:, :, None]
            else:
                by_QK = by_QK / _latent_rms(x @ attn.W_DQ + attn.b_DQ, attn.q_norm.eps)[:, None]
            torch.testing.assert_close(by_QK, scores, **TOL)


def test_w_k_and_qk_of_mla_raise_naming_rope_and_the_latent():
    model = _model(q_lora_rank=12)
    for name in ("W_K", "QK", "W_Q"):  # W_Q too: with query compression it is read from a normed latent
        with pytest.raises(NotImplementedError, match=r"multi-head latent attention.*RoPE.*W_K_nope"):
            getattr(model, name)
    assert model.W_V.shape == (2, 4, 32, model.cfg.d_head)  # what does exist, exists
    plain = _model()
    assert plain.W_Q.shape[-1] == plain.cfg.qk_nope_head_dim + plain.cfg.qk_rope_head_dim  # the real query map
    with pytest.raises(NotImplementedError, match="W_K"):
        _ = plain.W_K
    mha = wb.HookedDecoder(tiny())
    with pytest.raises(NotImplementedError, match="attention='mla'.*attention='mha'"):
        _ = mha.W_K_nope
    torch.testing.assert_close(mha.OV.AB, mha.W_V @ mha.W_O)  # MHA unchanged
