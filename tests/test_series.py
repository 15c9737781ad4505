"""Snapshots during training and analyses over them: the schedule, what the files hold, that
resuming keeps them and saves carry them, lazy loading (counted), and every kind of bad series."""

import functools
import json
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from factories import Trap, tiny
from workbench import snapshots as snap
from workbench import viz
from workbench.analysis import head_scores, over_training
from workbench.snapshots import snapshot_steps
from workbench.training import TrainConfig, TrainingDiverged, train


def setup(**overrides):
    cfg = tiny(d_vocab=64, n_ctx=16, attn_only=True, positional="rope")
    settings = dict(task="induction", task_options={"seq_len": 16}, steps=6, batch_size=4, lr=3e-3, warmup_steps=1,
                    eval_every=3, eval_batches=1, log_every=2, threads=1, device="cpu")
    config = TrainConfig(**{**settings, **overrides})
    return cfg, config


def test_schedules_every_log_and_explicit_steps():
    assert snapshot_steps("every:250", 1000) == [250, 500, 750, 1000]
    log = snapshot_steps("log:24", 4000)
    assert len(log) == 24 and log[0] == 1 and log[-1] == 4000 and all(a < b for a, b in zip(log, log[1:]))
    ratios = np.diff(np.log(log[8:]))  # past the integer crowding at the start, the spacing is geometric
    assert ratios.max() / ratios.min() < 1.2
    assert snapshot_steps("log:5", 5) == [1, 2, 3, 4, 5] and snapshot_steps("log:1", 7) == [7]
    assert snapshot_steps("0, 100,10", 100) == [0, 10, 100] == snapshot_steps([100, 0, 10, 10], 100)
    assert snapshot_steps(None, 10) == [] == snapshot_steps("", 10)
    for bad in ("every:0", "log:0", "log:11", "often", "every:x", "5,20", [1.5], 7):
        with pytest.raises(ValueError, match=r"TrainConfig.snapshots=.*every:N.*log:K"):
            snapshot_steps(bad, 10)


def test_snapshots_hold_the_weights_of_their_step_and_the_metrics_of_that_step(tmp_path):
    cfg, config = setup(snapshots=[0, 2, 3, 5, 6])
    result = train(config, cfg, tmp_path / "run", progress=False)
    series = wb.load_series(tmp_path / "run")
    assert series.steps == [0, 2, 3, 5, 6] and series.config == cfg
    initial = wb.HookedDecoder(cfg).state_dict()
    for name, value in load_file(str(series[0].path)).items():
        assert torch.equal(value, initial[name]), name
    final = load_file(str(series[-1].path))
    for name, value in result.model.state_dict().items():
        assert torch.equal(final[name], value), name
    # the same run stopped by its callback after step 3 holds the weights of the snapshot at step 3
    three = train(config.replace(snapshots=None, log_every=1), cfg, progress=False, callback=lambda row: row["step"] == 3)
    for name, value in three.model.state_dict().items():
        assert torch.equal(series.load(2).state_dict()[name], value), name
    metrics = series.metrics.set_index("step")
    history = result.history.set_index("step")
    assert metrics.loc[2, "train_loss"] == pytest.approx(history.loc[2, "train_loss"])  # a logged step
    assert np.isfinite(metrics.loc[5, "train_loss"]) and np.isnan(metrics.loc[5, "val_loss"])  # not logged
    assert metrics.loc[3, "val_loss"] == pytest.approx(history.loc[3, "val_loss"])  # evaluated at 3
    assert metrics.loc[6, "val_loss"] == pytest.approx(result.metrics["val_loss"])  # the final evaluation
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert {f"snapshots/{snap.snapshot_file(s)}" for s in series.steps} | {"snapshots/snapshots.json"} <= set(meta["files"])
    assert series.history["step"].tolist() == result.history["step"].tolist()


def test_fp16_snapshots_are_half_the_size_and_load_as_float32(tmp_path):
    cfg, config = setup(snapshots="every:3")
    train(config, cfg, tmp_path / "fp32", progress=False)
    train(config.replace(snapshot_fp16=True), cfg, tmp_path / "fp16", progress=False)
    full, half = wb.load_series(tmp_path / "fp32"), wb.load_series(tmp_path / "fp16")
    assert full.steps == half.steps == [3, 6]
    assert all(t.dtype == torch.float16 for t in load_file(str(half[1].path)).values())
    assert half[1].path.stat().st_size < 0.55 * full[1].path.stat().st_size
    a, b = full.load(1), half.load(1)
    for name, value in a.state_dict().items():
        assert b.state_dict()[name].dtype == torch.float32
        torch.testing.assert_close(b.state_dict()[name], value.half().float(), rtol=0, atol=0)


def test_resume_keeps_the_snapshots_and_continues_them_bit_exactly(tmp_path):
    cfg, config = setup(snapshots="every:2", eval_every=0, save_every=2)
    train(config, cfg, tmp_path / "straight", progress=False)
    model = wb.HookedDecoder(cfg)
    model.add_hook("hook_embed", Trap(at_call=4, action="interrupt"), is_permanent=True)  # in step 4
    interrupted = train(config, model=model, out_dir=tmp_path / "resumed", progress=False)
    assert interrupted.interrupted and interrupted.step == 3
    assert wb.load_series(tmp_path / "resumed").steps == [2]
    (tmp_path / "resumed" / "snapshots" / "snapshots.json").write_text("{broken")  # the files still name their steps
    train(config, out_dir=tmp_path / "resumed", resume=True, progress=False)
    straight, resumed = wb.load_series(tmp_path / "straight"), wb.load_series(tmp_path / "resumed")
    assert resumed.steps == straight.steps == [2, 4, 6]
    for a, b in zip(straight, resumed):
        assert snap.read_header(a.path) == snap.read_header(b.path)
        ours, theirs = load_file(str(a.path)), load_file(str(b.path))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), a.step
    # a resumed run without a schedule keeps them too
    train(config.replace(snapshots=None, steps=8), out_dir=tmp_path / "resumed", resume=True, progress=False)
    assert wb.load_series(tmp_path / "resumed").steps == [2, 4, 6]


def test_a_fresh_run_in_the_folder_starts_a_new_series_and_a_diverged_run_keeps_its_snapshots(tmp_path):
    cfg, config = setup(snapshots="every:2", eval_every=0)
    train(config, cfg, tmp_path / "run", progress=False)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    train(config.replace(snapshots="every:3"), cfg, tmp_path / "run", progress=False)
    assert wb.load_series(tmp_path / "run").steps == [3, 6]
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir()) == [
        "snapshots.json", "step-000003.safetensors", "step-000006.safetensors"]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"

    model = wb.HookedDecoder(cfg)
    model.add_hook("blocks.0.hook_resid_pre", Trap(at_call=5, action="nan"), is_permanent=True)  # step 5
    with pytest.raises(TrainingDiverged, match=r"last good checkpoint .* \(step 4\)"):
        train(config.replace(save_every=4, snapshots="every:1"), model=model, out_dir=tmp_path / "nan", progress=False)
    assert wb.load_series(tmp_path / "nan").steps == [1, 2, 3, 4]
    assert json.loads((tmp_path / "nan" / "meta.json").read_text())["step"] == 4


def test_snapshots_need_an_out_dir_and_a_valid_schedule(tmp_path):
    cfg, config = setup()
    with pytest.raises(ValueError, match="needs an out_dir"):
        train(config.replace(snapshots="every:2"), cfg, progress=False)
    with pytest.raises(ValueError, match="TrainConfig.snapshots='sometimes'"):
        train(config.replace(snapshots="sometimes"), cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    cfg, config = setup(snapshots="every:2", eval_every=0)
    path = tmp_path_factory.mktemp("series") / "run"
    train(config, cfg, path, progress=False)
    return path


def test_over_training_loads_each_snapshot_once_for_several_analyses(run_dir, monkeypatch):
    loads = []
    original = snap.load_snapshot
    monkeypatch.setattr(snap, "load_snapshot", lambda *a, **k: loads.append(a[0]) or original(*a, **k))
    series = wb.load_series(run_dir)
    assert loads == []  # loading a series reads headers only
    heads = functools.partial(head_scores, kinds=("previous_token", "induction"), seq_len=6, batch=2)
    both = over_training(series, {"heads": heads, "norm": lambda m: {"norm": float(m.W_E.norm())}}, progress=False)
    assert len(loads) == len(series) == 3 and len(set(loads)) == 3
    again = over_training(series, head_scores, kinds=("previous_token", "induction"), seq_len=6, batch=2, progress=False)
    assert len(loads) == 3  # the same analysis with the same arguments: every result was kept
    pd.testing.assert_frame_equal(again, both["heads"])
    assert list(again.columns) == ["step", "layer", "head", "kind", "score"]
    assert sorted(set(again["step"])) == [2, 4, 6] and len(again) == 3 * 2 * 4 * 2
    direct = head_scores(series.load(1), kinds=("previous_token", "induction"), seq_len=6, batch=2)
    pd.testing.assert_frame_equal(again[again.step == 4].drop(columns="step").reset_index(drop=True), direct)
    over_training(series, head_scores, kinds=("induction",), seq_len=6, batch=2, progress=False)
    assert len(loads) == 4 + 3  # other arguments are another analysis (and the direct load above)
    assert both["norm"]["step"].tolist() == [2, 4, 6] and again.attrs["history"]["step"] == [2, 4, 6]
    figure = viz.over_training_figure(again)
    assert [t.name for t in figure.data][:2] == ["previous_token (best head)", "induction (best head)"]
    assert "train_loss" in [t.name for t in figure.data] and list(figure.data[0].x) == [2, 4, 6]
    heatmap = viz.layer_head_over_training(again)
    assert len(heatmap.data) == 3 * 2 and len(heatmap.layout.sliders[0].steps) == 3
    assert [t.visible for t in heatmap.data] == [True, True] + [False] * 4
    with pytest.raises(ValueError, match="functools.partial"):
        over_training(series, {"heads": head_scores}, kinds=("induction",))
    with pytest.raises(ValueError, match="returned a str"):
        over_training(series, lambda m: "text", progress=False)


def test_missing_and_corrupt_snapshots_are_skipped_by_name(run_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "snapshots" / "step-000002.safetensors").unlink()
    (copy / "snapshots" / "step-000004.safetensors").write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match=r"skipped 2 snapshot\(s\).*step-000002.*missing.*step-000004.*corrupt"):
        series = wb.load_series(copy)
    assert series.steps == [6]
    good = copy / "snapshots" / "step-000006.safetensors"
    good.write_bytes(good.read_bytes()[:-100])  # truncated after load_series read its header
    with pytest.warns(UserWarning, match=r"skipped 1 snapshot.*step-000006"):
        frame = over_training(series, lambda m: 1.0, progress=False)
    assert frame.empty


def test_runs_without_snapshots_and_mixed_models_are_refused(run_dir, tmp_path):
    cfg, config = setup()
    train(config, cfg, tmp_path / "plain", progress=False)
    with pytest.raises(ValueError, match=r"has no snapshots.*snapshots='log:24'"):
        wb.load_series(tmp_path / "plain")
    with pytest.raises(ValueError, match="is not a folder"):
        wb.load_series(tmp_path / "nowhere")
    train(config.replace(snapshots="every:6"), cfg.replace(d_model=48), tmp_path / "wide", progress=False)
    files = [run_dir / "snapshots" / "step-000002.safetensors", tmp_path / "wide" / "snapshots" / "step-000006.safetensors"]
    with pytest.raises(ValueError, match=r"2 different models .*d_model"):
        wb.load_series(files)
    series = wb.load_series(files[:1])  # a list of files of one model is a series
    assert series.steps == [2] and series.history.empty
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wb.load_series(run_dir / "snapshots").steps == [2, 4, 6]  # the snapshots folder itself


def test_over_training_tables_survive_pandas_and_the_head_figures(run_dir):
    """An over_training table's rows at one step go through pandas (astype, concat) and the
    layer x head figures: the loss curve it carries in attrs once made every such call raise
    ("truth value of a DataFrame is ambiguous") as pandas compared the attrs."""
    table = over_training(wb.load_series(run_dir), head_scores, kinds=("previous_token", "induction"), seq_len=6,
                          batch=2, progress=False)
    at_step = table[table["step"] == 4].drop(columns="step")
    assert at_step.astype({"layer": int, "head": int}).shape == at_step.shape
    figure = viz.head_scores_figure(at_step)
    assert len(figure.data) >= 2
    pd.testing.assert_frame_equal(viz._history_of(table, None), wb.load_series(run_dir).history)


def test_over_training_reports_progress_to_a_callback(run_dir):
    calls = []
    over_training(wb.load_series(run_dir), lambda m: {"norm": float(m.W_E.norm())},
                  progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_nearest_snapshot_aligns_two_runs(run_dir):
    series = wb.load_series(run_dir)
    assert series.steps == [2, 4, 6]
    assert [series.nearest(s).step for s in (0, 3, 4, 5, 100)] == [2, 2, 4, 4, 6]  # a tie goes to the earlier
    with pytest.raises(ValueError, match="no snapshots"):
        series[0:0].nearest(3)
