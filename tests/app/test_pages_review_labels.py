"""An outside review's four page defects (stories-2026, the planted checkpoint, SmolLM2's meta): Compare
shows B - A only when both read the same token ids, the exact-patching note estimates from a timed forward
and says what was done once it ran, Ablate names its reference text, the model card says why no curve."""

import re
import threading

import pytest
from test_pages import messages

from ui import common, patch
from ui.common import pretrained
from ui.common.card import no_curve_message
from workbench.analysis import reference_batch, reference_source

PLANTED = "planted-hand-induction"  # no task in its meta.json, no metrics.csv


def _need(checkpoints_dir, name):
    if not (checkpoints_dir / name).is_dir():
        pytest.skip(f"the shipped {name} checkpoint is missing")


def captions(at) -> str:
    return " | ".join(c.value for c in at.caption)


def test_compare_shows_no_loss_difference_between_two_prompts(app, checkpoints_dir):
    other = "induction-attn2l"  # reads none of A's prompt: its own default prompt (token ids)
    _need(checkpoints_dir, other)
    at = app("Compare")
    at.selectbox(key="ckpt_b").set_value(other).run()
    assert not at.exception, [e.value for e in at.exception]
    cards = {m.label: m for m in at.metric}
    b = cards[f"Mean loss, {other}"]
    assert not b.delta, f"a difference of two prompts' losses is shown: {b.delta}"
    assert "No difference of the losses is shown" in captions(at)


def test_compare_shows_the_loss_difference_on_the_same_ids(app):
    at = app("Compare")
    at.selectbox(key="ckpt_b").set_value("stories-2026").run()  # A against itself: the same ids
    cards = [m for m in at.metric if m.label.startswith("Mean loss")]
    assert [float(m.value.split()[0]) for m in cards][0] == float(cards[1].value.split()[0])
    assert cards[1].delta == "+0.000 nats" and "No difference of the losses" not in captions(at)


def test_exact_patching_note_estimates_from_a_timed_forward_and_is_replaced_after_the_run(app, monkeypatch):
    at = app("Patch")

    def fake_forward_seconds(model, clean):  # a known per-forward time: the estimate is patches x it
        return 0.25

    monkeypatch.setattr(patch, "EXACT_BUDGET", 0)
    monkeypatch.setattr(patch, "forward_seconds", fake_forward_seconds)
    at.slider(key="patch_n").set_value(3).run()
    note = messages(at)
    patches = int(re.search(r"is ([\d,]+) patched forward passes", note).group(1).replace(",", ""))
    assert f"up to about {patch._duration(patches * 0.25)}, an estimate from one full forward" in note, note
    assert "took 0.250 s" in note and "a minute" not in note
    at.button(key="patch_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "below meanwhile" not in messages(at) and "estimate from one full forward" not in messages(at)
    assert f"Exact patching ran {patches:,} patched forward passes" in captions(at)


def test_forward_seconds_times_a_forward_of_the_prompts(monkeypatch):
    from workbench import HookedDecoder, ModelConfig

    model = HookedDecoder(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=50, n_ctx=16))
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    assert patch.forward_seconds(model, ((1, 2, 3), (4, 5))) > 0
    assert seen == [(2, 3, 50)] * 2  # two timed forwards of the padded pair of prompts, the faster kept


def test_ablate_names_the_reference_text_task_or_shuffles(app, checkpoints_dir):
    _need(checkpoints_dir, PLANTED)
    at = app("Ablate")
    at.radio(key="ablate_kind").set_value("mean (over reference text)").run()
    assert "16 sequences of the 'stories' task's validation text" in captions(at)
    at.selectbox(key="ckpt").set_value(PLANTED).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "16 shuffles of the prompt itself" in captions(at)
    at.radio(key="ablate_kind").set_value("resample (from reference text)").run()
    assert "Resample ablation draws from it" in captions(at)


def test_reference_source_agrees_with_the_batch_drawn():
    from workbench import HookedDecoder, ModelConfig

    model = HookedDecoder(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=1000, n_ctx=32))
    ids = (5, 6, 7, 8, 9)
    shuffles = reference_batch(model, {}, ids, rows=4)
    assert all(sorted(r) == sorted(ids) for r in shuffles.tolist())
    assert reference_source(model, {}, ids, rows=4).startswith("4 shuffles of the prompt itself")
    meta = {"task": "stories", "task_options": {"seed": 0, "heldout_fraction": 0.2}}
    task = reference_batch(model, meta, ids, rows=4)
    assert not all(sorted(r) == sorted(ids) for r in task.tolist())
    assert reference_source(model, meta, ids, rows=4) == "4 sequences of the 'stories' task's validation text"


def test_the_card_says_why_there_is_no_training_curve(app, checkpoints_dir, tmp_path):
    _need(checkpoints_dir, PLANTED)
    at = app("Inspect")
    at.selectbox(key="ckpt").set_value(PLANTED).run()
    assert "No training log was saved with this checkpoint" in messages(at)
    assert "metrics.csv" not in messages(at)
    real = common.Checkpoint("SmolLM2-135M", str(tmp_path), 0, None, object(),
                             {"cache_format": pretrained.CACHE_FORMAT}, threading.Lock())
    assert no_curve_message(real) == ("SmolLM2-135M is a pretrained model that was not trained here, so there is "
                                      "no training curve.")
