"""Reference batches for mean and resample ablation: what "an average input" is for a model.

Mean ablation replaces an activation by its mean over other inputs, and resample ablation
by another input's; the natural "other inputs" are the validation split of the task the
model was trained on, which a checkpoint's meta.json names (``task``, ``task_options``).
A meta.json can come from anywhere (an uploaded checkpoint, say), so the task is rebuilt
only when that reads no files: a task option that names a path is never followed, and the
``text`` task, which always reads a corpus (and whose vocabulary could have changed since
training), is never rebuilt. Without a usable task the reference is shuffles of the prompt.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

# Task options that name files or folders; a value that looks like a path counts too.
PATH_OPTIONS = ("path", "file", "dir", "folder", "root", "corpus")


def task_from_meta(meta: Any):
    """The task a checkpoint's meta.json names, built only when that reads no files; ValueError otherwise."""
    from workbench.data import get_task

    meta = meta if isinstance(meta, dict) else {}
    name, options = meta.get("task"), meta.get("task_options", {})
    if not isinstance(name, str) or not isinstance(options, dict):
        raise ValueError("meta.json names no task")
    names_a_file = any(word in str(k).lower() for k in options for word in PATH_OPTIONS) or any(
        isinstance(v, str) and ("/" in v or "\\" in v or v.startswith(("~", "."))) for v in options.values())
    if name == "text" or names_a_file:
        raise ValueError(f"task {name!r} would read files named in meta.json; they are not followed")
    return get_task(name, **options)


def reference_batch(model, meta: Any, ids: Sequence[int], rows: int = 16, seed: int = 0) -> Int[Tensor, "rows pos"]:
    """``rows`` sequences as long as ``ids`` for mean and resample ablation of a prompt ``ids``.

    The validation split of the task ``meta`` (a checkpoint's meta.json) names, when it can
    be rebuilt without reading files (see ``task_from_meta``) and its sequences fit the
    model; else ``rows`` shuffles of ``ids`` (seeded), which keep the prompt's token
    statistics but not its order.
    """
    n_pos = len(ids)
    if rows < 1 or n_pos < 1:
        raise ValueError(f"rows={rows} and len(ids)={n_pos} must both be at least 1")
    try:
        return _task_batch(model, meta, n_pos, rows)
    except (KeyError, TypeError, ValueError, OSError):  # OSError: a task's own files missing or unreadable
        gen = torch.Generator().manual_seed(seed)
        base = torch.tensor(list(ids), dtype=torch.long)
        return torch.stack([base[torch.randperm(n_pos, generator=gen)] for _ in range(rows)])


def reference_source(model, meta: Any, ids: Sequence[int], rows: int = 16) -> str:
    """What ``reference_batch`` (same arguments) draws, in words: the task's validation text, or
    ``rows`` shuffles of the prompt."""
    try:
        _task_batch(model, meta, len(ids), rows)
        return f"{rows} sequences of the {meta['task']!r} task's validation text"
    except (KeyError, TypeError, ValueError, OSError):
        return f"{rows} shuffles of the prompt itself (this model names no task whose text could be rebuilt)"


def _task_batch(model, meta: Any, n_pos: int, rows: int) -> Int[Tensor, "rows pos"]:
    """``rows`` validation sequences of the task ``meta`` names; ValueError (or the task's own error) when
    it cannot be used."""
    task = task_from_meta(meta)
    if task.fixed_seq_len and task.default_seq_len != n_pos:
        raise ValueError("the task's sequences have another length")
    batch = task.batch(rows, n_pos, step=0, split="val")
    if tuple(batch.shape) != (rows, n_pos) or batch.min() < 0 or batch.max() >= model.cfg.d_vocab:
        raise ValueError("the task's tokens do not fit this model")
    return batch.long().cpu()
