"""How many hook configurations ``model.compile()`` keeps compiled, and what happens past that.

Dynamo keeps a limited number of compiled variants of a model's forward (its ``recompile_limit``,
8 by default); past it, it runs the model eagerly: exact, but no longer compiled, with nothing but a
log line. A sweep that hooks every layer of a deep model, or resumes at every layer, is a new
configuration per layer, so on a 10-layer model it used to fall back to eager from the 9th layer
on (measured: 11 configurations, 8 compiled). ``model.compile()`` now keeps dynamo's 8 plus two
per block, counts the fallbacks
(``compile_counters()["eager_fallbacks"]``) and warns once when one happens.
"""

import jaxtyping
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.compiled import compile_counters, default_recompile_limit


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    was = jaxtyping.config.jaxtyping_disable  # beartype cannot check dynamo's fake tensors
    jaxtyping.config.update("jaxtyping_disable", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    jaxtyping.config.update("jaxtyping_disable", was)


def halve(resid, hook):
    return resid * 0.5


def test_more_configurations_than_dynamos_eight_stay_compiled():
    cfg = tiny(n_layers=1, d_model=16, n_heads=2)
    eager, compiled = wb.HookedDecoder(cfg).eval(), wb.HookedDecoder(cfg).eval().compile(backend="eager")
    assert default_recompile_limit(compiled) == 10 and default_recompile_limit(wb.HookedDecoder(tiny(n_layers=4))) == 16
    names = [n for n in compiled.hook_dict if not n.endswith(("hook_attn_scores", "hook_pattern", "hook_scale"))][:9]
    x = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    before = compile_counters()
    with torch.no_grad():
        for name in names:  # a new hook configuration each: 10 with the unhooked run, dynamo's 8 exceeded
            with eager.hooks(fwd_hooks=[(name, halve)]), compiled.hooks(fwd_hooks=[(name, halve)]):
                assert (compiled(x) - eager(x)).abs().max() <= 1e-5, name
        assert (compiled(x) - eager(x)).abs().max() <= 1e-5
    after = compile_counters()
    assert after["eager_fallbacks"] == before["eager_fallbacks"], "fell back to eager"
    assert after["graphs"] - before["graphs"] == 10  # every configuration compiled


def test_past_the_limit_it_warns_once_counts_and_stays_exact():
    cfg = tiny(n_layers=1, d_model=16, n_heads=2)
    model, compiled = wb.HookedDecoder(cfg).eval(), wb.HookedDecoder(cfg).eval().compile(backend="eager", recompile_limit=2)
    x = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    before = compile_counters()["eager_fallbacks"]
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid", "blocks.0.hook_resid_post"]
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"recompile limit \(2 configurations") as caught:
        for name in names:  # three configurations, two compiled: the third runs eagerly
            with model.hooks(fwd_hooks=[(name, halve)]), compiled.hooks(fwd_hooks=[(name, halve)]):
                assert (compiled(x) - model(x)).abs().max() <= 1e-5
                assert (compiled(x) - model(x)).abs().max() <= 1e-5
    assert compile_counters()["eager_fallbacks"] > before
    assert sum("recompile limit" in str(w.message) for w in caught) == 1
