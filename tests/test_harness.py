"""The test harness's own test: ``--device`` moves the models the tests build and nothing else.

The run is a nested pytest on a copy of ``tests/conftest.py`` with ``--device meta``, the one
device besides the CPU that every machine has, so the placement a CUDA run relies on is proven on a
CPU. A first CUDA run, whose harness made CUDA torch's default device, failed 661 of 1,118 tests on
the tests' own CPU generators and so hid the library's real CUDA status.
"""

import shutil
import subprocess
import sys
from pathlib import Path

from factories import python_env

TESTS = Path(__file__).resolve().parent

PROBE = '''
import torch
import workbench as wb
from factories import tiny
from workbench.interop.streaming import unfilled_model


def test_models_move_and_nothing_else(device):
    assert device == torch.device("meta")
    draws = torch.randn(3, generator=torch.Generator().manual_seed(0))  # a test's CPU generator
    assert draws.device.type == "cpu" and torch.empty(1).device.type == "cpu"
    model = wb.HookedDecoder(tiny())
    assert {p.device for p in model.parameters()} == {device}
    assert {b.device for b in model.buffers()} <= {device}
    # a loader's model, filled on the device the loader is given, is left to the loader
    assert unfilled_model(tiny()).device.type == "cpu"
'''


def test_device_option_moves_models_not_the_default_device(tmp_path):
    for name in ("conftest.py", "factories.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_probe.py").write_text(PROBE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--device", "meta",
                          "test_probe.py"], cwd=tmp_path, env=python_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
