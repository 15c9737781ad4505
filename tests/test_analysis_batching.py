"""iter_batches: every kind of data in, padded batches out, each row numbered as in the data and
equal to its prompt alone; real_positions counts within each prompt."""

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.analysis.batching import as_token_batch, iter_batches, n_rows, real_positions, select_rows
from workbench.tokenizer import WordTokenizer

TEXTS = ["Mary and John went to the park , John gave a ball to", "Tom gave a book to",
         "Anna met Tom . Tom gave a cup to", "Mary went home", "John and Tom talked"]


@pytest.fixture
def model():
    tok = WordTokenizer.from_text(" ".join(TEXTS))
    return wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, positional="rope"), tokenizer=tok).eval()


def _rows(model, batches):
    out = {}
    for b in batches:
        for i, r in enumerate(b.rows.tolist()):
            out[r] = b.row(i).tolist()
    return out


@pytest.mark.parametrize("side", ["left", "right"])
def test_every_kind_of_data_gives_the_same_rows(model, side):
    alone = {i: model.tokenizer.encode(t) for i, t in enumerate(TEXTS)}
    ds = wb.PromptSet(TEXTS)
    padded = model.to_tokens(TEXTS, padding_side=side)
    for data in (TEXTS, ds, padded):
        for size in (1, 2, 5, 64):
            batches = list(iter_batches(model, data, batch_size=size, padding_side=side))
            assert len(batches) == -(-len(TEXTS) // size)
            assert all(len(b) <= size for b in batches)
            assert _rows(model, batches) == alone
            if not isinstance(data, wb.TokenBatch):
                assert all(b.padding_side == side for b in batches)


def test_a_tensor_is_all_real_and_one_text_is_one_row(model):
    tokens = torch.randint(0, model.cfg.d_vocab, (3, 7))
    (batch,) = iter_batches(model, tokens, batch_size=8)
    assert batch.attention_mask.bool().all() and torch.equal(batch.tokens, tokens)
    assert n_rows(TEXTS[0]) == 1 and n_rows(tokens) == 3 and n_rows(tokens[0]) == 1
    (one,) = iter_batches(model, TEXTS[1])
    assert one.rows.tolist() == [0] and one.row(0).tolist() == model.tokenizer.encode(TEXTS[1])


def test_prompt_sets_keep_answers_and_corrupted(model):
    ds = wb.PromptSet(TEXTS[:2], answers=["Mary", "Tom"], wrong=["John", "Anna"], corrupted=TEXTS[2:4])
    (batch,) = iter_batches(model, ds, batch_size=4)
    assert batch.answer.tolist() == [model.tokenizer.encode("Mary")[0], model.tokenizer.encode("Tom")[0]]
    assert batch.corrupted is not None and batch.corrupted.tokens.shape == batch.tokens.shape


def test_real_positions_count_within_each_prompt(model):
    for side in ("left", "right"):
        batch = as_token_batch(model, TEXTS, side)
        pos = real_positions(batch.attention_mask)
        for i, text in enumerate(TEXTS):
            n = len(model.tokenizer.encode(text))
            assert pos[i][batch.attention_mask[i].bool()].tolist() == list(range(n))
            assert (pos[i][~batch.attention_mask[i].bool()] == -1).all()


def test_select_rows_keeps_the_kind(model):
    assert select_rows(TEXTS, [3, 0]) == [TEXTS[3], TEXTS[0]]
    assert len(select_rows(wb.PromptSet(TEXTS), [1, 2])) == 2
    assert select_rows(model.to_tokens(TEXTS), [4]).tokens.shape[0] == 1
    assert select_rows(TEXTS, None) is TEXTS


def test_bad_input_is_named(model):
    with pytest.raises(ValueError, match="batch_size"):
        list(iter_batches(model, TEXTS, batch_size=0))
    with pytest.raises(ValueError, match="padding_side"):
        list(iter_batches(model, TEXTS, padding_side="middle"))
    with pytest.raises(ValueError, match="data must be"):
        as_token_batch(model, 3.5)
