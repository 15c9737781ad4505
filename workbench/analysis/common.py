"""Small helpers shared by the analysis modules: token labels, metrics, input checks.

Every analysis function takes token ids ``[batch, pos]`` (or a string when the model
has a tokenizer) and labels tokens the same way, so the tables and figures built from
them agree on what a token is called.
"""

from __future__ import annotations

import numbers
from typing import Callable, Sequence, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

Metric = Callable[[Tensor], Tensor]


def as_tokens(model, tokens: Union[str, Sequence[str], Tensor]) -> Int[Tensor, "batch pos"]:
    """Token ids [batch, pos] on the model's device, from ids or text (needs a tokenizer)."""
    if isinstance(tokens, Tensor):
        return model._check_tokens(tokens)
    return model._check_tokens(model.to_tokens(tokens))


def str_tokens(model, ids: Union[Tensor, Sequence[int]]) -> list[str]:
    """Readable labels for token ids: the tokenizer's strings, else the ids as strings."""
    ids = ids.flatten().tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
    if getattr(model, "tokenizer", None) is None:
        return [str(i) for i in ids]
    return [s.replace("\n", "\\n") for s in model.to_str_tokens(ids)]


def unique_labels(labels: Sequence[str]) -> list[str]:
    """Position-prefixed labels (``"3: the"``) so repeated tokens stay distinct on a plotly axis."""
    return [f"{i}: {label}" for i, label in enumerate(labels)]


def loss_metric(tokens: Tensor) -> Metric:
    """Mean next-token loss of ``tokens`` as a function of logits."""

    def metric(logits: Tensor) -> Tensor:
        from workbench.model import HookedDecoder

        return HookedDecoder.loss_fn(logits, tokens)

    return metric


def logit_diff_metric(
    answer: Union[int, Tensor], wrong: Union[int, Tensor], pos: int = -1
) -> Metric:
    """Mean over the batch of logit[answer] - logit[wrong] at position ``pos``."""

    def metric(logits: Float[Tensor, "batch pos d_vocab"]) -> Tensor:
        at = logits[:, pos]
        idx = torch.arange(at.shape[0], device=at.device)
        a = torch.as_tensor(answer, device=at.device).expand(at.shape[0])
        w = torch.as_tensor(wrong, device=at.device).expand(at.shape[0])
        return (at[idx, a] - at[idx, w]).mean()

    return metric


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_layer(model, layer: int, allow_final: bool = False) -> int:
    n = model.cfg.n_layers + (1 if allow_final else 0)
    if not isinstance(layer, numbers.Integral) or not -n <= layer < n:
        raise ValueError(f"layer={layer!r} out of range for a model with n_layers={model.cfg.n_layers}")
    return int(layer) % n


def check_head(model, head: int) -> int:
    if not isinstance(head, numbers.Integral) or not 0 <= head < model.cfg.n_heads:
        raise ValueError(f"head={head!r} out of range: valid heads are 0..{model.cfg.n_heads - 1}")
    return head
