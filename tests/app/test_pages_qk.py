"""The QK panel of the Graph page and the QK figure of the Training page under AppTest.

What the pages show is checked against the library run directly: the panel's score, pairs and the
attention change when a key node is removed equal ``an.qk_attribution`` on the graph the page
builds (planted-hand-induction: the hand-written K-composition, 12.0 of a score of 12.0), picking
another attention entry moves the four selectors to it, the entry list shows the edge the selectors
open (none where the graph does not list it), and the Training page's figure is
``viz.qk_over_training_figure`` of ``over_training(series, qk_pairs, ...)`` on the same prompts (its
last five snapshots, measured again).
"""

import base64
import json

import numpy as np
import pytest
import torch

import workbench as wb
from workbench import analysis as an

PLANTED = "planted-hand-induction"


def charts(at) -> dict:
    return {json.loads(c.proto.spec)["layout"].get("title", {}).get("text", ""): json.loads(c.proto.spec)
            for c in at.get("plotly_chart")}


def values(y) -> list:
    """A trace's values as sent to the browser (a list, or plotly's typed array {dtype, bdata})."""
    if isinstance(y, dict) and "bdata" in y:
        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]).tolist()
    return list(y)


def metric(at, label: str) -> str:
    return next(m.value for m in at.metric if label in m.label)


@pytest.fixture
def graph_page(app):
    at = app("Graph")
    at.selectbox(key="graph_ckpt").set_value(PLANTED).run()
    at.toggle(key="graph_qk_open").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_qk_panel_is_qk_attribution_of_the_pages_graph(graph_page, checkpoints_dir):
    at = graph_page
    model, _ = wb.load_checkpoint(checkpoints_dir / PLANTED)
    ids = [int(t) for t in at.text_area(key="graph_prompt").value.split()]
    graph = an.attribution_graph(model, None, torch.tensor([ids]), max_feature_nodes=128)
    top = an.attention_entries(graph).iloc[0]
    layer, head, q, k = (int(top[c]) for c in ("layer", "head", "query_pos", "key_pos"))
    assert [at.session_state[f"graph_qk_{w}"] for w in ("layer", "head", "query", "key")] == [layer, head, q, k]
    reference = an.qk_attribution(graph, layer, head, q, k, top=20, exact=5)
    assert float(metric(at, "Score q")) == pytest.approx(reference.attrs["score"], abs=1e-3)
    assert reference.attrs["score"] == pytest.approx(12.0, abs=1e-4)  # the hand-written induction score
    table = at.dataframe[-1].value
    assert list(table["pair"]) == [f"{a} x {b}" for a, b in zip(reference["query_node"], reference["key_node"])]
    assert table["contribution"].tolist() == pytest.approx(reference["contribution"].round(4).tolist(), abs=1e-4)
    first = reference.iloc[0]
    assert (first["query_kind"], first["key_kind"], first["key_layer"]) == ("token", "head", 0)
    assert first["contribution"] == pytest.approx(12.0, abs=1e-4)  # K-composition: token x previous-token head
    assert float(metric(at, "Change")) == pytest.approx(first["pattern_change"], abs=1e-3)
    assert float(metric(at, "at the key")) == pytest.approx(float(metric(at, "Attention before"))
                                                             + first["pattern_change"], abs=2e-3)
    spec = charts(at)
    heat = next(v for t, v in spec.items() if "QK pairs" in t)
    assert heat["data"][0]["type"] == "heatmap" and any(t.get("name") == "cells" for t in heat["data"])


def test_another_attention_entry_moves_the_selectors_and_the_table(graph_page):
    at = graph_page
    options = at.selectbox(key="graph_qk_entry").options
    before = at.dataframe[-1].value["pair"].tolist()
    at.selectbox(key="graph_qk_entry").set_value(options[1]).run()
    assert not at.exception, [e.value for e in at.exception]
    layer, head = int(options[1][1]), int(options[1][3])
    query, key = (int(x) for x in options[1].split("query ")[1].split(" (")[0].split(" -> key "))
    assert [at.session_state[f"graph_qk_{w}"] for w in ("layer", "head", "query", "key")] == [layer, head, query, key]
    after = at.dataframe[-1].value["pair"].tolist()
    assert after != before and all(f"@{key}" in p.split(" x ")[1] or p.endswith("bias") for p in after)


def test_the_entry_picker_shows_the_edge_the_selectors_open(graph_page):
    at = graph_page
    picker = lambda: at.selectbox(key="graph_qk_entry")  # noqa: E731
    assert picker().value == picker().options[0] and picker().value.startswith("L1H0: query 14 -> key 8 ")
    at.selectbox(key="graph_qk_key").set_value(1).run()  # another entry the graph lists
    assert not at.exception, [e.value for e in at.exception]
    assert picker().value.startswith("L1H0: query 14 -> key 1 ")
    at.selectbox(key="graph_qk_query").set_value(12).run()  # query 12: none of the listed entries
    assert not at.exception, [e.value for e in at.exception]
    assert not any(o.startswith("L1H0: query 12 ") for o in picker().options)
    assert picker().value is None and "query 12 -> key" in picker().placeholder
    at.selectbox(key="graph_qk_entry").set_value(picker().options[0]).run()  # and back through the list
    assert [at.session_state[f"graph_qk_{w}"] for w in ("layer", "head", "query", "key")] == [1, 0, 14, 8]


def test_the_training_figure_is_the_librarys(app, checkpoints_dir):
    from workbench import viz

    at = app("Training")
    at.session_state["training_qk_prompts"] = 2  # before the toggle draws its input: one computation, not two
    at.toggle(key="training_qk_open").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    head = at.selectbox(key="training_qk_head").value
    spec = next(v for t, v in charts(at).items() if "the top QK pair and" in t)
    series = wb.load_series(checkpoints_dir / "induction-attn2l")
    cfg = series.config
    prompts, queries, keys = an.induction_qk_prompts(cfg.d_vocab, n=2, half=16, seed=0, n_ctx=cfg.n_ctx)
    part = series[-5:]  # the page's last five snapshots, measured again here
    table = an.over_training(part, an.qk_pairs, tokens=prompts, layer=1, head=[head], query_pos=queries,
                             key_pos=keys, progress=False)
    summary = an.qk_summary(table, pair=[("token", f"L0H{h}") for h in (2, 3, 4, 7)])
    fig = viz.qk_over_training_figure(summary, head=head, phase=an.loss_drop(series.history))
    ours = {t.name: list(t.y) for t in fig.data if t.name and "interval" not in t.name}
    shown = {t["name"]: values(t["y"]) for t in spec["data"] if t.get("name") and "interval" not in t["name"]}
    for name in ("top pair", "best of token x L0H2/L0H3/L0H4/L0H7", "token x L0H2/L0H3/L0H4/L0H7: share top"):
        assert shown[name][-5:] == pytest.approx(ours[name], abs=1e-6), name
    assert len(shown["top pair"]) == len(series)
