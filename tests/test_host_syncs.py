"""Host syncs per forward: on a GPU every read of a tensor's value on the host (``.item()``, ``int(t)``,
``bool(t)``, ``.tolist()``) waits for every queued kernel, so the host cannot run ahead of the chip. They
are counted on the CPU, where they show as ATen's ``_local_scalar_dense``, so no GPU is needed to see them
(benchmarks/host_overhead.py reports them against transformers)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import workbench as wb


class CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_token_range_check_reads_the_tokens_once():
    model = wb.HookedDecoder(wb.ModelConfig(d_model=32, n_layers=3, n_heads=2, d_vocab=50, n_ctx=16, seed=0)).eval()
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    counter = CountSyncs()
    with counter:
        model._check_token_range(tokens)
    assert counter.n == 1
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\); got range \[-1, 7\]"):
        model._check_token_range(torch.tensor([[3, -1, 7]]))
    with pytest.raises(ValueError, match=r"got range \[0, 50\]"):
        model._check_token_range(torch.tensor([[0, 50]]))
    model._check_token_range(torch.zeros(1, 0, dtype=torch.long))  # nothing to check
