"""Generation: sampling controls, seeds, stop tokens, and clear errors for bad input."""

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.tokenizer import CharTokenizer


@pytest.fixture
def model():
    return wb.HookedDecoder(tiny(positional="rope", n_kv_heads=2)).eval()


def test_greedy_is_argmax_of_the_forward(model):
    prompt = torch.randint(0, 50, (3, 5))
    out = model.generate(prompt, max_new_tokens=4)
    assert out.shape == (3, 9) and torch.equal(out[:, :5], prompt)
    for i in range(5, 9):
        assert torch.equal(out[:, i], model(out[:, :i])[:, -1].argmax(-1))


def test_sampling_is_seeded_and_respects_top_k(model):
    prompt = torch.randint(0, 50, (2, 4))
    a = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=7)
    b = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=7)
    assert torch.equal(a, b)
    seen = set()
    for seed in range(30):
        out = model.generate(prompt[:1], max_new_tokens=1, temperature=5.0, top_k=2, seed=seed)
        seen.add(int(out[0, -1]))
    top2 = set(model(prompt[:1])[0, -1].topk(2).indices.tolist())
    assert seen <= top2 and len(seen) == 2


def test_top_p_keeps_the_nucleus(model):
    prompt = torch.randint(0, 50, (1, 4))
    probs = model(prompt)[0, -1].softmax(-1)
    top = int(probs.argmax())
    # top_p smaller than the top token's probability keeps only that token
    for seed in range(5):
        out = model.generate(prompt, max_new_tokens=1, temperature=1.0, top_p=float(probs.max().detach()) * 0.5, seed=seed)
        assert int(out[0, -1]) == top


def test_stop_tokens_finish_rows_and_pad(model):
    prompt = torch.randint(0, 50, (2, 4))
    free = model.generate(prompt, max_new_tokens=6)
    stop = int(free[0, 5])  # the second generated token of row 0
    out = model.generate(prompt, max_new_tokens=6, stop_tokens=[stop])
    row0 = out[0, 4:].tolist()
    first = row0.index(stop)
    assert all(t == stop for t in row0[first:])


def test_string_prompts_with_a_tokenizer():
    tok = CharTokenizer("abcdefgh ")
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size), tokenizer=tok)
    text = model.generate("abc", max_new_tokens=5)
    assert isinstance(text, str) and text.startswith("abc") and len(text) == 8
    assert model.to_str_tokens("abc") == ["a", "b", "c"]


def test_bad_inputs_raise_clear_errors(model):
    with pytest.raises(ValueError, match="n_ctx"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="n_ctx"):
        model.generate(torch.zeros(1, 20, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="tokenizer"):
        model("hello")
    with pytest.raises(ValueError, match="return_type"):
        model(torch.zeros(1, 3, dtype=torch.long), return_type="probs")


def test_forward_from_a_layer_and_return_none(model):
    toks = torch.randint(0, 50, (2, 8))
    resid = model(toks, stop_at_layer=1)
    torch.testing.assert_close(model(resid, start_at_layer=1), model(toks), atol=1e-5, rtol=1e-5)
    assert model(resid, start_at_layer=1, return_type=None) is None  # no tokens needed when nothing is returned
    torch.testing.assert_close(model(resid, start_at_layer=1, tokens=toks, return_type="loss"), model(toks, return_type="loss"))
