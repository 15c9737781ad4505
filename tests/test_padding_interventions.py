"""Padding parity of the interventions: ablation (zero, mean, resample with a fixed reference),
activation patching and attribution patching over a mixed-length prompt set, padded on the
left or the right and run 1, 2 or all prompts at a time, equal running each prompt (pair)
alone, unpadded (<= 1e-5 in fp32), for learned, RoPE and ALiBi positions, GQA and MoE. Some
clean/corrupted pairs differ in length, so positions are aligned per row (from the end, and
named per row). Bad input names the row and the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.analysis import AblationSpec, AnswerMetric, ablate, ablation_sweep, activation_patching
from workbench.analysis import attribution_patching
from workbench.analysis.ablation import references
from workbench.analysis.resume import hook_name, run_from_site
from workbench.tokenizer import WordTokenizer

TOL = dict(atol=1e-5, rtol=1e-5)
# clean, corrupted (rows 1 and 3 differ in length), answer, wrong, where the IO name sits in each
ROWS = [
    ("Mary and John went to the park , John gave a ball to", "Mary and John went to the park , Tom gave a ball to",
     "Mary", "John", 0, 0),
    ("Tom gave a book to", "so Anna gave a book to", "Anna", "Tom", 0, 1),
    ("Anna met Tom . Tom gave a cup to", "Anna met Tom . John gave a cup to", "Anna", "Tom", 0, 0),
    ("Mary went home and gave", "John went home", "John", "Mary", 0, 0),
]
MEAN_REFERENCE = ["the park , Tom gave a cup to Mary and John went home", "Anna met Mary",
                  "John gave a book to Tom and Anna went to the park"]
RESAMPLE_REFERENCE = ["John gave a book to Tom and Anna went to the park , so"]  # one row: every prompt draws it
VARIANTS = {
    "learned": dict(positional="learned"),
    "alibi-gqa": dict(positional="alibi", n_kv_heads=2),
    "rope-moe": dict(ffn="moe", n_experts=3, experts_per_token=2, positional="rope"),
}
SPECS = [AblationSpec("head", 0, head=1), AblationSpec("attn", 1, method="mean"),
         AblationSpec("mlp", 0, method="mean", positions=[0, 2])]
RESAMPLE_SPECS = [AblationSpec("mlp", 0, method="resample", seed=3), AblationSpec("head", 1, head=2, method="resample")]
POSITIONS = [-2, "IO", "END"]


def _prompt_set() -> wb.PromptSet:
    return wb.PromptSet.from_records([
        {"prompt": c, "corrupted": k, "answer": a, "wrong": w, "pos_IO": p, "corrupted_pos_IO": q, "kind": f"k{i % 2}"}
        for i, (c, k, a, w, p, q) in enumerate(ROWS)])


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request):
    texts = " ".join(" ".join(r[:4]) for r in ROWS) + " " + " ".join(MEAN_REFERENCE + RESAMPLE_REFERENCE)
    tok = WordTokenizer.from_text(texts)
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, **VARIANTS[request.param]), tokenizer=tok).eval()
    ds = _prompt_set()
    alone = {"sweep": [], "resample": [], "patch": [], "attr": []}
    for i, (clean, corrupted, answer, wrong, _, _) in enumerate(ROWS):
        # each prompt (pair) alone: an unpadded tensor, scored by an AnswerMetric of its own ids
        one = model.to_tokens(clean)
        metric = AnswerMetric("logit_diff", tok.encode(answer)[0], tok.encode(wrong)[0])
        alone["sweep"].append(ablation_sweep(model, one, specs=SPECS, metric=metric, reference=MEAN_REFERENCE))
        alone["resample"].append(ablation_sweep(model, one, specs=RESAMPLE_SPECS, metric=metric,
                                                reference=RESAMPLE_REFERENCE))
        named = [p if p != "IO" else ROWS[i][4] for p in POSITIONS]  # IO is a position of the clean prompt
        pair = (one, model.to_tokens(corrupted))
        if len(pair[0][0]) != len(pair[1][0]):
            named = [-2, "END"]  # the pair alone cannot carry IO over; checked on the dataset with its column
        table = activation_patching(model, *pair, metric, sites=("resid_pre", "head"), positions=named)
        alone["patch"].append((named, table))
        alone["attr"].append(attribution_patching(model, *pair, metric, by_pos=True, positions=[-2, -1]))
    return model, ds, alone


def _sides_and_sizes():
    """Left and right padding, batches of 1, 2 and all (not every combination: the cost stays small)."""
    return [("left", 1), ("right", 2), ("left", len(ROWS))]


def test_ablation_equals_each_prompt_alone(setup):
    model, ds, alone = setup
    for side, size in _sides_and_sizes():
        sweep = ablation_sweep(model, ds, specs=SPECS, reference=MEAN_REFERENCE, batch_size=size,
                               padding_side=side, per_prompt=True)
        resample = ablation_sweep(model, ds, specs=RESAMPLE_SPECS, reference=RESAMPLE_REFERENCE, batch_size=size,
                                  padding_side=side, per_prompt=True)
        for i in range(len(ROWS)):
            for ours, theirs in ((sweep, alone["sweep"][i]), (resample, alone["resample"][i])):
                mine = ours[ours.prompt == i]
                np.testing.assert_allclose(mine.metric, theirs.metric, **TOL)
                np.testing.assert_allclose(mine.clean, theirs.clean, **TOL)
        assert (sweep.kind == [f"k{p % 2}" for p in sweep.prompt]).all()  # the PromptSet's meta rides along
        mean = ablation_sweep(model, ds, specs=SPECS, reference=MEAN_REFERENCE, batch_size=size, padding_side=side)
        expected = np.mean([t.metric for t in alone["sweep"]], axis=0)
        np.testing.assert_allclose(mean.metric, expected, **TOL)  # the mean over prompts of each prompt's value


def test_a_padded_ablated_forward_equals_each_prompt_alone(setup):
    model, ds, _ = setup
    for spec, side in zip(SPECS, ("left", "right", "left")):
        batch = model.to_tokens(ds.clean, padding_side=side)
        logits = ablate(model, batch, spec, reference=MEAN_REFERENCE)
        for i, text in enumerate(ds.clean):
            one = ablate(model, model.to_tokens(text), spec, reference=MEAN_REFERENCE)[0]
            torch.testing.assert_close(logits[i][batch.attention_mask[i].bool()], one, **TOL)


def test_the_mean_reference_counts_real_tokens_only(setup):
    model, _, _ = setup
    spec = AblationSpec("attn", 1, method="mean")
    for side in ("left", "right"):
        ref = references(model, MEAN_REFERENCE, None, [spec], 2, side)["mean"]
        mean, counts = ref.mean(spec.hook)
        alone = []
        for text in MEAN_REFERENCE:  # each reference prompt alone: no pads anywhere
            _, cache = model.run_with_cache(model.to_tokens(text))
            alone.append(cache[spec.hook][0])
        for k in range(mean.shape[0]):
            at_k = torch.stack([a[k] for a in alone if a.shape[0] > k])
            assert counts[k] == len(at_k)
            torch.testing.assert_close(mean[k].float(), at_k.mean(0), **TOL)


def test_activation_patching_equals_each_pair_alone(setup):
    model, ds, alone = setup
    for side, size in _sides_and_sizes():
        table = activation_patching(model, ds, sites=("resid_pre", "head"),
                                    positions=POSITIONS, batch_size=size, padding_side=side, per_prompt=True)
        assert set(table[table.site == "resid_pre"].pos) == set(POSITIONS)  # positions named by role
        for i, (named, theirs) in enumerate(alone["patch"]):
            mine, theirs_resid = table[table.prompt == i], theirs[theirs.site == "resid_pre"]
            for label, their_label in zip(POSITIONS, [p if p != "IO" else ROWS[i][4] for p in POSITIONS]):
                if their_label not in named:
                    continue
                a = mine[(mine.site == "resid_pre") & (mine.pos == label)]
                b = theirs_resid[theirs_resid.pos == their_label]
                np.testing.assert_allclose(a.metric, b.metric, **TOL)
                np.testing.assert_allclose(a.corrupted, b.corrupted, **TOL)
            if len(named) == len(POSITIONS):  # each head patched at all three positions together
                np.testing.assert_allclose(mine[mine.site == "head"].metric, theirs[theirs.site == "head"].metric,
                                           **TOL)
        assert (table.kind == [f"k{p % 2}" for p in table.prompt]).all()


def test_attribution_patching_equals_each_pair_alone(setup):
    model, ds, alone = setup
    for side, size in _sides_and_sizes():
        table = attribution_patching(model, ds, by_pos=True, positions=[-2, -1], batch_size=size,
                                     padding_side=side, per_prompt=True)
        for i, theirs in enumerate(alone["attr"]):
            np.testing.assert_allclose(table[table.prompt == i].attribution, theirs.attribution, **TOL)
        mean = attribution_patching(model, ds, by_pos=True, positions=[-2, -1], batch_size=size, padding_side=side)
        np.testing.assert_allclose(mean.attribution, np.mean([t.attribution for t in alone["attr"]], axis=0), **TOL)


def test_resuming_a_padded_batch_equals_the_hooked_forward():
    # run_from_site must carry the mask: without it the later layers attend to pads and count
    # them as positions, so a padded row would not be its prompt alone.
    tok = WordTokenizer.from_text(" ".join(r[0] for r in ROWS))
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, ffn="moe", n_experts=3, positional="rope"),
                             tokenizer=tok).eval()
    for side in ("left", "right"):
        batch = model.to_tokens([r[0] for r in ROWS], padding_side=side)
        real = batch.attention_mask.bool()
        for layer, site in ((0, "z"), (0, "attn_out"), (1, "mlp_out"), (1, "resid_pre")):
            _, cache = model.run_with_cache(batch)
            name = hook_name(layer, site)
            resumed = run_from_site(model, layer, site, cache[name] * 0.5, cache.cache_dict,
                                    attention_mask=batch.attention_mask)
            hooked = model.run_with_hooks(batch, fwd_hooks=[(name, lambda act, hook: act * 0.5)])
            torch.testing.assert_close(resumed[real], hooked[real], **TOL)


def test_bad_input_names_the_row_and_the_field():
    tok = WordTokenizer.from_text(" ".join(" ".join(r[:4]) for r in ROWS) + " two words")
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size), tokenizer=tok).eval()
    ds = _prompt_set()
    with pytest.raises(ValueError, match="row 1: position 7 does not exist in its clean prompt"):
        activation_patching(model, ds, sites="resid_pre", positions=[7])
    frame = ds.to_frame()
    frame.loc[1, "pos_IO"] = 9  # past the end of row 1's 5 tokens
    with pytest.raises(ValueError, match="row 1: position 'IO' does not exist"):
        activation_patching(model, wb.PromptSet.from_dataframe(frame), sites="resid_pre", positions=["IO"])
    with pytest.raises(ValueError, match="'S2' has no 'pos_S2' column"):
        activation_patching(model, ds, sites="resid_pre", positions=["S2"])
    no_override = wb.PromptSet.from_dataframe(ds.to_frame().drop(columns="corrupted_pos_IO"))
    with pytest.raises(ValueError, match="row 1: its clean and corrupted prompts differ in length"):
        activation_patching(model, no_override, sites="resid_pre", positions=["IO"])
    with pytest.raises(ValueError, match="row 1: the clean prompt has 5 tokens and the corrupted one 6"):
        activation_patching(model, ds, sites="head")
    frame = ds.to_frame()
    frame.loc[2, "answer"] = "two words"
    with pytest.raises(ValueError, match="row 2: field 'answer'"):
        ablation_sweep(model, wb.PromptSet.from_dataframe(frame), unit="head")
    with pytest.raises(ValueError, match=r"row 1: positions=\[0, 7\] include position 7, but the prompt has 5 tokens"):
        ablation_sweep(model, ds, specs=[AblationSpec("head", 0, head=0, positions=[0, 7])])
