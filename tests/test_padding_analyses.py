"""Padding parity for the read-side analyses: a set of prompts of different lengths, padded on the
left or the right and run in batches of 1, 2 or all of them, gives the table each prompt gives
alone (<= 1e-5 in fp32), with rows numbered as in the data and positions counted within each prompt.

The reference is every analysis run on one unpadded prompt at a time, the single-prompt path
that predates padding (no mask, positions 0..n-1), and its tables stitched together with the
prompt's number. Aggregates (lens means, head scores, compare_lenses) are checked against
reductions of those per-prompt tables written here, not against the library's own running sums.
The configs cover every positional scheme, MHA/GQA/MQA, a MoE FFN and pre/post norms.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
import workbench.analysis as an
from factories import tiny
from workbench.analysis.batching import real_positions
from workbench.padding import TokenBatch
from workbench.tokenizer import WordTokenizer

TOL = dict(atol=1e-5, rtol=1e-5)
LENGTHS = (7, 2, 11, 5)  # the longest in the middle: both sides pad rows before and after it
PAD_ID = 3  # a real token id: only the mask may say what is padding
CASES = {
    "learned-mha-pre-layernorm": dict(positional="learned"),
    "sinusoidal-gqa-post": dict(positional="sinusoidal", n_kv_heads=2, norm_placement="post"),
    "rope-mqa-moe-rmsnorm": dict(positional="rope", n_kv_heads=1, ffn="moe", n_experts=3, norm="rmsnorm"),
    "alibi-gqa-swiglu": dict(positional="alibi", n_kv_heads=2, ffn="swiglu"),
    "none-mha-post-nonorm": dict(positional="none", norm_placement="post", norm="none"),
}
# Each side once with every prompt in one batch, and once in smaller batches: sizes 1, 2 and all.
RUNS = (("left", len(LENGTHS)), ("right", len(LENGTHS)), ("left", 1), ("right", 2))


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request):
    model = wb.HookedDecoder(tiny(**CASES[request.param])).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.cfg.d_vocab, (n,), generator=gen) for n in LENGTHS]
    prompts[2][6:9] = prompts[2][1:4]  # a repeat, so duplicate and induction scores are not all zero
    lens = an.TunedLens(model.cfg.n_layers, model.cfg.d_model)
    with torch.no_grad():  # a translator that is not the identity
        lens.weight.add_(0.1 * torch.randn(lens.weight.shape, generator=gen))
        lens.bias.add_(0.1 * torch.randn(lens.bias.shape, generator=gen))
    return model, prompts, lens


def padded_runs(prompts, runs=RUNS):
    """(label, data, batch_size) for both padding sides and every batch size."""
    for side, size in runs:
        yield f"{side}-{size}", TokenBatch.from_ids([p.tolist() for p in prompts], PAD_ID, side), size


def alone(fn, prompts, **kwargs) -> pd.DataFrame:
    """``fn`` on each prompt by itself (a [1, n] tensor), its rows renumbered as that prompt."""
    frames = []
    for i, p in enumerate(prompts):
        frame = fn(p[None], **kwargs)
        frames.append(frame.assign(batch=i, prompt=i) if "batch" in frame else frame.assign(prompt=i))
    return pd.concat(frames, ignore_index=True)


def assert_same_table(got: pd.DataFrame, want: pd.DataFrame, keys: list[str], label: str) -> None:
    assert sorted(got.columns) == sorted(want.columns), (label, set(got.columns) ^ set(want.columns))
    assert len(got) == len(want), (label, len(got), len(want))
    got = got.sort_values(keys, kind="stable").reset_index(drop=True)
    want = want.sort_values(keys, kind="stable").reset_index(drop=True)[got.columns]
    for column in got.columns:
        a, b = got[column].to_numpy(), want[column].to_numpy()
        if np.issubdtype(a.dtype, np.number) and np.issubdtype(b.dtype, np.number):
            np.testing.assert_allclose(a.astype(float), b.astype(float), equal_nan=True, err_msg=f"{label}: {column}",
                                       **TOL)
        else:
            assert (a == b).all(), (label, column)


# Per-prompt tables: (analysis, its keyword arguments, the keys that identify a row)
TABLES = {
    "logit_lens": (an.logit_lens, dict(k=3), ["lens", "batch", "layer", "pos"]),
    "tuned_lens": (an.tuned_lens, dict(k=2), ["lens", "batch", "layer", "pos"]),
    "attention_patterns": (an.attention_patterns, dict(batch_index=None), ["batch", "layer", "head", "query_pos",
                                                                           "key_pos"]),
    "token_losses": (an.token_losses, {}, ["batch", "pos"]),
    "residual_norms": (an.residual_norms, {}, ["batch", "layer", "pos"]),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_per_token_tables_equal_each_prompt_alone(case, name):
    model, prompts, lens = case
    fn, kwargs, keys = TABLES[name]
    if name == "tuned_lens":
        kwargs = {**kwargs, "lens": lens}
    want = alone(lambda t, **kw: fn(model, t, **kw), prompts, **kwargs)
    if name != "attention_patterns":
        assert want.groupby("batch").pos.max().tolist() == [n - 1 - (name == "token_losses") for n in LENGTHS]
    for label, data, size in padded_runs(prompts):
        assert_same_table(fn(model, data, batch_size=size, **kwargs), want, keys, f"{name} {label}")


@pytest.mark.parametrize("pos", [-1, 1])
def test_per_prompt_tables_score_each_prompts_own_position(case, pos):
    model, prompts, _ = case
    gen = torch.Generator().manual_seed(1)
    answers = torch.randint(0, model.cfg.d_vocab, (len(prompts),), generator=gen)
    wrong = 5
    want_answers = pd.concat([an.answer_table(model, p[None], int(answers[i]), wrong, pos=pos).assign(batch=i, prompt=i)
                              for i, p in enumerate(prompts)], ignore_index=True)
    # the scored position, counted within the prompt, whatever the padding
    assert want_answers.pos.tolist() == [(n + pos) if pos < 0 else pos for n in LENGTHS]
    want_diff = want_answers[["prompt", "pos", "answer", "wrong", "logit_diff"]]
    dla = model.cfg.norm_placement == "pre"
    if dla:
        want_dla = pd.concat([an.direct_logit_attribution(model, p[None], int(answers[i]), wrong, pos=pos)
                              .assign(batch=i, prompt=i) for i, p in enumerate(prompts)], ignore_index=True)
    # pos >= 0 differs from the column only on the left: one left-padded run checks it
    for label, data, size in padded_runs(prompts, RUNS if pos < 0 else RUNS[:1]):
        got = an.answer_table(model, data, answers, wrong, pos=pos, batch_size=size)
        assert_same_table(got, want_answers, ["batch"], f"answer_table {label}")
        got = an.logit_diff(model, data, batch_size=size, answer=answers, wrong=wrong, pos=pos)
        assert_same_table(got, want_diff, ["prompt"], f"logit_diff {label}")
        if dla:
            got = an.direct_logit_attribution(model, data, answers, wrong, pos=pos, batch_size=size)
            assert_same_table(got, want_dla, ["batch", "granularity", "component"], f"dla {label}")


def test_aggregates_equal_reductions_of_each_prompt_alone(case):
    model, prompts, lens = case
    per_token = pd.concat([alone(lambda t: an.logit_lens(model, t, k=1), prompts),
                           alone(lambda t: an.tuned_lens(model, t, lens, k=1), prompts)], ignore_index=True)
    has = per_token[per_token.target_rank > 0]
    want = per_token.groupby(["lens", "layer"]).agg(n_tokens=("pos", "size"), kl_to_final=("kl_to_final", "mean"),
                                                   entropy=("entropy", "mean"))
    want["target_prob"] = has.groupby(["lens", "layer"]).target_prob.mean()
    want["target_rank"] = has.groupby(["lens", "layer"]).target_rank.mean()
    want["top1_accuracy"] = (has.top1_id == has.target_id).groupby([has.lens, has.layer]).mean()
    want = want.reset_index()
    kl = want.rename(columns={"kl_to_final": "kl"})[["layer", "lens", "kl"]]

    # head scores: each prompt's score weighted by its number of scored queries
    kinds = an.SCORE_KINDS
    n_queries = {k: np.array([int(an.detection_mask(k, p[None]).any(-1).sum()) for p in prompts]) for k in kinds}
    scores = [an.head_scores(model, p[None]) for p in prompts]
    want_scores = scores[0][["layer", "head", "kind"]].copy()
    want_scores["score"] = [sum(s.score.iloc[j] * n_queries[kind][i] for i, s in enumerate(scores)) /
                            max(n_queries[kind].sum(), 1) for j, kind in enumerate(want_scores.kind)]
    repeats = sum(s.attrs["layout"]["repeats"] for s in scores)
    assert repeats > 0
    for label, data, size in padded_runs(prompts):
        got = pd.concat([an.logit_lens(model, data, batch_size=size, aggregate=True),
                         an.tuned_lens(model, data, lens, batch_size=size, aggregate=True)], ignore_index=True)
        assert_same_table(got.drop(columns="layer_label"), want, ["lens", "layer"], f"aggregate lens {label}")
        assert_same_table(an.compare_lenses(model, data, lens, batch_size=size), kl, ["layer", "lens"],
                          f"compare_lenses {label}")
        got = an.head_scores(model, data, batch_size=size)
        assert_same_table(got, want_scores, ["layer", "head", "kind"], f"head_scores {label}")
        assert got.attrs["layout"] == {"source": "tokens", "batch": len(prompts), "n_pos": max(LENGTHS),
                                       "repeats": repeats}


def test_residual_stack_rows_are_each_prompt_alone(case):
    model, prompts, _ = case
    want = [an.residual_stack(model, p[None]) for p in prompts]
    for label, data, size in padded_runs(prompts):
        stack, logits = an.residual_stack(model, data, batch_size=size)
        real = data.attention_mask.bool()
        assert (stack[:, ~real] == 0).all() and (logits[~real] == 0).all()  # pads: zero, never NaN
        for i, (want_stack, want_logits) in enumerate(want):
            torch.testing.assert_close(stack[:, i, real[i]], want_stack[:, 0], **TOL, msg=label)
            torch.testing.assert_close(logits[i, real[i]], want_logits[0], **TOL, msg=label)


# ---- texts, prompt sets and their metadata; training a lens on padded data -------------------------
TEXTS = ["Mary and John went to the park , John gave a ball to", "Tom gave a book to",
         "Anna met Tom . Tom gave a cup to", "Mary went home"]


@pytest.fixture(scope="module")
def word_model():
    tok = WordTokenizer.from_text(" ".join(TEXTS) + " Mary John Tom Anna")
    return wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, positional="rope", n_kv_heads=2), tokenizer=tok).eval()


def test_prompt_sets_give_per_row_answers_and_meta(word_model):
    model = word_model
    ds = wb.PromptSet(TEXTS, answers=["Mary", "Tom", "Anna", "John"], wrong=["John", "Anna", "Tom", "Mary"],
                      meta=pd.DataFrame({"template": ["a", "b", "b", "c"], "pos": [9, 8, 7, 6]}))
    table = an.logit_diff(model, ds, batch_size=3)
    assert table.prompt.tolist() == [0, 1, 2, 3] and table.template.tolist() == ["a", "b", "b", "c"]
    assert table.meta_pos.tolist() == [9, 8, 7, 6]  # a meta column named like a table column keeps its values
    for i, text in enumerate(TEXTS):
        ids = model.to_tokens(text)
        logits = model(ids)[0, -1].detach()
        want = logits[model.to_single_token(ds.answers[i])] - logits[model.to_single_token(ds.wrong[i])]
        assert table.logit_diff[i] == pytest.approx(float(want), abs=1e-5)
    dla = an.direct_logit_attribution(model, ds, batch_size=2)
    sums = dla[dla.granularity == "layer"].groupby("prompt").attribution.sum()
    np.testing.assert_allclose(sums.to_numpy(), table.logit_diff.to_numpy(), atol=1e-4)
    assert set(dla.template) == {"a", "b", "c"}
    # texts of any lengths are data too, tokenized batch by batch
    lens = an.logit_lens(model, TEXTS, batch_size=3)
    assert_same_table(lens, alone(lambda t: an.logit_lens(model, t), [model.to_tokens(t)[0] for t in TEXTS]),
                      ["lens", "batch", "layer", "pos"], "texts")
    losses = an.token_losses(model, ds, batch_size=2)
    summary = an.loss_summary(losses)
    assert summary.predictions.tolist() == [len(model.to_tokens(t)[0]) - 1 for t in TEXTS]
    with torch.no_grad():
        alone_loss = [float(model(model.to_tokens(t), return_type="loss")) for t in TEXTS]
    np.testing.assert_allclose(summary.loss, alone_loss, rtol=1e-5)
    assert summary.template.tolist() == ["a", "b", "b", "c"]


def test_a_tuned_lens_trains_the_same_on_padded_data_either_way(word_model):
    model = word_model
    ids = [model.tokenizer.encode(t) for t in TEXTS]
    kw = dict(steps=4, batch_size=3, progress=False, seed=1)
    reference = an.train_tuned_lens(model, TEXTS, **kw)
    assert reference.info["train"]["n_tokens"] == sum(map(len, ids))
    for side in ("left", "right"):
        for cached in (2**30, 0):  # the streams kept, or each step's prompts run again
            lens = an.train_tuned_lens(model, TokenBatch.from_ids(ids, 0, side), max_cached_bytes=cached, **kw)
            torch.testing.assert_close(lens.weight, reference.weight, **TOL)
            np.testing.assert_allclose(lens.info["history"], reference.info["history"], **TOL)


def test_real_positions_ignore_the_padding_side():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    assert real_positions(mask).tolist() == [[-1, -1, 0, 1], [0, 1, 2, -1]]


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_masks_and_positions_are_named():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 5))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4\)"):
        an.logit_lens(model, tokens, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="attention_mask row 1 is all padding"):
        an.token_losses(model, tokens, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="attention_mask row 0 is all padding"):
        an.head_scores(model, TokenBatch(tokens, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])))
    with pytest.raises(ValueError, match="attention_mask goes with a token tensor"):
        an.residual_norms(model, TokenBatch(tokens, torch.ones_like(tokens)), attention_mask=torch.ones(2, 5))
    short = TokenBatch.from_ids([[1, 2, 3, 4], [5, 6]], 0, "left")
    with pytest.raises(ValueError, match="pos=3 is outside prompt 1, which has 2 tokens"):
        an.answer_table(model, short, 1, 2, pos=3)
    with pytest.raises(ValueError, match="pos=-3 is outside prompt 1"):
        an.direct_logit_attribution(model, short, 1, 2, pos=-3)
    with pytest.raises(ValueError, match="answer is needed"):
        an.direct_logit_attribution(model, short)
    with pytest.raises(ValueError, match="logit_diff needs wrong tokens"):
        an.logit_diff(model, short, answer=1)
    with pytest.raises(ValueError, match=r"answer must be a token id or a \[batch=2\] tensor"):
        an.direct_logit_attribution(model, short, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="targets go with token ids"):
        an.logit_lens(model, "a text", targets=torch.zeros(1, 2, dtype=torch.long))
