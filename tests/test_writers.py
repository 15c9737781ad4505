"""Every writer replaces only files it wrote: a file of the target name that is someone else's (a SAELens
download, a Hugging Face model's tokenizer.json or config.json, circuit-tracer's own files, a user's
notes) is refused with one ValueError naming it, byte-identical afterwards, unless ``overwrite=True``;
a re-save over the writer's own output still goes through. Each test fails on the code before the fix,
which replaced the file without a word (or wrote through a symbolic link to outside the folder).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis.circuits.circuit import Circuit
from workbench.analysis.dictionaries import DictionaryConfig
from workbench.analysis.dictionaries.circuit_tracer import load_circuit_tracer, save_circuit_tracer
from workbench.analysis.dictionaries.clt import CrossLayerTranscoder
from workbench.analysis.dictionaries.registry import make_dictionary
from workbench.analysis.dictionaries.saelens import load_dictionary, save_dictionary
from workbench.analysis.directions import Direction
from workbench.analysis.store import ActivationStore, TensorActivations
from workbench.analysis.dictionaries.trainer import train_sae
from workbench.tokenizer import ByteTokenizer, load_tokenizer


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _sae(seed: int = 0):
    sae = make_dictionary(DictionaryConfig(kind="relu", d_in=8, d_sae=16, hook_name="blocks.0.hook_resid_post"))
    sae.init_weights(torch.Generator().manual_seed(seed))
    return sae


def _transcoders(n: int = 2) -> list:
    out = []
    for layer in range(n):
        tc = make_dictionary(DictionaryConfig(kind="transcoder", d_in=8, d_sae=16, d_out=8,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        tc.init_weights(torch.Generator().manual_seed(layer))
        out.append(tc)
    return out


def _clt():
    clt = CrossLayerTranscoder(n_layers=2, d_in=8, d_sae=16, activation="jumprelu")
    clt.init_weights(torch.Generator().manual_seed(0))
    return clt


def _refused(write, folder: Path, match: str = "which the workbench did not write") -> None:
    """``write()`` raises ValueError and leaves ``folder`` exactly as it was."""
    before = _snapshot(folder)
    with pytest.raises(ValueError, match=match):
        write()
    assert _snapshot(folder) == before


def _saelens_folder(folder: Path) -> None:
    """What SAELens itself writes (no sae_meta.json of ours)."""
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(json.dumps({"d_in": 8, "d_sae": 16, "architecture": "standard"}))
    (folder / "sae_weights.safetensors").write_bytes(b"SAELens' own weights")


def test_save_dictionary_refuses_a_saelens_download_and_replaces_its_own(tmp_path):
    folder = tmp_path / "sae"
    _saelens_folder(folder)
    _refused(lambda: save_dictionary(_sae(), folder), folder)
    save_dictionary(_sae(), folder, overwrite=True)  # asked for: replaced
    save_dictionary(_sae(1), folder)  # ours now: a re-save needs no overwrite
    assert torch.equal(load_dictionary(folder).W_enc, _sae(1).W_enc)


def test_a_dictionary_saved_over_our_clt_loads_as_the_dictionary(tmp_path):
    """The folder held a CLT we saved; saving an SAE there left clt.json, and the folder loaded as the CLT."""
    folder = tmp_path / "d"
    save_dictionary(_clt(), folder)
    save_dictionary(_sae(), folder)
    loaded = load_dictionary(folder)
    assert not getattr(loaded, "cross_layer", False) and torch.equal(loaded.W_enc, _sae().W_enc)
    assert sorted(os.listdir(folder)) == ["cfg.json", "sae_meta.json", "sae_weights.safetensors"]


def test_save_clt_refuses_a_foreign_clt_json(tmp_path):
    folder = tmp_path / "clt"
    folder.mkdir()
    (folder / "clt.json").write_text('{"mine": true}')
    _refused(lambda: save_dictionary(_clt(), folder), folder)
    foreign = tmp_path / "sae-with-clt"
    foreign.mkdir()
    (foreign / "clt.json").write_text('{"mine": true}')  # an SAE saved here would load as this file
    _refused(lambda: save_dictionary(_sae(), foreign), foreign)


def test_training_into_a_saelens_download_is_refused_before_training(tmp_path):
    """A cfg.json made the folder count as "a dictionary run"; the run then replaced SAELens' files."""
    folder = tmp_path / "run"
    _saelens_folder(folder)
    data = {"blocks.0.hook_resid_post": torch.randn(64, 8, generator=torch.Generator().manual_seed(0))}
    _refused(lambda: train_sae(TensorActivations(data), kind="relu", d_sae=16, steps=2, out=folder, progress=False,
                               batch_size=16),
             folder, match="not a dictionary run the workbench wrote")


def test_circuit_tracer_export_refuses_files_it_did_not_write(tmp_path):
    folder = tmp_path / "ct"
    folder.mkdir()
    (folder / "config.yaml").write_text("model_kind: transcoder_set\n# circuit-tracer's own\n")
    _refused(lambda: save_circuit_tracer(_transcoders(), folder), folder)
    (folder / "config.yaml").unlink()
    (folder / "layer_1.safetensors").write_bytes(b"a user's file")
    _refused(lambda: save_circuit_tracer(_transcoders(), folder), folder)
    fresh = tmp_path / "mine"
    save_circuit_tracer(_transcoders(), fresh)
    save_circuit_tracer(_transcoders(), fresh)  # its own files (workbench.json lists them): replaced
    assert len(load_circuit_tracer(fresh)) == 2
    save_circuit_tracer(_transcoders(), folder, overwrite=True)
    assert len(load_circuit_tracer(folder)) == 2


def test_direction_save_refuses_a_user_file_of_its_names(tmp_path):
    vector = Direction(torch.randn(32), "blocks.0.hook_resid_post", {"kind": "custom"})
    (tmp_path / "d.json").write_text('{"a user\'s": "file"}')
    _refused(lambda: vector.save(tmp_path / "d"), tmp_path)
    (tmp_path / "d.json").unlink()
    (tmp_path / "d.safetensors").write_bytes(b"a user's file")
    _refused(lambda: vector.save(tmp_path / "d"), tmp_path)
    (tmp_path / "d.safetensors").unlink()
    vector.save(tmp_path / "d")
    vector.save(tmp_path / "d")  # its own: replaced
    assert torch.equal(Direction.load(tmp_path / "d").vector, vector.vector)


def test_circuit_save_refuses_a_file_that_is_not_a_circuit(tmp_path):
    circuit = Circuit(["L0H0 -> L1H0.q"], {"graph": "g", "name": "m"}, "manual")
    path = tmp_path / "notes.json"
    path.write_text('{"my": "notes"}')
    _refused(lambda: circuit.save(path), tmp_path)
    circuit.save(path, overwrite=True)
    circuit.save(path)  # a circuit file now: replaced
    assert Circuit.load(path, check_weights=False).edges == circuit.edges


def test_tokenizer_save_refuses_a_hugging_face_tokenizer_and_never_writes_through_a_link(tmp_path):
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    _refused(lambda: ByteTokenizer().save(folder), folder)
    outside = tmp_path / "outside.json"
    outside.write_text('{"kind": "byte"}')  # looks like ours, but is reached through a link
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ValueError, match="did not write"):
        ByteTokenizer().save(linked)
    assert outside.read_text() == '{"kind": "byte"}'
    (tmp_path / "ours").mkdir()
    ByteTokenizer().save(tmp_path / "ours")  # new: written; again: its own, replaced
    ByteTokenizer().save(tmp_path / "ours")
    assert isinstance(load_tokenizer(tmp_path / "ours"), ByteTokenizer)


def test_config_to_json_refuses_a_file_that_is_not_a_model_config(tmp_path):
    cfg = tiny()
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    _refused(lambda: cfg.to_json(path), tmp_path)
    cfg.to_json(path, overwrite=True)
    cfg.to_json(path)  # a ModelConfig now: replaced
    assert wb.ModelConfig.from_dict(json.loads(path.read_text())) == cfg


def test_a_resumed_store_deletes_only_its_own_temp_files(tmp_path):
    """A resumed collection removed every ``.*.tmp`` in the folder, a user's included."""
    model = wb.HookedDecoder(tiny(d_vocab=40)).eval()
    tokens = torch.randint(0, 40, (16, 8), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "store"
    kw = dict(batch_size=4, tokens_per_shard=32, progress=False)
    ActivationStore.collect(model, tokens, "blocks.0.hook_resid_post", 32, out, **kw)
    (out / ".my-draft.tmp").write_text("a user's draft")
    (out / ".shard_00001.safetensors.tmp").write_bytes(b"half a shard")  # what a killed collection leaves
    store = ActivationStore.collect(model, tokens, "blocks.0.hook_resid_post", 64, out, **kw)
    assert store.manifest["tokens"] == 64
    assert (out / ".my-draft.tmp").read_text() == "a user's draft"
    assert not (out / ".shard_00001.safetensors.tmp").exists()


def _interleaved(monkeypatch, other) -> list:
    """Patch ``os.replace`` so that just before the first rename, ``other()`` (a second writer of the same
    files) runs to its end: the second writer's temporary files are made, written and renamed while
    the first writer's are waiting. Returns the names the first writer renamed from."""
    real, renamed = os.replace, []

    def replace(src, dst):
        if not renamed:
            renamed.append(None)
            monkeypatch.setattr(os, "replace", real)
            other()
            monkeypatch.setattr(os, "replace", replace)
        renamed.append(Path(src).name)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return renamed


def test_two_writers_of_one_file_keep_to_their_own_temporary_files(tmp_path, monkeypatch):
    """write_atomic's temporary name carries the process id and a random part: a second writer of the
    same file (another thread, or a process that got this pid) no longer wrote into the first one's
    temporary file and renamed it away under it (FileNotFoundError, and the first one's bytes lost)."""
    from workbench.overwrite import write_atomic

    target = tmp_path / "f.json"
    target.write_text("old")  # an existing file: the write goes by rename
    renamed = _interleaved(monkeypatch, lambda: write_atomic(target, "second"))
    write_atomic(target, "first")
    assert target.read_text() == "first" and renamed[1].startswith(f".f.json.tmp-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_a_dictionary_saved_twice_at_once_is_one_whole_dictionary(tmp_path, monkeypatch):
    """Two saves of a dictionary into one folder at once (here: the second runs while the first waits
    to rename its weights): save_dictionary wrote every save's files through the same ``.<name>.tmp``
    names, so the second renamed the first's temporary files away and the first failed."""
    folder = tmp_path / "sae"
    first, second = _sae(0), _sae(1)
    save_dictionary(first, folder)
    renamed = _interleaved(monkeypatch, lambda: save_dictionary(second, folder))
    save_dictionary(first, folder)
    monkeypatch.undo()
    loaded = load_dictionary(folder)
    torch.testing.assert_close(loaded.W_enc, first.W_enc)
    assert all(n.startswith(".") and f".tmp-{os.getpid()}-" in n for n in renamed[1:]) and len(renamed) == 4
    assert not [p.name for p in folder.iterdir() if ".tmp" in p.name]
    umask = os.umask(0)
    os.umask(umask)  # safetensors' save_file makes 0o600: the weights get an ordinary file's mode, as before
    assert (folder / "sae_weights.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_training_runs_state_is_written_through_temporary_files_of_its_own(tmp_path, monkeypatch):
    """The resumable state (train_state.*) went through ``.<name>.tmp``, the same name in every process
    saving the run; now through write_atomic's (process id and a random part)."""
    data = {"blocks.0.hook_resid_post": torch.randn(64, 8, generator=torch.Generator().manual_seed(0))}
    real, renamed = os.replace, []
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append(Path(src).name), real(src, dst))[1])
    train_sae(TensorActivations(data), kind="relu", d_sae=16, steps=4, save_every=2, out=tmp_path / "run",
              progress=False, batch_size=16)
    state = [n for n in renamed if n.startswith(".train_state")]
    assert len(state) == 2  # the second save replaced both files of the first
    assert all(f".tmp-{os.getpid()}-" in n for n in state) and len(set(state)) == 2


def test_the_umask_is_read_without_being_set(monkeypatch, tmp_path):
    """The mode of a file written through a function (safetensors' 0600) comes from the umask. Reading it
    by setting it to 0 and back is process-wide: a file another thread created in that instant was
    world-writable. On Linux it is read from /proc/self/status, never set."""
    import sys

    from workbench.overwrite import current_umask, write_atomic

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/status is Linux's; elsewhere the set-and-restore fallback is used")
    before = os.umask(0o027)
    try:
        calls = []
        real = os.umask
        monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
        assert current_umask() == 0o027
        target = write_atomic(tmp_path / "w.bin", lambda tmp: tmp.write_bytes(b"x") and os.chmod(tmp, 0o600))
        assert (target.stat().st_mode & 0o777) == 0o640 and calls == []
    finally:
        os.umask(before)
