"""Figures that stay legible (the app's round three): thinned tick labels, a live loss curve with
sensible axes from its first point, token rows that wrap, circuit labels above the edges."""

import pandas as pd
import plotly.graph_objects as go
import pytest

from workbench import viz


def test_thin_ticks_keeps_at_most_max_labels_evenly_and_leaves_short_axes_alone():
    labels = [f"{i}: t{i}" for i in range(40)]
    fig = go.Figure(go.Heatmap(z=[list(range(40))], x=labels))
    fig.update_xaxes(type="category", tickmode="array", tickvals=labels, ticktext=labels)
    viz.thin_ticks(fig, 16)
    assert list(fig.layout.xaxis.tickvals) == labels[::3] and list(fig.layout.xaxis.ticktext) == labels[::3]
    assert len(fig.data[0].x) == 40  # every cell (and its hover) stays
    short = go.Figure(go.Heatmap(z=[[1, 2]], x=["a", "b"]))
    short.update_xaxes(tickmode="array", tickvals=["a", "b"], ticktext=["a", "b"])
    assert list(viz.thin_ticks(short, 16).layout.xaxis.tickvals) == ["a", "b"]


def test_live_loss_figure_spans_the_run_from_its_first_point_and_thins_long_histories():
    one = viz.live_loss_figure([{"step": 400, "train_loss": 3.2}], total_steps=20_000)
    assert list(one.layout.xaxis.range) == [0, 20_000] and one.layout.xaxis.tickformat == "d"
    assert one.data[0].mode == "lines+markers" and list(one.data[0].x) == [400]  # one point, and it shows
    history = [{"step": s, "train_loss": 5.0 / s} for s in range(1, 2_001)]
    many = viz.live_loss_figure(history, total_steps=2_000, max_points=400)
    xs = list(many.data[0].x)
    assert len(xs) <= 401 and xs[0] == 1 and xs[-1] == 2_000
    with pytest.raises(ValueError, match="no rows"):
        viz.live_loss_figure([], 10)


def test_token_rows_wrap_instead_of_squashing():
    n = 25
    lens = pd.DataFrame({"batch": 0, "layer": 1, "pos": range(n), "token": [f"tok{i}" for i in range(n)],
                         "top1": "x", "top1_prob": 0.5})
    patterns = pd.DataFrame([{"batch": 0, "layer": 0, "head": 0, "query_pos": q, "key_pos": k,
                              "query_token": f"{q}", "key_token": f"{k}", "attention": 1.0 / (q + 1)}
                             for q in range(n) for k in range(q + 1)])
    fig = viz.token_hover_figure(lens, patterns, 0, 0, k=1, per_row=10)
    trace = fig.data[0]
    assert max(trace.x) == 9 and sorted(set(trace.y)) == [0, 1, 2]  # 10 + 10 + 5
    assert (trace.x[12], trace.y[12]) == (2, 1) and fig.layout.width is None


def test_circuit_labels_are_annotations_above_the_edges():
    edges = pd.DataFrame({"sender": ["embed", "L0H1"], "receiver": ["L0H1.q", "logits"], "input": ["q", "logits"],
                          "score": [1.0, 0.5]})
    fig = viz.circuit_graph_figure(edges)
    nodes = fig.data[-1]
    assert nodes.mode == "markers" and list(nodes.text) == ["embed", "L0H1", "logits"]
    assert [a.text for a in fig.layout.annotations] == ["embed", "L0H1", "logits"]
    assert all(a.bgcolor and not a.showarrow for a in fig.layout.annotations)


@pytest.mark.parametrize("name", ["stories-2026", "planted-iit-modular"])
def test_counting_a_loaded_model_matches_counting_its_config(name):
    from pathlib import Path

    import workbench as wb
    from workbench.accounting import count_model_params, count_params

    path = Path(__file__).resolve().parents[1] / "checkpoints" / name
    if not path.is_dir():
        pytest.skip(f"the shipped checkpoint {path} is missing")
    model, _ = wb.load_checkpoint(path)
    assert count_model_params(model) == count_params(model.cfg)
    assert count_model_params(model)["total"] == sum(p.numel() for p in model.parameters())


# ---- the real model's size: 30 layers x 9 heads (SmolLM2-135M) -------------------------------------------
def _layer_head_table(n_layers: int = 30, n_heads: int = 9, panels: int = 1) -> pd.DataFrame:
    return pd.DataFrame([dict(layer=l, head=h, method=f"m{m}", delta=0.1 * l - 0.05 * h + 0.01 * m)
                         for m in range(panels) for l in range(n_layers) for h in range(n_heads)])


def _plot_height(fig) -> float:
    """The figure's height less its margins: what its panels share (plotly's defaults where unset)."""
    margin = fig.layout.margin
    return (fig.layout.height or 450) - (margin.t if margin.t is not None else 100) - (
        margin.b if margin.b is not None else 80)


ROW_PX = 14  # a layer's row must hold its 12 px tick label: below this plotly drops labels or they touch


@pytest.mark.parametrize("clickable", [False, True])
def test_a_layer_head_heatmap_of_30_layers_gives_every_layer_a_readable_row(clickable):
    fig = viz.layer_head_figure(_layer_head_table(), clickable=clickable, title="30 x 9")
    assert _plot_height(fig) / 30 >= ROW_PX, fig.layout.height  # and so its 10 px cell text


def test_sweeps_panels_of_30_layers_each_keep_readable_rows():
    table = _layer_head_table(panels=6)
    fig = viz.layer_head_figure(table, facet="method", columns=3)  # two rows of three panels
    domain = fig.layout.yaxis.domain  # the first panel's share of the plot height
    assert _plot_height(fig) * (domain[1] - domain[0]) / 30 >= ROW_PX, (fig.layout.height, domain)
    assert len([t for t in fig.data if t.type == "heatmap"]) == 6


def test_head_patching_and_scores_of_30_layers_keep_readable_rows():
    table = _layer_head_table().assign(site="head", pos=-1, metric=0.5, restored=0.2, clean=1.0, corrupted=0.0)
    fig = viz.patching_figure(table, "head", value="restored")
    assert _plot_height(fig) / 30 >= ROW_PX, fig.layout.height
    scores = pd.DataFrame([dict(layer=l, head=h, kind=k, score=0.1) for k in ("previous", "induction", "duplicate")
                           for l in range(30) for h in range(9)])
    fig = viz.head_scores_figure(scores)
    domain = fig.layout.yaxis.domain
    assert _plot_height(fig) * (domain[1] - domain[0]) / 30 >= ROW_PX, (fig.layout.height, domain)


def test_two_attention_patterns_side_by_side_share_one_colour_bar_at_the_right():
    # the left panel's own bar sat between the panels and ran into the right panel's axis title
    tokens = ["When", " Mary", " and", " John", " went"]
    patterns = pd.DataFrame([{"batch": 0, "layer": 0, "head": 0, "query_pos": q, "key_pos": k, "query_token": tokens[q],
                              "key_token": tokens[k], "attention": 1.0 / (q + 1)} for q in range(5) for k in range(q + 1)])
    fig = viz.side_by_side(viz.attention_figure(patterns, 0, 0), viz.attention_figure(patterns, 0, 0))
    shown = [t for t in fig.data if t.type == "heatmap" and t.showscale is not False]
    assert len(shown) == 1 and shown[0].xaxis == "x2" and shown[0].colorbar.x == 1.0
    diff = viz.attention_figure(patterns.assign(attention=patterns["attention"] - 0.2), 0, 0, difference=True)
    mixed = viz.side_by_side(viz.attention_figure(patterns, 0, 0), diff)  # two scales: a bar each
    assert len([t for t in mixed.data if t.type == "heatmap" and t.showscale is not False]) == 2


def test_side_by_side_keeps_the_sources_ticks_so_they_can_be_thinned():
    tokens = [f"tok{i}" for i in range(14)]
    patterns = pd.DataFrame([{"batch": 0, "layer": 0, "head": 0, "query_pos": q, "key_pos": k, "query_token": tokens[q],
                              "key_token": tokens[k], "attention": 1.0 / (q + 1)} for q in range(14) for k in range(q + 1)])
    one = viz.attention_figure(patterns, 0, 0)
    fig = viz.side_by_side(one, one)
    assert list(fig.layout.xaxis2.tickvals) == list(one.layout.xaxis.tickvals)
    viz.thin_ticks(viz.thin_ticks(fig, 8), 8, axis="y")
    for ax in (fig.layout.xaxis, fig.layout.xaxis2, fig.layout.yaxis, fig.layout.yaxis2):
        assert len(ax.tickvals) <= 8 and len(ax.ticktext) == len(ax.tickvals)


def test_a_clickable_heatmap_of_30_layers_fills_its_panel_so_clicks_land_on_their_cell():
    # the clickable points' markers padded the autorange: a click at layer 17's centre selected layer 18
    fig = viz.layer_head_figure(_layer_head_table(), clickable=True)
    assert list(fig.layout.yaxis.range) == [29.5, -0.5] and list(fig.layout.xaxis.range) == [-0.5, 8.5]
    assert fig.layout.yaxis.autorange is False


def test_a_layer_head_heatmap_sizes_itself_from_its_layers_and_heads():
    # a 30-layer grid with its values written in had 15 px rows (the 10 px text touched) and no width:
    # tutorial 09 set both by hand
    from workbench.analysis.common import unit_label

    small = viz.layer_head_figure(_layer_head_table(2, 4))
    assert (small.layout.height, small.layout.width) == (450, 450)  # the minimum, plotly's default height
    fig = viz.layer_head_figure(_layer_head_table(30, 9), text=True)
    assert fig.layout.height > small.layout.height and _plot_height(fig) / 30 >= 20, fig.layout.height
    plain = viz.layer_head_figure(_layer_head_table(30, 9), text=False)
    assert small.layout.height < plain.layout.height < fig.layout.height and _plot_height(plain) / 30 >= ROW_PX
    heatmap = fig.data[0]
    assert list(heatmap.y) == [unit_label(l) for l in range(30)]  # a label per row, none thinned away
    assert fig.layout.yaxis.tickvals is None and fig.layout.yaxis.dtick is None
    wide = viz.layer_head_figure(_layer_head_table(30, 24), text=True)
    assert wide.layout.width > fig.layout.width >= 9 * 30 and wide.layout.width - 260 >= 24 * 30
    huge = viz.layer_head_figure(_layer_head_table(400, 200), text=False)
    assert huge.layout.height <= 4000 and huge.layout.width <= 1600  # bounded
