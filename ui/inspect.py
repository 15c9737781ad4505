"""Inspect: one checkpoint, one prompt (or several, one per line), everything inside it.

With several prompts a selector picks the one the per-prompt figures show, and a section
over all of them shows what the library aggregates (each prompt's loss, the logit lens per
layer and the head scores over every real token; prompts of different lengths run as one
padded batch). Tokens with their per-token loss; the attention pattern of a chosen head (and the prompt's
tokens: hover one for its top predictions and that head's attention from and to it) and a
grid of every head; the logit lens; direct logit attribution for a target token (or a logit
difference between two); the logit or tuned lens; residual-stream norms per layer; and the model card.
"""

from __future__ import annotations

import streamlit as st

from ui import common
from workbench import viz
from workbench.analysis import (
    attention_patterns,
    direct_logit_attribution,
    head_scores,
    logit_lens,
    loss_summary,
    residual_norms,
    token_losses,
)

# The tabs' choice, kept while another page is shown (see app.py); the widgets keep theirs
# with persist_state="session" (a tab is a container and has no such option).
PERSISTENT = ("attn_tab",)
LENS_VALUES = {
    "probability of the next token": "target_prob",
    "probability of the top token": "prob",
    "rank of the next token": "rank",
    "KL to the final distribution (nats)": "kl",
}


WIDE_HEADS = 64  # above this many heads the attention section is drawn across the whole page


def render() -> None:
    ckpt = common.page_checkpoint("Inspect")
    if ckpt is None:
        return
    st.caption(f"**{ckpt.name}** · `{ckpt.path}`")
    text = common.prompt_box(ckpt)
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        ids = _several(ckpt, lines)
    else:
        st.caption("One prompt per line to inspect several: each is computed as it is alone.")
        ids = common.prompt_ids(ckpt, text)
    if ids is not None:
        # The loss, the attention, the norms, the lens, the suggested answer and the attribution of
        # this prompt: one forward for all that miss the cache (six forwards each were most of the
        # first page on SmolLM2-135M).
        # Streamlit shows the spinner only when the block takes over half a second: the cached runs stay quiet
        with st.spinner(f"Running {ckpt.name} on the prompt ({len(ids)} tokens, {ckpt.cfg.n_layers} layers) "
                        "and drawing what it computes…"), common.one_forward(ckpt.key, ids):
            _tokens_and_loss(ckpt, ids)
            if ckpt.cfg.n_heads * ckpt.cfg.n_layers > WIDE_HEADS:
                # Many heads: half the page left SmolLM2's 9-head score panels 65 px wide, their head labels
                # on top of each other; the section takes the page's width, the norms go under it.
                _attention(ckpt, ids)
                _residual_norms(ckpt, ids)
            else:
                left, right = st.columns(2)
                with left:
                    _attention(ckpt, ids)
                with right:
                    _residual_norms(ckpt, ids)
            _lens(ckpt, ids)  # full width: every cell carries the lens' top token
            _attribution(ckpt, ids)
    st.subheader("Model card")
    common.model_card(ckpt)


def precompute(ckpt: common.Checkpoint, ids: tuple[int, ...]) -> None:
    """Every analysis the page's first run on prompt ``ids`` asks for, with its widgets at their
    defaults, into the same cache entries (one forward in all): ``ui.serve`` calls it for the default
    prompt before the first session arrives, which then only draws. The calls are the page's own
    (``_losses``, ``_patterns``, ...); a test runs the page after this and counts no forward."""
    with common.one_forward(ckpt.key, ids):
        _losses(ckpt, ids)
        _patterns(ckpt, ids)
        common.lens_table(ckpt, ids, "logit")  # the token row's hover and the Lens section's default
        _norms(ckpt, ids)
        if ckpt.cfg.norm_placement == "pre":
            target = common.default_target(ckpt, ids)
            if target is not None:
                _dla(ckpt, ids, target)


def _losses(ckpt: common.Checkpoint, ids):
    return common.analysis(token_losses, ckpt.key, ids)


def _patterns(ckpt: common.Checkpoint, ids):
    return common.analysis(attention_patterns, ckpt.key, ids)


def _norms(ckpt: common.Checkpoint, ids):
    return common.analysis(residual_norms, ckpt.key, ids)


def _dla(ckpt: common.Checkpoint, ids, target: common.Target):
    return common.analysis(direct_logit_attribution, ckpt.key, ids, answer=target.answer, wrong=target.wrong,
                           pos=target.pos)


def _several(ckpt: common.Checkpoint, lines: list[str]):
    """Several prompts: each line's ids (a message naming the line when one cannot be read), the
    section over all of them, and the selector for the per-prompt figures; the chosen prompt's
    ids, or None."""
    prompts = []
    for number, line in enumerate(lines, start=1):
        try:
            prompts.append(tuple(common.encode_prompt(ckpt, line)))
        except ValueError as e:
            st.warning(f"Line {number}: {e}")
            return None
    if st.session_state.get("inspect_prompt", 0) >= len(prompts):  # fewer lines than before
        st.session_state["inspect_prompt"] = 0
    _over_all(ckpt, lines, prompts)
    chosen = st.selectbox("Prompt shown below", range(len(prompts)), key="inspect_prompt", persist_state="session",
                          format_func=lambda i: f"{i}: {lines[i]}",
                          help="The per-prompt figures below show this prompt.")
    return prompts[chosen]


def _over_all(ckpt: common.Checkpoint, lines: list[str], prompts: list[tuple[int, ...]]) -> None:
    st.subheader(f"Over all {len(prompts)} prompts")
    data = common.TokenRows(tuple(prompts))
    summary = loss_summary(common.analysis(token_losses, ckpt.key, None, data=data))
    summary.insert(1, "text", lines)
    common.table(summary)
    left, right = st.columns(2)
    with left:
        lens = common.analysis(logit_lens, ckpt.key, None, data=data, aggregate=True)
        fig, _ = viz.table_chart(lens, x="layer_label", y="top1_accuracy", kind="line")
        fig.update_layout(title="Top-1 accuracy of the lens per layer, over every prompt's tokens",
                          xaxis_title="layer", yaxis_title="fraction of next tokens that are the lens' top token")
        common.show(fig, key="inspect_lens_all")
    with right:
        scores = common.analysis(head_scores, ckpt.key, None, data=data)
        st.caption(layout_caption(scores.attrs["layout"]))
        common.show(viz.head_scores_figure(scores), key="inspect_head_scores_all")


def _tokens_and_loss(ckpt: common.Checkpoint, ids) -> None:
    losses = _losses(ckpt, ids)
    st.subheader("Tokens and per-token loss")
    c1, c2, c3 = st.columns(3)
    c1.metric("Prompt length", f"{len(ids)} tokens")
    c2.metric("Mean loss", f"{losses['loss'].mean():.3f} nats")
    c3.metric("Top-1 accuracy", f"{losses['correct'].mean():.0%}")
    common.show(viz.token_loss_figure(losses), key="inspect_loss")


@st.fragment
def _attention(ckpt: common.Checkpoint, ids) -> None:
    """A fragment: choosing a layer, a head or a tab redraws this section alone."""
    st.subheader("Attention")
    # Lazy tabs: the grid of every head (one heatmap per head) is drawn only when opened.
    one, every, scores = st.tabs(["One head", "Every head", "Head scores"], key="attn_tab", on_change="rerun")
    patterns = _patterns(ckpt, ids)
    if one.open:
        with one:
            a, b = st.columns(2)
            layer = a.selectbox("Layer", range(ckpt.cfg.n_layers), key="attn_layer", persist_state="session")
            head = b.selectbox("Head", range(ckpt.cfg.n_heads), key="attn_head", persist_state="session")
            # Half the page wide: every token's label would pile onto its neighbours (all are in the hover).
            common.show(viz.thin_ticks(viz.attention_figure(patterns, layer, head)), key="inspect_attention")
            lens = common.lens_table(ckpt, ids, "logit")
            common.show(viz.token_hover_figure(lens, patterns, layer, head), key="inspect_tokens")
    if every.open:
        with every:
            common.show(viz.attention_grid(patterns), key="inspect_grid")
    if scores.open:
        with scores:
            _head_scores(ckpt, ids)


def _lens(ckpt: common.Checkpoint, ids) -> None:
    st.subheader("Lens")
    a, b = st.columns([2, 3])
    with a:
        which = common.lens_picker(ckpt, key="lens_kind")
    shown = b.selectbox("Colour", list(LENS_VALUES), key="lens_value", persist_state="session", width=320)
    lens = common.lens_table(ckpt, ids, which)
    common.show(viz.logit_lens_figure(lens, color=LENS_VALUES[shown]), key="inspect_lens")


def _head_scores(ckpt: common.Checkpoint, ids) -> None:
    scores = common.analysis(head_scores, ckpt.key, ids)
    st.caption(layout_caption(scores.attrs["layout"]))
    common.show(viz.head_scores_figure(scores), key="inspect_head_scores")


def layout_caption(layout: dict) -> str:
    """What the head scores were measured on, from the layout ``head_scores`` reports it used."""
    rows = f"{layout['batch']} sequence{'s' if layout['batch'] != 1 else ''}"
    if layout["source"] == "repeated_random_tokens":
        where = (f"repeated random tokens: {rows} of {layout['seq_len']} random tokens shown twice "
                 f"({layout['n_pos']} tokens, seed {layout['seed']})")
    elif layout["batch"] > 1:
        where = f"these {layout['batch']} prompts (up to {layout['n_pos']} tokens each)"
    else:
        where = f"this prompt: {rows} of {layout['n_pos']} tokens"
    repeats = (f"{layout['repeats']} position(s) repeat an earlier token, and only those count for the "
               "duplicate-token and induction scores" if layout["repeats"] else
               "no position repeats an earlier token, so the duplicate-token and induction scores are 0")
    return (f"Head scores on {where}; {repeats}. A score belongs to this layout: on another input the "
            "highest-scoring head can change.")


def _attribution(ckpt: common.Checkpoint, ids) -> None:
    st.subheader("Direct logit attribution")
    if ckpt.cfg.norm_placement != "pre":
        st.info(f"Direct logit attribution needs a pre-norm model; this one is {ckpt.cfg.norm_placement}-norm.")
        return
    target = common.target_picker(ckpt, ids, key="dla", kinds=False)
    if target is None:
        return
    granularity = st.radio("Split", ["head", "layer"], horizontal=True, key="dla_granularity", persist_state="session")
    df = _dla(ckpt, ids, target)
    fig = viz.dla_figure(df, granularity=granularity)
    what = f"logit[{target.answer_str!r}]" + (f" − logit[{target.wrong_str!r}]" if target.wrong is not None else "")
    fig.update_layout(title=f"{what} at position {target.pos} = {df['total'].iloc[0]:.3f}: direct attribution")
    common.show(fig, key="inspect_dla")


def _residual_norms(ckpt: common.Checkpoint, ids) -> None:
    st.subheader("Residual-stream norm per layer")
    norms = _norms(ckpt, ids)
    common.show(viz.residual_norms_figure(norms), key="inspect_norms")
