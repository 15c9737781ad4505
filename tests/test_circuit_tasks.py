"""A checkpoint's prompt sets for circuit work (analysis.circuits.tasks), one method run, two
circuits' agreement, progress callbacks of the methods, and the figures the Circuit and
Training pages draw (viz.circuit_graph_figure, mark_step, runs_over_training_figure)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from factories import tiny
from workbench import viz
from workbench.analysis.circuits import (
    Circuit,
    circuit_agreement,
    circuit_prompts,
    discover_circuit,
    edge_attribution,
    faithfulness,
    prompt_sources,
    prompt_spec,
    run_method,
)
from workbench.checkpoint import read_meta
from workbench.planted import known_circuit, load_planted, spec_metric, spec_prompts

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
needs_planted = pytest.mark.skipif(not (CHECKPOINTS / "planted-hand-induction").is_dir(),
                                   reason="the planted checkpoints are missing: scripts/make_planted.py builds them")


def induction_model():
    torch.manual_seed(0)
    return wb.HookedDecoder(tiny(attn_only=True, d_vocab=20, n_ctx=16)).eval()


def test_an_induction_checkpoint_gets_repeated_tokens_scored_on_the_second_copy():
    model = induction_model()
    meta = {"task": "induction", "task_options": {"vocab": 20}}
    assert list(prompt_sources(meta, model.cfg)) == ["repeat"]
    spec = prompt_spec(meta, model.cfg)
    assert spec == {"kind": "repeat", "half": 8, "vocab": 20, "bos": None, "distinct": True}
    prompts = circuit_prompts(model, meta, "repeat", n=4, seed=3)
    clean, corrupted = prompts.tokens()
    assert clean.shape == corrupted.shape == (4, 16)
    assert torch.equal(clean[:, :8], clean[:, 8:]) and not torch.equal(clean, corrupted)
    reference = spec_prompts(spec, 4, 3)
    assert torch.equal(clean, reference[0]) and torch.equal(corrupted, reference[1])
    assert prompts.metrics == ("answer_logprob", "kl") and prompts.metric("kl") == "kl"
    logits = model(clean)
    # The metric: mean log-probability of the next token of the copy, positions 8..14 (independently computed).
    logp = logits.log_softmax(-1)
    expected = torch.stack([logp[:, p].gather(-1, clean[:, p + 1, None]) for p in range(8, 15)]).mean()
    torch.testing.assert_close(prompts.metric("answer_logprob")(logits), expected)
    pos, answer, wrong = prompts.target(1)
    assert (pos, answer, wrong) == (14, int(clean[1, 15]), None)
    with pytest.raises(ValueError, match="kind"):
        prompts.metric("logit_diff")
    with pytest.raises(ValueError, match=r"source must be one of .*'repeat'"):
        circuit_prompts(model, meta, "ioi")
    assert prompt_sources({"task": "text"}, model.cfg) == {}


@needs_planted
def test_planted_checkpoints_offer_their_own_prompts_and_known_circuits():
    for name, source in (("planted-hand-induction", "repeat"), ("planted-iit-modular", "modular"),
                         ("induction-attn2l", "repeat")):
        path = CHECKPOINTS / name
        model, _ = wb.load_checkpoint(path)
        meta = read_meta(path)
        assert list(prompt_sources(meta, model.cfg, path)) == [source]
        planted = load_planted(name.removeprefix("planted-"))
        prompts = circuit_prompts(model, meta, source, n=6, seed=2, path=path)
        clean, corrupted = planted.prompts(6, seed=2)
        assert prompts.clean == tuple(map(tuple, clean.tolist())) and prompts.corrupted == tuple(map(tuple, corrupted.tolist()))
        logits = model(clean)
        torch.testing.assert_close(prompts.metric("answer_logprob")(logits), planted.metric(clean)(logits))
        truth, info = known_circuit(model, path)
        assert truth == planted.truth and info["established_by"] == planted.established_by
    stories = CHECKPOINTS / "stories-2020"
    if stories.is_dir():
        model, _ = wb.load_checkpoint(stories)
        assert known_circuit(model, stories) is None
        assert set(prompt_sources(read_meta(stories), model.cfg, stories)) == {"ioi", "possession"}


@needs_planted
def test_run_method_matches_the_library_calls_it_wraps_and_reports_progress():
    path = CHECKPOINTS / "planted-iit-induction"
    model, _ = wb.load_checkpoint(path)
    prompts = circuit_prompts(model, read_meta(path), "repeat", n=6, seed=0, path=path)
    ds, metric = prompts.tokens(), prompts.metric("answer_logprob")
    for method in ("exact", "eap", "eap-ig", "acdc"):
        calls = []
        run = run_method(model, prompts, "answer_logprob", method=method, threshold=0.05, steps=3,
                         progress=lambda done, total: calls.append((done, total)))  # noqa: B023 (called within this iteration)
        direct = discover_circuit(model, ds, metric, method=method, threshold=0.05, steps=3)
        assert run.circuit.edges == direct.edges
        assert run.faithfulness == pytest.approx(faithfulness(model, direct, ds, metric) if len(direct) else 0.0)
        assert len(calls) >= 1 and calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == sorted(d for d, _ in calls)
        if method != "acdc":
            table = edge_attribution(model, ds, metric, method=method, steps=3)
            np.testing.assert_allclose(run.table["score"].to_numpy(), table["score"].to_numpy(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="method"):
        run_method(model, prompts, "answer_logprob", method="magic")


def test_circuit_agreement_counts_shared_edges_and_rank_correlation():
    model = induction_model()
    graph = wb.analysis.ComputationGraph(model)
    labels = graph.edge_labels[:6]
    a = Circuit.from_edges(model, labels[:4], scores={e: float(i) for i, e in enumerate(labels)})
    b = Circuit.from_edges(model, labels[2:6], scores={e: float(-i) for i, e in enumerate(labels)})
    agree = circuit_agreement(a, b)
    assert (agree["shared"], agree["only_a"], agree["only_b"]) == (2, 2, 2)
    assert agree["jaccard"] == pytest.approx(2 / 6) and agree["spearman"] == pytest.approx(-1.0)
    other = wb.HookedDecoder(tiny(attn_only=True, n_layers=1))
    with pytest.raises(ValueError, match="different models"):
        circuit_agreement(a, Circuit.from_edges(other, []))


def test_circuit_graph_figure_carries_node_labels_for_clicks_and_rings_the_selected_one():
    model = induction_model()
    circuit = Circuit.from_edges(model, ["embed -> L0H1.v", "L0H1 -> L1H2.k", "L1H2 -> logits"])
    fig = viz.circuit_graph_figure(circuit.to_frame(), selected="L0H1")
    nodes = fig.data[-1]
    assert [c[0] for c in nodes.customdata] == list(nodes.text) == ["embed", "L0H1", "L1H2", "logits"]
    ring = fig.data[-2]
    i = list(nodes.text).index("L0H1")
    assert (ring.x[0], ring.y[0]) == (nodes.x[i], nodes.y[i]) and fig.layout.clickmode == "event+select"
    assert len(viz.circuit_graph_figure(circuit.to_frame()).data) == len(fig.data) - 1


def test_mark_step_and_runs_compared_over_training():
    rows = [dict(step=s, layer=l, head=h, kind=k, score=s / 100 + l * 0.1 + h * 0.01)
            for s in (0, 10, 20) for l in range(2) for h in range(2) for k in ("induction", "previous_token")]
    a = pd.DataFrame(rows)
    a.attrs["history"] = {"step": [0, 10, 20], "train_loss": [3.0, 2.0, 1.0]}
    b = a.assign(score=a["score"] * 2)
    b.attrs["history"] = {"step": [0, 10, 20], "train_loss": [3.5, 2.5, 1.5]}
    fig = viz.runs_over_training_figure({"A": a, "B": b}, step=10)
    names = [t.name for t in fig.data]
    assert names == ["A: induction", "A: previous_token", "A: train_loss", "B: induction", "B: previous_token",
                     "B: train_loss"]
    best = fig.data[3]  # B's best induction head at each step: L1H1, score 2 * (s/100 + 0.11)
    assert list(best.x) == [0, 10, 20] and list(best.text) == ["L1H1"] * 3
    np.testing.assert_allclose(best.y, [0.22, 0.42, 0.62])
    assert fig.layout.shapes[0].x0 == fig.layout.shapes[0].x1 == 10
    assert fig.layout.annotations[-1].text == "step 10"
    plain = viz.mark_step(viz.loss_curves(pd.DataFrame(a.attrs["history"])), 20, label="here")
    assert plain.layout.shapes[0].x0 == 20 and plain.layout.annotations[0].text == "here"
    with pytest.raises(ValueError, match="empty"):
        viz.runs_over_training_figure({})
    with pytest.raises(ValueError, match="no column 'head'"):
        viz.runs_over_training_figure({"A": a.drop(columns="head")})


def test_spec_prompts_refuse_an_unknown_kind():
    with pytest.raises(ValueError, match="spec kind must be one of"):
        spec_prompts({"kind": "ioi"}, 2)
    with pytest.raises(ValueError, match="batch"):
        spec_prompts({"kind": "modular", "p": 5}, 0)
    clean, _ = spec_prompts({"kind": "modular", "p": 5}, 3, seed=1)
    metric = spec_metric({"kind": "modular", "p": 5}, clean)
    logits = torch.zeros(3, 4, 7)
    assert float(metric(logits)) == pytest.approx(-np.log(7))
