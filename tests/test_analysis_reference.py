"""The reference batch for mean and resample ablation: the checkpoint's own task's validation
text when meta.json names a task that reads no files, else shuffles of the prompt; a path named
in meta.json is never followed."""

import pytest
import torch
from factories import tiny

import workbench as wb
import workbench.data.text
from workbench.analysis import reference_batch, task_from_meta
from workbench.data import get_task

STORIES = {"task": "stories", "task_options": {"seed": 0, "heldout_fraction": 0.2}}


@pytest.fixture(scope="module")
def model():
    return wb.HookedDecoder(tiny(d_vocab=get_task("stories").vocab_size))


def _is_shuffle_of(batch: torch.Tensor, ids) -> bool:
    return all(sorted(row) == sorted(ids) for row in batch.tolist())


def test_the_tasks_own_validation_text(model):
    ids = tuple(range(3, 13))
    batch = reference_batch(model, STORIES, ids, rows=5)
    assert batch.shape == (5, 10) and batch.dtype == torch.long and not _is_shuffle_of(batch, ids)
    expected = get_task("stories", **STORIES["task_options"]).batch(5, 10, step=0, split="val")
    assert torch.equal(batch, expected)
    assert torch.equal(reference_batch(model, STORIES, ids, rows=5), batch)  # the same every time


@pytest.mark.parametrize("meta", [
    {"task": "text", "task_options": {"path": "/"}},
    {"task": "stories", "task_options": {"corpus_dir": "/tmp"}},
    {"task": "stories", "task_options": {"heldout_fraction": "../x"}},
    {"task": "stories", "task_options": ["not", "a", "dict"]},
    {},
    None,
])
def test_paths_in_meta_are_never_followed(model, meta, monkeypatch):
    def no_reading(*args, **kwargs):
        raise AssertionError("a path named in meta.json was read")

    monkeypatch.setattr(workbench.data.text, "read_corpus", no_reading)
    monkeypatch.setattr(workbench.data.text.Path, "rglob", no_reading)
    ids = tuple(range(3, 13))
    with pytest.raises(ValueError):
        task_from_meta(meta)
    batch = reference_batch(model, meta, ids, rows=4)
    assert batch.shape == (4, 10) and _is_shuffle_of(batch, ids)
    assert not all(row == list(ids) for row in batch.tolist())  # shuffled, not copies


def test_a_task_that_fails_on_its_own_files_or_does_not_fit_falls_back(model, monkeypatch):
    ids = tuple(range(3, 13))
    small = wb.HookedDecoder(tiny(d_vocab=8))  # the stories vocabulary does not fit in 8 ids
    assert _is_shuffle_of(reference_batch(small, STORIES, (1, 2, 3, 4), rows=3), (1, 2, 3, 4))
    monkeypatch.setattr("workbench.data.get_task", lambda *a, **k: (_ for _ in ()).throw(PermissionError("denied")))
    batch = reference_batch(model, STORIES, ids, rows=2)
    assert batch.shape == (2, 10) and _is_shuffle_of(batch, ids)
    with pytest.raises(ValueError, match="rows"):
        reference_batch(model, STORIES, ids, rows=0)
