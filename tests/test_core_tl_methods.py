"""TransformerLens utilities that read our model's weights and cache, against direct computations."""

import torch
from transformer_lens import FactoredMatrix

import workbench as wb
from factories import tiny


def make(**kw):
    model = wb.HookedDecoder(tiny(n_kv_heads=2, tie_embeddings=False, **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_factored_qk_and_ov_circuits():
    model = make()
    assert isinstance(model.OV, FactoredMatrix) and model.OV.shape == (2, 4, 32, 32)
    l, h = 1, 3
    torch.testing.assert_close(model.OV[l, h].AB, model.blocks[l].attn.W_V[h] @ model.blocks[l].attn.W_O[h])
    torch.testing.assert_close(model.QK[l, h].AB, model.blocks[l].attn.W_Q[h] @ model.blocks[l].attn.W_K[h].T)
    assert model.W_K.shape == (2, 4, 32, 8)  # GQA keys repeated per query head


def test_tokens_to_residual_directions_and_logit_attrs():
    model = make()
    # TL's logit_attrs assumes the final norm's gain is folded into W_U (its fold_ln default);
    # workbench.analysis' DLA multiplies by the gain itself. Here: unit gain, so both agree.
    with torch.no_grad():
        model.ln_final.w.fill_(1.0)
    toks = torch.randint(0, 50, (3, 10))
    torch.testing.assert_close(model.tokens_to_residual_directions(7), model.W_U[:, 7])
    assert model.tokens_to_residual_directions(toks[:, -1]).shape == (3, 32)
    logits, cache = model.run_with_cache(toks)
    answer, wrong = toks[:, -1], (toks[:, -1] + 1) % 50
    # logit_attrs over the full decomposition (with the final norm's scale) sums to the logit difference
    stack, labels = cache.decompose_resid(return_labels=True)
    # logit_attrs divides by the final norm's cached scale itself
    attrs = cache.logit_attrs(stack[:, :, -1], tokens=answer, incorrect_tokens=wrong, pos_slice=-1)
    final = logits[:, -1]
    diff = final.gather(1, answer[:, None])[:, 0] - final.gather(1, wrong[:, None])[:, 0]
    # the final norm's bias is a constant direction outside the stack
    bias_part = (model.ln_final.b @ (model.W_U[:, answer] - model.W_U[:, wrong]))
    torch.testing.assert_close(attrs.sum(0) + bias_part, diff, atol=1e-4, rtol=1e-4)


def test_accumulated_bias():
    model = make()
    expected = model.blocks[0].attn.b_O + model.blocks[0].mlp.b_out + model.blocks[1].attn.b_O
    torch.testing.assert_close(model.accumulated_bias(1, mlp_input=True), expected)
