"""Distributed data parallel helpers: who am I, talk to the others, and who may write.

``torchrun --nproc_per_node=N -m workbench train ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; ``setup()`` reads them and joins the process group (gloo on CPU, nccl on
CUDA). Without torchrun everything here is a no-op for a world of one, so the training
loop has a single code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Only the main process writes checkpoints, metrics and progress bars."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto") -> tuple[DistInfo, torch.device]:
    """Join the process group when launched by torchrun, and pick this process's device."""
    info = DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and info.enabled:
        dev = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(dev)
    if info.enabled and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return info, dev


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


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
