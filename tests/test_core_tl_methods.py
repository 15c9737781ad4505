"""TransformerLens utilities that read our model's weights and cache, against direct computations.

The cache methods the README names (``accumulated_resid``, ``decompose_resid``,
``stack_head_results``, ``logit_attrs``, ``apply_ln_to_stack``) are checked with ``apply_ln=True``
on models whose norms keep trained-looking weights and on the same models after
``process_weights``, LayerNorm and RMSNorm: against the library's DLA and logit lens, against
the model's own activations (what a norm's reader actually receives), and by hand.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from transformer_lens import ActivationCache, FactoredMatrix

import workbench as wb
from factories import tiny
from workbench.analysis import direct_logit_attribution, logit_lens
from workbench.cache import WorkbenchCache

REPO = Path(__file__).resolve().parents[1]


def make(**kw):
    model = wb.HookedDecoder(tiny(n_kv_heads=2, tie_embeddings=False, **kw)).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():  # norm weights far from 1 and nonzero biases, so both matter
            p.add_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim == 1 else 0.05))
    return model


def test_factored_qk_and_ov_circuits():
    model = make()
    assert isinstance(model.OV, FactoredMatrix) and model.OV.shape == (2, 4, 32, 32)
    l, h = 1, 3
    torch.testing.assert_close(model.OV[l, h].AB, model.blocks[l].attn.W_V[h] @ model.blocks[l].attn.W_O[h])
    torch.testing.assert_close(model.QK[l, h].AB, model.blocks[l].attn.W_Q[h] @ model.blocks[l].attn.W_K[h].T)
    assert model.W_K.shape == (2, 4, 32, 8)  # GQA keys repeated per query head


def test_tokens_to_residual_directions_and_logit_attrs():
    model = make()
    toks = torch.randint(0, 50, (3, 10))
    torch.testing.assert_close(model.tokens_to_residual_directions(7), model.W_U[:, 7])
    assert model.tokens_to_residual_directions(toks[:, -1]).shape == (3, 32)
    logits, cache = model.run_with_cache(toks)
    answer, wrong = toks[:, -1], (toks[:, -1] + 1) % 50
    stack = cache.decompose_resid()
    # logit_attrs applies the final norm (scale of this run and its weight) to each part
    attrs = cache.logit_attrs(stack[:, :, -1], tokens=answer, incorrect_tokens=wrong, pos_slice=-1)
    final = logits[:, -1]
    diff = final.gather(1, answer[:, None])[:, 0] - final.gather(1, wrong[:, None])[:, 0]
    # the final norm's bias is a constant that belongs to no part
    bias_part = model.ln_final.b @ (model.W_U[:, answer] - model.W_U[:, wrong])
    torch.testing.assert_close(attrs.sum(0) + bias_part, diff, atol=1e-4, rtol=1e-4)


def test_accumulated_bias():
    model = make()
    expected = model.blocks[0].attn.b_O + model.blocks[0].mlp.b_out + model.blocks[1].attn.b_O
    torch.testing.assert_close(model.accumulated_bias(1, mlp_input=True), expected)


# ---- the cache's norm-applying methods, unprocessed and processed ------------------------------
NORMS = {"layernorm": dict(), "rmsnorm": dict(norm="rmsnorm", ffn="swiglu", positional="rope")}
TOKENS = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(4))
ANSWER, WRONG = TOKENS[:, -1], (TOKENS[:, -1] + 7) % 50


@pytest.fixture(params=[(n, p) for n in NORMS for p in (False, True)], ids=lambda v: f"{v[0]}-{'processed' if v[1] else 'raw'}")
def run(request):
    norm, processed = request.param
    model = make(**NORMS[norm])
    if processed:
        model.process_weights()
        assert model.cfg.normalization_type in ("LNPre", "RMSPre")
    logits, cache = model.run_with_cache(TOKENS)
    return model, logits, cache


def bias(norm):
    return getattr(norm, "b", 0.0)  # RMSNorm has none


def norm_by_hand(model, x, norm, scale):
    """What a norm's weight sees of a part ``x``: centred (LayerNorm), divided by the run's scale, times w."""
    if model.cfg.norm == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    return x / scale * norm.w


def test_cache_is_an_activation_cache(run):
    model, _, cache = run
    assert isinstance(cache, ActivationCache) and isinstance(cache, WorkbenchCache)
    assert isinstance(cache.apply_slice_to_batch_dim((0, 2)), WorkbenchCache)


def test_logit_attrs_per_head_equal_the_library_dla(run):
    model, _, cache = run
    stack, labels = cache.stack_head_results(pos_slice=-1, return_labels=True)
    attrs = cache.logit_attrs(stack, tokens=ANSWER, incorrect_tokens=WRONG, pos_slice=-1)
    table = direct_logit_attribution(model, TOKENS, ANSWER, WRONG)
    heads = table[(table.granularity == "head") & (table.kind == "head")]
    ours = heads.pivot(index="component", columns="batch", values="attribution").loc[labels].to_numpy()
    np.testing.assert_allclose(attrs.detach().numpy(), ours, atol=1e-4, rtol=1e-4)


def test_decompose_resid_with_apply_ln_is_what_each_reader_receives(run):
    model, logits, cache = run
    n = model.cfg.n_layers
    # final norm: the parts sum to ln_final's output less its bias, and each part is its own share
    parts = cache.decompose_resid(apply_ln=True, pos_slice=-1)
    raw = cache.decompose_resid(pos_slice=-1)
    torch.testing.assert_close(parts, norm_by_hand(model, raw, model.ln_final, cache["ln_final.hook_scale"][:, -1]))
    final = model.ln_final(cache[f"blocks.{n - 1}.hook_resid_post"])[:, -1]
    torch.testing.assert_close(parts.sum(0) + bias(model.ln_final), final, atol=1e-5, rtol=1e-5)
    # layer 1's ln1: the parts, through W_Q, sum to the queries the model computed
    block = model.blocks[1]
    parts = cache.decompose_resid(layer=1, apply_ln=True)
    q = torch.einsum("cbpd,hde->bphe", parts, block.attn.W_Q) + (bias(block.ln1) @ block.attn.W_Q if model.cfg.norm == "layernorm" else 0) + block.attn.b_Q
    torch.testing.assert_close(q, cache["blocks.1.attn.hook_q"], atol=1e-5, rtol=1e-5)
    # layer 1's ln2 (mlp_input): through W_in, the parts sum to the MLP's linear pre-activation
    parts = cache.decompose_resid(layer=1, mlp_input=True, apply_ln=True)
    pre = torch.einsum("cbpd,dm->bpm", parts, block.mlp.W_in) + (bias(block.ln2) @ block.mlp.W_in if model.cfg.norm == "layernorm" else 0) + block.mlp.b_in
    site = "hook_pre_linear" if model.cfg.gated_mlp else "hook_pre"
    torch.testing.assert_close(pre, cache[f"blocks.1.mlp.{site}"], atol=1e-5, rtol=1e-5)


def test_accumulated_resid_with_apply_ln(run):
    model, logits, cache = run
    # up to the final layer: TL recomputes the norm per layer (the logit lens) ...
    resid = cache.accumulated_resid(apply_ln=True)
    lens_logp = (resid @ model.W_U + model.b_U).log_softmax(-1)
    final_logp = logits.log_softmax(-1)
    kl = (final_logp.exp() * (final_logp - lens_logp)).sum(-1)  # [layer, batch, pos]
    table = logit_lens(model, TOKENS, k=1).sort_values(["layer", "batch", "pos"])
    np.testing.assert_allclose(table.kl_to_final.to_numpy(), kl.detach().numpy().ravel(), atol=1e-5)
    np.testing.assert_allclose(table.top1_id.to_numpy(), lens_logp.argmax(-1).numpy().ravel())
    torch.testing.assert_close(model.unembed(resid[-1]), logits, atol=1e-4, rtol=1e-4)
    # ... into a block: the cached scale of that block's ln1, and its weight
    resid = cache.accumulated_resid(layer=1, apply_ln=True, pos_slice=-1)
    expected = cache["blocks.1.ln1.hook_normalized"][:, -1] * model.blocks[1].ln1.w
    torch.testing.assert_close(resid[-1], expected, atol=1e-5, rtol=1e-5)


def test_stack_head_results_and_apply_ln_to_stack_by_hand(run):
    model, _, cache = run
    stack = cache.stack_head_results(apply_ln=True, pos_slice=-1)
    z = torch.cat([cache[f"blocks.{l}.attn.hook_z"][:, -1] for l in range(model.cfg.n_layers)], dim=1)
    W_O = torch.cat([b.attn.W_O for b in model.blocks], dim=0)
    heads = torch.einsum("bhe,hed->hbd", z, W_O)
    torch.testing.assert_close(stack, norm_by_hand(model, heads, model.ln_final, cache["ln_final.hook_scale"][:, -1]))
    # apply_ln_to_stack itself, into layer 1's ln2, with a batch slice
    raw = cache.decompose_resid(layer=1, mlp_input=True)
    got = cache.apply_ln_to_stack(raw, layer=1, mlp_input=True, batch_slice=(1, 3))
    scale = cache["blocks.1.ln2.hook_scale"][1:3]
    torch.testing.assert_close(got, norm_by_hand(model, raw[:, 1:3], model.blocks[1].ln2, scale))


def test_projected_neuron_stack_includes_the_norm_weight():
    model = make()
    _, cache = model.run_with_cache(TOKENS)
    direction = model.W_U[:, ANSWER[0]] - model.W_U[:, WRONG[0]]
    full = cache.stack_neuron_results(layer=2, apply_ln=True, pos_slice=-1)  # explicit path
    projected = cache.stack_neuron_results(layer=2, apply_ln=True, pos_slice=-1, project_output_onto=direction)
    torch.testing.assert_close(projected, full @ direction, atol=1e-5, rtol=1e-4)


def test_pos_slice_with_apply_ln_without_a_batch_dim():
    model = make()
    _, cache = model.run_with_cache(TOKENS[:1], remove_batch_dim=True)
    parts = cache.decompose_resid(apply_ln=True, pos_slice=-1)
    assert parts.shape == (6, 32)  # embed, pos_embed, 2 x (attn, mlp)
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens=3, incorrect_tokens=4, pos_slice=-1,
                              has_batch_dim=False)
    torch.testing.assert_close(attrs, parts @ (model.W_U[:, 3] - model.W_U[:, 4]))


# ---- the shipped RMSNorm checkpoint ------------------------------------------------------------
def test_stories_2026_per_head_dla_through_logit_attrs():
    path = REPO / "checkpoints" / "stories-2026"
    if not (path / "config.json").exists():
        pytest.skip("checkpoints/stories-2026 is not built yet")
    from workbench.data import get_task

    model, _ = wb.load_checkpoint(path)
    prompts = get_task("stories").ioi_prompts(16, seed=0)
    table = direct_logit_attribution(model, prompts.tokens, prompts.correct, prompts.wrong)
    heads = table[(table.granularity == "head") & (table.kind == "head")]
    with torch.no_grad():
        _, cache = model.run_with_cache(prompts.tokens)
    stack, labels = cache.stack_head_results(pos_slice=-1, return_labels=True)
    expected = heads.pivot(index="component", columns="batch", values="attribution").loc[labels].to_numpy()

    def attrs(c, stack):
        return c.logit_attrs(stack, prompts.correct, prompts.wrong, pos_slice=-1).detach().numpy()

    np.testing.assert_allclose(attrs(cache, stack), expected, atol=1e-4, rtol=1e-4)
    # TL's own cache drops ln_final.w: off by logits on this model (what the README used to promise)
    plain = ActivationCache(cache.cache_dict, model)
    assert np.abs(attrs(plain, stack) - expected).max() > 0.5
    # after process_weights TL's assumption holds, and its own cache is exact too
    folded, _ = wb.load_checkpoint(path, fold_ln=True)
    with torch.no_grad():
        _, cache = folded.run_with_cache(prompts.tokens)
    stack = cache.stack_head_results(pos_slice=-1)
    np.testing.assert_allclose(attrs(ActivationCache(cache.cache_dict, folded), stack), expected, atol=1e-4, rtol=1e-4)


def test_apply_ln_to_a_layer_without_an_input_norm_is_named():
    """OLMo 2's reordered block normalises after each sublayer: no norm reads layer l's input."""
    model = wb.HookedDecoder(tiny(norm="rmsnorm", norm_placement="reordered")).eval()
    _, cache = model.run_with_cache(torch.randint(0, 50, (1, 5)))
    stack = cache.decompose_resid(layer=1, apply_ln=False)
    with pytest.raises(ValueError, match="reordered"):
        cache.apply_ln_to_stack(stack, layer=1)
    assert cache.apply_ln_to_stack(stack).shape == stack.shape  # the final norm is there


def test_run_with_cache_is_transformer_lens_run_with_cache():
    """Our run_with_cache (its own hook path for the common call, TransformerLens' for the rest) stores
    what HookedRootModule.run_with_cache stores, for each kind of names_filter and each option."""
    from transformer_lens import HookedRootModule

    model = make()
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
    for options in ({}, {"names_filter": "blocks.0.attn.hook_z"}, {"names_filter": names},
                    {"names_filter": lambda name: name.endswith("hook_q")}, {"names_filter": names, "pos_slice": 2},
                    {"names_filter": names, "device": "cpu"}, {"names_filter": names, "incl_bwd": True}):
        kwargs = {"return_type": "loss"} if options.get("incl_bwd") else {}
        ours_out, ours = model.run_with_cache(TOKENS[:2], attention_mask=mask, **kwargs, **options)
        their_out, theirs = HookedRootModule.run_with_cache(model, TOKENS[:2], attention_mask=mask, **kwargs, **options)
        model.zero_grad()
        torch.testing.assert_close(ours_out, their_out, atol=0, rtol=0)
        assert isinstance(ours, WorkbenchCache)
        assert sorted(ours.keys()) == sorted(theirs.keys()) and len(theirs.keys()) > 0, options
        for name in theirs.keys():
            assert torch.equal(ours[name], theirs[name]), (options, name)
    _, ours = model.run_with_cache(TOKENS[:1], remove_batch_dim=True)
    _, theirs = HookedRootModule.run_with_cache(model, TOKENS[:1], remove_batch_dim=True)
    assert sorted(ours.keys()) == sorted(theirs.keys()) and all(torch.equal(ours[n], theirs[n]) for n in theirs.keys())
