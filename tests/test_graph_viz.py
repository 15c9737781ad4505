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


# ---- a deep model's graph fits one screen (SmolLM2-135M: 30 layers, the Graph page's 128 or 512 feature rows) ----
def smollm2_sized_frames(features: int, seed: int = 0, layers: int = 30, positions: int = 14):
    """A pruned graph the size of SmolLM2-135M's on the page's IOI prompt (30 layers, 14 tokens, position 0
    held): an error node in every (layer, position) cell, three target logits, and ``features`` features
    crowded as the real graph's are (most in layers 0, 2, 11 and the last three; at positions 1, 2 and the last)."""
    rng = np.random.default_rng(seed)
    by_layer, by_pos = np.ones(layers), np.r_[0.0, np.ones(positions - 1)]
    by_layer[[max(layers - 3, 0), max(layers - 2, 0)]] = 10
    by_layer[[layer for layer in (0, 2, 11, layers - 1) if layer < layers]] = 20
    by_pos[[1, 2, positions - 1]] = 8
    weights = np.outer(by_layer, by_pos).ravel()
    cells = rng.choice(layers * positions, size=features, p=weights / weights.sum())
    rows = [dict(id=f"T{p}", kind="token", layer=-1, pos=p, influence=0.05) for p in range(positions)]
    rows += [dict(id=f"E{l}.{p}", kind="error", layer=l, pos=p, influence=0.02)
             for l in range(layers) for p in range(1, positions)]
    rows += [dict(id=f"F{c // positions}.{c % positions}.{f}", kind="feature", layer=c // positions,
                  pos=c % positions, influence=float(rng.exponential(0.05))) for f, c in enumerate(cells)]
    rows += [dict(id=f"L{j}", kind="logit", layer=layers, pos=positions - 1, influence=0.0, logit_weight=0.5 / (j + 1))
             for j in range(3)]
    nodes = pd.DataFrame(rows).fillna({"logit_weight": 0.0})
    return nodes, pd.DataFrame({"source": [0], "target": [len(nodes) - 1], "weight": [1.0]})


def drawn_nodes(fig, positions: int):
    """Every node's id, centre (px from the plot's bottom left, the page's plot width) and marker size."""
    traces = [t for t in fig.data if t.mode == "markers" and t.customdata is not None]
    ids = [row[0] for t in traces for row in t.customdata]
    x, y = (np.concatenate([np.asarray(getattr(t, axis), float) for t in traces]) for axis in "xy")
    size = np.concatenate([np.broadcast_to(np.asarray(t.marker.size, float), len(t.x)) for t in traces])
    low, high = fig.layout.yaxis.range
    plot_height = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    return ids, x, y, np.stack([x * viz.GRAPH_PLOT_WIDTH / positions, (y - low) / (high - low) * plot_height], 1), size


def assert_apart(centres: np.ndarray, size: np.ndarray, least: float = 12.0) -> None:
    """No two centres within ``least`` px, and no marker over another node's centre (each stays clickable)."""
    gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1) + np.eye(len(centres)) * 1e9
    assert gaps.min() >= least - 1e-6, f"two nodes {gaps.min():.1f} px apart"
    covered = gaps - np.maximum(size[:, None], size[None]) / 2
    assert covered.min() > 0, f"a marker covers a neighbour's centre by {-covered.min():.1f} px"


@pytest.mark.parametrize("features", [128, 512])
def test_a_smollm2_sized_graph_fits_one_screen_with_every_node_apart(features):
    nodes, edges = smollm2_sized_frames(features)
    fig = viz.attribution_graph_figure(nodes, edges)
    # the old layout gave every layer the crowdest layer's height: 3,060 px at least for 30 layers (4,446 px
    # for the real model's default graph); a 1400 x 1000 window shows 900 px below the page's header
    assert fig.layout.height <= viz.GRAPH_MAX_HEIGHT == 900
    ids, x, y, centres, size = drawn_nodes(fig, 14)
    assert sorted(ids) == sorted(nodes["id"])
    assert_apart(centres, size)
    # each node inside its layer's band (a shaded rect named after the layer) and its position's column
    bands = {shape.name: (shape.y0, shape.y1) for shape in fig.layout.shapes}
    assert list(bands) == ["embed", *(f"L{layer}" for layer in range(30)), "logits"]
    row = nodes.set_index("id").loc[ids]
    names = np.where(row["kind"] == "token", "embed", np.where(row["kind"] == "logit", "logits",
                                                                 "L" + row["layer"].astype(str)))
    low, high = np.array([bands[name] for name in names]).T
    assert np.all((low < y) & (y < high))
    inner = (row["kind"] != "logit").to_numpy()
    assert np.all(np.abs(x[inner] - row["pos"].to_numpy()[inner]) < 0.5)
    # each band's tick names its layer (a band too thin for a label: every other one)
    named = [(tick, band) for tick, band in zip(fig.layout.yaxis.ticktext, bands) if tick]
    assert all(tick == band for tick, band in named) and len(named) >= len(bands) // 2 + 1
    assert fig.layout.dragmode == "zoom"


def test_a_graph_too_crowded_for_the_screen_grows_rather_than_pile_its_nodes_up():
    nodes, edges = smollm2_sized_frames(0)
    crowd = pd.DataFrame([dict(id=f"F11.13.{f}", kind="feature", layer=11, pos=13, influence=0.01, logit_weight=0.0)
                          for f in range(512)])  # every feature row in one cell
    fig = viz.attribution_graph_figure(pd.concat([nodes, crowd], ignore_index=True), edges)
    assert fig.layout.height > viz.GRAPH_MAX_HEIGHT
    _, _, _, centres, size = drawn_nodes(fig, 14)
    assert_apart(centres, size)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_a_shallow_models_graph_keeps_even_layers_at_whole_numbers(layers):
    nodes, edges = smollm2_sized_frames(40, layers=layers)
    fig = viz.attribution_graph_figure(nodes, edges)
    assert list(fig.layout.yaxis.tickvals) == list(range(-1, layers + 1))  # y = layer, every band alike
    heights = {round(shape.y1 - shape.y0, 9) for shape in fig.layout.shapes}
    assert heights == {1.0} and fig.layout.height <= viz.GRAPH_MAX_HEIGHT
    _, _, _, centres, size = drawn_nodes(fig, 14)
    assert_apart(centres, size, least=16)
