"""ModelConfig: validation, presets, JSON round trip, TransformerLens' derived field names."""

import json

import pytest

import workbench as wb
from factories import tiny


def test_derived_sizes():
    cfg = tiny()
    assert (cfg.d_head, cfg.n_kv_heads, cfg.d_mlp, cfg.rotary_dim) == (8, 4, 128, 8)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("norm", "batchnorm", "layernorm"),
        ("positional", "relative", "alibi"),
        ("ffn", "tanh", "swiglu"),
        ("norm_placement", "middle", "pre"),
        ("n_kv_heads", 3, "n_kv_heads"),
        ("d_model", 0, "d_model"),
        ("attn_only", "yes", "attn_only"),
        ("moe_expert", "moe", "swiglu"),
        ("norm_eps", "1e-5", "norm_eps"),
        ("rope_scaling_factor", 0, "rope_scaling_factor"),
        ("rope_base", 1.0, "rope_base"),
        ("init_std", float("nan"), "init_std"),
        ("init_std", -0.1, "init_std"),
    ],
)
def test_invalid_values_name_the_field_and_choices(field, value, needle):
    with pytest.raises(ValueError) as err:
        tiny(**{field: value})
    assert field in str(err.value) and needle in str(err.value)


def test_indivisible_heads_and_bad_combinations():
    with pytest.raises(ValueError, match="divisible"):
        wb.ModelConfig(d_model=30, n_layers=1, n_heads=4, d_vocab=10, n_ctx=8)
    with pytest.raises(ValueError, match="parallel_residual"):
        tiny(parallel_residual=True, norm_placement="post")
    with pytest.raises(ValueError, match="experts_per_token"):
        tiny(ffn="moe", n_experts=2, experts_per_token=3)


def test_a_refusal_names_its_field_as_an_attribute():
    """A ConfigError (a ValueError) carries the field to change, so a caller (the app's Build & train
    page) need not match the message's wording; the message is unchanged."""
    from workbench.config import ConfigError

    with pytest.raises(ConfigError) as info:
        wb.ModelConfig(d_model=130, n_layers=1, n_heads=4, d_vocab=10, n_ctx=8)
    assert isinstance(info.value, ValueError)
    assert info.value.field == "d_head" and info.value.fields == ("d_head", "d_model", "n_heads")
    assert str(info.value) == ("d_model=130 is not divisible by n_heads=4: set d_head explicitly or choose n_heads "
                               "dividing d_model")
    assert wb.ModelConfig(d_model=130, n_layers=1, n_heads=4, d_head=32, d_vocab=10, n_ctx=8).d_head == 32
    with pytest.raises(ConfigError, match="must divide n_heads=4") as info:
        tiny(n_heads=4, n_kv_heads=3)
    assert info.value.field == "n_kv_heads" and info.value.fields == ("n_kv_heads", "n_heads")


def test_json_round_trip(tmp_path):
    cfg = tiny(norm="rmsnorm", positional="rope", n_kv_heads=2, ffn="swiglu", tie_embeddings=False)
    assert wb.ModelConfig.from_json(cfg.to_json()) == cfg
    cfg.to_json(tmp_path / "c.json")
    assert wb.ModelConfig.from_json(tmp_path / "c.json") == cfg
    assert json.loads(cfg.to_json())["n_kv_heads"] == 2


def test_unknown_keys_rejected():
    data = tiny().to_dict() | {"n_experts_typo": 3}
    with pytest.raises(ValueError, match="n_experts_typo"):
        wb.ModelConfig.from_dict(data)


def test_presets_and_overrides():
    for name in wb.ModelConfig.presets():
        cfg = wb.ModelConfig.from_preset(name)
        assert cfg.name == name
    cfg = wb.ModelConfig.from_preset("llama-style-tiny", n_layers=4)
    assert cfg.n_layers == 4 and cfg.norm == "rmsnorm" and cfg.positional == "rope"
    with pytest.raises(ValueError, match="gpt2-small"):
        wb.ModelConfig.from_preset("gpt5")


def test_replace_rederives_defaults():
    cfg = tiny()
    wider = cfg.replace(d_model=64)
    assert wider.d_head == 16 and wider.d_mlp == 256
    assert cfg.replace(d_mlp=100).replace(d_model=64).d_mlp == 100


def test_transformer_lens_vocabulary():
    cfg = tiny(norm="rmsnorm", positional="rope", ffn="swiglu", n_kv_heads=2)
    assert cfg.normalization_type == "RMS" and cfg.positional_embedding_type == "rotary"
    assert cfg.act_fn == "silu" and cfg.gated_mlp and cfg.n_key_value_heads == 2 and cfg.final_rms
    cfg = tiny()
    assert cfg.normalization_type == "LN" and cfg.positional_embedding_type == "standard"
    assert not cfg.gated_mlp and cfg.n_key_value_heads is None and cfg.act_fn == "gelu"
    assert tiny(norm="none").normalization_type is None
