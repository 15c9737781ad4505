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

``callback`` sees each logged row as it is written (a live loss curve, a progress bar);
returning ``True`` ends the run early, evaluated and saved like one that reached ``steps``.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import pandas as pd
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from workbench import distributed
from workbench.checkpoint import CheckpointError, check_replaceable, load_checkpoint, read_meta, save_checkpoint
from workbench.config import ModelConfig
from workbench.data import Task, get_task
from workbench.model import HookedDecoder
from workbench.utils import check_float, check_int, check_seed

METRICS_FILE = "metrics.csv"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
METRIC_COLUMNS = ["step", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"]
MAX_LR = 10.0


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """How to train: every field is a primitive (or a JSON object) and has a ``--flag`` in the CLI."""

    task: str = _opt("induction", "task name (induction, stories, modular, text)")
    task_options: dict = field(default_factory=dict, metadata={"help": "task constructor options, e.g. {'path': 'notes.txt'}"})
    steps: int = _opt(1000, "optimizer steps in total (a resumed run continues up to this)")
    batch_size: int = _opt(32, "sequences per optimizer step, summed over accumulation steps and processes")
    seq_len: Optional[int] = _opt(None, "tokens per sequence (default: the model's n_ctx; fixed-length tasks ignore it)")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step")
    lr: float = _opt(1e-3, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = _opt(100, "linear warmup steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only; norms, biases untouched)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0 disables)")
    eval_every: int = _opt(100, "validation loss every N steps (0: only at the end)")
    eval_batches: int = _opt(4, "validation batches per evaluation")
    log_every: int = _opt(10, "a metrics.csv row every N steps")
    save_every: int = _opt(0, "checkpoint every N steps (0: only at the end)")
    save_train_state: bool = _opt(True, "save optimizer/RNG state with checkpoints so the run can be resumed")
    seed: int = _opt(0, "seed of the initial weights, the data and the task's held-out split")
    device: str = _opt("auto", "cpu, cuda, cuda:1, ... (auto: cuda when available)")
    autocast: Literal["auto", "bf16", "none"] = _opt("auto", "bf16 autocast (auto: on CUDA only)")
    compile: bool = _opt(False, "torch.compile the model")
    threads: int = _opt(0, "torch CPU threads (0: torch's default)")

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
    """
    dist_info, device = distributed.setup(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    out_dir = check_replaceable(out_dir) if out_dir is not None else None  # fail now, not after training
    state = _load_train_state(out_dir) if resume else None
    if resume and state is None:
        raise ValueError(
            f"nothing to resume in {out_dir}: it holds no {STATE_JSON_FILE} (a run saved with "
            "save_train_state=False, or no run at all); start a fresh run instead"
        )
    history: list[dict] = []
    start_step = 0
    if state is not None:
        model, tokenizer = load_checkpoint(out_dir)
        task = task or build_task(config, tokenizer)
        start_step = state["json"]["step"]
        history = _read_history(out_dir, start_step)
    else:
        task = task or build_task(config)
        if model is None:
            if model_config is None:
                raise ValueError("train() needs a model_config or a model (or resume=True with a checkpoint in out_dir)")
            model = HookedDecoder(model_config)
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
    micro = config.batch_size // (config.grad_accum * dist_info.world_size)
    if micro * config.grad_accum * dist_info.world_size != config.batch_size:
        raise ValueError(
            f"batch_size={config.batch_size} must be divisible by grad_accum ({config.grad_accum}) x "
            f"processes ({dist_info.world_size})"
        )
    optimizer = _make_optimizer(model, config)
    if state is not None:
        _restore_train_state(optimizer, state)
    wrapped = model
    if dist_info.enabled:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if config.compile:
        wrapped = torch.compile(wrapped)
    use_bf16 = config.autocast == "bf16" or (config.autocast == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext

    meta = {"task": task.name, "task_options": _jsonable(task.options()), "train_config": config.to_dict()}
    params = [p for p in model.parameters() if p.requires_grad]
    step, last_saved, interrupted, stopped_early = start_step, start_step if state is not None else None, False, False
    bar = tqdm(total=config.steps, initial=start_step, desc=f"train {task.name}", disable=not (progress and dist_info.is_main))
    window_tokens, window_start = 0, time.perf_counter()

    def checkpoint() -> None:
        nonlocal last_saved
        if out_dir is not None and dist_info.is_main and last_saved != step:
            _save(model, task, out_dir, step, optimizer, config, history, meta, metrics=None)
            last_saved = step

    try:
        while step < config.steps:
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens = task.batch(config.batch_size, seq_len, step=step)
            loss_sum = torch.zeros((), device=device)
            for j in range(config.grad_accum):
                first = (j * dist_info.world_size + dist_info.rank) * micro
                rows = tokens[first : first + micro].to(device)
                sync = j == config.grad_accum - 1 or not dist_info.enabled
                with (contextlib.nullcontext() if sync else wrapped.no_sync()), autocast():
                    loss = task.loss(wrapped, rows) / config.grad_accum
                loss.backward()
                loss_sum += loss.detach().float()
            train_loss = float(distributed.all_reduce_mean(loss_sum, dist_info))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip or float("inf")))
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                where = f"the last good checkpoint is {out_dir} (step {last_saved})" if last_saved is not None else "no checkpoint had been saved yet"
                raise TrainingDiverged(
                    f"training stopped at step {step}: the loss is {train_loss} and the gradient norm {grad_norm} "
                    f"(not finite). The weights were not updated and {where}. Lower the learning rate "
                    f"(lr={config.lr}), keep grad_clip > 0, or check the data."
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_tokens += tokens.numel()
            evaluate = config.eval_every and (step % config.eval_every == 0) and step < config.steps
            if step % config.log_every == 0 or evaluate or step == config.steps:
                elapsed = time.perf_counter() - window_start
                row = {"step": step, "train_loss": train_loss, "val_loss": None, "lr": lr, "grad_norm": grad_norm,
                       "tokens_per_s": window_tokens / max(elapsed, 1e-9)}
                history.append(row)  # before evaluating, so an interrupt during evaluation keeps the row
                if evaluate and dist_info.is_main:
                    row["val_loss"] = task.val_loss(model, config.batch_size, seq_len, config.eval_batches)
                bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
                if callback is not None:
                    stopped_early = _ask_callback(callback, row, dist_info, device) and step < config.steps
                window_tokens, window_start = 0, time.perf_counter()
            bar.update(1)
            if stopped_early:
                break
            if config.save_every and step % config.save_every == 0 and step < config.steps:
                checkpoint()
    except KeyboardInterrupt:
        interrupted = True
        checkpoint()
        if dist_info.is_main:
            print(f"\ninterrupted: checkpoint saved at step {step} in {out_dir} (resume with --resume)" if out_dir else "\ninterrupted")
    finally:
        bar.close()

    metrics: dict = {}
    if not interrupted:
        if dist_info.is_main:
            model.eval()
            metrics = {"train_loss": history[-1]["train_loss"] if history else None,
                       "val_loss": task.val_loss(model, config.batch_size, seq_len, config.eval_batches),
                       **task.evaluate(model)}
            if history:
                history[-1]["val_loss"] = metrics["val_loss"]
            if out_dir is not None:
                _save(model, task, out_dir, step, optimizer, config, history, meta, metrics)
        distributed.barrier(dist_info)
    model.eval()
    return TrainResult(model, task, step, metrics, pd.DataFrame(history, columns=METRIC_COLUMNS), out_dir, interrupted,
                       stopped_early)


def _ask_callback(callback, row: dict, dist_info, device) -> bool:
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
def _save(model, task, out_dir, step, optimizer, config, history, meta, metrics) -> None:
    extra: dict[str, Union[str, bytes]] = {METRICS_FILE: _history_csv(history)}
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
    return tensors, _jsonable(info)


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


def _history_csv(history: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=METRIC_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: ("" if row.get(k) is None else (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k])) for k in METRIC_COLUMNS})
    return buffer.getvalue()


def _read_history(out_dir: Path, up_to_step: int) -> list[dict]:
    frame = read_metrics(out_dir / METRICS_FILE)
    frame = frame[frame["step"] <= up_to_step].astype(object).where(frame.notna(), None)
    return frame.to_dict("records")


def read_metrics(path: Union[str, Path]) -> pd.DataFrame:
    """The metrics.csv of a checkpoint directory (or the file itself) as a DataFrame.

    Empty (with the usual columns) when there is none; ValueError naming the file when it
    is not a readable CSV. Every reader of metrics.csv (resume, the figures, the app) uses this.
    """
    file = Path(path) / METRICS_FILE if Path(path).is_dir() else Path(path)
    if not file.exists():
        return pd.DataFrame(columns=METRIC_COLUMNS)
    try:
        return pd.read_csv(file)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not a readable metrics CSV: {e}") from None


def _jsonable(value: Any) -> Any:
    """Recursively turn tuples, paths and tokenizer objects into JSON-friendly values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "kind"):
        return value.kind
    return str(value)
