"""Timing shared by the benchmarks: contenders run in turns (A, B, C, A, B, C, ...), so that
load from other processes on a shared machine hits every contender alike; medians reported."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional


def interleaved(
    fns: dict[str, Callable],
    repeats: int,
    warmup: bool = True,
    sync: Callable[[], None] = lambda: None,
    outputs: Optional[dict] = None,
) -> dict[str, float]:
    """Median seconds of each callable over ``repeats`` rounds, after one warm-up call each
    (when ``warmup``). ``sync`` runs around each call (a CUDA synchronise); ``outputs``, when
    given, receives each callable's last result."""
    if warmup:
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            out = fn()
            sync()
            samples[name].append(time.perf_counter() - start)
            if outputs is not None:
                outputs[name] = out
    return {name: statistics.median(t) for name, t in samples.items()}
