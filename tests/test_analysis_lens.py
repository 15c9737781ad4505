"""Logit lens and tuned lens against direct computations, and on the shipped story models."""

from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis import TunedLens, compare_lenses, logit_lens, train_tuned_lens, tuned_lens
from workbench.checkpoint import read_meta
from workbench.data import get_task

REPO = Path(__file__).resolve().parents[1]


def _model(**kw):
    return wb.HookedDecoder(tiny(**kw)).eval()


@pytest.mark.parametrize("kw", [{}, {"norm": "rmsnorm", "positional": "rope"}, {"norm": "none"}])
def test_logit_lens_last_layer_is_the_models_distribution(kw):
    model = _model(**kw)
    tokens = torch.randint(0, 50, (2, 9))
    table = logit_lens(model, tokens, k=3)
    with torch.no_grad():
        probs = model(tokens).softmax(-1)
    final = table[table.layer == model.cfg.n_layers].sort_values(["batch", "pos"])
    assert len(table) == (model.cfg.n_layers + 1) * 2 * 9
    np.testing.assert_allclose(final.kl_to_final, 0, atol=1e-5)
    top = probs.max(-1)
    np.testing.assert_allclose(final.top1_prob, top.values.flatten().numpy(), rtol=1e-5)
    assert (final.top1_id.to_numpy() == top.indices.flatten().numpy()).all()
    expected = probs[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    with_target = final[final.target_rank > 0]
    np.testing.assert_allclose(with_target.target_prob, expected.flatten().numpy(), rtol=1e-5)
    assert final[final.pos == 8].target_rank.eq(-1).all()  # no next token at the end


def test_logit_lens_matches_transformer_lens_recomputed_norm():
    model = _model()
    tokens = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    stack = cache.accumulated_resid(layer=None, apply_ln=False)
    logits = (cache.apply_ln_to_stack(stack, layer=None, recompute_ln=True) @ model.W_U).detach()
    table = logit_lens(model, tokens, k=1).sort_values(["layer", "pos"])
    np.testing.assert_allclose(table.top1_prob, logits.softmax(-1).max(-1).values.flatten().numpy(), rtol=1e-5)
    # rank 1 exactly when the target is the top token
    has = table[table.target_rank > 0]
    assert ((has.target_rank == 1) == (has.top1_id == has.target_id)).all()


def test_identity_tuned_lens_is_the_logit_lens():
    model = _model()
    tokens = torch.randint(0, 50, (2, 6))
    lens = TunedLens(model.cfg.n_layers, model.cfg.d_model)
    a, b = logit_lens(model, tokens), tuned_lens(model, tokens, lens)
    np.testing.assert_allclose(a.kl_to_final, b.kl_to_final, atol=1e-6)
    assert (b.lens == "tuned").all()


def test_tuned_lens_beats_logit_lens_and_round_trips(tmp_path):
    model = _model()
    data = torch.randint(0, 50, (32, 12))
    lens = train_tuned_lens(model, data, steps=25, batch_size=16, lr=3e-3, progress=False)
    held_out = torch.randint(0, 50, (8, 16))
    kl = compare_lenses(model, held_out, lens).pivot(index="layer", columns="lens", values="kl")
    assert (kl.loc[: model.cfg.n_layers - 1, "tuned"] < kl.loc[: model.cfg.n_layers - 1, "logit"]).all(), kl

    wb.save_checkpoint(model, tmp_path / "ckpt")
    lens.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "tuned_lens.safetensors").exists() and (tmp_path / "ckpt" / "tuned_lens.json").exists()
    loaded = TunedLens.load(tmp_path / "ckpt", model)
    np.testing.assert_allclose(tuned_lens(model, held_out, loaded).kl_to_final,
                               tuned_lens(model, held_out, lens).kl_to_final, rtol=1e-6)
    assert loaded.info["train"]["steps"] == 25
    wb.load_checkpoint(tmp_path / "ckpt")  # the checkpoint itself is untouched and still loads
    with pytest.raises(ValueError, match="n_layers"):
        TunedLens.load(tmp_path / "ckpt", _model(n_layers=3))


def test_training_a_tuned_lens_computes_no_gradient_for_the_model_and_leaves_it_as_it_was():
    model = _model()
    next(model.parameters()).requires_grad_(False)  # a user's own choice, kept as it was
    computed = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad, name=name: computed.append(name))
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    train_tuned_lens(model, torch.randint(0, 50, (8, 12)), steps=3, batch_size=4, progress=False)
    assert computed == []  # the lens learns; the model's weight gradients were never computed
    assert {name: p.requires_grad for name, p in model.named_parameters()} == before
    assert all(p.grad is None for p in model.parameters())


def test_a_tuned_lens_trains_with_gradients_switched_off_around_it():
    model = _model()
    data = torch.randint(0, 50, (8, 12))
    reference = train_tuned_lens(model, data, steps=3, batch_size=4, progress=False)
    with torch.no_grad():  # as a notebook that switched gradients off earlier has it
        lens = train_tuned_lens(model, data, steps=3, batch_size=4, progress=False)
        assert not torch.is_grad_enabled()  # the caller's setting is left as it was
    identity = torch.eye(lens.weight.shape[-1]).expand_as(lens.weight)
    assert not torch.equal(lens.weight, identity)  # it learned
    assert torch.equal(lens.weight, reference.weight)  # the lens trained with gradients on


def test_tuned_lens_load_missing_or_corrupt_is_a_checkpoint_error(tmp_path):
    with pytest.raises(wb.CheckpointError, match="train one"):
        TunedLens.load(tmp_path)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    TunedLens(2, 32).save(tmp_path / "a")
    (tmp_path / "a" / "tuned_lens.json").unlink()
    with pytest.raises(wb.CheckpointError, match="incomplete or corrupt"):
        TunedLens.load(tmp_path / "a")
    TunedLens(2, 32).save(tmp_path / "b")
    weights = tmp_path / "b" / "tuned_lens.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(wb.CheckpointError, match="incomplete or corrupt"):
        TunedLens.load(tmp_path / "b")


@pytest.mark.parametrize("name", ["stories-2020", "stories-2026"])
def test_shipped_story_models_tuned_lens_beats_logit_lens(name):
    path = REPO / "checkpoints" / name
    if not (path / "config.json").exists():
        pytest.skip(f"checkpoints/{name} is not built yet (scripts/make_checkpoints.py builds it)")
    if not (path / "tuned_lens.safetensors").exists():
        pytest.skip(f"checkpoints/{name} has no tuned lens yet: run experiments/lens_comparison.py")
    model, _ = wb.load_checkpoint(path)
    model.eval()
    lens = TunedLens.load(path, model)
    meta = read_meta(path)
    task = get_task(meta["task"], **meta.get("task_options", {}))
    held_out = task.batch(16, model.cfg.n_ctx, step=7, split="val")  # data the lens never trained on
    kl = compare_lenses(model, held_out, lens).pivot(index="layer", columns="lens", values="kl")
    last = model.cfg.n_layers
    assert (kl.loc[: last - 1, "tuned"] < kl.loc[: last - 1, "logit"]).all(), kl


def test_a_long_prompts_lens_is_computed_a_chunk_of_positions_at_a_time(monkeypatch):
    """The lens over a long prompt never holds every position's [layer, pos, vocab] logits at once (the app's
    Inspect page ran out of 24 GB on a 2,501-token prompt of the 49,152-token real model): with a chunk of 3
    positions the projections see at most 3, and the tables (padded batch, targets, tuned lens, aggregate)
    equal TransformerLens' recomputed-norm lens and the one-chunk run."""
    import workbench.analysis.lens as lens_mod

    model = _model(norm="rmsnorm", positional="rope")
    tokens = torch.randint(0, 50, (2, 11))
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0  # left padding: the second prompt is 7 tokens
    tuned = TunedLens(model.cfg.n_layers, model.cfg.d_model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.01 * torch.randn_like(p))
    whole = [logit_lens(model, tokens, attention_mask=mask), tuned_lens(model, tokens, tuned, attention_mask=mask),
             logit_lens(model, tokens, attention_mask=mask, aggregate=True)]
    widths = []
    project = lens_mod._project
    monkeypatch.setattr(lens_mod, "_project", lambda m, r: widths.append(r.shape[2]) or project(m, r))
    per_position = (model.cfg.n_layers + 1) * 2 * model.cfg.d_vocab * 4
    monkeypatch.setattr(lens_mod, "LENS_CHUNK_BYTES", 3 * per_position)
    chunked = [logit_lens(model, tokens, attention_mask=mask), tuned_lens(model, tokens, tuned, attention_mask=mask),
               logit_lens(model, tokens, attention_mask=mask, aggregate=True)]
    assert widths and max(widths) == 3 and sum(widths) == 3 * 11
    for a, b in zip(whole, chunked):
        assert list(a.columns) == list(b.columns) and len(a) == len(b)
        for col in a.columns:
            if a[col].dtype.kind == "f":
                np.testing.assert_allclose(a[col], b[col], rtol=1e-6, atol=1e-7, err_msg=col)
            else:
                assert (a[col].to_numpy() == b[col].to_numpy()).all(), col
    # and against TransformerLens' own recomputed-norm lens, the first prompt's last position
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1])
    stack = cache.accumulated_resid(layer=None, apply_ln=False)
    ref = (cache.apply_ln_to_stack(stack, layer=None, recompute_ln=True) @ model.W_U).softmax(-1)[:, 0, -1]
    got = chunked[0][(chunked[0].batch == 0) & (chunked[0].pos == 10)].sort_values("layer")
    np.testing.assert_allclose(got.top1_prob, ref.max(-1).values.detach().numpy(), rtol=1e-5)


def test_the_logit_lens_unembeds_every_layer_in_one_product():
    """One unembedding per layer read the whole [d_model, d_vocab] matrix once per layer (SmolLM2's
    31 streams of a 14-token prompt: 3.8 s on one thread, 0.44 s as one product); the lens now
    unembeds the model's forward and all its layers' streams in two calls, whatever the layer count."""
    model = _model(n_layers=3)
    shapes = []
    handle = model.unembed.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        table = logit_lens(model, torch.randint(0, 50, (2, 9)), k=3)
    finally:
        handle.remove()
    assert shapes == [(2, 9, model.cfg.d_model), (4 * 2, 9, model.cfg.d_model)]
    assert sorted(table.layer.unique()) == [0, 1, 2, 3]
