"""Timing shared by the benchmarks: contenders run in turns (A, B, C, A, B, C, ...), so that
load from other processes on a shared machine hits every contender alike; medians reported."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional

import torch


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


def add_model_args(parser: argparse.ArgumentParser, d_model: int, vocab: int, batch: int, pos: int) -> None:
    """The flags of a benchmark on a random model: its size, the batch, repeats, threads, device."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--pos", type=int, default=pos)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def random_model(args: argparse.Namespace) -> Any:
    """The seeded random model those flags describe, in eval mode on ``args.device`` (threads set)."""
    import workbench as wb

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = wb.ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, d_vocab=args.vocab,
                         n_ctx=max(args.pos, 64), seed=0)
    return wb.HookedDecoder(cfg).to(args.device).eval()
