"""The command line: ``python -m workbench train|eval|tasks ...`` (``./workbench.sh`` calls it).

    python -m workbench train --task induction --model attn-only-2l --steps 1000 --out runs/ind
    python -m workbench train --task text --task-option path=notes.txt --model gpt2-style-tiny \\
        --set n_layers=4 --set d_model=192 --steps 2000 --out runs/notes
    python -m workbench train --config run.json          # {"model": {"preset": ..., ...}, "train": {...}}
    python -m workbench train --out runs/ind --resume --steps 2000   # continue a run
    torchrun --nproc_per_node=2 -m workbench train ...   # data parallel; only rank 0 writes
    python -m workbench eval runs/ind                    # the task's metrics of a checkpoint

Every TrainConfig field is a flag; ``--set key=value`` sets ModelConfig (or TrainConfig)
fields, values parsed as JSON when they parse. Other modules add subcommands through
``register(subparsers)`` (see the interop hook at the end of ``build_parser``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Optional

from workbench.config import ModelConfig
from workbench.training import TrainConfig

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), _parse_value(value)


def _add_train_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per TrainConfig field, help text from the field; default None = "not given"."""
    hints = typing.get_type_hints(TrainConfig)
    group = parser.add_argument_group("training (TrainConfig fields)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "task_options":
            continue
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(hint) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(hint), default=None, help=help_text)
        else:
            kind = next((t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)), str)
            group.add_argument(flag, type=kind, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workbench", description="Build, train and evaluate decoder-only transformers.",
        epilog="Run 'python -m workbench COMMAND --help' for the options of a command.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    tr = subparsers.add_parser("train", help="train a model on a task and write a checkpoint directory",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--model", metavar="PRESET", help=f"model preset, one of {ModelConfig.presets()}")
    tr.add_argument("--set", metavar="KEY=VALUE", type=_key_value, action="append", default=[],
                    help="set a ModelConfig field (e.g. n_layers=4, norm=rmsnorm) or a TrainConfig field; repeatable")
    tr.add_argument("--task-option", metavar="KEY=VALUE", type=_key_value, action="append", default=[],
                    help="a task option (e.g. path=notes.txt tokenizer=bpe for --task text; p=97 for modular); repeatable")
    tr.add_argument("--config", metavar="FILE.json", type=Path,
                    help='a JSON file {"model": {"preset": NAME, ...fields} or {...all fields}, "train": {...}}; flags override it')
    tr.add_argument("--out", metavar="DIR", type=Path, help="checkpoint directory (metrics.csv is written there too)")
    tr.add_argument("--resume", action="store_true", help="continue the run saved in --out (model, optimizer, RNG, data position)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_train_config_flags(tr)
    tr.set_defaults(func=cmd_train)

    ev = subparsers.add_parser("eval", help="evaluate a checkpoint on its task and print the metrics")
    ev.add_argument("checkpoint", type=Path, help="a checkpoint directory")
    ev.add_argument("--task", help="evaluate on this task instead of the one it was trained on")
    ev.add_argument("--task-option", metavar="KEY=VALUE", type=_key_value, action="append", default=[], help="a task option; repeatable")
    ev.add_argument("--json", action="store_true", help="print the metrics as JSON")
    ev.set_defaults(func=cmd_eval)

    ls = subparsers.add_parser("tasks", help="list the tasks and what each measures")
    ls.set_defaults(func=cmd_tasks)

    from workbench.analysis.dictionaries import cli as dictionaries_cli

    dictionaries_cli.register(subparsers)
    try:
        from workbench.interop import cli as interop_cli

        interop_cli.register(subparsers)
    except ImportError:
        pass
    return parser


# ---- train ----------------------------------------------------------------------------
def _configs(args: argparse.Namespace) -> tuple[dict, dict]:
    """The model and train settings from --config, then --model, --set and the flags (which win)."""
    file = json.loads(args.config.read_text()) if args.config else {}
    if args.config and not isinstance(file, dict):
        raise ValueError(f"{args.config} must hold a JSON object with 'model' and 'train' keys")
    model_spec = dict(file.get("model", {}))
    train_spec = dict(file.get("train", {}))
    if args.model:
        model_spec["preset"] = args.model
    for key, value in args.set:
        if key in _MODEL_FIELDS:
            model_spec[key] = value
        elif key in _TRAIN_FIELDS:
            train_spec[key] = value
        else:
            raise ValueError(f"--set {key}: not a ModelConfig or TrainConfig field; valid keys are {sorted(_MODEL_FIELDS | _TRAIN_FIELDS)}")
    for name in _TRAIN_FIELDS:
        if getattr(args, name, None) is not None:
            train_spec[name] = getattr(args, name)
    train_spec["task_options"] = {**train_spec.get("task_options", {}), **dict(args.task_option)}
    return model_spec, train_spec


def cmd_train(args: argparse.Namespace) -> int:
    from workbench.checkpoint import read_meta
    from workbench.distributed import DistInfo
    from workbench.training import TrainingDiverged, build_task, train

    model_spec, train_spec = _configs(args)
    model_cfg, task = None, None
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out DIR, the run to continue")
        saved = read_meta(args.out).get("train_config", {})
        options = {**saved.get("task_options", {}), **train_spec["task_options"]}
        config = TrainConfig.from_dict({**saved, **train_spec, "task_options": options})
    else:
        config = TrainConfig.from_dict(train_spec)
        task = build_task(config)
        preset = model_spec.pop("preset", None)
        if preset is None and not {"d_model", "n_layers", "n_heads", "n_ctx"} <= set(model_spec):
            raise ValueError("say which model: --model PRESET (with --set overrides), or a full model in --config")
        model_spec.setdefault("d_vocab", task.vocab_size)
        model_spec.setdefault("seed", config.seed)
        model_cfg = ModelConfig.from_preset(preset, **model_spec) if preset else ModelConfig.from_dict(model_spec)
    try:
        # torchrun's RANK / WORLD_SIZE are read here, at the entry point, and handed to the library
        result = train(config, model_cfg, args.out, resume=args.resume, task=task, progress=not args.no_progress,
                       dist=DistInfo.from_env())
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.interrupted:
        return 130
    if result.metrics:  # empty on DDP ranks other than 0, which neither evaluate nor write
        _print_metrics(result.metrics, as_json=False)
        if args.out is not None:
            print(f"checkpoint: {args.out}")
    return 0


# ---- eval / tasks -------------------------------------------------------------------------
def cmd_eval(args: argparse.Namespace) -> int:
    import workbench as wb
    from workbench.checkpoint import read_meta
    from workbench.data import checkpoint_task

    model, tokenizer = wb.load_checkpoint(args.checkpoint)
    meta = read_meta(args.checkpoint)
    task = checkpoint_task(meta, tokenizer, args.task, args.task_option, args.checkpoint)
    if model.cfg.d_vocab < task.vocab_size:
        raise ValueError(f"the model's d_vocab={model.cfg.d_vocab} does not cover the {task.name} task's vocabulary ({task.vocab_size})")
    _print_metrics({"step": meta.get("step"), **task.evaluate(model)}, as_json=args.json)
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from workbench.data import describe_tasks

    for name, description in describe_tasks().items():
        print(f"{name:10s} {description}")
    return 0


def _print_metrics(metrics: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(metrics, indent=2))
        return
    import pandas as pd

    table = pd.DataFrame({"metric": list(metrics), "value": list(metrics.values())})
    print(table.to_string(index=False))


def main(argv: Optional[list[str]] = None) -> int:
    """Run one command; the library's errors and the system's become one line on stderr.

    Exit status 2 for bad input (ValueError, which CheckpointError and UnsupportedHFConfig
    are), 1 for a file that cannot be read or written (OSError) or a run that diverged.
    KeyboardInterrupt is not caught (``train`` handles Ctrl-C itself and exits 130).
    """
    from workbench.training import TrainingDiverged

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        return _error(e, 2)
    except (OSError, TrainingDiverged) as e:
        return _error(e, 1)


def _error(e: Exception, status: int) -> int:
    print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line, no traceback
    return status


if __name__ == "__main__":
    sys.exit(main())
