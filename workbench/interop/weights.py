"""Weight maps between Hugging Face state dicts and ours, one table of rules per family.

A ``Rule`` ties one HF tensor to one or more of ours (GPT-2's fused ``c_attn`` holds Q, K
and V; GPT-NeoX's ``query_key_value`` interleaves them per head; Phi-3's ``qkv_proj`` stacks
them and its ``gate_up_proj`` stacks gate and up; Mixtral's ``gate_up_proj`` stacks gate and up
for every expert) with ``split`` (HF -> ours) and ``join`` (ours -> HF).
``split`` only reshapes, slices and transposes, so its outputs are views: an imported weight
keeps HF's memory layout and nothing is copied.
The same table drives import and export, so the round trip is the identity by construction
and the tests check each direction against HF's own forward.

Two layouts of the HF side: ``"file"`` is what a safetensors checkpoint holds (what
``save_pretrained`` writes and hub repositories store), ``"module"`` is a built transformers
model's ``state_dict``. They differ only where transformers 5 rearranges weights on load:
Mixtral's experts are per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3`` in files and one
fused ``mlp.experts.gate_up_proj`` / ``down_proj`` in memory, and GPT-NeoX's head is
``embed_out`` in files and ``lm_head`` in memory. Other spellings found in the wild (a GPT-2
saved from ``GPT2Model`` has no ``transformer.`` prefix, Llama from ``LlamaModel`` no
``model.``) are aliases of the same rule (``hf_aliases``), and tensors that are buffers, not
weights (GPT-2's causal mask ``attn.bias``, an old ``rotary_emb.inv_freq``), are skipped.

``rules_for`` is the table; ``plan_import``/``import_tensors`` and ``plan_export`` walk it one HF tensor at
a time, so the streamed reader (``streaming.py``) and the in-memory path share every check.

Layouts: HF ``nn.Linear`` weights are ``[out, in]``; GPT-2's ``Conv1D`` is ``[in, out]``; ours
are TransformerLens' (``W_Q [head, d_model, d_head]``, ``W_O [head, d_head, d_model]``,
``W_in [d_model, d_mlp]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Literal, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

from workbench.config import ModelConfig


@dataclass
class Rule:
    ours: tuple[str, ...]
    hf: str
    split: Callable[[Tensor], tuple[Tensor, ...]]
    join: Callable[..., Tensor]


def _same(ours: str, hf: str) -> Rule:
    return Rule((ours,), hf, lambda t: (t,), lambda t: t)


def _transposed(ours: str, hf: str) -> Rule:
    return Rule((ours,), hf, lambda t: (t.T,), lambda t: t.T)


def _heads_in(ours: str, hf: str, n: int, d_head: int) -> Rule:
    """nn.Linear [n * d_head, d_model] <-> [n, d_model, d_head]."""
    return Rule(
        (ours,), hf,
        lambda t: (t.reshape(n, d_head, -1).transpose(1, 2),),
        lambda w: w.transpose(1, 2).reshape(n * d_head, -1),
    )


def _heads_bias(ours: str, hf: str, n: int, d_head: int) -> Rule:
    return Rule((ours,), hf, lambda t: (t.reshape(n, d_head),), lambda b: b.reshape(n * d_head))


def _heads_out(ours: str, hf: str, n: int, d_head: int) -> Rule:
    """nn.Linear [d_model, n * d_head] <-> W_O [n, d_head, d_model]."""
    return Rule((ours,), hf, lambda t: (t.T.reshape(n, d_head, -1),), lambda w: w.reshape(n * d_head, -1).T)


def _norm(ours: str, hf: str, with_bias: bool) -> list[Rule]:
    rules = [_same(f"{ours}.w", f"{hf}.weight")]
    return rules + [_same(f"{ours}.b", f"{hf}.bias")] if with_bias else rules


def _head(cfg: ModelConfig, embed: str, lm_head: str) -> list[Rule]:
    rules = [_same("embed.W_E", embed)]
    if not cfg.tie_embeddings:
        rules.append(_transposed("unembed.W_U_param", lm_head))
    return rules


# ---- GPT-2 ------------------------------------------------------------------------------
def gpt2_rules(cfg: ModelConfig, layout: str = "file") -> list[Rule]:
    h, e, d = cfg.n_heads, cfg.d_head, cfg.d_model

    def split_qkv_weight(t: Tensor) -> tuple[Tensor, ...]:  # Conv1D [d_model, 3 * d_model]
        return tuple(w.reshape(d, h, e).permute(1, 0, 2) for w in t.split(d, dim=1))

    def join_qkv_weight(*ws: Tensor) -> Tensor:
        return torch.cat([w.permute(1, 0, 2).reshape(d, d) for w in ws], dim=1)

    rules = _head(cfg, "transformer.wte.weight", "lm_head.weight")
    rules.append(Rule(("pos_embed.W_pos",), "transformer.wpe.weight", lambda t: (t[: cfg.n_ctx],), lambda t: t))
    for l in range(cfg.n_layers):
        p, o = f"transformer.h.{l}", f"blocks.{l}"
        qkv = (f"{o}.attn.W_Q", f"{o}.attn._W_K", f"{o}.attn._W_V")
        qkv_b = (f"{o}.attn.b_Q", f"{o}.attn._b_K", f"{o}.attn._b_V")
        rules += _norm(f"{o}.ln1", f"{p}.ln_1", True) + _norm(f"{o}.ln2", f"{p}.ln_2", True)
        rules += [
            Rule(qkv, f"{p}.attn.c_attn.weight", split_qkv_weight, join_qkv_weight),
            Rule(qkv_b, f"{p}.attn.c_attn.bias", lambda t: tuple(b.reshape(h, e) for b in t.split(d)),
                 lambda *bs: torch.cat([b.reshape(d) for b in bs])),
            Rule((f"{o}.attn.W_O",), f"{p}.attn.c_proj.weight", lambda t: (t.reshape(h, e, d),), lambda w: w.reshape(d, d)),
            _same(f"{o}.attn.b_O", f"{p}.attn.c_proj.bias"),
            _same(f"{o}.mlp.W_in", f"{p}.mlp.c_fc.weight"),
            _same(f"{o}.mlp.b_in", f"{p}.mlp.c_fc.bias"),
            _same(f"{o}.mlp.W_out", f"{p}.mlp.c_proj.weight"),
            _same(f"{o}.mlp.b_out", f"{p}.mlp.c_proj.bias"),
        ]
    return rules + _norm("ln_final", "transformer.ln_f", True)


# ---- Llama, Mistral, Qwen2, Mixtral ------------------------------------------------------
def llama_rules(cfg: ModelConfig, layout: str = "file") -> list[Rule]:
    rules = _head(cfg, "model.embed_tokens.weight", "lm_head.weight")
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}", f"blocks.{l}"
        a = f"{p}.self_attn"
        rules += _llama_norms(cfg, p, o) + _qk_norm_rules(cfg, a, o)
        rules += _projection_rules(cfg, o, a)
        if cfg.ffn != "moe":
            rules += _gated_rules(f"{p}.mlp", f"{o}.mlp")
        else:
            rules += _fused_moe_rules(cfg, p, o) if layout == "module" else _expert_file_rules(cfg, p, o)
    return rules + _norm("ln_final", "model.norm", False)


def _projection_rules(cfg: ModelConfig, o: str, a: str) -> list[Rule]:
    """q/k/v/o_proj (weights and biases) of an HF self_attn ``a`` <-> our block ``o``'s attention."""
    h, kv, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    return [
        _heads_in(f"{o}.attn.W_Q", f"{a}.q_proj.weight", h, e),
        _heads_in(f"{o}.attn._W_K", f"{a}.k_proj.weight", kv, e),
        _heads_in(f"{o}.attn._W_V", f"{a}.v_proj.weight", kv, e),
        _heads_bias(f"{o}.attn.b_Q", f"{a}.q_proj.bias", h, e),
        _heads_bias(f"{o}.attn._b_K", f"{a}.k_proj.bias", kv, e),
        _heads_bias(f"{o}.attn._b_V", f"{a}.v_proj.bias", kv, e),
        _heads_out(f"{o}.attn.W_O", f"{a}.o_proj.weight", h, e),
        _same(f"{o}.attn.b_O", f"{a}.o_proj.bias"),
    ]


def _llama_norms(cfg: ModelConfig, p: str, o: str) -> list[Rule]:
    """The block's two norms: in front of each sublayer, or (OLMo 2, reordered) after it."""
    if cfg.norm_placement == "reordered":
        return _norm(f"{o}.ln1_post", f"{p}.post_attention_layernorm", False) + \
            _norm(f"{o}.ln2_post", f"{p}.post_feedforward_layernorm", False)
    return _norm(f"{o}.ln1", f"{p}.input_layernorm", False) + _norm(f"{o}.ln2", f"{p}.post_attention_layernorm", False)


def _qk_norm_rules(cfg: ModelConfig, a: str, o: str) -> list[Rule]:
    """Qwen3's [d_head] / OLMo 2's [n_heads * d_head] q_norm and k_norm weights: ours as they are."""
    if cfg.qk_norm == "none":
        return []
    return [_same(f"{o}.attn.q_norm.w", f"{a}.q_norm.weight"), _same(f"{o}.attn.k_norm.w", f"{a}.k_norm.weight")]


def _gated_rules(p: str, o: str) -> list[Rule]:
    rules = []
    for ours, hf in (("W_gate", "gate_proj"), ("W_in", "up_proj"), ("W_out", "down_proj")):
        rules.append(_transposed(f"{o}.{ours}", f"{p}.{hf}.weight"))
        rules.append(_same(f"{o}.b{ours[1:]}", f"{p}.{hf}.bias"))
    return rules


def _expert_file_rules(cfg: ModelConfig, p: str, o: str) -> list[Rule]:
    """Mixtral on disk: one [d_mlp, d_model] w1 (gate) / w3 (up) and one [d_model, d_mlp] w2 per expert."""
    moe = f"{p}.block_sparse_moe"
    rules = [_transposed(f"{o}.mlp.W_gate", f"{moe}.gate.weight")]
    for x in range(cfg.n_experts):
        for ours, hf in (("W_gate", "w1"), ("W_in", "w3"), ("W_out", "w2")):
            rules.append(_transposed(f"{o}.mlp.experts.{x}.{ours}", f"{moe}.experts.{x}.{hf}.weight"))
    return rules


def _fused_moe_rules(cfg: ModelConfig, p: str, o: str) -> list[Rule]:
    """Mixtral as transformers 5 holds it in memory: every expert's weights in one tensor."""
    n, m = cfg.n_experts, cfg.moe_d_mlp
    gates = tuple(f"{o}.mlp.experts.{x}.W_gate" for x in range(n))
    ups = tuple(f"{o}.mlp.experts.{x}.W_in" for x in range(n))
    downs = tuple(f"{o}.mlp.experts.{x}.W_out" for x in range(n))
    return [
        _transposed(f"{o}.mlp.W_gate", f"{p}.mlp.gate.weight"),
        Rule(  # [expert, 2 * d_mlp, d_model]: gate rows then up rows
            gates + ups, f"{p}.mlp.experts.gate_up_proj",
            lambda t: tuple(t[:, :m].transpose(1, 2).unbind(0)) + tuple(t[:, m:].transpose(1, 2).unbind(0)),
            lambda *ws: torch.cat([torch.stack(ws[:n]), torch.stack(ws[n:])], dim=2).transpose(1, 2),
        ),
        Rule(downs, f"{p}.mlp.experts.down_proj", lambda t: tuple(t.transpose(1, 2).unbind(0)),
             lambda *ws: torch.stack(ws).transpose(1, 2)),
    ]


# ---- DeepSeek-V2 / V3: multi-head latent attention, MoE with shared experts --------------------
def deepseek_rules(cfg: ModelConfig, layout: str = "file") -> list[Rule]:
    """DeepSeek's MLA projections onto ours (``workbench.components.mla``): ``kv_a_proj_with_mqa``
    stacks the latent's down-projection and the RoPE key's, ``kv_b_proj`` holds per head the key
    rows (qk_nope_head_dim) then the value rows (v_head_dim) read from the latent. Layers from
    ``moe_first_dense`` on are MoE: router, routed experts (per expert in files, fused in memory as
    Mixtral's), shared experts, and V3's ``e_score_correction_bias``."""
    h, e, r = cfg.n_heads, cfg.d_head, cfg.kv_lora_rank
    nope, qk = cfg.qk_nope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

    def split_kv_b(t: Tensor) -> tuple[Tensor, ...]:  # [h * (nope + d_head), rank]
        w = t.reshape(h, nope + e, r)
        return w[:, :nope].transpose(1, 2), w[:, nope:].transpose(1, 2)

    def join_kv_b(uk: Tensor, uv: Tensor) -> Tensor:
        return torch.cat([uk.transpose(1, 2), uv.transpose(1, 2)], dim=1).reshape(h * (nope + e), r)

    rules = _head(cfg, "model.embed_tokens.weight", "lm_head.weight")
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}", f"blocks.{l}"
        a, oa = f"{p}.self_attn", f"{o}.attn"
        rules += _norm(f"{o}.ln1", f"{p}.input_layernorm", False) + _norm(f"{o}.ln2", f"{p}.post_attention_layernorm", False)
        if cfg.q_lora_rank is None:
            rules.append(_heads_in(f"{oa}.W_Q", f"{a}.q_proj.weight", h, qk))
        else:
            rules += [_transposed(f"{oa}.W_DQ", f"{a}.q_a_proj.weight"), _same(f"{oa}.b_DQ", f"{a}.q_a_proj.bias"),
                      _same(f"{oa}.q_norm.w", f"{a}.q_a_layernorm.weight"),
                      _heads_in(f"{oa}.W_UQ", f"{a}.q_b_proj.weight", h, qk)]
        rules += [
            Rule((f"{oa}.W_DKV", f"{oa}.W_KR"), f"{a}.kv_a_proj_with_mqa.weight", lambda t: (t[:r].T, t[r:].T),
                 lambda dkv, kr: torch.cat([dkv.T, kr.T], dim=0)),
            Rule((f"{oa}.b_DKV", f"{oa}.b_KR"), f"{a}.kv_a_proj_with_mqa.bias", lambda t: (t[:r], t[r:]),
                 lambda dkv, kr: torch.cat([dkv, kr])),
            _same(f"{oa}.kv_norm.w", f"{a}.kv_a_layernorm.weight"),
            Rule((f"{oa}.W_UK", f"{oa}.W_UV"), f"{a}.kv_b_proj.weight", split_kv_b, join_kv_b),
            _heads_out(f"{oa}.W_O", f"{a}.o_proj.weight", h, e),
            _same(f"{oa}.b_O", f"{a}.o_proj.bias"),
        ]
        if cfg.ffn != "moe" or l < cfg.moe_first_dense:
            rules += _gated_rules(f"{p}.mlp", f"{o}.mlp")
            continue
        if layout == "module":
            rules += _fused_moe_rules(cfg, p, o)
        else:
            rules.append(_transposed(f"{o}.mlp.W_gate", f"{p}.mlp.gate.weight"))
            for x in range(cfg.n_experts):
                for ours, hf in (("W_gate", "gate_proj"), ("W_in", "up_proj"), ("W_out", "down_proj")):
                    rules.append(_transposed(f"{o}.mlp.experts.{x}.{ours}", f"{p}.mlp.experts.{x}.{hf}.weight"))
        rules.append(_same(f"{o}.mlp.b_score", f"{p}.mlp.gate.e_score_correction_bias"))
        if cfg.n_shared_experts:
            rules += _gated_rules(f"{p}.mlp.shared_experts", f"{o}.mlp.shared_experts")
    return rules + _norm("ln_final", "model.norm", False)


# ---- Gemma 2, Gemma 3 (text) -----------------------------------------------------------------
def gemma_rules(cfg: ModelConfig, layout: str = "file") -> list[Rule]:
    """Llama's projections and MLP; four (1 + w) norms per layer (the sandwich), whose HF weight is
    our ``w_offset`` as it is (both store the offset from 1); Gemma 3's per-head q_norm/k_norm."""
    rules = _head(cfg, "model.embed_tokens.weight", "lm_head.weight")
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}", f"blocks.{l}"
        a = f"{p}.self_attn"
        for ours, hf in (("ln1", "input_layernorm"), ("ln1_post", "post_attention_layernorm"),
                         ("ln2", "pre_feedforward_layernorm"), ("ln2_post", "post_feedforward_layernorm")):
            rules.append(_same(f"{o}.{ours}.w_offset", f"{p}.{hf}.weight"))
        if cfg.qk_norm == "head":
            rules += [_same(f"{o}.attn.q_norm.w_offset", f"{a}.q_norm.weight"),
                      _same(f"{o}.attn.k_norm.w_offset", f"{a}.k_norm.weight")]
        rules += _projection_rules(cfg, o, a)
        rules += _gated_rules(f"{p}.mlp", f"{o}.mlp")
    return rules + [_same("ln_final.w_offset", "model.norm.weight")]


# ---- GPT-NeoX / Pythia ---------------------------------------------------------------------
def neox_rules(cfg: ModelConfig, layout: str = "file") -> list[Rule]:
    h, e = cfg.n_heads, cfg.d_head

    def split_qkv(t: Tensor) -> tuple[Tensor, ...]:  # [h * 3 * d_head, d_model]: per head q, k, v
        w = t.reshape(h, 3, e, -1)
        return tuple(w[:, i].transpose(1, 2) for i in range(3))

    def join_qkv(*ws: Tensor) -> Tensor:
        return torch.stack([w.transpose(1, 2) for w in ws], dim=1).reshape(h * 3 * e, -1)

    rules = _head(cfg, "gpt_neox.embed_in.weight", "lm_head.weight" if layout == "module" else "embed_out.weight")
    for l in range(cfg.n_layers):
        p, o = f"gpt_neox.layers.{l}", f"blocks.{l}"
        rules += _norm(f"{o}.ln1", f"{p}.input_layernorm", True) + _norm(f"{o}.ln2", f"{p}.post_attention_layernorm", True)
        rules += [
            Rule((f"{o}.attn.W_Q", f"{o}.attn._W_K", f"{o}.attn._W_V"), f"{p}.attention.query_key_value.weight", split_qkv, join_qkv),
            Rule((f"{o}.attn.b_Q", f"{o}.attn._b_K", f"{o}.attn._b_V"), f"{p}.attention.query_key_value.bias",
                 lambda t: tuple(t.reshape(h, 3, e).unbind(1)), lambda *bs: torch.stack(bs, dim=1).reshape(-1)),
            _heads_out(f"{o}.attn.W_O", f"{p}.attention.dense.weight", h, e),
            _same(f"{o}.attn.b_O", f"{p}.attention.dense.bias"),
            _transposed(f"{o}.mlp.W_in", f"{p}.mlp.dense_h_to_4h.weight"),
            _same(f"{o}.mlp.b_in", f"{p}.mlp.dense_h_to_4h.bias"),
            _transposed(f"{o}.mlp.W_out", f"{p}.mlp.dense_4h_to_h.weight"),
            _same(f"{o}.mlp.b_out", f"{p}.mlp.dense_4h_to_h.bias"),
        ]
    return rules + _norm("ln_final", "gpt_neox.final_layer_norm", True)


# ---- Phi-3 ---------------------------------------------------------------------------------
def phi3_rules(cfg: ModelConfig, layout: str = "file") -> list[Rule]:
    """Llama's layout with q/k/v fused in ``qkv_proj`` ([(h + 2 kv) * d_head, d_model], q rows, then
    k, then v) and gate/up in ``gate_up_proj`` ([2 * d_mlp, d_model], gate rows first); no biases."""
    h, kv, e, m = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp

    def split_qkv(t: Tensor) -> tuple[Tensor, ...]:
        return tuple(w.reshape(n, e, -1).transpose(1, 2) for w, n in zip(t.split([h * e, kv * e, kv * e]), (h, kv, kv)))

    def join_qkv(*ws: Tensor) -> Tensor:
        return torch.cat([w.transpose(1, 2).reshape(-1, w.shape[1]) for w in ws])

    rules = _head(cfg, "model.embed_tokens.weight", "lm_head.weight")
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}", f"blocks.{l}"
        rules += _llama_norms(cfg, p, o)
        rules += [
            Rule((f"{o}.attn.W_Q", f"{o}.attn._W_K", f"{o}.attn._W_V"), f"{p}.self_attn.qkv_proj.weight", split_qkv, join_qkv),
            _heads_out(f"{o}.attn.W_O", f"{p}.self_attn.o_proj.weight", h, e),
            Rule((f"{o}.mlp.W_gate", f"{o}.mlp.W_in"), f"{p}.mlp.gate_up_proj.weight",
                 lambda t: (t[:m].T, t[m:].T), lambda g, u: torch.cat([g.T, u.T])),
            _transposed(f"{o}.mlp.W_out", f"{p}.mlp.down_proj.weight"),
        ]
    return rules + _norm("ln_final", "model.norm", False)


RULES = {"gpt2": gpt2_rules, "llama": llama_rules, "mistral": llama_rules, "qwen2": llama_rules,
         "mixtral": llama_rules, "gpt_neox": neox_rules, "qwen3": llama_rules, "olmo2": llama_rules,
         "phi3": phi3_rules, "gemma2": gemma_rules, "gemma3_text": gemma_rules}
RULES.update(deepseek_v2=deepseek_rules, deepseek_v3=deepseek_rules)
Layout = Literal["file", "module"]

# The base model's prefix: a checkpoint saved from GPT2Model / LlamaModel / GPTNeoXModel lacks it.
_BASE_PREFIX = {"gpt2": "transformer.", "gpt_neox": "gpt_neox.", "llama": "model.", "mistral": "model.",
                "qwen2": "model.", "mixtral": "model.", "qwen3": "model.", "olmo2": "model.", "phi3": "model.",
                "gemma2": "model.", "gemma3_text": "model.", "deepseek_v2": "model.", "deepseek_v3": "model."}
_HEADS = ("lm_head.weight", "embed_out.weight")
# Buffers older checkpoints saved beside the weights: causal masks and RoPE frequencies (we build our own).
_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|attention\.bias|attention\.masked_bias|rotary_emb\.inv_freq)$")


def rules_for(family: str, cfg: ModelConfig, layout: Layout = "file") -> list[Rule]:
    """The weight table of ``family`` in ``layout`` ("file": safetensors; "module": a built model)."""
    return RULES[family](cfg, layout)


def layout_of(names: Iterable[str]) -> Layout:
    """The layout of a built transformers model's state dict: fused Mixtral experts mean transformers 5."""
    return "module" if any(n.endswith(".experts.gate_up_proj") for n in names) else "file"


def hf_aliases(family: str, name: str) -> tuple[str, ...]:
    """``name`` and the other spellings of the same HF tensor, most usual first."""
    out = [name]
    prefix = _BASE_PREFIX[family]
    if name.startswith(prefix):
        out.append(name[len(prefix):])
    if family == "gpt_neox" and name in _HEADS:
        out += [h for h in _HEADS if h != name]
    return tuple(out)


def _is_mtp_layer(family: str, cfg: ModelConfig, name: str) -> bool:
    """DeepSeek-V3 checkpoints carry their multi-token-prediction layer as ``model.layers.{n_layers}``;
    the causal LM (transformers' too) never runs it."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return family == "deepseek_v3" and m is not None and int(m.group(1)) >= cfg.n_layers


def _is_bias(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lstrip("_").startswith("b")


# ---- HF -> ours ----------------------------------------------------------------------------------
@runtime_checkable
class TensorSource(Protocol):
    """Named tensors one at a time: a dict in memory, or the shards of a checkpoint (``streaming.py``)."""

    def names(self) -> Iterable[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> Tensor: ...  # owned by the caller
    def where(self, name: str) -> str: ...  # for error messages: "X in model-00002-of-00004.safetensors"


class DictSource:
    """A state dict as a ``TensorSource``."""

    def __init__(self, state: Mapping[str, Tensor], what: str = "the Hugging Face state dict"):
        self.state, self.what = state, what

    def names(self) -> Iterable[str]:
        return self.state.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> Tensor:
        # a copy: the imported model must not share memory with the model it came from
        return self.state[name].detach().to(device=device, dtype=dtype, copy=True)

    def where(self, name: str) -> str:
        return f"{name} in {self.what}"


@dataclass
class ImportPlan:
    """Which source tensor feeds each rule (None: a bias the checkpoint does not have, imported as
    zeros), checked against the config before any tensor is read."""

    steps: list[tuple[Rule, Optional[str]]]
    zero_biases: list[str]  # our learned biases no HF tensor feeds: zeros


def plan_import(family: str, cfg: ModelConfig, source: TensorSource, ours: Mapping[str, Tensor],
                persistent: Iterable[str], layout: Layout = "file") -> ImportPlan:
    """Match ``source``'s names and shapes to our model's before reading anything.

    ``ours`` holds every parameter and bias buffer of a model of ``cfg`` (meta tensors do: only
    shapes are read); ``persistent`` names the ones that are weights (its state dict). Raises
    HFImportError naming the first tensor that is missing, has the wrong shape or dtype, or has
    no place in the config.
    """
    from workbench.interop.hub import HFImportError

    persistent = set(persistent)
    available = set(source.names())
    used: set[str] = set()
    steps: list[tuple[Rule, Optional[str]]] = []
    for rule in rules_for(family, cfg, layout):
        name = next((n for n in hf_aliases(family, rule.hf) if n in available), None)
        if name is None:
            if not all(_is_bias(k) for k in rule.ours):
                raise HFImportError(f"the checkpoint has no tensor {rule.hf} (it holds {rule.ours[0]}); "
                                    "the weight files do not match config.json")
            steps.append((rule, None))
            continue
        used.add(name)
        expected = tuple(rule.join(*(ours[k].to("meta") for k in rule.ours)).shape)
        if source.shape(name) != expected:
            raise HFImportError(f"{source.where(name)} has shape {list(source.shape(name))}, but config.json "
                                f"implies {list(expected)}; the weight files do not match the config")
        if not source.dtype(name).is_floating_point:
            raise HFImportError(f"{source.where(name)} is {source.dtype(name)}; only unquantised floating-point "
                                "checkpoints (float32, bfloat16, float16) can be imported")
        steps.append((rule, name))
    fed = {k for rule, name in steps if name is not None for k in rule.ours}
    unfed = sorted(k for k in persistent - fed if not _is_bias(k))
    if unfed:
        raise HFImportError(f"no Hugging Face tensor maps onto {unfed[0]}")
    leftover = sorted(n for n in available - used
                      if not _BUFFERS.search(n) and not (cfg.tie_embeddings and n in _HEADS)
                      and not _is_mtp_layer(family, cfg, n))
    if leftover:
        shown = ", ".join(source.where(n) for n in leftover[:3]) + (f" (and {len(leftover) - 3} more)" if len(leftover) > 3 else "")
        raise HFImportError(f"the checkpoint holds {shown}, which the imported {family} config has no place for; "
                            "it is a variant the workbench does not model")
    return ImportPlan(steps, sorted(k for k in persistent - fed))


def import_tensors(plan: ImportPlan, source: TensorSource, persistent: Iterable[str], device: torch.device,
                   dtype: torch.dtype, float32: Container[str] = ()) -> Iterator[tuple[str, Tensor]]:
    """(our name, tensor on ``device`` in ``dtype``) for every weight, one source tensor at a time;
    in float32 instead for a source tensor that fills a name in ``float32`` (DeepSeek's router).

    Each source tensor arrives in the target dtype and device (``source.tensor``) and our
    weights are the rule's views of it: HF's memory layout is kept (``W_in`` is
    ``up_proj.weight.T``), so nothing is copied beyond what the dtype or device needs. Biases
    we hold as fixed zeros must be zero in the checkpoint (HFImportError otherwise).
    """
    from workbench.interop.hub import HFImportError
    from workbench.interop.streaming import prefetched

    persistent = set(persistent)
    steps = [(rule, name) for rule, name in plan.steps if name is not None]
    wide = {name for rule, name in steps if any(ours in float32 for ours in rule.ours)}
    tensors = prefetched(lambda name: source.tensor(name, device, torch.float32 if name in wide else dtype),
                         [name for _, name in steps])
    for (rule, name), tensor in zip(steps, tensors):
        for ours, part in zip(rule.ours, rule.split(tensor)):
            if ours in persistent:
                yield ours, part.detach()
            elif part.count_nonzero():
                raise HFImportError(f"{source.where(name)} holds a nonzero bias with no place in the imported "
                                    f"config ({ours})")
        del tensor


# ---- ours -> HF ----------------------------------------------------------------------------------
@dataclass
class ExportEntry:
    """One HF tensor of an export: its name, shape, and how to build it from our weights."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    build: Callable[[], Tensor]


def plan_export(family: str, cfg: ModelConfig, ours: Mapping[str, Tensor], hf_module: Mapping[str, Tensor],
                layout: Layout = "file") -> list[ExportEntry]:
    """The HF tensors of an export of ``ours`` (every parameter and bias buffer, ``unembed.W_U_param``
    when untied), in ``layout``. ``hf_module`` is the state dict of the target transformers model
    (meta tensors are enough): it says which biases the family has and is checked for coverage.
    Nothing is computed until an entry's ``build`` is called.
    """
    module_rules = rules_for(family, cfg, "module")
    made = {rule.hf for rule in module_rules if rule.hf in hf_module}
    skip = set(_HEADS) if cfg.tie_embeddings else set()
    missing = sorted(n for n in hf_module if n not in made and n not in skip and not n.endswith(".bias"))
    if missing:
        raise ValueError(f"nothing of ours maps onto the Hugging Face tensor {missing[0]}")
    entries = []
    for rule in rules_for(family, cfg, layout):
        tensors = [ours[k] for k in rule.ours]
        if _is_bias(rule.ours[0]) and rule.hf not in hf_module:
            nonzero = [k for k, t in zip(rule.ours, tensors) if t.count_nonzero()]
            if nonzero:
                raise ValueError(f"{nonzero[0]} is nonzero but {family} has no {rule.hf} to hold it")
            continue
        shape = tuple(rule.join(*(t.to("meta") for t in tensors)).shape)
        entries.append(ExportEntry(rule.hf, shape, tensors[0].dtype,
                                   lambda r=rule, ts=tensors: r.join(*ts).detach().contiguous()))
    # HF biases no rule of ours feeds (a family bias our config holds as zeros): written as zeros.
    dtype = ours["embed.W_E"].dtype
    for name in sorted(n for n in hf_module if n.endswith(".bias") and n not in made):
        shape = tuple(hf_module[name].shape)
        entries.append(ExportEntry(name, shape, dtype, lambda s=shape: torch.zeros(s, dtype=dtype)))
    return entries
