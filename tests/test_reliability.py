"""The ten defects of the outside audit (issue 22), one test each, named after the defect.

Each test fails on the code before its fix: a race that replaced a saved model, a config.json
whose sizes were allocated before the weights were checked, zip members inflated without a
running count, a dictionary spliced at a hook it was not trained on, unclear library errors,
garbage rows of metrics.csv, names longer than a file system allows, NaN weights the app never
reported, and the temp folders the app left behind.
"""

import io
import json
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.checkpoint import CheckpointError, NonFiniteWeightsWarning

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "checkpoints" / "stories-2026"


def _model(seed: int = 0):
    return wb.HookedDecoder(tiny(seed=seed))


def _race(n: int, save) -> tuple[list, list]:
    """``save(i)`` from ``n`` threads released together: (indices that returned, errors raised)."""
    barrier = threading.Barrier(n)
    won, lost = [], []

    def run(i):
        barrier.wait()
        try:
            save(i)
            won.append(i)
        except Exception as e:  # noqa: BLE001 - the test sorts them below
            lost.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return won, lost


# ---- 1. two saves under one new name ------------------------------------------------------------
def test_1_save_race_one_new_name_exactly_one_save_wins(tmp_path):
    models = [_model(seed) for seed in range(3)]
    for trial in range(4):
        target = tmp_path / f"model-{trial}"
        won, lost = _race(3, lambda i: wb.save_checkpoint(models[i], target, replace=False))
        assert len(won) == 1 and len(lost) == 2, (won, lost)
        assert all(isinstance(e, CheckpointError) and "already exists" in str(e) for e in lost), lost
        loaded, _ = wb.load_checkpoint(target)  # what is on disk is the winner's model, whole
        assert torch.equal(loaded.W_E, models[won[0]].W_E)
    wb.save_checkpoint(models[1], tmp_path / "model-0")  # replace=True (the default) still replaces
    assert torch.equal(wb.load_checkpoint(tmp_path / "model-0")[0].W_E, models[1].W_E)


def test_1_save_race_build_and_train_save_refuses_a_name_that_appeared(tmp_path, monkeypatch):
    import shutil
    import time

    from ui import build_train
    from ui.build_train import save_trained

    copy = shutil.copy2
    # A slow disk: each file takes a while, so every racer reaches its existence test while the first still writes.
    monkeypatch.setattr(build_train.shutil, "copy2", lambda *a, **k: (time.sleep(0.05), copy(*a, **k))[1])

    sources = []
    for seed in range(3):
        wb.save_checkpoint(_model(seed), tmp_path / "runs" / f"run{seed}")
        sources.append(tmp_path / "runs" / f"run{seed}")
    root = tmp_path / "checkpoints"
    for trial in range(4):
        won, lost = _race(3, lambda i: save_trained(sources[i], root, f"mine-{trial}"))
        assert len(won) == 1 and len(lost) == 2, (won, lost)
        assert all(isinstance(e, ValueError) and "already exists" in str(e) for e in lost), lost
        saved = (root / f"mine-{trial}" / "model.safetensors").read_bytes()
        assert saved == (sources[won[0]] / "model.safetensors").read_bytes()


# ---- 2. config.json sizes checked against the weights before anything is allocated -------------------
def _with_config(tmp_path, model=None, **changes) -> Path:
    path = tmp_path / "ckpt"
    wb.save_checkpoint(model or _model(), path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("field, value", [("n_layers", 10**6), ("d_model", 10**8), ("d_vocab", 10**9)])
def test_2_config_sizes_are_checked_against_the_safetensors_header(tmp_path, field, value, monkeypatch):
    from workbench.interop import streaming

    path = _with_config(tmp_path, **{field: value}, **({"n_heads": 4} if field == "d_model" else {}))
    built = []
    monkeypatch.setattr(streaming, "unfilled_model", lambda cfg: built.append(cfg))  # allocating is the defect
    with pytest.raises(CheckpointError, match=rf"says {field}={value}"):
        wb.load_checkpoint(path)
    assert not built


def test_2_a_model_larger_than_free_memory_is_refused_before_allocating(tmp_path, monkeypatch):
    from workbench import utils
    from workbench.interop import streaming

    path = _with_config(tmp_path)
    monkeypatch.setattr(utils, "available_memory_bytes", lambda device=None: 4096)  # a machine with 4 KiB free
    built = []
    with monkeypatch.context() as patch:
        patch.setattr(streaming, "unfilled_model", lambda cfg: built.append(cfg))
        with pytest.raises(CheckpointError, match=r"needs 0\.0 GiB in torch.float16 \(blocks\.\d\.mlp\.W_\w+ "
                                                  r"alone.*from d_model=32, d_mlp=128\), and cpu has 0\.0 GiB free"):
            wb.load_checkpoint(path, dtype=torch.float16)  # a cast: new memory, not the file's mapped pages
    assert not built
    assert wb.load_checkpoint(path)[0].cfg.d_model == 32  # float32 as in the file: mapped, nothing to allocate


# ---- 8. garbage rows in metrics.csv ------------------------------------------------------------------------
def test_8_metrics_csv_garbage_rows_are_skipped_counted_and_resume_survives(tmp_path):
    from workbench.training import MalformedMetricsWarning, TrainConfig, read_history, read_metrics, train

    from workbench.data import get_task

    task = get_task("induction", vocab=32)
    cfg = tiny(d_vocab=task.vocab_size, n_ctx=32)
    config = TrainConfig(steps=4, batch_size=4, seq_len=16, eval_every=0, save_every=2, log_every=1, seed=0)
    out = tmp_path / "run"
    train(config.replace(steps=2), cfg, out, task=task, progress=False)
    csv = out / "metrics.csv"
    text = csv.read_text()
    csv.write_text(text + "garbage,row\n3,not-a-number,,,,\n\x00\x01,2\n")
    with pytest.warns(MalformedMetricsWarning, match="skipped 3 malformed"):
        frame = read_metrics(out)
    assert frame["step"].tolist() == [1, 2] and frame.attrs["skipped_rows"] == 3
    assert frame["train_loss"].dtype.kind == "f"  # numbers, not text to be drawn as categories
    with pytest.warns(MalformedMetricsWarning):
        assert [row["step"] for row in read_history(out, 2)] == [1, 2]
    with pytest.warns(MalformedMetricsWarning):
        result = train(config, cfg, out, task=task, progress=False, resume=True)  # TypeError before the fix
    assert result.step == 4
    assert read_metrics(out)["step"].tolist() == [1, 2, 3, 4]


# ---- 9. the five unclear library errors -------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories():
    return wb.load_checkpoint(STORIES)[0]


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00\x00"])
def test_9_unclear_errors_prompt_csv_empty_or_binary(tmp_path, content):
    from workbench.data.prompts import PromptSet

    (tmp_path / "p.csv").write_bytes(content)
    with pytest.raises(ValueError, match="not a readable CSV of prompts"):
        PromptSet.from_csv(tmp_path / "p.csv")


def test_9_unclear_errors_analyses_of_no_prompts(stories):
    from workbench import analysis as an

    with pytest.raises(ValueError, match="holds no prompts"):
        an.logit_lens(stories, [])
    with pytest.raises(ValueError, match="holds no prompts"):
        an.head_scores(stories, torch.zeros(0, 8, dtype=torch.long))  # 0 rows: it answered 0.0 for every head


def test_9_unclear_errors_steer_scale_and_ablate_spec(stories):
    from workbench import analysis as an

    direction = an.Direction(torch.ones(stories.cfg.d_model), "blocks.0.hook_resid_post")
    for scale in ("4", None, [1.0, "2"], True):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            with stories.steer(direction, scale=scale):
                pass
    tokens = stories.to_tokens("Once upon a time")
    spec = an.AblationSpec("head", 0, head=0)
    with pytest.raises(ValueError, match="spec must be one AblationSpec.*ablation_sweep"):
        an.ablate(stories, tokens, [spec])
    assert an.ablate(stories, tokens, spec).shape[-1] == stories.cfg.d_vocab


# ---- 6. a dictionary's hook, shape and model are checked ----------------------------------------------------
SHIPPED_SAE = STORIES / "saes" / "resid-post-1"


def _tiny_sae(model, hook="blocks.1.hook_resid_post", **fields):
    from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary
    from workbench.analysis.store import model_fingerprint

    cfg = DictionaryConfig(kind="relu", d_in=model.cfg.d_model, d_sae=16, hook_name=hook,
                           model_name=model.cfg.name, model_fingerprint=model_fingerprint(model), **fields)
    return make_dictionary(cfg)


@pytest.mark.parametrize("drop_meta", [False, True])
def test_6_dictionary_cfg_edited_to_another_hook_of_the_same_width_is_refused(tmp_path, drop_meta):
    import shutil

    from workbench.analysis.dictionaries import DictionaryError, load_dictionary, save_dictionary

    if drop_meta:  # a fresh save: the weights file itself records the hook, sae_meta.json aside
        folder = save_dictionary(load_dictionary(SHIPPED_SAE), tmp_path / "sae")
        (folder / "sae_meta.json").unlink()
    else:  # the shipped dictionary, saved before the weights carried it: sae_meta.json records it
        folder = Path(shutil.copytree(SHIPPED_SAE, tmp_path / "sae"))
    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    assert load_dictionary(folder).cfg.hook_name == "blocks.1.hook_resid_post"
    cfg["metadata"]["hook_name"] = "blocks.2.hook_resid_post"  # the same width: the width check cannot see it
    (folder / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(DictionaryError, match=r"says hook_name='blocks.2.hook_resid_post'.*"
                                              r"saved for hook_name='blocks.1.hook_resid_post'"):
        load_dictionary(folder)


def test_6_dictionary_on_other_weights_warns_and_a_wrong_shape_is_refused(stories):
    from workbench.analysis import check_dictionary
    from workbench.analysis.dictionaries import load_dictionary
    from workbench.analysis.splice import DictionaryMismatchWarning

    sae = load_dictionary(SHIPPED_SAE)
    assert check_dictionary(stories, sae) is None  # its own model: nothing to say
    retrained = wb.HookedDecoder(stories.cfg)  # same name, same config, other weights
    assert "fingerprint" in (check_dictionary(retrained, sae) or "")
    with pytest.warns(DictionaryMismatchWarning, match=sae.cfg.model_fingerprint):
        retrained.add_sae(sae)
    retrained.remove_sae()
    flat = _tiny_sae(stories, hook_shape=(4, 32))  # trained on [n_heads, d_head]-shaped activations
    with pytest.raises(ValueError, match=r"shape \[4, 32\].*shape \[128\]"):
        check_dictionary(stories, flat)
    with pytest.raises(ValueError, match=r"shape \[4, 32\]"):
        stories.add_sae(flat)
    assert not stories.hook_dict["blocks.1.hook_resid_post"].__class__.__name__.startswith("SAE")


def test_6_replaced_checkpoint_drops_the_dictionaries_of_the_old_weights(tmp_path):
    from workbench.analysis.dictionaries import save_dictionary

    old, new = _model(0), _model(1)
    ckpt = wb.save_checkpoint(old, tmp_path / "ckpt")
    save_dictionary(_tiny_sae(old), ckpt / "saes" / "mine")
    (ckpt / "notes.txt").write_text("the user's")  # not the workbench's: it stays
    wb.save_checkpoint(old, ckpt)  # the same weights again: still recorded as the checkpoint's
    assert (ckpt / "saes" / "mine" / "cfg.json").is_file()
    wb.save_checkpoint(new, ckpt)  # new weights replace the checkpoint: its dictionaries go
    assert not (ckpt / "saes").exists() and (ckpt / "notes.txt").read_text() == "the user's"


# ---- 3, 4 and 10 (entry count). Archives that lie, are corrupt, or are bombs --------------------------------
def _zip(files: dict, method=zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def _declare(data: bytes, size: int) -> bytes:
    """The zip with every member's declared (uncompressed) size replaced by ``size``: a liar."""
    out = bytearray(data)
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        start = 0
        while (start := out.find(signature, start)) >= 0:
            out[start + offset:start + offset + 4] = size.to_bytes(4, "little")
            start += 4
    return bytes(out)


def _checkpoint_files(tmp_path) -> dict:
    path = wb.save_checkpoint(_model(), tmp_path / "upload-src")
    return {f"ckpt/{p.name}": p.read_bytes() for p in path.iterdir() if p.is_file()}


def test_3_corrupt_or_lying_zip_entries_give_one_message(tmp_path):
    from ui.common import save_upload

    files = _checkpoint_files(tmp_path)
    good = _zip(files)
    assert save_upload([("ok.zip", good)], root=tmp_path / "up")[0].startswith("upload: ok")
    at = good.find(b"model.safetensors") + 200  # inside the deflated weights
    flipped = good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:]
    bomb = _declare(_zip({**files, "ckpt/padding.bin": b"\0" * (8 << 20)}), 1000)  # 8 MiB declared as 1000 B
    for name, data in (("flipped.zip", flipped), ("liar.zip", bomb), ("cut.zip", good[: len(good) // 2])):
        with pytest.raises(ValueError, match=r"corrupt|inflates to more than") as info:
            save_upload([(name, data)], root=tmp_path / "up")
        assert name in str(info.value)


def test_3_inflating_counts_bytes_against_the_limit_not_the_declared_size():
    from workbench.archive import ArchiveError, read_zip

    bomb = _declare(_zip({"a.bin": b"\0" * (4 << 20)}), 100)
    with pytest.raises(ArchiveError):  # stopped at 1 MiB inflated, whatever zipfile itself checks
        read_zip(bomb, max_total=1 << 20)
    honest = _zip({"a.bin": b"\0" * (4 << 20)})
    with pytest.raises(ArchiveError, match="unpacks to more than 1 MiB"):
        read_zip(honest, max_total=1 << 20)
    assert read_zip(honest, max_total=8 << 20)["a.bin"] == b"\0" * (4 << 20)


def test_4_direction_upload_bomb_is_capped_at_what_the_model_can_need(stories):
    from workbench import analysis as an
    from workbench.analysis.directions import direction_bytes_limit

    direction = an.Direction(torch.ones(stories.cfg.d_model), "blocks.0.hook_resid_post")
    data = direction.to_bytes("d")
    assert torch.equal(an.Direction.from_bytes(data, stories).vector, direction.vector)
    limit = direction_bytes_limit(stories.cfg)
    assert limit < 4 << 20  # 64 positions x 512 wide x 8 bytes, plus room for the JSON
    zeros = b"\0" * (limit + 1)
    for bomb in (_zip({"d.json": zeros, "d.safetensors": zeros}), _declare(_zip({"d.json": zeros, "d.safetensors": zeros}), 10)):
        with pytest.raises(ValueError, match=r"the limit is|unpacks to more than|inflates to more than|corrupt"):
            an.Direction.from_bytes(bomb, stories)


def test_10_zip_entry_count_is_capped_and_nothing_is_written(tmp_path):
    from ui.common import save_upload

    files = {**_checkpoint_files(tmp_path), **{f"ckpt/junk{i}.txt": b"x" for i in range(1500)}}
    with pytest.raises(ValueError, match=r"holds 1,50\d files; at most 1,000"):
        save_upload([("many.zip", _zip(files, zipfile.ZIP_STORED))], root=tmp_path / "up")
    assert not list((tmp_path / "up").rglob("*.txt")) if (tmp_path / "up").exists() else True


# ---- 7. names over 255 bytes -------------------------------------------------------------------------
class _Where:
    """Stands in for a Streamlit container: keeps what the page would show."""

    def __init__(self):
        self.shown = []

    def __getattr__(self, kind):
        return lambda text, *a, **k: self.shown.append((kind, text))


def test_7_names_over_255_bytes_are_a_message_not_an_oserror(tmp_path):
    from ui import common
    from ui.build_train import save_trained

    long = "é" * 200  # 400 bytes in UTF-8: 200 characters look harmless
    with pytest.raises(CheckpointError, match="400 bytes.*at most 255"):
        wb.save_checkpoint(_model(), tmp_path / long)
    with pytest.raises(CheckpointError, match="at most 255"):
        wb.load_checkpoint(tmp_path / long / "x")
    source = wb.save_checkpoint(_model(), tmp_path / "run")
    with pytest.raises(ValueError, match="at most 255"):
        save_trained(source, tmp_path / "checkpoints", "m" * 256)
    where = _Where()
    assert common.load(str(tmp_path / long), where=where) is None
    assert where.shown and where.shown[0][0] == "error" and "at most 255" in where.shown[0][1]


# ---- 5. NaN/inf weights are reported on every page -------------------------------------------------------
def test_5_nan_weights_are_reported_once_at_the_top_of_every_page(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    model, tok = wb.load_checkpoint(STORIES)
    with torch.no_grad():
        model.blocks[0].attn.W_Q[0, 0, :3] = float("nan")
    with pytest.warns(NonFiniteWeightsWarning):  # what the library says: the page must say it too
        wb.save_checkpoint(model, tmp_path / "stories-2026", tokenizer=tok)
        wb.load_checkpoint(tmp_path / "stories-2026")
    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(tmp_path))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    for page in ("Inspect", "Steer"):
        at.session_state["page"] = page
        at.run()
        shown = [w.value for w in at.warning if "not finite" in str(w.value)]
        assert len(shown) == 1 and "blocks.0.attn.W_Q (3 NaN" in shown[0], (page, [w.value for w in at.warning])


# ---- 10. what the app wrote is removed -------------------------------------------------------------------
class _Upload:
    def __init__(self, name, data):
        self.name, self._data = name, data

    def getvalue(self):
        return self._data


def test_10_leftovers_rejected_uploads_and_finished_sessions_are_removed(tmp_path, monkeypatch):
    import gc

    from ui import common

    monkeypatch.setattr(common.st, "session_state", {})  # a session's state, outside a script run
    files = _checkpoint_files(tmp_path)
    files["ckpt/model.safetensors"] = b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"  # unzips, then fails to load
    common.st.session_state["upload_0"] = [_Upload("bad.zip", _zip(files))]
    common._on_upload("upload_0")
    assert "not a usable checkpoint" in common.st.session_state["upload_error"]
    assert not any(common.upload_root().iterdir())  # the rejected upload is gone

    folder = common.TempFolder("workbench-uploads-")  # what a session holds in its state
    (folder.path / "model.safetensors").write_bytes(b"x" * 1000)
    path = folder.path
    del folder
    gc.collect()
    assert not path.exists()  # the session ended: its uploads went with it


@pytest.mark.slow  # a second Python process (the "server"), started and stopped
def test_10_leftovers_removed_when_the_server_stops_and_after_a_kill(tmp_path):
    import os
    import subprocess
    import sys
    import tempfile

    code = ("import sys; sys.path.insert(0, sys.argv[1]); from ui import common; from ui.build_train import TrainingJob; "
            "import workbench as wb; job = TrainingJob(None, None, 'induction'); (job.out / 'w').write_text('1'); "
            "up = common.upload_root(); (up / 'u').write_text('1'); print(up, job.out, flush=True)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    folders = [Path(p) for p in out.stdout.split()]
    assert len(folders) == 2 and not any(p.exists() for p in folders), folders  # gone with the process

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now: a server killed with -9 leaves folders named after such a pid
    stale = Path(tempfile.mkdtemp(prefix=f"workbench-train-{dead.pid}-"))
    mine = Path(tempfile.mkdtemp(prefix=f"workbench-train-{os.getpid()}-"))
    from ui import common
    from ui.common import uploads

    uploads._stale_checked = False  # the flag remove_stale_temp_folders reads, in its own module
    common.TempFolder("workbench-uploads-").remove()
    assert not stale.exists() and mine.exists()  # a live process's folder is never touched
    mine.rmdir()
