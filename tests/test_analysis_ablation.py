"""Ablation: the fast sweep equals the naive hooked loop exactly; each ablation against a
direct edit of the weights; mean ablation with the input as reference changes nothing; a single
sequence with no reference is refused for mean and resample (it would silently change nothing)."""

import copy

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import AblationSpec, ablate, ablation_sweep
from workbench.components.block import LAYOUTS

# Every block layout the Block knows (a new one is covered as soon as it is in LAYOUTS), and
# one model whose components differ from the defaults everywhere else.
CONFIGS = {**{name: dict(layout.config) for name, layout in LAYOUTS.items()},
           "llama-like": {"norm": "rmsnorm", "positional": "rope", "ffn": "swiglu", "n_kv_heads": 2}}


@pytest.mark.parametrize("name", CONFIGS)
def test_sweep_equals_naive_loop_exactly(name):
    model = wb.HookedDecoder(tiny(**CONFIGS[name])).eval()
    assert name not in LAYOUTS or model.blocks[0].layout == name
    tokens = torch.randint(0, 50, (2, 8))
    reference = torch.randint(0, 50, (3, 9))
    for unit, methods in (("head", ("zero", "resample")), ("layer", ("mean",))):
        fast = ablation_sweep(model, tokens, unit=unit, methods=methods, reference=reference)
        naive = ablation_sweep(model, tokens, unit=unit, methods=methods, reference=reference, naive=True)
        assert (fast.metric.to_numpy() == naive.metric.to_numpy()).all(), (fast.metric - naive.metric).abs().max()
    assert (fast.delta != 0).any()


def test_stacked_sweep_matches_the_naive_loop():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (3, 10))
    stacked = ablation_sweep(model, tokens, unit="head", methods=("mean",), stack=3)
    plain = ablation_sweep(model, tokens, unit="head", methods=("mean",), naive=True)
    torch.testing.assert_close(torch.tensor(stacked.metric.to_numpy()), torch.tensor(plain.metric.to_numpy()),
                               rtol=1e-6, atol=1e-6)


def test_sweep_table_shape_and_custom_specs():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 8))
    table = ablation_sweep(model, tokens, unit="head", methods=("zero", "mean"))
    assert len(table) == 2 * 2 * 4 and set(table.columns) >= {"layer", "head", "method", "metric", "clean", "delta"}
    specs = [AblationSpec("neurons", 1, neurons=[0, 5, 7]), AblationSpec("resid", 1, positions=[2]),
             AblationSpec("direction", 0, direction=torch.randn(32), method="mean")]
    fast = ablation_sweep(model, tokens, specs=specs)
    naive = ablation_sweep(model, tokens, specs=specs, naive=True)
    assert (fast.metric.to_numpy() == naive.metric.to_numpy()).all()


def _edited(model, edit):
    other = copy.deepcopy(model)
    with torch.no_grad():
        edit(other)
    return other


@pytest.mark.parametrize("spec,edit", [
    (AblationSpec("head", 1, head=2), lambda m: m.blocks[1].attn.W_O[2].zero_()),
    (AblationSpec("attn", 0), lambda m: (m.blocks[0].attn.W_O.zero_(), m.blocks[0].attn.b_O.zero_())),
    (AblationSpec("mlp", 1), lambda m: (m.blocks[1].mlp.W_out.zero_(), m.blocks[1].mlp.b_out.zero_())),
    (AblationSpec("neurons", 0, neurons=[1, 4, 9]), lambda m: m.blocks[0].mlp.W_out.index_fill_(0, torch.tensor([1, 4, 9]), 0.0)),
])
def test_zero_ablation_equals_zeroing_the_weights(spec, edit):
    model = wb.HookedDecoder(tiny(bias=True)).eval()
    with torch.no_grad():
        for block in model.blocks:  # non-zero biases, so "zero the output" is not "zero the weights" by accident
            block.attn.b_O.add_(0.1)
            block.mlp.b_out.add_(0.1)
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        expected = _edited(model, edit)(tokens)
    torch.testing.assert_close(ablate(model, tokens, spec), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [AblationSpec("head", 0, head=1, method="mean"), AblationSpec("attn", 1, method="mean"),
                                  AblationSpec("mlp", 0, method="mean"), AblationSpec("neurons", 1, neurons=[3], method="mean"),
                                  AblationSpec("resid", 1, method="mean"),
                                  AblationSpec("direction", 1, direction=torch.ones(32), method="mean")])
def test_mean_ablation_with_the_input_as_reference_changes_nothing(spec):
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (1, 9)).repeat(3, 1)  # every row the same: the mean is each row
    with torch.no_grad():
        clean = model(tokens)
    torch.testing.assert_close(ablate(model, tokens, spec, reference=tokens), clean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ablate(model, tokens, spec), clean, rtol=1e-5, atol=1e-6)


def test_positions_and_resample_and_direction():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        clean = model(tokens)
    out = ablate(model, tokens, AblationSpec("resid", 1, positions=[5]))
    torch.testing.assert_close(out[:, :5], clean[:, :5])  # causal: earlier positions cannot see it
    assert not torch.allclose(out[:, 5:], clean[:, 5:])
    # resample without a reference: row 0 takes row 1's stream and vice versa
    swapped = ablate(model, tokens, AblationSpec("resid", 0, method="resample"))
    with torch.no_grad():
        torch.testing.assert_close(swapped, model(tokens.flip(0)))
    direction = torch.randn(32)
    seen = {}

    def grab(act, hook):
        seen["x"] = act

    hooks = wb.analysis.ablation_hooks(model, tokens, AblationSpec("direction", 1, direction=direction))
    model.run_with_hooks(tokens, fwd_hooks=hooks + [("blocks.1.hook_resid_pre", grab)])
    assert (seen["x"] @ direction).abs().max() < 1e-4


def test_bad_specs_are_refused():
    model = wb.HookedDecoder(tiny())
    tokens = torch.randint(0, 50, (1, 5))
    for kwargs, message in [(dict(target="head", layer=0, head=9), "head"), (dict(target="nope", layer=0), "target"),
                            (dict(target="attn", layer=5), "layer"), (dict(target="attn", layer=0, method="x"), "method"),
                            (dict(target="neurons", layer=0), "neurons"), (dict(target="direction", layer=0), "direction"),
                            (dict(target="attn", layer=0, method="resample"), "at least 2")]:
        with pytest.raises((ValueError, TypeError), match=message):  # under pytest jaxtyping may check first
            ablate(model, tokens, AblationSpec(**kwargs))
    with pytest.raises(ValueError, match="attention-only"):
        ablate(wb.HookedDecoder(tiny(attn_only=True)), tokens, AblationSpec("mlp", 0))


@pytest.mark.parametrize("method", ["mean", "resample"])
def test_one_sequence_without_a_reference_is_refused(method):
    # the input would be its own reference: the mean of one row is that row, so nothing would change
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (1, 6))
    spec = AblationSpec("head", 0, head=1, method=method)
    with pytest.raises(ValueError, match="pass reference=a batch of other inputs"):
        ablate(model, tokens, spec)
    with pytest.raises(ValueError, match="pass reference=a batch of other inputs"):
        ablation_sweep(model, tokens, unit="head", methods=("zero", method))
    with pytest.raises(ValueError, match="pass reference=a batch of other inputs"):
        wb.analysis.ablation_hooks(model, tokens, spec)
    reference = torch.randint(0, 50, (3, 6))
    with torch.no_grad():
        clean = model(tokens)
    assert not torch.allclose(ablate(model, tokens, spec, reference=reference), clean)
    assert (ablation_sweep(model, tokens, methods=(method,), reference=reference).delta != 0).any()
    torch.testing.assert_close(ablate(model, tokens, AblationSpec("head", 0, head=1)),
                               ablate(model, tokens.repeat(2, 1), AblationSpec("head", 0, head=1))[:1])


def test_sweep_reports_progress_to_a_callback():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 6))
    for naive, stack in ((False, 3), (True, None)):
        calls = []
        table = ablation_sweep(model, tokens, unit="head", stack=stack, naive=naive,
                               progress=lambda done, total: calls.append((done, total)))
        total = len(table)
        assert total == 8 and all(t == total for _, t in calls)
        dones = [d for d, _ in calls]
        assert dones == sorted(dones) and dones[-1] == total and len(set(dones)) == len(dones)
    assert len(calls) == total  # the naive loop reports every ablation


@pytest.mark.parametrize("positions,neurons", [([0, 2], [1, 2]), ([0, 3, 5], [4, 7]), (None, [0, 9])])
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_neurons_at_positions_ablate_every_combination_and_nothing_else(positions, neurons, method):
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (3, 7))
    name = "blocks.0.mlp.hook_post"
    _, cache = model.run_with_cache(tokens, names_filter=name)
    clean = cache[name]
    expected = clean.clone()
    for p in (range(tokens.shape[1]) if positions is None else positions):
        for n in neurons:  # the direct computation: one (position, neuron) cell at a time
            expected[:, p, n] = 0.0 if method == "zero" else clean[:, p, n].mean()
    seen = {}

    def grab(act, hook):
        seen["x"] = act

    spec = AblationSpec("neurons", 0, neurons=neurons, positions=positions, method=method)
    model.run_with_hooks(tokens, fwd_hooks=wb.analysis.ablation_hooks(model, tokens, spec) + [(name, grab)])
    torch.testing.assert_close(seen["x"], expected)


def test_a_negative_layer_counts_from_the_end():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 6))
    last = model.cfg.n_layers - 1
    spec = AblationSpec("head", -1, head=0)
    assert spec.validate(model).hook == f"blocks.{last}.attn.hook_z" and spec.layer == -1
    torch.testing.assert_close(ablate(model, tokens, spec), ablate(model, tokens, AblationSpec("head", last, head=0)))
    swept = ablation_sweep(model, tokens, specs=[AblationSpec("mlp", -1), AblationSpec("mlp", last)])
    assert swept.layer.tolist() == [last, last] and swept.metric[0] == swept.metric[1]


def test_specs_are_frozen_and_hashable_by_value():
    import dataclasses

    import numpy as np

    a = AblationSpec("neurons", np.int64(1), neurons=[3, 5], positions=range(0, 3, 2), method="mean")
    b = AblationSpec("neurons", 1, neurons=(3, 5), positions=(0, 2), method="mean")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.neurons == (3, 5) and a.positions == (0, 2) and type(a.layer) is int
    assert a != dataclasses.replace(b, method="zero")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.layer = 0
    direction = torch.randn(32)
    d1, d2 = AblationSpec("direction", 0, direction=direction), AblationSpec("direction", 0, direction=direction.clone())
    assert d1 == d2 and hash(d1) == hash(d2) and d1.direction == tuple(direction.double().tolist())
    assert d1 != AblationSpec("direction", 0, direction=direction + 1)
    with pytest.raises(ValueError, match=r"\[d_model\] vector"):
        AblationSpec("direction", 0, direction=torch.randn(2, 32))
    assert a.label == "L1 neurons (mean)" and AblationSpec("head", 0, head=3).label == "L0H3 (zero)"
