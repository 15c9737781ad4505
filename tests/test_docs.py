"""The documentation runs as written: every ```python block of README.md and of every page under
docs/ (blocks preceded by a line ``<!-- no-run: reason -->`` excepted, the reason said there), and
every tutorial under docs/tutorials/ top to bottom.

The blocks of one page run in order in one namespace, from the repository root, as a reader pasting
them one after another into a session would; the tutorials are plain scripts (jupytext percent
format), run with ``runpy`` in this process so that torch is imported once for all of them. The
strict site build (``./workbench.sh docs --build``) executes the tutorials again and takes minutes,
so it runs in .ci/run, not here.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import jaxtyping
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```+\s*python\s*$")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, no-run reason or None) of each ```python block of a markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m.group(1)), i
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        reason = NO_RUN.match(prev.strip())
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append((start + 1, "\n".join(body) + "\n", reason.group(1) if reason else None))
        i += 1
    return blocks


@contextlib.contextmanager
def _as_a_reader_runs_it():
    """Without the suite's jaxtyping shape checks, as a reader's session has them: they run in tests
    only, and cannot check the fake tensors ``model.compile()`` traces with (docs/reference/compiled.md)."""
    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", was)


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def test_the_block_reader_sees_fences_and_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("a\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n```python\nboom\n```\n"
                    "```bash\nls\n```\n    ```python\n    y = 2\n    ```\n")
    assert python_blocks(page) == [(2, "x = 1\n", None), (7, "boom\n", "needs a GPU"), (13, "y = 2\n", None)]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_a_page_runs_as_written(page, monkeypatch):
    blocks = python_blocks(page)
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for line, code, reason in blocks:
        if reason is not None:
            continue
        try:
            with warnings.catch_warnings(), _as_a_reader_runs_it():
                warnings.simplefilter("ignore")
                name = f"{page.relative_to(ROOT)}:{line}"
                # in linecache, as a file's source is: tracebacks show the line, and nnsight's trace
                # reads its with-block back from the source
                linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
                exec(compile(code, name, "exec"), namespace)
        except Exception as err:  # noqa: BLE001 - any failure of a documented example is the bug
            pytest.fail(f"{page.relative_to(ROOT)}, the block at line {line} fails as written: {type(err).__name__}: {err}")
        ran += 1
    if not blocks:
        pytest.skip(f"{page.relative_to(ROOT)} has no python block")
    if page.name == "README.md":
        assert ran >= 1, "the README's example must run (it is not marked no-run)"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


TUTORIALS = sorted((DOCS / "tutorials").glob("*.py"))


def test_there_is_a_tutorial_per_workflow():
    assert len(TUTORIALS) >= 8, [p.name for p in TUTORIALS]
    for path in TUTORIALS:
        text = path.read_text()
        assert text.startswith("# ---\n") and "format_name: percent" in text, f"{path.name}: not jupytext percent"
        assert "# %% [markdown]" in text and text.count("# %%") >= 3


# The app tour starts a Streamlit server and drives Chromium: slow, as the app's browser tests are.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if "app-tour" in p.name else p
                                  for p in TUTORIALS], ids=lambda p: p.name)
def test_tutorial_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(path), run_name="__main__")


def _moves_the_reader(code: str) -> list[str]:
    """The calls of ``code`` that change the reader's session: ``os.chdir`` (their working folder) or
    ``sys.path`` edits (imports from a checkout's folders, such as experiments/, that an installed
    workbench does not have)."""
    found = []
    for node in ast.walk(ast.parse(code)):
        target = node.func if isinstance(node, ast.Call) else node.targets[0] if isinstance(node, ast.Assign) else None
        text = ast.unparse(target) if target is not None else ""
        if text in ("os.chdir", "chdir") or text.startswith("sys.path"):
            found.append((node.lineno, f"line {node.lineno}: {text}"))
    return [text for _, text in sorted(found)]


def test_the_session_check_finds_a_chdir_and_a_sys_path_edit():
    code = "import os, sys\nos.chdir('/')\nsys.path.insert(0, 'experiments')\nsys.path = []\nprint(sys.path)\n"
    assert _moves_the_reader(code) == ["line 2: os.chdir", "line 3: sys.path.insert", "line 4: sys.path"]


def test_no_example_changes_the_readers_folder_or_import_path():
    """A tutorial or a page's example imports what it needs from workbench: it neither moves the
    reader's working folder nor adds a checkout's folder (experiments/) to the import path."""
    found = {p.name: _moves_the_reader(p.read_text()) for p in TUTORIALS}
    for page in pages():
        found |= {f"{page.relative_to(ROOT)}:{line}": _moves_the_reader(code) for line, code, _ in python_blocks(page)}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_tutorials_imports_work_from_any_folder(tmp_path):
    """Every module-level import of every tutorial, run by a fresh Python in an empty folder: only this
    checkout's package is on its path (PYTHONPATH), not the checkout's other folders."""
    lines = []
    for path in TUTORIALS:
        tree = ast.parse(path.read_text())
        lines += [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    code = "\n".join(dict.fromkeys(lines))
    assert "import workbench as wb" in code
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
