"""Probes: a direction planted in the embeddings is recovered (cosine > 0.9) while the shuffled-label
control sits at chance; labels unrelated to the activations give an AUC interval around 0.5; the
rank AUC equals a pairwise count; the fits satisfy their own optimality conditions and match
least squares; labels from columns, predicates and padded batches agree; bad labels are refused."""

import numpy as np
import pandas as pd
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench import analysis as an
from workbench.tokenizer import CharTokenizer

CLASS = set(range(0, 200, 2))


@pytest.fixture(scope="module")
def planted():
    """A tiny RoPE model whose even tokens' embeddings are shifted along a known unit vector."""
    torch.manual_seed(0)
    model = wb.HookedDecoder(tiny(positional="rope", d_vocab=200, n_ctx=32)).eval()
    gen = torch.Generator().manual_seed(1)
    planted = torch.randn(32, generator=gen)
    planted /= planted.norm()
    with torch.no_grad():
        model.embed.W_E[sorted(CLASS)] += 0.2 * planted
    return model, planted, torch.randint(0, 200, (48, 10), generator=gen)


def is_even(token: str) -> bool:
    return int(token) in CLASS


def test_planted_direction_is_recovered_and_the_control_is_at_chance(planted):
    model, direction, tokens = planted
    probe = an.train_probe(model, tokens, is_even, hooks="every resid_pre", n_boot=100)
    table = probe.results
    assert table.layer.tolist() == [0, 1]
    assert table.hook.tolist() == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    assert (table.n_test % 10 == 0).all() and (table.n_train + table.n_test == 480).all()  # split by prompt
    assert (table.acc > 0.95).all() and (table.auc > 0.98).all()
    assert (table.acc_lo <= table.acc).all() and (table.acc <= table.acc_hi).all()
    assert (table.control_auc - 0.5).abs().max() < 0.12 and (table.control_acc < 0.65).all()
    assert (table.selectivity > 0.3).all()
    found = probe.direction(layer=0)
    assert found.provenance["kind"] == "probe" and found.hook == "blocks.0.hook_resid_pre"
    assert float(found.vector @ direction) > 0.9
    assert float(probe.direction(layer=1).vector @ direction) > 0.9
    linear = an.train_probe(model, tokens, is_even, hooks="blocks.0.hook_resid_pre", kind="linear", n_boot=20)
    # least squares whitens by the sample covariance of only 200 token types in 32 dimensions,
    # which tilts its normal more than the regularised logistic fit's; a random vector scores ~0.2
    assert linear.results.acc.iloc[0] > 0.95 and float(linear.direction(layer=0).vector @ direction) > 0.8


def test_labels_unrelated_to_the_activations_score_chance(planted):
    model, _, tokens = planted
    labels = torch.randint(0, 2, (48,), generator=torch.Generator().manual_seed(5))  # one per prompt
    table = an.train_probe(model, tokens, labels, hooks="blocks.1.hook_resid_post", test_fraction=0.5).results
    assert table.auc_lo.iloc[0] < 0.5 < table.auc_hi.iloc[0] or abs(table.auc.iloc[0] - 0.5) < 0.1


def test_type_control_is_learnable_by_token_identity(planted):
    model, _, tokens = planted
    table = an.train_probe(model, tokens, is_even, hooks="blocks.0.hook_resid_pre", control="type", n_boot=20).results
    # a random label per token type is partly memorisable from the embedding: above chance, below the task
    assert 0.5 < table.control_auc.iloc[0] < table.auc.iloc[0]


def test_rank_auc_equals_the_pairwise_count_with_ties():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (40,), generator=gen).float()  # many ties
    labels = torch.randint(0, 2, (40,), generator=gen)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()).mean()
    assert float(an.auc(scores, labels)) == pytest.approx(float(pairwise), abs=1e-12)
    counts = torch.randint(0, 3, (2, 40), generator=gen)  # weighted = the examples repeated
    for row in range(2):
        repeated = torch.repeat_interleave(torch.arange(40), counts[row])
        expected = float(an.auc(scores[repeated], labels[repeated]))
        assert float(an.auc(scores, labels, counts.double())[row]) == pytest.approx(expected, abs=1e-12)


def test_fits_meet_their_optimality_conditions():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=gen) * torch.linspace(0.5, 3, 8) + 1.0
    y = ((x @ torch.randn(8, generator=gen) + 0.5 * torch.randn(300, generator=gen)) > 0).long()
    w, b = an.fit_probe(x, y, "linear", l2=0.0)
    design = np.c_[x.numpy(), np.ones(300)]
    expected = np.linalg.lstsq(design.astype(np.float64), 2.0 * y.numpy() - 1, rcond=None)[0]
    np.testing.assert_allclose(np.r_[w.numpy(), b], expected, rtol=1e-4, atol=1e-5)
    # logistic: the gradient of the objective it minimises (penalty on the RMS-scaled weights) is zero
    l2 = 0.05
    w, b = an.fit_probe(x, y, "logistic", l2=l2)
    xd = x.double()
    scale2 = (xd - xd.mean(0)).pow(2).mean()
    wt = w.double().clone().requires_grad_(True)
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(xd @ wt + bt, y.double())
    loss = loss + 0.5 * l2 * scale2 * (wt @ wt)
    loss.backward()
    assert wt.grad.abs().max() < 1e-5 and abs(float(bt.grad)) < 1e-5


def test_labels_from_columns_predicates_and_padded_batches_agree():
    tok = CharTokenizer("abcdefgh ")
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size), tokenizer=tok).eval()
    gen = torch.Generator().manual_seed(0)
    texts = ["".join("abcdefgh "[i] for i in torch.randint(0, 9, (int(n),), generator=gen)) for n in
             torch.randint(4, 9, (40,), generator=gen)]
    vowel = lambda t: t in "ae"  # noqa: E731
    by_predicate = an.train_probe(model, texts, vowel, hooks="every resid_post", n_boot=20).results
    frame = pd.DataFrame({"text": texts, "is_vowel": [[c in "ae" for c in t] for t in texts]})
    by_column = an.train_probe(model, frame, "is_vowel", hooks="every resid_post", n_boot=20).results
    pd.testing.assert_frame_equal(by_predicate, by_column)
    width = max(len(t) for t in texts)
    padded = torch.zeros(40, width, dtype=torch.long)
    mask = torch.zeros(40, width, dtype=torch.bool)
    labels = torch.full((40, width), -1)
    for i, t in enumerate(texts):
        padded[i, :len(t)], mask[i, :len(t)] = torch.tensor(tok.encode(t)), True
        labels[i, :len(t)] = torch.tensor([c in "ae" for c in t])
    by_mask = an.train_probe(model, padded, labels, hooks="every resid_post", mask=mask, n_boot=20).results
    pd.testing.assert_frame_equal(by_predicate, by_mask, check_exact=False, rtol=1e-5)
    frame["ends_in_vowel"] = [t[-1] in "ae" for t in texts]  # one label per prompt, read at its last token
    last = an.train_probe(model, frame, "ends_in_vowel", hooks="every resid_post", n_boot=20).results
    assert (last.n_train + last.n_test == 40).all()


def test_bad_labels_and_arguments_are_refused(planted):
    model, _, tokens = planted
    with pytest.raises(ValueError, match="one class only"):
        an.train_probe(model, tokens, torch.ones(48, dtype=torch.long))
    with pytest.raises(ValueError, match="0/1"):
        an.train_probe(model, tokens, torch.full((48,), 2))
    with pytest.raises(ValueError, match="not a column"):
        an.train_probe(model, pd.DataFrame({"tokens": tokens.tolist(), "y": [0, 1] * 24}), "is_name")
    with pytest.raises(ValueError, match="not a hook"):
        an.train_probe(model, tokens, is_even, hooks="every resid_final")
    with pytest.raises(ValueError, match="test_fraction"):
        an.train_probe(model, tokens, is_even, test_fraction=1.5)
    with pytest.raises(ValueError, match="48 prompts"):
        an.train_probe(model, tokens, torch.ones(47, dtype=torch.long))
    probe = an.train_probe(model, tokens, is_even, hooks=["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid"],
                           n_boot=10, control=None)
    with pytest.raises(ValueError, match="pass hook="):
        probe.direction(layer=0)
    assert probe.direction(hook="blocks.0.hook_resid_mid").hook == "blocks.0.hook_resid_mid"
    assert "control_acc" not in probe.results.columns
