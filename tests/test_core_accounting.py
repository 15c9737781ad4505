"""Parameter, FLOP and KV-cache accounting from the config alone."""

import resource

import pytest
import torch

import workbench as wb
from factories import tiny
from test_core_model import VARIANTS


@pytest.mark.parametrize("name", list(VARIANTS))
def test_count_equals_the_real_model(name):
    cfg = tiny(**VARIANTS[name])
    counts = wb.count_params(cfg)
    model = wb.HookedDecoder(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    parts = ("embedding", "positional", "attention", "ffn", "norms", "unembedding")
    assert sum(counts[p] for p in parts) == counts["total"]


def test_gpt3_175b_within_one_percent_without_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    total = wb.count_params(wb.ModelConfig.from_preset("gpt3-175b"))["total"]
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert abs(total - 175e9) / 175e9 < 0.01
    assert grown_mib < 300, f"counting allocated {grown_mib:.0f} MiB"


def test_seed_closed_form_is_exact_under_its_assumptions():
    # The seeds' N = V d + L (12 d^2 + 2 d) + d: tied, bias-free, d_mlp = 4d, MHA, one gain per norm, no position table.
    for d, L, V in [(64, 3, 1000), (768, 12, 50257)]:
        cfg = wb.ModelConfig(d_model=d, n_layers=L, n_heads=8, d_vocab=V, n_ctx=128, norm="rmsnorm",
                             positional="rope", ffn="gelu", bias=False, tie_embeddings=True)
        assert wb.count_params(cfg)["total"] == wb.seed_param_formula(cfg) == V * d + L * (12 * d * d + 2 * d) + d


def test_moe_active_parameters_and_flops():
    cfg = tiny(ffn="moe", n_experts=4, experts_per_token=1, bias=False)
    counts = wb.count_params(cfg)
    expert = 3 * cfg.d_model * cfg.d_mlp  # a SwiGLU expert: gate, in, out
    assert counts["total"] - counts["active"] == cfg.n_layers * 3 * expert
    dense = tiny(bias=False, ffn="swiglu")
    assert wb.forward_flops_per_token(cfg) == wb.forward_flops_per_token(dense) + 2 * cfg.n_layers * cfg.d_model * 4


def test_flops_and_kv_bytes():
    cfg = tiny(bias=False, tie_embeddings=False)
    n = wb.count_params(cfg)
    matmul = n["attention"] + n["ffn"] + n["unembedding"]
    assert wb.forward_flops_per_token(cfg, context=10) == 2 * matmul + 4 * cfg.n_layers * 10 * cfg.d_model
    assert wb.training_flops(cfg, 1000) == 6 * matmul * 1000
    # tied or untied, the head is one d_model x d_vocab product per token
    assert wb.training_flops(cfg.replace(tie_embeddings=True), 1) == wb.training_flops(cfg, 1)
    assert wb.kv_cache_bytes_per_token(cfg) == 2 * 2 * 4 * 8 * 2
    assert wb.kv_cache_bytes_per_token(cfg.replace(n_kv_heads=1)) * 4 == wb.kv_cache_bytes_per_token(cfg)
    # and it is what the KV cache really allocates per position
    model = wb.HookedDecoder(cfg).to(torch.bfloat16)
    cache = model.make_kv_cache(1)
    held = sum(e.k.numel() * e.k.element_size() + e.v.numel() * e.v.element_size() for e in cache.entries)
    assert held == wb.kv_cache_bytes_per_token(cfg) * cfg.n_ctx


def test_training_memory_counts_the_real_optimizer_state_exactly():
    import workbench as wb
    from workbench.accounting import training_memory_bytes

    cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=24, seed=0)
    model = wb.HookedDecoder(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 50, (2, 8)), return_type="loss").backward()
    opt.step()
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    est = training_memory_bytes(cfg, batch_size=2, seq_len=8)
    assert est["weights"] == real and est["gradients"] == real and est["optimizer"] == moments
    assert est["total"] == sum(v for k, v in est.items() if k != "total")
    bigger = training_memory_bytes(cfg, batch_size=4, seq_len=16)
    assert bigger["activations"] > 2 * est["activations"] and bigger["weights"] == est["weights"]
    with pytest.raises(ValueError, match="batch_size"):
        training_memory_bytes(cfg, 0, 8)


@pytest.mark.parametrize("scaling", ["none", "linear", "llama3", "yarn"])
def test_a_meta_model_computes_rope_frequencies_off_the_meta_device(scaling):
    """Every checkpoint load builds the model on the meta device first (check_config_matches_weights).
    RoPE's ``base ** tensor`` on the meta device runs one of torch's Python decompositions, whose
    first use in a process took seconds of the app's first page; the frequencies are now computed
    on the CPU and only their shape goes to the meta device. Same shapes as a real model."""
    from torch.overrides import TorchFunctionMode

    from workbench.accounting import meta_model
    from workbench.components.positional import rope_inv_freq

    cfg = wb.ModelConfig(d_vocab=50, d_model=32, n_layers=1, n_heads=2, n_ctx=64, positional="rope",
                         rope_scaling=scaling, rope_scaling_factor=1.0 if scaling == "none" else 2.0)
    meta_pows = []

    class Pows(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "pow" in getattr(func, "__name__", "") and isinstance(out, torch.Tensor) and out.is_meta:
                meta_pows.append(func.__name__)
            return out

    with Pows():
        model = meta_model(cfg)
    assert meta_pows == []
    freqs = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
    assert freqs and all(f.is_meta and f.shape == rope_inv_freq(cfg)[0].shape for f in freqs)


def test_a_meta_model_computes_the_sinusoidal_table_off_the_meta_device():
    """As RoPE's frequencies: the table of a sinusoidal model built on the meta device (every checkpoint
    load checks the file against one) is computed on the CPU, and only ``.to('meta')`` makes a meta table
    (a meta-device ``arange`` first in a process imported torch's meta kernels: 2-3 s of a load). The CPU
    table is Vaswani et al.'s formula, computed here with numpy."""
    import numpy as np
    from torch.overrides import TorchFunctionMode

    from workbench.components.positional import SinusoidalPositions

    cfg = wb.ModelConfig(d_vocab=50, d_model=10, n_layers=1, n_heads=2, n_ctx=12, positional="sinusoidal")
    meta_ops = []

    class MetaOps(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.is_meta:
                meta_ops.append(getattr(func, "__name__", str(func)))
            return out

    with torch.device("meta"), MetaOps():
        meta = SinusoidalPositions(cfg)
    # torch.get_default_device() makes an empty tensor to read the device: the only other meta output
    assert [op for op in meta_ops if op != "tensor"] == ["to"]
    assert meta.W_pos.is_meta and meta.W_pos.shape == (12, 10)
    pos, i = np.arange(12)[:, None], np.arange(0, 10, 2)[None, :]
    angle = pos / 10000 ** (i / 10)
    expected = np.zeros((12, 10))
    expected[:, 0::2], expected[:, 1::2] = np.sin(angle), np.cos(angle)
    assert np.allclose(SinusoidalPositions(cfg).W_pos.numpy(), expected, atol=1e-6)
