"""ModelConfig: every architectural choice of the decoder-only skeleton, as plain data.

A frozen dataclass of primitives, so it survives JSON, checkpoints and Streamlit's
cache. Component choices are ``Literal`` strings resolved once by the registries in
``workbench.components``. TransformerLens utilities read ``model.cfg`` by their own
field names (``normalization_type``, ``act_fn``, ``gated_mlp``, ...); those are
read-only properties derived here from our choices so the two vocabularies never drift.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from workbench.utils import check_float, check_int, check_seed

NormChoice = Literal["layernorm", "rmsnorm", "gemma_rmsnorm", "none"]
PlacementChoice = Literal["pre", "post", "sandwich", "reordered"]
PositionalChoice = Literal["learned", "sinusoidal", "rope", "alibi", "none"]
FFNChoice = Literal["relu", "gelu", "gelu_new", "swiglu", "geglu", "geglu_tanh", "moe"]
MoEExpertChoice = Literal["swiglu", "geglu", "relu", "gelu", "gelu_new"]
RopeScalingChoice = Literal["none", "linear", "dynamic", "llama3", "yarn"]
QKNormChoice = Literal["none", "head", "projection"]
AttentionChoice = Literal["mha", "mla"]
MoERouterChoice = Literal["softmax", "sigmoid"]
MoEGroupScoreChoice = Literal["max", "top2_sum"]
class ConfigError(ValueError):
    """A ModelConfig that is not a valid model, with what a caller can act on besides the message:
    ``field``, the field to give or change (``d_head`` when it cannot be derived), and ``fields``,
    every field the reason involves. A page with no widget for ``field`` reads these, never the
    message's wording."""

    def __init__(self, message: str, field: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.field = field
        self.fields = tuple(fields) or (field,)


MLA_SIZES = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

FORMAT_VERSION = 1


# no_type_check: validation is __post_init__'s job, with messages that list the choices;
# the test-time jaxtyping/beartype hook would otherwise pre-empt it with a generic error.
@typing.no_type_check
@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only model.

    Sizes use TransformerLens' names. ``None`` for a derived size means "the usual
    default": ``d_head = d_model // n_heads``, ``n_kv_heads = n_heads`` (MHA),
    ``d_mlp = 4 * d_model``.
    """

    d_model: int
    n_layers: int
    n_heads: int
    d_vocab: int
    n_ctx: int
    d_head: Optional[int] = None
    n_kv_heads: Optional[int] = None
    d_mlp: Optional[int] = None

    norm: NormChoice = "layernorm"
    # "sandwich" (Gemma 2/3): a norm before and after each sublayer, x = x + ln1_post(Attn(ln1(x)));
    # "reordered" (OLMo 2): only after, x = x + ln1_post(Attn(x)). See components/block.py.
    norm_placement: PlacementChoice = "pre"
    positional: PositionalChoice = "learned"
    ffn: FFNChoice = "gelu"
    attn_only: bool = False
    parallel_residual: bool = False
    tie_embeddings: bool = True

    # Biases: ``bias`` covers every linear map; ``qkv_bias`` overrides it for the
    # query/key/value projections only (Qwen2 has q/k/v biases and nothing else).
    bias: bool = True
    qkv_bias: Optional[bool] = None
    norm_eps: float = 1e-5

    # RoPE: ``rotary_dim`` < d_head rotates only the first dims (GPT-NeoX partial rotary);
    # ``rotary_interleaved`` pairs (0,1),(2,3).. (GPT-J) instead of halves (NeoX/Llama).
    rope_base: float = 10000.0
    rotary_dim: Optional[int] = None
    rotary_interleaved: bool = False
    rope_scaling: RopeScalingChoice = "none"
    rope_scaling_factor: float = 1.0
    rope_original_n_ctx: Optional[int] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0

    # QK-norm: an RMSNorm (its own weight, eps=norm_eps) on queries and keys after the projection,
    # before RoPE. "head": over each head's d_head, one weight shared by the heads (Qwen3, Gemma 3);
    # "projection": over the whole projection, n_heads*d_head for q, n_kv_heads*d_head for k (OLMo 2).
    qk_norm: QKNormChoice = "none"

    # Mixture of experts (ffn="moe"): top-k routing over n_experts gated MLPs.
    n_experts: int = 4
    experts_per_token: int = 2
    moe_expert: MoEExpertChoice = "swiglu"
    # DeepSeek-style MoE (all off by default, which is Mixtral's router): experts of their own
    # width ``moe_d_mlp`` (default d_mlp), ``n_shared_experts`` that every token passes through
    # (one dense MLP of width n_shared_experts * moe_d_mlp), the first ``moe_first_dense`` layers
    # dense (width d_mlp), softmax or sigmoid scores, optional renormalisation of the top k and a
    # scale on them, group-limited routing (the top ``moe_topk_groups`` of ``moe_n_groups`` expert
    # groups, a group scored by its best expert or by the sum of its best two), and a learned
    # per-expert bias added to the scores for the choice only (DeepSeek-V3's e_score_correction_bias).
    moe_d_mlp: Optional[int] = None
    n_shared_experts: int = 0
    moe_first_dense: int = 0
    moe_router: MoERouterChoice = "softmax"
    moe_norm_topk: bool = True
    moe_routed_scale: float = 1.0
    moe_n_groups: int = 1
    moe_topk_groups: int = 1
    moe_group_score: MoEGroupScoreChoice = "max"
    moe_score_bias: bool = False
    # Router precision in a bf16/fp16 model. False (Mixtral's): the logits in the model's dtype, the
    # softmax in float32. True (DeepSeek-V2/V3's): the logits from a float32 input and a float32
    # W_gate, and W_gate and b_score stay float32 whatever the model's dtype (transformers keeps
    # DeepSeek's gate.weight and e_score_correction_bias in float32). No effect in float32.
    moe_router_fp32: bool = False

    # Attention kind: "mha" is MHA/GQA/MQA (by n_kv_heads); "mla" is DeepSeek-V2/V3 multi-head latent
    # attention: keys and values are read up from one ``kv_lora_rank`` latent per token (RMS-normed),
    # plus a ``qk_rope_head_dim`` RoPE key shared by every head; queries optionally through a
    # ``q_lora_rank`` latent. A head's query/key is ``qk_nope_head_dim + qk_rope_head_dim`` wide and its
    # value ``v_head_dim`` (= d_head: z and W_O use it). None: the MLA defaults (kv_lora_rank = 4 d_head,
    # qk_nope_head_dim = d_head, qk_rope_head_dim = d_head / 2, no query compression); all None for "mha".
    attention: AttentionChoice = "mha"
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None

    init_std: float = 0.02
    seed: Optional[int] = None
    name: str = ""

    # Set by ``HookedDecoder.process_weights(fold_ln=True)``: every norm's weight (and LayerNorm's
    # bias) lives in the weights that read the norm, so the norms only centre (LayerNorm) and
    # scale; TransformerLens calls these "LNPre" / "RMSPre" (``normalization_type``).
    folded_ln: bool = False

    # Gemma 2/3 (each off by default, each usable alone). Soft-capping: cap * tanh(x / cap) on the
    # attention scores before the mask (this forces the explicit attention path: SDPA cannot do
    # it) and on the logits. ``query_pre_attn_scalar``: scores are divided by its square root
    # instead of sqrt(d_head). ``sliding_window``: a local layer's query sees itself and the
    # window - 1 positions before it; ``global_every`` = k makes layers k-1, 2k-1, ... global (full
    # context; Gemma 2: 2, Gemma 3: 6), 0 makes every layer local (Mistral). ``rope_local_base``:
    # local layers rotate with this base and no RoPE scaling (Gemma 3); None: every layer uses
    # rope_base and rope_scaling. ``scale_embeddings``: the embedding is multiplied by sqrt(d_model),
    # rounded to the weights' dtype first, as HF's Gemma does.
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    sliding_window: Optional[int] = None
    global_every: int = 0
    rope_local_base: Optional[float] = None
    scale_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_literal(f.name, getattr(self, f.name), _resolved_hints()[f.name])
        for name in ("d_model", "n_layers", "n_heads", "d_vocab", "n_ctx"):
            _check_positive(name, getattr(self, name))
        for name in ("d_head", "n_kv_heads", "d_mlp", "rotary_dim", "rope_original_n_ctx", "moe_d_mlp", *MLA_SIZES):
            if getattr(self, name) is not None:  # given explicitly: checked before anything is derived from it
                _check_positive(name, getattr(self, name))
        if self.attention == "mla" and self.d_head is None and self.v_head_dim is not None:
            object.__setattr__(self, "d_head", self.v_head_dim)  # MLA's value head is the d_head of z and W_O
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                    "set d_head explicitly or choose n_heads dividing d_model",
                    field="d_head", fields=("d_head", "d_model", "n_heads"),
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        if self.d_mlp is not None and self.moe_d_mlp is None:
            object.__setattr__(self, "moe_d_mlp", self.d_mlp)
        self._check_mla()
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.d_head)
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        _check_positive("n_experts", self.n_experts)
        check_int("ModelConfig.experts_per_token", self.experts_per_token, 1, self.n_experts)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(n_kv_heads = n_heads is MHA, 1 is MQA, a divisor in between is GQA)",
                field="n_kv_heads", fields=("n_kv_heads", "n_heads"),
            )
        # Only RoPE rotates: with other positions rotary_dim is inert (it still derives from d_head,
        # so an odd d_head such as d_model=100, n_heads=4 is fine until positional='rope').
        if self.positional == "rope" and self.attention == "mha" and (self.rotary_dim > self.d_head or self.rotary_dim % 2):
            raise ValueError(
                f"positional='rope' needs rotary_dim even and at most d_head={self.d_head}, got "
                f"rotary_dim={self.rotary_dim} (it defaults to d_head: set an even rotary_dim, or a d_head "
                "that is even)"
            )
        if self.parallel_residual and self.norm_placement != "pre":
            raise ValueError(
                "parallel_residual=True needs norm_placement='pre' (GPT-J/NeoX layout); "
                f"a {self.norm_placement}-norm parallel block has no standard definition"
            )
        if self.folded_ln and (self.norm == "none" or self.norm_placement == "post"):
            raise ValueError(
                f"folded_ln=True needs a pre-norm model (pre, sandwich or reordered) with a norm to fold; got norm={self.norm!r}, "
                f"norm_placement={self.norm_placement!r}"
            )
        if self.parallel_residual and self.attn_only:
            raise ValueError("parallel_residual=True has no meaning with attn_only=True")
        positive = ("norm_eps", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                    "rope_beta_fast", "rope_beta_slow")
        for name in positive:
            check_float(f"ModelConfig.{name}", getattr(self, name), 0, None, lo_open=True)
        check_float("ModelConfig.rope_base", self.rope_base, 1, None, lo_open=True)
        check_float("ModelConfig.init_std", self.init_std, 0)
        check_seed("ModelConfig.seed", self.seed, optional=True)
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name must be a string, got {self.name!r}")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("rope_high_freq_factor must exceed rope_low_freq_factor for llama3 RoPE scaling")
        _check_gemma_fields(self)
        self._check_moe()

    def _check_mla(self) -> None:
        """Derive the MLA sizes (attention='mla') or require them unset (attention='mha')."""
        if self.attention == "mha":
            given = [name for name in MLA_SIZES if getattr(self, name) is not None]
            if given:
                raise ValueError(f"ModelConfig.{given[0]}={getattr(self, given[0])} is a size of multi-head latent "
                                 "attention: set attention='mla', or leave it None for attention='mha'")
            return
        defaults = dict(kv_lora_rank=4 * self.d_head, qk_nope_head_dim=self.d_head,
                        qk_rope_head_dim=max(2, self.d_head // 2 // 2 * 2), v_head_dim=self.d_head)
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.v_head_dim != self.d_head:
            raise ValueError(f"attention='mla' uses d_head as the value head size: v_head_dim={self.v_head_dim} "
                             f"must equal d_head={self.d_head} (set one of them)")
        if self.positional != "rope":
            raise ValueError(f"attention='mla' needs positional='rope' (its decoupled RoPE key), got "
                             f"positional={self.positional!r}")
        if self.n_kv_heads is not None and self.n_kv_heads != self.n_heads:
            raise ValueError(f"attention='mla' has no KV heads to group: n_kv_heads={self.n_kv_heads} must equal "
                             f"n_heads={self.n_heads} (or be left None); its cache is the latent, see kv_lora_rank")
        for name in ("attn_logit_softcap", "query_pre_attn_scalar", "sliding_window", "rope_local_base"):
            if getattr(self, name) is not None:
                raise ValueError(f"attention='mla' has no {name} (a Gemma attention option): leave it None")
        if self.qk_norm != "none":
            raise ValueError(f"attention='mla' normalises its own latents; qk_norm={self.qk_norm!r} applies to "
                             "MHA/GQA/MQA queries and keys only: set qk_norm='none'")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"ModelConfig.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.qk_rope_head_dim)
        elif self.rotary_dim != self.qk_rope_head_dim:
            raise ValueError(f"attention='mla' rotates exactly the RoPE key: rotary_dim={self.rotary_dim} must equal "
                             f"qk_rope_head_dim={self.qk_rope_head_dim} (or be left None)")

    def _check_moe(self) -> None:
        check_int("ModelConfig.n_shared_experts", self.n_shared_experts, 0)
        check_int("ModelConfig.moe_first_dense", self.moe_first_dense, 0, self.n_layers)
        check_float("ModelConfig.moe_routed_scale", self.moe_routed_scale, 0, None, lo_open=True)
        check_int("ModelConfig.moe_n_groups", self.moe_n_groups, 1, self.n_experts)
        if self.n_experts % self.moe_n_groups:
            raise ValueError(f"ModelConfig.moe_n_groups={self.moe_n_groups} must divide n_experts={self.n_experts}")
        check_int("ModelConfig.moe_topk_groups", self.moe_topk_groups, 1, self.moe_n_groups)
        group = self.n_experts // self.moe_n_groups
        if self.experts_per_token > self.moe_topk_groups * group:
            raise ValueError(f"experts_per_token={self.experts_per_token} exceeds the {self.moe_topk_groups * group} "
                             f"experts of the moe_topk_groups={self.moe_topk_groups} groups a token may use")
        if self.moe_group_score == "top2_sum" and self.moe_n_groups > 1 and group < 2:
            raise ValueError("moe_group_score='top2_sum' needs at least 2 experts per group "
                             f"(n_experts={self.n_experts}, moe_n_groups={self.moe_n_groups})")

    def layer_is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window (False for every layer without one)."""
        if self.sliding_window is None:
            return False
        return self.global_every == 0 or (layer + 1) % self.global_every != 0

    # ---- TransformerLens' vocabulary, derived (read-only) -------------------------
    @property
    def normalization_type(self) -> Optional[str]:
        if self.folded_ln:
            return {"layernorm": "LNPre", "rmsnorm": "RMSPre", "gemma_rmsnorm": "RMSPre"}[self.norm]
        return {"layernorm": "LN", "rmsnorm": "RMS", "gemma_rmsnorm": "RMS", "none": None}[self.norm]

    @property
    def final_rms(self) -> bool:
        return self.norm in ("rmsnorm", "gemma_rmsnorm")

    @property
    def positional_embedding_type(self) -> str:
        return {
            "learned": "standard",
            "sinusoidal": "sinusoidal",
            "rope": "rotary",
            "alibi": "alibi",
            "none": "none",
        }[self.positional]

    @property
    def act_fn(self) -> str:
        act = self.moe_expert if self.ffn == "moe" else self.ffn
        return {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}.get(act, act)

    @property
    def gated_mlp(self) -> bool:
        return self.ffn in ("swiglu", "geglu", "geglu_tanh") or (self.ffn == "moe" and self.moe_expert in ("swiglu", "geglu"))

    @property
    def n_key_value_heads(self) -> Optional[int]:
        return None if self.n_kv_heads == self.n_heads else self.n_kv_heads

    @property
    def num_experts(self) -> Optional[int]:
        return self.n_experts if self.ffn == "moe" else None

    @property
    def rotary_base(self) -> float:
        return self.rope_base

    @property
    def eps(self) -> float:
        return self.norm_eps

    @property
    def parallel_attn_mlp(self) -> bool:
        return self.parallel_residual

    @property
    def use_attn_result(self) -> bool:
        return False

    @property
    def default_prepend_bos(self) -> bool:
        return False

    @property
    def original_architecture(self) -> str:
        return "workbench.HookedDecoder"

    @property
    def device(self) -> Optional[str]:
        return None

    # ---- construction and serialisation ---------------------------------------
    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed; derived sizes are re-derived unless given."""
        data = self.to_dict()
        for derived, default in _DERIVED_DEFAULTS.items():
            if derived not in changes and data[derived] == default(self):
                data[derived] = None
        data.update(changes)
        return ModelConfig.from_dict(data)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def identity_dict(self) -> dict:
        """The fields that differ from their defaults (and are not derived from others, as d_head is
        from d_model / n_heads): what makes this architecture what it is.

        Hashes of a model (the fingerprints stores, directions and dictionaries record) take this
        rather than ``to_dict``: a field added to ModelConfig later, with a default that keeps old
        models as they were, must not change every recorded fingerprint.
        """
        identity = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            if f.default is None:  # derived when left None (d_head, d_mlp, moe_d_mlp, ...): skip it when it was
                try:
                    if self.replace(**{f.name: None}) == self:
                        continue
                except ValueError:  # needed as given (e.g. an MLA size another field was checked against)
                    pass
            identity[f.name] = value
        return identity

    def to_json(self, path: str | Path | None = None, *, overwrite: bool = False) -> str:
        """The config as JSON; with ``path``, also written there (by rename). A file at ``path`` is
        replaced only when it is a ModelConfig (a Hugging Face ``config.json`` is not): else
        ValueError, nothing written, unless ``overwrite=True``."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            from workbench.overwrite import read_json_dict, refuse_foreign, write_atomic

            def ours(p: Path) -> bool:
                type(self).from_dict(read_json_dict(p))
                return True

            refuse_foreign([path], ours, overwrite=overwrite, what="writing the model config")
            write_atomic(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}; valid fields are {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ModelConfig":
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets are {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], "name": name, **overrides})

    @staticmethod
    def presets() -> list[str]:
        return sorted(PRESETS)


_DERIVED_DEFAULTS = {
    "d_head": lambda c: c.d_model // c.n_heads if c.d_model % c.n_heads == 0 else -1,
    "n_kv_heads": lambda c: c.n_heads,
    "d_mlp": lambda c: 4 * c.d_model,
    "rotary_dim": lambda c: c.qk_rope_head_dim if c.attention == "mla" else c.d_head,
    "moe_d_mlp": lambda c: c.d_mlp,
    "kv_lora_rank": lambda c: 4 * c.d_head if c.attention == "mla" else None,
    "qk_nope_head_dim": lambda c: c.d_head if c.attention == "mla" else None,
    "qk_rope_head_dim": lambda c: max(2, c.d_head // 2 // 2 * 2) if c.attention == "mla" else None,
    "v_head_dim": lambda c: c.d_head if c.attention == "mla" else None,
    "qkv_bias": lambda c: c.bias,
}

_HINTS: dict[str, Any] = {}


def _resolved_hints() -> dict[str, Any]:
    if not _HINTS:  # get_type_hints is empty under no_type_check, so evaluate the annotations
        for f in dataclasses.fields(ModelConfig):
            _HINTS[f.name] = eval(f.type, globals()) if isinstance(f.type, str) else f.type
    return _HINTS


def _check_literal(name: str, value: Any, hint: Any) -> None:
    args = typing.get_args(hint)
    literal = hint if typing.get_origin(hint) is Literal else None
    if literal is None:
        for arg in args:
            if typing.get_origin(arg) is Literal:
                literal = arg
    if literal is not None and value not in typing.get_args(literal):
        raise ValueError(
            f"ModelConfig.{name}={value!r} is not a valid choice; "
            f"valid choices are {list(typing.get_args(literal))}"
        )
    # Optional[bool] (qkv_bias) is typed like a plain bool.
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        if value is None:
            return
        hint = next(arg for arg in args if arg is not type(None))
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"ModelConfig.{name} must be true or false, got {value!r}")
    # int and float fields are checked with their ranges in __post_init__.


def _check_gemma_fields(cfg: ModelConfig) -> None:
    """The soft-caps, attention scalar, sliding window and local RoPE base: ranges and the fields they need."""
    for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_base"):
        if getattr(cfg, name) is not None:
            check_float(f"ModelConfig.{name}", getattr(cfg, name), 0, None, lo_open=True)
    if cfg.sliding_window is not None:
        _check_positive("sliding_window", cfg.sliding_window)
    check_int("ModelConfig.global_every", cfg.global_every, 0)
    if cfg.global_every and cfg.sliding_window is None:
        raise ValueError(f"global_every={cfg.global_every} needs sliding_window (it picks which layers are local)")
    if cfg.rope_local_base is not None:
        if cfg.positional != "rope" or cfg.sliding_window is None:
            raise ValueError(
                f"rope_local_base={cfg.rope_local_base} needs positional='rope' and a sliding_window (it is the RoPE "
                f"base of the local layers); got positional={cfg.positional!r}, sliding_window={cfg.sliding_window}"
            )
        if cfg.rope_local_base <= 1:
            raise ValueError(f"ModelConfig.rope_local_base must be a finite number > 1, got {cfg.rope_local_base!r}")


def _check_positive(name: str, value: Any) -> None:
    check_int(f"ModelConfig.{name}", value, 1)


PRESETS: dict[str, dict[str, Any]] = {
    # GPT-2 small (124M): the 2019 block, learned positions, tied head.
    "gpt2-small": dict(
        d_model=768, n_layers=12, n_heads=12, d_vocab=50257, n_ctx=1024,
        norm="layernorm", positional="learned", ffn="gelu_new", tie_embeddings=True,
    ),
    # GPT-3 175B as in Brown et al. (2020), table 2.1: d=12288, 96 layers, 96 heads.
    "gpt3-175b": dict(
        d_model=12288, n_layers=96, n_heads=96, d_vocab=50257, n_ctx=2048,
        norm="layernorm", positional="learned", ffn="gelu", tie_embeddings=True,
    ),
    # Small models for the bench: the 2020 block and the 2026 block.
    "gpt2-style-tiny": dict(
        d_model=128, n_layers=2, n_heads=4, d_vocab=512, n_ctx=128,
        norm="layernorm", positional="learned", ffn="gelu", tie_embeddings=True,
    ),
    "llama-style-tiny": dict(
        d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=352, d_vocab=512, n_ctx=128,
        norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, tie_embeddings=False,
        norm_eps=1e-6,
    ),
    "attn-only-2l": dict(
        d_model=128, n_layers=2, n_heads=8, d_vocab=64, n_ctx=64,
        norm="layernorm", positional="rope", attn_only=True, tie_embeddings=False,
    ),
    "moe-tiny": dict(
        d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=256, d_vocab=512, n_ctx=128,
        norm="rmsnorm", positional="rope", ffn="moe", n_experts=4, experts_per_token=2,
        bias=False, tie_embeddings=False,
    ),
    # Nanda et al. (2023), "Progress measures for grokking": one layer, no norm, ReLU MLP, learned
    # positions, untied; [a, b, =] in, the answer read at "=" (the modular task's layout="paper",
    # p = 113: 113 numbers + "="). init_std is TransformerLens' default 0.8 / sqrt(d_model). n_ctx is 4,
    # not the paper's 3, because a training sequence holds the answer too; the 4th position is never
    # read, gets no gradient and decays to zero under the weight decay.
    "grokking-1l": dict(
        d_model=128, n_layers=1, n_heads=4, d_mlp=512, d_vocab=114, n_ctx=4,
        norm="none", positional="learned", ffn="relu", tie_embeddings=False, init_std=0.8 / 128 ** 0.5,
    ),
    "nanogpt-bench": dict(
        d_model=256, n_layers=4, n_heads=8, d_mlp=1024, d_vocab=4096, n_ctx=256,
        norm="layernorm", positional="learned", ffn="gelu", tie_embeddings=True,
    ),
}
