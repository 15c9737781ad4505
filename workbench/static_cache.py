"""A static KV cache: decode steps of one fixed shape, so one compiled graph serves every token.

The dynamic cache (``workbench.model.KVCache``) hands each decode step the keys seen so far, so the
key axis grows by one per token and the position is a Python int: under ``torch.compile`` every
step is a new shape and a new constant. ``StaticKVCache`` keeps the same preallocated
[batch, kv_head, max_len, d_head] buffers but, once the prompt is in, a decode step

- writes its key and value in place at ``column``, a 0-dim long tensor (never a Python int),
- attends over the whole buffer with a [batch, 1, 1, max_len] visibility mask (the prompt's real
  tokens and every generated one up to ``column``),
- takes its positions (learned/sinusoidal tables, RoPE angles) from a [batch, 1] tensor,

so every step has the same shapes and the same Python values: dynamo traces one graph and every
later token (and every later generation of the same batch and buffer size) reuses it. The
per-token bookkeeping (``advance``) is three in-place tensor ops outside the graph; the buffers'
addresses never change, and are marked static for CUDA graphs (``mode="reduce-overhead"``), which
then replay one recorded step per token.

The prompt goes in as with the dynamic cache (one forward of the whole prompt, padded rows
included); ``start_decoding`` then switches the cache to fixed-shape steps.

What a hook sees differs in one place: a decode step's ``hook_attn_scores`` / ``hook_pattern``
are [batch, head, 1, max_len], the columns past ``column`` masked (scores -inf, pattern 0), where
the dynamic cache gives [batch, head, 1, n_key]; their first n_key columns are the same.

Not offered (a ValueError says so): sliding-window layers and MLA (their caches are not plain
position-indexed buffers), ALiBi and dynamic RoPE scaling (their biases and frequencies read the
length as a Python number).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.model import KVCache


def check_static_cache(cfg: ModelConfig) -> None:
    """ValueError when ``cfg`` has a part the static cache cannot decode with fixed shapes."""
    if cfg.attention != "mha":
        reason = f"attention={cfg.attention!r} keeps a latent, not keys and values"
    elif cfg.sliding_window is not None and any(cfg.layer_is_local(i) for i in range(cfg.n_layers)):
        reason = "sliding-window layers keep only the latest keys"
    elif cfg.positional == "alibi":
        reason = "ALiBi's bias is built from the length as a Python number"
    elif cfg.positional == "rope" and cfg.rope_scaling == "dynamic":
        reason = "dynamic RoPE scaling picks its frequencies from the length so far"
    else:
        return
    raise ValueError(f"static_cache=True cannot decode this model: {reason}; generate with static_cache=False "
                     "(the dynamic KV cache), which handles it")


class StaticStep:
    """What a fixed-shape decode step hands every layer in place of a ``Padding``.

    ``column`` [1]: the buffer column the step's key goes to; ``positions`` [batch, 1]: each row's
    position (its real tokens so far); ``visible`` [batch, 1, 1, max_len]: which columns it sees."""

    static = True
    packed = False
    query_mask = None  # every decode token is real: the FFN skips nothing

    def __init__(self, column: Tensor, positions: Tensor, visible: Tensor):
        self.column, self.positions, self.visible = column, positions, visible
        self.full = False  # set by ``advance`` once every column is written: a further step is refused

    @property
    def row_positions(self) -> Tensor:
        return self.positions


class StaticKVCache(KVCache):
    """A ``KVCache`` that decodes in fixed-shape steps after its prompt: see the module docstring."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype, max_len: int):
        check_static_cache(cfg)
        super().__init__(cfg, batch, device, dtype, max_len)
        self.step: Optional[StaticStep] = None
        self._held = 0  # positions held once decoding: counted here, so no step reads the column back
        for entry in self.entries:
            # zeros, not garbage: a masked column still enters the products (pattern 0 x value),
            # and NaN there would poison them
            entry.k.zero_()
            entry.v.zero_()
            if entry.k.is_cuda:  # CUDA graphs read the buffers in place instead of copying them in
                torch._dynamo.mark_static_address(entry.k)
                torch._dynamo.mark_static_address(entry.v)

    @property
    def length(self) -> int:
        """Positions held: the prompt's, then one more per ``advance`` (the entries' own ``length``
        stays the prompt's, a constant of the traced step)."""
        return self.entries[0].length if self.step is None else self._held

    def start_decoding(self) -> None:
        """Switch to fixed-shape steps once the prompt (``length`` positions) is in."""
        entry = self.entries[0]
        n, batch, room = self.length, entry.k.shape[0], entry.k.shape[2]
        device = entry.k.device
        if n >= room:
            raise ValueError(f"the static KV cache is full ({n} of {room} positions): nothing left to decode into")
        mask = self.attention_mask  # [batch, n] bool, or None when nothing is padded
        visible = torch.zeros(batch, room, dtype=torch.bool, device=device)
        visible[:, :n] = True if mask is None else mask
        visible[:, n] = True
        real = torch.full((batch,), n, device=device) if mask is None else mask.sum(dim=1)
        column = torch.tensor([n], device=device)
        self.step = StaticStep(column, real[:, None].long(), visible[:, None, None, :])
        self._held = n
        for entry in self.entries:
            entry.column = column

    def advance(self) -> None:
        """After a decode step: the next token's column, position and visible column, in place."""
        step = self.step
        self._held += 1
        if self._held >= step.visible.shape[-1]:  # a Python flag, False until then: no recompile per token
            step.full = True
        step.column.add_(1)
        step.positions.add_(1)
        step.visible.index_fill_(-1, step.column.clamp(max=step.visible.shape[-1] - 1), True)
