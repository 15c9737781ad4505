"""The machinery of experiments/real_induction.py on small models, against independent references
(``k_composition`` and ``copying_scores`` live in workbench.analysis.composition): the key-side K-composition split against ``an.qk_attribution`` on the hand-written induction model,
its OV copying score against the eigenvalues of the full vocabulary-sized OV circuit, and its
second-copy loss metric against the model's own per-token loss."""

import sys
from pathlib import Path

import pytest
import torch

from workbench import analysis as an
from workbench.planted.hand import BOS, build_hand_induction

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import real_induction as ri  # noqa: E402


def test_k_composition_matches_qk_attribution_summed_over_the_query_side():
    model = build_hand_induction()  # attention-only: L0 H0 is its previous-token head, L1 H0 its induction head
    tokens = torch.tensor([[BOS, 3, 9, 4, 7, 3, 9, 4, 7]])  # [BOS, r, r], |r| = 4
    ours = an.k_composition(model, tokens, half=4, heads=[(1, 0)], prefix=1).set_index("source")
    graph = an.attribution_graph(model, None, tokens)
    entries = [(key + 3, key) for key in range(2, 5)]  # query n + j attends key j + 1 (after the BOS)
    frames = [an.qk_attribution(graph, 1, 0, q, k, top=None) for q, k in entries]
    scores = [f.attrs["score"] for f in frames]
    assert ours["score"].iloc[0] == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    assert ours["residual"].max() < 1e-4  # the parts sum to the score
    for head in range(model.cfg.n_heads):
        reference = sum(f.loc[f.key_unit == f"L0 H{head}", "contribution"].sum() for f in frames) / len(frames)
        assert ours.loc[f"L0H{head}", "contribution"] == pytest.approx(reference, abs=1e-4)
    # the previous-token head carries the induction head's key: the largest part
    assert ours["contribution"].drop(["bias"]).idxmax() == "L0H0"


def test_k_composition_parts_sum_to_the_score_with_rope_gqa_and_mlps():
    model = ri.tiny_model(0)
    tokens = an.repeated_random_tokens(model, 10, 3, seed=1)
    frame = an.k_composition(model, tokens, half=10, heads=[(1, 3), (0, 1)])
    assert frame["residual"].max() < 1e-5
    for (_, _), part in frame.groupby(["layer", "head"]):
        assert part["contribution"].sum() == pytest.approx(part["score"].iloc[0], abs=1e-5)
    assert {"L0H0", "L0 MLP", "embed"} <= set(frame.query("layer == 1").source)


@torch.no_grad()
def test_copying_score_is_that_of_the_full_ov_circuit():
    model = ri.tiny_model(2)
    ours = an.copying_scores(model).set_index(["layer", "head"])
    W_E, W_U = model.W_E.double(), model.W_U.double()
    for layer, block in enumerate(model.blocks):
        for head in range(model.cfg.n_heads):
            full = (W_E * block.ln1.w.double()) @ block.attn.W_V[head].double() @ block.attn.W_O[head].double() \
                @ (model.ln_final.w.double()[:, None] * W_U)  # [d_vocab, d_vocab]
            eig = torch.linalg.eigvals(full)
            reference = float(eig.sum().real / eig.abs().sum())
            assert ours.loc[(layer, head), "copying"] == pytest.approx(reference, rel=1e-6, abs=1e-9)


def test_repeated_half_loss_is_the_models_own_loss_on_the_second_copy():
    model = ri.tiny_model(3)
    tokens = an.repeated_random_tokens(model, 8, 2, seed=0)
    with torch.no_grad():
        logits = model(tokens)
        per_token = model(tokens, return_type="loss", loss_per_token=True)
    assert float(ri.repeated_half_loss(8)(logits, tokens)) == pytest.approx(float(per_token[:, 8:].mean()), rel=1e-5)
    first, second = ri.copy_losses(model, tokens, 8)
    assert first == pytest.approx(float(per_token[:, :7].mean()), rel=1e-6)
    assert second == pytest.approx(float(per_token[:, 8:].mean()), rel=1e-6)


@pytest.mark.parametrize("which", ["hand", "rope-gqa-swiglu"])
def test_qk_pairs_are_qk_attribution_averaged_over_the_designed_entries(which):
    """Both sides split, against the library's QK attribution: on the hand-written induction model (attention
    only: a graph without transcoders) and on a random RoPE + GQA + SwiGLU model through transcoders with no
    active feature, whose graph's error nodes are the MLPs' whole outputs."""
    if which == "hand":
        model, half, prefix, head = build_hand_induction(), 4, 1, (1, 0)
        tokens = torch.tensor([[BOS, 3, 9, 4, 7, 3, 9, 4, 7]])
        graph = an.attribution_graph(model, None, tokens)
    else:
        model, half, prefix, head = ri.tiny_model(4), 8, 0, (1, 3)
        tokens = an.repeated_random_tokens(model, half, 1, seed=2)
        graph = an.attribution_graph(model, ri.empty_transcoders(model), tokens, max_feature_nodes=0)
        assert graph.nodes_of("feature").numel() == 0
    labels, pairs, score, residual = ri.qk_pairs(model, tokens, half, [head], prefix=prefix)[head]
    assert residual < 1e-4
    entries = [(key + half - 1, key) for key in range(prefix + 1, prefix + half)]
    frames = [an.qk_attribution(graph, *head, q, k, top=None, exact=0) for q, k in entries]
    assert score == pytest.approx(sum(f.attrs["score"] for f in frames) / len(frames), abs=1e-4)
    reference = torch.zeros_like(pairs)
    index = {label: i for i, label in enumerate(labels)}
    for f in frames:
        for r in f.itertuples(index=False):
            reference[index[ri._our_label(r.query_unit)], index[ri._our_label(r.key_unit)]] += r.contribution
    reference /= len(frames)
    scale = float(reference.abs().max())
    assert scale > 1e-4  # not a table of zeros (a random model's scores are small)
    assert torch.allclose(pairs, reference, atol=1e-4 * scale), float((pairs - reference).abs().max()) / scale
    if which == "hand":  # the planted pair: the token at the query, the previous-token head at the key
        i, j = divmod(int(pairs.abs().argmax()), pairs.shape[1])
        assert (labels[i], labels[j]) == ("embed", "L0H0")
    # the key-side marginal is the K-composition split
    kcomp = an.k_composition(model, tokens, half, [head], prefix=prefix).set_index("source")["contribution"]
    for label, value in zip(labels, pairs.sum(0).tolist()):
        assert value == pytest.approx(kcomp[label], abs=1e-4 * scale)


def test_k_composition_refuses_tokens_too_short_and_heads_the_model_lacks():
    model = ri.tiny_model(0)
    tokens = an.repeated_random_tokens(model, 6, 1, seed=0)
    with pytest.raises(ValueError, match=r"tokens \[batch, prefix \+ 2 \* half\]"):
        an.k_composition(model, tokens, half=7, heads=[(1, 0)])
    with pytest.raises(ValueError, match=r"head \(2, 0\) is not in this model \(2 layers x 4 heads\)"):
        an.k_composition(model, tokens, half=6, heads=[(2, 0)])
