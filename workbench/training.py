"""TrainConfig and the training loop: AdamW, warmup + cosine, clipping, accumulation, DDP, resume.

    result = train(TrainConfig(task="induction", steps=1000), model_cfg, out_dir="runs/x")

A checkpoint directory holds the model (``save_checkpoint``), ``metrics.csv`` (one row per
logged step: step, train_loss, val_loss, lr, grad_norm, tokens_per_s; val_loss empty when
not evaluated) and, unless ``save_train_state=False``, the state needed to resume without
pickles: ``train_state.safetensors`` (optimizer moments, RNG state) and
``train_state.json`` (step, optimizer hyper-parameters, Python RNG). The data position is
the step itself, because batch ``k`` is a pure function of the task seed and ``k``.

Nothing is lost on failure: a non-finite loss or gradient stops training before the
optimizer step, with a clear message, leaving the last good checkpoint untouched; Ctrl-C
saves a checkpoint at the last completed step.

With ``snapshots`` (``"every:N"``, ``"log:K"`` or explicit steps) the weights alone are also
kept at those steps in ``snapshots/`` inside the run folder (``workbench.snapshots``), for
analyses over training; saves carry them and resuming keeps them.

``callback`` sees each logged row as it is written (a live loss curve, a progress bar);
returning ``True`` ends the run early, evaluated and saved like one that reached ``steps``.

``train`` reads like its steps: ``_prepare_run`` (seed, model, task, optimizer), then
``_run_steps`` (``_step``, ``_log``, ``_evaluate``, ``_save_checkpoint`` on their cadences),
then ``_finish``. Data parallelism is an argument, ``dist=DistInfo.from_env()``, read by
the entry point (the command line) and never by the loop from the environment.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import pandas as pd
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from workbench import distributed
from workbench.checkpoint import CheckpointError, check_replaceable, load_checkpoint, read_meta, save_checkpoint
from workbench.compiled import is_compiled, uncompile
from workbench.config import ModelConfig
from workbench.data import Task, get_task
from workbench.distributed import DistInfo
from workbench.model import HookedDecoder
from workbench.utils import check_float, check_int, check_seed, jsonable
from workbench.snapshots import SnapshotWriter, snapshot_steps

METRICS_FILE = "metrics.csv"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
METRIC_COLUMNS = ["step", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"]
MAX_LR = 10.0


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its ``--flag`` help text (the CLI builds its flags from these)."""
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """How to train: every field is a primitive (or a JSON object) and has a ``--flag`` in the CLI."""

    task: str = option("induction", "task name (induction, stories, modular, text)")
    task_options: dict = field(default_factory=dict, metadata={"help": "task constructor options, e.g. {'path': 'notes.txt'}"})
    steps: int = option(1000, "optimizer steps in total (a resumed run continues up to this)")
    batch_size: int = option(32, "sequences per optimizer step, summed over accumulation steps and processes")
    seq_len: Optional[int] = option(None, "tokens per sequence (default: the model's n_ctx; fixed-length tasks ignore it)")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    lr: float = option(1e-3, "peak learning rate")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = option(100, "linear warmup steps")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only; norms, biases untouched)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 disables)")
    eval_every: int = option(100, "validation loss every N steps (0: only at the end)")
    eval_batches: int = option(4, "validation batches per evaluation")
    log_every: int = option(10, "a metrics.csv row every N steps")
    save_every: int = option(0, "checkpoint every N steps (0: only at the end)")
    save_train_state: bool = option(True, "save optimizer/RNG state with checkpoints so the run can be resumed")
    snapshots: Union[str, list, None] = option(None, "weight snapshots during training: every:N, log:K, or steps '0,100,250'")
    snapshot_fp16: bool = option(False, "store snapshots in fp16 (half the size; analyses run in fp32)")
    seed: int = option(0, "seed of the initial weights, the data and the task's held-out split")
    device: str = option("auto", "cpu, cuda, cuda:1, ... (auto: cuda when available)")
    autocast: Literal["auto", "bf16", "none"] = option("auto", "bf16 autocast (auto: on CUDA only)")
    compile: bool = option(False, "torch.compile the model (model.compile(): hooks honoured)")
    threads: int = option(0, "torch CPU threads (0: torch's default)")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_batches"):
            check_int(f"TrainConfig.{name}", getattr(self, name), 1)
        for name in ("warmup_steps", "eval_every", "save_every", "threads"):
            check_int(f"TrainConfig.{name}", getattr(self, name), 0)
        if self.seq_len is not None:
            check_int("TrainConfig.seq_len", self.seq_len, 2)  # the next-token loss needs two tokens
        check_seed("TrainConfig.seed", self.seed)
        # AdamW moves every weight by about lr per step, so lr above 10 replaces a model's weights in one
        # step; the bound also keeps lr inside the float32 range the optimizer computes in (1e40 overflows).
        check_float("TrainConfig.lr", self.lr, 0, MAX_LR, lo_open=True)
        check_float("TrainConfig.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_float("TrainConfig.weight_decay", self.weight_decay, 0)
        check_float("TrainConfig.grad_clip", self.grad_clip, 0)
        for name in ("beta1", "beta2"):  # AdamW's own range: a beta of 1 never forgets the first gradient
            check_float(f"TrainConfig.{name}", getattr(self, name), 0, 1, hi_open=True)
        for name in ("save_train_state", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainConfig.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("task", "device"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"TrainConfig.{name} must be a string, got {getattr(self, name)!r}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"TrainConfig.autocast={self.autocast!r}; valid choices are ['auto', 'bf16', 'none']")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"TrainConfig.task_options must be a dict, got {type(self.task_options).__name__}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the weights were not updated."""


@dataclass
class TrainResult:
    model: HookedDecoder
    task: Task
    step: int
    metrics: dict
    history: pd.DataFrame
    out_dir: Optional[Path]
    interrupted: bool = False
    stopped_early: bool = False  # the callback asked to stop before config.steps


def build_task(config: TrainConfig, tokenizer: Any = None) -> Task:
    """The task of ``config``, seeded by ``config.seed`` unless ``task_options`` sets a seed."""
    options = {"seed": config.seed, **config.task_options}
    if config.task == "text" and tokenizer is not None:
        options["tokenizer"] = tokenizer  # a resumed text run keeps the tokenizer it started with
    return get_task(config.task, **options)


def train(
    config: TrainConfig,
    model_config: Optional[ModelConfig] = None,
    out_dir: Union[str, Path, None] = None,
    *,
    resume: bool = False,
    model: Optional[HookedDecoder] = None,
    task: Optional[Task] = None,
    progress: bool = True,
    callback: Optional[Callable[[dict], Optional[bool]]] = None,
    dist: Optional[DistInfo] = None,
) -> TrainResult:
    """Train a model and return it with its final metrics and the logged history.

    The model is ``model``, or a new one from ``model_config`` (its ``d_vocab`` must cover the
    task's vocabulary), or, with ``resume=True`` and a checkpoint in ``out_dir`` holding a
    training state, the checkpoint's model, optimizer, RNG and step.

    ``callback(row)`` runs after each logged step (on the main process) with a dict of
    ``step, train_loss, val_loss`` (None when not evaluated at that step; the last step's
    comes in ``result.metrics``), ``lr, tokens_per_s``. Returning ``True`` (exactly: other
    truthy values are ignored, so a callback that returns a widget does not stop anything)
    stops training after that step; the run is then evaluated and saved as if it had
    ended there, and ``result.stopped_early`` is True.

    ``dist`` places this process in a data-parallel run (``DistInfo.from_env()`` under
    torchrun, as the command line does); None is a single process whatever the environment
    holds. A process group this call joins is left when it returns or raises.
    """
    dist = dist or DistInfo()
    device = distributed.device_for(dist, config.device)
    with distributed.process_group(dist, device):
        compiled_before = model is not None and is_compiled(model)
        run = _prepare_run(config, model_config, out_dir, resume=resume, model=model, task=task, dist=dist,
                           device=device)
        try:
            _run_steps(run, progress, callback)
            return _finish(run)
        finally:
            if config.compile and not compiled_before:  # the model is handed back as it came in
                uncompile(run.model)


@dataclass
class _Run:
    """Everything one training run carries from step to step (built by ``_prepare_run``)."""

    config: TrainConfig
    model: HookedDecoder
    wrapped: torch.nn.Module  # the model as the loss sees it: DDP and/or compiled
    task: Task
    optimizer: torch.optim.Optimizer
    dist: DistInfo
    device: torch.device
    out_dir: Optional[Path]
    seq_len: int
    micro_batch: int
    autocast: Callable[[], Any]
    meta: dict
    step: int
    history: list[dict]
    last_saved: Optional[int]
    snapshots: Optional[SnapshotWriter]  # the main process's, whenever there is an out_dir
    interrupted: bool = False
    stopped_early: bool = False


def _prepare_run(config: TrainConfig, model_config: Optional[ModelConfig], out_dir: Union[str, Path, None], *,
                 resume: bool, model: Optional[HookedDecoder], task: Optional[Task], dist: DistInfo,
                 device: torch.device) -> _Run:
    """Seed, load or build the model and task, check they fit together, and set up the optimizer."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    out_dir = check_replaceable(out_dir) if out_dir is not None else None  # fail now, not after training
    model, task, state, history = _model_task_and_state(config, model_config, out_dir, resume, model, task)
    start_step = state["json"]["step"] if state is not None else 0
    if model.cfg.d_vocab < task.vocab_size:
        raise ValueError(
            f"the model's d_vocab={model.cfg.d_vocab} is smaller than the {task.name} task's vocabulary "
            f"({task.vocab_size}); set d_vocab={task.vocab_size}"
        )
    if model.tokenizer is None:
        model.tokenizer = task.tokenizer
    model.to(device).train()
    seq_len = task.default_seq_len if task.fixed_seq_len else (config.seq_len or model.cfg.n_ctx)
    if seq_len > model.cfg.n_ctx:
        raise ValueError(f"seq_len={seq_len} exceeds the model's n_ctx={model.cfg.n_ctx}")
    schedule = snapshot_steps(config.snapshots, config.steps)  # a bad schedule fails now
    if schedule and out_dir is None:
        raise ValueError(f"TrainConfig.snapshots={config.snapshots!r} needs an out_dir to write the snapshots into")
    micro = config.batch_size // (config.grad_accum * dist.world_size)
    if micro * config.grad_accum * dist.world_size != config.batch_size:
        raise ValueError(
            f"batch_size={config.batch_size} must be divisible by grad_accum ({config.grad_accum}) x "
            f"processes ({dist.world_size})"
        )
    optimizer = _make_optimizer(model, config)
    if state is not None:
        _restore_train_state(optimizer, state)
    if config.compile and not is_compiled(model):  # in place, every hook honoured; train() undoes it at the end
        model.compile()
    wrapped: torch.nn.Module = model
    if dist.enabled:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    use_bf16 = config.autocast == "bf16" or (config.autocast == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    meta = {"task": task.name, "task_options": jsonable(task.options()), "train_config": config.to_dict()}
    snapshots = None
    if out_dir is not None and dist.is_main:  # also without a schedule: a resumed run carries its snapshots
        snapshots = SnapshotWriter(out_dir, schedule, config.snapshot_fp16,
                                   resume_from=start_step if state is not None else None)
    return _Run(config, model, wrapped, task, optimizer, dist, device, out_dir, seq_len, micro, autocast, meta,
                step=start_step, history=history, last_saved=start_step if state is not None else None,
                snapshots=snapshots)


def _model_task_and_state(config: TrainConfig, model_config: Optional[ModelConfig], out_dir: Optional[Path],
                          resume: bool, model: Optional[HookedDecoder], task: Optional[Task]):
    """``(model, task, training state or None, history so far)``: the checkpoint's when resuming,
    else the given model (or a new one from ``model_config``) and task."""
    state = _load_train_state(out_dir) if resume else None
    if resume and state is None:
        raise ValueError(
            f"nothing to resume in {out_dir}: it holds no {STATE_JSON_FILE} (a run saved with "
            "save_train_state=False, or no run at all); start a fresh run instead"
        )
    if state is not None:
        model, tokenizer = load_checkpoint(out_dir)
        return model, task or build_task(config, tokenizer), state, read_history(out_dir, state["json"]["step"])
    task = task or build_task(config)
    if model is None:
        if model_config is None:
            raise ValueError("train() needs a model_config or a model (or resume=True with a checkpoint in out_dir)")
        model = HookedDecoder(model_config)
    return model, task, None, []


def _run_steps(run: _Run, progress: bool, callback: Optional[Callable[[dict], Optional[bool]]]) -> None:
    """Step until ``config.steps`` (or the callback says stop), logging, evaluating and saving
    on their cadences; Ctrl-C saves a checkpoint at the last completed step."""
    config = run.config
    bar = tqdm(total=config.steps, initial=run.step, desc=f"train {run.task.name}",
               disable=not (progress and run.dist.is_main))
    window_tokens, window_start = 0, time.perf_counter()  # throughput since the last logged row
    try:
        if run.step == 0:
            _snapshot(run, {})  # the initial weights, when the schedule names step 0
        while run.step < config.steps:
            lr, train_loss, grad_norm, n_tokens = _step(run)
            window_tokens += n_tokens
            row = {"train_loss": train_loss, "val_loss": None, "lr": lr, "grad_norm": grad_norm}
            evaluate = config.eval_every and (run.step % config.eval_every == 0) and run.step < config.steps
            if run.step % config.log_every == 0 or evaluate or run.step == config.steps:
                row = _log(run, lr, train_loss, grad_norm, window_tokens / max(time.perf_counter() - window_start, 1e-9))
                if evaluate and run.dist.is_main:
                    row["val_loss"] = _evaluate(run)
                bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
                if callback is not None:
                    run.stopped_early = _ask_callback(callback, row, run.dist, run.device) and run.step < config.steps
                window_tokens, window_start = 0, time.perf_counter()
            _snapshot(run, row)
            bar.update(1)
            if run.stopped_early:
                break
            if config.save_every and run.step % config.save_every == 0 and run.step < config.steps:
                _save_checkpoint(run)
    except KeyboardInterrupt:
        run.interrupted = True
        _save_checkpoint(run)
        if run.dist.is_main:
            print(f"\ninterrupted: checkpoint saved at step {run.step} in {run.out_dir} (resume with --resume)"
                  if run.out_dir else "\ninterrupted")
    finally:
        bar.close()


def _step(run: _Run) -> tuple[float, float, float, int]:
    """One optimizer step over ``grad_accum`` micro-batches per process; returns
    ``(lr, train_loss, grad_norm, tokens)``. A non-finite loss or gradient raises
    ``TrainingDiverged`` before the weights change."""
    config, dist = run.config, run.dist
    lr = config.lr_at(run.step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    tokens = run.task.batch(config.batch_size, run.seq_len, step=run.step)
    loss_sum = torch.zeros((), device=run.device)
    for j in range(config.grad_accum):
        first = (j * dist.world_size + dist.rank) * run.micro_batch
        rows = tokens[first : first + run.micro_batch].to(run.device)
        sync = j == config.grad_accum - 1 or not dist.enabled
        with (contextlib.nullcontext() if sync else run.wrapped.no_sync()), run.autocast():
            loss = run.task.loss(run.wrapped, rows) / config.grad_accum
        loss.backward()
        loss_sum += loss.detach().float()
    train_loss = float(distributed.all_reduce_mean(loss_sum, dist))
    params = [p for p in run.model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip or float("inf")))
    if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
        where = (f"the last good checkpoint is {run.out_dir} (step {run.last_saved})" if run.last_saved is not None
                 else "no checkpoint had been saved yet")
        raise TrainingDiverged(
            f"training stopped at step {run.step}: the loss is {train_loss} and the gradient norm {grad_norm} "
            f"(not finite). The weights were not updated and {where}. Lower the learning rate "
            f"(lr={config.lr}), keep grad_clip > 0, or check the data."
        )
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return lr, train_loss, grad_norm, tokens.numel()


def _log(run: _Run, lr: float, train_loss: float, grad_norm: float, tokens_per_s: float) -> dict:
    """Append this step's metrics row to the history (before any evaluation, so an interrupt
    during evaluation keeps the row) and return it."""
    row = {"step": run.step, "train_loss": train_loss, "val_loss": None, "lr": lr, "grad_norm": grad_norm,
           "tokens_per_s": tokens_per_s}
    run.history.append(row)
    return row


def _evaluate(run: _Run) -> float:
    """The validation loss (the main process evaluates; the caller decides who calls)."""
    return run.task.val_loss(run.model, run.config.batch_size, run.seq_len, run.config.eval_batches)


def _snapshot(run: _Run, row: dict) -> None:
    """Save the weights (only) when the schedule names this step, with the step's metrics."""
    if run.snapshots is not None and run.snapshots.due(run.step):
        run.snapshots.write(run.model, run.step, {k: row.get(k) for k in ("train_loss", "val_loss", "lr", "grad_norm")})


def _save_checkpoint(run: _Run, metrics: Optional[dict] = None) -> None:
    """Write the checkpoint at the current step (main process, with an ``out_dir``). A step
    already saved is not saved again, except by the final save, which adds the metrics."""
    if run.out_dir is None or not run.dist.is_main or (run.last_saved == run.step and metrics is None):
        return
    for attempt in range(2):
        snapshot_files = run.snapshots.checkpoint_files() if run.snapshots is not None else {}
        try:
            _save(run.model, run.task, run.out_dir, run.step, run.optimizer, run.config, run.history, run.meta,
                  metrics, snapshot_files)
            break
        except FileNotFoundError:
            # A snapshot listed before the save took the folder's lock was dropped meanwhile by another
            # writer's save into the same folder: list them again (now without it) rather than lose the run.
            if attempt or not any(isinstance(v, Path) and not v.exists() for v in snapshot_files.values()):
                raise
    run.last_saved = run.step


def _finish(run: _Run) -> TrainResult:
    """Evaluate on the task and save the final checkpoint, unless interrupted; the model ends in eval mode."""
    metrics: dict = {}
    if not run.interrupted:
        if run.dist.is_main:
            run.model.eval()
            history = run.history
            metrics = {"train_loss": history[-1]["train_loss"] if history else None, "val_loss": _evaluate(run),
                       **run.task.evaluate(run.model)}
            if history:
                history[-1]["val_loss"] = metrics["val_loss"]
            if run.snapshots is not None:
                run.snapshots.update(run.step, val_loss=metrics["val_loss"])
            _save_checkpoint(run, metrics)
        distributed.barrier(run.dist)
    run.model.eval()
    return TrainResult(run.model, run.task, run.step, metrics, pd.DataFrame(run.history, columns=METRIC_COLUMNS),
                       run.out_dir, run.interrupted, run.stopped_early)


def _ask_callback(callback, row: dict, dist_info: DistInfo, device: torch.device) -> bool:
    """Hand ``row`` to the callback (main process only); True when it asked to stop, on every process."""
    stop = dist_info.is_main and callback({k: row[k] for k in ("step", "train_loss", "val_loss", "lr", "tokens_per_s")}) is True
    if dist_info.enabled:  # every process must leave the loop at the same step, or DDP hangs
        stop = float(distributed.all_reduce_mean(torch.tensor(float(stop), device=device), dist_info)) > 0
    return stop


# ---- optimizer -------------------------------------------------------------------------
def _make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not shrunk)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), foreach=True)


# ---- checkpoint files ----------------------------------------------------------------------
def _save(model, task, out_dir, step, optimizer, config, history, meta, metrics, snapshot_files=None) -> None:
    extra: dict[str, Union[str, bytes, Path]] = {METRICS_FILE: history_csv(history), **(snapshot_files or {})}
    if config.save_train_state:
        tensors, info = _train_state(optimizer, step)
        extra[STATE_TENSORS_FILE] = save(tensors)
        extra[STATE_JSON_FILE] = json.dumps(info, indent=1)
    save_checkpoint(model, out_dir, task.tokenizer, step=step, metrics=metrics, meta=meta, extra_files=extra)


def _train_state(optimizer: torch.optim.Optimizer, step: int) -> tuple[dict, dict]:
    """Optimizer moments and RNG as tensors; step, hyper-parameters and Python RNG as JSON."""
    sd = optimizer.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    scalars: dict[str, dict] = {}
    for index, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    version, internal, gauss = random.getstate()
    info = {
        "step": step,
        "optimizer_param_groups": sd["param_groups"],
        "optimizer_scalars": scalars,
        "python_rng": [version, list(internal), gauss],
    }
    return tensors, jsonable(info)


def _load_train_state(out_dir: Optional[Path]) -> Optional[dict]:
    """The saved training state in ``out_dir``, or None when it holds no resumable checkpoint."""
    if out_dir is None or not (out_dir / STATE_JSON_FILE).exists():
        return None
    read_meta(out_dir)  # raises CheckpointError on a corrupt meta.json
    try:
        info = json.loads((out_dir / STATE_JSON_FILE).read_text())
        tensors = load_file(str(out_dir / STATE_TENSORS_FILE))
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{out_dir}: the training state is missing or corrupt ({e}); start a fresh run") from None
    return {"json": info, "tensors": tensors}


def _restore_train_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    info, tensors = state["json"], state["tensors"]
    per_param: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = value
    for index, entry in info["optimizer_scalars"].items():
        per_param.setdefault(int(index), {}).update(entry)
    groups = info["optimizer_param_groups"]
    for group in groups:
        group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    version, internal, gauss = info["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def history_csv(history: list[dict], columns: list[str] = METRIC_COLUMNS) -> str:
    """Metrics rows as the text of a metrics.csv: ``columns`` in order, floats to 6 significant
    digits, a missing or None value as an empty cell. Every run folder (a model's training, a
    dictionary's) writes its metrics.csv with this, and resume reads it back with ``read_history``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: ("" if row.get(k) is None else (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k])) for k in columns})
    return buffer.getvalue()


def read_history(out_dir: Path, up_to_step: int) -> list[dict]:
    """The metrics rows of ``out_dir``'s metrics.csv up to ``up_to_step`` (where a resumed run
    continues), empty cells as None; [] when there is no file."""
    frame = read_metrics(out_dir / METRICS_FILE)
    frame = frame[frame["step"] <= up_to_step].astype(object).where(frame.notna(), None)
    return frame.to_dict("records")


class MalformedMetricsWarning(UserWarning):
    """Rows of a metrics.csv that are not numbers were skipped (a hand edit, a truncated write)."""


def read_metrics(path: Union[str, Path]) -> pd.DataFrame:
    """The metrics.csv of a checkpoint directory (or the file itself) as a DataFrame.

    Empty (with the usual columns) when there is none; ValueError naming the file when it
    is not a readable CSV (not text, no header with a ``step`` column). A row that is not
    numbers (the wrong number of cells, text in a cell, a step that is not a whole number) is
    skipped and counted: a ``MalformedMetricsWarning`` says how many, and the frame's
    ``attrs["skipped_rows"]`` keeps the count for a page to show. Every reader of metrics.csv
    (resume, the figures, the app) uses this.
    """
    file = Path(path) / METRICS_FILE if Path(path).is_dir() else Path(path)
    if not file.exists():
        return pd.DataFrame(columns=METRIC_COLUMNS)
    try:
        rows = list(csv.reader(io.StringIO(file.read_text(encoding="utf-8"))))
    except (UnicodeDecodeError, csv.Error, OSError) as e:
        raise ValueError(f"{file} is not a readable metrics CSV: {e}") from None
    header = [name.strip() for name in rows[0]] if rows else []
    if "step" not in header or len(set(header)) != len(header):
        raise ValueError(f"{file} is not a readable metrics CSV: its first line must name the columns, "
                         f"step among them (got {header[:8]})")
    good, skipped = [], []
    for number, row in enumerate(rows[1:], start=2):
        if not row:
            continue  # a blank line
        values = _numbers(row) if len(row) == len(header) else None
        step = values[header.index("step")] if values is not None else math.nan
        if values is None or not math.isfinite(step) or step < 0 or step != int(step):
            skipped.append(number)
            continue
        good.append(values)
    frame = pd.DataFrame(good, columns=header, dtype=float)
    frame["step"] = frame["step"].astype("int64")
    frame.attrs["skipped_rows"] = len(skipped)
    if skipped:
        warnings.warn(f"{file}: skipped {len(skipped)} malformed row(s) (line {', '.join(map(str, skipped[:5]))}"
                      f"{', ...' if len(skipped) > 5 else ''}): not {len(header)} numbers", MalformedMetricsWarning,
                      stacklevel=2)
    return frame


def _numbers(row: list[str]) -> Optional[list[float]]:
    """A CSV row's cells as floats (an empty cell: NaN), or None when one is not a number."""
    try:
        return [float(cell) if cell.strip() else math.nan for cell in row]
    except ValueError:
        return None
