"""Modular addition ``a + b = c (mod p)``: the grokking setting (Power et al. 2022, Nanda et al. 2023).

Each sequence is the five tokens ``[a, +, b, =, c]`` with ids ``0..p-1`` for numbers, ``p``
for ``+`` and ``p + 1`` for ``=``. All ``p * p`` pairs are split once, by the seed, into a
training fraction and a held-out rest; only the answer position is supervised.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.data.base import Task
from workbench.utils import check_float, check_int, eval_mode


class ModularTask(Task):
    name = "modular"
    description = "a + b mod p as [a, +, b, =, c] (the grokking setting); metric: held-out accuracy"
    default_seq_len = 5
    fixed_seq_len = True

    def __init__(self, seed: int = 0, p: int = 113, train_fraction: float = 0.3):
        super().__init__(seed)
        # p * p pairs are held in memory (p = 4096 is 16.8M pairs, 268 MB).
        self.p = check_int("p", p, 2, 4096)
        self.train_fraction = check_float("train_fraction", train_fraction, 0, 1, lo_open=True, hi_open=True)
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
        return self.p + 2

    def options(self) -> dict[str, Any]:
        return {"seed": self.seed, "p": self.p, "train_fraction": self.train_fraction}

    def sequences(self, pairs: Int[Tensor, "batch 2"]) -> Int[Tensor, "batch pos"]:
        """``[a, +, b, =, (a + b) % p]`` for each pair."""
        a, b = pairs[:, 0], pairs[:, 1]
        plus, equals = torch.full_like(a, self.p), torch.full_like(a, self.p + 1)
        return torch.stack([a, plus, b, equals, (a + b) % self.p], dim=1)

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> Int[Tensor, "batch pos"]:
        if seq_len != 5:
            raise ValueError(f"modular sequences are 5 tokens long ([a, +, b, =, c]); got seq_len={seq_len}")
        # The val stream draws held-out pairs, so the logged val loss tracks generalisation.
        pool = self.test_pairs if split == "val" else self.train_pairs
        return self.sequences(pool[torch.randint(0, len(pool), (batch_size,), generator=generator)])

    def loss(self, model: Callable[..., Tensor], tokens: Int[Tensor, "batch pos"]) -> Tensor:
        return model(tokens, return_type="loss", loss_per_token=True)[:, -1].mean()

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
                    correct += int((model(seqs[:, :-1])[:, -1].argmax(-1) == seqs[:, -1]).sum())
                out[f"{split}_accuracy"] = correct / max(1, len(pairs))
        return out
