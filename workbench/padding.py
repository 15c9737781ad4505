"""Prompts of different lengths: the padded batch type, and the mask arithmetic every layer shares.

A batch of prompts of different lengths travels as a ``TokenBatch``: ``tokens`` [batch, pos]
with a pad id where a row is shorter, and ``attention_mask`` [batch, pos] (1 = real token,
0 = pad), padded on the left or the right. The model takes it whole (``model(batch)``) or as
``model(tokens, attention_mask=mask)``, as TransformerLens users type.

What a row of a padded batch computes equals what its prompt computes alone, because:

- positions come from the mask, not the column: a token's position is the number of real
  tokens before it (``cumsum(mask) - 1``, pads clamped to 0), for learned and sinusoidal
  tables, RoPE's angles and ALiBi's distances alike;
- no query attends to a pad key; a pad query attends to itself only, so its output is finite
  and defined (not NaN) and depends on nothing real;
- nothing else mixes positions (norms and MLPs act per token; MoE routing has no capacity or
  load balancing in the forward, and skips pads anyway).

``Padding`` is what one forward hands to every layer: the key mask and key positions of every
position seen so far (the KV cache's included), and the visibility mask, built once per forward.

Packing: pads cost compute like real tokens. When nothing listens (no hook attached anywhere,
no KV cache, the whole model run), the forward drops them: every per-token step (embedding,
norms, projections, MLPs, the unembedding) runs on the real tokens only, packed as
[1, n_real, ...], and only the attention product itself goes back to the padded [batch, pos]
layout. Logits come back padded, 0 at pads (hooked and compiled forwards too). With hooks attached nothing is packed, so every
hook sees [batch, pos, ...] as always.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence, Union

import torch
from jaxtyping import Bool, Int, Shaped
from torch import Tensor

PADDING_SIDES = ("left", "right")
PAD_STR = "<pad>"  # how to_str_tokens shows a pad position


@dataclass
class TokenBatch:
    """Token ids of prompts of different lengths, padded to one width, with their mask.

    ``tokens`` [batch, pos]; ``attention_mask`` [batch, pos], 1 for a real token and 0 for a
    pad (the pad id at those places is meaningless: the mask is the truth). ``padding_side``
    says where the pads went; ``generate`` needs ``"left"``, so every row ends in a real token.
    """

    tokens: Int[Tensor, "batch pos"]
    attention_mask: Shaped[Tensor, "batch pos"]
    padding_side: str = "right"

    def __post_init__(self) -> None:
        if self.padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")
        check_attention_mask(self.attention_mask, self.tokens.shape)

    @classmethod
    def from_ids(
        cls,
        ids: Sequence[Sequence[int]],
        pad_id: int = 0,
        padding_side: str = "right",
        device: Optional[Union[str, torch.device]] = None,
        width: Optional[int] = None,
    ) -> "TokenBatch":
        """Pad lists of token ids to the longest (or to ``width``), on ``padding_side``, with ``pad_id``."""
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        rows = [list(map(int, r)) for r in ids]
        if not rows:
            raise ValueError("no prompts: need at least one sequence of token ids")
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt {i} has no tokens (an empty text?): every row needs at least one token")
        longest = max(map(len, rows))
        if width is None:
            width = longest
        elif width < longest:
            raise ValueError(f"width={width} is shorter than the longest row ({longest} tokens)")
        tokens = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            where = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
            tokens[i, where] = torch.tensor(r, dtype=torch.long)
            mask[i, where] = 1
        return cls(tokens.to(device), mask.to(device), padding_side)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        """Real tokens per row."""
        return self.attention_mask.sum(dim=1)

    @property
    def last_index(self) -> Int[Tensor, " batch"]:
        """Column of each row's last real token: where ``logits[rows, last_index]`` predicts the next one."""
        width = self.tokens.shape[1]
        return width - 1 - self.attention_mask.flip(1).long().argmax(dim=1)

    def row(self, i: int) -> Int[Tensor, " pos"]:
        """The real tokens of row ``i``, pads dropped: the prompt as it would run alone."""
        return self.tokens[i][self.attention_mask[i].bool()]

    def to(self, device: Union[str, torch.device]) -> "TokenBatch":
        """The same batch (and every tensor field of a subclass) on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return type(self)(**{k: v.to(device) if isinstance(v, (Tensor, TokenBatch)) else v for k, v in moved.items()})


def unpack(input: object, attention_mask: object) -> tuple[object, object]:
    """``(tokens, attention_mask)`` out of a TokenBatch; anything else passes through."""
    if isinstance(input, TokenBatch):
        if attention_mask is not None:
            raise ValueError(
                "attention_mask given twice: a TokenBatch carries its own mask (attention_mask=... is for plain token tensors)"
            )
        return input.tokens, input.attention_mask
    return input, attention_mask


def check_attention_mask(
    mask: object, tokens_shape: Sequence[int], require_real: bool = True, check_values: bool = True
) -> Tensor:
    """``mask`` as a bool [batch, pos] tensor, or a clear ValueError naming what is wrong.

    ``require_real``: every row must hold a real token (a row of pads only has nothing to compute).
    ``check_values=False`` skips the checks that read the mask's values (0/1 only, ``require_real``):
    inside a compiled graph each would be a graph break, so ``model.compile()`` runs them before it.
    """
    if not isinstance(mask, Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"attention_mask must be a [batch, pos] tensor of 0/1, got {type(mask).__name__}") from None
    shape = tuple(tokens_shape)
    if mask.ndim == 1 and len(shape) == 2 and shape[0] == 1:
        mask = mask[None]
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but the tokens have shape {shape}: it must be "
            "[batch, pos] like the tokens, 1 for a real token and 0 for padding"
        )
    if mask.dtype != torch.bool:
        if check_values and (mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all())):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
        mask = mask != 0
    empty = (~mask.any(dim=-1)).nonzero().flatten() if require_real and check_values else ()
    if len(empty):
        raise ValueError(
            f"attention_mask row {int(empty[0])} is all padding: every row needs at least one real token"
        )
    return mask


def loss_targets(mask: Tensor, check: bool = True) -> Tensor:
    """[batch, pos - 1] bool: the next-token targets that count with ``mask`` (bool), those real with a
    real token before them; ``check``: a ValueError when none does."""
    counted = mask[:, 1:] & mask[:, :-1]
    if check and not bool(counted.any()):
        raise ValueError("the next-token loss needs a row with at least 2 real tokens")
    return counted


def _whole_mask(
    attention_mask: Optional[object], shape: Sequence[int], past: Optional[Tensor], offset: int,
    device: torch.device, check_values: bool = True,
) -> tuple[Tensor, Tensor]:
    """This forward's mask as bool on ``device`` (all real when none was given) and the whole mask,
    ``past`` (None: ``offset`` real positions) then this forward's, each checked."""
    if attention_mask is None:
        mask = torch.ones(tuple(shape), dtype=torch.bool, device=device)
    else:
        mask = check_attention_mask(attention_mask, shape, require_real=False, check_values=check_values).to(device)
    if past is None:
        past = torch.ones((mask.shape[0], offset), dtype=torch.bool, device=device)
    full = check_attention_mask(torch.cat([past, mask], dim=1), (mask.shape[0], offset + mask.shape[1]),
                                check_values=check_values)
    return mask, full


def forward_padding(
    attention_mask: Optional[Tensor],
    shape: Sequence[int],
    past: Optional[Tensor],
    offset: int,
    device: torch.device,
    padded: Optional[bool] = None,
) -> tuple[Optional["Padding"], Optional[Tensor], Optional[Tensor]]:
    """What a forward over ``shape`` [batch, pos] tokens needs, after ``offset`` cached positions
    whose mask is ``past`` (None: all real): its ``Padding`` (None when nothing is padded, so the
    unpadded path runs unchanged), its own mask as bool (None when none was given), and the
    whole mask for the KV cache to keep (None when all real).

    ``padded``: whether the whole mask holds a pad, when the caller has checked the mask already
    (``mask_is_padded``); the function then reads no value of the mask, so a compiled graph runs it
    without a break (the branch is on a Python bool, which dynamo guards on). None: checked here."""
    if attention_mask is None and past is None:
        return None, None, None
    mask, full = _whole_mask(attention_mask, shape, past, offset, device, check_values=padded is None)
    given = mask if attention_mask is not None else None
    if padded is None:
        padded = not bool(full.all())
    if not padded:
        return None, given, None
    return Padding(full, offset), given, full


def mask_is_padded(
    attention_mask: Optional[object], shape: Sequence[int], past: Optional[Tensor], offset: int
) -> Optional[bool]:
    """Every check ``forward_padding`` makes of a mask's values (the same ValueErrors), and whether the
    whole mask (``past`` and this forward's) holds a pad: None when there is no mask at all. What
    ``model.compile()`` runs eagerly before its graph."""
    if attention_mask is None and past is None:
        return None
    device = past.device if past is not None else getattr(attention_mask, "device", torch.device("cpu"))
    return not bool(_whole_mask(attention_mask, shape, past, offset, device)[1].all())


def left_padded_mask(attention_mask: Optional[Tensor], shape: Sequence[int], device: torch.device) -> Optional[Tensor]:
    """A prompt mask for ``generate`` as bool (None when absent or all ones); right padding is refused."""
    if attention_mask is None:
        return None
    mask = check_attention_mask(attention_mask, shape).to(device)
    ends_in_pad = (~mask[:, -1]).nonzero().flatten()
    if len(ends_in_pad):
        row = int(ends_in_pad[0])
        raise ValueError(
            f"generate needs left padding: row {row} of attention_mask ends in padding "
            f"(attention_mask[{row}, -1] == 0), so its next token would follow a pad; build the "
            "batch with to_tokens(texts, padding_side='left')"
        )
    return None if bool(mask.all()) else mask


def cut_after_stop(row: Tensor, mask: Tensor, width: int, stops: Tensor) -> Tensor:
    """A generated row's real tokens (prompt ``width`` columns wide), cut after its first new stop token."""
    new = row[width:]
    hits = torch.isin(new, stops).nonzero().flatten()
    if len(hits):
        new = new[: int(hits[0]) + 1]
    return torch.cat([row[:width][mask[:width]], new])


def positions_from_mask(mask: Bool[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """Position ids: real tokens before each one (0, 1, 2, ... along each row's real tokens); pads 0."""
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@dataclass
class Padding:
    """What one forward over a padded batch hands to every layer.

    ``key_mask`` and ``key_positions`` [batch, key_pos] cover every position attended to (the
    KV cache's and this forward's); this forward's queries are the last ``key_pos - offset``.
    """

    static = False  # a static KV cache's decode step hands a StaticStep instead (workbench.static_cache)
    key_mask: Bool[Tensor, "batch key_pos"]
    offset: int = 0
    packed: bool = False  # per-token tensors hold only the real tokens, [1, n_real, ...]
    key_positions: Int[Tensor, "batch key_pos"] = field(init=False)
    _visible: Optional[Tensor] = field(default=None, init=False, repr=False)
    _real_index: Optional[Tensor] = field(default=None, init=False, repr=False)
    _packed_positions: Optional[Tensor] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.key_positions = positions_from_mask(self.key_mask)

    @property
    def positions(self) -> Int[Tensor, "batch pos"]:
        """Position ids of this forward's tokens ([1, n_real] when packed)."""
        positions = self.key_positions[:, self.offset :]
        if not self.packed:
            return positions
        if self._packed_positions is None:
            self._packed_positions = self.pack(positions)
        return self._packed_positions

    @property
    def row_positions(self) -> Int[Tensor, "batch pos"]:
        """Each row's own position of this forward's tokens, [batch, pos] (unpacked)."""
        return self.key_positions[:, self.offset :]

    @property
    def real_index(self) -> Tensor:
        """Flat indices (into batch * pos) of this forward's real tokens, computed once."""
        if self._real_index is None:
            self._real_index = self.query_mask.flatten().nonzero().flatten()
        return self._real_index

    def pack(self, x: Tensor) -> Tensor:
        """[batch, pos, ...] -> [1, n_real, ...]: the real tokens of every row, row after row."""
        return x.flatten(0, 1).index_select(0, self.real_index)[None]

    def unpack(self, x: Tensor) -> Tensor:
        """[1, n_real, ...] -> [batch, pos, ...], zeros at the pads."""
        batch, pos = self.query_mask.shape
        out = x.new_zeros((batch * pos,) + tuple(x.shape[2:]))
        return out.index_copy(0, self.real_index, x[0]).view((batch, pos) + tuple(x.shape[2:]))

    @property
    def query_mask(self) -> Bool[Tensor, "batch pos"]:
        """Which of this forward's tokens are real."""
        return self.key_mask[:, self.offset :]

    @property
    def visible(self) -> Bool[Tensor, "batch 1 query_pos key_pos"]:
        """Causal, never onto a pad key; a pad query sees itself only (finite, and touches nothing real)."""
        if self._visible is None:
            n_key = self.key_mask.shape[1]
            q_idx = torch.arange(self.offset, n_key, device=self.key_mask.device)[:, None]
            k_idx = torch.arange(n_key, device=self.key_mask.device)[None, :]
            real = self.query_mask[:, :, None] & self.key_mask[:, None, :]
            self._visible = (((k_idx <= q_idx)[None] & real) | (k_idx == q_idx)[None])[:, None]
        return self._visible
