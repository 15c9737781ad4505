"""Attention-pattern tables and head scores against TransformerLens' head_detector, and the
shipped induction model."""

from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny
from transformer_lens import head_detector as hd

import workbench as wb
from workbench.analysis import (
    AblationSpec,
    ablate,
    ablation_hooks,
    attention_change,
    attention_patterns,
    detection_mask,
    head_scores,
    repeated_random_tokens,
)

REPO = Path(__file__).resolve().parents[1]


def test_attention_patterns_table_matches_the_cache():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 7))
    table = attention_patterns(model, tokens, batch_index=1)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    assert len(table) == 2 * 4 * 7 * 8 // 2  # layers x heads x causal (query, key) pairs
    assert (table.key_pos <= table.query_pos).all() and (table.batch == 1).all()
    row = table[(table.layer == 1) & (table["head"] == 2) & (table.query_pos == 5) & (table.key_pos == 3)]
    assert float(row.attention.iloc[0]) == pytest.approx(float(cache["pattern", 1][1, 2, 5, 3]), rel=1e-6)
    assert row.query_token.iloc[0] == str(int(tokens[1, 5])) and row.key_token.iloc[0] == str(int(tokens[1, 3]))
    np.testing.assert_allclose(table.groupby(["layer", "head", "query_pos"]).attention.sum(), 1, rtol=1e-5)


@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
def test_detection_masks_are_transformer_lens_patterns(kind):
    tokens = torch.tensor([[3, 5, 7, 3, 5, 9, 3, 5]])
    ours = detection_mask(kind, tokens)[0].float()
    theirs = getattr(hd, f"get_{kind}_head_detection_pattern")(tokens)
    assert torch.equal(ours, theirs)


def test_head_scores_agree_with_transformer_lens_scores():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = repeated_random_tokens(model, seq_len=8, batch=1, seed=3)
    table = head_scores(model, tokens).set_index(["kind", "layer", "head"])["score"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, remove_batch_dim=True)
    n = tokens.shape[1]
    first = torch.zeros(n, n)
    first[1:, 0] = 1
    patterns = {"previous_token": hd.get_previous_token_head_detection_pattern(tokens),
                "duplicate_token": hd.get_duplicate_token_head_detection_pattern(tokens),
                "induction": hd.get_induction_head_detection_pattern(tokens), "first_token": first}
    for kind, pattern in patterns.items():
        rows_with_target = int((pattern.sum(-1) > 0).sum())
        for layer in range(2):
            for head in range(4):
                tl = hd.compute_head_attention_similarity_score(
                    cache["pattern", layer][head], pattern, exclude_bos=False, exclude_current_token=False,
                    error_measure="mul")
                # TL averages over every query row, ours over the rows that have a target
                assert table[kind, layer, head] == pytest.approx(tl * n / rows_with_target, rel=1e-5)


def test_head_scores_bad_kind():
    model = wb.HookedDecoder(tiny())
    with pytest.raises(ValueError, match="previous_token"):
        head_scores(model, kinds=["nope"])
    with pytest.raises(ValueError, match="n_ctx"):
        repeated_random_tokens(model, seq_len=20)


def test_shipped_induction_model_has_an_induction_head_that_matters():
    path = REPO / "checkpoints" / "induction-attn2l"
    if not (path / "config.json").exists():
        pytest.skip("checkpoints/induction-attn2l is missing: scripts/make_checkpoints.py builds it")
    model, _ = wb.load_checkpoint(path)
    model.eval()
    scores = head_scores(model, seq_len=min(24, model.cfg.n_ctx // 2 - 1), batch=16, seed=123)
    induction = scores[scores.kind == "induction"].set_index(["layer", "head"])["score"]
    layer, head = induction.idxmax()
    assert induction.max() > 0.5, induction
    assert layer >= 1  # induction needs a previous-token head below it

    tokens = repeated_random_tokens(model, seq_len=min(24, model.cfg.n_ctx // 2 - 1), batch=16, seed=7)
    half = tokens.shape[1] // 2

    def second_half_loss(spec=None):
        with torch.no_grad():
            logits = ablate(model, tokens, spec) if spec else model(tokens)
        losses = model.loss_fn(logits, tokens, per_token=True)
        return float(losses[:, half:].mean())

    clean = second_half_loss()
    ablated = second_half_loss(AblationSpec("head", layer, head=head, method="zero"))
    assert ablated > clean + 0.2, (clean, ablated)
    # every induction head at once: the copying is gone
    heads = [AblationSpec("head", l, head=h) for (l, h), s in induction.items() if s > 0.5]
    hooks = [hook for spec in heads for hook in ablation_hooks(model, tokens, spec)]
    with torch.no_grad():
        losses = model.loss_fn(model.run_with_hooks(tokens, fwd_hooks=hooks), tokens, per_token=True)
    assert float(losses[:, half:].mean()) > clean + 1.0


def test_head_scores_report_the_layout_they_were_measured_on():
    model = wb.HookedDecoder(tiny()).eval()
    probe = head_scores(model, seq_len=6, batch=3, seed=5)
    tokens = repeated_random_tokens(model, 6, 3, seed=5)
    # Independent count: positions whose token occurred earlier in the same row.
    repeats = sum(int(row[q] in row[:q]) for row in tokens.tolist() for q in range(len(row)))
    assert probe.attrs["layout"] == {"source": "repeated_random_tokens", "seq_len": 6, "seed": 5,
                                     "batch": 3, "n_pos": 12, "repeats": repeats}
    prompt = head_scores(model, torch.tensor([[3, 4, 3, 9, 4]]))
    assert prompt.attrs["layout"] == {"source": "tokens", "batch": 1, "n_pos": 5, "repeats": 2}


def test_shipped_induction_model_spreads_induction_over_layer_one():
    """The claim of docs/reference/checkpoints.md: every layer-1 head scores high on fresh layouts and the top one moves."""
    path = REPO / "checkpoints" / "induction-attn2l"
    if not (path / "config.json").exists():
        pytest.skip("checkpoints/induction-attn2l is not built yet (scripts/make_checkpoints.py)")
    model, _ = wb.load_checkpoint(path)
    model.eval()
    best = set()
    for seq_len in (8, 16, 31):
        scores = head_scores(model, kinds=["induction"], seq_len=seq_len, batch=32, seed=0)
        by_layer = scores.groupby("layer")["score"]
        assert by_layer.min()[1] > 0.6 and by_layer.max()[0] < 0.1, scores
        layer_one = scores[scores.layer == 1].set_index("head")["score"]
        best.add(int(layer_one.idxmax()))
    assert len(best) > 1, best  # the highest-scoring head depends on the layout


def test_head_scores_wide_is_one_row_per_head():
    model = wb.HookedDecoder(tiny()).eval()
    long = head_scores(model, seq_len=6)
    wide = head_scores(model, seq_len=6, wide=True)
    assert list(wide.columns) == ["layer", "head", *wb.analysis.SCORE_KINDS] and len(wide) == 2 * 4
    for row in long.itertuples():
        assert wide[(wide.layer == row.layer) & (wide["head"] == row.head)][row.kind].iloc[0] == row.score


def test_attention_change_finds_the_heads_an_ablation_moves():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (1, 8))
    clean = attention_patterns(model, tokens)
    assert attention_change(clean, clean).empty
    with model.hooks(fwd_hooks=ablation_hooks(model, tokens, AblationSpec("head", 0, head=1))):
        ablated = attention_patterns(model, tokens)
    table = attention_change(clean, ablated)
    assert list(table.columns) == ["layer", "head", "max_change"]
    assert set(table.layer) == {1}  # only heads above the ablated one read what it wrote
    assert table.max_change.is_monotonic_decreasing and (table.max_change > 1e-6).all()
    for row in table.itertuples():
        mine = (clean.layer == row.layer) & (clean["head"] == row.head)
        expected = (ablated[mine].attention.to_numpy() - clean[mine].attention.to_numpy())
        assert row.max_change == pytest.approx(np.abs(expected).max())
    with pytest.raises(ValueError, match="same batch"):
        attention_change(clean, attention_patterns(model, tokens[:, :6]))
