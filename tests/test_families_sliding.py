"""Mistral, Mixtral, Phi-3, Qwen2 and Qwen3 with a sliding window shorter than the context, in and
out, against transformers' own models from random small configs.

Which layers slide is transformers' rule: every layer for Mistral, Mixtral and Phi-3; for Qwen2 and
Qwen3 the layers ``layer_types`` names (by default those from ``max_window_layers`` on, with
``use_sliding_window``). Each case is saved and imported from the directory; over a sequence three
times the window its logits match HF's to 1e-5 in fp32, greedy KV-cache generation (our window-sized
cache, HF's sliding cache) equals HF's ``generate``, and the export loads in transformers with the
same window and the same logits. Patterns our config cannot express raise ``UnsupportedHFConfig``
naming the field.
"""

import pytest
import torch
import transformers as T
from factories import tiny
from test_interop import SMALL, VOCAB, _no_network, import_saved, max_diff  # noqa: F401 (_no_network: autouse fixture)

import workbench as wb
from workbench.interop import UnsupportedHFConfig, config_from_hf, hf_config_for

TOL = 1e-5
QWEN_WINDOW = dict(use_sliding_window=True, max_window_layers=0)
FOUR = {**SMALL, "num_hidden_layers": 4}
CASES = {
    "mistral": (T.MistralConfig, dict(num_key_value_heads=2, sliding_window=4, **SMALL)),
    "mixtral": (T.MixtralConfig, dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=3, **SMALL)),
    "phi3": (T.Phi3Config, dict(num_key_value_heads=2, sliding_window=4, **SMALL)),
    "phi3-partial-rotary": (T.Phi3Config, dict(sliding_window=5, rope_parameters={
        "rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}, **SMALL)),
    "qwen2": (T.Qwen2Config, dict(num_key_value_heads=2, sliding_window=4, **QWEN_WINDOW, **SMALL)),
    "qwen3": (T.Qwen3Config, dict(num_key_value_heads=1, head_dim=12, sliding_window=2, **QWEN_WINDOW, **SMALL)),
    # layer_types decides (max_window_layers is then unread): sliding, full, sliding, full
    "qwen2-alternating": (T.Qwen2Config, dict(num_key_value_heads=2, sliding_window=4, use_sliding_window=True,
                                              layer_types=["sliding_attention", "full_attention"] * 2, **FOUR)),
}
# (window, global_every) imported, and the family exported: Phi-3 rotating whole heads is a Mistral
EXPECTED = {"mistral": (4, 0, "Mistral"), "mixtral": (3, 0, "Mixtral"), "phi3": (4, 0, "Mistral"),
            "phi3-partial-rotary": (5, 0, "Phi3"), "qwen2": (4, 0, "Qwen2"), "qwen3": (2, 0, "Qwen3"),
            "qwen2-alternating": (4, 2, "Qwen2")}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return {name: (hf, ours) for name, (hf, _, ours) in import_saved(CASES, tmp_path_factory).items()}


def _tokens(n: int = 13):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CASES))
def test_import_reproduces_hf_logits_past_the_window(imported, name):
    hf, ours = imported[name]
    window, every, _ = EXPECTED[name]
    assert (ours.cfg.sliding_window, ours.cfg.global_every) == (window, every)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
        assert max_diff(expected, ours(tokens)) <= TOL
        # the window matters here: the same weights without it are far off
        unwindowed = wb.HookedDecoder(ours.cfg.replace(sliding_window=None, global_every=0)).eval()
        unwindowed.load_state_dict(ours.state_dict())
        assert max_diff(expected, unwindowed(tokens)) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_matches_hf_generate(imported, name):
    hf, ours = imported[name]
    prompt = _tokens(5)
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours.generate(prompt, max_new_tokens=10, use_kv_cache=True), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_keeps_the_window(imported, name, tmp_path):
    hf, ours = imported[name]
    window, every, family = EXPECTED[name]
    wb.to_hf(ours, tmp_path / "out")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == f"{family}ForCausalLM" and back.config.sliding_window == window
    if family.startswith("Qwen"):
        assert back.config.layer_types == [
            "sliding_attention" if every == 0 or (i + 1) % every else "full_attention" for i in range(ours.cfg.n_layers)]
    tokens = _tokens()
    with torch.no_grad():
        assert max_diff(back(tokens).logits, hf(tokens).logits) <= TOL
    reimported = wb.from_hf(tmp_path / "out")
    assert (reimported.cfg.sliding_window, reimported.cfg.global_every) == (window, every)
    for key, value in ours.state_dict().items():
        assert torch.equal(reimported.state_dict()[key], value), key


def test_a_window_the_context_never_reaches_imports_as_none():
    assert config_from_hf(T.MistralConfig(num_key_value_heads=2, sliding_window=24, **SMALL))[1].sliding_window is None
    assert config_from_hf(T.MistralConfig(num_key_value_heads=2, sliding_window=8, **SMALL), n_ctx=8)[1].sliding_window is None
    assert config_from_hf(T.MistralConfig(num_key_value_heads=2, sliding_window=8, **SMALL))[1].sliding_window == 8
    # Qwen without use_sliding_window has no window, whatever sliding_window says
    assert config_from_hf(T.Qwen2Config(num_key_value_heads=2, sliding_window=4, max_window_layers=0, **SMALL))[1].sliding_window is None
    # Qwen's default max_window_layers (28) leaves a small model's layers all full
    assert config_from_hf(T.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, **SMALL))[1].sliding_window is None


@pytest.mark.parametrize("make, field", [
    # the first layer full, the second sliding: our config has no such pattern
    (lambda: T.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **SMALL), "max_window_layers=1"),
    (lambda: T.Qwen3Config(use_sliding_window=True, sliding_window=4, **{**SMALL, "num_hidden_layers": 3},
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"]), "layer_types"),
])
def test_unreproducible_window_patterns_are_named(make, field):
    with pytest.raises(UnsupportedHFConfig, match=f"field {field}"):
        config_from_hf(make())


WINDOWED = dict(positional="rope", norm="rmsnorm", ffn="swiglu", bias=False, sliding_window=4)


@pytest.mark.parametrize("overrides, component", [
    (dict(qk_norm="projection", norm_placement="reordered"), "sliding_window=4 (every layer local) in a olmo2"),
    (dict(global_every=2, n_layers=4), "sliding_window=4 (global_every=2) in a llama"),
    (dict(qkv_bias=True, bias=True), "sliding_window=4 with bias=True"),
    (dict(norm="layernorm", ffn="gelu"), "sliding_window=4 (every layer local) in a gpt_neox"),
])
def test_export_of_a_window_no_family_has_names_it(overrides, component):
    with pytest.raises(UnsupportedHFConfig, match=component.replace("(", r"\(").replace(")", r"\)")):
        hf_config_for(tiny(**{**WINDOWED, **overrides}))


def test_a_qwen_export_with_alternating_windows_reads_back_in_transformers():
    cfg = tiny(**WINDOWED, qkv_bias=True, n_layers=4, global_every=2)
    hf = hf_config_for(cfg)
    assert type(hf).__name__ == "Qwen2Config" and hf.sliding_window == 4
    assert hf.layer_types == ["sliding_attention", "full_attention"] * 2
