"""The vocabulary tables: direct path against a hand-written embed -> norm -> unembed, neighbours
against torch's cosine similarity, and clear errors."""

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.analysis import direct_path, token_neighbours, vocabulary_table
from workbench.tokenizer import WordTokenizer


@pytest.fixture(params=["layernorm", "rmsnorm", "rmsnorm-scaled"])
def model(request):
    tok = WordTokenizer.from_text("Mary John gave a drink to the store went and")
    # Gemma's sqrt(d_model) embedding scale, with an epsilon large enough for the scale to matter
    scaled = dict(scale_embeddings=True, norm_eps=0.05) if request.param.endswith("scaled") else {}
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, norm=request.param.split("-")[0], tie_embeddings=False,
                                  seed=3, **scaled), tokenizer=tok).eval()
    with torch.no_grad():  # a final norm that is not the identity at init
        for p in model.ln_final.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _reference(model):
    W_E, W_U = model.embed.W_E.detach(), model.unembed.W_U.detach()
    if model.cfg.scale_embeddings:
        W_E = W_E * model.cfg.d_model ** 0.5
    if model.cfg.norm == "layernorm":
        x = torch.nn.functional.layer_norm(W_E, (W_E.shape[-1],), model.ln_final.w.detach(), model.ln_final.b.detach(),
                                           eps=model.cfg.norm_eps)
    else:
        x = torch.nn.functional.rms_norm(W_E, (W_E.shape[-1],), model.ln_final.w.detach(), eps=model.cfg.norm_eps)
    return x @ W_U


def test_direct_path_matches_a_hand_written_one(model):
    ref = _reference(model)
    table = vocabulary_table(model, k=2)
    assert len(table) == model.cfg.d_vocab
    torch.testing.assert_close(torch.tensor(table.direct_logit.values), ref.max(-1).values, rtol=1e-5, atol=1e-5)
    mary = model.tokenizer.encode("Mary")[0]
    path = direct_path(model, "Mary", k=3)
    top, bottom = path[path.side == "top"], path[path.side == "bottom"]
    assert top.id.tolist() == ref[mary].topk(3).indices.tolist()
    assert bottom.id.tolist() == ref[mary].topk(3, largest=False).indices.tolist()
    torch.testing.assert_close(torch.tensor(top.centred_logit.values),
                               (ref[mary] - ref[mary].mean())[top.id.tolist()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("space", ["embed", "unembed"])
def test_neighbours_are_the_nearest_by_cosine(model, space):
    vectors = model.embed.W_E.detach() if space == "embed" else model.unembed.W_U.detach().T
    i = 2
    sims = torch.nn.functional.cosine_similarity(vectors, vectors[i][None], dim=-1)
    sims[i] = -2
    got = token_neighbours(model, i, k=4, space=space)
    assert got.id.tolist() == sims.topk(4).indices.tolist()
    assert i not in got.id.tolist()
    torch.testing.assert_close(torch.tensor(got.cosine.values), sims.topk(4).values, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named(model):
    with pytest.raises(ValueError, match="not one"):
        direct_path(model, "Mary John")
    with pytest.raises(ValueError, match="token"):
        token_neighbours(model, model.cfg.d_vocab)
    with pytest.raises(ValueError, match="space"):
        token_neighbours(model, 0, space="middle")


def test_the_figures_draw_the_tables(model):
    from workbench import viz

    path = direct_path(model, "Mary", k=3)
    fig = viz.direct_path_figure(path, "Mary")
    assert sorted(fig.data[0].x) == sorted(path.centred_logit)
    near = token_neighbours(model, "Mary", k=4, space="unembed")
    fig = viz.neighbours_figure(near, "Mary", "unembed")
    assert list(fig.data[0].x) == sorted(near.cosine) and "unembedding" in fig.layout.title.text
