"""Tokenizers saved with checkpoints: character-level, byte-level, BPE, words, and raw ids.

Five kinds: ``CharTokenizer`` (one id per character), ``ByteTokenizer`` (UTF-8 bytes),
``BPETokenizer`` (byte-level BPE), ``WordTokenizer`` (one id per word or punctuation
mark of a closed vocabulary, used by the synthetic ``stories`` grammar so that every name
is a single token) and ``IdTokenizer`` (text is the token ids themselves, ``3 17 5``: for
models of abstract-id tasks such as induction, which have no words).

Every tokenizer has ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``token_str(id) -> str`` (a readable label for plots), ``unknown_pieces(text) -> list[str]``
(what ``encode`` would turn into ``unk``), ``vocab_size``, ``pad_id`` and ``save(dir)``,
which writes ``tokenizer.json``; ``load_tokenizer(dir)`` restores whichever kind was saved.

``encode_checked(tokenizer, text, strict=...)`` is ``encode`` that never turns text into ``unk``
silently: it warns (``UnknownTokenWarning``) naming the pieces outside the vocabulary, or raises
with ``strict=True`` (the app refuses such a prompt the same way). ``model.to_tokens`` uses it.

``pad_id`` is the id ``model.to_tokens(texts, padding_side=...)`` fills short rows with. None
of our own tokenizers has a pad token, and adding one would grow the vocabulary past what
shipped checkpoints were trained with; so they reuse an existing id (``unk``, byte 0, BPE id 0)
and rely on the attention mask, which is what tells a pad from a real token everywhere.
BPE is trained locally with the ``tokenizers`` library; nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Iterable, Optional, Union

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_KINDS = ("char", "byte", "bpe", "word", "ids")  # the "kind" of every tokenizer.json we write


class CharTokenizer:
    """One token per character of a fixed alphabet; unseen characters map to ``unk``."""

    kind = "char"

    def __init__(self, chars: Iterable[str], unk: str = "\ufffd"):
        alphabet = sorted(set(chars) - {unk})
        self.unk = unk
        self.itos = [unk] + alphabet
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(set(text))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, 0) for c in text]

    def unknown_pieces(self, text: str) -> list[str]:
        """The characters of ``text`` outside the alphabet (each once, in order): they would encode as ``unk``."""
        return list(dict.fromkeys(c for c in text if c not in self.stoi))

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.itos[int(i)] for i in ids)

    def token_str(self, token_id: int) -> str:
        return self.itos[int(token_id)]

    @property
    def pad_id(self) -> int:
        """The ``unk`` id: padding reuses it, and the attention mask marks pads (see the module docstring)."""
        return 0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.itos[1:], "unk": self.unk}

    def save(self, directory: Union[str, Path], *, overwrite: bool = False) -> None:
        """Write ``tokenizer.json`` into ``directory`` (by rename). A ``tokenizer.json`` there is replaced
        only when it is one of ours (a Hugging Face model's is not): else ValueError, unless ``overwrite``."""
        from workbench.overwrite import read_json_dict, refuse_foreign, write_atomic

        target = Path(directory, TOKENIZER_FILE)
        refuse_foreign([target], lambda p: (read_json_dict(p) or {}).get("kind") in TOKENIZER_KINDS,
                       overwrite=overwrite, what="saving the tokenizer")
        write_atomic(target, json.dumps(self.to_dict(), ensure_ascii=False))


class ByteTokenizer:
    """UTF-8 bytes, 256 ids: every string is encodable; decoding replaces broken sequences."""

    kind = "byte"
    vocab_size = 256
    pad_id = 0  # the NUL byte; the attention mask marks pads

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def unknown_pieces(self, text: str) -> list[str]:
        """Always empty: every string is UTF-8 bytes."""
        return []

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        b = bytes([int(token_id)])
        return b.decode("utf-8") if token_id < 128 else f"<0x{int(token_id):02X}>"

    def to_dict(self) -> dict:
        return {"kind": self.kind}

    save = CharTokenizer.save


class BPETokenizer:
    """Byte-level BPE trained on a local corpus with Hugging Face ``tokenizers``."""

    kind = "bpe"

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def unknown_pieces(self, text: str) -> list[str]:
        """Always empty: byte-level BPE encodes every string."""
        return []

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids])

    def token_str(self, token_id: int) -> str:
        return self.decode([token_id])

    @property
    def pad_id(self) -> int:
        """The backend's padding id when it has one, else id 0; the attention mask marks pads."""
        padding = self.hf.padding
        return int(padding["pad_id"]) if padding else 0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.hf.to_str())}

    save = CharTokenizer.save


class WordTokenizer:
    """One id per word, punctuation mark or newline of a fixed vocabulary; others map to ``unk``.

    ``encode`` splits on whitespace and punctuation; ``decode`` joins with single spaces and
    no space before punctuation or around newlines, so canonical text (single spaces, as the
    ``stories`` grammar writes it) round-trips exactly.
    """

    kind = "word"
    _split = re.compile(r"\n|[\w']+|[^\w\s]")
    _no_space_before = set(".,!?;:")

    def __init__(self, words: Iterable[str], unk: str = "<unk>"):
        vocab = sorted(set(words) - {unk})
        self.unk = unk
        self.itos = [unk] + vocab
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @classmethod
    def from_text(cls, text: str) -> "WordTokenizer":
        return cls(cls._split.findall(text))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(w, 0) for w in self._split.findall(text)]

    def unknown_pieces(self, text: str) -> list[str]:
        """The words of ``text`` outside the vocabulary (each once, in order): they would encode as ``unk``."""
        return list(dict.fromkeys(w for w in self._split.findall(text) if w not in self.stoi))

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        for i in ids:
            word = self.itos[int(i)]
            if out and word not in self._no_space_before and word != "\n" and out[-1] != "\n":
                out.append(" ")
            out.append(word)
        return "".join(out)

    def token_str(self, token_id: int) -> str:
        return self.itos[int(token_id)]

    pad_id = CharTokenizer.pad_id

    def to_dict(self) -> dict:
        return {"kind": self.kind, "words": self.itos[1:], "unk": self.unk}

    save = CharTokenizer.save


class IdTokenizer:
    """Token ids written as text: ``"3 17, 5"`` encodes to [3, 17, 5] (spaces or commas between)."""

    kind = "ids"

    def __init__(self, vocab_size: int):
        if int(vocab_size) < 1:
            raise ValueError(f"vocab_size={vocab_size} must be at least 1")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        bad = self.unknown_pieces(text)
        if bad:
            raise ValueError(f"{bad[0]!r} is not a token id: ids are 0..{self.vocab_size - 1}")
        return [int(t) for t in text.replace(",", " ").split()]

    def unknown_pieces(self, text: str) -> list[str]:
        """What is not a token id below ``vocab_size`` (each once, in order)."""
        pieces = text.replace(",", " ").split()
        return list(dict.fromkeys(p for p in pieces if not (p.isdigit() and int(p) < self.vocab_size)))

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_str(self, token_id: int) -> str:
        return str(int(token_id))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    save = CharTokenizer.save


Tokenizer = Union[CharTokenizer, ByteTokenizer, BPETokenizer, WordTokenizer, IdTokenizer]


def unknown_pieces(tokenizer, text: str) -> list[str]:
    """The pieces of ``text`` the tokenizer cannot represent (they would become ``unk``).

    Every tokenizer here (and the Hugging Face one of ``workbench.interop``) answers with its
    ``unknown_pieces``; a byte-level tokenizer without the method encodes every string.
    """
    method = getattr(tokenizer, "unknown_pieces", None)
    return method(text) if method is not None else []


class UnknownTokenWarning(UserWarning):
    """Text held pieces outside the tokenizer's vocabulary, which encode as its ``unk`` token."""


def encode_checked(tokenizer, text: str, strict: bool = False) -> list[int]:
    """``tokenizer.encode(text)``, saying so when a piece of ``text`` is outside the vocabulary.

    Those pieces would become ``unk`` (a word tokenizer turns every unseen word into ``<unk>``):
    with ``strict=False`` a ``UnknownTokenWarning`` names them and the ids are returned anyway;
    with ``strict=True`` a ValueError names them and nothing is encoded.
    """
    bad = unknown_pieces(tokenizer, text)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        unk = getattr(tokenizer, "unk", "unk")
        size = getattr(tokenizer, "vocab_size", "?")
        message = (
            f"{len(bad)} piece(s) of {text[:60]!r}{'...' if len(text) > 60 else ''} are outside this "
            f"tokenizer's vocabulary ({size} tokens) and encode as {unk!r}: {shown}"
        )
        if strict:
            raise ValueError(message + ". Use only what the vocabulary holds (strict=True refuses the rest).")
        warnings.warn(message + " (strict=True raises instead)", UnknownTokenWarning, stacklevel=3)
    return tokenizer.encode(text)


def tokenizer_from_dict(data: dict, backend=None) -> Tokenizer:
    """The tokenizer ``data`` (a parsed ``tokenizer.json``) describes. ``backend``: the
    ``tokenizers.Tokenizer`` of a ``"bpe"`` or ``"hf"`` one, already parsed from the file (then
    ``data`` need not hold its ``"tokenizer"``)."""
    kind = data.get("kind")
    if kind == "word":
        return WordTokenizer(data["words"], unk=data.get("unk", "<unk>"))
    if kind == "char":
        return CharTokenizer(data["chars"], unk=data.get("unk", "\ufffd"))
    if kind == "byte":
        return ByteTokenizer()
    if kind == "ids":
        return IdTokenizer(data["vocab_size"])
    if kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(backend if backend is not None else HFTokenizer.from_str(json.dumps(data["tokenizer"])))
    if kind == "hf":  # the Hugging Face tokenizer of an imported model (workbench.interop)
        from workbench.interop.hf_tokenizer import HFTokenizer as ImportedTokenizer

        return ImportedTokenizer.from_dict(data, backend)
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds are ['bpe', 'byte', 'char', 'hf', 'ids', 'word']")


def load_tokenizer(directory: Union[str, Path]) -> Optional[Tokenizer]:
    """The tokenizer saved in ``directory``, or None when there is none."""
    path = Path(directory, TOKENIZER_FILE)
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        wrapped = _wrapped_backend(text)
        if wrapped is not None:
            return tokenizer_from_dict(*wrapped)
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
        return tokenizer_from_dict(data)
    except Exception as e:  # noqa: BLE001 - a damaged file: wrong types, missing keys, an HF parse error
        raise ValueError(f"{path} is not a usable tokenizer file ({type(e).__name__}: {e}); restore the "
                         f"{TOKENIZER_FILE} saved with the model") from None


# How save() writes a "bpe" or "hf" tokenizer.json: the kind, then the tokenizers library's own JSON
# (1.7 MB for SmolLM2's 49,152 tokens), then the small fields of HFTokenizer.to_dict, if any.
_WRAPPED_HEAD = re.compile(r'\{"kind": "(bpe|hf)", "tokenizer": ')
_WRAPPED_FIELDS = frozenset({"special_tokens", "add_special_tokens"})
_WRAPPED_TAIL = 1 << 16  # the small fields are searched for in this many characters at the end


def _wrapped_backend(text: str):
    """``(data, backend)`` for ``tokenizer_from_dict`` of a ``"bpe"``/``"hf"`` ``tokenizer.json`` as
    ``save`` writes it, or None for any other text (which the caller then parses whole, as before).

    The tokenizers library parses its own part straight from the file's text: parsing the whole
    file into Python and dumping that part back to a string for the library (what loading did
    before) took 0.1-0.3 s of opening SmolLM2, for the same tokenizer. The library's object ends at
    a ``}, "`` that starts the small fields (or at the closing brace when there are none): the
    first such cut whose remainder parses as those fields alone. A cut inside the library's object
    cannot (its remainder closes more brackets than it opens), and the library's parser is strict
    JSON and refuses trailing text, so the pieces are those ``json.loads`` of the whole file finds.
    Anything unexpected returns None, so an odd or damaged file fails with the same message as before.
    """
    head = _WRAPPED_HEAD.match(text)
    body = text.rstrip()
    if head is None or not body.endswith("}"):
        return None
    inner, rest = body[head.end():-1], {}
    start = max(head.end(), len(body) - _WRAPPED_TAIL)
    for cut in (m.start() for m in re.finditer(r'\}, "', body[start:])):
        try:
            fields = json.loads("{" + body[start + cut + 3:])
        except ValueError:
            continue
        if isinstance(fields, dict) and set(fields) <= _WRAPPED_FIELDS:
            inner, rest = body[head.end():start + cut + 1], fields
            break
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(inner)
    except Exception:  # noqa: BLE001 - not this layout after all: the whole-file parse reports what is wrong
        return None
    return {"kind": head.group(1), **rest}, backend
