"""Checkpoints: a directory of safetensors weights and JSON, written atomically.

    model.safetensors   the weights (tied weights stored once)
    config.json         the ModelConfig
    tokenizer.json      the tokenizer, when there is one
    meta.json           format version, library version, step, metrics, anything JSON

Loading never unpickles; every way a checkpoint can be broken raises ``CheckpointError``
with one message that says what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from workbench.config import FORMAT_VERSION, ModelConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
META_FILE = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt, or from an incompatible version."""


def check_replaceable(path: Union[str, Path]) -> Path:
    """Raise CheckpointError unless ``path`` is absent, empty, or an earlier checkpoint / model directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; choose another output path")
    if path.is_dir() and any(path.iterdir()) and not (path / CONFIG_FILE).exists():
        raise CheckpointError(
            f"{path} is a non-empty directory that is not a checkpoint; refusing to replace it "
            "(choose a new or empty output directory)"
        )
    return path


def atomic_write_dir(path: Union[str, Path], write: Any) -> Path:
    """Call ``write(tmp_dir)`` then move ``tmp_dir`` to ``path``; the old contents survive a failure.

    An existing ``path`` is replaced only when it is empty or an earlier write of this kind (it
    holds a ``config.json``): ``--out notes/`` must never wipe a folder of the user's files.
    """
    path = check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        # mkdtemp makes a private (0700) directory; a checkpoint is ordinary shared data.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        for f in tmp.rglob("*"):
            f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
        backup = None
        if path.exists():
            backup = path.parent / f".{path.name}.old-{os.getpid()}-{time.time_ns()}"
            os.replace(path, backup)
        os.replace(tmp, path)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_checkpoint(
    model: torch.nn.Module,
    path: Union[str, Path],
    tokenizer: Any = None,
    *,
    step: Optional[int] = None,
    metrics: Optional[dict] = None,
    meta: Optional[dict] = None,
    extra_files: Optional[dict[str, Union[str, bytes]]] = None,
) -> Path:
    """Write ``model`` (and its tokenizer) to the directory ``path``, replacing it atomically.

    ``extra_files`` maps file names to contents written beside the weights (e.g. a metrics
    CSV or a training state saved as safetensors by the caller).
    """
    from workbench import __version__

    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    info = {
        **(meta or {}),  # first, so a caller's meta cannot overwrite the format version or step
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "step": step,
        "metrics": metrics or {},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in extra_files or {}:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"extra file name {name!r} must be a relative path inside the checkpoint")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        model.cfg.to_json(tmp / CONFIG_FILE)
        (tmp / META_FILE).write_text(json.dumps(info, indent=2, default=str) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, content in (extra_files or {}).items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content if isinstance(content, bytes) else content.encode())

    return atomic_write_dir(path, write)


def read_meta(path: Union[str, Path]) -> dict:
    """meta.json of a checkpoint ({} when absent)."""
    meta_path = Path(path, META_FILE)
    if not meta_path.exists():
        return {}
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is not valid JSON ({e}); the checkpoint is corrupt") from None


def load_config(path: Union[str, Path]) -> ModelConfig:
    config_path = Path(path, CONFIG_FILE)
    if not config_path.exists():
        raise CheckpointError(f"{path} is not a checkpoint: {CONFIG_FILE} is missing")
    try:
        return ModelConfig.from_dict(json.loads(config_path.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e}); the checkpoint is corrupt") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{config_path} does not describe a valid model: {e}") from None


def load_checkpoint(
    path: Union[str, Path],
    device: Union[str, torch.device, None] = None,
    *,
    fold_ln: bool = False,
    center_writing_weights: bool = False,
    center_unembed: bool = False,
    fold_value_biases: bool = False,
):
    """Load ``(model, tokenizer)`` from a directory written by ``save_checkpoint``.

    The tokenizer is None when the checkpoint has none. The model is in eval mode. The four
    switches (all off: the weights as saved) run ``model.process_weights`` after loading.
    """
    from workbench.model import HookedDecoder
    from workbench.tokenizer import load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist (or is not a directory)")
    meta = read_meta(path)
    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}, newer than this library's "
            f"{FORMAT_VERSION}: upgrade the workbench to load it"
        )
    cfg = load_config(path)
    weights = path / WEIGHTS_FILE
    if not weights.exists():
        raise CheckpointError(f"{path} is not a complete checkpoint: {WEIGHTS_FILE} is missing")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{weights} is truncated or corrupt ({e}); re-save or re-train it") from None
    with torch.device("meta"):
        model = HookedDecoder(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    problems += [
        f"{k}: config expects {expected[k]}, file has {got[k]}" for k in sorted(set(expected) & set(got)) if expected[k] != got[k]
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} problems)" if len(problems) > 6 else "")
        raise CheckpointError(f"{path}: weights do not match {CONFIG_FILE}: {shown}")
    model = HookedDecoder(cfg)
    model.load_state_dict(state, strict=True)
    try:
        model.tokenizer = load_tokenizer(path)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the tokenizer file is corrupt ({e})") from None
    if fold_ln or center_writing_weights or center_unembed or fold_value_biases:
        model.process_weights(fold_ln, center_writing_weights, center_unembed, fold_value_biases)
    if device is not None:
        model.to(device)
    model.eval()
    return model, model.tokenizer
