"""Build & train: pick every component with widgets, see its cost, train it, save it.

Parameter count, FLOPs per token and KV-cache bytes come from ``workbench.accounting``
and update as the widgets change. Training runs ``workbench.training.train`` on a
built-in task with a live progress bar and loss curve; the run is written to a temporary
directory and copied into the checkpoints folder only when saved under a new name (or
when replacing is confirmed), after which it is in every checkpoint picker.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import typing
from pathlib import Path

import pandas as pd
import streamlit as st

import workbench as wb
from ui import common
from workbench import viz
from workbench.config import FFNChoice, MoEExpertChoice, NormChoice, PlacementChoice, PositionalChoice
from workbench.data import describe_tasks, get_task
from workbench.training import TrainConfig, train

TASKS = ("induction", "stories", "modular")  # "text" needs a file; use the command line for it
START = "attn-only-2l"
SIZES = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp", "n_ctx", "n_experts", "experts_per_token")
CHOICES = {"norm": NormChoice, "norm_placement": PlacementChoice, "positional": PositionalChoice, "ffn": FFNChoice,
           "moe_expert": MoEExpertChoice}
FLAGS = ("attn_only", "parallel_residual", "tie_embeddings", "bias")


def render() -> None:
    st.header("Build & train")
    task_name = st.selectbox("Task", TASKS, key="bt_task", format_func=lambda t: f"{t}: {describe_tasks()[t]}")
    task = _task(task_name)
    st.selectbox("Start from preset", wb.ModelConfig.presets(), key="bt_preset", on_change=_apply_preset,
                 index=wb.ModelConfig.presets().index(START))
    if "bt_d_model" not in st.session_state:
        _apply_preset()
    cfg = _config_widgets(task.vocab_size)
    if cfg is None:
        return
    config = _train_widgets(task_name, cfg)
    _costs(cfg, config)
    if config is None:
        return
    if st.button("Train", type="primary", key="bt_train"):
        _train(config, cfg, task_name)
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


def _config_widgets(d_vocab: int):
    st.subheader("Architecture")
    cols = st.columns(4)
    sizes = {}
    for i, name in enumerate(SIZES):
        if name in ("n_experts", "experts_per_token") and st.session_state.get("bt_ffn") != "moe":
            continue
        sizes[name] = cols[i % 4].number_input(name, min_value=1, step=1, key=f"bt_{name}")
    cols = st.columns(len(CHOICES))
    choices = {}
    for col, (name, literal) in zip(cols, CHOICES.items()):
        if name == "moe_expert" and st.session_state.get("bt_ffn") != "moe":
            continue
        choices[name] = col.selectbox(name, typing.get_args(literal), key=f"bt_{name}")
    cols = st.columns(len(FLAGS))
    flags = {name: col.toggle(name, key=f"bt_{name}") for col, name in zip(cols, FLAGS)}
    try:
        cfg = wb.ModelConfig(d_vocab=d_vocab, seed=0, **sizes, **choices, **flags)
    except ValueError as e:
        st.warning(f"This combination is not a valid model: {e}")
        return None
    st.caption(f"d_vocab = {d_vocab} (the task's vocabulary), d_head = {cfg.d_head}.")
    return cfg


def _train_widgets(task_name: str, cfg: wb.ModelConfig):
    st.subheader("Training")
    cols = st.columns(5)
    steps = cols[0].number_input("steps", min_value=1, value=300, step=50, key="bt_steps")
    batch = cols[1].number_input("batch size", min_value=1, value=16, step=8, key="bt_batch")
    seq_len = cols[2].number_input("sequence length", min_value=2, value=min(64, cfg.n_ctx), step=8, key="bt_seq_len")
    lr = cols[3].number_input("learning rate", min_value=1e-5, max_value=1.0, value=1e-3, format="%.0e", key="bt_lr")
    warmup = cols[4].number_input("warmup steps", min_value=0, value=30, step=10, key="bt_warmup")
    try:
        return TrainConfig(task=task_name, steps=int(steps), batch_size=int(batch), seq_len=int(seq_len), lr=float(lr),
                           warmup_steps=int(warmup), eval_every=max(1, int(steps) // 5), log_every=max(1, int(steps) // 50),
                           save_train_state=False)
    except ValueError as e:
        st.warning(str(e))
        return None


def _costs(cfg: wb.ModelConfig, config) -> None:
    st.subheader("Cost")
    counts = wb.count_params(cfg)
    cols = st.columns(4)
    cols[0].metric("Parameters", f"{counts['total']:,}")
    cols[1].metric("Forward FLOPs / token", f"{wb.forward_flops_per_token(cfg):,}")
    cols[2].metric("KV cache / token (bf16)", f"{wb.kv_cache_bytes_per_token(cfg):,} B")
    if config is not None:
        tokens = config.steps * config.batch_size * (config.seq_len or cfg.n_ctx)
        cols[3].metric("Training FLOPs (6ND)", f"{wb.training_flops(cfg, tokens):.3g}")
    parts = pd.DataFrame([{"component": k, "parameters": v} for k, v in counts.items()
                          if k not in ("total", "non_embedding", "active")])
    with st.expander("Parameters by component"):
        common.table(parts)


def _train(config: TrainConfig, cfg: wb.ModelConfig, task_name: str) -> None:
    bar = st.progress(0.0, text="starting…")
    chart = st.empty()
    history: list[dict] = []
    last_draw, last_val = [0.0], [""]

    def on_step(row: dict) -> None:
        """``train``'s callback: one logged row (step, train_loss, val_loss or None, lr, tokens_per_s)."""
        history.append({"step": row["step"], "train_loss": row["train_loss"]})
        if row["val_loss"] is not None:  # evaluated only every few logged steps: a line of its own would be gaps
            last_val[0] = f", validation loss {row['val_loss']:.3f}"
        now = time.perf_counter()
        if now - last_draw[0] > 0.5 or row["step"] == config.steps:
            last_draw[0] = now
            bar.progress(row["step"] / config.steps,
                         text=f"step {row['step']} / {config.steps}: loss {row['train_loss']:.3f}{last_val[0]}, "
                              f"{row['tokens_per_s']:,.0f} tokens/s")
            chart.line_chart(pd.DataFrame(history).set_index("step"), height=260)

    out = Path(tempfile.mkdtemp(prefix="workbench-train-"))
    try:
        result = train(config, cfg, out, task=get_task(task_name, seed=config.seed), progress=False, callback=on_step)
    except (ValueError, RuntimeError) as e:
        bar.empty()
        st.error(f"Training stopped: {e}")
        return
    bar.progress(1.0, text=f"done: {result.step} steps")
    st.session_state["bt_trained"] = {"dir": str(out), "metrics": result.metrics, "name": cfg.name}


def _saving() -> None:
    trained = st.session_state.get("bt_trained")
    if not trained or not Path(trained["dir"]).is_dir():
        return
    st.subheader("The trained model")
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in trained["metrics"].items()}
    common.table(pd.DataFrame({"metric": list(shown), "value": [str(v) for v in shown.values()]}))
    common.show(viz.loss_curves(trained["dir"], title="Loss during training"), key="bt_curve")
    root = common.checkpoints_root()
    cols = st.columns([3, 2, 1])
    name = cols[0].text_input("Save as", value=f"my-{st.session_state['bt_task']}-model", key="bt_name").strip()
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
    target = root / name
    if target.exists() and not replace:
        raise ValueError(f"A checkpoint named {name!r} already exists in {root}: pick another name, "
                         "or tick 'Replace if it exists'.")
    from workbench.checkpoint import atomic_write_dir

    def write(tmp: Path) -> None:
        for f in source.iterdir():
            shutil.copy2(f, tmp / f.name)

    return atomic_write_dir(target, write)
