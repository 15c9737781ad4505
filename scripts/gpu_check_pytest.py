"""A pytest plugin for scripts/gpu_check.py: each test's outcome is appended to $GPU_CHECK_TEST_LOG (JSON
lines) as the test ends, so a run cut off at its time box still counts what finished.

    GPU_CHECK_TEST_LOG=tests.jsonl python -m pytest -p gpu_check_pytest ...   (scripts/ on PYTHONPATH)

Under pytest-xdist only the controlling process writes (it receives every worker's reports). One line per
report that pytest itself counts (a call's result; a setup or teardown that did not pass; a file that did
not collect), so the counts the check sums agree with pytest's own summary line: a test that fails in its
call and errors in its teardown is one failure and one error there, and here.
"""

import json
import os

import pytest


def _write(event: dict) -> None:
    path = os.environ.get("GPU_CHECK_TEST_LOG")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def pytest_collection_finish(session) -> None:
    if session.items:  # under xdist the controller collects nothing; the workers' count comes below
        _write({"collected": len(session.items)})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    _write({"collected": len(ids)})


def pytest_collectreport(report) -> None:
    if report.failed:  # a file that does not import: pytest's summary counts it as an error
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "error", "message": _message(report)})


def _message(report) -> str:
    """The failure's own words: the first ``E`` line of the traceback, else its last line."""
    lines = [line for line in report.longreprtext.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors[0] if errors else (lines[-1] if lines else ""))[:300]


def pytest_runtest_logreport(report) -> None:
    # A test's call result, or any phase that did not pass (a setup skip, a setup or teardown error).
    if report.when != "call" and report.passed:
        return
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when != "call" and report.failed:
        outcome = "error"
    _write({"nodeid": report.nodeid, "when": report.when, "outcome": outcome,
            "message": _message(report) if report.failed else ""})
