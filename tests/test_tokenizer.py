"""Tokenizers: round trips (including characters and bytes never seen), and save/load with a checkpoint."""

import json

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    IdTokenizer,
    WordTokenizer,
    load_tokenizer,
    tokenizer_from_dict,
    unknown_pieces,
)

CORPUS = "the cat sat on the mat. the dog sat on the log.\nthe end of the story, said the cat.\n" * 20
UNSEEN = "Zebra \u00e9t\u00e9 \u4e2d\u6587 \U0001f600 \x00 tab\tend"


def test_char_round_trip_and_unknown_characters():
    tok = CharTokenizer.from_text(CORPUS)
    assert tok.decode(tok.encode(CORPUS)) == CORPUS
    ids = tok.encode("cat\u4e2d")
    assert ids[-1] == 0 and tok.decode(ids) == "cat" + tok.unk  # unseen -> the unk id, not an error
    assert tok.vocab_size == len(set(CORPUS)) + 1


def test_byte_round_trip_on_any_string():
    tok = ByteTokenizer()
    for text in (CORPUS, UNSEEN, ""):
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a truncated UTF-8 sequence decodes with a replacement
    assert tok.token_str(ord("a")) == "a" and tok.token_str(0xE4) == "<0xE4>"


def test_bpe_trains_locally_and_round_trips_unseen_text():
    tok = BPETokenizer.train([CORPUS], vocab_size=300)
    assert 256 < tok.vocab_size <= 300
    assert len(tok.encode(CORPUS)) < len(CORPUS.encode())  # merges were learned
    for text in (CORPUS, UNSEEN):
        assert tok.decode(tok.encode(text)) == text  # byte-level: nothing is out of vocabulary


def test_word_round_trip_and_unknown_words():
    text = "When Mary and John went to the store, John gave a drink to Mary.\nThe end."
    tok = WordTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text
    assert [tok.token_str(i) for i in tok.encode("Mary, John.")] == ["Mary", ",", "John", "."]
    assert tok.encode("Mary met Zelda") == [tok.stoi["Mary"], 0, 0]


def test_id_tokenizer_reads_ids_and_names_what_is_not_one():
    tok = IdTokenizer(20)
    assert tok.encode("3 17, 5") == [3, 17, 5] and tok.decode([3, 17, 5]) == "3 17 5"
    assert tok.token_str(17) == "17" and tok.vocab_size == 20
    assert tok.unknown_pieces("1 2, 20 x -1 20") == ["20", "x", "-1"]
    with pytest.raises(ValueError, match="'20' is not a token id: ids are 0..19"):
        tok.encode("1 20")
    with pytest.raises(ValueError, match="vocab_size"):
        IdTokenizer(0)


def test_unknown_pieces_asks_each_tokenizer():
    assert unknown_pieces(CharTokenizer("ab "), "a☃b c☃") == ["☃", "c"]
    assert unknown_pieces(WordTokenizer(["Mary", "met", "."]), "Mary met a zebra, Mary.") == ["a", "zebra", ","]
    assert unknown_pieces(ByteTokenizer(), "☃ anything") == []
    assert unknown_pieces(BPETokenizer.train(["abc abc"], vocab_size=260), "☃ zz") == []
    assert unknown_pieces(IdTokenizer(10), "1 2, 12 x 12") == ["12", "x"]
    assert unknown_pieces(object(), "anything") == []  # a tokenizer without the method encodes everything


def test_to_single_token_says_what_the_text_is_instead():
    tok = WordTokenizer(["Mary", "John", "met", "."])
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size), tokenizer=tok)
    assert model.to_single_token("Mary") == tok.stoi["Mary"]
    for text, message in [("", "empty"), ("zebra", "not in the tokenizer's vocabulary"),
                          ("Mary met", r"is 2 tokens \(\['Mary', 'met'\]\), not one")]:
        with pytest.raises(ValueError, match=message):
            model.to_single_token(text)
    ids = wb.HookedDecoder(tiny(d_vocab=20), tokenizer=IdTokenizer(20))
    assert ids.to_single_token("7") == 7
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        ids.to_single_token("27")


@pytest.mark.parametrize("kind", ["char", "byte", "bpe", "word", "ids"])
def test_saved_with_checkpoint_and_restored(tmp_path, kind):
    tok = {
        "char": lambda: CharTokenizer.from_text(CORPUS),
        "byte": ByteTokenizer,
        "bpe": lambda: BPETokenizer.train([CORPUS], vocab_size=280),
        "word": lambda: WordTokenizer.from_text(CORPUS),
        "ids": lambda: IdTokenizer(40),
    }[kind]()
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size))
    wb.save_checkpoint(model, tmp_path / "ck", tokenizer=tok)
    loaded_model, loaded = wb.load_checkpoint(tmp_path / "ck")
    assert type(loaded) is type(tok) and loaded_model.tokenizer is loaded
    sample = "3 17 5 39 0" if kind == "ids" else CORPUS[:60] + (UNSEEN if kind in ("byte", "bpe") else "")
    assert loaded.encode(sample) == tok.encode(sample)
    assert loaded.decode(tok.encode(sample)) == tok.decode(tok.encode(sample))
    assert load_tokenizer(tmp_path / "ck").to_dict() == tok.to_dict()
    text = sample[:20]
    assert torch.equal(loaded_model.to_tokens(text)[0], torch.tensor(tok.encode(text)))


def test_unknown_kind_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="valid kinds are"):
        tokenizer_from_dict({"kind": "sentencepiece"})
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "nope"}))
    with pytest.raises(ValueError, match="nope"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path / "missing") is None


def test_to_tokens_warns_naming_words_outside_the_vocabulary_and_strict_raises():
    # The stories checkpoint's word vocabulary lacks "Then", "Anne", "Bob", "talked" and ";":
    # before, this prompt became five silent <unk>s.
    import warnings

    from workbench.tokenizer import UnknownTokenWarning, encode_checked

    model, tok = wb.load_checkpoint("checkpoints/stories-2026")
    text = "Then Anne and Bob talked; Bob handed a book to"
    with pytest.warns(UnknownTokenWarning) as caught:
        ids = model.to_tokens(text)
    message = str(caught[0].message)
    for word in ("'Then'", "'Anne'", "'Bob'", "'talked'", "';'"):
        assert word in message
    assert "'handed'" not in message and "strict=True" in message
    assert ids[0].tolist() == tok.encode(text) and (ids[0] == 0).sum() == 6  # still encoded, as before
    with pytest.raises(ValueError, match="'Anne'"):
        model.to_tokens(text, strict=True)
    with pytest.raises(ValueError, match="'Anne'"):
        model.to_tokens(["Mary gave a book to", text], padding_side="left", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prompt inside the vocabulary says nothing
        clean = model.to_tokens("When Mary and John went to the store , John gave a drink to", strict=True)
    assert (clean != 0).all()
    # Any tokenizer that can lose text warns the same way; a byte tokenizer never does.
    with pytest.warns(UnknownTokenWarning, match="'z'"):
        encode_checked(CharTokenizer.from_text("abc"), "abz")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert encode_checked(ByteTokenizer(), UNSEEN) == ByteTokenizer().encode(UNSEEN)
