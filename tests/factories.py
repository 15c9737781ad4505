"""Small builders shared by the tests (a module of its own: tests/app has its own conftest.py,
and two modules named ``conftest`` cannot both be imported by name)."""


def tiny(**overrides):
    """A tiny seeded ModelConfig (d_model 32, 2 layers, 4 heads, vocab 50, ctx 24); overrides win."""
    import workbench as wb

    base = dict(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=24, seed=0)
    base.update(overrides)
    return wb.ModelConfig(**base)


class Trap:
    """A permanent hook that raises (Ctrl-C) or poisons the residual stream (NaN) at the n-th forward."""

    def __init__(self, at_call, action):
        self.calls, self.at_call, self.action = 0, at_call, action

    def __call__(self, resid, hook):
        self.calls += 1
        if self.calls == self.at_call:
            if self.action == "interrupt":
                raise KeyboardInterrupt
            return resid * float("nan")
        return resid


def python_env(**extra: str) -> dict:
    """The environment of a Python subprocess a test starts: the repo first on PYTHONPATH, then whatever the
    caller's PYTHONPATH held (packages installed beside the interpreter's, as scripts/gpu_check.py installs
    the ones a GPU machine lacks), then ``extra``."""
    import os
    from pathlib import Path

    path = [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def run_torchrun(args, timeout: int = 300) -> None:
    """``torchrun --nproc_per_node=2 -m workbench *args`` from the repo root; fails the test on a
    non-zero exit (with its stderr) or a hang (killing torchrun and its workers)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[1]
    env = python_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "workbench",
           *args]
    # Its own session, so a hang kills torchrun *and* its workers instead of orphaning them.
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun with 2 processes did not finish in {timeout} s")
    assert proc.returncode == 0, stderr[-3000:]


def json_paths(value, width: int, prefix=()):
    """Every key path into a parsed JSON document (the first ``width`` items of each list): the places a
    fuzz test damages."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, width, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:width]):
            yield from json_paths(v, width, prefix + (i,))
