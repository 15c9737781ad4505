"""A Hugging Face fast tokenizer behind the workbench tokenizer interface.

``HFTokenizer`` wraps the ``tokenizers.Tokenizer`` that backs every HF *fast* tokenizer (a
``BPETokenizer`` subclass: both hold a ``tokenizers.Tokenizer`` as ``.hf``), so
``model.to_tokens`` / ``to_str_tokens`` / ``generate(str)`` work on imported models, and the
tokenizer saves with our checkpoints (``tokenizer.json`` of kind ``"hf"``, restored by
``workbench.tokenizer.tokenizer_from_dict``). Encoding goes through the backend's post-processor,
so ids equal ``AutoTokenizer(...)(text)["input_ids"]`` (Llama's BOS included; GPT-2 adds none).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from workbench.tokenizer import BPETokenizer

# Special-token attributes of a transformers tokenizer that survive a save/load through us.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class HFTokenizer(BPETokenizer):
    """encode/decode/token_str/vocab_size/save over a ``tokenizers.Tokenizer``; special tokens kept."""

    kind = "hf"

    def __init__(self, backend: Any, special_tokens: Optional[dict] = None, add_special_tokens: bool = True):
        super().__init__(backend)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_transformers(cls, tokenizer: Any) -> "HFTokenizer":
        """Wrap a loaded ``transformers`` tokenizer; it must be a fast (Rust-backed) one."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{type(tokenizer).__name__} is a slow (Python) tokenizer; the workbench needs a fast one. "
                "Convert it with transformers (AutoTokenizer.from_pretrained(dir, use_fast=True)) and save "
                "it so the directory has a tokenizer.json"
            )
        special = {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKENS}
        return cls(backend, {k: str(v) for k, v in special.items() if v is not None})

    def to_transformers(self) -> Any:
        """A ``transformers.PreTrainedTokenizerFast`` with the same vocabulary and special tokens."""
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self.hf.to_str()), **self.special_tokens)

    def token_id(self, name: str) -> Optional[int]:
        """Id of a special token by role (``"eos_token"``, ...), or None when the tokenizer has none."""
        token = self.special_tokens.get(name)
        return None if token is None else self.hf.token_to_id(token)

    @property
    def pad_id(self) -> int:
        """The model's pad token; without one (GPT-2, Llama) its EOS, else BOS, else id 0.

        Reusing an id keeps the vocabulary (and the checkpoint) as it is: the attention mask,
        not the id, tells a pad from a real token.
        """
        for name in ("pad_token", "eos_token", "bos_token"):
            token_id = self.token_id(name)
            if token_id is not None:
                return token_id
        return super().pad_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_piece(self, text: str) -> list[int]:
        """``text``'s ids without the special tokens ``encode`` adds (Llama's BOS): for answer tokens."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "tokenizer": json.loads(self.hf.to_str()),
            "special_tokens": self.special_tokens,
            "add_special_tokens": self.add_special_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict, backend: Any = None) -> "HFTokenizer":
        """The tokenizer a ``to_dict`` describes; ``backend``: its ``tokenizers.Tokenizer``, already
        parsed from the file (``workbench.tokenizer.load_tokenizer``), instead of ``data["tokenizer"]``."""
        from tokenizers import Tokenizer

        return cls(
            backend if backend is not None else Tokenizer.from_str(json.dumps(data["tokenizer"])),
            data.get("special_tokens", {}),
            data.get("add_special_tokens", True),
        )


def load_hf_tokenizer(directory: Union[str, Path]) -> Optional[HFTokenizer]:
    """The tokenizer of a Hugging Face model directory, or None when it has none."""
    directory = Path(directory)
    if not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return HFTokenizer.from_transformers(AutoTokenizer.from_pretrained(str(directory)))
