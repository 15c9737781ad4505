"""Build & train: pick every component with widgets, see its cost, train it, save it.

Parameter count (with the task's real vocabulary), FLOPs per token, KV-cache bytes and
the memory training needs come from ``workbench.accounting`` and update as the widgets
change; a model whose training would not fit in this machine's free memory is refused
before it starts. Training runs ``workbench.training.train`` in a background thread, so
the other pages stay usable: this page polls its progress (a bar and the loss curve)
and has a Cancel button (the callback asks ``train`` to stop after the current step).
The run is written to a temporary directory and copied into the checkpoints folder
only when saved under a new name (or when replacing is confirmed), after which it is in
every checkpoint picker.
"""

from __future__ import annotations

import math
import shutil
import threading
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st

import workbench as wb
from ui import common
from workbench import viz
from workbench.config import (AttentionChoice, ConfigError, FFNChoice, MoEExpertChoice, NormChoice,
                              PlacementChoice, PositionalChoice, QKNormChoice)
from workbench.data import describe_tasks, get_task
from workbench.accounting import training_memory_bytes
from workbench.training import TrainConfig, train
from workbench.utils import available_memory_bytes, check_path

TASKS = ("induction", "stories", "modular")  # "text" needs a file; use the command line for it
START = "attn-only-2l"
DEFAULT_STEPS = 1500
SIZES = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp", "n_ctx", "n_experts", "experts_per_token")
CHOICES = {"norm": NormChoice, "norm_placement": PlacementChoice, "positional": PositionalChoice, "ffn": FFNChoice,
           "qk_norm": QKNormChoice, "moe_expert": MoEExpertChoice, "attention": AttentionChoice}
# Multi-head latent attention's sizes, shown when attention = "mla" (q_lora_rank 0: no query compression).
MLA_WIDGETS = ("kv_lora_rank", "qk_rope_head_dim", "q_lora_rank")
FLAGS = ("attn_only", "parallel_residual", "tie_embeddings", "bias", "scale_embeddings")
# Gemma 2/3's options: empty is off (None), except global_every (0: every layer local)
GEMMA = {"attn_logit_softcap": float, "final_logit_softcap": float, "query_pre_attn_scalar": float,
         "sliding_window": int, "global_every": int, "rope_local_base": float}
# Widget keys kept while another page is shown (app.py re-sets them every run): a model being
# built, or one training in the background, keeps its settings when the user looks elsewhere.
PERSISTENT = ("bt_task", "bt_preset", *(f"bt_{n}" for n in (*SIZES, *CHOICES, *FLAGS, *MLA_WIDGETS, *GEMMA)),
              "bt_steps", "bt_batch", "bt_seq_len", "bt_lr", "bt_warmup", "bt_name", "bt_replace")
FFN_WIDGETS = ("d_mlp", "ffn", "moe_expert", "n_experts", "experts_per_token")  # unused by an attention-only model
MEMORY_SHARE = 0.5  # refuse a run whose estimated training memory exceeds this share of the free memory


def render() -> None:
    st.header("Build & train")
    job: Optional[TrainingJob] = st.session_state.get("bt_job")
    running = job is not None and job.running
    task_name = st.selectbox("Task", TASKS, key="bt_task", format_func=lambda t: f"{t}: {describe_tasks()[t]}",
                             disabled=running)
    task = _task(task_name)
    st.selectbox("Start from preset", wb.ModelConfig.presets(), key="bt_preset", on_change=_apply_preset,
                 index=wb.ModelConfig.presets().index(START), disabled=running)
    if "bt_d_model" not in st.session_state:
        _apply_preset()
    cfg = _config_widgets(task.vocab_size)
    if cfg is None:
        return
    config = _train_widgets(task_name, cfg)
    fits = _costs(cfg, config)
    if config is not None and fits:
        if st.button("Train", type="primary", key="bt_train", disabled=running):
            job = TrainingJob(config, cfg, task_name)
            st.session_state["bt_job"] = job
            job.start()
    _progress()
    _saving()


@st.cache_resource(show_spinner=False)
def _task(name: str):
    return get_task(name)


def _apply_preset() -> None:
    """Copy the chosen preset into the widgets (sizes kept small enough to train here)."""
    cfg = wb.ModelConfig.from_preset(st.session_state.get("bt_preset", START))
    for name in SIZES:
        st.session_state[f"bt_{name}"] = int(getattr(cfg, name))
    for name in CHOICES:
        st.session_state[f"bt_{name}"] = getattr(cfg, name)
    for name in FLAGS:
        st.session_state[f"bt_{name}"] = bool(getattr(cfg, name))
    for name in GEMMA:
        st.session_state[f"bt_{name}"] = getattr(cfg, name)


def _config_widgets(d_vocab: int):
    st.subheader("Architecture")
    attn_only = bool(st.session_state.get("bt_attn_only"))
    moe = st.session_state.get("bt_ffn") == "moe" and not attn_only
    mla = st.session_state.get("bt_attention") == "mla"
    cols = st.columns(4)
    sizes = {}
    for i, name in enumerate(SIZES):
        if name in ("n_experts", "experts_per_token") and not moe:
            continue
        sizes[name] = cols[i % 4].number_input(
            name, min_value=1, step=1, key=f"bt_{name}",
            disabled=(attn_only and name in FFN_WIDGETS) or (mla and name == "n_kv_heads"),
            help="Unused: the model is attention-only." if attn_only and name in FFN_WIDGETS
            else "Unused: MLA caches one latent per token, not KV heads." if mla and name == "n_kv_heads" else None)
    if mla:
        sizes.pop("n_kv_heads")
    cols = st.columns(len(CHOICES))
    choices = {}
    for col, (name, literal) in zip(cols, CHOICES.items()):
        if name == "moe_expert" and not moe:
            continue
        choices[name] = col.selectbox(name, typing.get_args(literal), key=f"bt_{name}",
                                      disabled=attn_only and name in FFN_WIDGETS)
    if mla:
        sizes.update(_mla_widgets(sizes))
    cols = st.columns(len(FLAGS))
    flags = {name: col.toggle(name, key=f"bt_{name}") for col, name in zip(cols, FLAGS)}
    with st.expander("Soft-capping, sliding window, local RoPE base (Gemma 2/3; empty = off)"):
        cols = st.columns(len(GEMMA))
        gemma = {name: col.number_input(name, min_value=kind(0), step=kind(1), key=f"bt_{name}")
                 for col, (name, kind) in zip(cols, GEMMA.items())}
    try:
        cfg = wb.ModelConfig(d_vocab=d_vocab, seed=0, **sizes, **choices, **flags, **gemma)
    except ValueError as e:
        st.warning(f"This combination is not a valid model: {_page_reason(e, sizes)}")
        return None
    st.caption(f"d_vocab = {d_vocab} (the task's vocabulary), d_head = {cfg.d_head}"
               + (" · attention-only: the FFN widgets are unused." if attn_only else "."))
    return cfg


def _page_reason(error: ValueError, sizes: dict) -> str:
    """The library's reason, in terms of this page's widgets: it has no d_head box, so a d_head the
    library cannot derive (``ConfigError.field``, not the message's wording: "set d_head explicitly"
    is meant for library users) becomes the n_heads that divide d_model."""
    if not (isinstance(error, ConfigError) and error.field == "d_head"):
        return str(error)
    d_model, n_heads = int(sizes["d_model"]), int(sizes["n_heads"])
    valid = [h for h in range(1, d_model + 1) if d_model % h == 0]
    return (f"d_model={d_model} is not divisible by n_heads={n_heads}: choose n_heads dividing d_model "
            f"({', '.join(map(str, valid))}), or another d_model.")


def _mla_widgets(sizes: dict) -> dict:
    """kv_lora_rank, qk_rope_head_dim and q_lora_rank, first set to MLA's defaults for this width."""
    d_head = max(1, int(sizes["d_model"]) // max(1, int(sizes["n_heads"])))
    defaults = dict(kv_lora_rank=4 * d_head, qk_rope_head_dim=max(2, d_head // 2 // 2 * 2), q_lora_rank=0)
    helps = dict(kv_lora_rank="Width of the cached KV latent (per token and layer, with the RoPE key).",
                 qk_rope_head_dim="Width of the RoPE key shared by every head (even).",
                 q_lora_rank="Width of the query latent; 0 projects queries from d_model directly.")
    out = {}
    for col, name in zip(st.columns(len(MLA_WIDGETS)), MLA_WIDGETS):
        st.session_state.setdefault(f"bt_{name}", defaults[name])
        value = int(col.number_input(name, min_value=0 if name == "q_lora_rank" else 1, step=1, key=f"bt_{name}",
                                     help=helps[name]))
        out[name] = value or None
    return out


def _train_widgets(task_name: str, cfg: wb.ModelConfig):
    st.subheader("Training")
    # Defaults through the session state (not value=): these keys outlive visits to other pages.
    # 1,500 steps: at 300 the default model's loss had barely left chance (4.17 -> 4.02 on induction).
    for key, default in (("bt_steps", DEFAULT_STEPS), ("bt_batch", 16), ("bt_seq_len", max(2, min(64, cfg.n_ctx))),
                         ("bt_lr", 1e-3), ("bt_warmup", 30)):
        st.session_state.setdefault(key, default)
    cols = st.columns(5)
    steps = cols[0].number_input("steps", min_value=1, step=50, key="bt_steps")
    batch = cols[1].number_input("batch size", min_value=1, step=8, key="bt_batch")
    seq_len = cols[2].number_input("sequence length", min_value=2, step=8, key="bt_seq_len")
    lr = cols[3].number_input("learning rate", min_value=1e-5, max_value=1.0, format="%.0e", key="bt_lr")
    warmup = cols[4].number_input("warmup steps", min_value=0, step=10, key="bt_warmup")
    st.caption(f"A loss at chance, ln {cfg.d_vocab} = {math.log(cfg.d_vocab):.2f} (the dashed line while it trains), "
               f"is a model that has learned nothing yet: the default {DEFAULT_STEPS:,} steps are about what the "
               "default model needs to leave it visibly (300 left the induction task's loss near chance, 4.17 -> 4.02).")
    try:
        return TrainConfig(task=task_name, steps=int(steps), batch_size=int(batch), seq_len=int(seq_len), lr=float(lr),
                           warmup_steps=int(warmup), eval_every=max(1, int(steps) // 5), log_every=1,
                           save_train_state=False)
    except ValueError as e:
        st.warning(str(e))
        return None


def _costs(cfg: wb.ModelConfig, config) -> bool:
    """Draw the costs; False (with the reason) when training would not fit in free memory."""
    st.subheader("Cost")
    counts = common.param_counts(cfg)
    cols = st.columns(5)
    cols[0].metric("Parameters", f"{counts['total']:,}", help=f"Counted with the task's vocabulary of {cfg.d_vocab} tokens.")
    cols[1].metric("Forward FLOPs / token", f"{wb.forward_flops_per_token(cfg):,}")
    cols[2].metric(f"KV cache at {cfg.n_ctx} tokens (bf16)", f"{wb.kv_cache_bytes(cfg):,} B",
                   help=f"{wb.kv_cache_bytes_per_token(cfg):,} B per token of context in the layers that keep every "
                        "token; a sliding-window layer holds at most its window")
    parts = pd.DataFrame([{"component": k, "parameters": v} for k, v in counts.items()
                          if k not in ("total", "non_embedding", "active")])
    with st.expander("Parameters by component"):
        common.table(parts)
    if config is None:
        return False
    tokens = config.steps * config.batch_size * (config.seq_len or cfg.n_ctx)
    cols[3].metric("Training FLOPs (6ND)", f"{wb.training_flops(cfg, tokens):.3g}")
    memory = training_memory_bytes(cfg, config.batch_size, config.seq_len or cfg.n_ctx)
    cols[4].metric("Training memory (fp32, AdamW)", _size(memory["total"]),
                   help="Weights, gradients and AdamW's moments (exact) plus activations (estimated).")
    free = free_memory_bytes()
    if free is not None and memory["total"] > MEMORY_SHARE * free:
        st.error(f"Too large to train here: training needs about {_size(memory['total'])} and this machine has "
                 f"{_size(free)} free (at most {MEMORY_SHARE:.0%} of it is used). Pick a smaller preset, or fewer "
                 "layers, a narrower d_model, a smaller batch or shorter sequences.")
        return False
    return True


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def free_memory_bytes() -> Optional[int]:
    """Memory the system reports free (MemAvailable); None where it does not say."""
    return available_memory_bytes("cpu")


@dataclass
class TrainingJob:
    """One training run in a background thread; the page polls it (``history``, ``step``)."""

    config: TrainConfig
    cfg: wb.ModelConfig
    task_name: str
    # Its run folder lives as long as the job: removed when the job is replaced or its session
    # ends (the object is garbage), or when the server stops.
    folder: common.TempFolder = field(default_factory=lambda: common.TempFolder("workbench-train-"))
    history: list = field(default_factory=list)
    last_val: Optional[float] = None
    tokens_per_s: float = 0.0
    status: str = "starting"  # running, done, cancelled, failed
    message: str = ""
    result: Optional[dict] = None
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)  # set when the thread is done

    @property
    def out(self) -> Path:
        return self.folder.path

    @property
    def running(self) -> bool:
        return self.status in ("starting", "running")

    @property
    def step(self) -> int:
        return self.history[-1]["step"] if self.history else 0

    def start(self) -> None:
        threading.Thread(target=self._run, name="workbench-training", daemon=True).start()

    def _on_step(self, row: dict) -> bool:
        """``train``'s callback: keep the row; True (stop after this step) once Cancel was pressed."""
        self.status = "running"
        self.history.append({"step": row["step"], "train_loss": row["train_loss"]})
        if row["val_loss"] is not None:
            self.last_val = row["val_loss"]
        self.tokens_per_s = row["tokens_per_s"]
        return self.cancel.is_set()

    def _run(self) -> None:
        try:
            self._train()
        finally:
            self.finished.set()

    def _train(self) -> None:
        try:
            result = train(self.config, self.cfg, self.out, task=get_task(self.task_name, seed=self.config.seed),
                           progress=False, callback=self._on_step)
        except Exception as e:  # the page shows it; the thread must not die silently
            self.status, self.message = "failed", f"{type(e).__name__}: {e}"
            return
        self.result = {"dir": str(self.out), "metrics": result.metrics, "name": self.cfg.name, "step": result.step}
        self.status = "cancelled" if result.stopped_early else "done"


def _progress() -> None:
    job: Optional[TrainingJob] = st.session_state.get("bt_job")
    if job is None:
        return
    if job.running:
        _live_progress()
    elif job.status == "failed":
        st.error(f"Training stopped: {job.message}")
    elif job.status == "cancelled":
        st.info(f"Cancelled at step {job.result['step']} of {job.config.steps}; the model as it was then can be "
                "saved below.")
    else:
        st.success(f"Done: {job.result['step']} steps.")


@st.fragment(run_every=1.0)
def _live_progress() -> None:
    """The running job's progress, redrawn every second while it runs (only this fragment
    reruns; the loss curve gains a point every step); when the run ends, the whole page reruns
    once and this fragment is gone. Cancel waits for the step that is running to end and reruns
    the page at once, rather than at the next tick."""
    job: TrainingJob = st.session_state["bt_job"]
    if not job.running:
        st.rerun()
    total = job.config.steps
    val = f", validation loss {job.last_val:.3f}" if job.last_val is not None else ""
    loss = f": loss {job.history[-1]['train_loss']:.3f}{val}, {job.tokens_per_s:,.0f} tokens/s" if job.history else "…"
    st.progress(job.step / total, text=f"training, step {job.step} / {total}{loss}")
    if job.history:
        common.show(viz.live_loss_figure(list(job.history), total, chance=math.log(job.cfg.d_vocab)),
                    key="bt_live_curve")
    if st.button("Cancel", key="bt_cancel", disabled=job.cancel.is_set()):
        job.cancel.set()
        job.finished.wait(timeout=10)  # the step, then the final evaluation and save
        st.rerun()
    if job.cancel.is_set():
        st.caption("Stopping after the current step…")


def _saving() -> None:
    job: Optional[TrainingJob] = st.session_state.get("bt_job")
    trained = job.result if job is not None and not job.running else None
    if not trained or not Path(trained["dir"]).is_dir():
        return
    st.subheader("The trained model")
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in trained["metrics"].items()}
    common.table(pd.DataFrame({"metric": list(shown), "value": [str(v) for v in shown.values()]}))
    common.show(viz.loss_curves(trained["dir"], title="Loss during training"), key="bt_curve")
    root = common.checkpoints_root()
    cols = st.columns([3, 2, 1])
    st.session_state.setdefault("bt_name", f"my-{st.session_state['bt_task']}-model")
    name = cols[0].text_input("Save as", key="bt_name").strip()
    replace = cols[1].checkbox("Replace if it exists", key="bt_replace")
    if cols[2].button("Save", key="bt_save"):
        try:
            path = save_trained(Path(trained["dir"]), root, name, replace)
        except ValueError as e:
            st.warning(str(e))
            return
        st.success(f"Saved to `{path}`: it is now in every checkpoint picker.")


def save_trained(source: Path, root: Path, name: str, replace: bool = False) -> Path:
    """Copy a trained checkpoint directory into the checkpoints folder as ``name``."""
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise ValueError(f"{name!r} is not a usable checkpoint name: use letters, digits, '-' and '_'.")
    check_path(name, "checkpoint name")  # over 255 bytes: a message, not OSError [Errno 36]
    target = root / name
    from workbench.checkpoint import CheckpointError, atomic_write_dir

    def write(tmp: Path) -> None:
        for f in source.iterdir():
            shutil.copy2(f, tmp / f.name)

    try:  # the existence test runs under the write's lock: two sessions saving one new name cannot both win
        return atomic_write_dir(target, write, replace=replace)
    except CheckpointError:
        if not replace and target.exists():
            raise ValueError(f"A checkpoint named {name!r} already exists in {root}: pick another name, "
                             "or tick 'Replace if it exists'.") from None
        raise
