"""Saving never deletes what the workbench did not write; killed and concurrent writers are handled.

Every writer of a directory (save_checkpoint, train's out_dir, to_hf, TunedLens.save, the
experiments' run folders) is pointed at a folder of someone else's files and must refuse,
leaving every file as it was; a folder it wrote may be replaced, keeping files a user added.
Writers killed at each point of a save (SIGKILL in a subprocess) leave leftovers that the next
save cleans up, and two processes saving to one path both finish with a loadable checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from factories import python_env, tiny

import workbench as wb
from workbench import checkpoint
from workbench.checkpoint import NonFiniteWeightsWarning

REPO = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def thesis(tmp_path):
    """A project folder that happens to hold a config.json."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "thesis.tex").write_text("\\section{Results}")
    (folder / "data" / "runs.csv").write_text("a,b\n1,2\n")
    (folder / "config.json").write_text(json.dumps({"d_model": 32, "n_layers": 2}))
    return folder


# ---- foreign folders are refused, untouched -------------------------------------------------------
def test_save_checkpoint_refuses_a_project_folder_with_a_config_json(thesis):
    before = snapshot(thesis)
    with pytest.raises(wb.CheckpointError) as err:
        wb.save_checkpoint(wb.HookedDecoder(tiny()), thesis)
    message = str(err.value)
    assert str(thesis) in message and "thesis.tex" in message and "data/" in message and "new or empty" in message
    assert snapshot(thesis) == before
    assert leftovers(thesis.parent) == []


def _hf_dir(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf-gpt2"
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=24,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    (directory / "README.md").write_text("# my model card\n")
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    return directory


def test_an_hf_model_saved_onto_its_own_folder_keeps_readme_and_generation_config(tmp_path):
    directory = _hf_dir(tmp_path)
    model = wb.from_hf(directory)
    before = snapshot(directory)
    with pytest.raises(wb.CheckpointError) as err:
        wb.save_checkpoint(model, directory)
    assert "README.md" in str(err.value) and "generation_config.json" in str(err.value)
    assert snapshot(directory) == before
    wb.from_hf(directory)  # still the HF model it was


def test_to_hf_refuses_a_foreign_folder_and_a_downloaded_model(tmp_path, thesis):
    model = wb.HookedDecoder(tiny())
    before = snapshot(thesis)
    with pytest.raises(wb.CheckpointError, match="thesis.tex"):
        wb.to_hf(model, thesis)
    assert snapshot(thesis) == before
    directory = _hf_dir(tmp_path)
    before = snapshot(directory)
    with pytest.raises(wb.CheckpointError, match="README.md"):
        wb.to_hf(model, directory)
    assert snapshot(directory) == before


def test_to_hf_replaces_its_own_export_and_keeps_a_users_readme(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "export"
    wb.to_hf(wb.HookedDecoder(tiny(positional="rope", norm="rmsnorm", ffn="swiglu")), out)
    manifest = json.loads((out / "workbench.json").read_text())
    assert manifest["format"] == "workbench.hf_export" and "model.safetensors" in manifest["files"]
    (out / "README.md").write_text("# card\n")
    model = wb.HookedDecoder(tiny(positional="rope", norm="rmsnorm", ffn="swiglu", seed=1))
    wb.to_hf(model, out)
    assert (out / "README.md").read_text() == "# card\n"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # the marker does not bother transformers
    tokens = torch.randint(0, 50, (1, 8))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, model.eval()(tokens), atol=1e-4)


def test_train_refuses_a_foreign_out_dir_before_training(thesis, capsys):
    from workbench.__main__ import main
    from workbench.training import TrainConfig, train

    before = snapshot(thesis)
    steps = []
    with pytest.raises(wb.CheckpointError, match="thesis.tex"):
        train(TrainConfig(task="modular", steps=3, batch_size=4, device="cpu"), tiny(d_vocab=128), out_dir=thesis,
              progress=False, callback=steps.append)
    assert steps == []  # refused before the first step
    assert main(["train", "--task", "modular", "--model", "gpt2-style-tiny", "--steps", "1", "--out", str(thesis),
                 "--no-progress"]) == 2
    assert "thesis.tex" in capsys.readouterr().err
    assert snapshot(thesis) == before


def test_symlinked_and_file_targets_are_refused(tmp_path, thesis):
    link = tmp_path / "link"
    link.symlink_to(thesis)
    with pytest.raises(wb.CheckpointError, match="symbolic link"):
        wb.save_checkpoint(wb.HookedDecoder(tiny()), link)
    assert link.is_symlink() and (thesis / "thesis.tex").exists()


# ---- a folder we wrote: our files replaced, the user's kept ---------------------------------------
def test_resaving_replaces_only_the_files_the_checkpoint_wrote(tmp_path):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c", extra_files={"old.csv": "x"})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == "workbench.checkpoint" and meta["files"] == ["config.json", "model.safetensors", "old.csv"]
    (path / "notes.txt").write_text("mine")
    (path / "plots").mkdir()
    (path / "plots" / "loss.png").write_bytes(b"png")
    (path / "empty").mkdir()
    os.symlink("notes.txt", path / "link")
    model = wb.HookedDecoder(tiny(seed=1))
    wb.save_checkpoint(model, path)
    assert not (path / "old.csv").exists()  # ours, not written this time: gone
    assert (path / "notes.txt").read_text() == "mine" and (path / "plots" / "loss.png").read_bytes() == b"png"
    assert (path / "empty").is_dir() and os.readlink(path / "link") == "notes.txt"
    assert "notes.txt" not in json.loads((path / "meta.json").read_text())["files"]  # still the user's
    loaded, _ = wb.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert leftovers(tmp_path) == []


def test_a_save_that_would_overwrite_a_users_file_is_refused(tmp_path):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c")
    (path / "notes.txt").write_text("mine")
    before = snapshot(path)
    with pytest.raises(wb.CheckpointError, match="notes.txt"):
        wb.save_checkpoint(wb.HookedDecoder(tiny()), path, extra_files={"notes.txt": "theirs"})
    assert snapshot(path) == before and leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="meta.json"):
        wb.save_checkpoint(wb.HookedDecoder(tiny()), path, extra_files={"meta.json": "{}"})
    wb.save_checkpoint(wb.HookedDecoder(tiny()), path, extra_files={"sub/ours.txt": "x"})
    (path / "sub" / "theirs.txt").write_text("mine")
    with pytest.raises(wb.CheckpointError, match="sub/theirs.txt"):  # a file where their folder is
        wb.save_checkpoint(wb.HookedDecoder(tiny()), path, extra_files={"sub": "a file now"})
    assert (path / "sub" / "theirs.txt").read_text() == "mine" and leftovers(tmp_path) == []


def test_a_checkpoint_from_before_the_marker_is_still_ours(tmp_path):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c", extra_files={"metrics.csv": "step\n"})
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("format", "files")}))
    (path / "notes.txt").write_text("mine")
    wb.save_checkpoint(wb.HookedDecoder(tiny()), path)
    assert (path / "notes.txt").read_text() == "mine" and not (path / "metrics.csv").exists()


def test_a_tuned_lens_is_part_of_the_checkpoint_it_was_saved_into(tmp_path):
    from workbench.analysis import TunedLens

    model = wb.HookedDecoder(tiny())
    path = wb.save_checkpoint(model, tmp_path / "c")
    TunedLens(2, 32).save(path)
    assert {"tuned_lens.json", "tuned_lens.safetensors"} <= set(json.loads((path / "meta.json").read_text())["files"])
    TunedLens.load(path, model)
    TunedLens(2, 32).save(path)  # replacing our own lens is fine
    wb.save_checkpoint(model, path)  # new weights: the lens trained for the old ones goes with them
    assert not (path / "tuned_lens.safetensors").exists()
    (path / "tuned_lens.json").write_text('{"mine": true}')
    with pytest.raises(wb.CheckpointError, match="tuned_lens.json"):
        TunedLens(2, 32).save(path)
    assert (path / "tuned_lens.json").read_text() == '{"mine": true}'
    assert leftovers(path) == [] and leftovers(tmp_path) == []


def test_experiment_runs_refuse_a_foreign_out_folder(thesis):
    sys.path.insert(0, str(REPO / "experiments"))
    import _common
    import param_table

    before = snapshot(thesis)
    with pytest.raises(SystemExit, match="thesis.tex"):
        param_table.main(["--quick", "--out", str(thesis)])
    assert snapshot(thesis) == before
    import pandas as pd

    only_config = thesis.parent / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="config.json"):  # even called without setup's check
        _common.write_run(only_config, {"experiment": "x"}, pd.DataFrame({"a": [1]}), {})
    assert (only_config / "config.json").read_text() == "{}" and not (only_config / "results.csv").exists()


def test_the_apps_replace_refuses_a_foreign_folder(tmp_path, thesis):
    pytest.importorskip("streamlit")
    sys.path.insert(0, str(REPO))
    from ui import build_train

    source = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "trained")
    before = snapshot(thesis)
    with pytest.raises(ValueError, match="thesis.tex"):
        build_train.save_trained(source, thesis.parent, thesis.name, replace=True)
    assert snapshot(thesis) == before


# ---- killed and concurrent writers ---------------------------------------------------------------
def run_python(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = python_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


KILLED_WRITER = """
    import os, signal, sys
    import workbench as wb
    from workbench import checkpoint
    from factories import tiny
    where, path = sys.argv[1], sys.argv[2]

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "writing":      # during write(tmp): a .tmp-<pid>-* folder is left
        class Tok:
            def save(self, directory):
                die()
        wb.save_checkpoint(wb.HookedDecoder(tiny(seed=1)), path, tokenizer=Tok())
    real_replace = os.replace
    calls = []
    def replace(a, b):
        calls.append(a)
        if where == "between" and len(calls) == 2:   # old moved aside, new not in place yet
            die()
        real_replace(a, b)
    checkpoint.os.replace = replace
    if where == "after":        # swapped, backup not yet removed: an .old-<pid>-* folder is left
        checkpoint.shutil.rmtree = die
    wb.save_checkpoint(wb.HookedDecoder(tiny(seed=1)), path)
"""


@pytest.mark.parametrize("where", ["writing", "between", "after"])
def test_a_killed_writers_leftovers_are_cleaned_by_the_next_save(tmp_path, where):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c")
    (path / "notes.txt").write_text("mine")
    sys_path = f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
    proc = run_python(sys_path + textwrap.dedent(KILLED_WRITER), where, str(path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    kind = {"writing": ".c.tmp-", "between": ".c.old-", "after": ".c.old-"}[where]
    assert any(name.startswith(kind) for name in leftovers(tmp_path)), leftovers(tmp_path)
    assert path.exists() == (where != "between")
    model = wb.HookedDecoder(tiny(seed=2))
    wb.save_checkpoint(model, path)
    assert leftovers(tmp_path) == []
    assert (path / "notes.txt").read_text() == "mine"  # the user's file survived even the worst moment
    loaded, _ = wb.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_a_live_writers_temp_folder_is_left_alone(tmp_path):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".c.tmp-{sleeper.pid}-abc123"
        live.mkdir()
        wb.save_checkpoint(wb.HookedDecoder(tiny()), path)
        assert live.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    wb.save_checkpoint(wb.HookedDecoder(tiny()), path)
    assert not live.exists()


CONCURRENT_WRITER = """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    import workbench as wb
    from workbench import checkpoint
    from factories import tiny
    path, seed = Path(sys.argv[1]), int(sys.argv[2])
    real_replace = checkpoint.os.replace

    def slow_replace(a, b):  # a slow disk: renames take a while, so the two writers' renames overlap
        time.sleep(0.05)
        real_replace(a, b)

    checkpoint.os.replace = slow_replace
    model = wb.HookedDecoder(tiny(seed=seed))
    go = path.parent / "go"
    while not go.exists():
        time.sleep(0.01)
    for step in range(8):
        wb.save_checkpoint(model, path, step=step, meta={"writer": seed}, extra_files={f"from-{seed}.txt": str(step)})
"""


def test_two_processes_saving_to_one_path_both_succeed(tmp_path):
    path = tmp_path / "shared"
    env = python_env(OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(CONCURRENT_WRITER), str(path), str(seed),
                               str(REPO / "tests")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    import time

    time.sleep(0.5)
    (tmp_path / "go").touch()
    results = [p.communicate(timeout=240) for p in procs]
    for proc, (_, stderr) in zip(procs, results):
        assert proc.returncode == 0, stderr[-3000:]
    loaded, _ = wb.load_checkpoint(path)
    writer = json.loads((path / "meta.json").read_text())["writer"]
    assert loaded.cfg.seed == writer and {p.name for p in path.iterdir()} >= {f"from-{writer}.txt"}
    assert not (path / f"from-{3 - writer}.txt").exists()  # the other writer's file was ours to replace
    assert leftovers(tmp_path) == []


def test_a_held_lock_gives_one_clear_error(tmp_path, monkeypatch):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c")
    monkeypatch.setattr(checkpoint, "LOCK_TIMEOUT_S", 0.3)
    with checkpoint.locked(path):
        with pytest.raises(wb.CheckpointError, match=rf"another process \(pid {os.getpid()}\) is writing"):
            wb.save_checkpoint(wb.HookedDecoder(tiny()), path)
    wb.save_checkpoint(wb.HookedDecoder(tiny()), path)  # released
    assert leftovers(tmp_path) == []


# ---- non-finite weights ---------------------------------------------------------------------------
def test_loading_non_finite_weights_warns_naming_the_tensors(tmp_path):
    model = wb.HookedDecoder(tiny())
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWeightsWarning)
        wb.load_checkpoint(wb.save_checkpoint(model, tmp_path / "fine"))  # finite: silent
    with torch.no_grad():
        model.blocks[1].attn.W_Q[0, 0, 0] = float("nan")
        model.blocks[0].mlp.W_out[0, :3] = float("inf")
    path = wb.save_checkpoint(model, tmp_path / "diverged")
    with pytest.warns(NonFiniteWeightsWarning) as record:
        loaded, _ = wb.load_checkpoint(path)
    message = str(record[0].message)
    assert "blocks.1.attn.W_Q (1 NaN, 0 inf" in message and "blocks.0.mlp.W_out (0 NaN, 3 inf" in message
    assert "blocks.0.attn.W_Q" not in message and issubclass(NonFiniteWeightsWarning, UserWarning)
    assert torch.isnan(loaded.blocks[1].attn.W_Q).any()  # loaded as saved: a warning, not a refusal


def test_the_finiteness_shortcut_neither_misses_nor_invents(tmp_path):
    """The loader tests a tensor's sum first: +inf and -inf cancelling to NaN must still be named, and
    huge finite weights whose sum overflows must not be."""
    model = wb.HookedDecoder(tiny())
    with torch.no_grad():
        model.blocks[0].mlp.W_in.fill_(3e38)  # finite; their sum is inf
        model.blocks[1].mlp.W_in[0, :2] = torch.tensor([float("inf"), float("-inf")])
    with pytest.warns(NonFiniteWeightsWarning) as record:
        wb.load_checkpoint(wb.save_checkpoint(model, tmp_path / "c"))
    message = str(record[0].message)
    assert "blocks.1.mlp.W_in (0 NaN, 2 inf" in message and "blocks.0.mlp.W_in" not in message
