"""QK attribution over training (workbench/analysis/graphs/qk_training.py) and its figures.

On the shipped induction-attn2l snapshots: the table over_training builds at the last snapshot is
qk_attribution's on that snapshot's model, row for row, and agrees with the final checkpoint
(snapshots are stored in half precision); the score column is the model's own attention score
(``hook_attn_scores``); the summary's numbers are checked against a hand-made table; the loss drop
against a curve with a known steepest point; the figures carry the traces they claim.
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from workbench import analysis as an
from workbench import viz
from workbench.analysis.graphs.qk_training import (induction_qk_prompts, loss_drop, node_label, qk_pairs,
                                                   qk_summary)
from workbench.analysis.graphs.qk import QKContext
from workbench.stats import t_interval

RUN = Path(__file__).resolve().parents[1] / "checkpoints" / "induction-attn2l"


@pytest.fixture(scope="module")
def run():
    if not (RUN / "snapshots").is_dir():
        pytest.skip(f"{RUN} has no snapshots: make the checkpoints (docs/reference/checkpoints.md)")
    series = wb.load_series(RUN)
    prompts, queries, keys = induction_qk_prompts(series.config.d_vocab, n=2, half=8, seed=0)
    part = series[-2:]  # steps 1350, 1500
    table = an.over_training(part, qk_pairs, tokens=prompts, layer=1, head=[0, 4], query_pos=queries, key_pos=keys,
                             progress=False)
    return series, part, prompts, queries, keys, table


def _attributions(model, ids, heads, q, k):
    graph = an.attribution_graph(model, None, ids)
    context = QKContext(graph)
    return {h: an.qk_attribution(graph, 1, h, q, k, top=None, exact=0, context=context) for h in heads}


def test_the_last_snapshot_gives_qk_attribution_of_that_model_and_of_the_final_checkpoint(run):
    series, part, prompts, queries, keys, table = run
    assert sorted(table["step"].unique()) == part.steps == [1350, 1500]
    final, _ = wb.load_checkpoint(RUN)
    last = series.load(len(series) - 1)
    at_end = table[table["step"] == 1500]
    for i, (ids, q, k) in enumerate(zip(prompts, queries, keys)):
        references, finals = _attributions(last, ids, (0, 4), q, k), _attributions(final, ids, (0, 4), q, k)
        for head in (0, 4):
            ours = at_end[(at_end["prompt"] == i) & (at_end["head"] == head)].reset_index(drop=True)
            reference = references[head]
            assert list(ours["query_node"]) == list(reference["query_node"])
            assert list(ours["key_node"]) == list(reference["key_node"])
            np.testing.assert_allclose(ours["contribution"], reference["contribution"], rtol=0, atol=1e-6)
            assert ours["score"].iloc[0] == pytest.approx(reference.attrs["score"], abs=1e-6)
            # the final checkpoint: the same pairs on top, contributions equal up to the snapshot's half precision
            full = finals[head].set_index(["query_node", "key_node"])["contribution"]
            mine = ours.set_index(["query_node", "key_node"])["contribution"]
            assert list(mine.index[:3]) == list(full.index[:3])
            np.testing.assert_allclose(mine.loc[full.index], full, rtol=0, atol=0.02 * float(full.abs().max()))


def test_the_score_is_the_models_own_attention_score_and_the_pairs_sum_to_it(run):
    series, part, prompts, queries, keys, table = run
    model = series.load(len(series) - 1)
    for i, (ids, q, k) in enumerate(zip(prompts, queries, keys)):
        _, cache = model.run_with_cache(ids[None])
        for head in (0, 4):
            rows = table[(table["step"] == 1500) & (table["prompt"] == i) & (table["head"] == head)]
            score = float(cache["blocks.1.attn.hook_attn_scores"][0, head, q, k])
            assert rows["score"].iloc[0] == pytest.approx(score, abs=1e-4)
            assert rows["contribution"].sum() + rows["residual"].iloc[0] == pytest.approx(score, abs=1e-4)
            assert list(rows["rank"]) == list(range(1, len(rows) + 1))
            assert (rows["query_pos"] == q).all() and (rows["key_pos"] == k).all()


def test_induction_prompts_end_on_a_repeat_and_point_at_the_token_after_its_first_occurrence():
    prompts, queries, keys = induction_qk_prompts(64, n=20, half=16, seed=3)
    assert len(prompts) == len(queries) == len(keys) == 20
    for ids, q, k in zip(prompts, queries, keys):
        assert q == len(ids) - 1 and 1 <= k <= 16
        assert len(set(ids[:16].tolist())) == 16  # distinct, so the earlier occurrence is unique
        assert ids[q] == ids[k - 1]  # the query token occurred just before the key
    again, _, _ = induction_qk_prompts(64, n=20, half=16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(prompts, again))
    with_bos, q, k = induction_qk_prompts(16, n=4, half=7, seed=0, bos=15, n_ctx=16)
    assert all(int(p[0]) == 15 and 15 not in p[1:].tolist() for p in with_bos)
    assert all(p[a] == p[b - 1] for p, a, b in zip(with_bos, q, k))
    # a BOS id that is not the last id: never drawn into r either (it was: r drew from every id below d_vocab)
    first = induction_qk_prompts(8, n=40, half=7, seed=0, bos=0)[0]
    assert all(int(p[0]) == 0 and 0 not in p[1:].tolist() for p in first)
    with pytest.raises(ValueError, match="context"):
        induction_qk_prompts(64, half=16, n_ctx=16)
    with pytest.raises(ValueError, match="distinct"):
        induction_qk_prompts(8, half=16)


def test_node_labels_drop_the_position(run):
    assert node_label("token", -1, -1) == "token" and node_label("bias", -1, -1) == "bias"
    assert node_label("error", 0, -1) == "error L0" and node_label("feature", 1, 37) == "F1.37"
    with pytest.raises(ValueError, match="kind"):
        node_label("neuron", 0, 3)
    table = run[-1]
    for side in ("query", "key"):  # the labels are the node names without " @pos", heads written L0H2
        rows = table[[f"{side}_node", f"{side}_kind", f"{side}_label"]].drop_duplicates()
        assert set(rows[f"{side}_kind"]) == {"token", "head", "bias"}
        for node, kind, label in rows.itertuples(index=False):
            expected = {"token": "token", "bias": "bias"}.get(kind, node.split(" @")[0].replace(" ", ""))
            assert label == expected, node


def _table(rows):
    return pd.DataFrame(rows, columns=["step", "prompt", "layer", "head", "rank", "query_label", "key_label",
                                       "contribution", "score"])


def test_summary_against_a_hand_made_table():
    rows = []
    # step 0: the bias pair on top on both prompts; step 1: K-composition (token x L0H2) on top on one of two
    for p, (a, b) in enumerate([(3.0, 1.0), (2.0, 0.5)]):
        rows += [(0, p, 1, 0, 1, "bias", "bias", a, 5.0 + p), (0, p, 1, 0, 2, "token", "L0H2", b, 5.0 + p)]
    rows += [(1, 0, 1, 0, 1, "token", "L0H2", 4.0, 9.0), (1, 0, 1, 0, 2, "token", "L0H3", 1.0, 9.0),
             (1, 0, 1, 0, 3, "bias", "bias", 0.5, 9.0),
             (1, 1, 1, 0, 1, "bias", "bias", 2.0, 7.0), (1, 1, 1, 0, 2, "token", "L0H3", 1.5, 7.0)]
    table = _table(rows)
    one = qk_summary(table, pair=("token", "L0H2")).set_index("step")
    assert one.loc[0, "top_pair"] == "bias x bias" and one.loc[0, "top_pair_share"] == 1.0
    assert one.loc[0, "pair_contribution"] == pytest.approx(0.75) and one.loc[0, "pair_rank"] == 2
    ref = t_interval([1.0, 0.5])
    assert (one.loc[0, "pair_contribution_low"], one.loc[0, "pair_contribution_high"]) == pytest.approx((ref.low, ref.high))
    # step 1, prompt 1 lacks the pair: its contribution is unknown and its rank past the last kept (3)
    assert one.loc[1, "pair_is_top"] == 0.5 and one.loc[1, "pair_rank"] == pytest.approx(2.0)
    assert one.loc[1, "pair_contribution"] == pytest.approx(4.0)
    both = qk_summary(table, pair=[("token", "L0H2"), ("token", "L0H3")]).set_index("step")
    assert both.loc[1, "pair"] == "token x L0H2/L0H3"
    assert both.loc[1, "pair_contribution"] == pytest.approx((5.0 + 1.5) / 2)  # summed per prompt, then the mean
    assert both.loc[1, "pair_best_contribution"] == pytest.approx((4.0 + 1.5) / 2)
    assert both.loc[1, "pair_rank"] == pytest.approx(1.5) and both.loc[1, "score"] == pytest.approx(8.0)
    assert qk_summary(table[table["prompt"] == 0]).attrs["pair"] == "token x L0H2"  # default: the top pair at the end
    with pytest.raises(ValueError, match="lacks"):
        qk_summary(table.drop(columns="rank"))


def test_loss_drop_finds_the_steepest_fall():
    steps = np.arange(0, 2000, 10)
    loss = 4 - 1.5 / (1 + np.exp(-(steps - 700) / 20))  # steepest at 700, most of the drop within +-50
    phase = loss_drop(pd.DataFrame({"step": steps, "train_loss": loss}))
    assert phase["steepest"] == 700 and 640 <= phase["start"] < 700 < phase["end"] <= 760
    assert phase["drop"] == pytest.approx(1.5 * 0.6, abs=0.3)
    with pytest.raises(ValueError, match="train_loss"):
        loss_drop(pd.DataFrame({"step": [1, 2]}))
    few = pd.DataFrame({"step": steps[:6], "train_loss": loss[:6]})  # window 5: 7 values needed, and 7 suffice
    with pytest.raises(ValueError, match="at least 7 values"):
        loss_drop(few)
    loss_drop(pd.DataFrame({"step": steps[:7], "train_loss": loss[:7]}))


def test_the_loss_drop_of_the_shipped_run_is_the_documented_window(run):
    phase = loss_drop(run[0].history)
    assert (phase["start"], phase["steepest"], phase["end"]) == (640, 660, 690)  # docs/reference/qk-over-training.md
    assert phase["drop"] == pytest.approx(0.48, abs=0.005)


def test_the_figure_has_the_traces_it_claims(run):
    series, part, prompts, queries, keys, table = run
    summary = qk_summary(table, pair=[("token", "L0H2"), ("token", "L0H4")])
    phase = loss_drop(series.history)
    fig = viz.qk_over_training_figure(summary, head=4, phase=phase)
    names = [t.name for t in fig.data]
    pair = "token x L0H2/L0H4"
    for name in ("top pair", f"best of {pair}", f"{pair}, summed", f"{pair}: median rank", f"{pair}: share top",
                 "train_loss", "top pair, 95% interval"):
        assert name in names, (name, names)
    line = next(t for t in fig.data if t.name == "top pair")
    mine = summary[summary["head"] == 4].sort_values("step")
    assert list(line.x) == mine["step"].tolist() and np.allclose(line.y, mine["top_contribution"])
    share = next(t for t in fig.data if t.name.endswith("share top"))
    rank = next(t for t in fig.data if t.name.endswith("median rank"))
    assert share.yaxis != rank.yaxis and fig.layout[rank.yaxis.replace("y", "yaxis")].type == "log"
    assert len([s for s in fig.layout.shapes if s.type == "rect"]) == 3  # the loss drop on every panel
    assert fig.layout.shapes[0].x0 == phase["start"] and fig.layout.shapes[0].x1 == phase["end"]
    with pytest.raises(ValueError, match="head 7"):
        viz.qk_over_training_figure(summary, head=7)


def test_the_heatmap_is_the_pairs_and_its_cells_are_clickable(run):
    table = run[-1]
    rows = table[(table["step"] == 1500) & (table["prompt"] == 0) & (table["head"] == 4)].head(12)
    fig = viz.qk_heatmap_figure(rows)
    heat, cells = fig.data[0], fig.data[1]
    z = pd.DataFrame(heat.z, index=list(heat.y), columns=list(heat.x))
    for _, r in rows.iterrows():
        assert z.loc[r["query_node"], r["key_node"]] == pytest.approx(r["contribution"])
    assert sorted((q, k) for q, k, _ in cells.customdata) == sorted(zip(rows["query_node"], rows["key_node"]))
    assert fig.layout.clickmode == "event+select"


def test_over_training_takes_an_analysis_that_returns_a_graph(run):
    series, part, prompts, *_ = run
    nodes = an.over_training(part[-1:], an.attribution_graph, transcoders=None, prompt=prompts[0], progress=False)
    reference = an.attribution_graph(series.load(len(series) - 1), None, prompts[0]).to_frame()[0]
    assert (nodes["step"] == 1500).all()
    pd.testing.assert_frame_equal(nodes.drop(columns="step"), reference)


def test_a_clickable_attention_pattern_carries_each_edge_and_fills_its_axes(run):
    series, part, prompts, *_ = run
    patterns = an.attention_patterns(series.load(len(series) - 1), prompts[0][None])
    fig = viz.attention_figure(patterns, 1, 4, clickable=True)
    cells = next(t for t in fig.data if t.name == "cells")
    mine = patterns[(patterns["layer"] == 1) & (patterns["head"] == 4)]
    expected = {(int(q), int(k)): w for q, k, w in zip(mine["query_pos"], mine["key_pos"], mine["attention"])}
    assert {(q, k) for q, k, _ in cells.customdata} == set(expected)
    assert all(w == pytest.approx(expected[(q, k)]) for q, k, w in cells.customdata)
    n = len(prompts[0])
    assert list(fig.layout.xaxis.range) == [-0.5, n - 0.5] and list(fig.layout.yaxis.range) == [n - 0.5, -0.5]
    assert len(viz.attention_figure(patterns, 1, 4).data) == 1  # not clickable: the heatmap alone
