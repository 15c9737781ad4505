"""Analyses over training: any analysis mapped over a run's snapshots into one table with a step column.

    series = wb.load_series("runs/ind")
    scores = an.over_training(series, an.head_scores, kinds=("previous_token", "induction"))
    both = an.over_training(series, {"heads": an.head_scores, "task": task.evaluate})   # one pass, two tables
    viz.over_training_figure(scores)          # the best head per kind against step, the loss curve below

One snapshot's model is in memory at a time. Each result is kept in the series, per snapshot
and per analysis (the function and its arguments), so a later call with an analysis already
run loads nothing, and several analyses given together load each snapshot once. A snapshot
that fails to load (truncated since ``load_series`` read its header) is skipped with a warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, Union

import numpy as np
import pandas as pd
import torch

from workbench.analysis.common import Progress, ProgressLike
from workbench.analysis.graphs.graph import Graph
from workbench.snapshots import Series, SnapshotError

Analysis = Callable[..., Any]


def over_training(series: Series, analysis: Union[Analysis, Mapping[str, Analysis]], *, progress: ProgressLike = True,
                  **kwargs: Any) -> Union[pd.DataFrame, dict[str, pd.DataFrame]]:
    """``analysis(model, **kwargs)`` at every snapshot of ``series``, stacked with a ``step`` column first.

    ``analysis`` may return a DataFrame (its rows are kept), a dict (one row), a number
    (column ``value``) or an attribution ``Graph`` (its node table, ``Graph.to_frame``'s first; for
    why a head attended at each step, ``graphs.qk_training.qk_pairs`` returns the QK pairs' table). A mapping ``{name: analysis}`` (use ``functools.partial`` for
    arguments) runs them all in one pass and returns ``{name: DataFrame}``. The returned
    frames carry the run's loss curve in ``.attrs["history"]`` (columns as lists) for the figures. ``progress``:
    True for a tqdm bar, or ``progress(done, total)`` called after each snapshot (an app's bar).
    """
    if not isinstance(series, Series):
        raise ValueError(f"over_training needs a Series (wb.load_series(run_dir)), got {type(series).__name__}")
    if callable(analysis):
        analyses = {"": functools.partial(analysis, **kwargs) if kwargs else analysis}
    elif isinstance(analysis, Mapping) and analysis and all(callable(a) for a in analysis.values()):
        if kwargs:
            raise ValueError("with a mapping of analyses, give each its arguments with functools.partial, "
                             f"not as keywords ({sorted(kwargs)})")
        analyses = dict(analysis)
    else:
        raise ValueError("analysis must be a callable taking the model, or a non-empty {name: callable} mapping")
    keys = {name: _key(fn) for name, fn in analyses.items()}
    parts: dict[str, list[pd.DataFrame]] = {name: [] for name in analyses}
    skipped = []
    bar = Progress(progress, len(series), "over training")
    for snapshot in series:
        missing = [name for name in analyses if (snapshot.step, keys[name]) not in series.results]
        if missing:
            try:
                model = series.load(snapshot)
            except SnapshotError as e:
                skipped.append(f"{snapshot.path.name} ({e})")
                bar.update()
                continue
            with torch.no_grad():
                for name in missing:
                    series.results[(snapshot.step, keys[name])] = _as_frame(analyses[name](model), name or analysis)
            del model  # before the next one is built: one model in memory at a time
        for name in analyses:
            frame = series.results[(snapshot.step, keys[name])]
            parts[name].append(frame.assign(step=snapshot.step)[["step", *frame.columns]])
        bar.update()
    bar.close()
    if skipped:
        warnings.warn(f"over_training skipped {len(skipped)} snapshot(s) that failed to load: {'; '.join(skipped)}",
                      stacklevel=2)
    out = {}
    for name, frames in parts.items():
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step"])
        # The loss curve as plain columns, not a DataFrame: pandas compares attrs when it combines
        # frames (astype, concat), and a DataFrame there makes that comparison raise.
        frame.attrs["history"] = series.history.to_dict("list")
        frame.attrs["source"] = series.source
        out[name] = frame
    return out[""] if callable(analysis) else out


def _key(fn: Analysis) -> tuple:
    """What identifies an analysis for the cache: the function and its bound arguments."""
    if isinstance(fn, functools.partial):
        return (_key(fn.func), tuple(_freeze(a) for a in fn.args),
                tuple(sorted((k, _freeze(v)) for k, v in fn.keywords.items())))
    return (fn,)


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return ("array", tuple(value.shape), hash(np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor)
                                                             else value).tobytes()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _as_frame(result: Any, analysis: Any) -> pd.DataFrame:
    if isinstance(result, pd.DataFrame):
        return result.reset_index(drop=True)
    if isinstance(result, Graph):  # an attribution graph: its node table (kind, layer, pos, activation, influence)
        return result.to_frame()[0]
    if isinstance(result, Mapping):
        return pd.DataFrame([dict(result)])
    if isinstance(result, (int, float, np.number)) or (isinstance(result, torch.Tensor) and result.numel() == 1):
        return pd.DataFrame({"value": [float(result)]})
    name = getattr(analysis, "__name__", analysis)
    raise ValueError(f"analysis {name!r} returned a {type(result).__name__}; over_training needs a DataFrame, "
                     "a dict, a number or a Graph")
