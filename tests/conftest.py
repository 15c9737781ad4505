"""Shared test fixtures: tiny seeded configs, CPU only."""

import os

import pytest
import torch
from factories import tiny

# Two cores on CI: keep intra-op threads from oversubscribing when pytest runs alone.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_cfg():
    return tiny()
