"""Induction: random tokens in which a random segment recurs, the setting where induction heads form.

Training sequences are uniform random tokens; in each, one segment of random length
(``segment_min``..``segment_max``) recurs several times with random filler between the
copies, so a model can lower its loss only by copying "what came after this token last
time". Evaluation uses a layout the model never saw: plain repeated random tokens
``[r_1..r_n, r_1..r_n]`` with ``n`` longer than any training segment. A head that attends
from a repeated token to the token after its earlier occurrence scores high there only if it
is a real induction head and not a positional shortcut: trained with the repeat always at
the same offset (second half = first half), a 2-layer model with learned positions copies
perfectly through a positional head in layer 0, and at another offset copies nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.data.base import _EVAL_STREAM, Task, make_generator
from workbench.utils import check_int, check_seed, eval_mode


class InductionTask(Task):
    name = "induction"
    description = "random tokens with a recurring random segment; metric: loss on repeats vs first occurrences, induction score"

    def __init__(
        self,
        seed: int = 0,
        vocab: int = 64,
        seq_len: int = 64,
        segment_min: int = 6,
        segment_max: int = 16,
        gap_max: int = 10,
    ):
        super().__init__(seed)
        self.vocab, self.default_seq_len = check_int("vocab", vocab, 2), check_int("seq_len", seq_len, 2)
        self.segment_min = check_int("segment_min", segment_min, 2)
        self.segment_max = check_int("segment_max", segment_max, self.segment_min)
        self.gap_max = check_int("gap_max", gap_max, 0)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def options(self) -> dict[str, Any]:
        return dict(
            seed=self.seed, vocab=self.vocab, seq_len=self.default_seq_len,
            segment_min=self.segment_min, segment_max=self.segment_max, gap_max=self.gap_max,
        )

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> Int[Tensor, "batch pos"]:
        tokens = torch.randint(0, self.vocab, (batch_size, seq_len), generator=generator)
        for row in tokens:
            length = int(torch.randint(self.segment_min, self.segment_max + 1, (1,), generator=generator))
            length = min(length, max(2, seq_len // 2))
            segment = torch.randint(0, self.vocab, (length,), generator=generator)
            start = int(torch.randint(0, self.gap_max + 1, (1,), generator=generator))
            while start + length <= seq_len:
                row[start : start + length] = segment
                start += length + int(torch.randint(0, self.gap_max + 1, (1,), generator=generator))
        return tokens

    def repeated_tokens(self, batch_size: int, half_len: int, seed: Optional[int] = None) -> Int[Tensor, "batch pos"]:
        """Plain repeated random tokens ``[r, r]``, shape [batch, 2 * half_len] (the evaluation layout)."""
        batch_size, half_len = check_int("batch_size", batch_size, 1), check_int("half_len", half_len, 1)
        seed = check_seed("seed", seed, optional=True)
        gen = make_generator(self.seed if seed is None else seed, _EVAL_STREAM)
        first = torch.randint(0, self.vocab, (batch_size, half_len), generator=gen)
        return torch.cat([first, first], dim=1)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batch_size: int = 32, half_len: Optional[int] = None, seed: Optional[int] = None) -> dict[str, float]:
        """Loss on the first and the repeated half, and the best head's induction score."""
        # Two tokens per half at least, or the first half has no next-token loss to average.
        half_len = model.cfg.n_ctx // 2 if half_len is None else check_int("half_len", half_len, 2, model.cfg.n_ctx // 2)
        tokens = self.repeated_tokens(batch_size, half_len, seed).to(model.device)
        with eval_mode(model):
            losses = model(tokens, return_type="loss", loss_per_token=True)  # [batch, 2n-1]; index i predicts token i+1
            scores = induction_scores(model, tokens)
        best = scores.loc[scores["score"].idxmax()]
        return {
            "loss_first_half": float(losses[:, : half_len - 1].mean()),
            "loss_repeated_half": float(losses[:, half_len:].mean()),
            "induction_score_max": float(best["score"]),
            "best_layer": int(best["layer"]),
            "best_head": int(best["head"]),
        }


@torch.no_grad()
def induction_scores(model: torch.nn.Module, tokens: Int[Tensor, "batch pos"]) -> pd.DataFrame:
    """Per-head induction score on repeated tokens ``[r, r]``: one row per (layer, head).

    The score is the mean attention from each token of the second copy to the token right
    after its earlier occurrence (``key_pos = query_pos - n + 1``), so 1.0 is a perfect
    induction head and a head that ignores the repeat scores about 1 / position.
    """
    half_len = tokens.shape[1] // 2
    if tokens.shape[1] != 2 * half_len or not torch.equal(tokens[:, :half_len], tokens[:, half_len:]):
        raise ValueError("induction_scores needs repeated tokens [r, r]; build them with InductionTask.repeated_tokens")
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    rows = []
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # [batch, head, query_pos, key_pos]
        stripe = pattern.diagonal(offset=1 - half_len, dim1=-2, dim2=-1)  # query i attends key i - n + 1
        per_head = stripe[..., 1:].mean(dim=(0, -1))  # queries n..2n-1 (the first has no earlier next token)
        rows += [{"layer": layer, "head": h, "score": float(s)} for h, s in enumerate(per_head)]
    return pd.DataFrame(rows)
