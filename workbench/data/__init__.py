"""Tasks: seeded generators of token batches, each with a one-line description and its own metric.

    from workbench.data import TASKS, get_task
    task = get_task("induction", seed=0)               # or "stories", "modular", "text"
    tokens = task.batch(32, 64, step=0)                # [batch, pos]; the same ids for the same step
    metrics = task.evaluate(model)                     # dict of floats, the task's own metric
    task.tokenizer                                     # None for abstract-id tasks

Task-specific helpers for analysis:
    get_task("induction").repeated_tokens(batch, half_len)     # [r, r] random repeats
    workbench.data.induction.induction_scores(model, tokens)   # DataFrame layer, head, score
    get_task("stories").ioi_prompts(n)                # PromptBatch: tokens, corrupted, correct, wrong, positions
    get_task("stories").possession_prompts(n)
    workbench.data.stories.answer_metrics(model, batch)        # accuracy, logit_diff, top1

Real text with no download: the standard library's docstrings
    workbench.data.stdlib.stdlib_text(["argparse"])  # TEXT_MODULES: the 24 modules of the real-model studies

Prompt datasets (prompts of any length, known answers, metadata), batched with padding:
    PromptSet.from_csv(path) / from_jsonl / from_records / from_dataframe / from_task(task)
"""

from __future__ import annotations

from typing import Any

from workbench.data.base import Task, make_generator
from workbench.data.induction import InductionTask, induction_scores
from workbench.data.modular import ModularTask
from workbench.data.prompts import PromptSet, PromptSetBatch
from workbench.data.stdlib import TEXT_MODULES, stdlib_docs, stdlib_text
from workbench.data.stories import PromptBatch, StoriesTask, answer_metrics
from workbench.data.text import TextTask

TASKS: dict[str, type[Task]] = {
    "induction": InductionTask,
    "stories": StoriesTask,
    "modular": ModularTask,
    "text": TextTask,
}


def get_task(name: str, **options: Any) -> Task:
    """The task ``name`` built with ``options`` (its constructor's keyword arguments)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks are {sorted(TASKS)}")
    return TASKS[name](**options)


def checkpoint_task(meta: dict, tokenizer: Any = None, name: Any = None, options: Any = None, where: Any = "") -> Task:
    """The task a checkpoint was trained on (its ``meta``: task and task_options), or ``name``
    with ``options`` layered over the recorded ones when it is the same task; a ``text`` task
    gets the checkpoint's own tokenizer. ``where`` names the checkpoint in the error."""
    name = name or meta.get("task")
    if name is None:
        raise ValueError(f"{where} records no task; pass --task NAME")
    merged = dict(meta.get("task_options", {})) if name == meta.get("task") else {}
    merged.update(dict(options or {}))
    if name == "text" and tokenizer is not None:
        merged["tokenizer"] = tokenizer
    return get_task(name, **merged)


def describe_tasks() -> dict[str, str]:
    """``{name: one-line description}`` for every task."""
    return {name: cls.description for name, cls in TASKS.items()}


__all__ = [
    "TASKS", "get_task", "checkpoint_task", "describe_tasks", "Task", "make_generator", "InductionTask", "StoriesTask",
    "ModularTask", "TextTask", "PromptBatch", "answer_metrics", "induction_scores", "PromptSet", "PromptSetBatch",
    "TEXT_MODULES", "stdlib_docs", "stdlib_text",
]
