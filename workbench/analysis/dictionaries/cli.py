"""``python -m workbench train-sae``: collect a checkpoint's activations and train a dictionary on them.

    python -m workbench train-sae checkpoints/stories-2026 --hook blocks.1.hook_resid_post --d-sae 2048
    python -m workbench train-sae checkpoints/stories-2026 --kind transcoder \\
        --hook blocks.1.ln2.hook_normalized --hook-out blocks.1.hook_mlp_out --d-sae 1024
    python -m workbench train-sae ... --out saes/s26-l1 --resume --steps 4000      # continue a run
    python -m workbench train-sae ... --live                                         # no store on disk
    torchrun --nproc_per_node=2 -m workbench train-sae ...                            # data parallel
    python -m workbench train-sae checkpoints/stories-2026 --kind clt --d-sae 256      # a cross-layer transcoder

The activations come from the checkpoint's own task (``meta.json``; ``--task`` picks another) and
are collected into ``--store`` (default ``acts/NAME-HOOK``; an interrupted collection resumes),
unless ``--live`` generates them during training. Every SAETrainConfig field is a flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path


def register(subparsers) -> None:
    from workbench.analysis.dictionaries.trainer import SAETrainConfig

    p = subparsers.add_parser("train-sae", help="train a sparse dictionary (SAE, transcoder) on a checkpoint's activations",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a checkpoint directory")
    p.add_argument("--out", type=Path, help="the run folder (default: saes/NAME-HOOK-KIND-D_SAE)")
    p.add_argument("--store", type=Path, help="the activation store to collect into or reuse (default: acts/NAME-HOOK)")
    p.add_argument("--tokens", type=int, default=1_000_000, help="activation rows to collect (default: 1,000,000)")
    p.add_argument("--live", action="store_true", help="generate activations while training instead of storing them")
    p.add_argument("--task", help="collect over this task instead of the checkpoint's own")
    p.add_argument("--task-option", metavar="KEY=VALUE", action="append", default=[], help="a task option; repeatable")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's n_ctx)")
    p.add_argument("--collect-batch-size", type=int, default=32, help="sequences per forward while collecting")
    p.add_argument("--exclude-token", metavar="TOKEN", action="append", default=[],
                   help="leave out positions holding this token (a string or an id); repeatable")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    group = p.add_argument_group("training (SAETrainConfig fields)")
    hints = typing.get_type_hints(SAETrainConfig)
    for f in dataclasses.fields(SAETrainConfig):
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})".replace("%", "%%")
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, type=hint, default=None, help=help_text)
    p.set_defaults(func=cmd_train_sae)


def cmd_train_sae(args: argparse.Namespace) -> int:
    import workbench as wb
    from workbench import distributed
    from workbench.analysis.dictionaries.trainer import SAETrainConfig, train_sae
    from workbench.analysis.store import ActivationStore, LiveActivations
    from workbench.checkpoint import read_meta
    from workbench.data import checkpoint_task
    from workbench.training import TrainingDiverged

    model, tokenizer = wb.load_checkpoint(args.checkpoint)
    task = checkpoint_task(read_meta(args.checkpoint), tokenizer, args.task, _key_values(args.task_option),
                           args.checkpoint)
    fields = {f.name for f in dataclasses.fields(SAETrainConfig)}
    config = SAETrainConfig().replace(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    hooks = [config.hook] if config.hook else []
    if config.hook_out:
        hooks.append(config.hook_out)
    if config.kind == "clt":  # every layer's MLP input and output
        from workbench.analysis.dictionaries.trainer import clt_hooks

        if hooks:
            raise ValueError("--kind clt reads every layer's MLP input and output: leave --hook and --hook-out out")
        hooks = clt_hooks(model.cfg.n_layers)
    if not hooks:
        raise ValueError("say which hook: --hook blocks.L.hook_resid_post (and --hook-out for a transcoder)")
    excluded = [_token_id(model, t) for t in args.exclude_token]
    ckpt = args.checkpoint.resolve().name
    slug = "mlps" if config.kind == "clt" else "-".join(h.replace(".", "_") for h in hooks)
    out = args.out or Path("saes") / f"{ckpt}-{slug}-{config.kind}-{config.d_sae}"
    progress = not args.no_progress
    common = dict(batch_size=args.collect_batch_size, seq_len=args.seq_len, exclude_token_ids=excluded)
    info = distributed.DistInfo.from_env()  # the entry point reads torchrun's variables, once
    with distributed.process_group(info, distributed.device_for(info, config.device)):
        if args.live:
            source = LiveActivations(model, task, hooks, **common)
        else:
            store = args.store or Path("acts") / f"{ckpt}-{slug}"
            if info.is_main:  # under torchrun one process collects, the others wait and read
                source = ActivationStore.collect(model, task, hooks, args.tokens, store, progress=progress, **common)
                print(f"store: {store} ({source.n_rows:,} rows, {source.n_shards} shards)")
            distributed.barrier(info)
            source = ActivationStore(store)
        try:
            sae = train_sae(source, config=config, out=out, model=model, resume=args.resume, progress=progress,
                            dist=info)
        except TrainingDiverged as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if info.is_main:
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in sae.metrics.items()}
        print(json.dumps(shown, indent=1))
        print(f"dictionary: {out}")
    return 0


def _key_values(pairs: list[str]) -> dict:
    out = {}
    for text in pairs:
        if "=" not in text:
            raise ValueError(f"--task-option expects key=value, got {text!r}")
        key, value = text.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _token_id(model, text: str) -> int:
    if text.lstrip("-").isdigit():
        return int(text)
    return model.to_single_token(text.encode().decode("unicode_escape"))
