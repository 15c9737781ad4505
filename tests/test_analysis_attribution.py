"""Direct logit attribution: the parts sum to the model's own logit difference, and the
head parts equal TransformerLens' stack_head_results + logit_attrs."""

import numpy as np
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import direct_logit_attribution

VARIANTS = [{}, {"norm": "rmsnorm", "positional": "rope", "ffn": "swiglu"}, {"norm": "none"},
            {"parallel_residual": True}, {"attn_only": True}, {"n_kv_heads": 2, "positional": "alibi"}]


@pytest.mark.parametrize("kw", VARIANTS)
def test_parts_sum_to_the_logit_difference(kw):
    model = wb.HookedDecoder(tiny(**kw)).eval()
    with torch.no_grad():  # a trained-looking final norm, so its scale and bias both matter
        model.ln_final.w.mul_(torch.rand(32) + 0.5) if hasattr(model.ln_final, "w") else None
        model.ln_final.b.add_(torch.randn(32)) if hasattr(model.ln_final, "b") else None
        for block in model.blocks:
            block.attn.b_O.add_(0.1 * torch.randn(32))
    tokens = torch.randint(0, 50, (3, 8))
    answer, wrong = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    table = direct_logit_attribution(model, tokens, answer, wrong, pos=5)
    with torch.no_grad():
        logits = model(tokens)[:, 5]
    expected = (logits[torch.arange(3), answer] - logits[torch.arange(3), wrong]).numpy()
    sums = table.groupby(["granularity", "batch"]).attribution.sum()
    for granularity in ("head", "layer"):
        np.testing.assert_allclose(sums[granularity].to_numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(table.groupby("batch").total.first(), expected, rtol=1e-6)
    heads = table[(table.granularity == "head") & (table.kind == "head")]
    assert len(heads) == 3 * model.cfg.n_layers * model.cfg.n_heads


def test_single_answer_logit_and_embed_row():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (1, 6))
    table = direct_logit_attribution(model, tokens, 7)
    with torch.no_grad():
        logit = float(model(tokens)[0, -1, 7])
    assert table[table.granularity == "layer"].attribution.sum() == pytest.approx(logit, rel=1e-4, abs=1e-5)
    assert set(table.component) >= {"embed", "pos_embed", "final_bias", "L0H0", "L1 mlp", "L1 attn"}


def test_heads_agree_with_transformer_lens_logit_attrs():
    model = wb.HookedDecoder(tiny()).eval()  # untrained: final norm weight 1, bias 0, as TL folds them
    tokens = torch.randint(0, 50, (2, 7))
    answer, wrong = torch.tensor([3, 9]), torch.tensor([11, 4])
    table = direct_logit_attribution(model, tokens, answer, wrong, pos=-1)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        stack = cache.stack_head_results(layer=-1, pos_slice=-1)  # [layer*head, batch, d_model]
        tl = cache.logit_attrs(stack, tokens=answer, incorrect_tokens=wrong, pos_slice=-1)
        parts, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
        tl_layers = cache.logit_attrs(parts, tokens=answer, incorrect_tokens=wrong, pos_slice=-1)
    ours = table[(table.granularity == "head") & (table.kind == "head")]
    for b in range(2):
        np.testing.assert_allclose(ours[ours.batch == b].attribution, tl[:, b].numpy(), rtol=1e-4, atol=1e-6)
    by_name = {"embed": "embed", "pos_embed": "pos_embed", **{f"{l}_attn_out": f"L{l[0]} attn" for l in ["0", "1"]},
               **{f"{l}_mlp_out": f"L{l[0]} mlp" for l in ["0", "1"]}}
    layer_rows = table[table.granularity == "layer"].set_index(["batch", "component"]).attribution
    for i, label in enumerate(labels):
        for b in range(2):
            assert layer_rows[b, by_name[label]] == pytest.approx(float(tl_layers[i, b]), rel=1e-4, abs=1e-6)


def test_post_norm_and_bad_answers_are_refused():
    with pytest.raises(ValueError, match="pre"):
        direct_logit_attribution(wb.HookedDecoder(tiny(norm_placement="post")), torch.zeros(1, 3, dtype=torch.long), 1)
    with pytest.raises((ValueError, TypeError), match="batch"):  # jaxtyping checks first under pytest
        direct_logit_attribution(wb.HookedDecoder(tiny()), torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 2, 3]))
