"""The transformer block: pre-norm, post-norm, parallel (GPT-J) and attention-only layouts.

    pre       x = x + Attn(ln1(x));      x = x + FFN(ln2(x))
    post      x = ln1(x + Attn(x));      x = ln2(x + FFN(x))
    parallel  x = x + Attn(ln1(x)) + FFN(ln2(x))

The layout is picked once in ``__init__``; every residual-stream write has its
TransformerLens hook (``hook_resid_pre/mid/post``, ``hook_attn_out``, ``hook_mlp_out``).
A padded batch's ``Padding`` (``workbench.padding``) goes to the attention and, as the mask
of real tokens, to the FFN (MoE routes only real tokens).
"""

from typing import Optional

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.attention import Attention, KVCacheEntry
from workbench.components.mlp import FFNS
from workbench.components.norm import NORMS
from workbench.components.registry import pick
from workbench.config import ModelConfig
from workbench.padding import Padding


class Block(nn.Module):
    # TransformerLens' logit-lens tools check this to read resid_post as the block output.
    hook_out_is_single_residual_stream = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        norm = pick(NORMS, cfg.norm, "norm")
        self.ln1 = norm(cfg)
        self.attn = Attention(cfg)
        if not cfg.attn_only:
            self.ln2 = norm(cfg)
            self.mlp = pick(FFNS, cfg.ffn, "ffn")(cfg)
            self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        if not (cfg.attn_only or cfg.parallel_residual):
            self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        if cfg.attn_only:
            self._layout = self._attn_only_post if cfg.norm_placement == "post" else self._attn_only_pre
        elif cfg.parallel_residual:
            self._layout = self._parallel
        else:
            self._layout = self._post if cfg.norm_placement == "post" else self._pre

    def forward(
        self,
        resid_pre: Float[Tensor, "batch pos d_model"],
        kv_cache: Optional[KVCacheEntry] = None,
        padding: Optional[Padding] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_resid_post(self._layout(self.hook_resid_pre(resid_pre), kv_cache, padding))

    def _pre(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding]) -> Tensor:
        mid = self.hook_resid_mid(x + self.hook_attn_out(self.attn(self.ln1(x), kv_cache, pad)))
        return mid + self.hook_mlp_out(self.mlp(self.ln2(mid), _real(pad)))

    def _post(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding]) -> Tensor:
        mid = self.hook_resid_mid(self.ln1(x + self.hook_attn_out(self.attn(x, kv_cache, pad))))
        return self.ln2(mid + self.hook_mlp_out(self.mlp(mid, _real(pad))))

    def _parallel(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding]) -> Tensor:
        attn_out = self.hook_attn_out(self.attn(self.ln1(x), kv_cache, pad))
        return x + attn_out + self.hook_mlp_out(self.mlp(self.ln2(x), _real(pad)))

    def _attn_only_pre(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding]) -> Tensor:
        return x + self.hook_attn_out(self.attn(self.ln1(x), kv_cache, pad))

    def _attn_only_post(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding]) -> Tensor:
        return self.ln1(x + self.hook_attn_out(self.attn(x, kv_cache, pad)))


def _real(padding: Optional[Padding]) -> Optional[Tensor]:
    """The FFN's token mask: None when nothing is padded, or when only real tokens are left (packed)."""
    return padding.query_mask if padding is not None and not padding.packed else None
