"""An outside review of the app on the real model (SmolLM2-135M-Instruct): each defect it found, checked
in a unit or under AppTest on the shipped checkpoints (the real model only where the defect needs it)."""

from pathlib import Path
from urllib.parse import parse_qsl, urlsplit


REPO = Path(__file__).resolve().parents[2]


# ---- 1. a Graph link naming a checkpoint the page cannot open ----------------------------------------
def test_a_graph_link_names_the_pretrained_model_by_its_short_name_and_reads_it_back():
    """The docs' link said ``graph_ckpt=smollm2-135m``, which the parser dropped (the picker's name is the
    long label), so the page opened stories-2026 silently. The builder now writes the short name and the
    parser maps it back to the picker's entry."""
    from ui import graph as page
    from ui.common import pretrained

    state = {"graph_ckpt": pretrained.LABEL, "graph_target": "top"}
    link = page.view_link(state)
    params = dict(parse_qsl(urlsplit(link).query, keep_blank_values=True))
    assert params["graph_ckpt"] == "smollm2-135m" == pretrained.NAME
    assert page.link_state(params, ["stories-2026", pretrained.LABEL]) == state
    assert page.link_refusal(params, ["stories-2026", pretrained.LABEL], {}) is None


def test_a_graph_link_to_a_missing_checkpoint_is_one_message_naming_it_and_what_is_offered():
    from ui import graph as page

    names = ["stories-2026", "planted-hand-induction"]
    said = page.link_refusal({"graph_ckpt": "nowhere-9"}, names, {})
    assert "`nowhere-9`" in said and "`stories-2026`" in said and "`planted-hand-induction`" in said
    said = page.link_refusal({"graph_ckpt": "plain"}, names, {"plain": "/x/plain"})
    assert "`plain`" in said and "no transcoder" in said and "none of that name" not in said
    assert page.link_refusal({"page": "Graph"}, names, {}) is None


def test_the_graph_page_opened_by_a_link_to_a_missing_checkpoint_says_so(checkpoints_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    at.query_params["page"] = "Graph"
    at.query_params["graph_ckpt"] = "no-such-model"
    at.query_params["graph_target"] = "top"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    said = [w.value for w in at.warning if "no-such-model" in w.value]
    assert len(said) == 1 and "stories-2026" in said[0], [w.value for w in at.warning]
    at.run()  # still there on the next run, while the fallback stays picked
    assert any("no-such-model" in w.value for w in at.warning)
