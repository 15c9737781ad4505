"""SynthSAEBench machinery: the Matryoshka BatchTopK and ReLU (L1) losses against SAE Lens' (a reimplementation from its
source here, and SAE Lens itself where it imports), the evals against hand computations, the
Hungarian matching against brute force, and the refusals."""

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.analysis import synth_bench
from workbench.analysis.dictionaries import DICTIONARIES, DictionaryConfig, load_dictionary, make_dictionary, save_dictionary
from workbench.analysis.dictionaries.trainer import SAETrainConfig, _losses

REPO = Path(__file__).resolve().parents[1]
D_IN, D_SAE, K, WIDTHS = 12, 32, 3, [4, 8, 16, 32]


def perturbed(cfg: DictionaryConfig, seed: int):
    """A dictionary of ``cfg`` with seeded weights off their initial values (biases nonzero)."""
    sae = make_dictionary(cfg)
    sae.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        sae.W_enc.add_(0.3 * torch.randn(sae.W_enc.shape, generator=g))
        sae.b_enc.copy_(0.1 * torch.randn(D_SAE, generator=g))
        sae.b_dec.copy_(0.1 * torch.randn(D_IN, generator=g))
    return sae


def matryoshka(seed=0):
    return perturbed(DictionaryConfig(kind="matryoshka_batchtopk", d_in=D_IN, d_sae=D_SAE, k=K,
                                      extra={"matryoshka_widths": WIDTHS}), seed)


def reference_loss(W_enc, b_enc, W_dec, b_dec, x, k, widths):
    """SAE Lens 6.54's MatryoshkaBatchTopKTrainingSAE.training_forward_pass with no dead latents, from
    its source: BatchTopK keeps the int(k * rows) largest ReLU'd pre-activations of the batch; the loss
    is the full reconstruction's squared error (summed over dims, mean over rows) plus each inner
    level's, decoded from the first ``width`` latents cumulatively on top of b_dec."""
    pre = (x - b_dec) @ W_enc + b_enc
    acts = pre.relu().flatten()
    top = acts.topk(int(k * x.shape[0]))
    acts = torch.zeros_like(acts).scatter(-1, top.indices, top.values).view(pre.shape)
    loss = ((acts @ W_dec + b_dec) - x).pow(2).sum(-1).mean()
    decoded, previous = b_dec, 0
    for width in widths[:-1]:
        decoded = acts[:, previous:width] @ W_dec[previous:width] + decoded
        loss = loss + (decoded - x).pow(2).sum(-1).mean()
        previous = width
    return loss, acts


def test_matryoshka_loss_and_gradients_match_saelens_source():
    sae = matryoshka()
    x = torch.randn(20, D_IN, generator=torch.Generator().manual_seed(5))
    config = SAETrainConfig(kind="matryoshka_batchtopk", d_sae=D_SAE, k=float(K))
    terms = _losses(sae, x, x, config, step=0, dead=torch.zeros(D_SAE, dtype=torch.bool))
    terms["loss"].backward()
    ours = {n: p.grad.clone() for n, p in sae.named_parameters()}
    params = {n: p.detach().clone().requires_grad_(True) for n, p in sae.named_parameters()}
    loss, acts = reference_loss(params["W_enc"], params["b_enc"], params["W_dec"], params["b_dec"], x, K, WIDTHS)
    loss.backward()
    torch.testing.assert_close(terms["loss"].detach(), loss.detach(), rtol=1e-5, atol=1e-6)
    assert terms["loss"] > terms["mse"] * 1.01  # the inner levels count
    torch.testing.assert_close(terms["acts"].dense(D_SAE).detach(), acts.detach(), rtol=1e-6, atol=1e-6)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_matryoshka_is_registered_and_round_trips_in_saelens_format(tmp_path):
    assert "matryoshka_batchtopk" in DICTIONARIES
    sae = matryoshka()
    with torch.no_grad():
        sae.threshold.fill_(0.2)
    save_dictionary(sae, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu"  # as SAE Lens saves Matryoshka BatchTopK
    back = load_dictionary(tmp_path / "m")
    assert type(back) is type(sae) and back.widths == WIDTHS
    x = torch.randn(9, D_IN)
    torch.testing.assert_close(back(x), sae(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        make_dictionary(DictionaryConfig(kind="matryoshka_batchtopk", d_in=4, d_sae=8, k=1,
                                         extra={"matryoshka_widths": [4, 2, 8]}))


def _sae_lens():
    module, why = synth_bench.import_sae_lens()
    if module is None:
        pytest.skip(f"SAE Lens parity needs sae_lens importable (it cannot share this venv: it pins "
                    f"transformer-lens < 4): {why}")
    return module


def test_matryoshka_parity_with_saelens_itself():
    _sae_lens()
    from sae_lens import MatryoshkaBatchTopKTrainingSAE, MatryoshkaBatchTopKTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput

    sae = matryoshka()
    theirs = MatryoshkaBatchTopKTrainingSAE(MatryoshkaBatchTopKTrainingSAEConfig(
        d_in=D_IN, d_sae=D_SAE, k=K, matryoshka_widths=list(WIDTHS), rescale_acts_by_decoder_norm=False))
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            getattr(theirs, name).copy_(getattr(sae, name))
    x = torch.randn(20, D_IN, generator=torch.Generator().manual_seed(5))
    out = theirs.training_forward_pass(TrainStepInput(sae_in=x, coefficients={}, dead_neuron_mask=None,
                                                      n_training_steps=0, is_logging_step=False))
    terms = _losses(sae, x, x, SAETrainConfig(kind="matryoshka_batchtopk", d_sae=D_SAE, k=float(K)), 0,
                    torch.zeros(D_SAE, dtype=torch.bool))
    torch.testing.assert_close(terms["loss"].detach(), out.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms["acts"].dense(D_SAE).detach(), out.feature_acts.detach(), rtol=1e-6, atol=1e-6)


# ---- ReLU (L1): the same objective as SAE Lens' StandardTrainingSAE ------------------------------------
def relu_sae(seed=0):
    return perturbed(DictionaryConfig(kind="relu", d_in=D_IN, d_sae=D_SAE), seed)


def standard_reference_loss(W_enc, b_enc, W_dec, b_dec, x, l1):
    """SAE Lens 6.54's StandardTrainingSAE.training_forward_pass, from its source: ReLU((x - b_dec) W_enc
    + b_enc), squared error summed over dims and averaged over rows, plus l1 * the mean over rows of the
    L1 norm of the activations weighted by their decoder rows' norms (its decoder is unconstrained)."""
    acts = ((x - b_dec) @ W_enc + b_enc).relu()
    mse = ((acts @ W_dec + b_dec) - x).pow(2).sum(-1).mean()
    return mse + l1 * (acts * W_dec.norm(dim=1)).norm(p=1, dim=-1).mean(), acts


def test_relu_loss_and_gradients_match_saelens_standard_source():
    """Our ReLU trains on SAE Lens' objective: its plain L1 equals SAE Lens' decoder-norm-weighted L1
    because training keeps the decoder rows at unit norm (checked here after real steps)."""
    sae = relu_sae()
    x = torch.randn(20, D_IN, generator=torch.Generator().manual_seed(5))
    config = SAETrainConfig(kind="relu", d_sae=D_SAE, sparsity_coefficient=2.5, steps=100)
    terms = _losses(sae, x, x, config, step=config.steps, dead=torch.zeros(D_SAE, dtype=torch.bool))
    terms["loss"].backward()
    ours = {n: p.grad.clone() for n, p in sae.named_parameters()}
    params = {n: p.detach().clone().requires_grad_(True) for n, p in sae.named_parameters()}
    loss, acts = standard_reference_loss(*(params[n] for n in ("W_enc", "b_enc", "W_dec", "b_dec")), x, 2.5)
    loss.backward()
    torch.testing.assert_close(terms["loss"].detach(), loss.detach(), rtol=1e-5, atol=1e-6)
    assert float(terms["sparsity_loss"].detach()) > 0.1 * float(terms["mse"].detach())  # the penalty is a real part of the sum
    torch.testing.assert_close(terms["acts"].detach(), acts.detach())
    # the gradients differ only along each decoder row, which the trainer removes before the step
    for name in ("W_enc", "b_enc", "b_dec"):
        torch.testing.assert_close(ours[name], params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    W = sae.W_dec.detach()
    radial = lambda g: g - (g * W).sum(-1, keepdim=True) * W  # noqa: E731
    torch.testing.assert_close(radial(ours["W_dec"]), radial(params["W_dec"].grad), rtol=1e-4, atol=1e-6)


def test_relu_training_keeps_unit_decoder_rows():
    """What makes the plain L1 the weighted one: after real training steps every decoder row has norm 1."""
    from workbench.analysis.dictionaries import train_sae
    from workbench.analysis.store import TensorActivations

    x = torch.randn(512, D_IN, generator=torch.Generator().manual_seed(3)) * 3 + 1
    sae = train_sae(TensorActivations({"x": x}, rows_per_shard=512), kind="relu", d_sae=D_SAE, steps=20,
                    batch_size=64, lr=1e-2, eval_rows=64, progress=False, device="cpu", save_train_state=False)
    # the saved dictionary takes raw activations (the input scale is folded into W_enc/b_enc/b_dec only)
    torch.testing.assert_close(sae.W_dec.norm(dim=1), torch.ones(D_SAE), rtol=0, atol=1e-5)


def test_relu_parity_with_saelens_itself():
    _sae_lens()
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput

    sae = relu_sae()
    theirs = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, l1_coefficient=2.5))
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            getattr(theirs, name).copy_(getattr(sae, name))
    x = torch.randn(20, D_IN, generator=torch.Generator().manual_seed(5))
    out = theirs.training_forward_pass(TrainStepInput(sae_in=x, coefficients={"l1": 2.5}, dead_neuron_mask=None,
                                                      n_training_steps=0, is_logging_step=False))
    config = SAETrainConfig(kind="relu", d_sae=D_SAE, sparsity_coefficient=2.5, steps=100)
    terms = _losses(sae, x, x, config, config.steps, torch.zeros(D_SAE, dtype=torch.bool))
    torch.testing.assert_close(terms["loss"].detach(), out.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms["sparsity_loss"].detach(), out.losses["l1_loss"].detach(), rtol=1e-5, atol=1e-6)


# ---- the evals by hand ------------------------------------------------------------------------------
class FixedSAE:
    """Latents given by hand; decode is latents @ W_dec (no bias)."""

    def __init__(self, W_dec, latents):
        self.W_dec, self.latents = W_dec, latents

    def encode(self, x):
        return self.latents[: len(x)]

    def decode(self, latents):
        return latents @ self.W_dec


def test_evals_agree_with_a_hand_computation():
    gt = torch.eye(3)  # three true features, one per axis
    W_dec = torch.tensor([[1.0, 0, 0], [0.6, 0.8, 0]])  # latent 0 is feature 0; latent 1 leans to feature 1
    gt_acts = torch.tensor([[1.0, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0]])
    latents = torch.tensor([[1.0, 0], [0, 1], [0, 1], [0, 1]])
    x = gt_acts @ gt + torch.tensor([0.0, 0, 1])
    m = synth_bench.evaluate(FixedSAE(W_dec, latents), gt, x, gt_acts)
    # MCC: latent 0 -> feature 0 (|cos| 1), latent 1 -> feature 1 (0.8): (1 + 0.8) / 2
    assert m["mcc"] == pytest.approx(0.9) and m["uniqueness"] == 1.0
    # latent 0 vs feature 0 (fires rows 0, 1): TP 1, FP 0, FN 1, TN 2 -> P 1, R 1/2, F1 2/3
    # latent 1 vs feature 1 (fires rows 1, 2): TP 2, FP 1, FN 0, TN 1 -> P 2/3, R 1, F1 4/5
    assert m["classification/precision"] == pytest.approx((1 + 2 / 3) / 2)
    assert m["classification/recall"] == pytest.approx(0.75)
    assert m["classification/f1_score"] == pytest.approx((2 / 3 + 0.8) / 2)
    assert m["classification/accuracy"] == pytest.approx(0.75)
    assert m["true_l0"] == 1.0 and m["sae_l0"] == 1.0 and m["dead_latents"] == 0
    out = latents @ W_dec
    assert m["shrinkage"] == pytest.approx(float((out.norm(dim=1) / x.norm(dim=1)).mean()))
    variance = float(((x - x.mean(0)) ** 2).sum(1).mean())
    assert m["explained_variance"] == pytest.approx(1 - float(((x - out) ** 2).sum(1).mean()) / variance)
    # both latents nearest feature 0: uniqueness 1/2, MCC matches them to features 0 and 1: (1 + 0.6) / 2
    W2 = torch.tensor([[1.0, 0, 0], [0.8, 0.6, 0]])
    assert synth_bench.feature_uniqueness(W2, gt) == 0.5
    assert synth_bench.mean_correlation_coefficient(W2, gt) == pytest.approx(0.8)


@pytest.mark.parametrize("shape", [(3, 3), (3, 5), (5, 3), (1, 4), (6, 6)])
def test_hungarian_finds_the_brute_force_optimum(shape):
    rng = np.random.default_rng(sum(shape))
    for _ in range(5):
        cost = rng.random(shape)
        rows, cols = synth_bench.hungarian(cost)
        n, m = shape
        small, large = min(n, m), max(n, m)
        c = cost if n <= m else cost.T
        best = min(sum(c[i, p[i]] for i in range(small)) for p in itertools.permutations(range(large), small))
        assert len(rows) == small and len(set(cols)) == small and len(set(rows)) == small
        assert cost[rows, cols].sum() == pytest.approx(best)


def test_evals_match_saelens_evals():
    _sae_lens()
    from sae_lens.synthetic import FeatureDictionary, eval_sae_on_synthetic_data

    torch.manual_seed(0)
    fd = FeatureDictionary(num_features=24, hidden_dim=8, bias=1.0, seed=0)
    gen = synth_bench.SimpleSynthModel(24, 8, seed=0)
    acts = gen.sample_with_features(3000)[1]
    x = fd(acts).detach()
    sae = make_dictionary(DictionaryConfig(kind="topk", d_in=8, d_sae=20, k=3))

    class Replay:
        at = 0

        def sample(self, n):
            Replay.at += n
            return acts[Replay.at - n: Replay.at]

    theirs = synth_bench.saelens_result_dict(eval_sae_on_synthetic_data(sae, fd, Replay(), num_samples=3000,
                                                                        batch_size=1000))
    ours = synth_bench.evaluate(sae, fd.feature_vectors.detach(), x, acts, batch_size=700)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


# ---- refusals -----------------------------------------------------------------------------------------
def test_settings_past_the_ram_are_refused_before_allocation_naming_the_size():
    with pytest.raises(MemoryError, match=r"features x hidden size.*GiB of RAM is available"):
        synth_bench.check_fits(10**7, 10**5, 1024, 1000, 100, ram=8 * 2**30)
    synth_bench.check_fits(64, 16, 64, 1000, 100, ram=8 * 2**30)  # small settings pass


def test_unknown_kind_lists_the_registered_ones(capsys):
    sys.path.insert(0, str(REPO / "experiments"))
    import synth_sae_bench

    with pytest.raises(SystemExit, match="registered kinds are .*matryoshka_batchtopk"):
        synth_sae_bench.main(["--quick", "--kinds", "relu,gated", "--out", "/nonexistent/never-written"])
    with pytest.raises(MemoryError, match="features x hidden size"):
        synth_sae_bench.main(["--features", str(10**8), "--hidden", str(10**5), "--out", "/nonexistent/never-written"])


# ---- equal-L0 comparison --------------------------------------------------------------------------------
def test_at_l0_interpolates_in_log_l0_like_numpy_and_refuses_to_extrapolate():
    runs = [{"sae_l0": 12.0, "f1": 0.2, "mcc": 0.5}, {"sae_l0": 2.0, "f1": 0.6, "mcc": 0.9},
            {"sae_l0": 5.0, "f1": 0.5, "mcc": 0.7}]
    got = synth_bench.at_l0(runs, 4.0, ["f1", "mcc"])
    xs = np.log([2.0, 5.0, 12.0])
    assert got["f1"] == pytest.approx(np.interp(np.log(4.0), xs, [0.6, 0.5, 0.2]))
    assert got["mcc"] == pytest.approx(np.interp(np.log(4.0), xs, [0.9, 0.7, 0.5]))
    assert synth_bench.at_l0(runs, 5.0, ["f1"])["f1"] == pytest.approx(0.5)  # a run exactly at the target
    assert synth_bench.at_l0(runs, 1.5, ["f1"]) is None and synth_bench.at_l0(runs, 20.0, ["f1"]) is None
    with pytest.raises(ValueError, match="positive"):
        synth_bench.at_l0(runs, 0.0, ["f1"])


def test_equal_l0_rows_and_paired_verdicts():
    import pandas as pd

    sys.path.insert(0, str(REPO / "experiments"))
    import synth_sae_bench as bench

    metrics = ["classification/f1_score", "mcc", "sae_l0"]
    rows = []
    for seed in range(3):
        for trainer, f1 in (("workbench", 0.6), ("sae_lens", 0.4)):
            # relu swept: L0 2 and 8 bracket k = 4 (F1 halfway in log L0); topk at k exactly
            rows += [{"trainer": trainer, "kind": "relu", "seed": seed, "k": 4, "coefficient": c, "sae_l0": l0,
                      "classification/f1_score": f, "mcc": 0.5 + 0.01 * seed}
                     for c, l0, f in ((3.0, 2.0, f1 + 0.1), (1.0, 8.0, f1 - 0.1))]
            rows.append({"trainer": trainer, "kind": "topk", "seed": seed, "k": 4, "coefficient": 0.0,
                         "sae_l0": 4.0 if trainer == "workbench" else 5.0, "classification/f1_score": f1 + seed / 100,
                         "mcc": 0.7})
    matched = bench.equal_l0(pd.DataFrame(rows), metrics)
    relu = matched[matched.kind == "relu"].set_index(["trainer", "seed"])
    assert relu.loc[("workbench", 0), "classification/f1_score"] == pytest.approx(0.6)
    assert (relu.matched == "interpolated").all() and (relu.sae_l0 == 4).all()
    topk = matched[matched.kind == "topk"].set_index(["trainer", "seed"])
    assert topk.loc[("sae_lens", 1), "matched"].startswith("L0 5 off k")  # 25% off: not compared
    assert np.isnan(topk.loc[("sae_lens", 1), "mcc"])
    verdicts = bench.verdicts(matched, ["relu", "topk"]).set_index("kind")
    assert verdicts.loc["relu", "F1 verdict"] == "workbench better"  # +0.2 on every seed
    assert verdicts.loc["relu", "MCC verdict"] == "no difference detected"  # equal on every seed
    assert verdicts.loc["topk", "F1 verdict"] == "not compared" and verdicts.loc["topk", "F1 n"] == 0


def test_a_bad_sweep_is_refused_before_any_training():
    sys.path.insert(0, str(REPO / "experiments"))
    import synth_sae_bench

    for bad in ("", "1,x", "0,1", "-3"):
        with pytest.raises(SystemExit, match="--sweep: expected comma-separated positive multiples"):
            synth_sae_bench.main(["--quick", "--sweep", bad, "--out", "/nonexistent/never-written"])
