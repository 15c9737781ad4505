"""The grokking paper's Fourier analyses against hand computations and numpy's FFT, and the paper's layout
of the modular task (its loss shortcut equal to the full forward, values and gradients)."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.analysis import fourier, over_training
from workbench.checkpoint import read_meta
from workbench.data.modular import ModularTask, answer_logits
from workbench.training import TrainConfig, train

P = 7


def wave(k, x, p=P, kind="cos"):
    return (torch.cos if kind == "cos" else torch.sin)(2 * math.pi * k * x / p)


def grid(p=P):
    a, b = torch.meshgrid(torch.arange(p, dtype=torch.float64), torch.arange(p, dtype=torch.float64), indexing="ij")
    return a.flatten(), b.flatten()


def tiny_model(p=P, seed=0):
    cfg = wb.ModelConfig.from_preset("grokking-1l", d_model=32, d_mlp=64, d_vocab=p + 1, seed=seed)
    return wb.HookedDecoder(cfg).eval()


def test_basis_is_orthonormal_and_matches_numpy_fft():
    basis = fourier.fourier_basis(P).double()
    assert torch.allclose(basis @ basis.T, torch.eye(P, dtype=torch.float64), atol=1e-6)
    f = torch.randn(P, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    coeffs, spectrum = (basis @ f).numpy(), np.fft.rfft(f.numpy())
    assert coeffs[0] == pytest.approx(f.sum().item() / math.sqrt(P), abs=1e-6)
    for k in range(1, (P - 1) // 2 + 1):  # cos row: Re X_k * sqrt(2/p); sin row: -Im X_k * sqrt(2/p)
        assert coeffs[2 * k - 1] == pytest.approx(spectrum[k].real * math.sqrt(2 / P), abs=1e-5)
        assert coeffs[2 * k] == pytest.approx(-spectrum[k].imag * math.sqrt(2 / P), abs=1e-5)
    labels = fourier.basis_labels(P)
    assert labels.label.tolist() == ["const", "cos 1", "sin 1", "cos 2", "sin 2", "cos 3", "sin 3"]
    with pytest.raises(ValueError, match="odd p"):
        fourier.fourier_basis(8)


def test_embedding_norms_of_a_pure_wave():
    task = ModularTask(seed=0, p=P, layout="paper")
    model = tiny_model()
    x = torch.arange(P, dtype=torch.float64)
    u, v = torch.zeros(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    u[0], v[1] = 1.0, 1.0
    with torch.no_grad():  # every number's embedding is cos(w_2 x) u + sin(w_2 x) v: all of it frequency 2
        model.embed.W_E[:P] = (wave(2, x)[:, None] * u + wave(2, x, kind="sin")[:, None] * v).float()
    table = fourier.embedding_norms(model, task)
    embed = table[table.matrix == "embed"].set_index("frequency")
    assert embed.loc[2, "fraction"] == pytest.approx(1.0, abs=1e-6)
    # sum over x of cos^2 + sin^2 is p: the norm is sqrt(p)
    assert embed.loc[2, "norm"] == pytest.approx(math.sqrt(P), abs=1e-5)
    assert set(table.matrix) == {"embed", "unembed"} and len(table) == 2 * (P + 1) // 2


def test_gini_by_hand_and_by_mean_absolute_difference():
    assert fourier.gini([0, 0, 0, 1]) == pytest.approx(0.75)
    assert fourier.gini([2, 2, 2]) == pytest.approx(0.0)
    x = np.random.default_rng(0).random(50)
    mad = np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())  # the textbook definition
    assert fourier.gini(x) == pytest.approx(mad)
    with pytest.raises(ValueError, match="non-negative"):
        fourier.gini([-1, 2])


def test_frequency_fractions_of_hand_signals():
    a, b = grid()
    pure = wave(3, a) * wave(3, b) + 0.5  # all frequency 3, plus a mean that does not count
    mixed = wave(1, a) + 2 * wave(2, b, kind="sin")  # variance 1/2 in frequency 1 and 2 in frequency 2
    table = fourier.frequency_fractions(torch.stack([pure, mixed], dim=1).float(), P)
    assert table.frequency.tolist() == [3, 2]
    assert table.fraction.tolist() == pytest.approx([1.0, 2 / 2.5], abs=1e-5)
    assert table.variance.tolist() == pytest.approx([pure.var(unbiased=False).item(), mixed.var(unbiased=False).item()],
                                                    rel=1e-4)


def test_fourier_2d_matches_numpy():
    values = torch.randn(P * P, 2, generator=torch.Generator().manual_seed(1))
    coeffs = fourier.fourier_2d(values, P)
    spectrum = np.fft.fft2(values[:, 0].reshape(P, P).double().numpy())
    # const x const is the sum / p; cos a x const is Re(X[k, 0]) * sqrt(2) / p
    assert coeffs[0, 0, 0].item() == pytest.approx(spectrum[0, 0].real / P, abs=1e-5)
    assert coeffs[1, 0, 0].item() == pytest.approx(spectrum[1, 0].real * math.sqrt(2) / P, abs=1e-5)
    assert coeffs[0, 2, 0].item() == pytest.approx(-spectrum[0, 1].imag * math.sqrt(2) / P, abs=1e-5)


def test_restricted_and_excluded_logits_split_a_wave_of_a_plus_b_minus_c():
    a, b = grid()
    c = torch.arange(P, dtype=torch.float64)
    key = 3 * torch.cos(2 * math.pi * 2 * (a[:, None] + b[:, None] - c[None, :]) / P)  # the circuit's own shape
    other = 2 * wave(1, a)[:, None] * torch.ones(P, dtype=torch.float64)[None, :] + 0.7
    logits = (key + other).float()
    restricted, excluded = fourier.split_logits(logits, P, [2])
    mean = logits.mean(dim=0, keepdim=True)
    assert torch.allclose(restricted, mean + key.float(), atol=1e-4)
    assert torch.allclose(excluded, other.float(), atol=1e-4)
    centred_other = other - other.mean(dim=0, keepdim=True)
    expected = (key**2).sum() / ((key**2).sum() + (centred_other**2).sum())  # the two parts are orthogonal
    assert fourier.logit_variance_explained(logits, P, [2]) == pytest.approx(expected.item(), abs=1e-5)
    with pytest.raises(ValueError, match="not one of 1 .. 3"):
        fourier.sum_directions(P, [4])


def test_progress_measures_against_direct_computations():
    task = ModularTask(seed=0, p=P, layout="paper", train_fraction=0.5)
    model = tiny_model()
    row = fourier.progress_measures(model, task, [])
    seqs = task.sequences(task.train_pairs)
    logits = model(seqs[:, :-1])[:, -1, :P]
    assert row["train_loss"] == pytest.approx(F.cross_entropy(logits, seqs[:, -1]).item(), rel=1e-5)
    assert row["excluded_loss"] == pytest.approx(row["train_loss"], rel=1e-6)  # nothing removed
    assert {k: row[f"{k}_accuracy"] for k in ("train", "test")} == pytest.approx(
        {k.split("_")[0]: v for k, v in task.evaluate(model).items()})
    weights = sum(float((p.detach().double() ** 2).sum()) for p in model.parameters())
    assert row["sum_squared_weights"] == pytest.approx(weights)
    # keeping every frequency's a + b directions keeps the part of the logits that depends on a + b only
    full = fourier.progress_measures(model, task, [1, 2, 3])
    assert full["logit_fraction_key"] <= 1 + 1e-6 and full["excluded_loss"] != row["excluded_loss"]


def test_key_frequencies_from_a_neuron_table():
    table = pd.DataFrame({"neuron": range(6), "frequency": [5, 5, 5, 9, 2, 2], "fraction": [0.9, 0.8, 0.6, 0.95, 0.3, 0.9],
                          "variance": [1, 1, 1, 1, 1, 1e-9]})
    # neuron 4 explains too little, neuron 5 is silent; one neuron of 5 active is a share of 0.2
    assert fourier.clustered_frequencies(table, min_share=0.2) == [5, 9]
    assert fourier.clustered_frequencies(table, min_share=0.5) == [5]


def test_phase_epochs_of_a_hand_curve():
    curve = pd.DataFrame({"step": [0, 10, 20, 30, 40, 50],
                          "train_accuracy": [0.0, 0.5, 1.0, 1.0, 1.0, 1.0],
                          "test_accuracy": [0.0, 0.0, 0.0, 0.2, 0.7, 1.0],
                          "excluded_loss": [4.6, 3.0, 2.0, 5.0, 8.0, 9.0],
                          "restricted_loss": [4.6, 6.0, 7.0, 6.5, 2.0, 0.1]})
    assert fourier.phase_epochs(curve) == {"memorised": 20, "excluded_min": 20, "restricted_max": 20, "grokked": 40,
                                           "cleaned": 50}


def test_paper_layout_and_its_loss_shortcut_equal_the_full_forward():
    task = ModularTask(seed=0, p=P, layout="paper", full_batch=True, train_fraction=0.5)
    assert task.vocab_size == P + 1 and task.default_seq_len == 4
    batch = task.batch(len(task.train_pairs))
    assert torch.equal(batch, task.sequences(task.train_pairs)) and (batch[:, 2] == P).all()
    assert torch.equal(batch[:, 3], (batch[:, 0] + batch[:, 1]) % P)
    with pytest.raises(ValueError, match="set batch_size="):
        task.batch(3)
    with pytest.raises(ValueError, match="valid layouts"):
        ModularTask(layout="reversed")
    model = tiny_model().train()
    shortcut = task.loss(model, batch)
    grads = torch.autograd.grad(shortcut, list(model.parameters()), allow_unused=True)
    full = F.cross_entropy(model(batch[:, :-1])[:, -1, :P], batch[:, -1])
    full_grads = torch.autograd.grad(full, list(model.parameters()), allow_unused=True)
    assert shortcut.item() == pytest.approx(full.item(), rel=1e-6)
    for g, h in zip(grads, full_grads):
        assert (g is None and (h is None or not h.any())) or torch.allclose(g, h, atol=1e-6)
    assert torch.allclose(answer_logits(model, batch[:, :-1]), model(batch[:, :-1])[:, -1], atol=1e-6)
    exact = task.val_loss(model)
    test = task.sequences(task.test_pairs)
    assert exact == pytest.approx(F.cross_entropy(model(test[:, :-1])[:, -1, :P], test[:, -1]).item(), rel=1e-5)


def test_progress_measures_over_a_trained_run(tmp_path):
    task_options = dict(p=P, train_fraction=0.5, layout="paper", full_batch=True)
    task = ModularTask(seed=0, **task_options)
    config = TrainConfig(task="modular", task_options=task_options, steps=6, batch_size=len(task.train_pairs),
                         lr=1e-2, warmup_steps=1, min_lr_ratio=1.0, grad_clip=0.0, eval_every=0, log_every=1,
                         snapshots=[0, 3, 6], snapshot_fp16=True, threads=1)
    train(config, tiny_model().cfg, tmp_path / "run", progress=False)
    series = wb.load_series(tmp_path / "run")
    curve = over_training(series, fourier.progress_measures, task=task, key_freqs=[1], progress=False)
    assert curve.step.tolist() == [0, 3, 6] and curve.train_loss.iloc[-1] < curve.train_loss.iloc[0]
    norms = over_training(series, fourier.embedding_norms, task=task, progress=False)
    assert len(norms) == 3 * 2 * (P + 1) // 2


SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "modular-grokking"


@pytest.mark.skipif(not (SHIPPED / "snapshots").is_dir(), reason="checkpoints/modular-grokking is not built "
                    "(scripts/make_grokking_checkpoint.py)")
def test_the_shipped_grokking_run_grokked_on_a_few_frequencies():
    series = wb.load_series(SHIPPED)
    meta = read_meta(SHIPPED)
    task = ModularTask(**meta["task_options"])
    assert task.p == 113 and task.layout == "paper" and len(series) >= 8
    final = series.load(-1)
    keys = fourier.key_frequencies(final, task)
    end = fourier.progress_measures(final, task, keys)
    start = fourier.progress_measures(series.load(0), task, keys)
    assert end["test_accuracy"] > 0.99 and start["test_accuracy"] < 0.05  # it generalised, from chance
    assert 3 <= len(keys) <= 8 and end["logit_fraction_key"] > 0.5
    assert end["gini_embed"] > start["gini_embed"] + 0.3  # the embedding became sparse in the Fourier basis
    assert end["excluded_loss"] > end["train_loss"] * 100  # without the key frequencies the model fails


def test_grokking_figures_from_their_tables():
    from workbench import viz

    curve = pd.DataFrame({"seed": [0, 0, 1, 1], "step": [0, 10, 0, 10], "train_loss": [4.0, 0.1, 4.0, 0.2],
                          "test_loss": [4.0, 3.0, 4.0, 1.0]})
    fig = viz.grokking_figure(curve, {"memorised": 10, "grokked": float("nan")})
    assert [t.name for t in fig.data] == ["train_loss, seed 0", "test_loss, seed 0", "train_loss, seed 1",
                                          "test_loss, seed 1"]
    assert [s.x0 for s in fig.layout.shapes] == [10]  # a phase never reached draws no line
    with pytest.raises(ValueError, match="restricted_loss"):
        viz.grokking_figure(curve, columns=["restricted_loss"])
    norms = pd.DataFrame({"step": [0, 0, 5, 5], "matrix": "embed", "frequency": [0, 1, 0, 1], "norm": [1.0, 2.0, 0.5, 3.0]})
    fig = viz.fourier_norms_figure(norms)
    assert len(fig.data) == 2 and list(fig.data[1].y) == [0.5, 3.0]
    with pytest.raises(ValueError, match="no rows for matrix"):
        viz.fourier_norms_figure(norms, matrix="unembed")
