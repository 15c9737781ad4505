"""``one_forward``'s stand-in sees weights changed between two analyses that share it.

It answered every analysis from its first run for its whole life: after a ``load_state_dict``, a
cast or a parameter replaced, the next analysis gave the old weights' numbers, where the model
itself (and a fresh stand-in) gave the new ones. It now re-runs when a cheap stamp of the weights
(identity, dtype, device, shape, storage address, version counter) differs. An in-place ``.data``
edit bumps no version counter and is documented as unseen (``workbench/analysis/shared.py``).
"""

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench import analysis as an
from workbench.analysis.shared import inspect_hooks, one_forward


def _model(seed: int = 0):
    return wb.HookedDecoder(tiny(init_std=0.3, norm="rmsnorm", positional="rope", seed=seed)).eval()


def _swap(model):
    model.load_state_dict(_model(seed=5).state_dict())


def _double(model):
    model.double()


def _replace(model):
    w = model.blocks[0].attn.W_Q
    w.data = w.data * -2.0  # a new tensor behind the parameter


def _in_place(model):
    with torch.no_grad():
        model.blocks[1].mlp.W_in.mul_(3.0)  # bumps the parameter's version counter, as an optimizer step does


@pytest.mark.parametrize("change", [_swap, _double, _replace, _in_place], ids=lambda f: f.__name__.strip("_"))
def test_the_next_shared_analysis_sees_changed_weights(change):
    model = _model()
    tokens = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    shared = one_forward(model, tokens, inspect_hooks(model))
    before = an.token_losses(shared, tokens)
    change(model)
    after = an.token_losses(shared, tokens)
    lens = an.logit_lens(shared, tokens, k=3)
    # the independent reference: the model itself, and a fresh copy loaded with the changed weights
    fresh = wb.HookedDecoder(model.cfg)
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    fresh = fresh.to(next(model.parameters()).dtype).eval()
    expected = an.token_losses(fresh, tokens)
    assert not torch.allclose(torch.tensor(before["loss"].to_numpy()), torch.tensor(expected["loss"].to_numpy()),
                              atol=1e-4) or change is _double
    torch.testing.assert_close(torch.tensor(after["loss"].to_numpy()), torch.tensor(expected["loss"].to_numpy()),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(lens.select_dtypes("number").to_numpy(dtype=float)),
                               torch.tensor(an.logit_lens(fresh, tokens, k=3).select_dtypes("number")
                                            .to_numpy(dtype=float)), atol=1e-5, rtol=1e-5, equal_nan=True)
    assert shared.forwards == 2  # one run for each set of weights, shared by the analyses after the change


def test_unchanged_weights_keep_one_run():
    model = _model()
    tokens = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    shared = one_forward(model, tokens, inspect_hooks(model))
    an.token_losses(shared, tokens), an.logit_lens(shared, tokens, k=3), an.residual_norms(shared, tokens)
    assert shared.forwards == 1
