"""Hugging Face interop: every family against transformers' own forward, generate and loader.

Every HF model is built here from a tiny config with random weights (perturbed so that norm
weights and biases are not their trivial init), saved to a temporary directory and imported;
nothing is downloaded (a fixture makes any network connection fail). The logit differences
are printed (run with ``-s``) and must stay <= 1e-4 in fp32.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import socket

import pytest
import torch
import transformers as T
from factories import tiny

import workbench as wb
from workbench.interop import UnsupportedHFConfig, config_from_hf, hf_family_for, looks_like_hf_dir
from workbench.interop.hf_tokenizer import HFTokenizer

TOL = 1e-4
VOCAB = 50
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=24, intermediate_size=40, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)

# name -> (HF config class, kwargs); each is one family or one switch of a family.
HF_CASES = {
    "gpt2": (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=24,
                                bos_token_id=None, eos_token_id=None)),
    "gpt2-untied-relu": (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=24,
                                            n_inner=48, activation_function="relu", tie_word_embeddings=False,
                                            bos_token_id=None, eos_token_id=None)),
    "llama": (T.LlamaConfig, dict(num_key_value_heads=2, **SMALL)),
    "llama-tied-biases-headdim": (T.LlamaConfig, dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
                                                      mlp_bias=False, head_dim=16, hidden_act="gelu", **SMALL)),
    "mistral": (T.MistralConfig, dict(num_key_value_heads=2, sliding_window=None, **SMALL)),
    "qwen2": (T.Qwen2Config, dict(num_key_value_heads=2, **SMALL)),
    "mixtral": (T.MixtralConfig, dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **SMALL)),
    "gpt_neox": (T.GPTNeoXConfig, dict(**SMALL)),
    # DeepSeek: MLA (expert width 16: transformers' bf16 grouped_mm wants 16-byte strides); V2 softmax group-limited routing, V3 sigmoid routing with a score bias and query compression
    "deepseek_v2": (T.DeepseekV2Config, dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                             v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                             moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1,
                                             topk_method="group_limited_greedy", routed_scaling_factor=1.5, **SMALL)),
    "deepseek_v3": (T.DeepseekV3Config, dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                             v_head_dim=6, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                                             moe_intermediate_size=16, first_k_dense_replace=1, n_group=4, topk_group=2,
                                             num_key_value_heads=4, **SMALL)),
    "deepseek_v3-halves-bias-dense": (T.DeepseekV3Config, dict(
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_interleave=False,
        attention_bias=True, first_k_dense_replace=2, num_key_value_heads=4, n_group=1, topk_group=1, **SMALL)),
    "gpt_neox-sequential-nobias": (T.GPTNeoXConfig, dict(use_parallel_residual=False, attention_bias=False,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                                          "partial_rotary_factor": 0.5}, **SMALL)),
}


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Interop must work offline: any socket connection is a test failure."""

    def refuse(*args, **kwargs):
        raise RuntimeError("network access attempted during an interop test")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def build_hf(config_class, **kwargs):
    """An HF causal LM with random weights, every parameter perturbed away from its init."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # a weight kept as a buffer (DeepSeek-V3's router bias)
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def perturb(model, scale=0.1):
    """Our model with nonzero biases and non-unit norms, so the export maps every tensor."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def import_saved(cases, tmp_path_factory, **save_kwargs):
    """name -> (hf_model, directory, our model imported from the saved directory), for each
    name -> (HF config class, kwargs) of ``cases``."""
    out = {}
    for name, (config_class, kwargs) in cases.items():
        hf = build_hf(config_class, **kwargs)
        directory = tmp_path_factory.mktemp(name)
        hf.save_pretrained(directory, **save_kwargs)
        out[name] = (hf, directory, wb.from_hf(directory))
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (hf_model, directory, our model); built once per module."""
    return import_saved(HF_CASES, tmp_path_factory)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_import_reproduces_hf_logits(imported, name):
    hf, directory, ours = imported[name]
    tokens = torch.randint(0, VOCAB, (3, 20))
    with torch.no_grad():
        diff = max_diff(hf(tokens).logits, ours(tokens))
    print(f"\n[interop] {name}: import max |logit diff| = {diff:.2e}")
    assert diff <= TOL
    assert looks_like_hf_dir(directory) and ours.training is False


def test_import_config_mapping(imported):
    """The switches land on the fields they should, not just on matching logits."""
    cfg = {name: imported[name][2].cfg for name in HF_CASES}
    assert (cfg["gpt2"].ffn, cfg["gpt2"].tie_embeddings, cfg["gpt2"].positional) == ("gelu_new", True, "learned")
    assert (cfg["gpt2-untied-relu"].ffn, cfg["gpt2-untied-relu"].d_mlp, cfg["gpt2-untied-relu"].tie_embeddings) == ("relu", 48, False)
    assert (cfg["llama"].n_kv_heads, cfg["llama"].bias, cfg["llama"].tie_embeddings) == (2, False, False)
    odd = cfg["llama-tied-biases-headdim"]
    assert (odd.d_head, odd.n_kv_heads, odd.ffn, odd.bias, odd.qkv_bias, odd.tie_embeddings) == (16, 1, "geglu", True, True, True)
    assert (cfg["qwen2"].bias, cfg["qwen2"].qkv_bias) == (False, True)
    assert (cfg["mixtral"].ffn, cfg["mixtral"].moe_expert, cfg["mixtral"].n_experts) == ("moe", "swiglu", 4)
    assert (cfg["gpt_neox"].parallel_residual, cfg["gpt_neox"].rotary_dim) == (True, 2)  # rotary_pct 0.25 of 8
    seq = cfg["gpt_neox-sequential-nobias"]
    assert (seq.parallel_residual, seq.rotary_dim, seq.qkv_bias, seq.bias, seq.rope_base) == (False, 4, False, True, 500.0)


def test_deepseek_import_within_1e5_and_config_mapping(imported):
    """MLA and DeepSeek's MoE reproduce transformers' DeepSeek-V2/V3 to 1e-5 in fp32."""
    for name in ("deepseek_v2", "deepseek_v3", "deepseek_v3-halves-bias-dense"):
        hf, _, ours = imported[name]
        tokens = torch.randint(0, VOCAB, (3, 20))
        with torch.no_grad():
            assert max_diff(hf(tokens).logits, ours(tokens)) <= 1e-5, name
    v2, v3, dense = (imported[n][2].cfg for n in ("deepseek_v2", "deepseek_v3", "deepseek_v3-halves-bias-dense"))
    assert (v2.attention, v2.kv_lora_rank, v2.q_lora_rank, v2.rotary_interleaved, v2.moe_router, v2.moe_norm_topk,
            v2.moe_n_groups, v2.moe_group_score, v2.moe_routed_scale, v2.moe_first_dense, v2.moe_d_mlp, v2.d_mlp) == \
        ("mla", 16, None, True, "softmax", False, 2, "max", 1.5, 1, 16, 40)
    assert (v3.q_lora_rank, v3.d_head, v3.moe_router, v3.moe_score_bias, v3.moe_norm_topk, v3.moe_group_score,
            v3.moe_topk_groups, v3.n_shared_experts, v3.moe_routed_scale) == (12, 6, "sigmoid", True, True, "top2_sum", 2, 2, 2.5)
    assert (dense.ffn, dense.rotary_interleaved, dense.qkv_bias, dense.bias) == ("swiglu", False, True, True)
    assert hf_family_for(v2) == "deepseek_v2" and hf_family_for(v3) == "deepseek_v3"


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 8}), "mscale"),
    (dict(topk_method="noaux_tc"), "topk_method"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_deepseek_unsupported_fields_are_named(change, field):
    kwargs = {**HF_CASES["deepseek_v2"][1], **change}
    try:
        hf_config = T.DeepseekV2Config(**kwargs)
    except Exception:  # transformers refuses a value itself: set it after construction
        hf_config = T.DeepseekV2Config(**HF_CASES["deepseek_v2"][1])
        for key, value in change.items():
            setattr(hf_config, key, value)
    with pytest.raises(UnsupportedHFConfig, match=field):
        config_from_hf(hf_config)


def test_deepseek_export_refuses_what_neither_version_has():
    cfg = tiny(attention="mla", positional="rope", norm="rmsnorm", ffn="moe", moe_expert="swiglu", n_shared_experts=1,
               bias=False)  # softmax routing renormalised (Mixtral's): neither DeepSeek version routes so
    with pytest.raises(UnsupportedHFConfig, match="moe_norm_topk=True"):
        hf_family_for(cfg)
    with pytest.raises(UnsupportedHFConfig, match="n_shared_experts=0"):
        hf_family_for(cfg.replace(n_shared_experts=0))
    assert hf_family_for(cfg.replace(moe_router="sigmoid")) == "deepseek_v3"


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mixtral", "gpt_neox", "deepseek_v2", "deepseek_v3"])
def test_greedy_generation_matches_hf_generate(imported, name):
    hf, _, ours = imported[name]
    prompt = torch.randint(0, VOCAB, (2, 5))
    expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    got = ours.generate(prompt, max_new_tokens=8, use_kv_cache=True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_export_round_trip(imported, name, tmp_path):
    hf, _, ours = imported[name]
    wb.to_hf(ours, tmp_path / "out")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        diff = max_diff(back(tokens).logits, ours(tokens))
        diff_hf = max_diff(back(tokens).logits, hf(tokens).logits)
    print(f"\n[interop] {name}: export max |logit diff| = {diff:.2e} (vs original HF {diff_hf:.2e})")
    assert diff <= TOL and diff_hf <= TOL
    reimported = wb.from_hf(tmp_path / "out")
    for key, value in ours.state_dict().items():
        assert torch.equal(reimported.state_dict()[key], value), key


# ---- RoPE scaling: beyond the original context ------------------------------------------
ROPE_SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "llama3": dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8),
    "yarn": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16),
    "yarn-betas": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=16, beta_fast=8.0, beta_slow=2.0),
}


@pytest.mark.parametrize("variant", list(ROPE_SCALINGS))
def test_rope_scaling_beyond_original_context(variant, tmp_path):
    # rope_theta 100 with d_head 16 puts frequencies on both sides of every variant's thresholds.
    kwargs = {**SMALL, "hidden_size": 64, "max_position_embeddings": 16, "num_key_value_heads": 2,
              "rope_parameters": {**ROPE_SCALINGS[variant], "rope_theta": 100.0}}
    hf = build_hf(T.LlamaConfig, **kwargs)
    hf.save_pretrained(tmp_path)
    ours = wb.from_hf(tmp_path)
    assert ours.cfg.rope_scaling == variant.split("-")[0] and ours.cfg.n_ctx > 16
    # Generation first: HF's dynamic RoPE keeps the frequencies of the longest sequence it saw.
    prompt = torch.randint(0, VOCAB, (2, 12))
    expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours.generate(prompt, max_new_tokens=8), expected)  # ends at 20 > 16
    tokens = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        diff = max_diff(hf(tokens).logits, ours(tokens))
    print(f"\n[interop] rope {variant}: max |logit diff| at 30 > 16 positions = {diff:.2e}")
    assert diff <= TOL
    wb.to_hf(ours, tmp_path / "out")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert max_diff(back(tokens).logits, ours(tokens)) <= TOL


def test_partial_rotary_with_dynamic_scaling(tmp_path):
    kwargs = {**SMALL, "max_position_embeddings": 12,
              "rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 50.0, "partial_rotary_factor": 0.5}}
    hf = build_hf(T.GPTNeoXConfig, **kwargs)
    ours = wb.from_hf(hf)
    tokens = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        assert max_diff(hf(tokens).logits, ours(tokens)) <= TOL


# ---- our own configs out to HF ----------------------------------------------------------
NATIVE_EXPORTS = {
    "gpt2": tiny(ffn="gelu_new"),
    "gpt2-untied-gelu": tiny(ffn="gelu", tie_embeddings=False, d_mlp=40),
    "gpt_neox": tiny(positional="rope", parallel_residual=True, rotary_dim=4, ffn="gelu"),
    "llama": wb.ModelConfig.from_preset("llama-style-tiny", d_model=32, d_mlp=48, d_vocab=VOCAB, n_ctx=24, seed=0),
    "qwen2": tiny(norm="rmsnorm", positional="rope", ffn="swiglu", n_kv_heads=2, bias=False, qkv_bias=True,
                  tie_embeddings=False, rope_scaling="llama3", rope_scaling_factor=2.0, rope_original_n_ctx=12),
    "mixtral": wb.ModelConfig.from_preset("moe-tiny", d_model=32, d_mlp=40, d_vocab=VOCAB, n_ctx=24, seed=0),
}


@pytest.mark.parametrize("family", list(NATIVE_EXPORTS))
def test_export_our_configs(family, tmp_path):
    cfg = NATIVE_EXPORTS[family]
    assert hf_family_for(cfg) == family.split("-")[0]
    ours = perturb(wb.HookedDecoder(cfg))
    wb.to_hf(ours, tmp_path)
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.model_type == family.split("-")[0]
    tokens = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        diff = max_diff(hf(tokens).logits, ours(tokens))
    print(f"\n[interop] export of our {family}-shaped config: max |logit diff| = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize(
    "overrides, component",
    [
        (dict(norm_placement="post"), "post-norm"),
        (dict(positional="alibi"), "alibi"),
        (dict(positional="sinusoidal"), "sinusoidal"),
        (dict(positional="none"), "positional='none'"),
        (dict(norm="none"), "norm='none'"),
        (dict(attn_only=True), "attn_only"),
        (dict(positional="rope", rotary_interleaved=True), "rotary_interleaved"),
        (dict(n_kv_heads=2), "n_kv_heads=2"),
        (dict(d_head=4), "d_head=4"),
        (dict(ffn="swiglu"), "positional='learned'"),
        (dict(parallel_residual=True), "parallel_residual=True"),
        (dict(positional="rope", ffn="geglu"), "ffn='geglu' with LayerNorm"),
        (dict(positional="rope", norm="rmsnorm", ffn="gelu"), "ffn='gelu' with RMSNorm"),
        (dict(positional="rope", norm="rmsnorm", ffn="swiglu", parallel_residual=True), "parallel_residual=True with RMSNorm"),
        (dict(positional="rope", norm="rmsnorm", ffn="swiglu", rotary_dim=4), "rotary_dim < d_head"),
        (dict(positional="rope", norm="rmsnorm", ffn="moe", moe_expert="geglu", bias=False), "moe_expert='geglu'"),
        (dict(positional="rope", norm="rmsnorm", ffn="moe", bias=True), "bias=True"),
    ],
)
def test_export_without_hf_equivalent_names_the_component(overrides, component, tmp_path):
    model = wb.HookedDecoder(tiny(**overrides))
    with pytest.raises(UnsupportedHFConfig, match=component.replace("(", r"\(").replace("[", r"\[")):
        wb.to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- unsupported HF fields ----------------------------------------------------------------
UNSUPPORTED_HF = [
    (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, scale_attn_weights=False), "scale_attn_weights"),
    (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, activation_function="gelu_fast"), "activation_function"),
    (T.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, add_cross_attention=True), "add_cross_attention"),
    (T.LlamaConfig, dict(hidden_act="gelu_pytorch_tanh", **SMALL), "hidden_act"),
    (T.MixtralConfig, dict(hidden_act="gelu", **SMALL), "hidden_act"),
    (T.GPTNeoXConfig, dict(hidden_act="gelu_fast", **SMALL), "hidden_act"),
    (T.LlamaConfig, dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0] * 4,
                                          "short_factor": [1.0] * 4, "original_max_position_embeddings": 12}, **SMALL),
     "rope_parameters"),
    (T.LlamaConfig, dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "mscale": 0.7,
                                          "mscale_all_dim": 0.7, "original_max_position_embeddings": 12}, **SMALL),
     "rope_parameters.mscale"),
    (T.LlamaConfig, dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.5,
                                          "original_max_position_embeddings": 12}, **SMALL),
     "rope_parameters.attention_factor"),
    (T.LlamaConfig, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, **SMALL),
     "partial_rotary_factor"),
    (T.LlamaConfig, dict(attn_logit_softcapping=30.0, **SMALL), "attn_logit_softcapping"),
    (T.Qwen2Config, dict(final_logit_softcapping=30.0, **SMALL), "final_logit_softcapping"),
    (T.OPTConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=40, vocab_size=VOCAB), "model_type"),
]


@pytest.mark.parametrize("config_class, kwargs, field", UNSUPPORTED_HF, ids=[f"{c.model_type}-{f}" for c, _, f in UNSUPPORTED_HF])
def test_unsupported_hf_field_is_named(config_class, kwargs, field):
    with pytest.raises(UnsupportedHFConfig, match=field):
        config_from_hf(config_class(**kwargs))


def test_unsupported_directory_fails_before_reading_weights(tmp_path):
    # a config and no weights at all (its first layer full, its second sliding: no such pattern here)
    T.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                  **SMALL).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedHFConfig, match="max_window_layers=1"):
        wb.from_hf(tmp_path)


def test_sliding_window_longer_than_the_context_imports_exactly():
    hf = build_hf(T.MistralConfig, **{**SMALL, "sliding_window": 8, "num_key_value_heads": 2})
    ours = wb.from_hf(hf, n_ctx=8)
    tokens = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert max_diff(hf(tokens).logits, ours(tokens)) <= TOL
    with pytest.raises(ValueError, match="n_ctx=8"):
        ours(torch.randint(0, VOCAB, (1, 9)))


def test_bad_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        wb.from_hf(tmp_path)
    with pytest.raises(TypeError, match="a hub id or a transformers model"):
        wb.from_hf(42)
    base = T.AutoModel.from_config(T.LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="no language-model head"):
        wb.from_hf(base)


# ---- tokenizer ------------------------------------------------------------------------
def _llama_style_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "hello world, the dog ran"] * 10, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_tokenizer_comes_along_and_saves_with_checkpoints(imported, tmp_path):
    hf, _, _ = imported["llama"]
    hf.save_pretrained(tmp_path / "hf")
    _llama_style_tokenizer().save_pretrained(tmp_path / "hf")
    reference = T.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = wb.from_hf(tmp_path / "hf")
    assert isinstance(model.tokenizer, HFTokenizer)
    text = "the cat sat"
    ids = reference(text)["input_ids"]
    assert ids[0] == reference.bos_token_id
    assert model.to_tokens(text)[0].tolist() == ids
    assert model.to_string(model.to_tokens(text)[0]) == reference.decode(ids)
    assert model.tokenizer.token_id("eos_token") == reference.eos_token_id
    wb.save_checkpoint(model, tmp_path / "ck")
    loaded, tok = wb.load_checkpoint(tmp_path / "ck")
    assert isinstance(tok, HFTokenizer) and tok.encode(text) == ids
    with torch.no_grad():
        assert torch.equal(loaded(model.to_tokens(text)), model(model.to_tokens(text)))
    wb.to_hf(loaded, tmp_path / "out")
    exported = T.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported(text)["input_ids"] == ids and exported.eos_token == "</s>"
    assert T.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == reference.eos_token_id


def test_bpe_tokenizer_exports_and_others_warn(tmp_path):
    from workbench.tokenizer import BPETokenizer, ByteTokenizer

    model = wb.HookedDecoder(tiny(d_vocab=300))
    bpe = BPETokenizer.train(["the cat sat on the mat"] * 5, vocab_size=300)
    wb.to_hf(model, tmp_path / "bpe", tokenizer=bpe)
    assert T.AutoTokenizer.from_pretrained(tmp_path / "bpe")("the cat")["input_ids"] == bpe.encode("the cat")
    with pytest.warns(UserWarning, match="no Hugging Face form"):
        wb.to_hf(model, tmp_path / "byte", tokenizer=ByteTokenizer())
    assert (tmp_path / "byte" / "model.safetensors").exists()


# ---- command line -----------------------------------------------------------------------
def test_cli_import_and_export(imported, tmp_path, capsys):
    import argparse

    from workbench.interop import cli

    _, directory, ours = imported["gpt_neox"]
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["import-hf", str(directory), "--out", str(tmp_path / "ck")])
    assert args.func(args) == 0
    model, _ = wb.load_checkpoint(tmp_path / "ck")
    args = parser.parse_args(["export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")])
    assert args.func(args) == 0
    assert "as gpt_neox" in capsys.readouterr().out
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert max_diff(back(tokens).logits, ours(tokens)) <= TOL
        assert torch.equal(model(tokens), ours(tokens))


# ---- cross-library: TransformerLens' TransformerBridge on the same weights ----------------------
def _shared_hook_diffs(bridge_cache, our_cache, n_experts):
    diffs = {}
    for name in sorted(set(bridge_cache.keys()) & set(our_cache.keys())):
        theirs, ours = bridge_cache[name], our_cache[name]
        if name.endswith("hook_attn_scores"):
            # Masked entries: ours are -inf, HF adds the dtype's minimum; compare the causal part.
            keep = torch.ones(ours.shape[-2:], dtype=torch.bool).tril()
            theirs, ours = theirs[..., keep], ours[..., keep]
        elif name.endswith("hook_expert_indices"):
            ours = ours.reshape(theirs.shape)
        elif name.endswith("hook_expert_weights"):
            # The bridge scatters the top-k weights into [tokens, n_experts].
            idx = our_cache[name.replace("weights", "indices")].reshape(-1, ours.shape[-1])
            ours = torch.zeros(idx.shape[0], n_experts).scatter(1, idx, ours.reshape(idx.shape))
        diffs[name] = max_diff(theirs, ours)
    return diffs


def bridge_and_our_runs(hf, directory, ours):
    """(bridge logits, bridge cache, our logits, our cache) of TransformerLens' bridge on ``hf`` and ours."""
    from transformer_lens.model_bridge import TransformerBridge

    _llama_style_tokenizer().save_pretrained(directory)  # the bridge wants a tokenizer; give it a local one
    bridge = TransformerBridge.boot_transformers(
        str(directory), hf_model=hf, tokenizer=T.AutoTokenizer.from_pretrained(directory), device="cpu"
    )
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        return (*bridge.run_with_cache(tokens), *ours.run_with_cache(tokens))


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mixtral", "gpt_neox"])
def test_run_with_cache_matches_transformer_bridge(imported, name):
    hf, directory, ours = imported[name]
    bridge_logits, bridge_cache, our_logits, our_cache = bridge_and_our_runs(hf, directory, ours)
    diffs = _shared_hook_diffs(bridge_cache, our_cache, ours.cfg.n_experts)
    worst = max(diffs, key=diffs.get)
    print(f"\n[interop] bridge {name}: {len(diffs)} shared hooks, worst {worst} = {diffs[worst]:.2e}; "
          f"logits {max_diff(bridge_logits, our_logits):.2e}")
    for layer_hook in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "attn.hook_q",
                       "attn.hook_k", "attn.hook_v", "attn.hook_pattern", "attn.hook_z", "ln1.hook_scale"):
        assert f"blocks.1.{layer_hook}" in diffs
    assert all(d <= TOL for d in diffs.values()), {k: v for k, v in diffs.items() if v > TOL}
    assert max_diff(bridge_logits, our_logits) <= TOL
