"""The Training page on the shipped grokking run (checkpoints/modular-grokking) under AppTest: it shows the
Fourier progress measures instead of head scores, and the step slider moves them."""

from pathlib import Path

import pytest
from test_pages_training_circuit import figures

REPO = Path(__file__).resolve().parents[2]
RUN = "modular-grokking"


def metric(at, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, [m.label for m in at.metric]
    return found[0]


def test_training_page_shows_the_fourier_measures_of_the_modular_run(checkpoints_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    if not (checkpoints_dir / RUN / "snapshots").is_dir():
        pytest.skip(f"{checkpoints_dir / RUN} is missing: make it with scripts/make_grokking_checkpoint.py")
    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=240)
    at.session_state["page"], at.session_state["training_run"] = "Training", RUN  # opened straight on the run
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="training_run").value == RUN
    steps = at.select_slider(key="training_step").options
    last, first = steps[-1], steps[0]
    shown = figures(at)
    losses = next(f for t, f in shown.items() if "losses over training" in t)
    names = {trace["name"] for trace in losses["data"]}
    assert {"train_loss", "test_loss", "restricted_loss", "excluded_loss"} <= names
    assert any(s.get("x0") == int(last) for s in losses["layout"]["shapes"])  # the step marked
    assert any(f"Embedding norm per frequency at step {last}" in t for t in shown)
    assert not any("head scores" in t.lower() for t in shown)  # not the induction view
    late = metric(at, "Test accuracy at this step")
    at.select_slider(key="training_step").set_value(first).run()
    assert not at.exception
    assert any(f"Embedding norm per frequency at step {first}" in t for t in figures(at))
    assert metric(at, "Test accuracy at this step") != late
