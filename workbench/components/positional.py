"""Position information: added to the embedding (learned, sinusoidal) or applied
inside attention (RoPE rotates queries and keys, ALiBi biases the scores).

Two registries, because the two kinds act in different places of the skeleton:
``POS_EMBEDDINGS`` is used once by the model, ``ATTN_POSITIONS`` once per attention layer.
Every variant takes ``offset``, the number of positions already in the KV cache, and, for a
padded batch, per-row ``positions`` [batch, pos] (from the attention mask, see
``workbench.padding``), which replace ``offset + arange(pos)`` so that a padded row sees the
positions its prompt has alone.
"""

import math
from typing import Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.config import ModelConfig
from workbench.padding import Padding


# ---- added to the embedding ---------------------------------------------------------
class LearnedPositions(nn.Module):
    adds_to_residual = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))

    def forward(
        self, tokens: Int[Tensor, "batch pos"], offset: int = 0, positions: Optional[Int[Tensor, "batch pos"]] = None
    ) -> Float[Tensor, "batch pos d_model"]:
        if positions is not None:
            return self.W_pos[positions]
        pos = self.W_pos[offset : offset + tokens.shape[1]]
        return pos.unsqueeze(0).expand(tokens.shape[0], -1, -1)


def sinusoidal_table(n_ctx: int, d_model: int) -> Tensor:
    """[n_ctx, d_model]: sin of each position times each frequency on even dims, cos on odd dims.

    On the meta device (a model built for its shapes: every checkpoint load checks the file against
    one) the table is computed on the CPU and only its shape goes there, as ``rope_inv_freq`` does:
    the first meta-device ``arange`` of a process imports torch's meta kernels, 2-3 s of a load."""
    if torch.get_default_device().type == "meta":
        with torch.device("cpu"):
            return sinusoidal_table(n_ctx, d_model).to("meta")
    pos = torch.arange(n_ctx, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_ctx, d_model)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : d_model // 2]
    return table


class SinusoidalPositions(nn.Module):
    """Vaswani et al. (2017): sin on even dims, cos on odd dims; nothing learned."""

    adds_to_residual = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("W_pos", sinusoidal_table(cfg.n_ctx, cfg.d_model), persistent=False)

    forward = LearnedPositions.forward


class NoPositionEmbedding(nn.Module):
    """For RoPE, ALiBi and NoPE: nothing is added to the residual stream."""

    adds_to_residual = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def forward(
        self, tokens: Int[Tensor, "batch pos"], offset: int = 0, positions: Optional[Int[Tensor, "batch pos"]] = None
    ) -> None:
        return None


POS_EMBEDDINGS = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "rope": NoPositionEmbedding,
    "alibi": NoPositionEmbedding,
    "none": NoPositionEmbedding,
}


# ---- applied inside attention ---------------------------------------------------------
class NoAttnPosition(nn.Module):
    rotates = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def score_bias(self, n_query: int, n_key: int, offset: int, padding: Optional[Padding] = None) -> Optional[Tensor]:
        return None


def _plain_inv_freq(base: float, dim: int) -> Tensor:
    """RoPE's unscaled frequencies base^(-2i/dim), computed as Hugging Face does (int64 arange, then float)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(cfg: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies of RoPE and the attention scaling, for each scaling variant.

    Mirrors Hugging Face's ``ROPE_INIT_FUNCTIONS`` (default, linear, llama3, yarn), so that
    imported checkpoints reproduce their logits. ``dynamic`` is applied per call in ``Rotary``.
    """
    if torch.get_default_device().type == "meta":
        # A model built for its shapes (accounting.meta_model, which checks every checkpoint loaded):
        # the same numbers on the CPU, then shape only. On the meta device itself ``base ** tensor``
        # is one of torch's Python decompositions, whose first use in a process imports torch's
        # meta kernels: seconds of the app's first page on a loaded machine.
        with torch.device("cpu"):
            inv_freq, scaling = rope_inv_freq(cfg)
        return inv_freq.to("meta"), scaling
    dim = cfg.rotary_dim
    inv_freq = _plain_inv_freq(cfg.rope_base, dim)
    factor, scaling = cfg.rope_scaling_factor, 1.0
    original = cfg.rope_original_n_ctx or cfg.n_ctx
    if cfg.rope_scaling == "linear":
        inv_freq = inv_freq / factor
    elif cfg.rope_scaling == "llama3":
        low_wavelen = original / cfg.rope_low_freq_factor
        high_wavelen = original / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif cfg.rope_scaling == "yarn":
        scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def correction_dim(n_rot: float) -> float:
            return (dim * math.log(original / (n_rot * 2 * math.pi))) / (2 * math.log(cfg.rope_base))

        low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, scaling


class Rotary(nn.Module):
    """RoPE (Su et al. 2021) on the first ``rotary_dim`` dims of each query and key head."""

    rotates = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotate_pairs = self._rotate_interleaved if cfg.rotary_interleaved else self._rotate_half
        self._dynamic = cfg.rope_scaling == "dynamic"

    def score_bias(self, n_query: int, n_key: int, offset: int, padding: Optional[Padding] = None) -> Optional[Tensor]:
        return None

    def _apply(self, fn, recurse: bool = True):
        # model.to(bfloat16) must not round the frequencies: at position 3000 a bf16 inv_freq
        # moves cos/sin by up to 1.0. Keep them float32, recomputed exactly, on the new device.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and not self.inv_freq.is_meta:
            self.inv_freq = rope_inv_freq(self.cfg)[0].to(self.inv_freq.device)
        return self

    def _inv_freq_for(self, n_positions: int) -> Tensor:
        cfg = self.cfg
        original = cfg.rope_original_n_ctx or cfg.n_ctx
        if cfg.rope_scaling != "dynamic" or n_positions <= original:
            return self.inv_freq
        dim = cfg.rotary_dim
        base = cfg.rope_base * (
            (cfg.rope_scaling_factor * n_positions / original) - (cfg.rope_scaling_factor - 1)
        ) ** (dim / (dim - 2))
        return _plain_inv_freq(base, dim).to(self.inv_freq.device)

    def cos_sin(
        self, n_positions: int, offset: int, dtype: torch.dtype, positions: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin [pos, 1, rotary_dim] at ``offset + arange(n_positions)``, or
        [batch, pos, 1, rotary_dim] at per-row ``positions`` [batch, pos] (a padded batch)."""
        if positions is None:
            pos = torch.arange(offset, offset + n_positions, device=self.inv_freq.device, dtype=torch.float32)
            angles = torch.outer(pos, self._inv_freq_for(offset + n_positions))  # [pos, rotary_dim/2]
        else:
            # Dynamic scaling picks its frequencies from the length so far: per row, the length
            # that row has alone (its last position + 1), never the padded width.
            inv_freq = self.inv_freq[None]
            if self._dynamic:
                lengths = (positions.max(dim=1).values + 1).tolist()
                inv_freq = torch.stack([self._inv_freq_for(n) for n in lengths])
            angles = positions.to(torch.float32)[..., None] * inv_freq[:, None, :]  # [batch, pos, rotary_dim/2]
        if self.cfg.rotary_interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        # [..., pos, 1, rotary_dim], broadcast over heads
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    @staticmethod
    def _rotated_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x * cos + _rotate_half(x) * sin`` with the halves added in place: (-x2) * s is -(x2 * s) and
        a + (-b) is a - b exactly, so the result is the same to the bit, with two [.., d_head] temporaries
        (the negation and the concatenation) fewer."""
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].sub_(x[..., half:] * sin[..., :half])
        out[..., half:].add_(x[..., :half] * sin[..., half:])
        return out

    @staticmethod
    def _rotate_interleaved(x: Tensor) -> Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([-x2, x1], dim=-1).flatten(-2)

    def rotate(
        self,
        x: Float[Tensor, "batch pos head_index d_head"],
        offset: int,
        positions: Optional[Int[Tensor, "batch pos"]] = None,
        cos_sin: Optional[tuple[Tensor, Tensor]] = None,
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        """``x`` rotated at its positions; ``cos_sin``: this call's ``cos_sin(...)`` when the caller has it
        (queries and keys of one step share it)."""
        r = self.cfg.rotary_dim
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(x.shape[1], offset, x.dtype, positions)
        x_rot, x_pass = x[..., :r], x[..., r:]
        if self.cfg.rotary_interleaved:
            x_rot = x_rot * cos + self.rotate_pairs(x_rot) * sin
        else:
            x_rot = self._rotated_halves(x_rot, cos, sin)
        return torch.cat([x_rot, x_pass], dim=-1) if x_pass.shape[-1] else x_rot


def alibi_slopes(n_heads: int) -> Tensor:
    """Press et al. (2022): a geometric sequence; for non-powers of two, interleave the next one."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two_slopes(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two_slopes(closest) + extra)


class ALiBi(nn.Module):
    """A per-head linear penalty on distance, added to the attention scores."""

    rotates = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def score_bias(
        self, n_query: int, n_key: int, offset: int, padding: Optional[Padding] = None
    ) -> Float[Tensor, "*batch head_index query_pos key_pos"]:
        """[head, query, key]; for a padded batch [batch, head, query, key], the distances
        counted in each row's real tokens (pads in between do not add to the distance)."""
        if padding is None:
            q_pos = torch.arange(offset, offset + n_query, device=self.slopes.device)
            k_pos = torch.arange(n_key, device=self.slopes.device)
            distance = (k_pos[None, :] - q_pos[:, None]).clamp(max=0).to(self.slopes.dtype)
            return self.slopes[:, None, None] * distance
        k_pos = padding.key_positions
        q_pos = k_pos[:, padding.offset :]
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(max=0).to(self.slopes.dtype)
        return self.slopes[None, :, None, None] * distance[:, None]


ATTN_POSITIONS = {
    "learned": NoAttnPosition,
    "sinusoidal": NoAttnPosition,
    "none": NoAttnPosition,
    "rope": Rotary,
    "alibi": ALiBi,
}
