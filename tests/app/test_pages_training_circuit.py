"""The Training and Circuit pages under AppTest, on the shipped checkpoints.

Training: the run with snapshots opens at its last step, the slider moves every at-step
figure (titles and content), a comparison adds the second run aligned by step, a checkpoint
without snapshots says so. Circuit: a method runs and draws its circuit with the AUROC
against the known one, a second method runs beside it, a selected node opens its attention
and DLA, induction-attn2l shows its shipped circuit.json, and a click replays no computation.
"""

import json

import base64

import numpy as np
import pytest

from ui import circuit, common, training
from workbench.checkpoint import read_meta


def figures(at) -> dict[str, dict]:
    out = {}
    for chart in at.get("plotly_chart"):
        fig = json.loads(chart.proto.spec)
        title = fig.get("layout", {}).get("title", {})
        out[title.get("text", "") if isinstance(title, dict) else str(title)] = fig
    return out


def titled(at, part: str) -> dict:
    found = [fig for title, fig in figures(at).items() if part in title]
    assert found, f"no figure titled *{part}* among {list(figures(at))}"
    return found[0]


def array(value) -> np.ndarray:
    """A figure's array as sent to the browser: a list (of lists), or base64 with dtype and shape."""
    if isinstance(value, dict) and "bdata" in value:
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).astype(float)
        shape = [int(n) for n in str(value.get("shape", len(flat))).split(",")]
        return flat.reshape(shape)
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return np.stack([array(row) for row in value])
    return np.asarray([[np.nan if v is None else v for v in row] for row in value], dtype=float)


def messages(at) -> str:
    return " | ".join(str(e.value) for e in [*at.warning, *at.error, *at.info])


# ---- Training -------------------------------------------------------------------------------------
def test_training_opens_on_the_run_with_snapshots_at_its_last_step(app):
    at = app("Training")
    assert at.selectbox(key="training_run").value == "induction-attn2l"
    assert at.select_slider(key="training_step").value == 1500
    shown = list(figures(at))
    for part in ("head scores and loss over training", "Loss, step 1500 marked", "Head scores at step 1500",
                 "Attention L0H0 at step 1500", "Logit lens at step 1500"):
        assert any(part in t for t in shown), (part, shown)
    over = titled(at, "over training")
    assert [s["x0"] for s in over["layout"]["shapes"]] == [1500]  # the step marked on the phase-change figure


def test_training_slider_moves_every_figure_to_the_snapshot(app):
    at = app("Training")
    late = titled(at, "Head scores at step 1500")
    late_attention = titled(at, "Attention L0H0 at step 1500")
    at.select_slider(key="training_step").set_value(600).run()
    assert not at.exception
    early = titled(at, "Head scores at step 600")
    assert titled(at, "Loss, step 600 marked")["layout"]["shapes"][0]["x0"] == 600
    assert titled(at, "over training")["layout"]["shapes"][0]["x0"] == 600
    # Before the phase change (README: best induction score 0.02 at step 600) no head is an induction head.
    def z(fig, kind="heatmap"):
        return [array(t["z"]) for t in fig["data"] if t.get("type") == kind]

    assert max(np.nanmax(a) for a in z(early)) < max(np.nanmax(a) for a in z(late))
    attention = titled(at, "Attention L0H0 at step 600")
    assert not np.allclose(z(attention)[0], z(late_attention)[0], equal_nan=True)


def test_training_compares_two_runs_aligned_by_step(app, checkpoints_dir, tmp_path, monkeypatch):
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(checkpoints_dir / "induction-attn2l", runs / "copy")  # a second run (the same weights)
    monkeypatch.setenv("WORKBENCH_RUNS", str(runs))
    at = app("Training")
    assert "runs/copy" in at.selectbox(key="training_compare").options
    at.selectbox(key="training_compare").set_value("runs/copy").run()
    assert not at.exception, [e.value for e in at.exception]
    both = titled(at, "aligned by step")
    names = [t["name"] for t in both["data"]]
    assert "induction-attn2l: induction" in names and "runs/copy: induction" in names
    a, b = (next(t for t in both["data"] if t["name"] == f"{r}: induction") for r in ("induction-attn2l", "runs/copy"))
    assert a["y"] == b["y"]  # the same weights: the same scores at every step
    assert "its snapshot nearest to 1500" in " ".join(figures(at))


def test_training_says_when_a_run_has_no_snapshots(app):
    at = app("Training")
    at.selectbox(key="training_run").set_value("stories-2026").run()
    assert not at.exception
    assert "has no snapshots" in messages(at) and "log:24" in messages(at)
    assert not figures(at)


def test_training_helpers_find_runs_with_snapshots(checkpoints_dir, tmp_path):
    (tmp_path / "runs" / "a" / "snapshots").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "snapshots" / "snapshots.json").write_text("{}")
    (tmp_path / "runs" / "b").mkdir()
    found = training.list_runs(checkpoints_dir, tmp_path / "runs")
    assert "induction-attn2l" in found and "runs/a" in found and "runs/b" not in found
    assert training.has_snapshots(found["induction-attn2l"]) and not training.has_snapshots(found["stories-2026"])


# ---- Circuit --------------------------------------------------------------------------------------
def test_circuit_runs_a_method_and_scores_it_against_the_known_circuit(app):
    at = app("Circuit")
    assert at.selectbox(key="circuit_ckpt").value == "planted-iit-induction"
    assert "Press **Run**" in messages(at)
    known = titled(at, "Known circuit of planted-iit-induction: 5 edges")
    assert [c[0] for c in known["data"][-1]["customdata"]] == ["embed", "L0H2", "L1H1", "logits"]
    at.selectbox(key="circuit_method").set_value("acdc")
    at.selectbox(key="circuit_method_b").set_value("eap-ig")
    at.button(key="circuit_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    acdc, eap_ig = titled(at, "ACDC (greedy pruning): 5 edges"), titled(at, "EAP-IG (integrated gradients)")
    assert acdc["layout"]["clickmode"] == "event+select" and eap_ig
    captions = " ".join(c.value for c in at.caption)
    assert "Edge AUROC against the known circuit: **1.000**" in captions  # ACDC recovers the planted circuit
    assert "share" in captions and "Jaccard" in captions
    faithful = [m.value for m in at.metric if m.label == "Faithfulness"]
    assert faithful[0] == "1.00"


def test_circuit_node_selection_opens_attention_and_dla_without_rerunning(app, monkeypatch):
    at = app("Circuit")
    at.selectbox(key="circuit_method").set_value("acdc")
    at.button(key="circuit_run").click().run()
    calls = []
    original = circuit.run_method
    monkeypatch.setattr(circuit, "run_method", lambda *a, **k: calls.append(1) or original(*a, **k))
    at.session_state["circuit_node"] = "L1H1"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert calls == []  # a click redraws from the session, it never reruns the method
    attention = titled(at, "Attention L1H1 on the first clean prompt")
    assert attention["data"][0]["z"]
    assert "direct attribution (L1H1 among them)" in " ".join(figures(at))
    ring = titled(at, "ACDC")["data"][-2]
    assert ring["marker"]["size"] == 26  # the selected node is ringed
    assert common.clicked_node({"selection": {"points": [{"customdata": {"0": "L0H2"}}]}}) == "L0H2"
    assert common.clicked_node({"selection": {"points": [{"customdata": ["L1H1"]}]}}) == "L1H1"
    assert common.clicked_node({"selection": {"points": []}}) is None


def test_circuit_shows_the_shipped_circuit_of_induction_attn2l_and_refuses_eap_with_kl(app):
    at = app("Circuit")
    at.selectbox(key="circuit_ckpt").set_value("induction-attn2l").run()
    assert titled(at, "Known circuit of induction-attn2l: 53 edges")
    assert "ACDC at threshold 0.01" in " ".join(c.value for c in at.caption)
    at.selectbox(key="circuit_ckpt").set_value("planted-hand-induction").run()
    at.slider(key="circuit_n").set_value(4)
    at.selectbox(key="circuit_metric").set_value("kl")
    at.selectbox(key="circuit_method").set_value("eap")
    at.button(key="circuit_run").click().run()
    assert not at.exception
    assert "cannot run here" in messages(at) and "KL" in messages(at)


def test_circuit_keeps_the_top_k_edges_by_default_and_says_when_a_threshold_keeps_none(app, checkpoints_dir):
    import workbench as wb
    from workbench.analysis.circuits import ComputationGraph, circuit_prompts, run_method

    at = app("Circuit")
    assert at.radio(key="circuit_keep").value == "top_k" and at.number_input(key="circuit_top_k").value == 20
    at.selectbox(key="circuit_method").set_value("eap")
    at.button(key="circuit_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    path = checkpoints_dir / "planted-iit-induction"
    model, _ = wb.load_checkpoint(path)
    n_edges = ComputationGraph(model).n_edges
    prompts = circuit_prompts(model, read_meta(str(path)), at.selectbox(key="circuit_source").value, n=8, seed=0,
                              path=path)
    library = run_method(model, prompts, at.selectbox(key="circuit_metric").value, "eap", top_k=20)
    assert 0 < len(library.circuit) <= 20
    shown = titled(at, f"EAP (edge attribution patching): {len(library.circuit)} edges")
    assert len([t for t in shown["data"] if t.get("mode") == "lines"]) == len(library.circuit)
    assert [m.value for m in at.metric if m.label == "Edges kept"] == [f"{len(library.circuit)} of {n_edges}"]
    # A threshold no edge reaches: a message naming it and pointing at top k, not an empty graph.
    at.radio(key="circuit_keep").set_value("threshold").run()
    at.number_input(key="circuit_threshold").set_value(10.0)
    at.button(key="circuit_run").click().run()
    assert "kept 0 edges" in messages(at) and "threshold 10" in messages(at) and "top k edges" in messages(at)
    assert not any(t.startswith("EAP") for t in figures(at))
    # The choice is kept when the user visits another page and comes back; k is bounded by the edge count.
    at.radio(key="circuit_keep").set_value("top_k").run()
    at.number_input(key="circuit_top_k").set_value(7).run()
    at.session_state["page"] = "Inspect"
    at.run()
    at.session_state["page"] = "Circuit"
    at.run()
    assert at.radio(key="circuit_keep").value == "top_k" and at.number_input(key="circuit_top_k").value == 7
    assert at.number_input(key="circuit_top_k").max == n_edges
    assert not at.exception

@pytest.mark.parametrize("name", ["stories-2020"])
def test_circuit_on_a_stories_model_offers_ioi_pairs_and_answer_metrics(app, name):
    at = app("Circuit")
    at.selectbox(key="circuit_ckpt").set_value(name).run()
    assert not at.exception
    assert at.selectbox(key="circuit_source").options[:1] == ["IOI prompts, corrupted by a third name in place of "
                                                               "the second subject (ABC)"]
    assert "logit difference (answer − wrong)" in at.selectbox(key="circuit_metric").options
    assert not any("Known circuit" in t for t in figures(at))
