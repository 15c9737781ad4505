"""Weight processing (fold_ln, center_writing_weights, center_unembed, fold_value_biases).

Every variant keeps its predictions (fp32); the processed weights equal those of TransformerLens'
own ``ProcessWeights`` applied to the same state dict; processed models save, load and export;
what cannot be processed is refused with an error that names the switch.
"""

import re

import pytest
import torch
from factories import tiny
from transformer_lens.weight_processing import ProcessWeights

import workbench as wb
from workbench.components.norm import LayerNormPre, RMSNormPre
from workbench.interop import UnsupportedHFConfig
from workbench.processing import model_state, process_state

VARIANTS = {
    "layernorm-tied": dict(),
    "rmsnorm-tied": dict(norm="rmsnorm"),
    "layernorm-untied-gqa-swiglu": dict(n_kv_heads=2, tie_embeddings=False, ffn="swiglu"),
    "rmsnorm-llama-like": dict(norm="rmsnorm", n_kv_heads=2, ffn="swiglu", bias=False, tie_embeddings=False,
                               positional="rope"),
    "layernorm-parallel-rope": dict(parallel_residual=True, positional="rope", tie_embeddings=False),
    "rmsnorm-parallel-geglu": dict(norm="rmsnorm", parallel_residual=True, ffn="geglu"),
    "rmsnorm-moe-gqa": dict(norm="rmsnorm", ffn="moe", n_kv_heads=2, tie_embeddings=False),
    "layernorm-moe": dict(ffn="moe", n_kv_heads=1),
    "layernorm-bias-free": dict(bias=False, positional="alibi"),
    "rmsnorm-qkv-bias-only": dict(norm="rmsnorm", bias=False, qkv_bias=True, n_kv_heads=2, positional="rope"),
    "layernorm-attn-only-sinusoidal": dict(attn_only=True, positional="sinusoidal", tie_embeddings=False),
    "no-norm": dict(norm="none", positional="rope"),
}


def randomised(cfg):
    """A model whose norm weights, biases and value biases are far from their init."""
    model = wb.HookedDecoder(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim == 1 else 0.05))
        if cfg.ffn == "moe" and cfg.norm == "layernorm":  # a router cannot absorb a LayerNorm bias
            for block in model.blocks:
                block.ln2.b.zero_()
    return model


TOKENS = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(2))


def assert_same_predictions(before, after, centred: bool):
    """<= 1e-4 relative to the logit scale; centred: logits equal up to a per-position constant."""
    tol = 1e-4 * max(1.0, before.abs().max().item())
    if centred:
        before, after = before - before.mean(-1, keepdim=True), after - after.mean(-1, keepdim=True)
    assert (after - before).abs().max().item() <= tol


@pytest.mark.parametrize("name", list(VARIANTS))
def test_processing_keeps_predictions(name):
    model = randomised(tiny(**VARIANTS[name]))
    before = model(TOKENS)
    model.process_weights()
    after = model(TOKENS)
    assert_same_predictions(before, after, centred=True)
    torch.testing.assert_close(after.log_softmax(-1), before.log_softmax(-1), atol=1e-4, rtol=0)
    cfg = model.cfg
    if cfg.norm == "none":
        assert not cfg.folded_ln and cfg.normalization_type is None
    else:
        assert cfg.folded_ln and not cfg.tie_embeddings
        assert cfg.normalization_type == {"layernorm": "LNPre", "rmsnorm": "RMSPre"}[cfg.norm]
        weightless = LayerNormPre if cfg.norm == "layernorm" else RMSNormPre
        assert all(isinstance(m, weightless) for n, m in model.named_modules() if n.endswith(("ln1", "ln2", "ln_final")))
        assert not any(n.endswith((".w", ".b")) for n in model.state_dict())
    assert all(bool((b.attn._b_V == 0).all()) for b in model.blocks)  # value biases folded into b_O
    # the hooks were rebuilt with the modules: caching still reaches every norm scale
    _, cache = model.run_with_cache(TOKENS)
    if cfg.norm != "none":
        assert "ln_final.hook_scale" in cache.cache_dict and "blocks.1.ln1.hook_scale" in cache.cache_dict


@pytest.mark.parametrize("name", ["layernorm-untied-gqa-swiglu", "rmsnorm-moe-gqa", "layernorm-parallel-rope"])
def test_each_switch_alone_keeps_logits(name):
    for switch in ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"):
        model = randomised(tiny(**VARIANTS[name]))
        if switch == "center_writing_weights" and model.cfg.norm != "layernorm":
            continue
        before = model(TOKENS)
        flags = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
        model.process_weights(**{**flags, switch: True})
        assert_same_predictions(before, model(TOKENS), centred=switch == "center_unembed")


def test_processing_is_idempotent():
    model = randomised(tiny(n_kv_heads=2, ffn="swiglu"))
    model.process_weights()
    once = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = model.cfg
    model.process_weights()
    assert model.cfg == cfg
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, once[k], atol=1e-6, rtol=0)


# ---- against TransformerLens' own ProcessWeights ------------------------------------------------
def tl_layout(cfg, state):
    """Our state dict under the keys TL's ProcessWeights reads: MHA keys/values without the GQA
    underscore; MoE router and experts in the [out, in] layout of its bridge state dicts."""
    out = {}
    for k, v in state.items():
        if cfg.n_key_value_heads is None:
            k = k.replace("._W_", ".W_").replace("._b_", ".b_")
        if cfg.ffn == "moe" and re.search(r"mlp\.(experts\.\d+\.)?W_(in|gate)$", k):
            k, v = k + ".weight", v.T
        out[k] = v.clone()
    return out


@pytest.mark.parametrize("name", [n for n in VARIANTS if VARIANTS[n].get("norm") != "none"
                                  and not (VARIANTS[n].get("ffn") == "moe" and VARIANTS[n].get("norm") != "rmsnorm")])
def test_matches_transformer_lens_process_weights(name):
    model = randomised(tiny(**VARIANTS[name]))
    state = model_state(model)
    _, ours = process_state(model.cfg, state)
    given = tl_layout(model.cfg, state)
    if model.cfg.positional == "sinusoidal":  # TL centres any W_pos; ours is a fixed table, no weight
        given["pos_embed.W_pos"] = model.pos_embed.W_pos.clone()
    theirs = ProcessWeights.process_weights(given, model.cfg)
    if model.cfg.positional == "sinusoidal":
        del theirs["pos_embed.W_pos"]
    ours = tl_layout(model.cfg, ours)
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        reference = theirs[key]
        if key.endswith("mlp.W_gate") and model.cfg.norm == "layernorm":
            # TL centres W_in but not W_gate after folding a LayerNorm; we centre every reader.
            # Both are exact (the folded norm's output has zero mean); only the mean differs.
            reference = reference - reference.mean(0, keepdim=True)
        torch.testing.assert_close(value, reference, atol=2e-6, rtol=1e-5, msg=key)


def test_processed_cache_agrees_with_transformer_lens_folded_cache():
    """After processing, TL's own ActivationCache (which assumes folded norms) is exact: its
    per-head logit attributions equal the unprocessed model's through WorkbenchCache."""
    from transformer_lens import ActivationCache

    model = randomised(tiny(n_kv_heads=2, ffn="swiglu", tie_embeddings=False))
    answer, wrong = TOKENS[:, -1], (TOKENS[:, -1] + 1) % 50
    _, cache = model.run_with_cache(TOKENS)
    expected = cache.logit_attrs(cache.stack_head_results(pos_slice=-1), answer, wrong, pos_slice=-1)
    model.process_weights(center_writing_weights=False, fold_value_biases=False)
    _, processed = model.run_with_cache(TOKENS)
    plain = ActivationCache(processed.cache_dict, model)
    got = plain.logit_attrs(plain.stack_head_results(pos_slice=-1), answer, wrong, pos_slice=-1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# ---- saving, loading, importing, exporting -----------------------------------------------------
@pytest.mark.parametrize("name", ["layernorm-tied", "rmsnorm-llama-like", "layernorm-bias-free", "rmsnorm-moe-gqa"])
def test_processed_model_round_trips_through_a_checkpoint(name, tmp_path):
    model = randomised(tiny(**VARIANTS[name]))
    wb.save_checkpoint(model, tmp_path / "raw")
    model.process_weights()
    wb.save_checkpoint(model, tmp_path / "processed")
    loaded, _ = wb.load_checkpoint(tmp_path / "processed")
    assert loaded.cfg == model.cfg
    torch.testing.assert_close(loaded(TOKENS), model(TOKENS), atol=0, rtol=0)
    # the same processing as a loader switch
    switched, _ = wb.load_checkpoint(tmp_path / "raw", fold_ln=True, center_writing_weights=model.cfg.norm == "layernorm",
                                     center_unembed=True, fold_value_biases=True)
    assert switched.cfg == model.cfg
    torch.testing.assert_close(switched(TOKENS), model(TOKENS), atol=1e-5, rtol=1e-5)


def test_from_hf_processing_switches():
    import transformers as T

    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(T.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
        max_position_embeddings=24, intermediate_size=40, attention_bias=True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = wb.from_hf(hf, fold_ln=True, center_unembed=True, fold_value_biases=True)
    assert model.cfg.folded_ln and model.cfg.normalization_type == "RMSPre"
    expected = hf(TOKENS).logits
    assert_same_predictions(expected, model(TOKENS), centred=True)


def test_export_of_processed_models(tmp_path):
    import transformers as T

    rms = randomised(tiny(**VARIANTS["rmsnorm-llama-like"]))
    before = rms(TOKENS)
    rms.process_weights()
    wb.to_hf(rms, tmp_path / "llama")  # a folded RMSNorm is an RMSNorm with unit weight: exact
    exported = T.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    assert_same_predictions(before, exported(TOKENS).logits, centred=True)
    ln = randomised(tiny()).process_weights()
    with pytest.raises(UnsupportedHFConfig, match="folded LayerNorm"):
        wb.to_hf(ln, tmp_path / "gpt2")


# ---- what is refused ---------------------------------------------------------------------------
def test_post_norm_cannot_be_folded():
    model = randomised(tiny(norm_placement="post"))
    with pytest.raises(ValueError, match="fold_ln=True is impossible with norm_placement='post'"):
        model.process_weights()
    with pytest.raises(ValueError, match="center_writing_weights=True needs"):
        model.process_weights(fold_ln=False, center_writing_weights=True)
    before = model(TOKENS)  # what stays valid for post-norm: centring the unembedding, folding b_V
    model.process_weights(fold_ln=False)
    assert not model.cfg.folded_ln
    assert_same_predictions(before, model(TOKENS), centred=True)
    with pytest.raises(ValueError, match="folded_ln=True needs a pre-norm model"):
        tiny(norm_placement="post", folded_ln=True)


def test_center_writing_weights_needs_layernorm():
    model = randomised(tiny(norm="rmsnorm"))
    with pytest.raises(ValueError, match="center_writing_weights=True needs norm='layernorm'"):
        model.process_weights(center_writing_weights=True)
    before = model(TOKENS)
    model.process_weights()  # the default centres only where that is valid
    assert_same_predictions(before, model(TOKENS), centred=True)


def test_layernorm_bias_in_front_of_a_router_is_refused():
    model = randomised(tiny(ffn="moe"))
    with torch.no_grad():
        model.blocks[1].ln2.b.add_(0.1)
    with pytest.raises(ValueError, match="layer 1's LayerNorm bias into the MoE router"):
        model.process_weights()


def test_tied_model_is_untied_only_when_needed():
    model = randomised(tiny(norm="none"))
    model.process_weights(center_unembed=False)  # only value biases: W_U stays W_E^T
    assert model.cfg.tie_embeddings and model.W_U.data_ptr() == model.W_E.data_ptr()
    model.process_weights()
    assert not model.cfg.tie_embeddings


def test_device_dtype_mode_and_tokenizer_are_kept():
    model = randomised(tiny(norm="rmsnorm", ffn="swiglu")).to(torch.bfloat16).train()
    model.tokenizer = object()
    tokenizer = model.tokenizer
    model.process_weights()
    assert model.training and model.tokenizer is tokenizer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.ln_final.w.dtype == torch.bfloat16
