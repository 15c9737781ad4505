"""``vocab_labels`` decodes a tokenizer's vocabulary once: the token-loss table, the logit lens and the
suggested answer each asked for it on every call (0.6 s for SmolLM2's 49,152 tokens on a busy machine)."""

from pathlib import Path

import pytest

from workbench.analysis.common import str_tokens, vocab_labels

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "stories-2026"


def test_vocab_labels_are_decoded_once_per_tokenizer_and_equal_a_fresh_decode():
    import copy

    import torch

    import workbench as wb

    if not CHECKPOINT.is_dir():
        pytest.skip(f"the shipped checkpoint {CHECKPOINT} is missing")
    model, tok = wb.load_checkpoint(CHECKPOINT)
    model.tokenizer = tok
    calls = []
    original = type(tok).token_str
    tok.token_str = lambda i: calls.append(i) or original(tok, i)  # counts this object's decodes only
    first = vocab_labels(model)
    assert len(calls) == model.cfg.d_vocab
    again = vocab_labels(model)
    assert len(calls) == model.cfg.d_vocab and again is first  # no second decode
    assert list(first) == str_tokens(model, torch.arange(model.cfg.d_vocab)) + [""]
    with pytest.raises(ValueError):
        first[0] = "changed"  # read-only: a caller cannot spoil what the next one reads
    other = copy.deepcopy(tok)  # another tokenizer object: decoded on its own
    model.tokenizer = other
    assert list(vocab_labels(model)) == list(first)
