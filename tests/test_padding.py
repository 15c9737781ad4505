"""Padding parity: a batch of prompts of different lengths, padded on the left or the right,
computes what each prompt computes alone.

The reference is the model itself on one unpadded prompt, an independent computation for
every row (no mask, ``is_causal`` attention, positions 0..n-1). For a seeded sample of
configs in which every registry value appears (norm, placement, positions, MHA/GQA/MQA, every
FFN including MoE, parallel, attention-only) plus every RoPE scaling: logits, loss (mean and
per token), every hook of ``run_with_cache`` at real positions on the fused (SDPA) and the
explicit attention path, and generation (greedy with and without the KV cache, per-row
stop tokens, per-row seeded sampling) all equal the prompts alone, within 1e-5 in fp32. A
Hugging Face Llama given the same padded batch and position ids is a second, outside reference.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from factories import tiny
from workbench.components import attention as attention_module
from workbench.components.mlp import FFNS
from workbench.components.norm import NORMS
from workbench.components.positional import POS_EMBEDDINGS
from workbench.padding import TokenBatch
from workbench.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer, WordTokenizer

TOL = dict(atol=1e-5, rtol=1e-5)
LENGTHS = (7, 2, 11, 5)  # mixed, with the longest in the middle: both sides pad some rows before and after it
NEW_TOKENS = 6

FACTORS = {
    "norm": list(NORMS),
    "norm_placement": ["pre", "post"],
    "positional": list(POS_EMBEDDINGS),
    "n_kv_heads": [4, 2, 1],  # MHA, GQA, MQA over 4 query heads
    "ffn": list(FFNS),
    "parallel_residual": [False, True],
    "attn_only": [False, True],
}


def _sampled_cases(n: int = 18, seed: int = 3) -> dict[str, dict]:
    """A seeded Latin-square-like sample of the product: each factor's values are spread over the
    ``n`` configs, so every value appears (the full product, 2,160 configs, would take minutes)."""
    rng = random.Random(seed)
    columns = {}
    for name, values in FACTORS.items():
        column = (values * (n // len(values) + 1))[:n]
        rng.shuffle(column)
        columns[name] = column
    cases = {}
    for i in range(n):
        choice = {name: columns[name][i] for name in FACTORS}
        if choice["parallel_residual"] and (choice["norm_placement"] == "post" or choice["attn_only"]):
            choice["parallel_residual"] = False  # no such layout (ModelConfig refuses it)
        cases["-".join(str(v) for v in choice.values())] = choice
    return cases


CASES = {
    **_sampled_cases(),
    "rope-linear": dict(positional="rope", rope_scaling="linear", rope_scaling_factor=2.0),
    # dynamic scaling switches on past 8 positions: the 11-token row uses other frequencies than the rest
    "rope-dynamic": dict(positional="rope", rope_scaling="dynamic", rope_scaling_factor=2.0, rope_original_n_ctx=8),
    "rope-llama3": dict(positional="rope", rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_n_ctx=8),
    "rope-yarn": dict(positional="rope", rope_scaling="yarn", rope_scaling_factor=2.0, rope_original_n_ctx=8),
    "rope-partial-interleaved": dict(positional="rope", rotary_dim=4, rotary_interleaved=True, n_kv_heads=2),
    "alibi-mqa-untied-no-bias": dict(positional="alibi", n_kv_heads=1, tie_embeddings=False, bias=False),
    "moe-top1-relu-experts": dict(ffn="moe", n_experts=3, experts_per_token=1, moe_expert="relu", positional="rope"),
    # MLA: padded rows through the latent (and, decoding, the latent-only cache with absorbed weights)
    "mla-interleaved": dict(attention="mla", positional="rope", rotary_interleaved=True, norm="rmsnorm"),
    "mla-qlora-deepseek-moe": dict(attention="mla", positional="rope", q_lora_rank=12, ffn="moe", n_shared_experts=1,
                                   moe_first_dense=1, moe_router="sigmoid", moe_score_bias=True, moe_n_groups=2,
                                   rope_scaling="yarn", rope_scaling_factor=2.0, rope_original_n_ctx=8),
}


def test_the_sample_covers_every_registry_value():
    for name, values in FACTORS.items():
        seen = {case.get(name) for case in CASES.values()}
        assert set(values) <= seen, f"{name}: {set(values) - seen} never sampled"


@functools.lru_cache(maxsize=None)
def _model(case: str) -> wb.HookedDecoder:
    model = wb.HookedDecoder(tiny(**CASES[case])).eval()
    with torch.no_grad():  # non-trivial gains and biases, so no formula hides behind init values
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model


def _rows(d_vocab: int = 50) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, d_vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _batch(side: str) -> TokenBatch:
    return TokenBatch.from_ids(_rows(), pad_id=0, padding_side=side)


def _alone(model, row, **kwargs):
    return model(torch.tensor([row]), **kwargs)


# ---- forward: logits, loss, hooks ------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_loss_equal_each_prompt_alone(case, side):
    model, batch = _model(case), _batch(side)
    mask = batch.attention_mask.bool()
    with torch.no_grad():
        logits, loss = model(batch, return_type="both")
        per_token = model(batch.tokens, return_type="loss", loss_per_token=True, attention_mask=batch.attention_mask)
        assert torch.isfinite(logits).all(), "pad positions must be finite, not NaN"
        total, count = 0.0, 0
        for i, row in enumerate(_rows()):
            torch.testing.assert_close(logits[i][mask[i]], _alone(model, row)[0], **TOL)
            counted = mask[i, 1:] & mask[i, :-1]
            assert (per_token[i][~counted] == 0).all(), "per-token loss is 0 where no real target is predicted"
            if len(row) > 1:
                alone = _alone(model, row, return_type="loss", loss_per_token=True)[0]
                torch.testing.assert_close(per_token[i][counted], alone, **TOL)
                total, count = total + float(alone.sum()), count + alone.numel()
        torch.testing.assert_close(loss, torch.tensor(total / count), **TOL)


def _assert_cache_matches(cache, alone_caches, mask):
    assert set(cache.keys()) == set(alone_caches[0].keys())
    for name in cache.keys():
        got = cache[name]
        assert not torch.isnan(got).any(), f"{name}: NaN (at a pad position?)"
        if ".experts." in name:  # experts see [1, routed tokens, ...]: the real tokens of each row in turn
            torch.testing.assert_close(got, torch.cat([c[name] for c in alone_caches], dim=1), **TOL, msg=name)
            continue
        for i, alone in enumerate(alone_caches):
            real = mask[i]
            if name.endswith(("hook_attn_scores", "hook_pattern")):  # [batch, head, query, key]
                torch.testing.assert_close(got[i][:, real][:, :, real], alone[name][0], **TOL, msg=name)
                if name.endswith("hook_pattern"):
                    assert (got[i][:, real][:, :, ~real] == 0).all(), f"{name}: a real token attends to a pad"
            else:
                torch.testing.assert_close(got[i][real], alone[name][0], **TOL, msg=name)


@pytest.mark.parametrize("path", ["fused", "explicit"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_hook_equals_each_prompt_alone_at_real_positions(case, side, path):
    model, batch = _model(case), _batch(side)
    # Caching the scores or the pattern is what switches attention to the explicit path.
    keep = (lambda n: True) if path == "explicit" else (lambda n: not n.endswith(("hook_attn_scores", "hook_pattern")))
    with torch.no_grad():
        logits, cache = model.run_with_cache(batch.tokens, attention_mask=batch.attention_mask, names_filter=keep)
        alone = [model.run_with_cache(torch.tensor([row]), names_filter=keep)[1] for row in _rows()]
    assert torch.equal(cache.attention_mask, batch.attention_mask.bool())
    _assert_cache_matches(cache, alone, batch.attention_mask.bool())


@pytest.mark.parametrize("case", ["moe-top1-relu-experts", "alibi-mqa-untied-no-bias"])
def test_gradients_of_a_padded_batch_equal_those_of_the_prompts_alone(case):
    """Training on a padded batch: the loss (mean over real targets) has the gradient of the same
    mean taken over the prompts run alone; pads contribute nothing, on the packed path too."""
    model = wb.HookedDecoder(tiny(**CASES[case])).train()
    model(_batch("left"), return_type="loss").backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sums = [_alone(model, row, return_type="loss", loss_per_token=True).sum() for row in _rows()]
    (sum(sums) / sum(n - 1 for n in LENGTHS)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(padded[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_run_with_hooks_and_a_start_layer_take_the_mask():
    model, batch = _model("rope-partial-interleaved"), _batch("left")
    seen = {}
    hooked = model.run_with_hooks(batch, fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: seen.setdefault("r", x))])
    real = batch.attention_mask.bool()  # pads: finite but meaningless (0 on the packed path, below)
    torch.testing.assert_close(hooked[real], model(batch)[real], **TOL)
    resumed = model(seen["r"], start_at_layer=1, attention_mask=batch.attention_mask)
    torch.testing.assert_close(resumed[real], model(batch)[real], **TOL)
    assert (model(batch)[~real] == 0).all()


def test_unpadded_input_takes_todays_path(monkeypatch):
    """No mask, or an all-ones mask: SDPA with is_causal and no attn_mask, bit for bit as before."""
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    model = _model("rope-partial-interleaved")
    tokens = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        plain = model(tokens)
        ones = model(tokens, attention_mask=torch.ones(3, 9, dtype=torch.long))
        cache = model.make_kv_cache(3)
        model(tokens, kv_cache=cache, attention_mask=torch.ones(3, 9))
    assert torch.equal(plain, ones) and cache.attention_mask is None
    assert calls[: 2 * model.cfg.n_layers] == [(True, True)] * (2 * model.cfg.n_layers)
    calls.clear()
    model(_batch("left"))
    assert calls and all(not causal and not no_mask for causal, no_mask in calls), "a padded batch needs the mask"


def test_a_one_token_prompt_and_a_row_of_middle_pads():
    model = _model("alibi-mqa-untied-no-bias")
    rows = [[5], [3, 9, 4, 8, 1, 2]]
    batch = TokenBatch.from_ids(rows, padding_side="left")
    with torch.no_grad():
        out = model(batch)
        torch.testing.assert_close(out[0, -1:], _alone(model, rows[0])[0], **TOL)
        # Pads in the middle of a row (a mask with a hole) are skipped too: positions count real tokens.
        tokens = torch.tensor([[3, 9, 0, 0, 4, 8]])
        holed = model(tokens, attention_mask=torch.tensor([[1, 1, 0, 0, 1, 1]]))
        torch.testing.assert_close(holed[0, [0, 1, 4, 5]], _alone(model, [3, 9, 4, 8])[0], **TOL)


def test_kv_cache_continues_each_rows_positions():
    for case in ("rope-dynamic", "alibi-mqa-untied-no-bias", "moe-top1-relu-experts"):
        model, batch = _model(case), _batch("left")
        extra = torch.randint(1, 50, (len(LENGTHS), 3), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            cache = model.make_kv_cache(len(LENGTHS))
            steps = [model(batch, kv_cache=cache)[:, -1:]]
            steps += [model(extra[:, j : j + 1], kv_cache=cache) for j in range(3)]
            assert cache.attention_mask.shape == (len(LENGTHS), batch.shape[1] + 3)
            for i, row in enumerate(_rows()):
                alone = _alone(model, row + extra[i].tolist())[0, -4:]
                torch.testing.assert_close(torch.cat([s[i] for s in steps]), alone, **TOL, msg=case)


# ---- generation ----------------------------------------------------------------------------
@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_of_a_left_padded_batch_equals_each_prompt_alone(case, use_kv_cache):
    model, batch = _model(case), _batch("left")
    out = model.generate(batch, max_new_tokens=NEW_TOKENS, use_kv_cache=use_kv_cache)
    assert isinstance(out, TokenBatch) and out.shape == (len(LENGTHS), max(LENGTHS) + NEW_TOKENS)
    for i, row in enumerate(_rows()):
        alone = model.generate(torch.tensor([row]), max_new_tokens=NEW_TOKENS, use_kv_cache=use_kv_cache)[0]
        assert torch.equal(out.row(i), alone), f"row {i} drifted from its prompt alone"
    as_tl = model.generate(batch.tokens, attention_mask=batch.attention_mask, max_new_tokens=NEW_TOKENS)
    assert isinstance(as_tl, torch.Tensor) and torch.equal(as_tl, out.tokens)


def test_stop_tokens_stop_each_row_as_alone():
    model, batch = _model("rope-linear"), _batch("left")
    free = model.generate(batch, max_new_tokens=NEW_TOKENS)
    stop = int(free.tokens[0, -NEW_TOKENS + 1])  # row 0's second new token
    out = model.generate(batch, max_new_tokens=NEW_TOKENS, stop_tokens=[stop])
    for i, row in enumerate(_rows()):
        alone = model.generate(torch.tensor([row]), max_new_tokens=NEW_TOKENS, stop_tokens=[stop])[0]
        got = out.row(i)
        assert torch.equal(got[: len(alone)], alone)
        assert (got[len(alone) :] == stop).all()  # a finished row is padded with its stop token
    assert out.shape[1] < batch.shape[1] + NEW_TOKENS or (out.tokens[:, -1] == stop).any()


def test_sampling_with_a_seed_per_row_equals_each_prompt_alone():
    """One generator shared by a batch cannot reproduce per-prompt runs (row i's draws follow the
    draws of rows before it); a seed per row gives each row its own generator, and then a row
    equals its prompt sampled alone with that seed, whatever the other rows and the padding."""
    model, batch = _model("rope-dynamic"), _batch("left")
    seeds = [101, 102, 103, 104]
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=1.5, top_k=20)
    out = model.generate(batch, seed=seeds, **kwargs)
    assert torch.equal(out.tokens, model.generate(batch, seed=seeds, **kwargs).tokens), "seeded sampling repeats"
    for i, row in enumerate(_rows()):
        alone = model.generate(torch.tensor([row]), seed=seeds[i], **kwargs)[0]
        assert torch.equal(out.row(i), alone)
    pair = TokenBatch.from_ids([_rows()[0], _rows()[2]], padding_side="left")  # other company, other padding
    other = model.generate(pair, seed=[seeds[0], seeds[2]], **kwargs)
    assert torch.equal(other.row(0), out.row(0)) and torch.equal(other.row(1), out.row(2))
    # One int seed: reproducible for the same batch (its rows are not comparable to runs alone).
    shared = model.generate(batch, seed=7, **kwargs)
    assert torch.equal(shared.tokens, model.generate(batch, seed=7, **kwargs).tokens)


# ---- text in, text out -----------------------------------------------------------------
def test_texts_of_different_lengths_pad_with_every_tokenizer():
    corpus = "the cat sat on the mat . the dog ran to the park ."
    tokenizers = [CharTokenizer.from_text(corpus), ByteTokenizer(), WordTokenizer.from_text(corpus),
                  BPETokenizer.train([corpus] * 5, vocab_size=300)]
    texts = ["the cat sat on the mat .", "the dog ran .", "the cat ran to the park ."]
    for tok in tokenizers:
        model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, n_ctx=64, positional="rope"), tokenizer=tok).eval()
        assert 0 <= tok.pad_id < tok.vocab_size, "pads reuse an id: the vocabulary never grows"
        for side in ("left", "right"):
            batch = model.to_tokens(texts, padding_side=side)
            assert isinstance(batch, TokenBatch) and batch.lengths.tolist() == [len(tok.encode(t)) for t in texts]
            assert (batch.tokens[~batch.attention_mask.bool()] == tok.pad_id).all()
            logits = model(batch)
            for i, text in enumerate(texts):
                torch.testing.assert_close(logits[i][batch.attention_mask[i].bool()], model(text)[0], **TOL)
        strs = model.to_str_tokens(model.to_tokens(texts[:2], padding_side="left"))
        n1, n2 = len(tok.encode(texts[0])), len(tok.encode(texts[1]))
        assert strs[1][: n1 - n2] == ["<pad>"] * (n1 - n2) and strs[1][n1 - n2 :] == model.to_str_tokens(texts[1])
    # Backward compatible: one length and no padding asked gives the plain tensor it always gave.
    assert isinstance(model.to_tokens(["the cat", "the dog"]), torch.Tensor)
    assert isinstance(model.to_tokens(["the cat", "the"]), TokenBatch)  # different lengths: padded on the right


def test_generate_on_a_list_of_texts_equals_each_text_alone():
    tok = CharTokenizer("abcdefgh ")
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, positional="learned", init_std=0.3), tokenizer=tok).eval()
    texts = ["abc", "a", "hgfedcb"]
    stop = tok.encode("e")[0]
    got = model.generate(texts, max_new_tokens=8, stop_tokens=[stop])
    assert got == [model.generate(t, max_new_tokens=8, stop_tokens=[stop]) for t in texts]
    _, cache = model.run_with_cache(texts)
    assert cache.attention_mask.sum(1).tolist() == [3, 1, 7]


def test_hugging_face_llama_agrees_on_a_padded_batch():
    """An outside reference: transformers' Llama given the same left-padded batch, its mask and
    position ids from the mask (HF's forward alone would number positions by column)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=50, max_position_embeddings=24, intermediate_size=40,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = wb.from_hf(hf)
    batch = _batch("left")
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(batch.tokens, attention_mask=batch.attention_mask, position_ids=positions).logits
        got = ours(batch)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=1e-4)


# ---- bad input -------------------------------------------------------------------------
def test_bad_masks_and_padding_raise_clear_errors():
    model, batch = _model("rope-linear"), _batch("left")
    with pytest.raises(ValueError, match=r"attention_mask has shape \(4, 10\).*\(4, 11\)"):
        model(batch.tokens, attention_mask=batch.attention_mask[:, 1:])
    with pytest.raises(ValueError, match="row 1 is all padding"):
        model(batch.tokens, attention_mask=torch.tensor([[1] * 11, [0] * 11, [1] * 11, [1] * 11]))
    with pytest.raises(ValueError, match="only 0 .* and 1"):
        model(batch.tokens, attention_mask=batch.attention_mask * 2)
    with pytest.raises(ValueError, match="given twice"):
        model(batch, attention_mask=batch.attention_mask)
    right = _batch("right")
    with pytest.raises(ValueError, match=r"left padding: row 0 .*padding_side='left'"):
        model.generate(right, max_new_tokens=2)
    with pytest.raises(ValueError, match="left padding: row 0"):
        model.generate(right.tokens, attention_mask=right.attention_mask, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"one per row \(4 rows\), got 2"):
        model.generate(batch, max_new_tokens=2, temperature=1.0, seed=[1, 2])
    as_bool = TokenBatch(batch.tokens, batch.attention_mask.bool(), "left")  # bool masks work as well as 0/1
    assert as_bool.last_index.tolist() == [10] * 4 and _batch("right").last_index.tolist() == [n - 1 for n in LENGTHS]
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        TokenBatch.from_ids([[1, 2], []])
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        TokenBatch.from_ids([[1, 2], [3]], padding_side="middle")
