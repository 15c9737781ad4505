"""The command line: --help explains every option; a tiny train + eval + resume runs end to end."""

import dataclasses
import json

import pytest

from workbench.__main__ import build_parser, main
from workbench.training import TrainConfig, read_metrics

TINY = ["--set", "d_model=32", "--set", "n_layers=1", "--set", "n_heads=2", "--set", "n_ctx=8"]


def test_help_lists_the_commands_and_every_train_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "eval" in out and "tasks" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--set", "--config", "--out", "--resume", "--task-option"):
        assert option in out
    for f in dataclasses.fields(TrainConfig):
        if f.name != "task_options":
            assert "--" + f.name.replace("_", "-") in out, f.name
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "checkpoint" in capsys.readouterr().out


def test_train_eval_and_resume_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--task", "modular", "--task-option", "p=7", "--model", "gpt2-style-tiny", *TINY,
            "--steps", "4", "--batch-size", "8", "--warmup-steps", "1", "--log-every", "1", "--out", str(out), "--no-progress",
            "--snapshots", "every:2", "--snapshot-fp16"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "test_accuracy" in printed and str(out) in printed
    config = json.loads((out / "config.json").read_text())
    meta = json.loads((out / "meta.json").read_text())
    assert config["d_vocab"] == 9 and config["d_model"] == 32 and config["n_layers"] == 1  # vocab from the task
    assert meta["task"] == "modular" and meta["task_options"]["p"] == 7 and meta["train_config"]["steps"] == 4
    assert read_metrics(out)["step"].tolist() == [1, 2, 3, 4]

    assert main(["eval", str(out), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["step"] == 4 and set(metrics) >= {"train_accuracy", "test_accuracy"}
    assert metrics["test_accuracy"] == pytest.approx(meta["metrics"]["test_accuracy"])

    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert read_metrics(out)["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "meta.json").read_text())["step"] == 6
    import workbench as wb

    assert wb.load_series(out).steps == [2, 4, 6]  # the resumed run kept its snapshots and its schedule


def test_config_file_with_flags_overriding_it(tmp_path, capsys):
    spec = {
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_ctx": 8, "d_vocab": 9, "norm": "rmsnorm", "ffn": "swiglu"},
        "train": {"task": "modular", "task_options": {"p": 7}, "steps": 50, "batch_size": 4, "warmup_steps": 1},
    }
    (tmp_path / "run.json").write_text(json.dumps(spec))
    assert main(["train", "--config", str(tmp_path / "run.json"), "--steps", "2", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["train_config"]["batch_size"] == 4
    assert json.loads((tmp_path / "out" / "config.json").read_text())["ffn"] == "swiglu"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--task", "modular", "--model", "gpt2-style-tiny", "--set", "bogus=1", "--steps", "1"], "bogus"),
        (["train", "--task", "modular", "--model", "no-such-preset", "--steps", "1"], "valid presets"),
        (["train", "--task", "nope", "--model", "gpt2-style-tiny", "--steps", "1"], "valid tasks"),
        (["train", "--task", "modular", "--steps", "1"], "--model PRESET"),
        (["eval", "/nonexistent/checkpoint"], "does not exist"),
        (["train", "--task", "modular", "--model", "gpt2-style-tiny", "--steps", "1", "--snapshots", "often",
          "--out", "/tmp/never-written"], "TrainConfig.snapshots='often'"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_os_errors_are_one_line_and_ctrl_c_is_not_swallowed(tmp_path, capsys, monkeypatch):
    assert main(["train", "--config", str(tmp_path / "missing.json"), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.json" in err and err.count("\n") == 1 and "Traceback" not in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("workbench.__main__.cmd_tasks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["tasks"])


def test_the_interop_commands_plug_in_when_present():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    assert {"train", "eval", "tasks"} <= set(subcommands)
    try:
        import workbench.interop.cli  # noqa: F401
    except ImportError:
        pytest.skip("workbench.interop.cli is not installed in this tree, so there is nothing to plug in")
    assert {"import-hf", "export-hf"} <= set(subcommands)
