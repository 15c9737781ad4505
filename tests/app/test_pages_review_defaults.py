"""What an outside review of the app found on the shipped checkpoints (AppTest, no browser): Circuit's
prompt pairs follow the chosen checkpoint, Circuit and Graph open on the sidebar's pick and say which
model they show, Build & train names the widgets it has, the launch hints name ./workbench.sh app, and
the Method boxes' labels are short (the full names in their help)."""

import pytest
from test_pages import messages

from ui import circuit as circuit_page
from ui import common

PLANTED = "planted-iit-induction"


def captions(at) -> str:
    return " | ".join(c.value for c in at.caption)


def sidebar_then(app, name: str, page: str):
    """The app after picking ``name`` in the sidebar (on Inspect) and then going to ``page``."""
    at = app("Inspect")
    at.selectbox(key="ckpt").set_value(name).run()
    at.session_state["page"] = page
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_circuit_pairs_follow_the_checkpoint_and_remember_the_users_value_per_checkpoint(app):
    at = app("Circuit")
    assert at.selectbox(key="circuit_ckpt").value == PLANTED
    assert at.slider(key="circuit_n").value == 8
    at.slider(key="circuit_n").set_value(5).run()
    at.selectbox(key="circuit_ckpt").set_value("stories-2026").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.slider(key="circuit_n").value == 8  # not set on stories-2026: its own default, not planted's 5
    at.selectbox(key="circuit_ckpt").set_value(PLANTED).run()
    assert at.slider(key="circuit_n").value == 5  # what the user set on this one


def test_circuit_method_labels_are_short_and_the_help_names_each_method(app):
    at = app("Circuit")
    box = at.selectbox(key="circuit_method")
    assert box.value == "eap"
    assert box.options == ["exact patching", "EAP", "EAP-IG", "ACDC"]
    for full in circuit_page.METHODS.values():
        assert full in box.help and full in at.selectbox(key="circuit_method_b").help


def test_circuit_and_graph_open_on_the_sidebars_checkpoint_and_say_which_they_show(app):
    at = sidebar_then(app, "induction-attn2l", "Circuit")
    assert at.selectbox(key="circuit_ckpt").value == "induction-attn2l"
    assert "own checkpoint picker" not in captions(at)
    at.selectbox(key="circuit_ckpt").set_value(PLANTED).run()  # now it differs from the sidebar's: said
    assert f"it shows **{PLANTED}**, not the sidebar's **induction-attn2l**" in captions(at)
    at.session_state["page"] = "Graph"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="graph_ckpt").value == "induction-attn2l"  # attention-only: offered here


def test_graph_says_why_it_does_not_show_the_sidebars_checkpoint(app):
    at = sidebar_then(app, "modular-grokking", "Graph")
    if "modular-grokking" in at.selectbox(key="graph_ckpt").options:
        pytest.skip("modular-grokking has a graph here")
    shown = at.selectbox(key="graph_ckpt").value
    assert f"This page shows **{shown}**: the sidebar's **modular-grokking** is not offered here" in captions(at)


def test_build_and_train_names_n_heads_not_a_d_head_box_it_lacks(app):
    at = app("Build & train")
    at.number_input(key="bt_n_heads").set_value(4).run()
    at.number_input(key="bt_d_model").set_value(130).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = messages(at)
    assert "d_head explicitly" not in shown, shown
    assert "choose n_heads dividing d_model (1, 2, 5, 10, 13, 26, 65, 130)" in shown, shown


def test_build_and_train_reads_the_errors_field_not_its_wording():
    """The page matched the library's words "set d_head explicitly" to know it lacked a d_head box;
    reworded, the page showed the library users' advice. It now reads ConfigError.field."""
    from ui.build_train import _page_reason
    from workbench.config import ConfigError

    sizes = {"d_model": 130, "n_heads": 4}
    reworded = ConfigError("d_head cannot be derived from d_model=130 and n_heads=4", field="d_head",
                           fields=("d_head", "d_model", "n_heads"))
    assert _page_reason(reworded, sizes) == ("d_model=130 is not divisible by n_heads=4: choose n_heads dividing "
                                             "d_model (1, 2, 5, 10, 13, 26, 65, 130), or another d_model.")
    quoting = ValueError("a plain error that says set d_head explicitly")  # not the library's d_head refusal
    assert _page_reason(quoting, sizes) == str(quoting)
    other = ConfigError("n_kv_heads=3 must divide n_heads=4", field="n_kv_heads")
    assert _page_reason(other, sizes) == str(other)


def test_the_launch_hints_name_the_workbench_launcher(app, tmp_path, monkeypatch):
    refusal = common.path_refusal(str(tmp_path), root=tmp_path / "ckpts", argv=[])
    assert "`./workbench.sh app -- --allow-any-path`" in refusal and "streamlit run" not in refusal
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "no-runs"))
    at = app("Sweeps")
    shown = messages(at)
    assert "`./workbench.sh app -- --runs DIR`" in shown and "streamlit run" not in shown, shown
