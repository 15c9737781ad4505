"""The block layouts: every entry of LAYOUTS is picked by its config, and ``Block.resume`` from
any mid-block site runs the same layout as ``forward`` (bit for bit with the clean values, and
equal to a hooked forward with a replaced one)."""

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.components.block import LAYOUTS, layout_of


@pytest.fixture(params=list(LAYOUTS))
def model(request):
    cfg = tiny(**dict(LAYOUTS[request.param].config), bias=True)
    model = wb.HookedDecoder(cfg).eval()
    with torch.no_grad():  # non-zero biases and norm weights, so no term vanishes by accident
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    assert layout_of(cfg) == request.param and model.blocks[0].layout == request.param
    return model


def _block_cache(model, tokens):
    """The blocks' own activations only: caching a norm's or attention's inner hooks switches it
    from the fused kernel to the explicit one, which rounds differently."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.count(".") == 2)
    return cache


def test_resume_with_the_clean_values_equals_forward_exactly(model):
    tokens = torch.randint(0, 50, (2, 7))
    cache = _block_cache(model, tokens)
    for block in model.blocks:
        at = lambda site: cache[f"blocks.{block.layer}.hook_{site}"]  # noqa: E731
        for site in block.sites:
            given = {s: at(s) for s in (site, *block.unaffected_by(site))}
            assert torch.equal(block.resume(at("resid_pre"), **given), at("resid_post")), site
        assert torch.equal(block.resume(at("resid_pre")), at("resid_post"))  # nothing given: forward


def test_resume_with_a_replaced_site_equals_a_hooked_forward(model):
    tokens = torch.randint(0, 50, (2, 7))
    layer = model.cfg.n_layers - 1
    block = model.blocks[layer]
    cache = _block_cache(model, tokens)
    for site in block.sites:
        name = f"blocks.{layer}.hook_{site}"
        new = torch.randn_like(cache[name])
        expected = model.run_with_hooks(tokens, stop_at_layer=layer + 1, fwd_hooks=[(name, lambda act, hook: new)])
        unchanged = {s: cache[f"blocks.{layer}.hook_{s}"] for s in block.unaffected_by(site)}
        got = block.resume(cache[f"blocks.{layer}.hook_resid_pre"], **unchanged, **{site: new})
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for other in set(block.sites) - {site}:  # unaffected_by is exactly what stays the same
            other_name, seen = f"blocks.{layer}.hook_{other}", {}
            model.run_with_hooks(tokens, fwd_hooks=[(name, lambda act, hook: new),
                                                    (other_name, lambda act, hook: seen.update(act=act))])
            assert torch.equal(seen["act"], cache[other_name]) == (other in block.unaffected_by(site)), (site, other)


def test_resume_refuses_a_site_the_layout_lacks():
    block = wb.HookedDecoder(tiny(attn_only=True)).blocks[0]
    x = torch.zeros(1, 3, 32)
    with pytest.raises(ValueError, match="has no mlp_out"):
        block.resume(x, mlp_out=x)
    with pytest.raises(ValueError, match="site='resid_mid' is not in the attn_only_pre layout"):
        block.unaffected_by("resid_mid")
