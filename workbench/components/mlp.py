"""Feed-forward boxes: plain (ReLU, GELU, GELU-tanh), gated (SwiGLU, GeGLU, GeGLU-tanh), and MoE.

Hook names follow TransformerLens: ``hook_pre`` is the pre-activation (the gate branch for
gated MLPs, with the linear branch at ``hook_pre_linear``) and ``hook_post`` the hidden
activation fed to ``W_out``. The MoE router exposes its logits, the chosen experts and
their weights; each expert is itself a hooked MLP under ``mlp.experts.{e}``.

Every FFN takes an optional ``token_mask`` [batch, pos] (True = real token, from a padded
batch). A dense MLP acts on each position alone, so it has nothing to do with it; MoE routes
only real tokens to its experts (pads get a zero output), so an expert's hooks see exactly the
real tokens, in the order the prompts would give alone, one after another.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.registry import add_bias, pick
from workbench.config import ModelConfig

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, act: str):
        super().__init__()
        self.act = pick(ACTIVATIONS, act, "activation")
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        add_bias(self, "b_in", (cfg.d_mlp,), cfg.bias)
        add_bias(self, "b_out", (cfg.d_model,), cfg.bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], token_mask: Optional[Bool[Tensor, "batch pos"]] = None
    ) -> Float[Tensor, "batch pos d_model"]:
        pre = self.hook_pre(F.linear(x, self.W_in.T, self.b_in))
        return F.linear(self.hook_post(self.act(pre)), self.W_out.T, self.b_out)


class GatedMLP(nn.Module):
    """out = W_out (act(x W_gate) * (x W_in)): SwiGLU with SiLU, GeGLU with GELU."""

    def __init__(self, cfg: ModelConfig, act: str):
        super().__init__()
        self.act = pick(ACTIVATIONS, act, "activation")
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        add_bias(self, "b_gate", (cfg.d_mlp,), cfg.bias)
        add_bias(self, "b_in", (cfg.d_mlp,), cfg.bias)
        add_bias(self, "b_out", (cfg.d_model,), cfg.bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the gate branch
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], token_mask: Optional[Bool[Tensor, "batch pos"]] = None
    ) -> Float[Tensor, "batch pos d_model"]:
        gate = self.hook_pre(F.linear(x, self.W_gate.T, self.b_gate))
        linear = self.hook_pre_linear(F.linear(x, self.W_in.T, self.b_in))
        return F.linear(self.hook_post(self.act(gate) * linear), self.W_out.T, self.b_out)


def _dense(kind: str):
    gated = kind in ("swiglu", "geglu", "geglu_tanh")
    # geglu_tanh: GeGLU with the tanh approximation of GELU (HF's gelu_pytorch_tanh, Gemma's MLP)
    act = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_new"}.get(kind, kind)
    return lambda cfg: (GatedMLP if gated else MLP)(cfg, act)


class MoE(nn.Module):
    """Top-k routing as in Mixtral: softmax over all experts, keep the top k, renormalise.

    Tokens never compete: there is no expert capacity and no load-balancing term in the
    forward, so one token's routing cannot change another's (a pad cannot move a real token).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k = cfg.experts_per_token
        self.n_experts = cfg.n_experts
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.n_experts))
        make_expert = _dense(cfg.moe_expert)
        self.experts = nn.ModuleList([make_expert(cfg) for _ in range(cfg.n_experts)])
        self.hook_router_logits = HookPoint()  # [batch, pos, expert]
        self.hook_expert_weights = HookPoint()  # [batch, pos, k]
        self.hook_expert_indices = HookPoint()  # [batch, pos, k]

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], token_mask: Optional[Bool[Tensor, "batch pos"]] = None
    ) -> Float[Tensor, "batch pos d_model"]:
        logits = self.hook_router_logits(x @ self.W_gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.k, dim=-1)
        weights = self.hook_expert_weights((weights / weights.sum(-1, keepdim=True)).to(x.dtype))
        indices = self.hook_expert_indices(indices)
        flat_x = x.reshape(-1, x.shape[-1])
        flat_idx, flat_w = indices.reshape(-1, self.k), weights.reshape(-1, self.k)
        if token_mask is not None:  # pads go to no expert
            flat_idx = flat_idx.masked_fill(~token_mask.reshape(-1, 1), -1)
        out = torch.zeros_like(flat_x)
        for e, expert in enumerate(self.experts):
            # An expert with no tokens still runs (on zero rows) so every parameter gets a grad.
            token, slot = torch.where(flat_idx == e)
            y = expert(flat_x[token][None])[0]  # experts see [1, routed tokens, d_model]
            out.index_add_(0, token, y * flat_w[token, slot, None])
        return out.reshape(x.shape)


FFNS = {
    "relu": _dense("relu"),
    "gelu": _dense("gelu"),
    "gelu_new": _dense("gelu_new"),
    "swiglu": _dense("swiglu"),
    "geglu": _dense("geglu"),
    "geglu_tanh": _dense("geglu_tanh"),
    "moe": MoE,
}
