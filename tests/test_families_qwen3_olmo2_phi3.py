"""Qwen3, OLMo 2 and Phi-3 in and out, against transformers' own models from random small configs.

Each case is saved with ``save_pretrained`` and imported from the directory (the streamed
reader: no transformers model is built) and from the built model; logits must match HF's to
1e-5 in fp32, greedy KV-cache generation must equal HF's ``generate``, a left-padded batch must
match HF's with its attention mask, and the export must load in transformers as the same
family. Fields the workbench cannot reproduce raise ``UnsupportedHFConfig`` naming the field.
"""

import pytest
import torch
import transformers as T
from factories import tiny
from test_interop import SMALL, VOCAB, _no_network, build_hf, import_saved, max_diff  # noqa: F401 (_no_network: autouse fixture)

import workbench as wb
from workbench.interop import UnsupportedHFConfig, config_from_hf, hf_family_for

TOL = 1e-5
CASES = {
    "qwen3": (T.Qwen3Config, dict(num_key_value_heads=2, head_dim=12, **SMALL)),  # head_dim != 32 / 4
    "qwen3-bias-tied": (T.Qwen3Config, dict(num_key_value_heads=1, head_dim=8, attention_bias=True,
                                            tie_word_embeddings=True, **SMALL)),
    "olmo2": (T.Olmo2Config, dict(num_key_value_heads=2, **SMALL)),
    "olmo2-mha-bias": (T.Olmo2Config, dict(attention_bias=True, rms_norm_eps=1e-5, **SMALL)),
    "phi3": (T.Phi3Config, dict(num_key_value_heads=2, **SMALL)),
    "phi3-partial-rotary": (T.Phi3Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                                "partial_rotary_factor": 0.5}, **SMALL)),
}
# what each exports as: Phi-3 rotating whole heads is a Llama; partial rotary with RMSNorm is Phi-3
EXPORTED_AS = {"qwen3": "Qwen3ForCausalLM", "qwen3-bias-tied": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
               "olmo2-mha-bias": "Olmo2ForCausalLM", "phi3": "LlamaForCausalLM",
               "phi3-partial-rotary": "Phi3ForCausalLM"}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_saved(CASES, tmp_path_factory, max_shard_size="20KB")  # several shards and an index


@pytest.mark.parametrize("name", list(CASES))
def test_import_reproduces_hf_logits(imported, name):
    hf, directory, ours = imported[name]
    assert (directory / "model.safetensors.index.json").exists()
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
        assert max_diff(expected, ours(tokens)) <= TOL
        assert max_diff(expected, wb.from_hf(hf)(tokens)) <= TOL  # a built model imports the same
        # the comparison can fail: a QK-norm or output-norm weight that did not arrive would show
        edited = wb.from_hf(directory)
        leaf = "attn.q_norm.w" if ours.cfg.qk_norm != "none" else "mlp.W_gate"
        edited.state_dict()[f"blocks.1.{leaf}"].mul_(1.5)
        assert max_diff(expected, edited(tokens)) > 1e-3


def test_config_mapping(imported):
    cfg = {name: imported[name][2].cfg for name in CASES}
    q = cfg["qwen3"]
    assert (q.qk_norm, q.norm_placement, q.d_head, q.n_kv_heads, q.bias, q.qkv_bias) == ("head", "pre", 12, 2, False, False)
    qb = cfg["qwen3-bias-tied"]
    assert (qb.d_head, qb.n_kv_heads, qb.bias, qb.qkv_bias, qb.tie_embeddings) == (8, 1, True, True, True)
    o = cfg["olmo2"]
    assert (o.qk_norm, o.norm_placement, o.norm, o.ffn) == ("projection", "reordered", "rmsnorm", "swiglu")
    assert imported["olmo2"][2].blocks[0].attn.k_norm.w.shape == (2 * 8,)  # over n_kv_heads * d_head
    p, pp = cfg["phi3"], cfg["phi3-partial-rotary"]
    assert (p.qk_norm, p.norm_placement, p.rotary_dim, p.n_kv_heads, p.bias) == ("none", "pre", 8, 2, False)
    assert (pp.rotary_dim, pp.rope_base) == (4, 100.0)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "phi3-partial-rotary"])
def test_greedy_generation_matches_hf_generate(imported, name):
    hf, _, ours = imported[name]
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours.generate(prompt, max_new_tokens=8, use_kv_cache=True), expected)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "phi3-partial-rotary"])
def test_left_padded_batch_matches_hf_with_its_mask(imported, name):
    hf, _, ours = imported[name]
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask, position_ids=position_ids).logits
        got = ours(tokens, attention_mask=mask)
    real = mask.bool()
    assert max_diff(expected[real], got[real]) <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip(imported, name, tmp_path):
    hf, _, ours = imported[name]
    wb.to_hf(ours, tmp_path / "out")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == EXPORTED_AS[name]
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert max_diff(back(tokens).logits, hf(tokens).logits) <= TOL
    reimported = wb.from_hf(tmp_path / "out")
    for key, value in ours.state_dict().items():
        assert torch.equal(reimported.state_dict()[key], value), key


def _with_rope(config, **rope):
    config.rope_parameters = {**config.rope_parameters, **rope}
    return config


@pytest.mark.parametrize("make, field", [
    (lambda: _with_rope(T.Phi3Config(**SMALL), rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4),
     "rope_parameters.rope_type='longrope'"),
    (lambda: _with_rope(T.Phi3Config(**SMALL), rope_type="su"), "rope_parameters.rope_type='su'"),
    # Qwen3's default pattern, full below max_window_layers and sliding from it (windows: test_families_sliding)
    (lambda: T.Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **SMALL), "max_window_layers=1"),
    (lambda: _with_rope(T.Olmo2Config(**SMALL), partial_rotary_factor=0.5), "rope_parameters.partial_rotary_factor=0.5"),
    (lambda: _with_rope(T.Qwen3Config(head_dim=8, **SMALL), partial_rotary_factor=0.5),
     "rope_parameters.partial_rotary_factor=0.5"),
])
def test_unreproducible_fields_are_named(make, field):
    with pytest.raises(UnsupportedHFConfig, match=f"field {field}"):
        config_from_hf(make())


def test_phi3_sliding_window_covering_the_context_imports():
    family, cfg = config_from_hf(T.Phi3Config(sliding_window=24, **SMALL))
    assert (family, cfg.n_ctx) == ("phi3", 24)
    _, cfg = config_from_hf(T.Phi3Config(sliding_window=12, **SMALL), n_ctx=12)  # a context the window never cuts
    assert cfg.n_ctx == 12


@pytest.mark.parametrize("overrides, component", [
    (dict(norm_placement="sandwich"), "norm_placement='sandwich'"),
    (dict(qk_norm="projection"), "qk_norm='projection' with norm_placement='pre'"),
    (dict(qk_norm="head", norm_placement="reordered"), "qk_norm='head' with norm_placement='reordered'"),
    (dict(norm="layernorm", qk_norm="head"), "qk_norm='head', norm_placement='pre' with norm='layernorm'"),
    (dict(qk_norm="head", ffn="gelu"), "ffn='gelu' with qk_norm='head'"),
    (dict(rotary_dim=4, bias=True), "biases with rotary_dim < d_head"),
    (dict(rotary_dim=4, qk_norm="head"), "rotary_dim < d_head with QK-norm"),
])
def test_export_without_hf_equivalent_names_the_component(overrides, component):
    cfg = tiny(**{**dict(norm="rmsnorm", positional="rope", ffn="swiglu", bias=False), **overrides})
    with pytest.raises(UnsupportedHFConfig, match=component.replace("(", r"\(").replace(")", r"\)")):
        hf_family_for(cfg)


def test_our_configs_export_to_the_new_families(tmp_path):
    """Configs built here (not imported) pick Qwen3 / OLMo 2 / Phi-3 and load in transformers exactly."""
    base = dict(norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, n_kv_heads=2, tie_embeddings=False)
    for overrides, family in ((dict(qk_norm="head"), "qwen3"),
                              (dict(qk_norm="projection", norm_placement="reordered"), "olmo2"),
                              (dict(rotary_dim=4), "phi3")):
        model = wb.HookedDecoder(tiny(**base, **overrides)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
        assert hf_family_for(model.cfg) == family
        wb.to_hf(model, tmp_path / family)
        back = T.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
        assert back.config.model_type == family
        tokens = torch.randint(0, 50, (2, 10))
        with torch.no_grad():
            assert max_diff(back(tokens).logits, model(tokens)) <= TOL


@pytest.mark.parametrize("name, extra", [
    ("qwen3", ("attn.hook_q_normed", "attn.hook_k_normed", "attn.q_norm.hook_scale", "ln1.hook_scale")),
    ("olmo2", ("attn.hook_q_normed", "attn.hook_k_normed", "ln1_post.hook_scale", "ln2_post.hook_scale")),
])
def test_run_with_cache_matches_transformer_bridge(imported, name, extra):
    """TransformerLens' bridge names the same things the same way: hook_q is the projection,
    hook_q_normed the QK-normed query, hook_attn_out the output norm's output (OLMo 2)."""
    from test_interop import _shared_hook_diffs, bridge_and_our_runs

    bridge_logits, bridge_cache, our_logits, our_cache = bridge_and_our_runs(*imported[name])
    # The bridge's QK-normed tensors keep HF's layout ([batch, head, pos, d_head] for Qwen3, the flat
    # [batch, pos, n_heads * d_head] projection for OLMo 2); ours are [batch, pos, head, d_head] as hook_q.
    theirs = {k: v for k, v in bridge_cache.items()}
    for k in [k for k in theirs if k in our_cache and (k.endswith("_normed") or "_norm.hook_" in k)]:
        v, target = theirs[k], our_cache[k].shape
        if v.shape != target:
            theirs[k] = v.transpose(1, 2) if v.ndim == 4 else v.reshape(target)
    diffs = _shared_hook_diffs(theirs, our_cache, 0)
    for hook in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post",
                 "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern", "attn.hook_z", *extra):
        assert f"blocks.1.{hook}" in diffs, hook
    assert all(d <= TOL for d in diffs.values()), {k: v for k, v in diffs.items() if v > TOL}
    assert max_diff(bridge_logits, our_logits) <= TOL
