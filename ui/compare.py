"""Compare: two checkpoints side by side on the same prompt.

The config diff (the swapped components highlighted), both loss curves on one plot,
per-token loss, head-score tables, attention grids and the logit lens of each.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ui import common
from workbench import viz
from workbench.analysis import attention_patterns, head_scores, logit_lens, token_losses

# Fields that pick a component (the rest are sizes and numbers).
COMPONENTS = ("norm", "norm_placement", "positional", "ffn", "attn_only", "parallel_residual", "tie_embeddings",
              "bias", "qkv_bias", "n_kv_heads", "moe_expert")


def render() -> None:
    st.header("Compare")
    names = list(common.all_checkpoints())
    first = st.session_state.get("ckpt") or common.default_checkpoint(names)
    # By default B is another model of the same family (the two shipped story models), else any other.
    second = next((n for n in names if n != first and n.split("-")[0] == str(first).split("-")[0]),
                  next((n for n in names if n != first), first))
    left, right = st.columns(2)
    with left:
        a = common.checkpoint_picker("Checkpoint A", key="ckpt", where=st)
    with right:
        b = common.checkpoint_picker("Checkpoint B", key="ckpt_b", where=st, default=second)
    if a is None or b is None:
        return
    st.subheader("Config")
    diff = config_diff(a, b)
    st.caption(f"{int(diff['differs'].sum())} fields differ; highlighted: swapped components "
               f"({int((diff['component'] & diff['differs']).sum())}), other differences in a lighter shade.")
    st.dataframe(_styled(diff), hide_index=True, height=min(600, 36 * (len(diff) + 1)))

    metrics = {c.name: m for c in (a, b) if (m := common.training_curve(c.path)) is not None}
    if metrics:
        st.subheader("Training curves")
        runs = pd.concat([m.assign(run=name) for name, m in metrics.items()], ignore_index=True)
        common.show(viz.loss_curves(runs, title="Training loss (solid) and validation loss (dashed)"),
                    key="compare_curves")

    text = common.prompt_box(a)
    ids_a = common.prompt_ids(a, text)
    ids_b = common.prompt_ids(b, text) if ids_a is not None else None
    if ids_a is None or ids_b is None:
        return
    loss_a = common.analysis(token_losses, a.key, ids_a)
    loss_b = common.analysis(token_losses, b.key, ids_b)
    c1, c2 = st.columns(2)
    c1.metric(f"Mean loss, {a.name}", f"{loss_a['loss'].mean():.3f}")
    c2.metric(f"Mean loss, {b.name}", f"{loss_b['loss'].mean():.3f}",
              delta=f"{loss_b['loss'].mean() - loss_a['loss'].mean():+.3f}", delta_color="inverse")
    st.subheader("Per-token loss")
    if ids_a == ids_b:
        common.show(viz.token_loss_figure({a.name: loss_a, b.name: loss_b}), key="compare_loss")
    else:
        st.caption("The two tokenizers split the prompt differently, so each model gets its own plot.")
        for c, losses in ((a, loss_a), (b, loss_b)):
            common.show(viz.token_loss_figure(losses, title=f"Per-token loss, {c.name}"), key=f"compare_loss_{c.name}")

    tabs = st.tabs(["Head scores", "Attention grids", "Logit lens"], key="compare_tab", on_change="rerun")
    if tabs[0].open:
        with tabs[0]:
            st.caption("Head scores on repeated random tokens (where induction and duplicate-token heads show).")
            for col, c in zip(st.columns(2), (a, b)):
                with col:
                    st.markdown(f"**{c.name}**")
                    common.table(common.analysis(head_scores, c.key, None, wide=True).round(3))
    if tabs[1].open:
        with tabs[1]:
            for c, ids in ((a, ids_a), (b, ids_b)):
                fig = viz.attention_grid(common.analysis(attention_patterns, c.key, ids))
                fig.update_layout(title=f"Every head of {c.name}")
                common.show(fig, key=f"compare_grid_{c.name}")
    if tabs[2].open:
        with tabs[2]:
            figs = [viz.logit_lens_figure(common.analysis(logit_lens, c.key, ids, k=3)) for c, ids in ((a, ids_a), (b, ids_b))]
            fig = viz.side_by_side(*figs, titles=(a.name, b.name))
            fig.update_layout(height=max(320, 50 * (max(a.cfg.n_layers, b.cfg.n_layers) + 1) + 200))
            common.show(fig, key="compare_lens")


def config_diff(a: common.Checkpoint, b: common.Checkpoint) -> pd.DataFrame:
    """One row per config field: both values, whether they differ, whether it picks a component."""
    da, db = a.cfg.to_dict(), b.cfg.to_dict()
    rows = [{"field": f, a.name: str(da[f]), b.name if b.name != a.name else f"{b.name} (B)": str(db[f]),
             "differs": da[f] != db[f], "component": f in COMPONENTS} for f in da]
    frame = pd.DataFrame(rows)
    return frame.sort_values(["differs", "component"], ascending=False, kind="stable").reset_index(drop=True)


def _styled(diff: pd.DataFrame):
    def colour(row):
        if row["differs"] and row["component"]:
            return ["background-color: rgba(255, 165, 0, 0.45); font-weight: bold"] * len(row)
        if row["differs"]:
            return ["background-color: rgba(255, 165, 0, 0.15)"] * len(row)
        return [""] * len(row)

    return diff.style.apply(colour, axis=1)
