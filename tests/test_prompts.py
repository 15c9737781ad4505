"""PromptSet: prompt datasets from CSV / JSONL / records / DataFrames / the stories task, their
padded batches (each row equal to its prompt alone), and clear errors naming the row and field."""

import json

import pandas as pd
import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.data import get_task
from workbench.data.prompts import PromptSetBatch
from workbench.interop.hf_tokenizer import HFTokenizer
from workbench.tokenizer import BPETokenizer, WordTokenizer

RECORDS = [
    {"prompt": "Mary and John went to the park , John gave a ball to", "answer": "Mary", "wrong": "John",
     "corrupted": "Mary and John went to the park , Anna gave a ball to", "template": "ABBA", "n": 1},
    {"prompt": "Anna met Tom . Tom gave a cup to", "answer": "Anna", "wrong": "Tom",
     "corrupted": "Anna met Tom . Mary gave a cup to", "template": "short", "n": 2},
    {"prompt": "Tom gave a book to", "answer": "Anna", "wrong": "Tom",
     "corrupted": "Mary gave a book to", "template": "shortest", "n": 3},
]


@pytest.fixture
def model():
    words = " ".join(r["prompt"] + " " + r["corrupted"] for r in RECORDS)
    tok = WordTokenizer.from_text(words)
    return wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, positional="rope", n_kv_heads=2), tokenizer=tok).eval()


def test_every_source_reads_the_same_set(tmp_path):
    frame = pd.DataFrame(RECORDS)
    frame.to_csv(tmp_path / "p.csv", index=False)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    sets = [wb.PromptSet.from_records(RECORDS), wb.PromptSet.from_dataframe(frame),
            wb.PromptSet.from_csv(tmp_path / "p.csv"), wb.PromptSet.from_jsonl(tmp_path / "p.jsonl")]
    for ds in sets:
        assert ds.clean == [r["prompt"] for r in RECORDS] and ds.corrupted == [r["corrupted"] for r in RECORDS]
        assert ds.answers == ["Mary", "Anna", "Anna"] and ds.wrong == ["John", "Tom", "Tom"]
        assert list(ds.meta.columns) == ["template", "n"] and ds.meta["n"].tolist() == [1, 2, 3]
        pd.testing.assert_frame_equal(ds.to_frame(), frame)
    assert len(sets[0][1:]) == 2 and sets[0][[2]].clean == [RECORDS[2]["prompt"]]


def test_csv_text_is_read_verbatim(tmp_path):
    (tmp_path / "p.csv").write_text('prompt,answer,wrong,score\n"When Mary, John gave it to", Mary,NA,0.5\n')
    ds = wb.PromptSet.from_csv(tmp_path / "p.csv")
    assert ds.answers == [" Mary"] and ds.wrong == ["NA"] and ds.meta["score"].dtype == float


def test_batches_equal_each_prompt_alone(model):
    ds = wb.PromptSet.from_records(RECORDS * 3)
    seen = []
    for side, sort in (("left", False), ("right", True)):
        for batch in ds.batches(model, batch_size=4, padding_side=side, sort_by_length=sort):
            assert isinstance(batch, PromptSetBatch) and batch.padding_side == side
            assert batch.corrupted.shape == batch.shape  # one width, so clean and corrupted positions line up
            logits = model(batch)
            last = logits[torch.arange(len(batch)), batch.last_index]
            for j, row in enumerate(batch.rows.tolist()):
                alone = model(ds.clean[row])[0, -1]
                torch.testing.assert_close(last[j], alone, atol=1e-5, rtol=1e-5)
                assert int(batch.answer[j]) == model.to_single_token(ds.answers[row])
                assert int(batch.wrong[j]) == model.to_single_token(ds.wrong[row])
                assert torch.equal(batch.corrupted.row(j), model.to_tokens(ds.corrupted[row])[0])
            seen += batch.rows.tolist()
    assert sorted(seen) == sorted(list(range(len(ds))) * 2)
    first = next(ds.batches(model, batch_size=9, sort_by_length=True))
    assert first.lengths.tolist() == sorted(first.lengths.tolist())


def test_from_task_reproduces_the_stories_ioi_prompts():
    task = get_task("stories", seed=0)
    ds = wb.PromptSet.from_task(task, n=6)
    reference = task.ioi_prompts(6)
    batch = next(ds.batches(task.tokenizer, batch_size=6))
    assert torch.equal(batch.tokens, reference.tokens) and bool(batch.attention_mask.all())
    assert torch.equal(batch.corrupted.tokens, reference.corrupted)
    assert torch.equal(batch.answer, reference.correct) and torch.equal(batch.wrong, reference.wrong)
    assert ds.meta["template"].tolist() == reference.templates
    assert ds.meta["pos_IO"].tolist() == reference.positions["IO"].tolist()
    assert len(wb.PromptSet.from_task(task, n=3, kind="possession")) == 3


def _bpe():
    """GPT-2's situation in miniature: " mat" and " cat" are single tokens, "mat" is three."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["Ġ", "m", "a", "t", "c", "s", "Ġm", "Ġma", "Ġmat", "Ġc", "Ġca", "Ġcat"]
    merges = [("Ġ", "m"), ("Ġm", "a"), ("Ġma", "t"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "t")]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return BPETokenizer(backend)


def test_leading_space_answers():
    tok = _bpe()
    ds = wb.PromptSet.from_records([{"prompt": "the cat sat on the", "answer": "mat", "wrong": " cat"}])
    with pytest.raises(ValueError, match=r"row 0: field 'answer' = 'mat' is 3 tokens.*\(' mat'\) it is one token: pass answer_space=True"):
        ds.answer_ids(tok)
    assert ds.answer_ids(tok, answer_space=True).tolist() == tok.encode(" mat")
    assert ds.answer_ids(tok, "wrong").tolist() == tok.encode(" cat")  # already spaced: encoded as written


def test_hf_tokenizer_pads_with_eos_and_answers_skip_bos():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(["the cat sat on the mat"] * 10, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = HFTokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    assert tok.pad_id == backend.token_to_id("</s>")  # no pad token: EOS, and the mask marks pads
    assert tok.encode(" cat")[0] == 1 and tok.encode_piece(" cat") == tok.encode(" cat")[1:]
    ds = wb.PromptSet.from_records([{"prompt": "the cat sat", "answer": " on"}, {"prompt": "the", "answer": " cat"}])
    batch = next(ds.batches(tok, batch_size=2))
    n0, n1 = len(tok.encode("the cat sat")), len(tok.encode("the"))  # both start with BOS
    assert batch.tokens[1, 0] == tok.pad_id and batch.attention_mask[1].tolist() == [0] * (n0 - n1) + [1] * n1
    assert batch.answer.tolist() == [tok.encode_piece(" on")[0], tok.encode_piece(" cat")[0]]
    with_pad = HFTokenizer(backend, {"pad_token": "<unk>", "eos_token": "</s>"})
    assert with_pad.pad_id == 0


def test_bad_rows_name_the_row_and_the_field(model, tmp_path):
    with pytest.raises(ValueError, match="row 1: field 'answer' = 'store' is not in the tokenizer's vocabulary"):
        wb.PromptSet.from_records([RECORDS[0], {**RECORDS[1], "answer": "store"}]).answer_ids(model)
    bpe = _bpe()
    with pytest.raises(ValueError, match=r"row 2: field 'wrong' = ' cats' is 2 tokens \[' cat', 's'\], not one"):
        wb.PromptSet(["a", "b", "c"], wrong=[" cat", " mat", " cats"]).answer_ids(bpe, "wrong")
    (tmp_path / "p.csv").write_text("prompt,answer,wrong\nthe cat,sat,on\nthe mat,,ran\n")
    with pytest.raises(ValueError, match="row 1: field 'answer' must be a non-empty string, got ''"):
        wb.PromptSet.from_csv(tmp_path / "p.csv")
    with pytest.raises(ValueError, match=r"no 'prompt' column: the columns are \['text'\]"):
        wb.PromptSet.from_records([{"text": "hi"}])
    assert wb.PromptSet.from_records([{"text": "hi"}], prompt="text").clean == ["hi"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        wb.PromptSet.from_jsonl(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(wb.PromptSet(["a"]).batches(model, batch_size=0))
    with pytest.raises(ValueError, match="kind must be one of"):
        wb.PromptSet.from_task(get_task("stories"), kind="nope")
