"""The Graph page under Streamlit's AppTest, on the shipped stories-2026 and its transcoders and CLT.

What the page shows is checked against the library run directly on the same checkpoint: the
pruned node count at two thresholds (``an.attribution_graph(...).prune``), an intervention's
changed logit difference (``graph.intervene``), a feature's max-activating contexts
(``max_activating_contexts`` on the CLT's layer encoder), and a supernode's collapsed figure.
"""

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from ui.graph import IOI_PROMPT
from workbench import analysis as an
from workbench.analysis.features import dataset_tokens

DEFAULT = "stories-2026"


def metric(at, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def graph_figure(at) -> dict:
    for chart in at.get("plotly_chart"):
        spec = json.loads(chart.proto.spec)
        if "features," in str(spec.get("layout", {}).get("title", {})):
            return spec
    raise AssertionError("no graph figure")


@pytest.fixture(scope="module")
def shipped(checkpoints_dir):
    model, _ = wb.load_checkpoint(checkpoints_dir / DEFAULT)
    root = checkpoints_dir / DEFAULT / "saes"
    tcs = [an.load_dictionary(str(root / "transcoders" / f"layer{layer}")) for layer in range(model.cfg.n_layers)]
    clt = an.load_dictionary(str(root / "clt"))
    tokens = torch.tensor([model.tokenizer.encode(IOI_PROMPT)])
    return model, tcs, clt, tokens


def test_graph_page_renders_and_the_threshold_sets_the_node_count(app, shipped):
    model, tcs, _, tokens = shipped
    at = app("Graph")
    assert at.radio(key="graph_kind").value.endswith("(transcoder set)")
    assert graph_figure(at)["data"], "the graph is drawn"
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=128)
    kept = {}
    for threshold in (0.8, 0.95):
        at.slider(key="graph_node_threshold").set_value(threshold).run()
        assert not at.exception, [e.value for e in at.exception]
        kept[threshold] = metric(at, "Nodes kept")
        assert kept[threshold] == f"{graph.prune(threshold, 0.98).n_nodes} of {graph.n_nodes}"
    assert kept[0.8] != kept[0.95]
    # the figure's markers are the pruned graph's nodes, each with its id for a click
    ids = [row[0] for trace in graph_figure(at)["data"] if trace.get("mode") == "markers" and "customdata" in trace
           for row in trace["customdata"]]
    assert sorted(ids) == sorted(graph.prune(0.95, 0.98).node_ids())


def test_intervention_matches_graph_intervene_and_the_card_its_contexts(app, shipped, checkpoints_dir):
    model, _, clt, tokens = shipped
    at = app("Graph")
    at.radio(key="graph_kind").set_value(next(o for o in at.radio(key="graph_kind").options if "cross-layer" in o))
    at.radio(key="graph_target").set_value("token").run()
    assert (at.text_input(key="graph_answer").value, at.text_input(key="graph_wrong").value) == ("Ella", "Ivy")
    io, s = model.to_single_token(" Ella"), model.to_single_token(" Ivy")
    graph = an.attribution_graph(model, clt, tokens, target=(io, s), max_feature_nodes=128)
    pruned = graph.prune(0.8, 0.98)
    feature = at.selectbox(key="graph_iv_feature").options[1]
    at.selectbox(key="graph_iv_feature").set_value(feature)
    at.number_input(key="graph_iv_value").set_value(3.0).run()
    assert not at.exception, [e.value for e in at.exception]
    frame = at.dataframe[-1].value
    layer, pos, fid = (int(x) for x in feature[1:].split("."))
    with torch.no_grad():
        clean = model(tokens)[0, -1]
    after = pruned.intervene([(layer, pos, fid)], 3.0)[-1]
    assert frame["before"].iloc[0] == pytest.approx(float(clean[io] - clean[s]), abs=1e-3)
    assert frame["after"].iloc[0] == pytest.approx(float(after[io] - after[s]), abs=1e-4)
    assert abs(frame["change"].iloc[0]) > 1e-3, "setting a feature to 3 moves the target"
    # the card of the selected node: its max-activating contexts, from the CLT's layer-`layer` encoder
    at.selectbox(key="graph_node").set_value(feature).run()
    spec = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if "max-activating" in str(json.loads(c.proto.spec)["layout"].get("title")))
    task = an.task_from_meta(wb.checkpoint.read_meta(str(checkpoints_dir / DEFAULT)))
    reference = an.max_activating_contexts(model, clt.layer_encoder(layer), dataset_tokens(model, task, 64),
                                           feature=fid, k=10, n_sequences=64)
    assert len(reference) and spec["data"][0]["y"] == [f"#{r}: {a:.2f}" for r, a in
                                                       zip(reference["rank"], reference["activation"])]


def test_a_supernode_collapses_its_features(app):
    at = app("Graph")
    features = at.multiselect(key="graph_group").options
    at.multiselect(key="graph_group").set_value(features[:3])
    at.text_input(key="graph_group_name").set_value("names").run()
    assert not at.exception, [e.value for e in at.exception]
    traces = graph_figure(at)["data"]
    ids = [row[0] for t in traces if "customdata" in t for row in t["customdata"]]
    assert "names" in ids and not set(features[:3]) & set(ids)
    assert any(t.get("name") == "supernode" for t in traces)


def test_a_checkpoint_without_transcoders_is_offered_only_when_attention_only(app, checkpoints_dir):
    at = app("Graph")
    options = at.selectbox(key="graph_ckpt").options
    assert DEFAULT in options and "planted-hand-induction" in options  # attention-only: its own replacement
    from ui.common import pretrained

    for name in options:  # the pretrained model's folder is in the model cache (offered once its transcoders are in)
        folder = Path(pretrained.entries().get(name, Path(checkpoints_dir) / name))
        attn_only = json.loads((folder / "config.json").read_text()).get("attn_only")
        assert attn_only or any((folder / "saes").glob("*/*.safetensors")) or \
            any((folder / "saes").glob("*/*/*.safetensors"))
    assert "modular-grokking" not in options  # MLPs and no transcoders: nothing to build the graph with


def test_a_supernode_named_as_a_node_is_a_message(app):
    at = app("Graph")
    at.multiselect(key="graph_group").set_value(at.multiselect(key="graph_group").options[:2])
    at.text_input(key="graph_group_name").set_value("T0").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("already a node id" in str(w.value) for w in at.warning)
