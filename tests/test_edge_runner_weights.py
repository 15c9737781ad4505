"""An ``EdgeRunner`` refuses weights changed since it was built.

It caches the clean and corrupted runs (every sender's output) and answered every later run from
them, mixed with the live model's later layers: after a ``load_state_dict``, a cast or an edit, a
run with every edge kept returned the old clean logits (or a mix), where a runner built afresh on
the changed model gives the new ones. Each run now compares a cheap stamp of the weights, and
``acdc`` / ``edge_effects`` / ``logit_diff_direct_effects`` the values too (``.data`` edits).
"""

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.analysis.circuits import EdgeRunner
from workbench.analysis.circuits.acdc import acdc
from workbench.analysis.circuits.edges import edge_effects
from workbench.analysis.circuits.ioi import logit_diff_direct_effects


def _model(seed: int = 0):
    return wb.HookedDecoder(tiny(init_std=0.3, positional="rope", norm="rmsnorm", seed=seed)).eval()


def _pair():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 50, (2, 6), generator=g), torch.randint(0, 50, (2, 6), generator=g)


def _metric(logits):
    return logits[:, -1, 3].float().mean()


CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict(_model(seed=4).state_dict()),
    "double": lambda m: m.double(),
    "data =": lambda m: setattr(m.blocks[0].attn.W_Q, "data", m.blocks[0].attn.W_Q.data * -2.0),
    "in place": lambda m: torch.no_grad()(m.blocks[1].mlp.W_in.mul_)(3.0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_runner_refuses_weights_changed_since_it_was_built(change):
    model = _model()
    runner = EdgeRunner(model, _pair())
    full = runner.graph.full_mask()
    before = runner.metric_of(_metric, full, from_stage=0)
    CHANGES[change](model)
    fresh = EdgeRunner(model, _pair())  # the independent reference: built from the changed weights
    with torch.no_grad():
        live = float(_metric(model(fresh.clean)))
    assert fresh.metric_of(_metric, fresh.graph.full_mask(), from_stage=0) == pytest.approx(live, abs=1e-5)
    if change != "double":
        assert before != pytest.approx(live, abs=1e-4)  # what the old runner's caches hold is of other weights
    for call in (lambda: runner.metric_of(_metric, full, from_stage=0), lambda: runner.endpoints(_metric),
                 lambda: runner.receiver_scores(_metric), lambda: acdc(runner, _metric, 0.1, kl=False)):
        with pytest.raises(ValueError, match="weights changed since this EdgeRunner was built"):
            call()


def test_the_algorithms_given_a_runner_see_data_edits():
    """A .data edit bumps no version counter: the cheap stamp misses it, the full check does not."""
    model = _model()
    runner = EdgeRunner(model, _pair())
    model.blocks[0].attn.W_O.data.mul_(-1.0)
    runner.check_weights()  # the cheap stamp: blind to it (documented)
    for call in (lambda: acdc(runner, _metric, 0.1, kl=False), lambda: edge_effects(runner, _metric, [0, 1]),
                 lambda: logit_diff_direct_effects(runner, [1, 2], [3, 4]),
                 lambda: runner.check_weights(full=True)):
        with pytest.raises(ValueError, match="weights changed"):
            call()
    model.blocks[0].attn.W_O.data.mul_(-1.0)  # the old weights back: the runner answers again
    runner.check_weights(full=True)
    assert len(edge_effects(runner, _metric, [0, 1])) == 2


def test_broken_weights_do_not_read_as_changed():
    """NaN never equals itself: a signature holding one made the same weights read as changed."""
    model = _model()
    with torch.no_grad():
        model.blocks[1].mlp.W_out[0, 0] = float("nan")
        model.blocks[1].mlp.W_in[0, 0] = float("inf")
    runner = EdgeRunner(model, _pair())
    runner.check_weights(full=True)
    model.blocks[0].attn.W_O.data.mul_(-1.0)  # a finite tensor edited: still seen
    with pytest.raises(ValueError, match="weights changed"):
        runner.check_weights(full=True)
