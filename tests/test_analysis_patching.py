"""Activation patching equals transformer_lens.patching on the same model; attribution
patching tracks exact patching."""

import numpy as np
import pytest
import torch
from factories import tiny
from transformer_lens import patching as tl_patching

import workbench as wb
from workbench.analysis import activation_patching, attribution_patching, logit_diff_metric
from workbench.components.block import LAYOUTS

TL = {"resid_pre": tl_patching.get_act_patch_resid_pre, "resid_mid": tl_patching.get_act_patch_resid_mid,
      "attn_out": tl_patching.get_act_patch_attn_out, "mlp_out": tl_patching.get_act_patch_mlp_out,
      "head": tl_patching.get_act_patch_attn_head_out_all_pos,
      "head_by_pos": tl_patching.get_act_patch_attn_head_out_by_pos}


def _pair(n_pos=7):
    clean = torch.randint(0, 50, (2, n_pos))
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 11) % 50
    return clean, corrupted


# Every block layout the Block knows, and a parallel model with other components.
CONFIGS = {**{name: dict(layout.config) for name, layout in LAYOUTS.items()},
           "neox-like": {"norm": "rmsnorm", "positional": "rope", "n_kv_heads": 2, "ffn": "swiglu",
                         "parallel_residual": True}}


@pytest.mark.parametrize("name", CONFIGS)
def test_activation_patching_equals_transformer_lens(name):
    model = wb.HookedDecoder(tiny(**CONFIGS[name])).eval()
    sites = [s for s in TL if s not in ("resid_mid", "mlp_out") or s in model.blocks[0].sites]
    clean, corrupted = _pair(5)
    metric = logit_diff_metric(5, 9)
    ours = activation_patching(model, clean, corrupted, metric, sites=sites)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)
    for site in sites:
        theirs = TL[site](model, corrupted, clean_cache, metric).flatten().numpy()
        np.testing.assert_allclose(ours[ours.site == site].metric.to_numpy(), theirs, rtol=1e-5, atol=1e-6)
    # the streams before the corrupted position are the same in both runs: patching them restores nothing
    if "resid_pre" in sites:
        early = ours[(ours.site == "resid_pre") & (ours.layer == 0)]
        np.testing.assert_allclose(early[early.pos < 2].restored, 0, atol=1e-5)


def test_attribution_patching_tracks_exact_patching():
    model = wb.HookedDecoder(tiny(n_layers=3)).eval()
    clean, corrupted = _pair(8)
    metric = logit_diff_metric(5, 9)
    table = attribution_patching(model, clean, corrupted, metric, exact=True)
    exact = activation_patching(model, clean, corrupted, metric, sites="head")
    np.testing.assert_allclose(table.exact, exact.metric - exact.corrupted, rtol=1e-6)
    assert table.attrs["correlation"] > 0.9
    by_pos = attribution_patching(model, clean, corrupted, metric, by_pos=True)
    summed = by_pos.groupby(["layer", "head"]).attribution.sum().to_numpy()
    np.testing.assert_allclose(summed, table.attribution, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # grads taken without touching .grad


def test_patching_rejects_bad_input():
    model = wb.HookedDecoder(tiny(attn_only=True)).eval()
    clean, corrupted = _pair()
    with pytest.raises(ValueError, match="mlp_out"):
        activation_patching(model, clean, corrupted, logit_diff_metric(1, 2), sites="mlp_out")
    with pytest.raises(ValueError, match="site"):
        activation_patching(model, clean, corrupted, logit_diff_metric(1, 2), sites="nope")
    with pytest.raises((ValueError, TypeError), match="pos"):  # jaxtyping sees the mismatch first under pytest
        activation_patching(model, clean, corrupted[:, :5], logit_diff_metric(1, 2), sites="head")


def test_task_pairs_are_the_tasks_own_abc_pairs():
    from workbench.analysis import AnswerMetric, task_pairs
    from workbench.data import get_task

    task = get_task("stories")
    model = wb.HookedDecoder(tiny(d_vocab=task.vocab_size, n_ctx=32), tokenizer=task.tokenizer).eval()
    meta = {"task": "stories", "task_options": task.options()}
    pairs = task_pairs(model, meta, n=4, seed=3)
    batch = task.ioi_prompts(4, seed=3)
    assert pairs.clean == tuple(map(tuple, batch.tokens.tolist()))
    assert pairs.corrupted == tuple(map(tuple, batch.corrupted.tolist()))
    assert pairs.answer == tuple(batch.correct.tolist()) and pairs.wrong == tuple(batch.wrong.tolist())
    differs = (batch.tokens != batch.corrupted).nonzero()[:, 1].unique().tolist()
    assert differs == [10]  # only the second subject mention (S2) is replaced
    assert hash(pairs) == hash(task_pairs(model, meta, n=4, seed=3))
    metric = AnswerMetric("logit_diff", pairs.answer, pairs.wrong)
    frame = activation_patching(model, torch.tensor(pairs.clean), torch.tensor(pairs.corrupted), metric, sites="head")
    assert len(frame) == model.cfg.n_layers * model.cfg.n_heads
    assert task_pairs(model, meta, n=2, kind="possession").clean[0][-1] == task.tokenizer.stoi["the"]
    with pytest.raises(ValueError, match="no ioi prompt pairs"):
        task_pairs(wb.HookedDecoder(tiny()), {"task": "induction", "task_options": {"vocab": 50}})
    with pytest.raises(ValueError, match="kind="):
        task_pairs(model, meta, kind="greater_than")
    with pytest.raises(ValueError, match="names no task"):
        task_pairs(model, {})


def test_patching_agreement_equals_attribution_patchings_own_exact_column():
    from workbench.analysis import patching_agreement

    model = wb.HookedDecoder(tiny()).eval()
    clean, corrupted = _pair(6)
    metric = logit_diff_metric(5, 9)
    attribution = attribution_patching(model, clean, corrupted, metric, exact=True)
    patched = activation_patching(model, clean, corrupted, metric, sites=("resid_pre", "head"))
    agreement = patching_agreement(attribution.drop(columns="exact"), patched)
    np.testing.assert_allclose(agreement["exact"], attribution["exact"], atol=1e-6)
    assert agreement.attrs["correlation"] == pytest.approx(attribution.attrs["correlation"], abs=1e-6)
    with pytest.raises(ValueError, match="site='head'"):
        patching_agreement(attribution, patched[patched.site == "resid_pre"])
