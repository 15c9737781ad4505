"""What every component family shares: registry lookup with one clear error for an unknown
key, and biases that are either learned or fixed zeros."""

from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn


def pick(registry: Mapping[str, Any], key: str, family: str) -> Any:
    """Return ``registry[key]``, or raise a ValueError that lists the valid keys."""
    try:
        return registry[key]
    except KeyError:
        raise ValueError(f"unknown {family} {key!r}; valid choices are {sorted(registry)}") from None


def add_bias(module: nn.Module, name: str, shape: tuple, learned: bool) -> None:
    """A zero bias: a parameter when ``learned``, else a non-persistent zero buffer, so the TL
    weight names (``b_O``, ``b_in``, ...) exist either way and checkpoints hold only real weights."""
    if learned:
        module.register_parameter(name, nn.Parameter(torch.zeros(shape)))
    else:
        module.register_buffer(name, torch.zeros(shape), persistent=False)
        module._fixed_zero_biases = getattr(module, "_fixed_zero_biases", frozenset()) | {name}


def bias_term(module: nn.Module, name: str) -> Optional[Tensor]:
    """The bias ``name`` as a matmul should add it: None for a fixed zero, so ``F.linear`` runs a plain
    matmul instead of first copying the zeros into its whole output and accumulating onto them (a few
    percent of each projection of a bias-free model on the CPU). So an edit of a fixed zero (in place
    or through ``.data``) changes nothing the forward computes, as it is not saved by a checkpoint
    either: a bias to edit or learn needs ``bias=True`` / ``qkv_bias=True``."""
    return None if name in getattr(module, "_fixed_zero_biases", ()) else getattr(module, name)
