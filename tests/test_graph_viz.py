"""What the Graph page draws with: the attribution-graph figure, supernode collapsing, and a CLT
layer seen as a one-hook dictionary, on a tiny seeded model and a hand-made graph table."""

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from workbench import analysis as an
from workbench import viz
from workbench.analysis.dictionaries import CrossLayerTranscoder
from workbench.analysis.features import feature_activations


def hand_graph():
    """Two tokens, two layer-0 features at position 1, one error, one logit; four edges."""
    nodes = pd.DataFrame({"id": ["F0.1.3", "F0.1.5", "E1.1", "T0", "T1", "L0"],
                          "kind": ["feature", "feature", "error", "token", "token", "logit"],
                          "layer": [0, 0, 1, -1, -1, 2], "pos": [1, 1, 1, 0, 1, 1], "feature": [3, 5, -1, 7, 8, 9],
                          "activation": [1.0, 2.0, 0.5, 0.0, 0.0, 3.0], "influence": [0.4, 0.1, 0.2, 0.3, 0.2, 0.0],
                          "logit_weight": [0, 0, 0, 0, 0, 1.0], "label": ["", "", "", "a", "b", "c"]})
    edges = pd.DataFrame({"source": [3, 4, 0, 1, 2, 0], "target": [0, 1, 5, 5, 5, 1],
                          "weight": [2.0, -1.0, 4.0, -0.5, 1.0, 0.25]})
    return nodes, edges


def test_attribution_graph_figure_places_sizes_and_colours_as_circuit_tracer():
    nodes, edges = hand_graph()
    fig = viz.attribution_graph_figure(nodes, edges, selected="F0.1.3", str_tokens=["a", "b"])
    markers = {t.name: t for t in fig.data if t.mode == "markers" and t.customdata is not None}
    assert set(markers) == {"feature", "error", "token", "logit"}
    ids = {row[0]: (x, y, s) for t in markers.values() for row, x, y, s in
           zip(t.customdata, t.x, t.y, np.broadcast_to(t.marker.size, len(t.x)))}
    assert set(ids) == set(nodes["id"])
    # y = layer (embeddings below layer 0, logits above the last layer), x = position
    assert ids["T0"][:2] == (0.0, -1.0) and ids["L0"][:2] == (1.0, 2.0) and ids["E1.1"][1] == 1.0
    # two features in one cell are spread across it, inside it
    assert ids["F0.1.3"][0] != ids["F0.1.5"][0] and all(abs(ids[f][0] - 1) < 0.5 for f in ("F0.1.3", "F0.1.5"))
    # size follows influence (a logit's: its weight)
    assert ids["F0.1.3"][2] > ids["T0"][2] > ids["F0.1.5"][2] and ids["L0"][2] == max(s for *_, s in ids.values())
    lines = [t for t in fig.data if t.mode == "lines"]
    widths = {}
    for t in lines:  # each edge is one segment (x0, x1, None) of a trace of its sign and width
        n = len([v for v in t.x if v is not None and not np.isnan(v)]) // 2
        widths.setdefault(t.line.color, []).extend([t.line.width] * n)
    assert len(widths[viz.POSITIVE]) == 4 and len(widths[viz.NEGATIVE]) == 2
    thickest = max((t for t in lines), key=lambda t: t.line.width)
    assert thickest.line.color == viz.POSITIVE and len(thickest.x) == 3  # the 4.0 edge alone
    assert any(t.marker.line.color == viz.STEP_MARK for t in fig.data if t.mode == "markers")  # the ring
    assert list(fig.layout.xaxis.ticktext) == ["0: 'a'", "1: 'b'"]


def test_attribution_graph_figure_needs_the_frames_columns():
    nodes, edges = hand_graph()
    with pytest.raises(ValueError, match="missing"):
        viz.attribution_graph_figure(nodes.drop(columns="influence"), edges)


def test_collapse_frames_sums_edges_into_and_out_of_the_group():
    nodes, edges = hand_graph()
    out_nodes, out_edges = an.collapse_frames(nodes, edges, {"pair": ["F0.1.3", "F0.1.5"]})
    assert list(out_nodes["id"]) == ["E1.1", "T0", "T1", "L0", "pair"]
    group = out_nodes.set_index("id").loc["pair"]
    assert group["kind"] == "supernode" and group["influence"] == pytest.approx(0.5) and group["activation"] == 3.0
    named = {(out_nodes["id"][s], out_nodes["id"][t]): w for s, t, w in out_edges.itertuples(index=False)}
    # by hand: T0 -> F3 (2) and T1 -> F5 (-1) stay separate; F3 -> L (4) + F5 -> L (-0.5) = 3.5; F3 -> F5 is inside
    assert named == {("T0", "pair"): 2.0, ("T1", "pair"): -1.0, ("pair", "L0"): 3.5, ("E1.1", "L0"): 1.0}
    fig = viz.attribution_graph_figure(out_nodes, out_edges)
    assert [[list(row) for row in t.customdata] for t in fig.data if t.name == "supernode"] == [[["pair"]]]
    with pytest.raises(ValueError, match="not a feature node"):
        an.collapse_frames(nodes, edges, {"g": ["T0"]})
    with pytest.raises(ValueError, match="already a node id"):
        an.collapse_frames(nodes, edges, {"L0": ["F0.1.3"]})


def test_clt_layer_encoder_reads_what_the_spliced_clt_computes():
    torch.manual_seed(0)
    cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, d_vocab=40, n_ctx=16, norm="rmsnorm", positional="rope",
                         ffn="swiglu", seed=0)
    model = wb.HookedDecoder(cfg).eval()
    clt = CrossLayerTranscoder(n_layers=2, d_in=32, d_sae=24, d_out=32, activation="jumprelu")
    with torch.no_grad():
        clt.threshold.fill_(0.0)
    tokens = torch.randint(0, 40, (2, 8))
    with torch.no_grad(), an.spliced(model, clt, error_term=True):
        _, cache = model.run_with_cache(tokens)
    for layer in range(2):
        view = clt.layer_encoder(layer)
        assert view.cfg.hook_name == f"blocks.{layer}.ln2.hook_normalized" and view.cfg.d_sae == 24
        with torch.no_grad():
            acts = feature_activations(model, view, tokens)
        expected = cache[f"blocks.{layer}.hook_mlp_out.hook_sae_acts_post"]
        assert acts.abs().sum() > 0 and torch.allclose(acts, expected, atol=1e-6)
    with pytest.raises(ValueError, match="layer must be"):
        clt.layer_encoder(2)
