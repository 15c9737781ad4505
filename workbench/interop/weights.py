"""Weight maps between Hugging Face state dicts and ours, one table of rules per family.

A ``Rule`` ties one HF tensor to one or more of ours (GPT-2's fused ``c_attn`` holds Q, K
and V; GPT-NeoX's ``query_key_value`` interleaves them per head; Mixtral's ``gate_up_proj``
stacks gate and up for every expert) with ``split`` (HF -> ours) and ``join`` (ours -> HF).
The same table drives import and export, so the round trip is the identity by construction
and the tests check each direction against HF's own forward.

Layouts: HF ``nn.Linear`` weights are ``[out, in]``; GPT-2's ``Conv1D`` is ``[in, out]``; ours
are TransformerLens' (``W_Q [head, d_model, d_head]``, ``W_O [head, d_head, d_model]``,
``W_in [d_model, d_mlp]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
def gpt2_rules(cfg: ModelConfig) -> list[Rule]:
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
def llama_rules(cfg: ModelConfig) -> list[Rule]:
    h, kv, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    rules = _head(cfg, "model.embed_tokens.weight", "lm_head.weight")
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}", f"blocks.{l}"
        a = f"{p}.self_attn"
        rules += _norm(f"{o}.ln1", f"{p}.input_layernorm", False) + _norm(f"{o}.ln2", f"{p}.post_attention_layernorm", False)
        rules += [
            _heads_in(f"{o}.attn.W_Q", f"{a}.q_proj.weight", h, e),
            _heads_in(f"{o}.attn._W_K", f"{a}.k_proj.weight", kv, e),
            _heads_in(f"{o}.attn._W_V", f"{a}.v_proj.weight", kv, e),
            _heads_bias(f"{o}.attn.b_Q", f"{a}.q_proj.bias", h, e),
            _heads_bias(f"{o}.attn._b_K", f"{a}.k_proj.bias", kv, e),
            _heads_bias(f"{o}.attn._b_V", f"{a}.v_proj.bias", kv, e),
            _heads_out(f"{o}.attn.W_O", f"{a}.o_proj.weight", h, e),
            _same(f"{o}.attn.b_O", f"{a}.o_proj.bias"),
        ]
        rules += _moe_rules(cfg, p, o) if cfg.ffn == "moe" else _gated_rules(f"{p}.mlp", f"{o}.mlp")
    return rules + _norm("ln_final", "model.norm", False)


def _gated_rules(p: str, o: str) -> list[Rule]:
    rules = []
    for ours, hf in (("W_gate", "gate_proj"), ("W_in", "up_proj"), ("W_out", "down_proj")):
        rules.append(_transposed(f"{o}.{ours}", f"{p}.{hf}.weight"))
        rules.append(_same(f"{o}.b{ours[1:]}", f"{p}.{hf}.bias"))
    return rules


def _moe_rules(cfg: ModelConfig, p: str, o: str) -> list[Rule]:
    n, m = cfg.n_experts, cfg.d_mlp
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


# ---- GPT-NeoX / Pythia ---------------------------------------------------------------------
def neox_rules(cfg: ModelConfig) -> list[Rule]:
    h, e = cfg.n_heads, cfg.d_head

    def split_qkv(t: Tensor) -> tuple[Tensor, ...]:  # [h * 3 * d_head, d_model]: per head q, k, v
        w = t.reshape(h, 3, e, -1)
        return tuple(w[:, i].transpose(1, 2) for i in range(3))

    def join_qkv(*ws: Tensor) -> Tensor:
        return torch.stack([w.transpose(1, 2) for w in ws], dim=1).reshape(h * 3 * e, -1)

    rules = _head(cfg, "gpt_neox.embed_in.weight", "lm_head.weight")
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


RULES = {"gpt2": gpt2_rules, "llama": llama_rules, "mistral": llama_rules, "qwen2": llama_rules,
         "mixtral": llama_rules, "gpt_neox": neox_rules}


def _is_bias(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lstrip("_").startswith("b")


def state_from_hf(family: str, cfg: ModelConfig, hf_state: dict[str, Tensor], ours_expected: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict from an HF one. Biases HF lacks become zeros; biases we lack must be zero."""
    out: dict[str, Tensor] = {}
    for rule in RULES[family](cfg):
        if rule.hf not in hf_state:
            if not all(_is_bias(k) for k in rule.ours):
                raise ValueError(f"the Hugging Face weights have no {rule.hf}")
            continue
        for name, tensor in zip(rule.ours, rule.split(hf_state[rule.hf])):
            if name in ours_expected:
                out[name] = tensor.detach()  # a view; load_state_dict copies it into the model
            elif tensor.count_nonzero():
                raise ValueError(f"{rule.hf} holds a nonzero bias with no place in the imported config ({name})")
    for name, ref in ours_expected.items():
        if name not in out:
            if not _is_bias(name):
                raise ValueError(f"no Hugging Face tensor maps onto {name}")
            out[name] = torch.zeros_like(ref)
    return out


def state_to_hf(family: str, cfg: ModelConfig, ours: dict[str, Tensor], hf_expected: dict[str, Tensor]) -> dict[str, Tensor]:
    """An HF state dict from ours (parameters and zero bias buffers); the inverse of ``state_from_hf``."""
    out: dict[str, Tensor] = {}
    for rule in RULES[family](cfg):
        tensors = [ours[k] for k in rule.ours]
        if rule.hf not in hf_expected:
            nonzero = [k for k, t in zip(rule.ours, tensors) if t.count_nonzero()]
            if nonzero:
                raise ValueError(f"{nonzero[0]} is nonzero but {family} has no {rule.hf} to hold it")
            continue
        out[rule.hf] = rule.join(*tensors).detach().contiguous()
    if cfg.tie_embeddings and "lm_head.weight" in hf_expected:
        out["lm_head.weight"] = ours["embed.W_E"].detach()
    for name, ref in hf_expected.items():
        if name not in out:
            if not name.endswith(".bias"):
                raise ValueError(f"nothing of ours maps onto the Hugging Face tensor {name}")
            out[name] = torch.zeros_like(ref)
    return out
