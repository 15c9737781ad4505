"""The training loop: it learns, logs, resumes exactly, stops cleanly on NaN and Ctrl-C, and runs DDP."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from factories import Trap, run_torchrun, tiny
from workbench.data import get_task
from workbench.distributed import DistInfo
from workbench.training import METRIC_COLUMNS, TrainConfig, TrainingDiverged, read_metrics, train

ROOT = Path(__file__).resolve().parents[1]


def stories_setup(**train_overrides):
    task = get_task("stories", seed=0)
    cfg = tiny(d_vocab=task.vocab_size, n_ctx=32)
    config = TrainConfig(task="stories", steps=6, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2,
                         eval_every=3, log_every=1, **train_overrides)
    return task, cfg, config


def test_short_run_lowers_the_loss_and_writes_metrics(tmp_path):
    task, cfg, config = stories_setup()
    config = config.replace(steps=30, eval_every=15, log_every=5, lr=1e-2, warmup_steps=5)
    result = train(config, cfg, tmp_path / "run", progress=False)
    history = result.history
    assert list(history.columns) == METRIC_COLUMNS and history["step"].tolist() == list(range(5, 31, 5))
    assert history["train_loss"].iloc[-1] < 0.6 * math.log(task.vocab_size)  # well below uniform guessing
    assert history["train_loss"].iloc[-1] < history["train_loss"].iloc[0]
    csv = read_metrics(tmp_path / "run")
    assert list(csv.columns) == METRIC_COLUMNS and len(csv) == len(history)
    assert csv["val_loss"].notna().tolist() == [s in (15, 30) for s in csv["step"]]  # empty unless evaluated
    assert (csv["tokens_per_s"] > 0).all() and (csv["lr"] > 0).all()
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["task"] == "stories" and meta["train_config"]["steps"] == 30 and meta["step"] == 30
    assert "ioi_accuracy" in meta["metrics"] and meta["metrics"]["val_loss"] == pytest.approx(csv["val_loss"].iloc[-1], rel=1e-4)
    model, tok = wb.load_checkpoint(tmp_path / "run")
    assert tok.to_dict() == task.tokenizer.to_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, result.model.state_dict()[name])
    assert "optimizer.0.exp_avg" in load_file(str(tmp_path / "run" / "train_state.safetensors"))


def test_callback_sees_each_logged_row_and_can_stop_early(tmp_path):
    task, cfg, config = stories_setup()  # 6 steps, evaluated at step 3, a row every step
    rows = []
    full = train(config, cfg, progress=False, callback=lambda row: rows.append(row) or "truthy, not True")
    assert not full.stopped_early and full.step == 6  # only an exact True stops
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(set(r) == {"step", "train_loss", "val_loss", "lr", "tokens_per_s"} for r in rows)
    for key in ("step", "train_loss", "lr", "tokens_per_s"):
        assert [r[key] for r in rows] == full.history[key].tolist()
    assert [r["val_loss"] is None for r in rows] == [True, True, False, True, True, True]

    seen = []
    stopped = train(config, cfg, tmp_path / "run", progress=False,
                    callback=lambda row: seen.append(row["step"]) or row["step"] == 4)
    assert stopped.stopped_early and not stopped.interrupted and stopped.step == seen[-1] == 4
    assert stopped.history["step"].tolist() == [1, 2, 3, 4] and math.isfinite(stopped.metrics["val_loss"])
    saved, _ = wb.load_checkpoint(tmp_path / "run")
    for name, value in stopped.model.state_dict().items():
        assert torch.equal(value, saved.state_dict()[name]), name
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["step"] == 4
    assert read_metrics(tmp_path / "run")["step"].tolist() == [1, 2, 3, 4]


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    config = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert config.lr_at(0) == pytest.approx(0.1) and config.lr_at(9) == pytest.approx(1.0)
    assert config.lr_at(10) == pytest.approx(1.0) and config.lr_at(55) == pytest.approx(0.55)
    assert config.lr_at(100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="valid fields"):
        TrainConfig.from_dict({"learning_rate": 1})


def test_interrupted_then_resumed_run_equals_an_uninterrupted_one(tmp_path):
    task, cfg, config = stories_setup(grad_accum=2)
    straight = train(config, cfg, tmp_path / "straight", progress=False)

    model = wb.HookedDecoder(cfg)
    model.add_hook("hook_embed", Trap(at_call=2 * 3 + 2, action="interrupt"), is_permanent=True)  # in step 4
    interrupted = train(config, model=model, out_dir=tmp_path / "resumed", progress=False)
    assert interrupted.interrupted and interrupted.step == 3
    assert json.loads((tmp_path / "resumed" / "meta.json").read_text())["step"] == 3

    resumed = train(config, out_dir=tmp_path / "resumed", resume=True, progress=False)
    assert resumed.step == config.steps
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name  # bit-exact
    straight_csv, resumed_csv = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert straight_csv["step"].tolist() == resumed_csv["step"].tolist()
    assert straight_csv["train_loss"].tolist() == pytest.approx(resumed_csv["train_loss"].tolist(), rel=1e-5)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    task, cfg, config = stories_setup(save_every=2)
    config = config.replace(eval_every=0)  # so the n-th forward is the n-th training step
    model = wb.HookedDecoder(cfg)
    model.add_hook("blocks.0.hook_resid_pre", Trap(at_call=4, action="nan"), is_permanent=True)  # step 4's forward
    with pytest.raises(TrainingDiverged, match=r"stopped at step 3: the loss is nan.*last good checkpoint .* \(step 2\)"):
        train(config, model=model, out_dir=tmp_path / "run", progress=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the poisoned step was not applied
    saved, _ = wb.load_checkpoint(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["step"] == 2
    assert all(torch.isfinite(p).all() for p in saved.parameters())


def test_vocabulary_and_batch_mismatches_are_clear_errors(tmp_path):
    task, cfg, config = stories_setup()
    with pytest.raises(ValueError, match="d_vocab"):
        train(config, cfg.replace(d_vocab=20), progress=False)
    with pytest.raises(ValueError, match="divisible"):
        train(config.replace(batch_size=7, grad_accum=2), cfg, progress=False)
    with pytest.raises(ValueError, match="n_ctx"):
        train(config.replace(seq_len=64), cfg, progress=False)


def test_torchrun_variables_in_the_environment_do_not_make_train_distributed(tmp_path, monkeypatch):
    # A grid script under torchrun trains a different model on each rank: train() must stay
    # single-process unless it is handed a DistInfo (it used to read RANK itself).
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    task, cfg, config = stories_setup()
    result = train(config.replace(steps=2, eval_every=0), cfg, tmp_path / "run", progress=False)
    assert result.step == 2 and math.isfinite(result.metrics["val_loss"])  # rank 0 of 1: it evaluated and saved
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["step"] == 2
    assert not torch.distributed.is_initialized()
    assert DistInfo.from_env() == DistInfo(rank=1, world_size=2, local_rank=1)  # what an entry point would pass
    with pytest.raises(ValueError, match="rank"):
        DistInfo(rank=2, world_size=2)


def test_process_group_is_left_when_the_block_ends_even_on_error(monkeypatch):
    from workbench import distributed

    calls = []
    state = {"up": False}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: calls.append(("init", backend)) or state.update(up=True))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append(("destroy",)) or state.update(up=False))
    two = DistInfo(rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="boom"):
        with distributed.process_group(two, torch.device("cpu")):
            assert state["up"]
            raise RuntimeError("boom")
    assert calls == [("init", "gloo"), ("destroy",)] and not state["up"]
    state["up"], calls[:] = True, []  # a group the caller made is the caller's to leave
    with distributed.process_group(two, torch.device("cpu")):
        pass
    assert calls == [] and state["up"]
    state["up"] = False
    with distributed.process_group(DistInfo(), torch.device("cpu")):  # a world of one never joins
        pass
    assert calls == []


@pytest.mark.slow  # two torchrun processes; deselect with -m "not slow"
def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    task = get_task("induction", vocab=32)
    steps, args = 4, ["--task", "induction", "--task-option", "vocab=32", "--model", "attn-only-2l",
                      "--set", "d_model=32", "--set", "n_heads=4", "--set", "n_ctx=24", "--steps", "4",
                      "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "1", "--eval-every", "0",
                      "--log-every", "1", "--threads", "1", "--no-progress"]
    run_torchrun(["train", *args, "--out", str(tmp_path / "ddp")])

    config = TrainConfig(task="induction", task_options={"vocab": 32}, steps=steps, batch_size=8, lr=3e-3,
                         warmup_steps=1, eval_every=0, log_every=1, threads=1)
    cfg = wb.ModelConfig.from_preset("attn-only-2l", d_model=32, n_heads=4, n_ctx=24, d_vocab=task.vocab_size, seed=0)
    single = train(config, cfg, progress=False)
    ddp_model, _ = wb.load_checkpoint(tmp_path / "ddp")
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(ddp_model.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    ddp_losses = read_metrics(tmp_path / "ddp")["train_loss"].tolist()
    assert ddp_losses == pytest.approx(single.history["train_loss"].tolist(), rel=1e-4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp"]  # no stray temporary directories
