"""Shared test fixtures: tiny seeded configs, CPU only."""

import os

import pytest
import torch

# Two cores on CI: keep intra-op threads from oversubscribing when pytest runs alone.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def tiny(**overrides):
    """A tiny ModelConfig (d_model 32, 2 layers) for tests; overrides win."""
    import workbench as wb

    base = dict(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=24, seed=0)
    base.update(overrides)
    return wb.ModelConfig(**base)


@pytest.fixture
def tiny_cfg():
    return tiny()
