"""Modular addition ``a + b = c (mod p)``: the grokking setting (Power et al. 2022, Nanda et al. 2023).

Two layouts of the same pairs:

* ``layout="plus"`` (the default): the five tokens ``[a, +, b, =, c]``, ids ``0..p-1`` for
  numbers, ``p`` for ``+`` and ``p + 1`` for ``=`` (vocabulary ``p + 2``);
* ``layout="paper"``: Nanda et al.'s ``[a, b, =, c]``, ``=`` is ``p`` (vocabulary ``p + 1``),
  and the loss is the cross-entropy over the ``p`` number logits only at the ``=`` position
  (the paper's ``d_vocab_out = p``), the model seeing ``[a, b, =]`` and never the answer.

All ``p * p`` pairs are split once, by the seed, into a training fraction and a held-out
rest; only the answer position is supervised. ``full_batch=True`` makes every training batch
the whole training set (the paper's full-batch gradient descent: ``batch_size`` must then be
the number of training pairs) and the validation loss the exact loss over every held-out pair.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from workbench.data.base import Task
from workbench.utils import check_float, check_int, eval_mode

LAYOUTS = ("plus", "paper")


class ModularTask(Task):
    name = "modular"
    description = "a + b mod p as [a, +, b, =, c] (the grokking setting); metric: held-out accuracy"
    default_seq_len = 5
    fixed_seq_len = True

    def __init__(self, seed: int = 0, p: int = 113, train_fraction: float = 0.3, layout: str = "plus",
                 full_batch: bool = False):
        super().__init__(seed)
        # p * p pairs are held in memory (p = 4096 is 16.8M pairs, 268 MB).
        self.p = check_int("p", p, 2, 4096)
        self.train_fraction = check_float("train_fraction", train_fraction, 0, 1, lo_open=True, hi_open=True)
        if layout not in LAYOUTS:
            raise ValueError(f"modular layout={layout!r}; valid layouts are {list(LAYOUTS)} "
                             "('plus': [a, +, b, =, c]; 'paper': Nanda et al.'s [a, b, =, c])")
        if not isinstance(full_batch, bool):
            raise ValueError(f"modular full_batch must be true or false, got {full_batch!r}")
        self.layout, self.full_batch = layout, full_batch
        self.default_seq_len = 5 if layout == "plus" else 4
        a, b = torch.meshgrid(torch.arange(self.p), torch.arange(self.p), indexing="ij")
        pairs = torch.stack([a.flatten(), b.flatten()], dim=1)
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(self.seed))
        n_train = max(1, int(round(train_fraction * len(pairs))))
        if n_train == len(pairs):  # the val stream and the held-out accuracy need at least one pair
            raise ValueError(f"train_fraction={train_fraction} leaves no held-out pair of the {len(pairs)} (p={p}); "
                             f"use a train_fraction below {1 - 1 / len(pairs):.4g}")
        self.train_pairs, self.test_pairs = pairs[order[:n_train]], pairs[order[n_train:]]

    @property
    def vocab_size(self) -> int:
        return self.p + (2 if self.layout == "plus" else 1)

    @property
    def equals(self) -> int:
        """The id of the ``=`` token, where the answer is read."""
        return self.p + 1 if self.layout == "plus" else self.p

    def options(self) -> dict[str, Any]:
        return {"seed": self.seed, "p": self.p, "train_fraction": self.train_fraction, "layout": self.layout,
                "full_batch": self.full_batch}

    def sequences(self, pairs: Int[Tensor, "batch 2"]) -> Int[Tensor, "batch pos"]:
        """``[a, +, b, =, (a + b) % p]`` (or ``[a, b, =, (a + b) % p]`` in the paper's layout) for each pair."""
        a, b = pairs[:, 0], pairs[:, 1]
        equals, answer = torch.full_like(a, self.equals), (a + b) % self.p
        if self.layout == "paper":
            return torch.stack([a, b, equals, answer], dim=1)
        return torch.stack([a, torch.full_like(a, self.p), b, equals, answer], dim=1)

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> Int[Tensor, "batch pos"]:
        if seq_len != self.default_seq_len:
            raise ValueError(f"modular sequences in the {self.layout!r} layout are {self.default_seq_len} tokens long; "
                             f"got seq_len={seq_len}")
        # The val stream draws held-out pairs, so the logged val loss tracks generalisation.
        pool = self.test_pairs if split == "val" else self.train_pairs
        if self.full_batch and split == "train":
            if batch_size != len(pool):
                raise ValueError(f"a full-batch modular task trains on all {len(pool)} training pairs at once; "
                                 f"set batch_size={len(pool)} (got {batch_size})")
            return self.sequences(pool)
        return self.sequences(pool[torch.randint(0, len(pool), (batch_size,), generator=generator)])

    def loss(self, model: Callable[..., Tensor], tokens: Int[Tensor, "batch pos"]) -> Tensor:
        if self.layout == "paper":
            return F.cross_entropy(answer_logits(model, tokens[:, :-1])[:, : self.p].float(), tokens[:, -1])
        return model(tokens, return_type="loss", loss_per_token=True)[:, -1].mean()

    @torch.no_grad()
    def val_loss(self, model: torch.nn.Module, batch_size: int = 32, seq_len: Optional[int] = None, n_batches: int = 4) -> float:
        """With ``full_batch``, the exact loss over every held-out pair; else the mean over sampled batches."""
        if not self.full_batch:
            return super().val_loss(model, batch_size, seq_len, n_batches)
        device = next(model.parameters()).device
        with eval_mode(model):
            return float(self.loss(model, self.sequences(self.test_pairs).to(device)))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batch_size: int = 4096) -> dict[str, float]:
        """Accuracy of the answer token on the training pairs and on the held-out pairs."""
        batch_size = check_int("batch_size", batch_size, 1)
        out = {}
        with eval_mode(model):
            for split, pairs in (("train", self.train_pairs), ("test", self.test_pairs)):
                correct = 0
                for chunk in pairs.split(batch_size):
                    seqs = self.sequences(chunk).to(model.device)
                    logits = answer_logits(model, seqs[:, :-1])
                    if self.layout == "paper":
                        logits = logits[:, : self.p]
                    correct += int((logits.argmax(-1) == seqs[:, -1]).sum())
                out[f"{split}_accuracy"] = correct / max(1, len(pairs))
        return out


def answer_logits(model: Callable[..., Tensor], prompts: Int[Tensor, "batch pos"]) -> Tensor:
    """The logits at the last position of ``prompts`` ([batch, d_vocab]).

    In a one-layer sequential model only the last position's residual after attention reaches
    those logits, so the forward stops at ``hook_resid_mid`` and the rest of the block
    (``Block.resume``) and the unembedding run on that position alone: the same numbers and
    gradients as the full forward, for about 40% of its arithmetic (full-batch training spends
    nearly all its time here). Any other model (or a DDP wrapper) runs the full forward.
    """
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "hooks") or cfg.n_layers != 1 or cfg.parallel_residual:
        return model(prompts)[:, -1]
    seen: dict[str, Tensor] = {}

    def stop(resid_mid: Tensor, hook: Any) -> None:
        seen["resid_mid"] = resid_mid
        raise _Stop

    try:
        with model.hooks(fwd_hooks=[("blocks.0.hook_resid_mid", stop)]):
            model(prompts)
    except _Stop:
        pass
    last = seen["resid_mid"][:, -1:]
    resid_post = model.blocks[0].resume(last, resid_mid=last)  # the pre-norm block reads resid_mid only
    return model(resid_post, start_at_layer=1)[:, -1]


class _Stop(Exception):
    """Raised by the hook that ends a forward at ``hook_resid_mid``."""
