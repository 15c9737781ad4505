"""Distributed data parallel helpers: who am I, talk to the others, and who may write.

``torchrun --nproc_per_node=N -m workbench train ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``. Only an entry point reads them (``DistInfo.from_env()``, once) and passes the
result in: ``train(..., dist=info)``. A library call that is handed nothing is a world of
one, whatever the environment says, so a script that runs a grid of independent models
under torchrun (one per rank) needs no trick to keep each call single-process.
Everything here is a no-op for a world of one, so the training loop has a single code path.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Union

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(f"DistInfo needs world_size >= 1, 0 <= rank < world_size and local_rank >= 0; "
                             f"got rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}")

    @classmethod
    def from_env(cls) -> "DistInfo":
        """This process's place in a torchrun launch (a world of one without torchrun)."""
        return cls(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        """Only the main process writes checkpoints, metrics and progress bars."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def device_for(info: DistInfo, device: Union[str, torch.device] = "auto") -> torch.device:
    """This process's device: ``device`` ("auto": CUDA when available), one GPU per local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and info.enabled:
        dev = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(dev)
    return dev


@contextlib.contextmanager
def process_group(info: DistInfo, device: torch.device) -> Iterator[None]:
    """Be in the process group for the block (gloo on CPU, nccl on CUDA).

    Joins only when ``info`` spans several processes and no group exists yet, and then
    leaves it on the way out, error or not; a group the caller set up is left to the caller.
    """
    joined = info.enabled and not dist.is_initialized()
    if joined:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of ``value`` over all processes (``value`` itself for a world of one)."""
    if not info.enabled:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / info.world_size


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
