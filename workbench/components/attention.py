"""Causal self-attention covering MHA, GQA and MQA (``n_kv_heads`` = n_heads, between, 1).

Weights use TransformerLens' layout (``W_Q [head, d_model, d_head]``, ``W_O [head, d_head,
d_model]``); keys and values are stored once per KV head (``_W_K``, ``_W_V``) and the
``W_K``/``W_V`` properties repeat them per query head, as TL's grouped-query attention does.

Two paths give the same output: when nothing listens to ``hook_attn_scores`` or
``hook_pattern``, attention runs through ``F.scaled_dot_product_attention`` and the
[batch, head, query, key] tensors are never materialised; otherwise the explicit path runs.

A padded batch comes with a ``Padding`` (``workbench.padding``): per-row positions for RoPE
and ALiBi, and a [batch, 1, query, key] visibility mask that keeps pads out of every real
token's attention. Without one (no mask, or an all-ones mask) both paths are exactly what
they were before padding existed: SDPA with ``is_causal``.

QK-norm (``cfg.qk_norm``, Qwen3 / OLMo 2 / Gemma 3): an RMSNorm on the projected queries and
keys, per head or over the whole projection, before RoPE; the KV cache holds normalised,
rotated keys, so decode steps normalise only the new token.

Gemma's options (``workbench.config``): ``attn_logit_softcap`` (cap * tanh(scores / cap) before the
mask; SDPA has no such step, so a soft-capped layer always runs the explicit path),
``query_pre_attn_scalar`` (scores divided by its square root instead of sqrt(d_head), on both
paths), and a per-layer sliding window (``cfg.layer_is_local(layer)``): the visibility mask also
hides keys ``window`` or more positions back, on both paths, padded or not, and in KV-cache decode
steps. Gemma 3's local layers rotate with their own RoPE base (``rope_local_base``).

The KV cache (``KVCacheEntry``) holds a layer's keys and values in position order, rotated at
their absolute positions. A global layer's entry is preallocated to max_len; a sliding layer's
holds ``window`` positions at most, whatever the context: after each step it keeps the last
``window - 1`` (what a later query can see beside its own key, as transformers'
``DynamicSlidingWindowLayer`` keeps), so a decode step attends over the held keys and its own,
and the keys of a cached step are the last ``n_key`` positions (column ``first = offset +
n_query - n_key`` on): the padding mask and ALiBi's bias are cut to those columns, and
``hook_attn_scores`` / ``hook_pattern`` of a sliding layer's decode step have ``n_key`` columns.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.norm import GemmaRMSNorm, QKNorm
from workbench.components.positional import ATTN_POSITIONS
from workbench.components.registry import add_bias, bias_term, pick
from workbench.config import ModelConfig
from workbench.padding import Padding


class KVCacheEntry:
    """Keys and values of one layer, in position order: every position so far (preallocated to
    max_len), or in a sliding-window layer only the latest ones, ``window`` positions of storage.

    ``length`` counts the positions seen, ``held`` those stored (the last ``held`` of them, at
    [0, held)). After an append a sliding layer keeps the last ``hold`` positions: ``window - 1``,
    unless the model's ``KVCache`` raises it for a row with pads after real tokens (its last
    window - 1 real keys then span more columns; the storage grows for them).
    """

    def __init__(
        self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype, max_len: int,
        window: Optional[int] = None,
    ):
        room = max_len if window is None else min(window, max_len)
        shape = (batch, cfg.n_kv_heads, room, cfg.d_head)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_len, self.window = max_len, window
        self.hold = max_len if window is None else window - 1
        self.length = 0
        self.held = 0
        # A static cache's decode step (workbench.static_cache): the [1] column its key goes to, a tensor
        self.column: Optional[Tensor] = None
        self.fused_qkv: Optional[tuple[Tensor, Tensor]] = None  # set by Attention on first use

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store [batch, kv_head, new, d_head] keys/values; return the held and the new ones, in
        position order: every position so far, or in a sliding layer the last ``n_key`` of them.
        A static cache's decode step writes at ``column`` and returns the whole buffers."""
        if self.column is not None:
            if k.shape[2] != 1:
                raise ValueError(f"a static KV cache decodes one token per step, got {k.shape[2]}")
            self.k.index_copy_(2, self.column, k)
            self.v.index_copy_(2, self.column, v)
            return self.k, self.v
        n, end = k.shape[2], self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions exceed its capacity of {self.max_len}")
        self.length = end
        room = self.k.shape[2]
        if self.held + n <= room:  # room after what is held: written in place, nothing copied
            self.k[:, :, self.held : self.held + n] = k
            self.v[:, :, self.held : self.held + n] = v
            self.held += n
            return self.k[:, :, : self.held], self.v[:, :, : self.held]
        # A sliding layer past its storage: this step attends over the held keys and its own, then the
        # last ``hold`` are kept. Storage of ``window`` for a hold of window - 1 leaves room for the next
        # one-token step, so decoding copies the held keys every other step only.
        if self.held:
            k = torch.cat([self.k[:, :, : self.held], k], dim=2)
            v = torch.cat([self.v[:, :, : self.held], v], dim=2)
        keep = min(self.hold, k.shape[2])
        if keep > room:  # a row with pads after real tokens needs more columns than the window
            self.k = self.k.new_empty(self.k.shape[:2] + (keep, self.k.shape[3]))
            self.v = self.v.new_empty(self.k.shape)
        self.k[:, :, :keep] = k[:, :, k.shape[2] - keep :]
        self.v[:, :, :keep] = v[:, :, v.shape[2] - keep :]
        self.held = keep
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        h, kv, d, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.d_head
        self.group = h // kv
        self.W_Q = nn.Parameter(torch.empty(h, d, e))
        self._W_K = nn.Parameter(torch.empty(kv, d, e))
        self._W_V = nn.Parameter(torch.empty(kv, d, e))
        self.W_O = nn.Parameter(torch.empty(h, e, d))
        add_bias(self, "b_Q", (h, e), cfg.qkv_bias)
        add_bias(self, "_b_K", (kv, e), cfg.qkv_bias)
        add_bias(self, "_b_V", (kv, e), cfg.qkv_bias)
        add_bias(self, "b_O", (d,), cfg.bias)
        self.attn_scale = math.sqrt(e if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar)
        self.sdpa_scale = None if cfg.query_pre_attn_scalar is None else 1 / self.attn_scale  # None: SDPA's 1/sqrt(d_head)
        self.softcap = cfg.attn_logit_softcap
        self.window = cfg.sliding_window if cfg.layer_is_local(layer) else None
        pos_cfg = cfg
        if self.window is not None and cfg.rope_local_base is not None:  # Gemma 3's local layers
            pos_cfg = cfg.replace(rope_base=cfg.rope_local_base, rope_scaling="none")
        self.position = pick(ATTN_POSITIONS, cfg.positional, "positional")(pos_cfg)

        self.hook_q = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_k = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_v = HookPoint()  # [batch, pos, kv_head, d_head]
        if cfg.qk_norm != "none":
            # As TransformerLens' bridge (Qwen3, OLMo 2): hook_q/hook_k are the projections,
            # hook_q_normed/hook_k_normed the normalised queries/keys that RoPE then rotates.
            per_head = cfg.qk_norm == "head"
            qk_norm = GemmaRMSNorm if cfg.norm == "gemma_rmsnorm" else QKNorm  # Gemma 3: (1 + w) here too
            self.q_norm = qk_norm(cfg, e if per_head else h * e)
            self.k_norm = qk_norm(cfg, e if per_head else kv * e)
            self.hook_q_normed = HookPoint()  # [batch, pos, head_index, d_head]
            self.hook_k_normed = HookPoint()  # [batch, pos, kv_head, d_head]
        if self.position.rotates:
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head_index, d_model]

    @property
    def W_K(self) -> Float[Tensor, "head_index d_model d_head"]:
        return self._W_K.repeat_interleave(self.group, dim=0)

    @property
    def W_V(self) -> Float[Tensor, "head_index d_model d_head"]:
        return self._W_V.repeat_interleave(self.group, dim=0)

    @property
    def b_K(self) -> Float[Tensor, "head_index d_head"]:
        return self._b_K.repeat_interleave(self.group, dim=0)

    @property
    def b_V(self) -> Float[Tensor, "head_index d_head"]:
        return self._b_V.repeat_interleave(self.group, dim=0)

    def _explicit_needed(self) -> bool:
        # SDPA has no soft-capping of the scores: a soft-capped layer always runs the explicit path
        return self.softcap is not None or self.hook_attn_scores.has_hooks() or self.hook_pattern.has_hooks()

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        kv_cache: Optional[KVCacheEntry] = None,
        padding: Optional[Padding] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        offset = kv_cache.length if kv_cache is not None else 0
        q, k, v = self._project_qkv(x, kv_cache)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if self.cfg.qk_norm != "none":
            q = self.hook_q_normed(self._qk_normed(self.q_norm, q))
            k = self.hook_k_normed(self._qk_normed(self.k_norm, k))
        if self.position.rotates:
            positions = padding.positions if padding is not None else None
            angles = self.position.cos_sin(q.shape[1], offset, q.dtype, positions)
            same = k.shape[1] == q.shape[1] and k.dtype == q.dtype  # as they are unless a hook changed one
            q = self.hook_rot_q(self.position.rotate(q, offset, positions, angles))
            k = self.hook_rot_k(self.position.rotate(k, offset, positions, angles if same else None))
        packed = padding is not None and padding.packed
        if packed:  # the attention product needs the padded [batch, pos] layout back
            q, k, v = padding.unpack(q), padding.unpack(k), padding.unpack(v)
        # (batch, head, pos, d_head) for the attention product
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        if padding is not None and padding.static:  # a static cache's step: the whole buffer, its mask
            bias, visible = None, padding.visible
        else:
            bias, visible = self._bias_and_visible(q.shape[2], k.shape[2], offset, padding, q.device)
        if self._explicit_needed():
            z = self._explicit(q, k, v, bias, offset, visible)
        elif padding is not None and padding.static and torch.compiler.is_compiling():
            z = self._static_step(q, k, v, visible)
        else:
            z = self._fused(q, k, v, bias, offset, visible)
        z = z.transpose(1, 2)
        z = self.hook_z(padding.pack(z) if packed else z)  # [batch, pos, head_index, d_head]
        b_O = bias_term(self, "b_O")
        if self.hook_result.has_hooks():
            result = self.hook_result(torch.einsum("bphe,hed->bphd", z, self.W_O))
            out = result.sum(dim=2)
            return out if b_O is None else out + b_O
        return F.linear(z.flatten(2), self.W_O.flatten(0, 1).T, b_O)

    def _bias_and_visible(
        self, n_query: int, n_key: int, offset: int, padding: Optional[Padding], device: torch.device
    ) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The score bias (ALiBi) and visibility mask (None: causal) over this step's keys."""
        first = offset + n_query - n_key  # > 0: a sliding layer's cache holds only the latest keys
        bias = self.position.score_bias(n_query, offset + n_query, offset, padding)
        visible = padding.visible if padding is not None else None
        if first:
            bias = bias[..., first:] if bias is not None else None
            visible = visible[..., first:] if visible is not None else None
        if self.window is not None:
            visible = self._windowed(visible, padding, n_query, n_key, offset, device)
        return bias, visible

    def _qk_normed(self, norm: nn.Module, x: Tensor) -> Tensor:
        """QK-norm of [..., head, d_head]: over d_head, or over the flattened projection."""
        if self.cfg.qk_norm == "head":
            return norm(x)
        return norm(x.flatten(-2)).unflatten(-1, x.shape[-2:])

    def _project_qkv(self, x: Tensor, kv_cache: Optional[KVCacheEntry] = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values [batch, pos, head, d_head] from one fused matmul."""
        h, kv, e = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.d_head
        params = (self.W_Q, self._W_K, self._W_V)
        if (kv_cache is None or torch.is_grad_enabled()) and all(w.transpose(1, 2).is_contiguous() for w in params):
            # Weights imported from a checkpoint are views of its [heads * d_head, d_model] matrices:
            # three matmuls read them in place, where concatenating them would copy every attention
            # weight on every call (a sixth of a 1B model's first bf16 forward on the CPU).
            biases = (bias_term(self, name) for name in ("b_Q", "_b_K", "_b_V"))
            q, k, v = (F.linear(x, w.transpose(1, 2).flatten(0, 1), None if b is None else b.flatten())
                       .unflatten(-1, (-1, e)) for w, b in zip(params, biases))
            return q, k, v
        weight, bias = self._fused_qkv_weight(kv_cache)
        qkv = F.linear(x, weight, bias)  # [batch, pos, (h + 2kv) * d_head]
        q, k, v = qkv.unflatten(-1, (h + 2 * kv, e)).split([h, kv, kv], dim=2)
        return q, k, v

    def _fused_qkv_weight(self, kv_cache: Optional[KVCacheEntry] = None) -> tuple[Tensor, Tensor]:
        """W_Q, W_K, W_V (and biases) as one [(h + 2kv) * d_head, d_model] matrix.

        Concatenated afresh on every call, so any change to a weight (``.data`` edits, which do
        not bump ``_version``; ``load_state_dict``; casts) is seen by the next forward. Only a
        KV cache keeps one concatenation for its lifetime, outside autograd: its keys and values
        already belong to the weights it was filled with, and one-token decode steps would
        otherwise spend as long copying the weights as multiplying by them.
        """
        reuse = kv_cache is not None and not torch.is_grad_enabled()
        if reuse and kv_cache.fused_qkv is not None:
            return kv_cache.fused_qkv
        parts = (self.W_Q, self._W_K, self._W_V, self.b_Q, self._b_K, self._b_V)
        weight = torch.cat(parts[:3], dim=0).transpose(1, 2).flatten(0, 1)  # [(h + 2kv) * d_head, d_model]
        bias = torch.cat(parts[3:], dim=0).flatten()
        if reuse:
            kv_cache.fused_qkv = (weight, bias)
        return weight, bias

    def _windowed(
        self, visible: Optional[Tensor], padding: Optional[Padding], n_query: int, n_key: int, offset: int,
        device: torch.device,
    ) -> Optional[Tensor]:
        """``visible`` (None: causal) narrowed to the sliding window: a query sees the keys fewer than
        ``window`` positions back, counted in real tokens for a padded row (as its prompt alone).
        The keys are the last ``n_key`` positions (a sliding layer's KV cache holds no more)."""
        if n_key <= self.window:  # the last query and the first key are fewer than window apart: nothing to cut
            return visible
        first = offset + n_query - n_key
        if padding is None:
            q_pos = torch.arange(offset, offset + n_query, device=device)[:, None]
            k_pos = torch.arange(first, first + n_key, device=device)[None, :]
            return (k_pos <= q_pos) & (q_pos - k_pos < self.window)  # [query, key]
        k_pos = padding.key_positions
        distance = k_pos[:, offset:, None] - k_pos[:, None, first:]  # [batch, query, key]
        return visible & (distance < self.window)[:, None]

    def _causal_mask(self, n_query: int, n_key: int, offset: int, device: torch.device) -> Tensor:
        """[query, key], True = visible; the keys are the last ``n_key`` positions."""
        q_pos = torch.arange(offset, offset + n_query, device=device)
        k_pos = torch.arange(offset + n_query - n_key, offset + n_query, device=device)
        return k_pos[None, :] <= q_pos[:, None]

    def _fused(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], offset: int, visible: Optional[Tensor] = None
    ) -> Tensor:
        # CPU SDPA returns 0, not NaN, for a query row that is NaN or whose visible scores are all
        # NaN, where the explicit softmax (and the math) gives NaN: a broken weight would hide
        # behind finite logits. Non-finite queries or keys (one summed reduction each, far
        # cheaper than the attention) take the explicit path, so both paths always agree.
        finite = torch.isfinite(q.sum(dtype=torch.float32) + k.sum(dtype=torch.float32))
        if torch.compiler.is_compiling():  # no data-dependent branch in a graph: NaN everywhere instead
            return torch.where(finite, self._sdpa(q, k, v, bias, offset, visible), float("nan"))
        if not bool(finite):
            return self._explicit(q, k, v, bias, offset, visible)
        return self._sdpa(q, k, v, bias, offset, visible)

    def _sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], offset: int, visible: Optional[Tensor] = None
    ) -> Tensor:
        n_query, n_key = q.shape[2], k.shape[2]
        gqa = self.group > 1
        if visible is not None:  # a padded batch: [batch, 1, query, key], pads never visible
            mask = visible if bias is None else bias.to(q.dtype).masked_fill(~visible, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.sdpa_scale)
        if bias is None and offset == 0 and n_query == n_key:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.sdpa_scale)
        if bias is None and n_query == 1:  # one decode step sees every cached key
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=self.sdpa_scale)
        mask = self._causal_mask(n_query, n_key, offset, q.device)
        if bias is not None:
            mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.sdpa_scale)

    def _static_step(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
        """A static cache's decode step under torch.compile: one query per head over the whole buffer,
        written out so inductor makes it its own kernels (SDPA's CPU kernel, an opaque call, copies
        the query, keys, values and mask into its layout every call: most of a small model's
        attention time). Grouped heads broadcast over their key head, nothing repeated; scores and
        softmax in float32 at least, as SDPA accumulates (float64 stays float64: a float64 model's
        compiled step equals its eager one to 1e-15, not to float32's 1e-8); a non-finite query or
        key makes the output NaN, as ``_fused`` does in a graph."""
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = q.to(acc).unflatten(1, (k.shape[1], self.group))  # [batch, kv_head, group, 1, d_head]
        scores = qg @ k.to(acc)[:, :, None].transpose(-1, -2) / self.attn_scale  # [batch, kv_head, group, 1, key]
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
        z = (torch.softmax(scores, dim=-1) @ v.to(acc)[:, :, None]).flatten(1, 2)  # [batch, head, 1, d_head]
        finite = torch.isfinite(q.sum(dtype=torch.float32) + k.sum(dtype=torch.float32))
        return torch.where(finite, z.to(v.dtype), float("nan"))

    def _explicit(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], offset: int, visible: Optional[Tensor] = None
    ) -> Tensor:
        # What caching every hook pays for: the [batch, head, query, key] scores and pattern are written
        # once each (the scale and the mask act in place on the product's fresh output) and the values
        # are read per KV head, never copied out per query head.
        if self.group > 1:  # the scores are per query head
            k = k.repeat_interleave(self.group, dim=1)
        mask = self._causal_mask(q.shape[2], k.shape[2], offset, q.device) if visible is None else visible
        scores = self.hook_attn_scores(self.scores(q, k, bias).masked_fill_(~mask, float("-inf")))
        # float32 softmax, rounded after (HF's eager attention does the same in bf16/fp16)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype))
        if self.group == 1:
            return pattern @ v
        # the query heads of one KV head, stacked along the queries, read its values in one product
        b, h, n_query, n_key = pattern.shape
        z = pattern.reshape(b, v.shape[1], self.group * n_query, n_key) @ v
        return z.view(b, h, n_query, v.shape[-1])

    def scores(self, q: Tensor, k: Tensor, bias: Optional[Tensor]) -> Tensor:
        """Unmasked scores [batch, head, query, key] of queries and keys with as many heads: this
        layer's scale, soft-cap and score bias (what the circuits' head-by-head runner reuses).
        A fresh tensor (the caller may mask it in place)."""
        scores = (q @ k.transpose(-1, -2)).div_(self.attn_scale)  # in place on the product: one tensor
        if self.softcap is not None:  # Gemma 2: before the mask, as HF's eager attention
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if bias is None:
            return scores
        if bias.dtype == scores.dtype and torch.broadcast_shapes(scores.shape, bias.shape) == scores.shape:
            return scores.add_(bias)
        return scores + bias  # a wider bias widens the scores, as it always has
