"""Parameters, FLOPs and KV-cache bytes, computed from the config alone.

``count_params`` builds the model on PyTorch's meta device, so even GPT-3 175B costs no
memory, and the count is exact for every variant (it is the model's own parameter list).
The closed forms of the seed texts are here too, to compare against.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from workbench.config import ModelConfig
from workbench.utils import check_int


def _component(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blocks":
        return {"attn": "attention", "mlp": "ffn", "ln1": "norms", "ln2": "norms", "ln1_post": "norms",
                "ln2_post": "norms"}.get(parts[2], parts[2])
    return {"embed": "embedding", "pos_embed": "positional", "ln_final": "norms", "unembed": "unembedding"}.get(
        parts[0], parts[0]
    )


def meta_model(cfg: ModelConfig):
    """The model ``cfg`` describes, on the meta device: every shape, no memory."""
    from workbench.model import HookedDecoder

    with torch.device("meta"):
        return HookedDecoder(cfg)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts: ``total``, ``non_embedding`` and one entry per component."""
    return count_model_params(meta_model(cfg))


def count_model_params(model) -> dict[str, int]:
    """:func:`count_params` of a model already built (a loaded checkpoint): no second model to
    build, and no meta-device op (whose first use imports torch's meta kernels, seconds on a
    cold process)."""
    cfg = model.cfg
    counts: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():
        counts[_component(name)] += p.numel()
    for key in ("embedding", "positional", "attention", "ffn", "norms", "unembedding"):
        counts.setdefault(key, 0)
    counts["total"] = sum(p.numel() for p in model.parameters())
    counts["non_embedding"] = counts["total"] - counts["embedding"] - counts["positional"] - counts["unembedding"]
    # A token runs experts_per_token of each MoE layer's n_experts routed experts (shared experts,
    # dense first layers and the router always run).
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    counts["active"] = counts["total"] - routed * (cfg.n_experts - cfg.experts_per_token) // cfg.n_experts
    return dict(counts)


def seed_param_formula(cfg: ModelConfig) -> int:
    """The seeds' closed form N = V*d + L*(12 d^2 + 2 d) + d.

    Exact for a tied, bias-free(ish) GPT block with d_mlp = 4d, MHA, RMS-like norms with
    one gain vector each, and no positional parameters: 4d^2 (attention) + 8d^2 (MLP) per layer,
    2d per layer for the two norms, d for the final norm.
    """
    V, d, L = cfg.d_vocab, cfg.d_model, cfg.n_layers
    return V * d + L * (12 * d * d + 2 * d) + d


def matmul_params(cfg: ModelConfig) -> int:
    """Weights multiplied once per token in a forward pass: every active matrix, including the
    head (tied or not), excluding embedding/position lookups and norm gains."""
    counts = count_params(cfg)
    n = counts["active"] - counts["embedding"] - counts["positional"] - counts["norms"]
    return n + (cfg.d_vocab * cfg.d_model if cfg.tie_embeddings else 0)


def forward_flops_per_token(cfg: ModelConfig, context: int | None = None) -> int:
    """Forward FLOPs per token: 2 per multiplied weight (multiply-add) plus attention's
    QK^T and AV products over ``context`` positions (n_ctx by default), as in Kaplan et al. (2020)."""
    context = cfg.n_ctx if context is None else check_int("context", context, 0)
    if cfg.attention == "mla":  # QK^T over the query/key width, AV over the value width
        attention = 2 * cfg.n_layers * context * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.d_head)
    else:
        attention = 2 * 2 * cfg.n_layers * context * cfg.n_heads * cfg.d_head
    return 2 * matmul_params(cfg) + attention


def training_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """The 6ND rule: forward (2N) plus backward (4N) per token, with N = ``matmul_params`` (the
    same N as ``forward_flops_per_token``, so tied and untied heads count alike)."""
    return 6 * matmul_params(cfg) * check_int("n_tokens", n_tokens, 0)


def _kv_values_per_position(cfg: ModelConfig) -> int:
    """Values one layer's KV cache stores per position."""
    if cfg.attention == "mla":
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * cfg.n_kv_heads * cfg.d_head


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_value: int = 2) -> int:
    """Bytes of keys and values stored per token of context (bf16 by default), in the layers
    that keep every token.

    MHA/GQA/MQA store a key and a value per KV head: 2 n_kv_heads d_head values per layer. MLA
    stores its latent and its shared RoPE key, kv_lora_rank + qk_rope_head_dim values per layer,
    whatever the number of heads. A sliding-window layer holds at most ``window`` positions
    whatever the context, so it adds nothing per token: it counts in ``kv_cache_bytes`` only
    (with every layer local, as Mistral's, this is 0)."""
    bytes_per_value = check_int("bytes_per_value", bytes_per_value, 1)
    global_layers = sum(not cfg.layer_is_local(layer) for layer in range(cfg.n_layers))
    return global_layers * _kv_values_per_position(cfg) * bytes_per_value


def kv_cache_bytes(cfg: ModelConfig, context: int | None = None, batch: int = 1, bytes_per_value: int = 2) -> int:
    """Bytes the KV cache holds for ``batch`` sequences of ``context`` positions (n_ctx by
    default), what ``make_kv_cache(batch, context)`` allocates: ``context`` positions in a layer
    that keeps every token, min(window, context) in a sliding-window layer."""
    context = cfg.n_ctx if context is None else check_int("context", context, 1)
    batch = check_int("batch", batch, 1)
    bytes_per_value = check_int("bytes_per_value", bytes_per_value, 1)
    positions = sum(min(cfg.sliding_window, context) if cfg.layer_is_local(layer) else context
                    for layer in range(cfg.n_layers))
    return batch * positions * _kv_values_per_position(cfg) * bytes_per_value


def training_memory_bytes(cfg: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
    """Bytes training in fp32 with AdamW needs, estimated from the config alone.

    ``weights``, ``gradients`` and ``optimizer`` (AdamW's two moments) are exact: 4 bytes per
    parameter each (twice for the optimizer). ``activations`` is the estimate of Korthikanti
    et al. (2022) for what the backward pass keeps, ``s b h (34 + 5 a s / h)`` bytes per layer
    in 16 bits, doubled for fp32, plus the logits and their gradient; ``total`` sums them.
    """
    batch_size, seq_len = check_int("batch_size", batch_size, 1), check_int("seq_len", seq_len, 1)
    params = count_params(cfg)["total"]
    s, b, h, a = seq_len, batch_size, cfg.d_model, cfg.n_heads
    per_layer = s * b * h * (34 + 5 * a * s / h) * 2
    logits = 2 * 4 * b * s * cfg.d_vocab
    out = {"weights": 4 * params, "gradients": 4 * params, "optimizer": 8 * params,
           "activations": int(cfg.n_layers * per_layer + logits)}
    out["total"] = sum(out.values())
    return out
