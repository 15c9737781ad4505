"""Training a dictionary on stored (or live) activations: a run folder like ``train``'s.

    sae = train_sae(store, kind="batchtopk", d_sae=4096, k=32, steps=3000, out="saes/s26-l1")
    sae.metrics        # L0, explained variance, dead / dense fractions (+ CE loss recovered with model=)

The run folder holds the dictionary in SAELens' format (``cfg.json``, ``sae_weights.safetensors``,
``sae_meta.json``), ``metrics.csv`` (step, loss, mse, sparsity_loss, aux_loss, l0,
explained_variance, dead_fraction, lr, tokens_per_s) and, for ``resume=True``,
``train_state.safetensors`` + ``train_state.json`` (the unfolded weights, Adam's moments, the
dead-feature counters, RNG; no pickles). A non-finite loss stops the run before the step, with
the last saved state untouched.

How it trains (the choices of SAELens and EleutherAI's sparsify, unless noted):
- Inputs (and a transcoder's targets) are scaled so their mean norm is ``sqrt(d)``; the scale is
  folded into the saved weights, which therefore take raw activations.
- ``b_dec`` starts at the mean of the targets; decoder rows stay unit norm (``base.py``).
- Adam; the learning rate warms up linearly for ``warmup_steps``, stays flat, and decays linearly
  to 0 over the last ``decay_fraction`` of the steps; the default rate is sparsify's
  ``2e-4 / sqrt(d_sae / 2**14)``. The sparsity coefficient (L1, or JumpReLU's L0) ramps up over
  ``sparsity_warmup_steps``.
- A feature that has not fired for ``dead_after_tokens`` tokens is dead; TopK-style dictionaries
  then train the dead ones on the live ones' residual (AuxK, coefficient 1/32, Gao et al.).
- The last shard of a store with several is held out for the final metrics.
- Under torchrun every process reads the same global batch and takes its slice; gradients,
  firing counts and the BatchTopK threshold are averaged over processes; rank 0 writes.
- A cross-layer transcoder (kind ``clt``) trains on a store holding every layer's MLP input and
  output (``clt_hooks(n_layers)``); its rows concatenate the layers, each layer scaled on its own,
  and its metrics add each layer's explained variance and L0 (``explained_variance_layer0``, ...)
  and CE loss recovered with every MLP replaced.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pandas as pd
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from workbench import distributed
from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig, SparseActs
from workbench.analysis.dictionaries.clt import is_our_clt
from workbench.analysis.dictionaries.clt import HOOK_IN, HOOK_OUT, CrossLayerTranscoder, clt_config
from workbench.analysis.dictionaries.evaluate import ce_loss_recovered, reconstruction_metrics
from workbench.analysis.dictionaries.registry import DICTIONARIES, make_dictionary
from workbench.analysis.dictionaries.saelens import is_our_dictionary, save_dictionary
from workbench.analysis.dictionaries.topk import aux_k_loss
from workbench.analysis.store import ActivationStore, LiveActivations, TensorActivations, hook_layer
from workbench.overwrite import write_atomic
from workbench.training import (METRICS_FILE, TrainingDiverged, _restore_train_state, _train_state, history_csv,
                                option, read_history)

AnyDictionary = Union[Dictionary, CrossLayerTranscoder]
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
METRIC_COLUMNS = ["step", "loss", "mse", "sparsity_loss", "aux_loss", "l0", "explained_variance", "dead_fraction",
                  "lr", "tokens_per_s"]
# Sparsity coefficients that gave L0 of a few per cent of d_sae on the shipped stories model and
# on planted-feature data (inputs scaled to mean norm sqrt(d)); TopK-style kinds need none.
DEFAULT_SPARSITY = {"relu": 1.0, "jumprelu": 0.3, "transcoder": 0.3, "skip_transcoder": 0.3, "clt": 0.3}
AUX_K_KINDS = ("topk", "batchtopk", "matryoshka_batchtopk")
TRANSCODER_KINDS = ("transcoder", "skip_transcoder")


@dataclass(frozen=True)
class SAETrainConfig:
    """How to train a dictionary; every field is a primitive and a ``--flag`` of ``train-sae``."""

    kind: str = option("topk", f"dictionary kind, one of {list(DICTIONARIES)}")
    d_sae: int = option(4096, "number of features")
    k: float = option(32.0, "TopK: features per token; BatchTopK: mean features per token")
    hook: str = option("", "the store hook to read (default: the store's only hook); a transcoder's input")
    hook_out: str = option("", "a transcoder's output hook (e.g. blocks.1.hook_mlp_out)")
    activation: str = option("jumprelu", "a CLT's activation: jumprelu (L0 penalty) or topk (k per token and layer); "
                             "a transcoder's: topk (k per token), else ReLU + L1")
    skip: bool = option(False, "a CLT with a linear skip path per layer")
    steps: int = option(2000, "optimizer steps in total (a resumed run continues up to this)")
    batch_size: int = option(4096, "activation rows per step, summed over processes")
    lr: float = option(0.0, "peak learning rate (0: 2e-4 / sqrt(d_sae / 16384))")
    warmup_steps: int = option(100, "linear learning-rate warmup steps")
    decay_fraction: float = option(0.2, "linear decay to 0 over this last fraction of the steps")
    sparsity_coefficient: float = option(0.0, f"L1 (relu, transcoders) or L0 (jumprelu) coefficient (0: {DEFAULT_SPARSITY})")
    sparsity_warmup_steps: int = option(-1, "steps over which the sparsity coefficient ramps up (-1: 5% of steps)")
    matryoshka_widths: str = option("", "matryoshka_batchtopk: comma-separated level widths (empty: 4 doubling levels up to d_sae)")
    aux_k_coefficient: float = option(1 / 32, "weight of the AuxK dead-feature loss (topk, batchtopk)")
    dead_after_tokens: int = option(0, "a feature silent this many tokens is dead (0: min(10M, a tenth of training))")
    buffer_shards: int = option(4, "shards shuffled together (memory: this many shards)")
    eval_rows: int = option(65536, "held-out rows for the final metrics")
    eval_sequences: int = option(64, "held-out sequences for CE loss recovered (needs the model)")
    log_every: int = option(50, "a metrics.csv row every N steps")
    save_every: int = option(0, "save the run every N steps (0: only at the end)")
    save_train_state: bool = option(True, "keep optimizer state so the run can be resumed")
    seed: int = option(0, "seed of the initial weights and the shuffle")
    device: str = option("auto", "cpu, cuda, ... (auto: cuda when available)")
    threads: int = option(0, "torch CPU threads (0: torch's default)")

    def __post_init__(self) -> None:
        if self.kind not in DICTIONARIES:
            raise ValueError(f"kind={self.kind!r} is not a dictionary kind; valid kinds are {list(DICTIONARIES)}")
        for name in ("d_sae", "steps", "batch_size", "log_every", "buffer_shards", "eval_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"SAETrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "threads", "dead_after_tokens", "lr", "sparsity_coefficient",
                     "aux_k_coefficient", "eval_sequences"):
            if getattr(self, name) < 0:
                raise ValueError(f"SAETrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"SAETrainConfig.decay_fraction must lie in [0, 1], got {self.decay_fraction}")
        if self.activation not in ("jumprelu", "topk"):
            raise ValueError(f"activation={self.activation!r} is not a CLT activation; choose jumprelu or topk")
        if self.kind == "clt" and self.activation == "topk" and not (float(self.k).is_integer() and 1 <= self.k <= self.d_sae):
            raise ValueError(f"a TopK CLT needs an integer k in [1, d_sae={self.d_sae}] (per token and layer), got {self.k:g}")
        if self.topk_transcoder and not (float(self.k).is_integer() and 1 <= self.k <= self.d_sae):
            raise ValueError(f"a TopK {self.kind} needs an integer k in [1, d_sae={self.d_sae}] (per token), got {self.k:g}")
        if self.kind in AUX_K_KINDS and not 0 < self.k <= self.d_sae:
            raise ValueError(f"k={self.k:g} must lie in (0, d_sae={self.d_sae}] for kind={self.kind!r}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "SAETrainConfig":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown SAETrainConfig field(s) {unknown}; valid fields are {sorted(known)}")
        floats = {f.name for f in dataclasses.fields(self) if f.type in (float, "float")}
        changes = {k: float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool) else v
                   for k, v in changes.items()}
        return dataclasses.replace(self, **changes)

    @property
    def topk_transcoder(self) -> bool:
        """A per-layer transcoder with the TopK activation (``activation="topk"``)."""
        return self.kind in TRANSCODER_KINDS and self.activation == "topk"

    @property
    def aux_k(self) -> bool:
        """Whether the AuxK dead-feature loss applies (TopK-style kinds, TopK transcoders)."""
        return (self.kind in AUX_K_KINDS or self.topk_transcoder) and self.aux_k_coefficient > 0

    @property
    def peak_lr(self) -> float:
        return self.lr or 2e-4 / math.sqrt(self.d_sae / 2**14)

    @property
    def sparsity(self) -> float:
        if self.topk_transcoder:
            return 0.0  # k sets the sparsity
        return self.sparsity_coefficient or DEFAULT_SPARSITY.get(self.kind, 0.0)

    def lr_at(self, step: int) -> float:
        decay_start = self.steps * (1 - self.decay_fraction)
        ramp = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        if step >= decay_start and self.decay_fraction > 0:
            ramp = min(ramp, (self.steps - step) / (self.steps - decay_start))
        return self.peak_lr * ramp

    def sparsity_at(self, step: int) -> float:
        warm = self.sparsity_warmup_steps if self.sparsity_warmup_steps >= 0 else self.steps // 20
        return self.sparsity * (min(1.0, (step + 1) / warm) if warm else 1.0)


def train_sae(
    source: Union[ActivationStore, LiveActivations, TensorActivations, str, Path],
    kind: Optional[str] = None,
    d_sae: Optional[int] = None,
    k: Union[int, float, None] = None,
    steps: Optional[int] = None,
    out: Union[str, Path, None] = None,
    *,
    config: Optional[SAETrainConfig] = None,
    model=None,
    resume: bool = False,
    progress: bool = True,
    callback: Optional[Callable[[dict], Optional[bool]]] = None,
    dist: Optional[distributed.DistInfo] = None,
    **overrides: Any,
) -> AnyDictionary:
    """Train a dictionary on ``source`` (a store, its path, or ``LiveActivations``) and return it.

    The settings are ``config`` with ``kind``/``d_sae``/``k``/``steps`` and any other
    SAETrainConfig field given as keywords on top. With ``model`` (the one the store came from,
    checked by fingerprint) the metrics include CE loss recovered. ``callback(row)`` sees each
    logged row; returning True stops early (evaluated and saved like a finished run).
    The returned dictionary takes raw activations; ``sae.history`` is the logged DataFrame.
    """
    given = {k_: v for k_, v in dict(kind=kind, d_sae=d_sae, k=k, steps=steps).items() if v is not None}
    if k is not None and "activation" not in overrides and (kind or (config and config.kind)) in TRANSCODER_KINDS:
        given["activation"] = "topk"  # k= given for a transcoder asks for a TopK one (ReLU + L1 has no k)
    config = (config or SAETrainConfig()).replace(**given, **overrides)
    if isinstance(source, (str, Path)):
        source = ActivationStore(source)
    if model is not None:
        source.check_model(model)
    layout = _layout(config, source)
    # State goes in: a data-parallel run is handed its DistInfo by the entry point (the CLI reads
    # torchrun's variables); without one this is a single process whatever the environment says.
    dist_info = dist or distributed.DistInfo()
    # One run writes into out at a time (its lock, held until the run returns; only the main rank writes):
    # a second train_sae into the same folder is refused at once, before its checks, instead of both
    # writing and resuming from each other's state files.
    with _owned(out if dist_info.is_main else None):
        out = _check_out(out, resume)
        device = distributed.device_for(dist_info, config.device)
        threads = torch.get_num_threads()
        if config.threads:
            torch.set_num_threads(config.threads)
        try:
            with distributed.process_group(dist_info, device):
                return _train(source, config, layout, dist_info, device, out, model, resume, progress, callback)
        finally:
            torch.set_num_threads(threads)  # the setting lasts for this call only


def _owned(out):
    """The write lock of run folder ``out`` (``.<name>.lock`` beside it), held; ValueError at once when
    another run holds it. Nothing for ``out=None``."""
    import contextlib

    from workbench.checkpoint import hold_now

    if out is None or (os.path.lexists(out) and not Path(out).is_dir()):
        return contextlib.ExitStack()  # no folder, or not one: _check_out says so
    out = Path(out)
    return hold_now(out, lambda by: ValueError(f"{out} is in use: another training run{by} is writing there now; "
                                               "give each run its own out= (nothing was written)"))


def _train(source, config: SAETrainConfig, layout: "_Layout", dist_info, device, out, model, resume: bool,
           progress: bool, callback) -> AnyDictionary:
    micro = config.batch_size // dist_info.world_size
    if micro * dist_info.world_size != config.batch_size:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by the {dist_info.world_size} processes")
    train_src, eval_src, held_out = _split(source)

    hooks = layout.hooks
    cfg = _dictionary_config(config, layout, source)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    sae = make_dictionary(cfg)
    sae.init_weights(torch.Generator().manual_seed(config.seed))
    sae.to(device).train()
    optimizer = torch.optim.Adam(sae.parameters(), lr=config.peak_lr, betas=(0.9, 0.999))
    since_fired = torch.zeros(getattr(sae, "n_features", cfg.d_sae), dtype=torch.float64, device=device)
    dead_after = config.dead_after_tokens or max(config.batch_size, min(10_000_000, config.steps * config.batch_size // 10))
    step, history = 0, []
    state = _load_state(out) if resume else None
    if state is not None:
        step, scales = state["json"]["step"], state["json"]["scales"]
        _restore(sae, optimizer, since_fired, train_src, state)
        history = read_history(out, step)
    else:
        scales = _scales_and_bias(sae, train_src, layout)
    s_in, s_out = scales
    scale_x, scale_y = layout.scale_rows(s_in, layout.ins, source), layout.scale_rows(s_out, layout.outs, source)

    def save_run(metrics: Optional[dict], density: Optional[torch.Tensor] = None) -> None:
        if out is None or not dist_info.is_main:
            return
        final = _folded(sae, scales)
        final.metrics = metrics or {}
        extra = {"training": config.to_dict(), "source": _source_info(source), "held_out": held_out,
                 "normalization": {"scale_in": s_in, "scale_out": s_out}}
        if density is not None:
            extra["feature_density"] = [round(float(v), 7) for v in density]
        save_dictionary(final, out, extra_meta=extra,
                        context_size=source.manifest.get("seq_len") or source.manifest.get("source", {}).get("seq_len"))
        (out / METRICS_FILE).write_text(history_csv(history, METRIC_COLUMNS))
        if config.save_train_state:
            tensors, info = _train_state(optimizer, step)
            tensors.update({f"param.{n}": p.detach().cpu().contiguous() for n, p in sae.named_parameters()})
            tensors.update({f"buffer.{n}": b.detach().cpu().contiguous() for n, b in sae.named_buffers()})
            tensors["since_fired"] = since_fired.cpu()
            info.update(scales=list(scales), config=config.to_dict(),
                        live_rows={str(i): r for i, r in getattr(train_src, "rows", {}).items()})
            write_atomic(out / STATE_TENSORS_FILE, save(tensors))
            write_atomic(out / STATE_JSON_FILE, json.dumps(info, indent=1))

    stream = train_src.batches(config.batch_size, hooks, seed=config.seed, buffer_shards=config.buffer_shards,
                               start_batch=step, device=device)
    bar = tqdm(total=config.steps, initial=step, desc=f"train-sae {config.kind}", disable=not (progress and dist_info.is_main))
    window_rows, window_start, last_saved, stopped = 0, time.perf_counter(), step if state else None, False
    try:
        while step < config.steps:
            batch = next(stream)
            x, y = layout.rows(batch)
            lo = dist_info.rank * micro
            x, y = x[lo : lo + micro] * scale_x, y[lo : lo + micro] * scale_y
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            terms = _losses(sae, x, y, config, step, since_fired >= dead_after)
            loss_value = float(distributed.all_reduce_mean(terms["loss"].detach(), dist_info))
            if not math.isfinite(loss_value):
                where = f"the last saved state is in {out} (step {last_saved})" if last_saved is not None else "nothing had been saved yet"
                raise TrainingDiverged(f"dictionary training stopped at step {step}: the loss is {loss_value} (not finite). "
                                       f"The weights were not updated and {where}. Lower the learning rate "
                                       f"(now {config.peak_lr:g}) or check the activations for inf/NaN.")
            _optimize(sae, optimizer, terms["loss"], dist_info)
            _count_firing(sae, terms["acts"], since_fired, config.batch_size, dist_info)
            step += 1
            window_rows += config.batch_size
            if step % config.log_every == 0 or step == config.steps:
                row = {"step": step, "loss": loss_value, **_batch_stats(terms, y), "lr": lr,
                       "dead_fraction": float((since_fired >= dead_after).double().mean()),
                       "tokens_per_s": window_rows / max(time.perf_counter() - window_start, 1e-9)}
                history.append(row)
                bar.set_postfix(mse=f"{row['mse']:.3f}", l0=f"{row['l0']:.1f}", ev=f"{row['explained_variance']:.3f}")
                if callback is not None and dist_info.is_main and callback(dict(row)) is True:
                    stopped = step < config.steps
                window_rows, window_start = 0, time.perf_counter()
            bar.update(1)
            if stopped:
                break
            if config.save_every and step % config.save_every == 0 and step < config.steps:
                save_run(None)
                last_saved = step
    except KeyboardInterrupt:
        save_run(None)
        if dist_info.is_main:
            print(f"\ninterrupted: saved at step {step} in {out} (resume with resume=True)" if out else "\ninterrupted")
        raise
    finally:
        bar.close()

    final = _folded(sae, scales)
    metrics, density = reconstruction_metrics(final, eval_src, max_rows=config.eval_rows)
    metrics.update(held_out=held_out, steps=step, training_tokens=step * config.batch_size,
                   dead_fraction_training=float((since_fired >= dead_after).double().mean()))
    if model is not None and config.eval_sequences:
        metrics.update(ce_loss_recovered(model, final, _eval_tokens(eval_src, config.eval_sequences)))
    if getattr(final, "cross_layer", False):
        metrics.update(n_layers=final.n_layers)
    final.metrics = metrics
    final.feature_density = density
    save_run(metrics, density)
    distributed.barrier(dist_info)
    final.history = pd.DataFrame(history, columns=METRIC_COLUMNS)
    return final


# ---- one step, in named parts -------------------------------------------------------------------
def _losses(sae: AnyDictionary, x: torch.Tensor, y: torch.Tensor, config: SAETrainConfig, step: int,
            dead: torch.Tensor) -> dict:
    """Reconstruction, sparsity and AuxK terms of one batch (``x`` and ``y`` already scaled)."""
    pre = sae.pre_acts(x)
    acts = sae.train_encode(pre)
    recons = sae.train_decode(acts, x)
    mse = (recons - y).pow(2).sum(-1).mean()
    # Matryoshka: each inner level's reconstruction error joins the loss (SAELens adds them the same way)
    inner = sum(getattr(sae, "inner_losses", lambda *_: {})(acts, y).values(), mse.new_zeros(()))
    sparsity = sum(sae.sparsity_loss(acts, pre, config.sparsity_at(step)).values(), mse.new_zeros(()))
    aux = mse.new_zeros(())
    if config.aux_k:
        aux = config.aux_k_coefficient * aux_k_loss(sae, pre, y - recons, dead)
    return {"loss": mse + inner + sparsity + aux, "mse": mse, "sparsity_loss": sparsity, "aux_loss": aux, "acts": acts,
            "recons": recons, "rows": len(x)}


def _optimize(sae: AnyDictionary, optimizer, loss: torch.Tensor, dist_info) -> None:
    """Backward, average gradients over processes, keep decoder rows unit norm around the Adam step."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if dist_info.enabled:
        for p in sae.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist_info.world_size
    sae.remove_parallel_grads()
    optimizer.step()
    sae.normalize_decoder()


@torch.no_grad()
def _count_firing(sae: AnyDictionary, acts, since_fired: torch.Tensor, batch_size: int, dist_info) -> None:
    """Tokens since each feature last fired (any process), and BatchTopK's running threshold."""
    if isinstance(acts, SparseActs):
        fired = acts.fired(sae.cfg.d_sae).to(torch.float64)
    else:
        fired = (acts > 0).any(0).to(torch.float64)
    if dist_info.enabled:
        dist.all_reduce(fired, op=dist.ReduceOp.MAX)
    since_fired.add_(batch_size).mul_(1 - fired)
    sae.after_batch(acts)
    if dist_info.enabled and isinstance(getattr(sae, "threshold", None), torch.Tensor) \
            and not isinstance(sae.threshold, torch.nn.Parameter):
        dist.all_reduce(sae.threshold)
        sae.threshold /= dist_info.world_size


@torch.no_grad()
def _batch_stats(terms: dict, y: torch.Tensor) -> dict:
    acts, recons = terms["acts"], terms["recons"]
    active = acts.active() if isinstance(acts, SparseActs) else (acts > 0).sum()
    sst = (y - y.mean(0)).pow(2).sum().clamp_min(1e-12)
    return {"mse": float(terms["mse"]), "sparsity_loss": float(terms["sparsity_loss"]),
            "aux_loss": float(terms["aux_loss"]), "l0": float(active) / terms["rows"],
            "explained_variance": float(1 - (recons - y).pow(2).sum() / sst)}


# ---- pieces ----------------------------------------------------------------------------------
def clt_hooks(n_layers: int) -> list[str]:
    """The hooks a store for a CLT over ``n_layers`` layers holds: every MLP input, then every MLP output."""
    return [HOOK_IN.format(l=layer) for layer in range(n_layers)] + [HOOK_OUT.format(l=layer) for layer in range(n_layers)]


@dataclass(frozen=True)
class _Layout:
    """The hooks a dictionary reads (``ins``) and predicts (``outs``); a training row concatenates
    them in this order (one hook each, except a CLT's layers)."""

    ins: tuple
    outs: tuple

    @property
    def hooks(self) -> list[str]:
        return list(self.ins) + [h for h in self.outs if h not in self.ins]

    def rows(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        by_hook = dict(zip(self.hooks, batch if isinstance(batch, tuple) else (batch,)))
        return (torch.cat([by_hook[h] for h in self.ins], -1) if len(self.ins) > 1 else by_hook[self.ins[0]],
                torch.cat([by_hook[h] for h in self.outs], -1) if len(self.outs) > 1 else by_hook[self.outs[0]])

    @staticmethod
    def scale_rows(scale, hooks, source) -> Union[float, torch.Tensor]:
        """A float for one hook; for several (a CLT's layers), each hook's scale repeated over its columns."""
        if isinstance(scale, (int, float)):
            return float(scale)
        return torch.cat([torch.full((source.d(h),), float(s)) for h, s in zip(hooks, scale)])


def _layout(config: SAETrainConfig, source) -> _Layout:
    if config.kind == "clt":
        return _clt_layout(config, source)
    transcoder = config.kind in ("transcoder", "skip_transcoder")
    hook = config.hook or (source._single_hook() if not transcoder else "")
    if transcoder and not (config.hook and config.hook_out):
        raise ValueError(f"a {config.kind} needs hook= (the MLP input) and hook_out= (the MLP output); "
                         f"the source holds {list(source.manifest['hooks'])}")
    hooks = [hook, config.hook_out] if transcoder else [hook]
    for h in hooks:
        if h not in source.manifest["hooks"]:
            raise ValueError(f"the source has no hook {h!r}; it holds {list(source.manifest['hooks'])}")
    return _Layout((hooks[0],), (hooks[-1],))


def _clt_layout(config: SAETrainConfig, source) -> _Layout:
    """Every layer's MLP input and output, layers 0..L-1 with none missing."""
    held = set(source.manifest["hooks"])
    layers = {hook_layer(h) for h in held if h in (HOOK_IN.format(l=hook_layer(h)), HOOK_OUT.format(l=hook_layer(h)))}
    n_layers = len(layers)
    if not layers or set(clt_hooks(n_layers)) - held:
        raise ValueError(f"a CLT trains on every layer's MLP input and output ({HOOK_IN} and {HOOK_OUT} for layers "
                         f"0..L-1: collect hooks=clt_hooks(n_layers)); the source holds {sorted(held)}")
    if config.hook or config.hook_out:
        raise ValueError("a CLT reads every layer's MLP input and output: leave hook= and hook_out= empty")
    hooks = clt_hooks(n_layers)
    return _Layout(tuple(hooks[:n_layers]), tuple(hooks[n_layers:]))


def _dictionary_config(config: SAETrainConfig, layout: _Layout, source) -> DictionaryConfig:
    d_in, d_out = source.d(layout.ins[0]), source.d(layout.outs[0])
    model = dict(model_name=source.model_info.get("name", ""), model_fingerprint=source.model_info.get("fingerprint", ""))
    if config.kind == "clt":
        return clt_config(len(layout.ins), d_in, config.d_sae, d_out, activation=config.activation,
                          k=int(config.k) if config.activation == "topk" else 0, skip=config.skip, **model)
    transcoder = layout.outs != layout.ins
    return DictionaryConfig(kind=config.kind, d_in=d_in, d_sae=config.d_sae, d_out=d_out if transcoder else 0,
                            k=config.k if config.kind in AUX_K_KINDS or config.topk_transcoder else 0, hook_name=layout.ins[0],
                            hook_name_out=layout.outs[0] if transcoder else "",
                            hook_shape=tuple(source.hook_shape(layout.ins[0])),
                            extra=_extra(config) | _bos(source), **model)


def _bos(source) -> dict:
    """Whether the activations' text began with a BOS (the model's tokenizer's own choice), for SAE Lens'
    ``prepend_bos``; nothing when the source does not say (tensors handed in)."""
    flag = source.model_info.get("prepend_bos")
    return {} if flag is None else {"prepend_bos": bool(flag)}


def _extra(config: SAETrainConfig) -> dict:
    if config.kind != "matryoshka_batchtopk" or not config.matryoshka_widths:
        return {}
    return {"matryoshka_widths": [int(w) for w in config.matryoshka_widths.split(",") if w.strip()]}


def _check_out(out, resume: bool) -> Optional[Path]:
    if out is None:
        if resume:
            raise ValueError("resume=True needs out=, the run folder to continue")
        return None
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; choose another out=")
    # ours by its marks, not by a cfg.json: a SAELens download has one, and training over it replaced its files
    if out.is_dir() and any(out.iterdir()) and not (is_our_dictionary(out) or is_our_clt(out)):
        raise ValueError(f"{out} is a non-empty folder that is not a dictionary run the workbench wrote (no "
                         "sae_meta.json or clt.json of ours); choose a new or empty folder (nothing was written)")
    if resume and not (out / STATE_JSON_FILE).exists():
        raise ValueError(f"nothing to resume in {out}: it holds no {STATE_JSON_FILE}")
    return out


def _split(source) -> tuple[Any, Any, str]:
    """Training and evaluation parts: a store's last shard is held out when it has several."""
    if source.n_shards is not None:
        if source.n_shards >= 2:
            return source.subset(range(source.n_shards - 1)), source.subset([source.n_shards - 1]), "last shard"
        return source, source, "none (a single shard: metrics on training rows)"
    return source, source.heldout(), "validation split" if source.src.task is not None else "none"


@torch.no_grad()
def _scales_and_bias(sae, source, layout: _Layout, rows: int = 32768) -> tuple:
    """Scales that give mean norm sqrt(d) to inputs and targets, and b_dec at the scaled targets' mean.

    One float each for a single hook; one per layer (lists) for a CLT.
    """
    parts, n, shard = {h: [] for h in layout.hooks}, 0, 0
    while n < rows and (source.n_shards is None or shard < source.n_shards):
        data = source.load_shard(shard, layout.hooks)
        for h in layout.hooks:
            parts[h].append(data[h].float())
        n += len(data[layout.hooks[0]])
        shard += 1
    acts = {h: torch.cat(p)[:rows] for h, p in parts.items()}

    def scale(h: str) -> float:
        return math.sqrt(acts[h].shape[1]) / float(acts[h].norm(dim=1).mean().clamp_min(1e-12))

    s_in, s_out = [scale(h) for h in layout.ins], [scale(h) for h in layout.outs]
    y_mean = torch.cat([(acts[h] * s).mean(0) for h, s in zip(layout.outs, s_out)])
    sae.b_dec.copy_(y_mean.view_as(sae.b_dec).to(sae.b_dec.device))
    if len(layout.ins) == 1:
        return s_in[0], s_out[0]
    return s_in, s_out


def _folded(sae: AnyDictionary, scales) -> AnyDictionary:
    final = copy.deepcopy(sae)
    final.fold_scaling(*scales)
    final.eval()
    for p in final.parameters():
        p.requires_grad_(False)
    return final


def _eval_tokens(source, n: int) -> torch.Tensor:
    """Up to ``n`` held-out sequences from the source's shards (their token ids)."""
    parts, have, shard = [], 0, 0
    while have < n and (source.n_shards is None or shard < source.n_shards):
        ids = source.load_shard(shard, [], with_tokens=True)["token_ids"]
        parts.append(ids.long())
        have += len(ids)
        shard += 1
    return torch.cat(parts)[:n]


def _source_info(source) -> dict:
    manifest = source.manifest
    return {"path": str(getattr(source, "path", "")) or None, "model": manifest.get("model"),
            "source": manifest.get("source"), "rule": manifest.get("rule"), "tokens": manifest.get("tokens")}


def _load_state(out: Path) -> dict:
    try:
        info = json.loads((out / STATE_JSON_FILE).read_text())
        tensors = load_file(str(out / STATE_TENSORS_FILE))
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{out}: the training state is missing or corrupt ({e}); start a fresh run") from None
    return {"json": info, "tensors": tensors}


def _restore(sae: AnyDictionary, optimizer, since_fired, source, state: dict) -> None:
    tensors, info = state["tensors"], state["json"]
    with torch.no_grad():
        for name, p in list(sae.named_parameters()) + list(sae.named_buffers()):
            key = f"param.{name}" if f"param.{name}" in tensors else f"buffer.{name}"
            if key not in tensors or tensors[key].shape != p.shape:
                raise ValueError(f"the saved training state does not fit this dictionary ({name}); "
                                 "resume with the settings the run started with")
            p.copy_(tensors[key])
        since_fired.copy_(tensors["since_fired"])
    _restore_train_state(optimizer, state)
    if isinstance(source, LiveActivations):
        source.rows.update({int(i): r for i, r in info.get("live_rows", {}).items()})
