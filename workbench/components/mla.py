"""Multi-head latent attention (MLA, DeepSeek-V2/V3) and the registry of attention kinds.

Each token writes one latent ``c = RMSNorm(x W_DKV)`` of ``kv_lora_rank`` dims and one RoPE key
``k_R = RoPE(x W_KR)`` of ``qk_rope_head_dim`` dims shared by every head; head h reads its key
``[c W_UK[h], k_R]`` and value ``c W_UV[h]`` from them. Queries come from x directly (``W_Q``) or
through a normed latent of their own (``W_DQ``, ``q_norm``, ``W_UQ``: query compression). A
head's query ``[q_nope, q_rope]`` rotates only its RoPE part, so the position lives in k_R alone.

Weights (TransformerLens-style layouts): ``W_Q [head, d_model, qk]`` or ``W_DQ [d_model, q_lora_rank]``
+ ``W_UQ [head, q_lora_rank, qk]``; ``W_DKV [d_model, kv_lora_rank]``, ``W_KR [d_model, qk_rope]``,
``W_UK [head, kv_lora_rank, qk_nope]``, ``W_UV [head, kv_lora_rank, d_head]``, ``W_O [head, d_head,
d_model]``, with qk = qk_nope_head_dim + qk_rope_head_dim and d_head = v_head_dim.

Without a KV cache the keys and values of every head are materialised and attention runs as in
``Attention`` (the same fused SDPA / explicit paths, masks and padding). With a cache only c and
k_R are stored (``MLACacheEntry``: (kv_lora_rank + qk_rope_head_dim) values per token and layer,
whatever the head count) and attention runs on the latent: W_UK is absorbed into the query
(``q_nope W_UK[h]^T`` is a query over c) and W_UV into the output (the pattern averages c, then
W_UV reads the average), so no per-head key or value is ever built. It is one-KV-head attention
over [c, k_R] with values c; the scores are the same numbers in another order of summation.

Hooks: ``hook_q`` [batch, pos, head, qk] (before RoPE), ``hook_k`` [batch, pos, head, qk],
``hook_v`` [batch, pos, head, d_head], ``hook_rot_q``/``hook_rot_k`` (after RoPE), the usual
``hook_attn_scores``/``hook_pattern``/``hook_z``/``hook_result``, and the latents
``hook_kv_latent`` [batch, pos, kv_lora_rank] (normed: what the cache stores) and ``hook_q_latent``
[batch, pos, q_lora_rank] (with query compression). With a cache, keys and values exist only as
the latent: ``hook_k``/``hook_v``/``hook_rot_k`` still report the new positions' keys and values,
but editing them there raises (edit ``hook_kv_latent``, or decode without the cache).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.attention import Attention, KVCacheEntry
from workbench.components.norm import RMSNorm
from workbench.components.positional import ATTN_POSITIONS
from workbench.components.registry import add_bias, pick
from workbench.config import ModelConfig
from workbench.padding import Padding

# DeepSeek's q_a_layernorm / kv_a_layernorm keep RMSNorm's default eps whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MLACacheEntry(KVCacheEntry):
    """The normed KV latent and the rotated RoPE key of one layer, preallocated to max_len.

    A ``KVCacheEntry`` to the code that passes entries along (the block's annotations), but it
    holds no per-head keys or values: ``latent`` and ``k_rope`` are all it stores.
    """

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype, max_len: int):
        self.latent = torch.empty((batch, max_len, cfg.kv_lora_rank), device=device, dtype=dtype)
        self.k_rope = torch.empty((batch, max_len, cfg.qk_rope_head_dim), device=device, dtype=dtype)
        self.length = 0

    def append(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """Store [batch, new, kv_lora_rank] latents and [batch, new, qk_rope] keys; return all so far."""
        end = self.length + latent.shape[1]
        if end > self.latent.shape[1]:
            raise ValueError(f"KV cache full: {end} positions exceed its capacity of {self.latent.shape[1]}")
        self.latent[:, self.length : end] = latent
        self.k_rope[:, self.length : end] = k_rope
        self.length = end
        return self.latent[:, :end], self.k_rope[:, :end]


def _latent_norm(cfg: ModelConfig, width: int) -> RMSNorm:
    norm = RMSNorm(cfg)
    norm.w = nn.Parameter(torch.ones(width))
    norm.eps = LATENT_NORM_EPS
    return norm


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):  # layer: as Attention takes it (MLA has no per-layer options)
        super().__init__()
        self.cfg = cfg
        h, d, e = cfg.n_heads, cfg.d_model, cfg.d_head
        self.nope, self.rope, self.rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.group = 1  # every head has its own key and value (read from the shared latent)
        if cfg.q_lora_rank is None:
            self.W_Q = nn.Parameter(torch.empty(h, d, qk))
            add_bias(self, "b_Q", (h, qk), cfg.qkv_bias)  # DeepSeek has none; a folded LayerNorm needs it
        else:
            self.W_DQ = nn.Parameter(torch.empty(d, cfg.q_lora_rank))
            add_bias(self, "b_DQ", (cfg.q_lora_rank,), cfg.qkv_bias)
            self.q_norm = _latent_norm(cfg, cfg.q_lora_rank)
            self.W_UQ = nn.Parameter(torch.empty(h, cfg.q_lora_rank, qk))
            self.hook_q_latent = HookPoint()  # [batch, pos, q_lora_rank]
        self.W_DKV = nn.Parameter(torch.empty(d, self.rank))
        self.W_KR = nn.Parameter(torch.empty(d, self.rope))
        add_bias(self, "b_DKV", (self.rank,), cfg.qkv_bias)
        add_bias(self, "b_KR", (self.rope,), cfg.qkv_bias)
        self.kv_norm = _latent_norm(cfg, self.rank)
        self.W_UK = nn.Parameter(torch.empty(h, self.rank, self.nope))
        self.W_UV = nn.Parameter(torch.empty(h, self.rank, e))
        self.W_O = nn.Parameter(torch.empty(h, e, d))
        add_bias(self, "b_O", (d,), cfg.bias)
        self.attn_scale = qk**0.5
        # What the borrowed Attention paths read: no Gemma soft-cap or sliding window (config refuses them)
        self.sdpa_scale, self.softcap, self.window = 1 / self.attn_scale, None, None
        self.position = pick(ATTN_POSITIONS, cfg.positional, "positional")(cfg)

        self.hook_kv_latent = HookPoint()  # [batch, pos, kv_lora_rank], normed
        self.hook_q = HookPoint()  # [batch, pos, head_index, qk]
        self.hook_k = HookPoint()  # [batch, pos, head_index, qk]
        self.hook_v = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_rot_q = HookPoint()
        self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head_index, d_model]

    # The attention product itself is Attention's (same masks, padding, NaN handling, two paths).
    _explicit_needed = Attention._explicit_needed
    _causal_mask = Attention._causal_mask
    _fused = Attention._fused
    _sdpa = Attention._sdpa
    _explicit = Attention._explicit
    scores = Attention.scores

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        kv_cache: Optional[MLACacheEntry] = None,
        padding: Optional[Padding] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        offset = kv_cache.length if kv_cache is not None else 0
        positions = padding.positions if padding is not None else None
        q = self.hook_q(self._query(x))
        q = self.hook_rot_q(self._rotate(q, offset, positions))
        latent = self.hook_kv_latent(self.kv_norm(F.linear(x, self.W_DKV.T, self.b_DKV)))
        k_rope = F.linear(x, self.W_KR.T, self.b_KR)  # [batch, pos, qk_rope], before RoPE
        visible = padding.visible if padding is not None else None
        if kv_cache is not None:
            if self.hook_k.has_hooks() or self.hook_v.has_hooks() or self.hook_rot_k.has_hooks():
                self._keys_values(latent, k_rope, offset, positions, _read_only)
            k_rope = self.position.rotate(k_rope[:, :, None], offset, positions)[:, :, 0]
            z = self._on_latent(q, *kv_cache.append(latent, k_rope), offset, visible)
        else:
            k, v = self._keys_values(latent, k_rope, offset, positions)
            packed = padding is not None and padding.packed
            if packed:  # the attention product needs the padded [batch, pos] layout back
                q, k, v = padding.unpack(q), padding.unpack(k), padding.unpack(v)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self._explicit_needed():
                z = self._explicit(q, k, v, None, offset, visible)
            else:
                z = self._fused(q, k, v, None, offset, visible)
            z = z.transpose(1, 2)
            z = padding.pack(z) if packed else z
        z = self.hook_z(z)  # [batch, pos, head_index, d_head]
        if self.hook_result.has_hooks():
            result = self.hook_result(torch.einsum("bphe,hed->bphd", z, self.W_O))
            return result.sum(dim=2) + self.b_O
        return F.linear(z.flatten(2), self.W_O.flatten(0, 1).T, self.b_O)

    # ---- TransformerLens-style effective weights (HookedDecoder.W_V, OV, W_Q_nope, W_K_nope, QK_nope) ----
    # Keys and values are read from c = RMSNorm(x W_DKV) = (x W_DKV / rms) * w: linear in the
    # (ln1-normed) stream except for the latent's per-token 1/rms, a positive scalar per source
    # token that, like TransformerLens' LayerNorm scale, no weight matrix can hold. The products
    # are therefore taken after the latent norm's weight w and before its 1/rms: v = (x W_V) / rms,
    # exactly, for every head. No bias enters them (b_DKV, zero in DeepSeek, as TL's W_ never do).
    def effective_W_V(self) -> Float[Tensor, "head_index d_model d_head"]:
        """W_DKV diag(kv_norm.w) W_UV[h]: head h's value is (x W_V[h]) / rms(x W_DKV + b_DKV)."""
        return torch.einsum("dr,r,hre->hde", self.W_DKV, self.kv_norm.w, self.W_UV)

    def effective_W_K_nope(self) -> Float[Tensor, "head_index d_model qk_nope"]:
        """W_DKV diag(kv_norm.w) W_UK[h]: the no-RoPE part of head h's key, up to the latent's 1/rms.

        The RoPE part of every key is RoPE(x W_KR), rotated by its position: no fixed matrix."""
        return torch.einsum("dr,r,hre->hde", self.W_DKV, self.kv_norm.w, self.W_UK)

    def effective_W_Q_nope(self) -> Float[Tensor, "head_index d_model qk_nope"]:
        """The no-RoPE part of the query map: W_Q[..., :nope], or with query compression
        W_DQ diag(q_norm.w) W_UQ[..., :nope] (up to the query latent's per-token 1/rms)."""
        if self.cfg.q_lora_rank is None:
            return self.W_Q[..., : self.nope]
        return torch.einsum("dr,r,hre->hde", self.W_DQ, self.q_norm.w, self.W_UQ[..., : self.nope])

    def _query(self, x: Tensor) -> Tensor:
        """Queries [batch, pos, head, qk] before RoPE, through the query latent when there is one."""
        if self.cfg.q_lora_rank is None:
            return torch.einsum("bpd,hde->bphe", x, self.W_Q) + self.b_Q
        q_latent = self.hook_q_latent(self.q_norm(F.linear(x, self.W_DQ.T, self.b_DQ)))
        return torch.einsum("bpr,hre->bphe", q_latent, self.W_UQ)

    def _rotate(self, qk: Tensor, offset: int, positions: Optional[Tensor]) -> Tensor:
        """RoPE on the last qk_rope_head_dim dims of each head (DeepSeek's [nope | rope] order)."""
        return torch.cat([qk[..., : self.nope], self.position.rotate(qk[..., self.nope :], offset, positions)], dim=-1)

    def _keys_values(self, latent: Tensor, k_rope: Tensor, offset: int, positions: Optional[Tensor],
                     run=lambda hook, t: hook(t)) -> tuple[Tensor, Tensor]:
        """Every head's rotated keys [batch, pos, head, qk] and values [batch, pos, head, d_head], hooked."""
        k_nope = torch.einsum("bpr,hre->bphe", latent, self.W_UK)
        k = run(self.hook_k, torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, k_nope.shape[2], -1)], dim=-1))
        v = run(self.hook_v, torch.einsum("bpr,hre->bphe", latent, self.W_UV))
        return run(self.hook_rot_k, self._rotate(k, offset, positions)), v

    def _on_latent(self, q: Tensor, latent: Tensor, k_rope: Tensor, offset: int, visible: Optional[Tensor]) -> Tensor:
        """Attention with W_UK absorbed into the query and W_UV into the output; z [batch, pos, head, d_head].

        ``q`` [batch, pos, head, qk] (rotated), ``latent`` [batch, key, kv_lora_rank], ``k_rope``
        [batch, key, qk_rope]: one shared key [latent, k_rope] of rank + qk_rope dims, value latent.
        """
        q_latent = torch.einsum("bphe,hre->bhpr", q[..., : self.nope], self.W_UK)
        q_all = torch.cat([q_latent, q[..., self.nope :].transpose(1, 2)], dim=-1)  # [batch, head, pos, rank + rope]
        keys = torch.cat([latent, k_rope], dim=-1)[:, None]  # [batch, 1, key, rank + rope]
        values = latent[:, None]  # [batch, 1, key, rank]
        n_query, n_key = q_all.shape[2], keys.shape[2]
        finite = bool(torch.isfinite(q_all.sum(dtype=torch.float32) + keys.sum(dtype=torch.float32)))
        if self._explicit_needed() or not finite:  # see Attention._fused for why NaN takes this path
            out = self._explicit(q_all, keys, values, None, offset, visible)
        else:
            mask = visible
            if mask is None and not (n_query == 1 or (offset == 0 and n_query == n_key)):
                mask = self._causal_mask(n_query, n_key, offset, q_all.device)
            causal = mask is None and n_query == n_key and offset == 0 and n_query > 1
            out = F.scaled_dot_product_attention(q_all, keys, values, attn_mask=mask, is_causal=causal,
                                                 scale=1 / self.attn_scale, enable_gqa=True)
        return torch.einsum("bhpr,hre->bphe", out, self.W_UV)


def _read_only(hook: HookPoint, t: Tensor) -> Tensor:
    """Run ``hook`` on ``t`` and raise if it changed it: with a cache MLA's keys and values are not read."""
    before = t.clone()
    if not torch.equal(hook(t), before):
        raise ValueError(
            f"a hook edited {hook.name} of multi-head latent attention during KV-cache decoding, where keys and "
            "values exist only as the latent (nothing reads the per-head ones): edit hook_kv_latent instead, "
            "or generate with use_kv_cache=False"
        )
    return before


# The attention kinds (ModelConfig.attention) and the KV-cache entry each one keeps.
ATTENTIONS = {"mha": Attention, "mla": MLA}
CACHE_ENTRIES = {"mha": KVCacheEntry, "mla": MLACacheEntry}
