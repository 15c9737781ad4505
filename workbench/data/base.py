"""The Task interface every data source implements, and the seeding that makes batches reproducible.

A task is a seeded generator of token batches with a one-line ``description``, a
tokenizer (or None for tasks whose tokens are abstract ids), and its own ``evaluate``.
Batch ``step`` of a training run is a pure function of ``(task seed, step)``: resuming a
run, or splitting a global batch across DDP ranks and accumulation steps, needs nothing
but the step counter to reproduce the data exactly.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.utils import check_int, check_seed, eval_mode

# Seeds of training batches, validation batches and evaluation sets never collide.
_TRAIN_STREAM, _VAL_STREAM, _EVAL_STREAM = 0, 1, 2


def make_generator(seed: int, stream: int = _TRAIN_STREAM, index: int = 0) -> torch.Generator:
    """A CPU generator seeded from ``(seed, stream, index)`` (a fixed mix, stable across runs)."""
    mixed = (seed * 1_000_003 + stream * 7_919 + index * 104_729) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


class Task:
    """Base class: subclasses set ``name``, ``description``, ``vocab_size`` and implement ``sample``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    default_seq_len: int = 64
    fixed_seq_len: ClassVar[bool] = False  # True when every sequence has exactly default_seq_len tokens

    def __init__(self, seed: int = 0):
        self.seed = check_seed("seed", seed)
        self.tokenizer: Any = None

    # ---- what subclasses provide ------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> Int[Tensor, "batch pos"]:
        """``batch_size`` sequences of ``seq_len`` token ids drawn with ``generator`` from ``split``."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, **options: Any) -> dict[str, float]:
        """The task's own metrics of ``model`` (a plain dict of floats; higher or lower is named)."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The constructor arguments, so ``get_task(name, **task.options())`` rebuilds this task."""
        return {"seed": self.seed}

    # ---- shared behaviour ---------------------------------------------------------
    def batch(self, batch_size: int, seq_len: Optional[int] = None, *, step: int = 0, split: str = "train") -> Int[Tensor, "batch pos"]:
        """Batch number ``step`` of the ``train`` or ``val`` stream: the same ids on every call."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        stream = _TRAIN_STREAM if split == "train" else _VAL_STREAM
        batch_size = check_int("batch_size", batch_size, 1)
        seq_len = self.default_seq_len if seq_len is None else check_int("seq_len", seq_len, 1)
        step = check_int("step", step, 0)
        return self.sample(batch_size, seq_len, make_generator(self.seed, stream, step), split)

    def loss(self, model: Callable[..., Tensor], tokens: Int[Tensor, "batch pos"]) -> Tensor:
        """The training loss of ``model`` on ``tokens`` (next-token cross-entropy by default).

        ``model`` may be a DDP wrapper; tasks that supervise only some positions override this.
        """
        return model(tokens, return_type="loss")

    @torch.no_grad()
    def val_loss(self, model: torch.nn.Module, batch_size: int = 32, seq_len: Optional[int] = None, n_batches: int = 4) -> float:
        """Mean training loss over ``n_batches`` fixed validation batches."""
        check_int("n_batches", n_batches, 1)
        device = next(model.parameters()).device
        with eval_mode(model):
            losses = [float(self.loss(model, self.batch(batch_size, seq_len, step=i, split="val").to(device)))
                      for i in range(n_batches)]
        return sum(losses) / len(losses)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({args})"
