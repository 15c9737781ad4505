"""./workbench.sh, the README's one entry point: with no argument it prints its usage, and a venv
that is set up is used as it is (no reinstall on every call)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _venv_is_the_scripts_own() -> str | None:
    """Why the script would rebuild the running venv (then the test must not call it), or None."""
    venv = Path(sys.prefix)
    stamp = venv / ".requirements.sha"
    if not stamp.exists():
        return f"{venv} was not made by ./workbench.sh (no .requirements.sha): calling it would rebuild the venv"
    want = hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()
    if stamp.read_text().strip() != want:
        return f"{venv} was made from another requirements.txt: calling ./workbench.sh would reinstall it"
    return None


def test_no_argument_prints_the_usage_and_reinstalls_nothing():
    why = _venv_is_the_scripts_own()
    if why:
        pytest.skip(why)
    env = {**os.environ, "WORKBENCH_VENV": sys.prefix}
    run = subprocess.run(["bash", str(ROOT / "workbench.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "./workbench.sh test [pytest args]" in run.stdout and "usage: python -m workbench" in run.stdout
    # The editable-install check once compared against "/" + path (it read $PWD after its own cd /) and
    # so reinstalled the package on every call.
    assert "installing this repository" not in run.stderr, run.stderr
