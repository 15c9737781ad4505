"""Text: any local UTF-8 file or folder of files, tokenized and split into train / validation.

A folder is read recursively in sorted order (hidden files skipped); the last
``val_fraction`` of the token stream is validation. The tokenizer is trained on the
training part only (BPE with Hugging Face ``tokenizers``, locally) or is character- or
byte-level; a tokenizer object can be passed instead, e.g. the one saved with a checkpoint
when a run is resumed. Batches are random windows of the stream.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Union

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.data.base import Task
from workbench.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer
from workbench.utils import check_float, check_int, eval_mode

TOKENIZER_KINDS = ("char", "byte", "bpe")


def read_corpus(path: Union[str, Path]) -> str:
    """The UTF-8 text of a file, or of every non-hidden file under a folder (sorted, newline-joined)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"text path {path} does not exist; pass a UTF-8 file or a folder of them")
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"folder {path} contains no files")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text ({e}); convert it or remove it from the folder") from None
    return "\n".join(texts)


class TextTask(Task):
    name = "text"
    description = "a local UTF-8 file or folder, tokenized (char, byte or BPE) and split into train / val; metric: val loss, bits per byte"
    default_seq_len = 128

    def __init__(self, seed: int = 0, path: Union[str, Path, None] = None, tokenizer: Any = "char", vocab_size: int = 1024, val_fraction: float = 0.1):
        super().__init__(seed)
        if path is None:
            raise ValueError("the text task needs path=FILE_OR_FOLDER (e.g. --task-option path=notes.txt)")
        check_float("val_fraction", val_fraction, 0, 1, lo_open=True, hi_open=True)
        check_int("vocab_size", vocab_size, 1)
        if isinstance(tokenizer, str) and tokenizer not in TOKENIZER_KINDS:
            raise ValueError(f"unknown tokenizer {tokenizer!r}; valid choices are {list(TOKENIZER_KINDS)}")
        self.path, self.val_fraction, self.vocab = str(path), float(val_fraction), int(vocab_size)
        text = read_corpus(path)
        split_at = int(len(text) * (1 - val_fraction))
        train_text, val_text = text[:split_at], text[split_at:]
        if isinstance(tokenizer, str):
            self.tokenizer_kind = tokenizer
            if tokenizer == "char":
                self.tokenizer = CharTokenizer.from_text(train_text)
            elif tokenizer == "byte":
                self.tokenizer = ByteTokenizer()
            else:
                self.tokenizer = BPETokenizer.train([train_text], vocab_size=self.vocab)
        else:
            self.tokenizer, self.tokenizer_kind = tokenizer, tokenizer.kind
        self.train_ids = torch.tensor(self.tokenizer.encode(train_text), dtype=torch.long)
        self.val_ids = torch.tensor(self.tokenizer.encode(val_text), dtype=torch.long)
        self.val_bytes = len(val_text.encode("utf-8"))
        if len(self.train_ids) < 2 or len(self.val_ids) < 2:
            raise ValueError(f"{path} is too short to split into train and validation ({len(text)} characters)")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def options(self) -> dict[str, Any]:
        return dict(seed=self.seed, path=self.path, tokenizer=self.tokenizer_kind, vocab_size=self.vocab, val_fraction=self.val_fraction)

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train") -> Int[Tensor, "batch pos"]:
        ids = self.train_ids if split == "train" else self.val_ids
        if len(ids) < seq_len:
            raise ValueError(f"the {split} split has {len(ids)} tokens, fewer than seq_len={seq_len}; use a shorter seq_len or more text")
        starts = torch.randint(0, len(ids) - seq_len + 1, (batch_size,), generator=generator)
        return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, seq_len: int = 0, max_windows: int = 64) -> dict[str, float]:
        """Loss over consecutive validation windows, its perplexity, and bits per UTF-8 byte.

        ``seq_len`` 0 means the model's n_ctx; windows are capped at the validation split's length.
        """
        check_int("max_windows", max_windows, 1)
        seq_len = min(check_int("seq_len", seq_len, 0, model.cfg.n_ctx) or model.cfg.n_ctx, len(self.val_ids))
        if seq_len == 1:  # a next-token loss needs two tokens per window
            raise ValueError("seq_len must be 0 (the model's n_ctx) or an integer in [2, n_ctx], got 1")
        n = min(max_windows, max(1, (len(self.val_ids) - 1) // (seq_len - 1)))
        windows = torch.stack([self.val_ids[i * (seq_len - 1) : i * (seq_len - 1) + seq_len] for i in range(n)
                               if i * (seq_len - 1) + seq_len <= len(self.val_ids)])
        with eval_mode(model):
            loss = float(model(windows.to(model.device), return_type="loss"))
        tokens_per_byte = len(self.val_ids) / max(1, self.val_bytes)
        return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "bits_per_byte": loss * tokens_per_byte / math.log(2)}
