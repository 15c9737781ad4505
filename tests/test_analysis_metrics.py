"""The answer metrics against plain torch on the logits, the task answers of task prompts, and the
clean-minus-changed tables against the two tables they are built from."""

import numpy as np
import pandas as pd
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import (
    AblationSpec,
    AnswerMetric,
    ablate,
    ablation_sweep,
    activation_patching,
    answer_change,
    answer_table,
    attention_patterns,
    attribution_patching,
    direct_logit_attribution,
    dla_difference,
    lens_difference,
    logit_diff_metric,
    logit_lens,
    pattern_difference,
    suggest_answer,
    task_answer,
)
from workbench.analysis.ablation import ablation_hooks
from workbench.data import get_task


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return wb.HookedDecoder(tiny()).eval()


@pytest.fixture(scope="module")
def stories_model():
    task = get_task("stories")
    torch.manual_seed(0)
    cfg = tiny(d_vocab=task.vocab_size, n_ctx=32)
    return wb.HookedDecoder(cfg, tokenizer=task.tokenizer).eval(), task


def test_answer_metric_matches_torch_on_the_logits(model):
    tokens = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        logits = model(tokens)
    last = logits[:, -1].float()
    rows = torch.arange(3)
    assert float(AnswerMetric("logit_diff", 4, 9)(logits)) == pytest.approx(float(logit_diff_metric(4, 9)(logits)))
    assert float(AnswerMetric("logit", 4)(logits)) == pytest.approx(float(last[:, 4].mean()))
    probs = torch.softmax(last, -1)
    assert float(AnswerMetric("prob", 4)(logits)) == pytest.approx(float(probs[:, 4].mean()), rel=1e-5)
    assert float(AnswerMetric("logprob", 4)(logits)) == pytest.approx(float(probs[:, 4].log().mean()), rel=1e-5)
    ranks = [int((torch.argsort(last[r], descending=True) == 4).nonzero()) + 1 for r in range(3)]
    assert AnswerMetric("rank", 4).per_row(logits).tolist() == ranks
    # one answer per row, at another position
    per_row = AnswerMetric("logit_diff", (1, 2, 3), (5, 6, 7), pos=2).per_row(logits)
    expected = logits[rows, 2, torch.tensor([1, 2, 3])] - logits[rows, 2, torch.tensor([5, 6, 7])]
    torch.testing.assert_close(per_row, expected)


def test_answer_metric_is_hashable_and_checks_its_arguments(model):
    assert AnswerMetric("prob", torch.tensor(3)) == AnswerMetric("prob", 3)
    assert len({AnswerMetric("logit_diff", [1, 2], [3, 4]), AnswerMetric("logit_diff", (1, 2), (3, 4))}) == 1
    with pytest.raises(ValueError, match="kind="):
        AnswerMetric("accuracy", 1)
    with pytest.raises(ValueError, match="needs wrong"):
        AnswerMetric("logit_diff", 1)
    with pytest.raises(ValueError, match="answer"):
        AnswerMetric("prob", -1)
    logits = model(torch.randint(0, 50, (2, 5)))
    with pytest.raises(ValueError, match="answer must be token ids in \\[0, 50\\)"):
        AnswerMetric("prob", 50)(logits)
    with pytest.raises(ValueError, match="pos"):
        AnswerMetric("prob", 1, pos=5)(logits)
    with pytest.raises(ValueError, match="one per batch row"):
        AnswerMetric("prob", (1, 2, 3))(logits)


def test_answer_metric_drives_sweeps_and_patching(model):
    """Wherever a metric goes, an AnswerMetric does: the sweep's values equal the metric of the
    ablated logits, and attribution patching works on a frozen model (no parameter needs grad)."""
    tokens = torch.randint(0, 50, (1, 8))
    metric = AnswerMetric("logit_diff", 3, 7)
    sweep = ablation_sweep(model, tokens, metric=metric)
    row = sweep[(sweep.layer == 1) & (sweep["head"] == 2)].iloc[0]
    ablated = ablate(model, tokens, AblationSpec("head", 1, head=2))
    assert row.metric == pytest.approx(float(metric(ablated)), abs=1e-5)
    with torch.no_grad():
        assert row.clean == pytest.approx(float(metric(model(tokens))), abs=1e-5)
    corrupted = tokens.clone()
    corrupted[0, 3] = (corrupted[0, 3] + 1) % 50
    frozen = wb.HookedDecoder(tiny()).eval()
    frozen.load_state_dict(model.state_dict())
    for p in frozen.parameters():
        p.requires_grad_(False)
    attribution = attribution_patching(frozen, tokens, corrupted, metric, exact=True)
    assert attribution.attrs["correlation"] > 0.5
    exact = activation_patching(frozen, tokens, corrupted, metric, sites="head")
    np.testing.assert_allclose(attribution["exact"], exact["metric"] - exact["corrupted"], atol=1e-5)


def test_answer_table_and_change(model):
    tokens = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        logits = model(tokens).float()
    table = answer_table(model, tokens, answer=4, wrong=9, pos=-2)
    assert table["pos"].tolist() == [4, 4]
    np.testing.assert_allclose(table["logit_diff"], (logits[:, 4, 4] - logits[:, 4, 9]).numpy(), rtol=1e-5)
    np.testing.assert_allclose(table["prob"], torch.softmax(logits[:, 4], -1)[:, 4].numpy(), rtol=1e-5)
    assert table["top"].tolist() == [str(int(i)) for i in logits[:, 4].argmax(-1)]
    assert answer_table(model, tokens, answer=4)["logit_diff"].isna().all()

    hooks = ablation_hooks(model, tokens, AblationSpec("head", 0, head=1))
    with model.hooks(fwd_hooks=hooks):
        ablated = answer_table(model, tokens, answer=4, wrong=9, pos=-2)
    change = answer_change(table, ablated).set_index("measure")
    assert list(change.index) == ["logit_diff", "logit", "prob", "logprob", "rank"]
    assert change.loc["logit_diff", "difference"] == pytest.approx(table.logit_diff.mean() - ablated.logit_diff.mean())
    assert change.loc["prob", "units"] == "probability"
    assert "logit_diff" not in set(answer_change(answer_table(model, tokens, 4), answer_table(model, tokens, 4)).measure)
    with pytest.raises(ValueError, match="not an answer_table"):
        answer_change(table.drop(columns="rank"), ablated)


def test_the_task_answer_of_an_ioi_prompt(stories_model):
    model, task = stories_model
    meta = {"task": "stories", "task_options": task.options()}
    ids = task.tokenizer.encode("Once upon a time , Mary and John lived in a town . "
                                "When Mary and John went to the store , John gave a drink to")
    answer, wrong, why = task_answer(model, meta, ids)
    assert (answer, wrong) == (model.to_single_token("Mary"), model.to_single_token("John")) and "indirect object" in why
    suggested = suggest_answer(model, torch.tensor([ids]), meta=meta)
    assert (suggested["answer_str"], suggested["wrong_str"]) == ("Mary", "John")
    # every prompt of the task's own IOI set gets its answer
    batch = task.ioi_prompts(8)
    for row, correct, rival in zip(batch.tokens, batch.correct, batch.wrong):
        assert task_answer(model, meta, row.tolist())[:2] == (int(correct), int(rival))
    # not an IOI sentence, another position, or no task: the model's own top two
    other = task.tokenizer.encode("Mary and John went to the park .")
    assert task_answer(model, meta, other) is None
    logits = model(torch.tensor([other]))[0, -1]
    top = suggest_answer(model, torch.tensor([other]), meta=meta)
    assert [top["answer"], top["wrong"]] == logits.topk(2).indices.tolist() and "top prediction" in top["source"]
    early = suggest_answer(model, torch.tensor([ids]), pos=3, meta=meta)
    assert [early["answer"], early["wrong"]] == model(torch.tensor([ids[:4]]))[0, -1].topk(2).indices.tolist()
    assert task_answer(model, {}, ids) is None


def test_an_ioi_sentence_of_a_model_without_a_task_scores_the_indirect_object_against_the_subject():
    """A pretrained model's checkpoint names no task, so its IOI prompt got the model's top two predictions
    (SmolLM2-135M: ' Mary' against ' the'). In byte-level BPE the answer after "to" is the spaced name."""
    from workbench.analysis import ioi_answer
    from workbench.tokenizer import BPETokenizer

    text = ["When Mary and John went to the store, John gave a drink to Mary.",
            "Then Alice and Bob walked to the park, and Bob handed a book to Alice."] * 50
    tok = BPETokenizer.train(text, vocab_size=400)
    torch.manual_seed(0)
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, n_ctx=32), tokenizer=tok).eval()
    ids = tok.encode("When Mary and John went to the store, John gave a drink to")
    answer, wrong, why = ioi_answer(model, ids)
    assert (tok.token_str(answer), tok.token_str(wrong)) == (" Mary", " John") and "indirect object" in why
    suggested = suggest_answer(model, torch.tensor([ids]), meta={})
    assert (suggested["answer_str"], suggested["wrong_str"]) == (" Mary", " John")
    assert "IOI sentence" in suggested["source"]
    # the other names, the other way round
    ids = tok.encode("Then Alice and Bob walked to the park, and Bob handed a book to")
    assert [tok.token_str(i) for i in ioi_answer(model, ids)[:2]] == [" Alice", " Bob"]
    # not of that shape (no "to" at the end, or one name only): the model's own top two, as before
    for other in ("When Mary and John went to the store", "John gave a drink to"):
        ids = tok.encode(other)
        assert ioi_answer(model, ids) is None
        top = suggest_answer(model, torch.tensor([ids]), meta={})
        assert [top["answer"], top["wrong"]] == model(torch.tensor([ids]))[0, -1].topk(2).indices.tolist()


def test_the_task_answer_of_an_induction_prompt(model):
    meta = {"task": "induction", "task_options": {"vocab": 50}}
    ids = [5, 9, 13, 2, 7, 5, 9, 13]
    answer, wrong, _ = task_answer(model, meta, ids)
    assert answer == 2 and wrong != 2  # after 13 came 2 last time
    assert task_answer(model, meta, [1, 2, 3, 4]) is None


def test_lens_dla_and_pattern_differences(model):
    tokens = torch.randint(0, 50, (1, 6))
    spec = AblationSpec("head", 0, head=2)
    with model.hooks(fwd_hooks=ablation_hooks(model, tokens, spec)):
        lens_ablated = logit_lens(model, tokens, k=2)
        dla_ablated = direct_logit_attribution(model, tokens, 3, 8)
        pat_ablated = attention_patterns(model, tokens)
    lens_clean = logit_lens(model, tokens, k=2)
    diff = lens_difference(lens_clean, lens_ablated, "kl_to_final")
    assert len(diff) == len(lens_clean)
    merged = lens_clean.merge(lens_ablated, on=["batch", "layer", "pos"])
    np.testing.assert_allclose(diff["difference"], merged.kl_to_final_x - merged.kl_to_final_y)
    # the stream entering layer 0 is before the ablation (its KL is not: the final distribution moved)
    same = lens_difference(lens_clean, lens_ablated, "target_prob")
    assert (same.loc[same.layer == 0, "difference"].dropna() == 0).all() and same.difference.abs().max() > 0
    dla = dla_difference(direct_logit_attribution(model, tokens, 3, 8), dla_ablated)
    head = dla[(dla.granularity == "head") & (dla.component == "L0H2")].iloc[0]
    assert head.changed == 0 and head.difference == pytest.approx(head.clean)
    assert dla.groupby("granularity").changed.sum().to_numpy() == pytest.approx(dla_ablated.total.iloc[0], rel=1e-4)
    patterns = pattern_difference(attention_patterns(model, tokens), pat_ablated)
    assert (patterns.loc[patterns.layer == 0, "attention"] == 0).all()  # layer 0's pattern does not read head 2
    assert patterns.loc[patterns.layer == 1, "attention"].abs().max() > 0
    np.testing.assert_allclose(patterns.attention, patterns.attention_clean - patterns.attention_changed)
    with pytest.raises(ValueError, match="not a lens table"):
        lens_difference(lens_clean.drop(columns="pos"), lens_ablated)
    with pytest.raises(ValueError, match="same rows"):
        lens_difference(lens_clean, lens_ablated[lens_ablated.layer > 0])
    with pytest.raises(ValueError, match="value="):
        lens_difference(lens_clean, lens_ablated, "loss")
    assert isinstance(diff, pd.DataFrame)
