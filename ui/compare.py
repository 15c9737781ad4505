"""Compare: two checkpoints side by side on the same prompt.

The config diff (the swapped components highlighted), both loss curves on one plot (one
colour per model, everywhere on the page), the answer metrics of both at the last position,
per-token loss, head-score heatmaps, attention grids and the lens of each. When B's
tokenizer cannot read A's prompt, the page says so and gives B a prompt of its own.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ui import common
from workbench import viz
from workbench.analysis import answer_table, attention_patterns, head_scores, suggest_answer, token_losses

# Fields that pick a component (the rest are sizes and numbers).
COMPONENTS = ("norm", "norm_placement", "positional", "ffn", "attn_only", "parallel_residual", "tie_embeddings",
              "bias", "qkv_bias", "n_kv_heads", "moe_expert")
# The tabs' choice, kept while another page is shown (see app.py).
PERSISTENT = ("compare_tab",)


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
        common.show(viz.loss_curves(runs, title="Training loss (solid) and validation loss (dashed)",
                                    colours={a.name: viz.PAIR[0], b.name: viz.PAIR[1]}), key="compare_curves")

    text = common.prompt_box(a, label=f"Prompt (for {a.name}, and for {b.name} when it can read it)")
    ids_a = common.prompt_ids(a, text)
    if ids_a is None:
        return
    ids_b = _prompt_for_b(b, text, text == common.default_prompt(a))
    if ids_b is None:
        return
    _answers(a, b, ids_a, ids_b)
    with st.spinner(f"Running the prompt on {a.name} and on {b.name}: per-token losses…"):
        loss_a = common.analysis(token_losses, a.key, ids_a)
        loss_b = common.analysis(token_losses, b.key, ids_b)
    colours = {a.name: viz.PAIR[0], b.name: viz.PAIR[1]}
    c1, c2 = st.columns(2)
    c1.metric(f"Mean loss, {a.name}", f"{loss_a['loss'].mean():.3f} nats")
    # B minus A only when both read the same token ids: across two prompts (or two vocabularies) the
    # difference of the losses measures the prompts as much as the models.
    same = ids_a == ids_b
    c2.metric(f"Mean loss, {b.name}", f"{loss_b['loss'].mean():.3f} nats",
              delta=f"{loss_b['loss'].mean() - loss_a['loss'].mean():+.3f} nats" if same else None,
              delta_color="inverse")
    if not same:
        st.caption(f"No difference of the losses is shown: {a.name} and {b.name} read different token ids, "
                   "so each loss is of its own prompt.")
    st.subheader("Per-token loss")
    if same:
        common.show(viz.token_loss_figure({a.name: loss_a, b.name: loss_b}, colours=colours), key="compare_loss")
    else:
        st.caption("The two models read different prompts (or split them differently), so each gets its own plot.")
        for side, c, losses in (("a", a, loss_a), ("b", b, loss_b)):
            common.show(viz.token_loss_figure({c.name: losses}, title=f"Per-token loss, {c.name}", colours=colours),
                        key=f"compare_loss_{side}")

    tabs = st.tabs(["Head scores", "Attention grids", "Lens"], key="compare_tab", on_change="rerun")
    if tabs[0].open:
        with tabs[0]:
            st.caption("Head scores on repeated random tokens (where induction and duplicate-token heads show).")
            # Keys name the side, not the checkpoint: A and B can be the same checkpoint.
            for side, c in (("a", a), ("b", b)):
                with st.spinner(f"Scoring every head of {c.name} on repeated random tokens…"):
                    scores = common.analysis(head_scores, c.key, None)
                fig = viz.head_scores_figure(scores)
                fig.update_layout(title=f"Head scores of {c.name}")
                common.show(fig, key=f"compare_scores_{side}")
    if tabs[1].open:
        with tabs[1]:
            for side, c, ids in (("a", a, ids_a), ("b", b, ids_b)):
                with st.spinner(f"Every head's attention pattern on {c.name}…"):
                    patterns = common.analysis(attention_patterns, c.key, ids)
                fig = viz.attention_grid(patterns)
                fig.update_layout(title=f"Every head of {c.name}")
                common.show(fig, key=f"compare_grid_{side}")
    if tabs[2].open:
        with tabs[2]:
            for side, c, ids in (("a", a, ids_a), ("b", b, ids_b)):
                which = common.lens_picker(c, key=f"compare_lens_kind_{side}_{c.name}")
                fig = viz.logit_lens_figure(common.lens_table(c, ids, which))
                fig.update_layout(title=f"{which.capitalize()} lens of {c.name}")
                common.show(fig, key=f"compare_lens_{side}")


def _prompt_for_b(b: common.Checkpoint, text: str, a_default: bool = False):
    """B's token ids of the shared prompt, or of a prompt of its own when its tokenizer cannot read it
    (A's default prompt that B cannot read is no mistake of the user's: B's own default, and a caption)."""
    try:
        return tuple(common.encode_prompt(b, text))
    except ValueError as e:
        if a_default:
            st.caption(f"**{b.name}** cannot read A's default prompt (its context is {b.cfg.n_ctx} tokens, its "
                       f"vocabulary {b.cfg.d_vocab}), so it reads a default prompt of its own below.")
        else:
            st.warning(f"**{b.name}** cannot read this prompt: {e} Give it a prompt of its own below.")
    other = common.prompt_box(b, key="prompt_b", label=f"Prompt for {b.name}")
    return common.prompt_ids(b, other)


def _answers(a: common.Checkpoint, b: common.Checkpoint, ids_a, ids_b) -> None:
    """The answer metrics of both models at their last position, for one answer typed as text."""
    st.subheader("The answer at the last position")
    suggestion = common.analysis(suggest_answer, a.key, ids_a, meta=a.meta)
    common.follow_default("compare_answer", suggestion["answer_str"], ids_a)
    common.follow_default("compare_wrong", suggestion["wrong_str"], ids_a)
    left, right = st.columns(2)
    answer = left.text_input("Answer token", key="compare_answer", persist_state="session",
                             help=f"Default: {suggestion['source']} ({a.name}).")
    wrong = right.text_input("Wrong token (optional)", key="compare_wrong", persist_state="session")
    rows = []
    for c, ids in ((a, ids_a), (b, ids_b)):
        try:
            answer_id = common.token_id(c, answer, f"{c.name} cannot score the answer")
            wrong_id = common.token_id(c, wrong, f"{c.name} cannot score the wrong token") if wrong.strip() else None
        except ValueError as e:
            st.warning(str(e))
            continue
        table = common.analysis(answer_table, c.key, ids, answer=answer_id, wrong=wrong_id, pos=-1)
        rows.append(table.assign(model=c.name))
    if rows:
        both = pd.concat(rows, ignore_index=True)
        columns = ["model", "answer", "wrong", "logit_diff", "prob", "rank", "top", "top_prob"]
        common.table(both[[c for c in columns if c in both]].round(4))


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
