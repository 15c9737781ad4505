"""Small helpers shared by the analysis modules: token and unit labels, metrics, input checks.

Every analysis function takes token ids ``[batch, pos]`` (or a string when the model
has a tokenizer) and labels tokens the same way, so the tables and figures built from
them agree on what a token is called. Units are named the same way everywhere too:
``L1H4`` is head 4 of layer 1, ``L1 mlp`` a part of layer 1 (``unit_label`` writes them,
``parse_unit`` reads them back; the figures, the tables and the app all use these two).
"""

from __future__ import annotations

import numbers
import re
import weakref
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from workbench.utils import check_index, check_int, check_token_ids

Metric = Callable[[Tensor], Tensor]


def as_tokens(model, tokens: Union[str, Sequence[str], Tensor]) -> Int[Tensor, "batch pos"]:
    """Token ids [batch, pos] on the model's device, from ids or text (needs a tokenizer)."""
    if isinstance(tokens, Tensor):
        return model._check_tokens(tokens)
    return model._check_tokens(model.to_tokens(tokens))


_VOCAB_LABELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def vocab_labels(model) -> np.ndarray:
    """The label of every token id (``str_tokens`` of the whole vocabulary), plus a trailing ""
    that index -1 picks (a target that is none); read-only.

    Kept per tokenizer object (and vocabulary size): decoding a 49,152-token vocabulary one id at a
    time took 0.6 s on a busy 2-core machine, and the token-loss table, the logit lens and the
    suggested answer each asked for it on every call."""
    tok = getattr(model, "tokenizer", None)
    try:
        cached = _VOCAB_LABELS.get(tok) if tok is not None else None
    except TypeError:  # a tokenizer that cannot be weakly referenced (or hashed): not kept
        tok, cached = None, None
    if cached is not None and cached[0] == model.cfg.d_vocab:
        return cached[1]
    labels = np.array(str_tokens(model, torch.arange(model.cfg.d_vocab)) + [""], dtype=object)
    labels.flags.writeable = False
    if tok is not None:
        _VOCAB_LABELS[tok] = (model.cfg.d_vocab, labels)
    return labels


def token_ids(model, name: str, value, batch: int) -> Int[Tensor, " batch"]:
    """One ``name`` token id per row of a batch of ``batch`` rows: ``value`` as a token id or a
    single-token text for every row, or a [batch] tensor of ids."""
    if isinstance(value, str):
        value = model.to_single_token(value)
    if isinstance(value, (list, tuple)):
        value = torch.tensor(value)
    # No Python-style negatives: answer=-1 would silently pick the last vocabulary entry.
    ids = check_token_ids(name, value, model.cfg.d_vocab).to(model.device)
    if ids.ndim == 0:
        ids = ids.expand(batch)
    if ids.shape != (batch,):
        raise ValueError(f"{name} must be a token id or a [batch={batch}] tensor of ids, got shape {tuple(ids.shape)}")
    return ids


def row_ids(model, name: str, value, batch, n: int) -> Optional[Tensor]:
    """The ``name`` token id ("answer" or "wrong") of every row of ``batch`` (a ``PromptSetBatch``
    of data with ``n`` rows): ``value`` as one id or text for every row, or one id per row of the
    data (``token_ids``); None takes the batch's own (a PromptSet's column; None when it has none)."""
    if value is None:
        return getattr(batch, name, None)
    return token_ids(model, name, value, n)[batch.rows]


def str_tokens(model, ids: Union[Tensor, Sequence[int]]) -> list[str]:
    """Readable labels for token ids: the tokenizer's strings, else the ids as strings."""
    ids = ids.flatten().tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
    if getattr(model, "tokenizer", None) is None:
        return [str(i) for i in ids]
    return [s.replace("\n", "\\n") for s in model.to_str_tokens(ids)]


def unique_labels(labels: Sequence[str], positions: Optional[Sequence[numbers.Integral]] = None) -> list[str]:
    """Position-prefixed labels (``"3: the"``) so repeated tokens stay distinct on a plotly axis.

    ``positions``: the position of each label (default 0, 1, 2, ...).
    """
    positions = range(len(labels)) if positions is None else positions
    return [f"{int(p)}: {label}" for p, label in zip(positions, labels)]


def unit_label(layer: numbers.Integral, head: Optional[numbers.Integral] = None, part: Optional[str] = None) -> str:
    """``L1H4`` (a head), ``L1 mlp`` (a part of a layer) or ``L1`` (the layer)."""
    if head is not None and part is not None:
        raise ValueError("a unit is a head or a part of a layer, not both")
    if head is not None:
        return f"L{int(layer)}H{int(head)}"
    return f"L{int(layer)}" + (f" {part}" if part else "")


def head_label(head: numbers.Integral) -> str:
    """``H4``: a head on an axis whose other axis names the layer."""
    return f"H{int(head)}"


_UNIT = re.compile(r"L(\d+)(?:H(\d+)|\s+(\S.*))?")


def parse_unit(label: str) -> tuple[int, Optional[int], Optional[str]]:
    """(layer, head, part) of a ``unit_label``: ``L1H4`` -> (1, 4, None), ``L1 mlp`` -> (1, None, "mlp")."""
    match = _UNIT.fullmatch(label.strip())
    if match is None:
        raise ValueError(f"{label!r} is not a unit: write L<layer>H<head> (e.g. L1H4) or L<layer> <part> (e.g. L1 mlp)")
    layer, head, part = match.groups()
    return int(layer), None if head is None else int(head), part


def parse_head(label: str) -> int:
    """The head of a ``head_label`` (``H4`` -> 4)."""
    match = re.fullmatch(r"H(\d+)", label.strip())
    if match is None:
        raise ValueError(f"{label!r} is not a head label: write H<head> (e.g. H4)")
    return int(match.group(1))


def loss_metric(tokens: Tensor) -> Metric:
    """Mean next-token loss of ``tokens`` as a function of logits."""

    def metric(logits: Tensor) -> Tensor:
        from workbench.model import HookedDecoder

        return HookedDecoder.loss_fn(logits, tokens)

    return metric


def logit_diff_metric(
    answer: Union[int, Tensor], wrong: Union[int, Tensor], pos: int = -1
) -> Metric:
    """Mean over the batch of logit[answer] - logit[wrong] at position ``pos`` (negative: from the end).

    The ids and the position are checked against the logits the metric is given.
    """
    check_token_ids("answer", answer, None)  # the type and sign now; the vocabulary size once logits come
    check_token_ids("wrong", wrong, None)
    check_int("pos", pos)

    def metric(logits: Float[Tensor, "batch pos d_vocab"]) -> Tensor:
        at = logits[:, check_index("pos", pos, logits.shape[1], negative=True, of=f"{logits.shape[1]} positions")]
        idx = torch.arange(at.shape[0], device=at.device)
        a = check_token_ids("answer", answer, at.shape[-1]).to(at.device).expand(at.shape[0])
        w = check_token_ids("wrong", wrong, at.shape[-1]).to(at.device).expand(at.shape[0])
        return (at[idx, a] - at[idx, w]).mean()

    return metric


def check_device(model, what: str, held) -> None:
    """A ValueError naming both devices unless ``held`` (a module's parameters and buffers, or a tensor)
    is on ``model``'s device: else the first op that meets both raises a RuntimeError from inside torch
    (or, for an index, a message that names only one of them)."""
    tensors = [held] if isinstance(held, Tensor) else [*held.parameters(), *getattr(held, "buffers", list)()]
    devices = sorted({str(t.device) for t in tensors if t.device != model.device})
    if devices:
        raise ValueError(f"{what} {'is' if isinstance(held, Tensor) else 'are'} on {', '.join(devices)} and the model "
                         f"on {model.device}: move them to the model's device first (.to(model.device))")


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_layer(model, layer: int, allow_final: bool = False, name: str = "layer") -> int:
    """A block index (Python-style negatives count from the end), normalised to ``0..n_layers-1``."""
    n = model.cfg.n_layers + (1 if allow_final else 0)
    return check_index(name, layer, n, negative=True, of=f"n_layers={model.cfg.n_layers}")


def check_head(model, head: int, name: str = "head") -> int:
    return check_index(name, head, model.cfg.n_heads, of=f"n_heads={model.cfg.n_heads}")


def check_positions(name: str, positions: Optional[Sequence[int]], n_pos: int) -> Optional[list[int]]:
    """Position indices into a sequence of ``n_pos`` tokens (no negatives), or None for all."""
    if positions is None:
        return None
    if isinstance(positions, (str, bytes)) or not hasattr(positions, "__iter__"):
        raise ValueError(f"{name} must be a sequence of position indices, got {positions!r}")
    return [check_index(name, p, n_pos, of=f"{n_pos} positions") for p in positions]


ProgressLike = Union[bool, Callable[[int, int], object]]


class Progress:
    """A tqdm bar (``progress=True``) or calls of ``progress(done, total)`` (an app's own
    progress bar), behind one ``update``: how every long analysis reports how far it got."""

    def __init__(self, progress: ProgressLike, total: int, desc: str = "") -> None:
        self.callback = progress if callable(progress) else None
        self.done, self.total = 0, total
        self.bar = tqdm(total=total, disable=self.callback is not None or not progress, desc=desc)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def close(self) -> None:
        self.bar.close()
