"""The Circuit page on the real model (SmolLM2-135M-Instruct, which records no task): it offers the
English IOI pairs, a few by default, and opens without running a method (that waits for Run).
The model is opened once here, by the app's own loader."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def circuit_app(checkpoints_dir, monkeypatch):
    """An AppTest of app.py on the Circuit page (not yet run); a skip where the real model is not converted."""
    from streamlit.testing.v1 import AppTest

    from ui.common import pretrained

    folder = pretrained.cache_dir()
    if folder is None or not pretrained.converted(folder):
        pytest.skip("the pretrained model is not converted here (the app would convert it: 15 s, not in a test)")
    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    return AppTest.from_file(str(REPO / "app.py"), default_timeout=240)


def test_the_circuit_page_offers_english_ioi_pairs_on_the_real_model(checkpoints_dir, monkeypatch):
    from ui import circuit as page
    from ui.common import pretrained

    at = circuit_app(checkpoints_dir, monkeypatch)
    at.session_state["page"] = "Circuit"
    at.session_state["circuit_ckpt"] = pretrained.LABEL
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not [i.value for i in at.info if "no prompt set" in i.value]
    assert at.selectbox(key="circuit_source").value == page.TEXT_IOI
    assert at.slider(key="circuit_n").value == page.TEXT_IOI_PAIRS == 4
    assert any("pairs of" in c.value and "IOI" in c.value for c in at.caption)
    assert any("Press **Run**" in i.value for i in at.info)


def test_switching_circuit_to_the_real_model_gives_its_own_few_pairs(checkpoints_dir, monkeypatch):
    """The review's path: Circuit opens on a planted model (8 pairs), then the real model is picked.
    A setdefault kept the planted model's 8 there; the real model's default is 4 (TEXT_IOI_PAIRS)."""
    from ui import circuit as page
    from ui.common import pretrained

    at = circuit_app(checkpoints_dir, monkeypatch)
    at.session_state["page"] = "Circuit"
    at.run()
    assert at.selectbox(key="circuit_ckpt").value == page.DEFAULT and at.slider(key="circuit_n").value == 8
    at.selectbox(key="circuit_ckpt").set_value(pretrained.LABEL).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="circuit_source").value == page.TEXT_IOI
    assert at.slider(key="circuit_n").value == page.TEXT_IOI_PAIRS == 4
