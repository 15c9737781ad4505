"""A sliding-window layer's KV cache holds the window, not the context.

Each cached decode equals the full recompute (whose window is the mask alone, checked against a
plain-torch reference in test_core_gemma_components): greedy tokens equal, step logits <= 1e-5 in
fp32, for prompts shorter and longer than the window, windows 1, 2, 3, 5, GQA, Gemma's
alternation and every layer local (Mistral), RoPE and ALiBi; a left-padded batch equals each
prompt alone, a row with pads in its middle too; and the storage itself: a sliding layer's keys
and values take ``window`` positions of bytes, a global layer's max_len, as
``kv_cache_bytes`` says.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.padding import TokenBatch

TOL = dict(atol=1e-5, rtol=1e-5)
CTX = 24


def _model(window: int, **extra) -> wb.HookedDecoder:
    fields = dict(n_layers=4, n_heads=4, n_kv_heads=2, positional="rope", norm="rmsnorm", ffn="swiglu", bias=False,
                  sliding_window=window, global_every=2, init_std=0.15, n_ctx=CTX)
    return wb.HookedDecoder(tiny(**{**fields, **extra})).eval()


def _steps(model: wb.HookedDecoder, tokens: torch.Tensor, chunks: list[int], mask=None) -> torch.Tensor:
    """Logits of ``tokens`` fed through one KV cache in chunks of the given sizes (the rest one at a time)."""
    cache = model.make_kv_cache(tokens.shape[0], tokens.shape[1])
    out, at = [], 0
    sizes = chunks + [1] * (tokens.shape[1] - sum(chunks))
    for n in sizes:
        step_mask = mask[:, at : at + n] if mask is not None and at == 0 else None
        out.append(model(tokens[:, at : at + n], kv_cache=cache, attention_mask=step_mask))
        at += n
    return torch.cat(out, dim=1)


CASES = {
    "gqa-alternating": {},
    "every-layer-local": dict(global_every=0),
    "alibi-mha": dict(positional="alibi", n_kv_heads=4),
    "softcap-explicit": dict(attn_logit_softcap=4.0, n_kv_heads=1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [1, 2, 3, 5])
@pytest.mark.parametrize("prompt", ["shorter", "longer"])
def test_cached_decoding_equals_recompute(case, window, prompt):
    model = _model(window, **CASES[case])
    n = max(1, window - 1) if prompt == "shorter" else window + 4
    prompt_tokens = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(window))
    cached = model.generate(prompt_tokens, max_new_tokens=10)
    assert cached.equal(model.generate(prompt_tokens, max_new_tokens=10, use_kv_cache=False))
    with torch.no_grad():
        full = model(cached)
        torch.testing.assert_close(_steps(model, cached, [n]), full, **TOL)
        # several tokens at a time once the cache holds some (a chunked prefill past the window)
        torch.testing.assert_close(_steps(model, cached, [2, 3, 4]), full, **TOL)


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("case", ["gqa-alternating", "alibi-mha"])
def test_left_padded_batch_decodes_as_each_prompt_alone(window, case):
    model = _model(window, **CASES[case])
    rows = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15]]
    batch = TokenBatch.from_ids(rows, padding_side="left")
    out = model.generate(batch, max_new_tokens=9)
    with torch.no_grad():
        steps = _steps(model, out.tokens, [batch.shape[1]], out.attention_mask)
    for i, row in enumerate(rows):
        alone = model.generate(torch.tensor([row]), max_new_tokens=9)[0]
        assert out.row(i).equal(alone)
        with torch.no_grad():
            torch.testing.assert_close(steps[i][out.attention_mask[i].bool()], model(alone[None])[0], **TOL)


@pytest.mark.parametrize("window", [2, 3])
def test_a_row_with_pads_in_its_middle_keeps_its_window(window):
    # Right padding, then decode: row 1's last real keys sit before its pads, more than window - 1
    # columns back; its cache must still hold them (the storage grows past the window for it).
    model = _model(window, global_every=0)
    rows = [[5, 6, 7, 8, 9, 10], [3, 4, 20]]
    batch = TokenBatch.from_ids(rows, padding_side="right")
    extra = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.make_kv_cache(2, batch.shape[1] + extra.shape[1])
        steps = [model(batch, kv_cache=cache)]
        steps += [model(extra[:, j : j + 1], kv_cache=cache) for j in range(extra.shape[1])]
        steps = torch.cat(steps, dim=1)
        for i, row in enumerate(rows):
            alone = model(torch.tensor([row + extra[i].tolist()]))[0]
            real = torch.cat([batch.attention_mask[i].bool(), torch.ones(extra.shape[1], dtype=torch.bool)])
            torch.testing.assert_close(steps[i][real], alone, **TOL)


@pytest.mark.parametrize("window", [1, 3, 5])
def test_a_sliding_layer_stores_the_window_not_the_context(window):
    cfg = _model(window, n_ctx=40).cfg
    model = wb.HookedDecoder(cfg).eval()
    cache = model.make_kv_cache(3, 30)

    def held_bytes(layer):
        entry = cache[layer]
        return entry.k.numel() * entry.k.element_size() + entry.v.numel() * entry.v.element_size()

    per_position = 3 * 2 * cfg.n_kv_heads * cfg.d_head * 4  # batch x (k, v) x kv heads x d_head x fp32
    expected = [per_position * (window if cfg.layer_is_local(layer) else 30) for layer in range(cfg.n_layers)]
    assert [cfg.layer_is_local(layer) for layer in range(4)] == [True, False, True, False]
    assert [held_bytes(layer) for layer in range(4)] == expected
    tokens = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, kv_cache=cache)  # a prefill past the window
        for j in range(14):
            model(tokens[:, j % 12 : j % 12 + 1], kv_cache=cache)
    assert cache.length == 26
    assert [held_bytes(layer) for layer in range(4)] == expected  # still the window, past it
    assert [cache[layer].held for layer in (0, 2)] == [window - 1] * 2  # what the next query sees beside its own
    # the accounting says the same, from the config alone; per token, only the global layers grow
    assert wb.kv_cache_bytes(cfg, context=30, batch=3, bytes_per_value=4) == sum(expected)
    assert wb.kv_cache_bytes_per_token(cfg, bytes_per_value=4) == 2 * per_position // 3

def test_accounting_without_a_window_and_with_every_layer_local():
    plain = tiny(n_kv_heads=2)
    assert wb.kv_cache_bytes(plain, context=10, batch=2) == 2 * 10 * wb.kv_cache_bytes_per_token(plain)
    mistral = tiny(n_kv_heads=2, sliding_window=4)  # global_every 0: every layer local
    assert wb.kv_cache_bytes_per_token(mistral) == 0  # past the window, a token adds nothing
    per_layer_position = 2 * 2 * 8 * 2  # (k, v) x kv heads x d_head x bf16
    assert wb.kv_cache_bytes(mistral, context=3) == 2 * 3 * per_layer_position  # shorter than the window
    assert wb.kv_cache_bytes(mistral, context=20) == 2 * 4 * per_layer_position
    model = wb.HookedDecoder(mistral).to(torch.bfloat16)
    cache = model.make_kv_cache(1, 20)
    assert sum(e.k.numel() * 2 + e.v.numel() * 2 for e in cache.entries) == wb.kv_cache_bytes(mistral, context=20)
    with pytest.raises(ValueError, match="context must be an integer >= 1"):
        wb.kv_cache_bytes(mistral, context=0)
