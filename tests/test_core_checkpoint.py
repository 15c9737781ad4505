"""Checkpoints: bit-exact round trip, atomic writes, and one clear error per broken input."""

import json

import pytest
import torch

import workbench as wb
from factories import tiny
from workbench.tokenizer import CharTokenizer


@pytest.fixture
def saved(tmp_path):
    tok = CharTokenizer("abcdef")
    model = wb.HookedDecoder(tiny(d_vocab=tok.vocab_size, positional="rope", tie_embeddings=False), tokenizer=tok)
    path = wb.save_checkpoint(model, tmp_path / "ckpt", step=12, metrics={"val_loss": 1.5})
    return model, path


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_bit_exact(tmp_path, tied):
    model = wb.HookedDecoder(tiny(tie_embeddings=tied, ffn="moe", n_kv_heads=2))
    wb.save_checkpoint(model, tmp_path / "c")
    loaded, tok = wb.load_checkpoint(tmp_path / "c")
    assert tok is None and loaded.cfg == model.cfg and not loaded.training
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    toks = torch.randint(0, 50, (2, 9))
    assert torch.equal(model.eval()(toks), loaded(toks))


def test_layout_meta_and_tokenizer(saved):
    model, path = saved
    assert {p.name for p in path.iterdir()} == {"model.safetensors", "config.json", "meta.json", "tokenizer.json"}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 12 and meta["metrics"] == {"val_loss": 1.5} and meta["format_version"] == 1
    loaded, tok = wb.load_checkpoint(path)
    assert tok.decode(tok.encode("cafe")) == "cafe" and loaded.tokenizer is tok


def test_overwrite_is_atomic_and_failures_keep_the_old_checkpoint(saved, tmp_path):
    model, path = saved

    class Boom:
        def save(self, directory):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        wb.save_checkpoint(model, path, tokenizer=Boom())
    loaded, tok = wb.load_checkpoint(path)  # the old one is intact
    assert tok is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def error_for(path):
    with pytest.raises(wb.CheckpointError) as err:
        wb.load_checkpoint(path)
    return str(err.value)


def test_missing_directory_and_files(saved, tmp_path):
    _, path = saved
    assert "does not exist" in error_for(tmp_path / "nope")
    (path / "model.safetensors").unlink()
    assert "model.safetensors is missing" in error_for(path)
    (path / "config.json").unlink()
    assert "config.json is missing" in error_for(path)


def test_truncated_and_corrupt_weights(saved):
    _, path = saved
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt" in error_for(path)
    weights.write_bytes(b"\x00" * 64)
    assert "truncated or corrupt" in error_for(path)


def test_config_weight_mismatch_and_unknown_keys(saved):
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"d_mlp": 64}))
    msg = error_for(path)
    assert "do not match" in msg and "W_in" in msg
    (path / "config.json").write_text(json.dumps(config | {"colour": "blue"}))
    assert "colour" in error_for(path)
    (path / "config.json").write_text("{not json")
    assert "not valid JSON" in error_for(path)


def test_newer_format_version(saved):
    _, path = saved
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps(meta | {"format_version": 99}))
    assert "newer" in error_for(path)


def test_never_unpickles(saved, monkeypatch):
    _, path = saved

    def forbidden(*a, **k):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", forbidden)
    wb.load_checkpoint(path)


def test_checkpoint_permissions_follow_the_umask(saved):
    import os
    _, path = saved
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("precious")
    model = wb.HookedDecoder(tiny())
    with pytest.raises(wb.CheckpointError, match="not a checkpoint"):
        wb.save_checkpoint(model, notes)
    assert (notes / "notes.txt").read_text() == "precious"
    (tmp_path / "file").write_text("x")
    with pytest.raises(wb.CheckpointError, match="not a directory"):
        wb.save_checkpoint(model, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    wb.save_checkpoint(model, tmp_path / "empty")  # empty folders and old checkpoints are fine
    wb.save_checkpoint(model, tmp_path / "empty")


def test_meta_cannot_override_format_and_extra_files_stay_inside(tmp_path):
    model = wb.HookedDecoder(tiny())
    path = wb.save_checkpoint(model, tmp_path / "c", step=3, meta={"format_version": 99, "step": 7, "task": "x"})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format_version"] == 1 and meta["step"] == 3 and meta["task"] == "x"
    for bad in ("../escaped.txt", "/tmp/abs.txt"):
        with pytest.raises(ValueError, match="relative path"):
            wb.save_checkpoint(model, tmp_path / "c", extra_files={bad: "x"})
    assert not (tmp_path / "escaped.txt").exists()
