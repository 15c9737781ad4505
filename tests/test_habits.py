"""TransformerLens habits on HookedDecoder (workbench.habits), and nnsight wrapping our model.

References: the tokenizer's own encode/token_str, TL's ActivationCache, and TL hooks for nnsight's
trace (the same edit made two ways)."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.interop.hf_tokenizer import HFTokenizer
from workbench.planted import CHECKPOINTS


@pytest.fixture(scope="module")
def model():
    return wb.HookedDecoder.from_pretrained("stories-2020")


def test_from_pretrained_opens_a_shipped_checkpoint_and_a_folder(model):
    again, _ = wb.load_checkpoint(CHECKPOINTS / "stories-2020")
    assert torch.equal(model.W_E, again.W_E)
    by_path = wb.HookedDecoder.from_pretrained(CHECKPOINTS / "stories-2020")
    assert torch.equal(by_path.W_U, again.W_U)
    with pytest.raises(ValueError, match="not a shipped checkpoint"):
        wb.HookedDecoder.from_pretrained("/nonexistent/folder/of/nothing")


def test_to_single_str_token(model):
    tok = model.tokenizer
    for i in (0, 5, tok.vocab_size - 1):
        assert model.to_single_str_token(i) == tok.token_str(i)
        assert model.to_single_str_token(torch.tensor(i)) == tok.token_str(i)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.to_single_str_token(tok.vocab_size)
    with pytest.raises(ValueError, match="one token id"):
        model.to_single_str_token(torch.tensor([1, 2]))


def test_prepend_bos_refused_without_a_bos_and_applied_with_one(model):
    plain = model.to_tokens("Once upon a time")
    assert torch.equal(model.to_tokens("Once upon a time", prepend_bos=False), plain)
    with pytest.raises(ValueError, match="no BOS"):
        model.to_tokens("Once upon a time", prepend_bos=True)
    # A tokenizer with a BOS whose post-processor adds it (as Llama's does).
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    backend = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    small = wb.HookedDecoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=4, n_ctx=8),
                             tokenizer=HFTokenizer(backend, {"bos_token": "<s>"}))
    assert small.to_tokens("a b").tolist() == [[0, 1, 2]]
    assert small.to_tokens("a b", prepend_bos=True).tolist() == [[0, 1, 2]]  # never twice
    assert small.to_tokens("a b", prepend_bos=False).tolist() == [[1, 2]]


def test_set_use_attn_result(model):
    tokens = model.to_tokens("Once upon a time")
    _, full = model.run_with_cache(tokens)
    assert "blocks.0.attn.hook_result" in full
    try:
        model.set_use_attn_result(False)
        _, lean = model.run_with_cache(tokens)
        assert "blocks.0.attn.hook_result" not in lean
        assert set(full) - set(lean) == {f"blocks.{l}.attn.hook_result" for l in range(model.cfg.n_layers)}
        _, asked = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_result"))
        torch.testing.assert_close(asked["blocks.0.attn.hook_result"], full["blocks.0.attn.hook_result"], atol=1e-6, rtol=0)
    finally:
        model.set_use_attn_result(True)
    with pytest.raises(ValueError):
        model.set_use_attn_result("yes")


def test_nnsight_trace_save_and_intervene_equal_tl_hooks(model):
    nnsight = pytest.importorskip("nnsight", reason="nnsight is in requirements.txt; this venv lacks it")
    tokens = model.to_tokens("Once upon a time")
    _, cache = model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")
    wrapped = nnsight.NNsight(model)
    with wrapped.trace(tokens):
        resid = wrapped.blocks[1].hook_resid_post.output.save()
    torch.testing.assert_close(resid, cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=0)

    def scale(x, hook):
        return 2 * x

    with wrapped.trace(tokens):
        wrapped.blocks[0].hook_resid_post.output[:] = 2 * wrapped.blocks[0].hook_resid_post.output
        out = wrapped.output.save()
    ref = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", scale)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_to_str_tokens_takes_prepend_bos_as_transformer_lens_does(tmp_path):
    """A tokenizer that declares a BOS but does not add one (SmolLM2's GGUF: BOS id 1, add_bos_token
    false): to_tokens and to_str_tokens with prepend_bos None / True / False, on one text and on a
    list of texts, against TransformerLens' own TransformerBridge holding the same tokenizer."""
    pytest.importorskip("transformer_lens.model_bridge.sources.native", reason="TL native source missing")
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformer_lens import TransformerBridge
    from transformers import PreTrainedTokenizerFast

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backend = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    ours = wb.HookedDecoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=4, n_ctx=8),
                            tokenizer=HFTokenizer(backend, {"bos_token": "<s>"}))
    # TL's bridge reloads the tokenizer from its folder while it boots
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>").save_pretrained(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    theirs = TransformerBridge.boot_native(
        dict(d_model=8, n_layers=1, n_heads=2, d_head=4, d_vocab=4, n_ctx=8, d_mlp=16, normalization_type="LN",
             positional_embedding_type="standard", act_fn="gelu", seed=0, default_prepend_bos=False), tokenizer=hf)
    for bos in (None, True, False):
        assert ours.to_tokens("a b", prepend_bos=bos).tolist() == theirs.to_tokens("a b", prepend_bos=bos).tolist()
        for text in ("a b", ["a b", "b"]):
            assert ours.to_str_tokens(text, prepend_bos=bos) == theirs.to_str_tokens(text, prepend_bos=bos), (text, bos)
    assert ours.to_str_tokens("a b", prepend_bos=True) == ["<s>", "a", "b"]  # not vacuous: the BOS shows
    ids = torch.tensor([0, 1])  # token ids are shown as they are, whatever prepend_bos says (TL's too)
    assert ours.to_str_tokens(ids, prepend_bos=False) == theirs.to_str_tokens(ids, prepend_bos=False) == ["<s>", "a"]
    with pytest.raises(ValueError, match="prepend_bos=True"):
        ours.to_str_tokens("a b", True)  # TL's positional prepend_bos lands on our attention_mask
