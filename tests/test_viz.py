"""Figures are built from the analysis tables: right trace types, token labels on the axes
(unique even when tokens repeat), top tokens written in the lens cells, both themes."""

import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench import viz
from workbench.analysis import ablation_sweep, attention_patterns, direct_logit_attribution, head_scores, logit_lens
from workbench.analysis.tokens import residual_norms, token_losses
from workbench.tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    tok = CharTokenizer("abcdefgh ")
    return wb.HookedDecoder(tiny(d_vocab=tok.vocab_size), tokenizer=tok).eval()


def test_attention_figure_has_unique_token_labels_and_hover(model):
    tokens = model.to_tokens("abab cab")
    fig = viz.attention_figure(attention_patterns(model, tokens), layer=1, head=2)
    heatmap = fig.data[0]
    assert isinstance(heatmap, go.Heatmap)
    assert list(heatmap.x) == ["0: a", "1: b", "2: a", "3: b", "4:  ", "5: c", "6: a", "7: b"]
    assert len(set(heatmap.y)) == 8 and "attention" in heatmap.hovertemplate
    z = np.array(heatmap.z, dtype=float)
    assert np.isnan(z[0, 1]) and np.allclose(np.nansum(z, axis=1), 1, atol=1e-5)


def test_attention_grid_is_one_mosaic_of_every_head(model):
    table = attention_patterns(model, model.to_tokens("abcab"))
    fig = viz.attention_grid(table)
    assert len(fig.data) == 1 and isinstance(fig.data[0], go.Heatmap) and fig.data[0].hoverongaps is False
    heatmap, n, step = fig.data[0], 5, 6  # 5 tokens per tile, one empty row/column between tiles
    z = np.array(heatmap.z, dtype=float)
    assert z.shape == (2 * step - 1, 4 * step - 1)
    assert np.isnan(z[n]).all() and np.isnan(z[:, n]).all()  # the gaps
    for row in table.itertuples():  # every weight sits in its head's tile, at (query, key)
        assert z[row.layer * step + row.query_pos, row.head * step + row.key_pos] == pytest.approx(row.attention)
    assert np.isnan(z).sum() == z.size - len(table)
    # hover names layer, head, query token, key token and weight, through unique row/column labels
    assert heatmap.y[step + 3] == "L1 · query 3: a" and heatmap.x[2 * step + 1] == "H2 · key 1: b"
    assert len(set(heatmap.x)) == len(heatmap.x) and len(set(heatmap.y)) == len(heatmap.y)
    assert heatmap.hovertemplate.startswith("%{y}<br>%{x}<br>attention %{z")
    assert list(fig.layout.xaxis.ticktext) == ["H0", "H1", "H2", "H3"] and list(fig.layout.yaxis.ticktext) == ["L0", "L1"]
    assert list(fig.layout.xaxis.tickvals) == [f"H{h} · key 2: c" for h in range(4)]
    assert fig.layout.yaxis.autorange == "reversed"
    some_heads = viz.attention_grid(attention_patterns(model, model.to_tokens("abcab"), heads=[1, 3]))
    assert list(some_heads.layout.xaxis.ticktext) == ["H1", "H3"]


@pytest.mark.parametrize("color", ["prob", "rank", "target_prob", "kl"])
def test_logit_lens_figure_writes_the_top_token(model, color):
    table = logit_lens(model, model.to_tokens("abcdabcd"))
    fig = viz.logit_lens_figure(table, color=color, theme="dark")
    heatmap = fig.data[0]
    assert heatmap.texttemplate == "%{text}" and fig.layout.template.layout.paper_bgcolor is not None
    assert np.array(heatmap.text).shape == (model.cfg.n_layers + 1, 8)
    final = table[table.layer == model.cfg.n_layers].sort_values("pos")
    assert list(np.array(heatmap.text)[-1]) == final.top1.tolist()
    assert list(heatmap.y) == ["resid_pre 0", "resid_pre 1", "final"]


def test_dla_layer_head_and_loss_figures(model, tmp_path):
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 6))
    dla = direct_logit_attribution(model, tokens, 1, 2)
    bars = viz.dla_figure(dla, "layer").data[0]
    assert isinstance(bars, go.Bar) and "embed" in list(bars.x)
    sweep = ablation_sweep(model, tokens, methods=("zero", "mean"))
    fig = viz.layer_head_figure(sweep, "delta", facet="method")
    assert len(fig.data) == 2 and np.array(fig.data[0].z).shape == (model.cfg.n_layers, model.cfg.n_heads)
    scores = viz.layer_head_figure(head_scores(model, seq_len=6), "score", facet="kind")
    assert len(scores.data) == 4
    pd.DataFrame({"step": [10, 20, 30], "train_loss": [3.0, 2.0, 1.5], "val_loss": [None, None, 1.7], "lr": 1e-3,
                  "grad_norm": 1.0, "tokens_per_s": 100.0}).to_csv(tmp_path / "metrics.csv", index=False)
    curves = viz.loss_curves(tmp_path)
    assert [t.name for t in curves.data] == ["train_loss", "val_loss"] and list(curves.data[1].x) == [30]


def test_side_by_side_and_bad_input(model):
    table = attention_patterns(model, model.to_tokens("abcabc"))
    left, right = viz.attention_figure(table, 0, 0), viz.attention_figure(table, 1, 3)
    fig = viz.side_by_side(left, right, ("clean", "ablated"))
    assert len(fig.data) == 2 and fig.data[1].xaxis == "x2"
    assert [a.text for a in fig.layout.annotations] == ["clean", "ablated"]
    assert len(left.data) == 1  # the sources are left alone
    sweep = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "delta": [0.1, 0.2], "method": ["zero", "mean"]})
    with pytest.raises(ValueError, match="single-panel"):
        viz.side_by_side(viz.layer_head_figure(sweep, facet="method"), right)
    with pytest.raises(ValueError, match="theme"):
        viz.attention_figure(table, 0, 0, theme="sepia")
    with pytest.raises(ValueError, match="no pattern"):
        viz.attention_figure(table, 0, 9)
    with pytest.raises(ValueError, match="column"):
        viz.layer_head_figure(table, "delta")


def test_token_loss_figure_one_run_and_several(model):
    tokens = model.to_tokens("abcab")
    losses = token_losses(model, tokens)
    bars = viz.token_loss_figure(losses).data
    assert len(bars) == 1 and list(bars[0].x) == ["1: b", "2: c", "3: a", "4: b"]  # at the token predicted
    np.testing.assert_allclose(bars[0].y, losses.loss)
    assert list(bars[0].marker.color) == [viz.CORRECT if c else viz.WRONG for c in losses.correct]
    assert [list(c) for c in bars[0].customdata] == [[p, t] for p, t in zip(losses.predicted, losses.token)]
    other = losses.assign(loss=losses.loss * 2)
    fig = viz.token_loss_figure({"clean": losses, "ablated": other}, theme="dark")
    assert [t.name for t in fig.data] == ["clean", "ablated"] and fig.layout.barmode == "group"
    np.testing.assert_allclose(fig.data[1].y, other.loss)


def test_residual_norms_figure_one_line_per_position_and_the_mean(model):
    norms = residual_norms(model, model.to_tokens("abca"))
    fig = viz.residual_norms_figure(norms)
    each, mean = fig.data
    n_layer = model.cfg.n_layers + 1
    assert len(each.x) == 4 * (n_layer + 1) and each.x[n_layer] is None  # a gap between positions
    assert each.text[0] == "0: a" and each.text[-1] == "3: a"
    expected = norms.groupby("layer").norm.mean().to_numpy()
    np.testing.assert_allclose(mean.y, expected, rtol=1e-6)
    assert list(mean.x) == ["resid_pre 0", "resid_pre 1", "final"]


def test_loss_curves_read_metrics_through_the_library(tmp_path):
    (tmp_path / "metrics.csv").write_bytes(b"\xff\xfe not a csv \x00")
    with pytest.raises(ValueError, match="not a readable metrics CSV"):
        viz.loss_curves(tmp_path)
    assert len(viz.loss_curves(tmp_path / "missing").data) == 0  # no metrics yet: an empty figure


def test_units_are_labelled_as_the_analysis_names_them(model):
    from workbench.analysis import parse_head, parse_unit

    sweep = ablation_sweep(model, torch.randint(0, model.cfg.d_vocab, (2, 5)))
    heatmap = viz.layer_head_figure(sweep).data[0]
    layer, head = parse_unit(heatmap.y[1])[0], parse_head(heatmap.x[2])
    row = sweep[(sweep.layer == layer) & (sweep["head"] == head)].iloc[0]
    assert row.label.startswith("L1H2") and heatmap.z[1][2] == pytest.approx(row.delta)


def test_sweep_heatmap_cells_are_clickable_points_with_values(model):
    sweep = ablation_sweep(model, torch.randint(0, model.cfg.d_vocab, (2, 5)))
    fig = viz.layer_head_figure(sweep, units="Δ nats", clickable=True)
    heatmap, cells = fig.data
    assert isinstance(cells, go.Scatter) and fig.layout.clickmode == "event+select" and fig.layout.hoverdistance == -1
    assert heatmap.texttemplate == "%{z:.2f}" and fig.layout.coloraxis.colorbar.title.text == "Δ nats"
    assert fig.layout.xaxis.title.text == "head" and fig.layout.yaxis.title.text == "layer"
    z = np.array(heatmap.z, dtype=float)
    assert isinstance(cells.customdata, tuple) or isinstance(cells.customdata, list)  # a list: not a typed array
    for (layer, head, value), x, y in zip(cells.customdata, cells.x, cells.y):
        assert (x, y) == (f"H{int(head)}", f"L{int(layer)}") and z[int(layer), int(head)] == pytest.approx(value)
    assert len(viz.layer_head_figure(sweep).data) == 1  # not clickable: the heatmap alone


def test_html_figures_are_made_drawable_without_their_folder(tmp_path):
    fig = go.Figure(go.Heatmap(z=[[1.5, 2.0], [0.5, 3.0]]), layout=dict(title="a figure"))
    fig.write_html(tmp_path / "f.html", include_plotlyjs="directory")
    html = (tmp_path / "f.html").read_text()
    assert 'src="plotly.min.js"' in html
    parsed = viz.figure_from_html(html)
    assert parsed.layout.title.text == "a figure"
    assert json.loads(parsed.to_json())["data"] == json.loads(fig.to_json())["data"]
    assert viz.figure_from_html(html + html) is None and viz.figure_from_html("<p>no figure</p>") is None

    inlined = viz.self_contained_html(html, tmp_path)  # no plotly.min.js in the folder: plotly's own bundle
    assert 'src="plotly.min.js"' not in inlined and len(inlined) > 1_000_000
    (tmp_path / "mine.js").write_text("var x = '</script>';")
    page = ('<script src="mine.js"></script><script src="https://cdn.example/x.js"></script>'
            '<script src="../escape.js"></script>')
    out = viz.self_contained_html(page, tmp_path)
    assert "<script>var x = '<\\/script>';</script>" in out
    assert 'src="https://cdn.example/x.js"' in out and 'src="../escape.js"' in out


def test_table_chart_never_stacks_bars_silently():
    table = pd.DataFrame({"variant": ["a", "a", "b", "b"], "seed": [0, 1, 0, 1], "loss": [1.0, 3.0, 2.0, 4.0]})
    fig, note = viz.table_chart(table, "variant", "loss")
    assert list(fig.data[0].y) == [2.0, 3.0] and "each bar is their mean" in note and "up to 2" in note
    fig, note = viz.table_chart(table, "variant", "loss", color="seed")
    assert note == "" and [t.name for t in fig.data] == ["0", "1"] and fig.layout.barmode == "group"
    fig, note = viz.table_chart(table, "variant", "loss", kind="scatter")
    assert note == "" and len(fig.data[0].y) == 4
    with pytest.raises(ValueError, match="no column"):
        viz.table_chart(table, "variant", "accuracy")


def test_difference_figures_are_diverging_around_zero(model):
    from workbench.analysis import AblationSpec, dla_difference, lens_difference, pattern_difference
    from workbench.analysis.ablation import ablation_hooks

    tokens = model.to_tokens("abcabca")
    with model.hooks(fwd_hooks=ablation_hooks(model, tokens, AblationSpec("head", 0, head=1))):
        lens_b, dla_b, pat_b = (logit_lens(model, tokens), direct_logit_attribution(model, tokens, 1, 2),
                                attention_patterns(model, tokens))
    lens = viz.lens_difference_figure(lens_difference(logit_lens(model, tokens), lens_b))
    assert lens.data[0].colorscale[0][1] == go.Heatmap(colorscale=viz.DIVERGING).colorscale[0][1]
    assert lens.data[0].zmid == 0 and "clean − ablated" in lens.layout.title.text
    dla = viz.dla_difference_figure(dla_difference(direct_logit_attribution(model, tokens, 1, 2), dla_b))
    assert [t.name for t in dla.data] == ["clean", "ablated", "clean − ablated"]
    pattern = viz.attention_figure(pattern_difference(attention_patterns(model, tokens), pat_b), 1, 0, difference=True)
    assert pattern.data[0].zmid == 0 and pattern.layout.title.text == "Attention change L1H0"


def test_readable_lens_and_dla(model):
    long = model.to_tokens("abcdefgh" * 3)  # 24 positions: text would shrink, so it moves to hover
    fig = viz.logit_lens_figure(logit_lens(model, long), color="kl")
    assert fig.data[0].texttemplate is None and "hover" in fig.layout.title.text
    assert fig.data[0].colorbar.title.text == "KL to final (nats)"
    frame = fig.layout.shapes[0]
    assert (frame.x0, frame.x1) == (22.5, 23.5)  # the last position is outlined
    short = viz.logit_lens_figure(logit_lens(model, model.to_tokens("abcd")))
    assert short.data[0].texttemplate == "%{text}"
    # a model without biases: its bias parts are zero by structure, so they are not drawn
    no_bias = wb.HookedDecoder(tiny(d_vocab=model.cfg.d_vocab, bias=False), tokenizer=model.tokenizer).eval()
    dla = direct_logit_attribution(no_bias, no_bias.to_tokens("abca"), 1, 2)
    assert (dla[dla.kind == "attn_bias"].attribution == 0).all()
    bars = viz.dla_figure(dla, "head")
    shown = {x for trace in bars.data for x in trace.x}
    assert not any("attn bias" in x for x in shown) and "L1H3" in shown and "embed" in shown
    assert {t.name for t in bars.data} >= {"attention head", "token embedding"} and len(bars.data) >= 2


def test_head_scores_and_patching_figures(model):
    from workbench.analysis import activation_patching, logit_diff_metric

    scores = head_scores(model, seq_len=6)
    fig = viz.head_scores_figure(scores)
    assert len(fig.data) == scores["kind"].nunique() and all(t.texttemplate == "%{z:.2f}" for t in fig.data)
    clean = model.to_tokens("abcab")
    corrupted = model.to_tokens("abdab")
    patch = activation_patching(model, clean, corrupted, logit_diff_metric(1, 2), sites=("resid_pre", "head"))
    labels = ["a", "b", "c", "a", "b"]
    by_pos = viz.patching_figure(patch, "resid_pre", tokens=labels, value="restored")
    assert list(by_pos.data[0].x) == ["0: a", "1: b", "2: c", "3: a", "4: b"] and list(by_pos.data[0].y) == ["L0", "L1"]
    grid = patch[patch.site == "resid_pre"].pivot(index="layer", columns="pos", values="restored").to_numpy()
    np.testing.assert_allclose(np.array(by_pos.data[0].z, dtype=float), grid)
    heads = viz.patching_figure(patch, "head")
    assert np.array(heads.data[0].z).shape == (model.cfg.n_layers, model.cfg.n_heads)
    with pytest.raises(ValueError, match="no rows for site"):
        viz.patching_figure(patch, "mlp_out")


def test_a_model_keeps_its_colour_across_figures(model):
    runs = pd.DataFrame({"step": [1, 2, 1, 2], "train_loss": [3.0, 2.0, 3.1, 2.2], "val_loss": [3.2, 2.1, 3.3, 2.4],
                         "run": ["a", "a", "b", "b"]})
    curves = viz.loss_curves(runs, colours={"a": "#111111", "b": "#222222"})
    assert [(t.name, t.line.color, t.line.dash) for t in curves.data] == [
        ("a train_loss", "#111111", "solid"), ("a val_loss", "#111111", "dash"),
        ("b train_loss", "#222222", "solid"), ("b val_loss", "#222222", "dash")]
    losses = token_losses(model, model.to_tokens("abcab"))
    bars = viz.token_loss_figure({"a": losses, "b": losses}, colours={"a": "#111111", "b": "#222222"})
    assert [t.marker.color for t in bars.data] == ["#111111", "#222222"]
    assert [t.marker.color for t in viz.token_loss_figure({"x": losses, "y": losses}).data] == list(viz.PAIR)


def test_token_hover_shows_predictions_and_attention_from_and_to(model):
    tokens = model.to_tokens("abcab")
    lens, patterns = logit_lens(model, tokens, k=3), attention_patterns(model, tokens)
    fig = viz.token_hover_figure(lens, patterns, layer=1, head=2)
    trace = fig.data[0]
    assert list(trace.text) == ["a", "b", "c", "a", "b"]
    final = lens[lens.layer == model.cfg.n_layers].sort_values("pos")
    last = final.iloc[-1]
    assert f"predicts: {last.top1!r} {last.top1_prob:.2f}" in trace.hovertext[-1]
    head = patterns[(patterns.layer == 1) & (patterns["head"] == 2)]
    best = head[head.query_pos == 4].nlargest(1, "attention").iloc[0]
    assert f"L1H2 attends to: '{int(best.key_pos)}: {best.key_token}' {best.attention:.2f}" in trace.hovertext[-1]
    first = head[head.key_pos == 0].nlargest(1, "attention").iloc[0]
    assert f"attended by: '{int(first.query_pos)}: {first.query_token}' {first.attention:.2f}" in trace.hovertext[0]
    with pytest.raises(ValueError, match="no pattern"):
        viz.token_hover_figure(lens, patterns, layer=0, head=9)


def test_layer_head_panels_wrap_into_rows(model):
    scores = head_scores(model, seq_len=6)
    fig = viz.head_scores_figure(scores)
    kinds = sorted(scores["kind"].unique())
    assert [a.text for a in fig.layout.annotations] == kinds
    assert {t.xaxis for t in fig.data} == {"x", "x2", "x3", "x4"} and fig.layout.yaxis3.title.text == "layer"
    assert fig.layout.yaxis.domain[0] > fig.layout.yaxis3.domain[1]  # kinds 3 and 4 sit below 1 and 2
