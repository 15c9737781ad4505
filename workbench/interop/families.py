"""Which Hugging Face architecture a model is, as a ``ModelConfig``, and back.

``config_from_hf`` reads a ``transformers`` config (GPT-2, Llama, Mistral, Qwen2, Mixtral,
GPT-NeoX, Qwen3, OLMo 2, Phi-3, DeepSeek-V2/V3) and returns our family name and ``ModelConfig``; ``hf_config_for`` does the reverse
for our configs that have an HF equivalent. Anything either side cannot express exactly
raises ``UnsupportedHFConfig`` naming the field: an imported model either reproduces HF's
numbers or does not load.

Biases one side lacks are zero on the other (e.g. GPT-NeoX with ``attention_bias=False`` has
an MLP bias, so it imports as ``bias=True, qkv_bias=False`` with ``b_O = 0``): exact, not an
approximation. A bias we learned that the HF family has no slot for is an error.

The newer Llama-shaped families differ by one component each: Qwen3 normalises queries and
keys per head (``qk_norm="head"``, its ``head_dim`` free of hidden_size / heads), OLMo 2 over
the whole projection (``qk_norm="projection"``) and puts its norms after each sublayer instead
of before (``norm_placement="reordered"``), and Phi-3 fuses q/k/v and gate/up into one
projection each (split on import, ``weights.py``) and may rotate part of each head
(``partial_rotary_factor``). Phi-3's LongRoPE (``rope_type`` longrope / su) rescales each
frequency by a learned table and is refused.

Sliding windows: Mistral, Mixtral and Phi-3 slide every layer by ``sliding_window``; Qwen2 and
Qwen3 slide the layers ``layer_types`` names ``sliding_attention`` (by default, with
``use_sliding_window``, those from ``max_window_layers`` on), Gemma 2/3 likewise. Our config
models every layer local or every k-th layer global (``global_every``); another pattern is
refused naming the field. A window at least as long as the context never cuts and imports as
none.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from workbench.config import ModelConfig

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "gpt_neox", "qwen3", "olmo2", "phi3", "gemma2",
            "gemma3_text", "deepseek_v2", "deepseek_v3")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "olmo2")  # rotate the whole head
GEMMA = ("gemma2", "gemma3_text")
# Gemma's options in our config (off: None, False or 0); no other family may carry one. (The
# sliding window and global_every are shared: Mistral, Mixtral, Phi-3, Qwen2 and Qwen3 slide too.)
GEMMA_OPTIONS = ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_base",
                 "scale_embeddings")
SLIDING_EVERY_LAYER = ("mistral", "mixtral", "phi3")  # sliding_window applies to every layer
SLIDING_BY_LAYER_TYPES = ("qwen2", "qwen3")  # layer_types names the sliding layers
_GEMMA_ACTS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu"}
_HF_FIELDS_OF_GEMMA = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")

# HF ACT2FN names -> our activation names (exact matches only; "gelu_fast" etc. differ).
_ACTS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}

_ROPE_KEYS = {
    "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
    "high_freq_factor", "beta_fast", "beta_slow", "partial_rotary_factor", "attention_factor",
    "mscale", "mscale_all_dim", "truncate",
}


# Fields of neighbouring architectures that change the forward pass; a config carrying one
# (set by hand or by a fine-tuning recipe) must not load as if it were absent.
_FOREIGN_FIELDS = (
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "attention_multiplier",
    "embedding_multiplier", "residual_multiplier", "logits_scaling", "logit_scale", "use_qk_norm",
    "qk_layernorm", "rope_interleaved", "alibi", "use_alibi", "parallel_attn", "new_decoder_architecture",
)


class UnsupportedHFConfig(ValueError):
    """An HF config field (or a component of ours) with no exact counterpart on the other side."""


def _unsupported(field: str, value: Any, why: str) -> UnsupportedHFConfig:
    return UnsupportedHFConfig(f"unsupported Hugging Face config field {field}={value!r}: {why}")


# ---- HF -> ours -----------------------------------------------------------------------
def config_from_hf(hf: Any, n_ctx: Optional[int] = None) -> tuple[str, ModelConfig]:
    """(family, ModelConfig) for a ``transformers`` config; raises ``UnsupportedHFConfig``."""
    family = getattr(hf, "model_type", None)
    if family not in FAMILIES:
        raise _unsupported("model_type", family, f"supported families are {list(FAMILIES)}")
    if getattr(hf, "add_cross_attention", False) or getattr(hf, "is_encoder_decoder", False):
        raise _unsupported("add_cross_attention", True, "the workbench builds decoder-only models")
    for field in _FOREIGN_FIELDS:
        if family in GEMMA and field in _HF_FIELDS_OF_GEMMA:
            continue  # read by _gemma_fields
        if getattr(hf, field, None) not in (None, False):
            raise _unsupported(field, getattr(hf, field), f"the {family} blocks here have no such option")
    if family == "gpt2":
        fields = _gpt2_fields(hf)
    elif family == "gpt_neox":
        fields = _neox_fields(hf)
    elif family in DEEPSEEK:
        fields = _deepseek_fields(hf, family)
    elif family in GEMMA:
        fields = _gemma_fields(hf, family)
    else:
        fields = _llama_fields(hf, family)
    if family != "gpt2":
        fields.update(_rope_fields(hf, family, fields.get("qk_rope_head_dim") or fields["d_head"],
                                   _global_rope_parameters(hf, family)))
    suggested = fields.pop("n_ctx")
    if n_ctx is not None:
        if n_ctx < 1 or (family == "gpt2" and n_ctx > hf.n_positions):
            raise ValueError(f"n_ctx={n_ctx} must be between 1 and the model's {suggested} positions")
        suggested = n_ctx
    if family in SLIDING_EVERY_LAYER + SLIDING_BY_LAYER_TYPES:
        fields.update(_window_fields(hf, family, suggested))
    name = getattr(hf, "_name_or_path", "") or family
    return family, ModelConfig(n_ctx=suggested, name=str(name), **fields)


def _gpt2_fields(hf: Any) -> dict:
    if not getattr(hf, "scale_attn_weights", True):
        raise _unsupported("scale_attn_weights", False, "our attention always divides scores by sqrt(d_head)")
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False):
        raise _unsupported("scale_attn_by_inverse_layer_idx", True, "no per-layer score scaling here")
    act = hf.activation_function
    if act not in _ACTS:
        raise _unsupported("activation_function", act, f"supported: {sorted(_ACTS)}")
    # reorder_and_upcast_attn only changes the precision of the scores; in fp32 it is the same math.
    return dict(
        d_model=hf.n_embd, n_layers=hf.n_layer, n_heads=hf.n_head, d_vocab=hf.vocab_size,
        n_ctx=hf.n_positions, d_mlp=hf.n_inner or 4 * hf.n_embd, d_head=hf.n_embd // hf.n_head,
        norm="layernorm", positional="learned", ffn=_ACTS[act], bias=True,
        norm_eps=hf.layer_norm_epsilon, tie_embeddings=bool(hf.tie_word_embeddings),
    )


def _neox_fields(hf: Any) -> dict:
    act = hf.hidden_act
    if act not in _ACTS:
        raise _unsupported("hidden_act", act, f"supported: {sorted(_ACTS)}")
    # attention_bias covers query_key_value and dense; the MLP always has biases.
    return dict(
        d_model=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
        d_vocab=hf.vocab_size, n_ctx=hf.max_position_embeddings, d_mlp=hf.intermediate_size,
        d_head=hf.hidden_size // hf.num_attention_heads, norm="layernorm", positional="rope",
        ffn=_ACTS[act], bias=True, qkv_bias=bool(hf.attention_bias),
        parallel_residual=bool(hf.use_parallel_residual), norm_eps=hf.layer_norm_eps,
        tie_embeddings=bool(hf.tie_word_embeddings),
    )


def _llama_fields(hf: Any, family: str) -> dict:
    act = hf.hidden_act
    if act not in _GATED_ACTS:
        raise _unsupported("hidden_act", act, f"supported for {family}: {sorted(_GATED_ACTS)}")
    d_head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    fields = dict(
        d_model=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads, d_vocab=hf.vocab_size,
        n_ctx=hf.max_position_embeddings, d_mlp=hf.intermediate_size, d_head=d_head,
        norm="rmsnorm", positional="rope", ffn=_GATED_ACTS[act], norm_eps=hf.rms_norm_eps,
        tie_embeddings=bool(hf.tie_word_embeddings), bias=False,
    )
    if family == "llama":
        attn_bias, mlp_bias = bool(hf.attention_bias), bool(hf.mlp_bias)
        # Our `bias` covers o_proj and the MLP together; the part HF lacks is imported as zeros.
        fields.update(bias=attn_bias or mlp_bias, qkv_bias=attn_bias)
    elif family == "qwen2":
        fields.update(qkv_bias=True)  # Qwen2: q/k/v biases, nothing else
    elif family in ("qwen3", "olmo2"):
        # attention_bias: q/k/v and o_proj; the MLP has none (imported as zeros, exact)
        attn_bias = bool(getattr(hf, "attention_bias", False))
        fields.update(bias=attn_bias, qkv_bias=attn_bias, qk_norm="head" if family == "qwen3" else "projection")
        if family == "olmo2":
            fields.update(norm_placement="reordered")
    elif family == "mixtral":
        if act not in ("silu", "swish"):
            raise _unsupported("hidden_act", act, "Mixtral experts are SwiGLU here (silu)")
        fields.update(ffn="moe", moe_expert="swiglu", n_experts=hf.num_local_experts,
                      experts_per_token=hf.num_experts_per_tok)
    return fields


def _deepseek_fields(hf: Any, family: str) -> dict:
    """DeepSeek-V2/V3: MLA attention; dense SwiGLU for the first ``first_k_dense_replace`` layers,
    then MoE with shared experts. V2 (as transformers runs it): softmax scores, top-k greedy or
    group-limited (a group scored by its best expert), no renormalisation (transformers' V2 never
    reads ``norm_topk_prob``), times ``routed_scaling_factor``. V3: sigmoid scores, the choice
    biased by ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group`` groups (a
    group scored by its best two), optional renormalisation, times ``routed_scaling_factor``."""
    if hf.hidden_act not in ("silu", "swish"):
        raise _unsupported("hidden_act", hf.hidden_act, f"{family} MLPs are SwiGLU here (silu)")
    if hf.num_key_value_heads not in (None, hf.num_attention_heads):
        raise _unsupported("num_key_value_heads", hf.num_key_value_heads,
                           "MLA reads every head's key and value from the latent; transformers then repeats them, "
                           "which only num_key_value_heads = num_attention_heads keeps well-defined")
    partial = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _unsupported("rope_parameters.partial_rotary_factor", partial, "MLA rotates the whole qk_rope_head_dim")
    attn_bias, mlp_bias = bool(hf.attention_bias), bool(getattr(hf, "mlp_bias", False))
    n_layers = hf.num_hidden_layers
    fields = dict(
        d_model=hf.hidden_size, n_layers=n_layers, n_heads=hf.num_attention_heads, d_vocab=hf.vocab_size,
        n_ctx=hf.max_position_embeddings, d_mlp=hf.intermediate_size, d_head=hf.v_head_dim, norm="rmsnorm",
        positional="rope", ffn="swiglu", norm_eps=hf.rms_norm_eps, tie_embeddings=bool(hf.tie_word_embeddings),
        # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj; our `bias` covers o_proj and the MLPs.
        bias=attn_bias or mlp_bias, qkv_bias=attn_bias,
        attention="mla", kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        # V2 rotates (0,1),(2,3).. pairs (complex multiply); V3 does with rope_interleave (its output
        # lists the pairs' first then second halves: a permutation of q and k alike, same scores).
        rotary_interleaved=True if family == "deepseek_v2" else bool(hf.rope_interleave),
    )
    first_dense = min(hf.first_k_dense_replace or 0, n_layers)
    if first_dense == n_layers:
        return fields
    if not hf.n_shared_experts:
        raise _unsupported("n_shared_experts", hf.n_shared_experts, "a zero-width shared MLP is not modelled")
    n_experts = hf.n_routed_experts
    fields.update(ffn="moe", moe_expert="swiglu", n_experts=n_experts, experts_per_token=hf.num_experts_per_tok,
                  moe_d_mlp=hf.moe_intermediate_size, n_shared_experts=hf.n_shared_experts,
                  moe_first_dense=first_dense, moe_routed_scale=float(hf.routed_scaling_factor), moe_router_fp32=True)
    groups = dict(moe_n_groups=hf.n_group or 1, moe_topk_groups=hf.topk_group or 1)
    if family == "deepseek_v2":
        if hf.topk_method not in ("greedy", "group_limited_greedy"):
            raise _unsupported("topk_method", hf.topk_method, "transformers' DeepSeek-V2 routes greedy or group_limited_greedy")
        if hf.topk_method == "greedy":
            groups = dict(moe_n_groups=1, moe_topk_groups=1)
        fields.update(moe_router="softmax", moe_norm_topk=False, moe_group_score="max", **groups)
    else:
        fields.update(moe_router="sigmoid", moe_norm_topk=bool(hf.norm_topk_prob), moe_group_score="top2_sum",
                      moe_score_bias=True, **groups)
    return fields


def _gemma_fields(hf: Any, family: str) -> dict:
    """Gemma 2 and Gemma 3 (text): sandwich norms with (1 + w) scales, scaled embeddings, soft-caps
    (Gemma 2), QK-norm and a RoPE base of their own for the local layers (Gemma 3)."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act not in _GEMMA_ACTS:
        raise _unsupported("hidden_activation", act, f"supported for {family}: {sorted(_GEMMA_ACTS)}")
    if getattr(hf, "use_bidirectional_attention", False):
        raise _unsupported("use_bidirectional_attention", True, "the workbench builds causal decoders")
    attn_bias = bool(getattr(hf, "attention_bias", False))
    n_layers = hf.num_hidden_layers
    fields = dict(
        d_model=hf.hidden_size, n_layers=n_layers, n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads, d_vocab=hf.vocab_size,
        n_ctx=hf.max_position_embeddings, d_mlp=hf.intermediate_size, d_head=hf.head_dim,
        norm="gemma_rmsnorm", norm_placement="sandwich", positional="rope", ffn=_GEMMA_ACTS[act],
        norm_eps=hf.rms_norm_eps, tie_embeddings=bool(hf.tie_word_embeddings), bias=attn_bias, qkv_bias=attn_bias,
        final_logit_softcap=hf.final_logit_softcapping, query_pre_attn_scalar=hf.query_pre_attn_scalar,
        scale_embeddings=True,
    )
    # HF's Gemma 3 attention never passes attn_logit_softcapping on (its eager attention gets no softcap):
    # reproducing its numbers means leaving it out, as it does.
    if family == "gemma2":
        fields.update(attn_logit_softcap=hf.attn_logit_softcapping)
    else:
        fields.update(qk_norm="head")
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * n_layers)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n_layers:
        raise _unsupported("layer_types", types, f"one of sliding_attention/full_attention per layer ({n_layers})")
    if "sliding_attention" not in types:
        return fields
    if not getattr(hf, "sliding_window", None):
        raise _unsupported("sliding_window", getattr(hf, "sliding_window", None), "sliding_attention layers need a window")
    fields.update(_periodic_window(types, int(hf.sliding_window)))
    if family == "gemma3_text":
        local = dict(hf.rope_parameters.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
            raise _unsupported("rope_parameters.sliding_attention", local, "local layers rotate with plain RoPE here")
        fields.update(rope_local_base=float(local["rope_theta"]))
    return fields


def _global_rope_parameters(hf: Any, family: str) -> Optional[dict]:
    """Gemma 3 keeps RoPE per layer type; its full-attention entry is the model's RoPE (None: the flat one)."""
    params = getattr(hf, "rope_parameters", None) or {}
    return dict(params.get("full_attention") or {}) if family == "gemma3_text" else None


def _rope_fields(hf: Any, family: str, d_head: int, params: Optional[dict] = None) -> dict:
    params = dict(params if params is not None else (getattr(hf, "rope_parameters", None) or {}))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("longrope", "su"):  # named before its short_factor/long_factor tables are
        raise _unsupported("rope_parameters.rope_type", rope_type,
                           "LongRoPE's per-frequency short_factor/long_factor rescaling is not modelled")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise _unsupported(f"rope_parameters.{unknown[0]}", params[unknown[0]], "not a RoPE option the workbench models")
    partial = params.get("partial_rotary_factor", 1.0)
    rotary_dim = int(d_head * partial)
    if (family in LLAMA_LIKE or family in GEMMA) and rotary_dim != d_head:
        raise _unsupported("rope_parameters.partial_rotary_factor", partial, f"{family} rotates the whole head")
    max_pos = hf.max_position_embeddings
    out = dict(rope_base=float(params["rope_theta"]), rotary_dim=rotary_dim, n_ctx=max_pos)
    if rope_type == "default":
        return out
    if rope_type not in ("linear", "dynamic", "llama3", "yarn"):
        raise _unsupported("rope_parameters.rope_type", rope_type, "supported: default, linear, dynamic, llama3, yarn")
    original = params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if factor is None:
        if rope_type != "yarn":
            raise _unsupported("rope_parameters.factor", None, f"rope_type={rope_type!r} needs a factor")
        factor = max_pos / original
    out.update(rope_scaling=rope_type, rope_scaling_factor=float(factor))
    if rope_type in ("linear", "dynamic"):
        # HF scales relative to max_position_embeddings, the length the model was trained at.
        original = max_pos
    out.update(rope_original_n_ctx=int(original), n_ctx=max(max_pos, int(factor * original)))
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]))
    if rope_type == "yarn":
        for key in ("mscale", "mscale_all_dim"):
            if params.get(key):
                raise _unsupported(f"rope_parameters.{key}", params[key], "YaRN's DeepSeek mscale variant is not modelled")
        default_scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        given = params.get("attention_factor")
        if given is not None and abs(given - default_scale) > 1e-12:
            raise _unsupported("rope_parameters.attention_factor", given, f"only YaRN's default {default_scale} is modelled")
        if params.get("truncate", True) is False:
            raise _unsupported("rope_parameters.truncate", False, "only the truncated correction range is modelled")
        out.update(rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1))
    elif params.get("attention_factor") not in (None, 1.0):
        raise _unsupported("rope_parameters.attention_factor", params["attention_factor"], f"not used by {rope_type}")
    return out


def _periodic_window(types: list, window: int, field: str = "layer_types", value: Any = None) -> dict:
    """``sliding_window`` and ``global_every`` for per-layer ``types`` (sliding_attention / full_attention);
    ``UnsupportedHFConfig`` naming ``field`` for a pattern our config cannot express."""
    n_layers = len(types)
    for every in (0, *range(2, n_layers + 1)):  # 0: every layer local; k: layers k-1, 2k-1, ... global
        if types == ["sliding_attention" if every == 0 or (i + 1) % every else "full_attention" for i in range(n_layers)]:
            return dict(sliding_window=window, global_every=every)
    raise _unsupported(field, types if value is None else value,
                       f"sliding layers {types}: only every layer local or every k-th layer global is modelled")


def _window_fields(hf: Any, family: str, n_ctx: int) -> dict:
    """The sliding window of Mistral, Mixtral, Phi-3 (every layer) or Qwen2/Qwen3 (the layers
    ``layer_types`` names, as transformers' attention reads them); none when it never cuts the context."""
    window = getattr(hf, "sliding_window", None)  # Qwen: None unless use_sliding_window
    n_layers = hf.num_hidden_layers
    if family in SLIDING_EVERY_LAYER:
        types = ["sliding_attention"] * n_layers
    else:
        types = list(getattr(hf, "layer_types", None) or ["full_attention"] * n_layers)
        if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise _unsupported("layer_types", types, f"one of sliding_attention/full_attention per layer ({n_layers})")
    if window is None or window >= n_ctx or "sliding_attention" not in types:
        return {}
    if family in SLIDING_BY_LAYER_TYPES:  # the default pattern: full below max_window_layers, sliding from it on
        mwl = getattr(hf, "max_window_layers", None)
        if mwl is not None and types == ["sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)]:
            return _periodic_window(types, int(window), "max_window_layers", mwl)
    return _periodic_window(types, int(window))


# ---- ours -> HF -----------------------------------------------------------------------
def hf_family_for(cfg: ModelConfig) -> str:
    """The HF family that expresses ``cfg`` exactly; ``UnsupportedHFConfig`` naming the component if none."""

    def no(component: str, why: str) -> UnsupportedHFConfig:
        return UnsupportedHFConfig(f"{component} has no Hugging Face equivalent among {list(FAMILIES)}: {why}")

    gemma = _gemma_family_for(cfg)
    if gemma is not None:
        return gemma

    if cfg.norm_placement in ("post", "sandwich"):
        raise no(f"norm_placement={cfg.norm_placement!r} ({cfg.norm_placement}-norm)",
                 "supported families are pre-norm, or reordered (OLMo 2)")
    if cfg.positional in ("alibi", "sinusoidal", "none"):
        raise no(f"positional={cfg.positional!r}", "supported families use learned positions or RoPE")
    if cfg.norm == "none":
        raise no("norm='none'", "every supported family normalises")
    if cfg.attn_only:
        raise no("attn_only=True", "every supported family has an FFN")
    if (cfg.qk_norm != "none" or cfg.norm_placement == "reordered") and cfg.norm != "rmsnorm":
        raise no(f"qk_norm={cfg.qk_norm!r}, norm_placement={cfg.norm_placement!r} with norm={cfg.norm!r}",
                 "Qwen3 and OLMo 2 use RMSNorm")
    if cfg.folded_ln and cfg.norm == "layernorm":
        raise no("a folded LayerNorm (process_weights(fold_ln=True))",
                 "the final norm's bias now lives in an unembedding bias b_U, which no family has")
    if cfg.attention == "mla":
        return _deepseek_family(cfg, no)
    if cfg.sliding_window is not None:
        return _windowed_family(cfg, _plain_family(cfg, no), no)
    return _plain_family(cfg, no)


def _plain_family(cfg: ModelConfig, no: Any) -> str:
    """The family of a RoPE or learned-position, non-Gemma, non-MLA config, its window aside."""
    if cfg.rotary_interleaved:
        raise no("rotary_interleaved=True (GPT-J pairing)", "supported families rotate halves")
    gated = cfg.ffn in ("swiglu", "geglu")
    if cfg.positional == "learned":
        if cfg.norm != "layernorm" or gated or cfg.ffn == "moe" or cfg.parallel_residual or cfg.rope_scaling != "none":
            raise no(_describe(cfg), "learned positions export as GPT-2: LayerNorm, a plain GELU/ReLU MLP, sequential")
        _require_mha(cfg, "GPT-2")
        return "gpt2"
    if cfg.norm == "layernorm":
        if gated or cfg.ffn == "moe":
            raise no(f"ffn={cfg.ffn!r} with LayerNorm", "LayerNorm + RoPE exports as GPT-NeoX, whose MLP is plain")
        _require_mha(cfg, "GPT-NeoX")
        return "gpt_neox"
    if cfg.parallel_residual:
        raise no("parallel_residual=True with RMSNorm", "only GPT-NeoX (LayerNorm) has a parallel block")
    newer = _newer_family(cfg, gated, no)
    if newer is not None:
        return newer
    if cfg.rotary_dim != cfg.d_head:
        raise no("rotary_dim < d_head with RMSNorm", "Llama-family models rotate the whole head")
    if cfg.ffn == "moe":
        if cfg.moe_expert != "swiglu" or cfg.bias or cfg.qkv_bias:
            raise no(f"ffn='moe' with moe_expert={cfg.moe_expert!r}, bias={cfg.bias}, qkv_bias={cfg.qkv_bias}",
                     "Mixtral has SwiGLU experts and no biases at all")
        return "mixtral"
    if not gated:
        raise no(f"ffn={cfg.ffn!r} with RMSNorm", "Llama-family MLPs are gated (swiglu, geglu)")
    if cfg.qkv_bias and not cfg.bias:
        return "qwen2" if cfg.ffn == "swiglu" else "llama"
    return "llama"


def _gemma_family_for(cfg: ModelConfig) -> Optional[str]:
    """gemma2 or gemma3_text for a Gemma-style config; None for a config with nothing of Gemma's;
    ``UnsupportedHFConfig`` naming the component for a mix no family has."""
    used = [name for name in GEMMA_OPTIONS if getattr(cfg, name) not in (None, False, 0)]
    if cfg.norm != "gemma_rmsnorm" and not used:  # (a sandwich of plain norms is refused by the caller)
        return None

    def no(component: str, why: str) -> UnsupportedHFConfig:
        return UnsupportedHFConfig(f"{component} has no Hugging Face equivalent among {list(FAMILIES)}: {why}")

    wanted = dict(norm="gemma_rmsnorm", norm_placement="sandwich", positional="rope", scale_embeddings=True,
                  parallel_residual=False, attn_only=False, rotary_interleaved=False, folded_ln=False)
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            why = f"only Gemma 2/3 have {', '.join(used) or 'these options'}, and Gemma needs {name}={value!r}"
            raise no(f"{name}={getattr(cfg, name)!r}", why)
    if cfg.ffn not in ("geglu_tanh", "geglu"):
        raise no(f"ffn={cfg.ffn!r} in a Gemma-style model", "Gemma's MLP is GeGLU (geglu_tanh or geglu)")
    if cfg.rotary_dim != cfg.d_head:
        raise no("rotary_dim < d_head in a Gemma-style model", "Gemma rotates the whole head")
    if cfg.qk_norm == "projection":
        raise no("qk_norm='projection' in a Gemma-style model", "Gemma 3's QK-norm is per head")
    if cfg.qk_norm == "none":
        if cfg.rope_local_base is not None:
            raise no("rope_local_base without qk_norm='head'", "only Gemma 3 (with its per-head QK-norm) has a local RoPE base")
        return "gemma2"
    if cfg.attn_logit_softcap is not None:
        raise no("attn_logit_softcap with qk_norm='head'", "HF's Gemma 3 does not soft-cap attention (Gemma 2 has no QK-norm)")
    if cfg.rope_local_base is None and cfg.sliding_window is not None and cfg.rope_scaling != "none":
        raise no("rope_scaling on local layers", "Gemma 3's local layers rotate with plain RoPE: set rope_local_base")
    return "gemma3_text"


def _newer_family(cfg: ModelConfig, gated: bool, no) -> Optional[str]:
    """Qwen3 (per-head QK-norm), OLMo 2 (QK-norm over the projection, reordered norms) or Phi-3
    (partial rotary with RMSNorm); None for a config that is none of them."""
    qk, reordered, partial = cfg.qk_norm != "none", cfg.norm_placement == "reordered", cfg.rotary_dim != cfg.d_head
    if not (qk or reordered or partial):
        return None
    if not gated or cfg.ffn == "moe":
        raise no(f"ffn={cfg.ffn!r} with qk_norm={cfg.qk_norm!r}, norm_placement={cfg.norm_placement!r}",
                 "Qwen3, OLMo 2 and Phi-3 have a gated MLP")
    if partial and (qk or reordered):
        raise no("rotary_dim < d_head with QK-norm or reordered norms", "Qwen3 and OLMo 2 rotate the whole head")
    if partial:
        if cfg.rope_scaling != "none":
            raise no(f"rope_scaling={cfg.rope_scaling!r} with rotary_dim < d_head", "Phi-3 has only default RoPE here")
        if cfg.bias or cfg.qkv_bias:
            raise no("biases with rotary_dim < d_head", "partial rotary with RMSNorm exports as Phi-3, which has no biases")
        return "phi3"
    if cfg.qk_norm == "head" and not reordered:
        return "qwen3"
    if cfg.qk_norm == "projection" and reordered:
        return "olmo2"
    raise no(f"qk_norm={cfg.qk_norm!r} with norm_placement={cfg.norm_placement!r}",
             "Qwen3 is per-head QK-norm with pre-norm, OLMo 2 QK-norm over the projection with reordered norms")


def _windowed_family(cfg: ModelConfig, family: str, no: Any) -> str:
    """The family for a non-Gemma config with a sliding window: every layer local exports as Mistral
    (Llama without biases), Mixtral, Phi-3, Qwen2 or Qwen3; every k-th layer global as Qwen2 or
    Qwen3 (their layer_types)."""
    if cfg.global_every == 0 and family == "llama":
        if cfg.bias or cfg.qkv_bias:
            raise no(f"sliding_window={cfg.sliding_window} with bias={cfg.bias}, qkv_bias={cfg.qkv_bias}",
                     "Llama has no sliding window; Mistral has one and no biases (Qwen2: q/k/v biases only)")
        return "mistral"
    allowed = SLIDING_EVERY_LAYER + SLIDING_BY_LAYER_TYPES if cfg.global_every == 0 else SLIDING_BY_LAYER_TYPES
    if family not in allowed:
        what = "every layer local" if cfg.global_every == 0 else f"global_every={cfg.global_every}"
        raise no(f"sliding_window={cfg.sliding_window} ({what}) in a {family}-shaped model",
                 f"of the non-Gemma families only {', '.join(allowed)} slide that way")
    return family


def _deepseek_family(cfg: ModelConfig, no: Any) -> str:
    """DeepSeek-V2 or V3 for an MLA model (RMSNorm, RoPE, SwiGLU, sequential pre-norm)."""
    if cfg.norm != "rmsnorm" or cfg.parallel_residual:
        raise no(f"attention='mla' with norm={cfg.norm!r}, parallel_residual={cfg.parallel_residual}",
                 "DeepSeek blocks are sequential with RMSNorm")
    if (cfg.moe_expert if cfg.ffn == "moe" else cfg.ffn) != "swiglu":
        raise no(f"attention='mla' with ffn={cfg.ffn!r}, moe_expert={cfg.moe_expert!r}", "DeepSeek MLPs are SwiGLU")
    if cfg.ffn != "moe":
        return "deepseek_v2" if cfg.rotary_interleaved else "deepseek_v3"
    if cfg.n_shared_experts == 0:
        raise no("ffn='moe' with n_shared_experts=0 and attention='mla'", "DeepSeek MoE layers have shared experts")
    grouped = cfg.moe_n_groups > 1
    if cfg.moe_router == "sigmoid":
        if grouped and cfg.moe_group_score != "top2_sum":
            raise no("moe_router='sigmoid' with moe_group_score='max'", "DeepSeek-V3 scores a group by its best two experts")
        return "deepseek_v3"
    if cfg.moe_norm_topk or (grouped and cfg.moe_group_score != "max") or not cfg.rotary_interleaved:
        raise no(f"moe_router='softmax' with moe_norm_topk={cfg.moe_norm_topk}, moe_group_score={cfg.moe_group_score!r}, "
                 f"rotary_interleaved={cfg.rotary_interleaved}",
                 "softmax routing exports as DeepSeek-V2: no renormalisation, groups scored by their best expert, "
                 "interleaved RoPE")
    return "deepseek_v2"


def _describe(cfg: ModelConfig) -> str:
    return f"positional='learned' with norm={cfg.norm!r}, ffn={cfg.ffn!r}, parallel_residual={cfg.parallel_residual}"


def _require_mha(cfg: ModelConfig, family: str) -> None:
    if cfg.n_kv_heads != cfg.n_heads:
        raise UnsupportedHFConfig(f"n_kv_heads={cfg.n_kv_heads} < n_heads (GQA/MQA) has no {family} equivalent")
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise UnsupportedHFConfig(f"d_head={cfg.d_head} with n_heads * d_head != d_model has no {family} equivalent")


def hf_config_for(cfg: ModelConfig, family: Optional[str] = None) -> Any:
    """A ``transformers`` config of ``family`` (default: ``hf_family_for(cfg)``) equal to ``cfg``."""
    import transformers

    family = family or hf_family_for(cfg)
    common = dict(vocab_size=cfg.d_vocab, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if family == "gpt2":
        act = {"gelu_new": "gelu_new", "gelu": "gelu", "relu": "relu"}[cfg.ffn]
        return transformers.GPT2Config(
            n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_positions=cfg.n_ctx,
            n_inner=cfg.d_mlp, activation_function=act, layer_norm_epsilon=cfg.norm_eps, **common,
        )
    rope = _rope_parameters(cfg)
    max_pos = cfg.rope_original_n_ctx if cfg.rope_scaling in ("linear", "dynamic") and cfg.rope_original_n_ctx else cfg.n_ctx
    if family == "gpt_neox":
        act = {"gelu_new": "gelu_new", "gelu": "gelu", "relu": "relu"}[cfg.ffn]
        rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.d_head
        return transformers.GPTNeoXConfig(
            hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            intermediate_size=cfg.d_mlp, hidden_act=act, max_position_embeddings=max_pos,
            layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_residual,
            attention_bias=cfg.bias or cfg.qkv_bias, rope_parameters=rope, **common,
        )
    sizes = dict(
        hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head, intermediate_size=cfg.d_mlp,
        max_position_embeddings=max_pos, rms_norm_eps=cfg.norm_eps, rope_parameters=rope,
        hidden_act="silu" if cfg.act_fn == "silu" else "gelu", **common,
    )
    if family in DEEPSEEK:
        return _deepseek_config(cfg, family, sizes)
    if family in GEMMA:
        return _gemma_config(cfg, family, sizes, rope)
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                                          sliding_window=cfg.sliding_window, **sizes)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=cfg.sliding_window, **sizes)
    # Qwen: the window applies where layer_types says sliding_attention (max_window_layers is then unused)
    qwen = dict(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window, max_window_layers=0,
                layer_types=["sliding_attention" if cfg.layer_is_local(i) else "full_attention" for i in range(cfg.n_layers)])
    if family == "qwen2":
        return transformers.Qwen2Config(**qwen, **sizes)
    if family == "qwen3":
        return transformers.Qwen3Config(attention_bias=cfg.bias or cfg.qkv_bias, **qwen, **sizes)
    if family == "olmo2":
        return transformers.Olmo2Config(attention_bias=cfg.bias or cfg.qkv_bias, **sizes)
    if family == "phi3":
        rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.d_head
        return transformers.Phi3Config(sliding_window=cfg.sliding_window, **sizes)
    return transformers.LlamaConfig(attention_bias=cfg.bias or cfg.qkv_bias, mlp_bias=cfg.bias, **sizes)


def _deepseek_config(cfg: ModelConfig, family: str, sizes: dict) -> Any:
    import transformers

    sizes = {k: v for k, v in sizes.items() if k not in ("head_dim", "num_key_value_heads")}
    moe = cfg.ffn == "moe"
    kw = dict(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.d_head, num_key_value_heads=cfg.n_heads,
              attention_bias=cfg.qkv_bias or cfg.bias, first_k_dense_replace=cfg.moe_first_dense if moe else cfg.n_layers,
              n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.moe_d_mlp, n_shared_experts=max(cfg.n_shared_experts, 1),
              routed_scaling_factor=cfg.moe_routed_scale, n_group=cfg.moe_n_groups, topk_group=cfg.moe_topk_groups,
              norm_topk_prob=cfg.moe_norm_topk)
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            mlp_bias=cfg.bias, topk_method="group_limited_greedy" if cfg.moe_n_groups > 1 else "greedy", **kw, **sizes)
    return transformers.DeepseekV3Config(rope_interleave=cfg.rotary_interleaved, **kw, **sizes)


def _rope_parameters(cfg: ModelConfig) -> dict:
    rope: dict = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling, "rope_theta": cfg.rope_base}
    if cfg.rope_scaling == "none":
        return rope
    rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope_original_n_ctx or cfg.n_ctx
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
    return rope


def _gemma_config(cfg: ModelConfig, family: str, sizes: dict, rope: dict) -> Any:
    import transformers

    sizes = {k: v for k, v in sizes.items() if k not in ("hidden_act", "rope_parameters")}
    layer_types = ["sliding_attention" if cfg.layer_is_local(i) else "full_attention" for i in range(cfg.n_layers)]
    common = dict(
        hidden_activation="gelu_pytorch_tanh" if cfg.ffn == "geglu_tanh" else "gelu", attention_bias=cfg.qkv_bias or cfg.bias,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.d_head, final_logit_softcapping=cfg.final_logit_softcap,
        sliding_window=cfg.sliding_window or cfg.n_ctx, layer_types=layer_types, **sizes,
    )
    if family == "gemma2":
        return transformers.Gemma2Config(attn_logit_softcapping=cfg.attn_logit_softcap, rope_parameters=rope, **common)
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_base or cfg.rope_base}
    return transformers.Gemma3TextConfig(attn_logit_softcapping=None, **common,
                                         rope_parameters={"full_attention": rope, "sliding_attention": local})
