"""workbench.utils: ``eval_mode`` restores the caller's mode even when the work inside raises, and
every library function that flips a model to eval mode does so through it.

Each case puts the model in one mode, makes a forward pass fail part-way (a hook that raises on
its n-th call, or a metric that raises), and checks the mode afterwards.
"""

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import (
    ablation_sweep,
    activation_patching,
    attribution_patching,
    logit_diff_metric,
    train_tuned_lens,
)
from workbench.data import get_task
from workbench.utils import eval_mode


class Boom(Exception):
    pass


class _RaiseOnCall:
    """A hook that raises on its ``at``-th call (1-based), so the failure comes mid-way."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, act, hook):
        self.calls += 1
        if self.calls >= self.at:
            raise Boom(f"hook call {self.calls}")
        return act


def _raising_metric(after: int):
    calls = {"n": 0}

    def metric(logits):
        calls["n"] += 1
        if calls["n"] > after:
            raise Boom(f"metric call {calls['n']}")
        return logits[:, -1, 0].mean()

    return metric


def _with_hook(model, at: int):
    model.add_hook("blocks.0.hook_resid_pre", _RaiseOnCall(at), is_permanent=True)
    return model


def _stories_model():
    task = get_task("stories")
    return wb.HookedDecoder(tiny(d_vocab=task.vocab_size, n_ctx=32)), task


TOKENS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))

# name -> (build the model, call(model, tmp_path) that raises part-way through)
CASES = {
    "generate": (lambda: _with_hook(wb.HookedDecoder(tiny()), at=3),
                 lambda m, tmp: m.generate(TOKENS, max_new_tokens=5)),
    "ablation_sweep": (lambda: wb.HookedDecoder(tiny()),
                       lambda m, tmp: ablation_sweep(m, TOKENS, metric=_raising_metric(after=2))),
    "activation_patching": (lambda: _with_hook(wb.HookedDecoder(tiny()), at=2),
                            lambda m, tmp: activation_patching(m, TOKENS, TOKENS.flip(0), logit_diff_metric(1, 2))),
    "attribution_patching": (lambda: wb.HookedDecoder(tiny()),
                             lambda m, tmp: attribution_patching(m, TOKENS, TOKENS.flip(0), _raising_metric(after=0))),
    "train_tuned_lens": (lambda: _with_hook(wb.HookedDecoder(tiny()), at=1),
                         lambda m, tmp: train_tuned_lens(m, TOKENS, steps=2, progress=False)),
    "val_loss": (lambda: _with_hook(wb.HookedDecoder(tiny()), at=2),
                 lambda m, tmp: get_task("induction", vocab=50).val_loss(m, batch_size=2, seq_len=8, n_batches=3)),
    "induction.evaluate": (lambda: _with_hook(wb.HookedDecoder(tiny()), at=1),
                           lambda m, tmp: get_task("induction", vocab=50).evaluate(m, batch_size=2)),
    "modular.evaluate": (lambda: _with_hook(wb.HookedDecoder(tiny(d_vocab=9)), at=2),
                         lambda m, tmp: get_task("modular", p=7).evaluate(m, batch_size=4)),
    "stories.evaluate": (lambda: _with_hook(_stories_model()[0], at=2),
                         lambda m, tmp: get_task("stories").evaluate(m, n=4)),
    "text.evaluate": (lambda: _with_hook(wb.HookedDecoder(tiny(d_vocab=256)), at=1),
                      lambda m, tmp: _text_task(tmp).evaluate(m, seq_len=8)),
}


def _text_task(tmp):
    path = tmp / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return get_task("text", path=path, tokenizer="byte")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_call_that_raises_midway_leaves_the_mode_as_it_was(name, training, tmp_path):
    build, call = CASES[name]
    model = build().train(training)
    with pytest.raises(Boom):
        call(model, tmp_path)
    assert model.training is training
    assert all(module.training is training for module in model.modules())


def test_the_cases_run_cleanly_without_the_failure():
    """The same calls succeed without the raising hook/metric (so each case fails where it should)."""
    model = wb.HookedDecoder(tiny()).train()
    model.generate(TOKENS, max_new_tokens=2)
    ablation_sweep(model, TOKENS, metric=_raising_metric(after=10**6))
    assert model.training


def test_eval_mode_restores_on_exit_and_on_error():
    model = wb.HookedDecoder(tiny()).train()
    with eval_mode(model) as inner:
        assert inner is model and not model.training and not model.blocks[0].training
    assert model.training
    with pytest.raises(Boom), eval_mode(model):
        raise Boom()
    assert model.training
    model.eval()
    with eval_mode(model):
        pass
    assert not model.training
