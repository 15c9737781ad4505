"""Fixtures for the app tests: the shipped checkpoints folder and a fresh AppTest on a page.

The tests run on the shipped default checkpoint (checkpoints/stories-2026);
$WORKBENCH_TEST_CHECKPOINTS points them at another folder holding a ``stories-2026``.
"""

import os
import sys
from pathlib import Path

import pytest
from browser_kit import browser, page, server  # noqa: F401 (session fixtures for the browser tests)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `import ui` as app.py does when streamlit runs it
DEFAULT = "stories-2026"


@pytest.fixture(scope="session")
def checkpoints_dir() -> Path:
    root = Path(os.environ.get("WORKBENCH_TEST_CHECKPOINTS", REPO / "checkpoints"))
    if not (root / DEFAULT / "config.json").is_file():
        pytest.skip(f"the shipped default checkpoint {root / DEFAULT} is missing: make it with the "
                    "command that builds checkpoints/ (see docs/reference/checkpoints.md)")
    return root


@pytest.fixture
def app(checkpoints_dir, monkeypatch):
    """A function page -> AppTest that has run app.py once and then switched to ``page``."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))

    def open_page(name: str = "Inspect"):
        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        if name != "Inspect":
            at.session_state["page"] = name
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return open_page


def pytest_configure(config):
    config.addinivalue_line("markers", "page(name): the app page a browser test opens on")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item, so a fixture can tell whether its test failed
    (the browser tests save a screenshot then)."""
    outcome = yield
    setattr(item, f"rep_{call.when}", outcome.get_result())
