"""Loading a checkpoint, cached: ``st.cache_resource`` keyed by the directory and the modification
time of its weights, so re-saving a checkpoint reloads it and nothing else ever does. A directory
that does not load becomes a message in the page."""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import streamlit as st
import torch

import workbench as wb
from workbench.checkpoint import CONFIG_FILE, WEIGHTS_FILE, NonFiniteWeightsWarning, read_meta
from workbench.tokenizer import IdTokenizer


# How many times each checkpoint was really loaded (read from disk): the tests use it to
# check that changing a widget never reloads a model.
LOADS: Counter = Counter()
# What loading a checkpoint warned about (NaN or inf weights), by Checkpoint.key: every page shows it.
NOTICES: dict[tuple[str, int], list[str]] = {}


# ---- loading -----------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A loaded checkpoint: the model, its tokenizer, meta.json, and a cache key for analyses."""

    name: str
    path: str
    stamp: int
    model: Any
    tokenizer: Any
    meta: dict
    lock: threading.Lock = field(repr=False)

    @property
    def key(self) -> tuple[str, int]:
        """Hashable identity for ``st.cache_data`` functions: (directory, weights mtime)."""
        return (self.path, self.stamp)

    @property
    def cfg(self) -> wb.ModelConfig:
        return self.model.cfg


def weights_stamp(path: str) -> int:
    try:
        return Path(path, WEIGHTS_FILE).stat().st_mtime_ns
    except OSError:
        return 0


def app_device() -> str:
    """Where the app runs its models: $WORKBENCH_DEVICE when set (e.g. ``cpu`` to keep a GPU free),
    else CUDA when torch sees a GPU, else the CPU."""
    return os.environ.get("WORKBENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


@st.cache_resource(max_entries=8, show_spinner="Loading the checkpoint…")
def _load(path: str, stamp: int, device: str = "cpu") -> tuple[Any, Any, dict, threading.Lock]:
    from workbench.interop.hf import looks_like_hf_dir

    LOADS[path] += 1
    with warnings.catch_warnings(record=True) as caught:  # kept for the pages: NaN weights, see load_notices
        warnings.simplefilter("always", NonFiniteWeightsWarning)
        if looks_like_hf_dir(path):  # a Hugging Face model directory, imported with every hook
            model = wb.from_hf(path, device=device)
            tok = model.tokenizer
        else:
            model, tok = wb.load_checkpoint(path, device=device)
    NOTICES[(path, stamp)] = [str(w.message) for w in caught if issubclass(w.category, NonFiniteWeightsWarning)]
    for w in caught:
        if not issubclass(w.category, NonFiniteWeightsWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if tok is None:  # abstract-id tasks (induction, modular): prompts are typed as token ids
        tok = model.tokenizer = IdTokenizer(model.cfg.d_vocab)
    for p in model.parameters():
        p.requires_grad_(False)
    # One lock per model: hooks are attached to the shared module during a forward, so two
    # sessions must not run the same model at once.
    return model, tok, read_meta(path), threading.Lock()


def model_for(key: tuple[str, int]):
    """The cached model of a :attr:`Checkpoint.key`, for use inside ``st.cache_data`` functions."""
    model, _, _, lock = _load(*key, app_device())
    return model, lock


def load(path: str, name: Optional[str] = None, where=st) -> Optional[Checkpoint]:
    """Load (cached) the checkpoint at ``path``; on failure show why in ``where`` and return None."""
    from workbench.interop.hub import HFImportError, looks_like_hub_id, resolve_hf_source
    from workbench.utils import check_path

    try:
        p = check_path(path).expanduser()
    except ValueError as e:  # a name over 255 bytes: stat would raise OSError [Errno 36]
        where.error(f"Cannot open this path: {e}.")
        return None
    hub_id = not p.is_dir() and looks_like_hub_id(path)
    if hub_id:  # its snapshot in the Hugging Face cache (downloaded when online)
        try:
            p = resolve_hf_source(path)
        except HFImportError as e:
            where.error(f"Cannot open `{path}`: {e}")
            return None
    from ui.common import pretrained

    if not p.is_dir() and pretrained.is_pretrained(str(p)):  # chosen for the first time: convert it, once
        try:
            pretrained.convert(where)
        except Exception as e:  # a damaged wheel, a full disk: say so in the page
            where.error(f"Cannot convert {pretrained.LABEL}: {type(e).__name__}: {e}")
            return None
    if not p.is_dir():
        where.error(f"`{path}` is not a directory. Pick a checkpoint directory (it holds {CONFIG_FILE} and {WEIGHTS_FILE}) "
                    "or type a Hugging Face hub id such as gpt2.")
        return None
    experiment = experiment_run(p)
    if experiment is not None:
        where.error(f"`{path}` is a run of the experiment {experiment!r}, not a checkpoint: open it on the Sweeps page.")
        return None
    try:
        model, tok, meta, lock = _load(str(p.resolve()), weights_stamp(str(p)), app_device())
    except wb.CheckpointError as e:
        where.error(f"Cannot load this checkpoint: {e}")
        return None
    except Exception as e:  # anything else a damaged directory can raise
        where.error(f"Cannot load `{path}`: {type(e).__name__}: {e}")
        return None
    label = name or (path if hub_id else p.name)
    return Checkpoint(label, str(p.resolve()), weights_stamp(str(p)), model, tok, meta, lock)


def experiment_run(path: Path) -> Optional[str]:
    """The experiment's name when ``path`` holds an experiment run's config.json (what the
    scripts in experiments/ write), not a model's; None otherwise."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and "experiment" in config and "d_model" not in config:
        return str(config["experiment"])
    return None
