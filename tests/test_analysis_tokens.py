"""Per-position tables against direct computations: next-token losses from the logits by
cross-entropy, their change between two runs, residual norms from the cached hook activations."""

import pytest
import torch
import torch.nn.functional as F
from factories import tiny

import workbench as wb
from workbench.analysis import AblationSpec, ablation_hooks, residual_norms, token_loss_change, token_losses
from workbench.tokenizer import CharTokenizer


def test_token_losses_match_cross_entropy_of_the_logits():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 7))
    table = token_losses(model, tokens)
    assert len(table) == 2 * 6 and list(table.columns[:4]) == ["batch", "pos", "token", "next_token"]
    with torch.no_grad():
        logits = model(tokens)
        per_token = model(tokens, return_type="loss", loss_per_token=True)
    for row in table.itertuples():
        expected = F.cross_entropy(logits[row.batch, row.pos], tokens[row.batch, row.pos + 1])
        assert abs(row.loss - float(expected)) < 1e-5 and abs(row.loss - float(per_token[row.batch, row.pos])) < 1e-5
        assert row.token == str(int(tokens[row.batch, row.pos])) and row.next_token == str(int(tokens[row.batch, row.pos + 1]))
        top = int(logits[row.batch, row.pos].argmax())
        assert row.predicted == str(top) and row.correct == (top == int(tokens[row.batch, row.pos + 1]))
    assert abs(table["prob"] - (-table["loss"]).map(lambda x: torch.tensor(x).exp().item())).max() < 1e-6


def test_token_losses_labels_text_with_the_tokenizer():
    tok = CharTokenizer("abc ")
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size), tokenizer=tok).eval()
    table = token_losses(model, "ab ca")
    assert table["token"].tolist() == list("ab c") and table["next_token"].tolist() == list("b ca")


def test_residual_norms_match_the_cache():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (2, 5))
    table = residual_norms(model, tokens)
    n = model.cfg.n_layers
    assert len(table) == (n + 1) * 2 * 5
    _, cache = model.run_with_cache(tokens)
    streams = [cache[f"blocks.{l}.hook_resid_pre"] for l in range(n)] + [cache[f"blocks.{n - 1}.hook_resid_post"]]
    for row in table.itertuples():
        expected = streams[row.layer][row.batch, row.pos].norm()
        assert abs(row.norm - float(expected)) < 1e-4 * max(1.0, float(expected))
        assert row.layer_label == ("final" if row.layer == n else f"resid_pre {row.layer}")
        assert row.token == str(int(tokens[row.batch, row.pos]))


def test_token_loss_change_lines_up_two_runs_changed_predictions_first():
    model = wb.HookedDecoder(tiny()).eval()
    tokens = torch.randint(0, 50, (1, 9))
    clean = token_losses(model, tokens)
    with model.hooks(fwd_hooks=ablation_hooks(model, tokens, AblationSpec("resid", 1, positions=[4, 6]))):
        ablated = token_losses(model, tokens)
    table = token_loss_change(clean, ablated)
    assert len(table) == 8 and sorted(table["pos"]) == list(range(1, 9))  # the position of the token predicted
    by_pos = table.set_index("pos")
    for row in clean.itertuples():
        got = by_pos.loc[row.pos + 1]
        other = ablated[ablated.pos == row.pos].iloc[0]
        assert got.after == row.token and got.next_token == row.next_token
        assert got.loss_clean == row.loss and got.loss_changed == other.loss
        assert got.change == other.loss - row.loss
        assert got.prediction_changed == (row.predicted != other.predicted)
    assert (by_pos.loc[1:4, "change"] == 0).all() and (by_pos.loc[5:, "change"] != 0).any()  # causal
    flags = table["prediction_changed"].tolist()
    assert flags == sorted(flags, reverse=True)  # changed predictions first
    for flag in (True, False):
        assert table[table.prediction_changed == flag]["pos"].is_monotonic_increasing
    with pytest.raises(ValueError, match="same tokens"):
        token_loss_change(clean, token_losses(model, torch.randint(0, 50, (1, 9))))
