"""Feed-forward boxes: plain (ReLU, GELU, GELU-tanh), gated (SwiGLU, GeGLU, GeGLU-tanh), and MoE.

Hook names follow TransformerLens: ``hook_pre`` is the pre-activation (the gate branch for
gated MLPs, with the linear branch at ``hook_pre_linear``) and ``hook_post`` the hidden
activation fed to ``W_out``. The MoE router exposes its logits, the chosen experts and
their weights; each expert is itself a hooked MLP under ``mlp.experts.{e}`` (and DeepSeek's shared
experts, when configured, one hooked MLP under ``mlp.shared_experts``).

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

from workbench.components.registry import add_bias, bias_term, pick
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
        pre = self.hook_pre(F.linear(x, self.W_in.T, bias_term(self, "b_in")))
        return F.linear(self.hook_post(self.act(pre)), self.W_out.T, bias_term(self, "b_out"))


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
        gate = self.hook_pre(F.linear(x, self.W_gate.T, bias_term(self, "b_gate")))
        linear = self.hook_pre_linear(F.linear(x, self.W_in.T, bias_term(self, "b_in")))
        return F.linear(self.hook_post(self.act(gate) * linear), self.W_out.T, bias_term(self, "b_out"))


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
        expert_cfg = cfg if cfg.moe_d_mlp == cfg.d_mlp else cfg.replace(d_mlp=cfg.moe_d_mlp)
        self.experts = nn.ModuleList([make_expert(expert_cfg) for _ in range(cfg.n_experts)])
        # DeepSeek's options (config.py); with the defaults the routing is Mixtral's, as above.
        self.router, self.norm_topk, self.routed_scale = cfg.moe_router, cfg.moe_norm_topk, cfg.moe_routed_scale
        self.n_groups, self.topk_groups, self.group_score = cfg.moe_n_groups, cfg.moe_topk_groups, cfg.moe_group_score
        # Learned (saved) when moe_score_bias, else fixed zeros. It moves the choice only, never the
        # weights, so topk passes it no gradient: DeepSeek-V3 adjusts it outside backprop (load
        # balancing), hence requires_grad=False.
        add_bias(self, "b_score", (cfg.n_experts,), cfg.moe_score_bias)
        self.b_score.requires_grad_(False)
        # DeepSeek's router runs in float32 on float32 weights whatever the model's dtype (config.py):
        # these stay float32 under model.to(dtype) (_apply) and the loaders read them as float32
        # (interop.streaming.float32_weights). Mixtral's rounds its logits to the model's dtype.
        self.router_fp32 = cfg.moe_router_fp32
        self.float32_weights = ("W_gate", "b_score") if cfg.moe_router_fp32 else ()
        if cfg.n_shared_experts:  # every token, unweighted: one dense MLP as wide as the shared experts together
            self.shared_experts = make_expert(cfg.replace(d_mlp=cfg.moe_d_mlp * cfg.n_shared_experts))
        self.hook_router_logits = HookPoint()  # [batch, pos, expert]
        self.hook_expert_weights = HookPoint()  # [batch, pos, k]
        self.hook_expert_indices = HookPoint()  # [batch, pos, k]

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], token_mask: Optional[Bool[Tensor, "batch pos"]] = None
    ) -> Float[Tensor, "batch pos d_model"]:
        logits = self.hook_router_logits(x.float() @ self.W_gate.float() if self.router_fp32 else x @ self.W_gate)
        weights, indices = self._route(logits)
        # kept float32: the references multiply the expert outputs by the float32 weights
        weights = self.hook_expert_weights(weights)
        indices = self.hook_expert_indices(indices)
        flat_x = x.reshape(-1, x.shape[-1])
        flat_idx, flat_w = indices.reshape(-1, self.k), weights.reshape(-1, self.k)
        if token_mask is not None:  # pads go to no expert
            flat_idx = flat_idx.masked_fill(~token_mask.reshape(-1, 1), -1)
        # float32 products summed in float32, rounded once to x's dtype: what transformers' default
        # experts path (grouped_mm) does in bf16/fp16, for Mixtral and DeepSeek alike
        out = torch.zeros_like(flat_x, dtype=torch.promote_types(x.dtype, torch.float32))
        for e, expert in enumerate(self.experts):
            # An expert with no tokens still runs (on zero rows) so every parameter gets a grad.
            token, slot = torch.where(flat_idx == e)
            y = expert(flat_x[token][None])[0]  # experts see [1, routed tokens, d_model]
            out.index_add_(0, token, y * flat_w[token, slot, None])
        out = out.to(x.dtype).reshape(x.shape)
        if hasattr(self, "shared_experts"):
            return out + self.shared_experts(x)
        return out

    def _apply(self, fn, recurse: bool = True):
        # model.to(bfloat16) must not round the float32 router weights: keep their float32 values
        # (the tensors from before the cast), on the new device.
        before = {name: getattr(self, name).data for name in self.float32_weights}
        super()._apply(fn, recurse)
        for name, old in before.items():
            now = getattr(self, name)
            if now.dtype != torch.float32 and not now.is_meta:
                now.data = old.to(device=now.device, dtype=torch.float32)
        return self

    def _route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(weights, expert indices) [batch, pos, k] in float32 from the router logits.

        Scores are a softmax (Mixtral, DeepSeek-V2) or sigmoids (DeepSeek-V3) of the logits. The
        choice reads the scores plus ``b_score`` (zeros unless moe_score_bias), limited to the best
        ``topk_groups`` groups; the weights are the chosen experts' unbiased scores, renormalised
        to sum to 1 when ``norm_topk``, times ``routed_scale``.
        """
        if self.router == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        choice = scores + self.b_score.float()
        if self.n_groups > 1:
            grouped = choice.unflatten(-1, (self.n_groups, -1))
            if self.group_score == "max":
                group_scores = grouped.max(dim=-1).values
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = torch.topk(group_scores, self.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
        indices = torch.topk(choice, self.k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.routed_scale, indices


def make_ffn(cfg: ModelConfig, layer: int) -> nn.Module:
    """The FFN of block ``layer``: ``cfg.ffn``, except that a MoE model's first ``moe_first_dense``
    layers are dense MLPs of the experts' kind and width d_mlp (DeepSeek's first_k_dense_replace)."""
    if cfg.ffn == "moe" and layer < cfg.moe_first_dense:
        return _dense(cfg.moe_expert)(cfg)
    return pick(FFNS, cfg.ffn, "ffn")(cfg)


FFNS = {
    "relu": _dense("relu"),
    "gelu": _dense("gelu"),
    "gelu_new": _dense("gelu_new"),
    "swiglu": _dense("swiglu"),
    "geglu": _dense("geglu"),
    "geglu_tanh": _dense("geglu_tanh"),
    "moe": MoE,
}
