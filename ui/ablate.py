"""Ablate: knock out heads, layers, MLPs or neurons (optionally at some positions) and compare.

What is measured is chosen once (``common.target_picker``): the logit difference between
an answer and a wrong token, the answer's probability, log-probability or rank at a chosen
position (the last by default, where a prompt's answer is decided), or the prompt's mean
loss. Clean and ablated sit side by side: that metric, per-token loss and its change, the
prediction at each position, the logit lens, the attention of the head whose pattern
changed most and direct logit attribution, each also as clean − ablated. A button runs
the ablation sweep over every head (one library call reporting its progress) and draws
the layer x head heatmap; clicking a cell ablates that head.

"Over a prompt set" ablates the chosen units on many prompts at once (the task's IOI
prompts, scored by each one's own answer, or prompts typed one per line, scored by their
mean loss; they may have any lengths): each unit's mean change with its 95% interval over
the prompts, and every prompt's change as a point.
"""

from __future__ import annotations

import re
from typing import Optional

import streamlit as st

from ui import common
from workbench import viz
from workbench.analysis import (
    AblationSpec,
    AnswerMetric,
    ablation_sweep,
    answer_change,
    answer_table,
    attention_change,
    attention_patterns,
    direct_logit_attribution,
    dla_difference,
    lens_difference,
    parse_unit,
    pattern_difference,
    token_loss_change,
    token_losses,
    task_pairs,
    unit_label,
)
from workbench.stats import interval_cells, summarize

KINDS = {"zero": "zero", "mean (over reference text)": "mean", "resample (from reference text)": "resample"}
# The parts of a layer the unit picker offers, and the targets each ablates.
PARTS = {"attn": ("attn",), "mlp": ("mlp",), "block (attn + mlp)": ("attn", "mlp")}


def render() -> None:
    ckpt = common.page_checkpoint("Ablate")
    if ckpt is None:
        return
    text = common.prompt_box(ckpt)
    ids = common.prompt_ids(ckpt, text)
    if ids is None:
        return
    kind = KINDS[st.radio("Kind", list(KINDS), horizontal=True, key="ablate_kind", persist_state="session")]
    with st.spinner("Drawing the reference batch that mean and resample ablations read…"):
        reference = common.reference_batch(ckpt.key, ids) if kind != "zero" else None
    if reference is not None:
        # a model without a task (a pretrained one) averages over shuffles of the prompt itself: say so
        verb = "averages over" if kind == "mean" else "draws from"
        st.caption(f"The reference text: {common.reference_source(ckpt.key, ids)}. "
                   f"{kind.capitalize()} ablation {verb} it.")
    ablation = _choose_units(ckpt, ids, kind)
    st.subheader("What to measure")
    target = common.target_picker(ckpt, ids, key="ablate_target")
    if target is None:
        return
    if ablation is not None:
        if ablation:
            _compare(ckpt, ids, ablation, reference, target)
            _over_prompt_set(ckpt, ablation)
        else:
            st.info("Choose units to ablate above, or run the head sweep below and click a cell.")
    _head_sweep(ckpt, ids, kind, reference, target)


def unit_options(cfg) -> list[str]:
    out = []
    for layer in range(cfg.n_layers):
        out += [unit_label(layer, head=h) for h in range(cfg.n_heads)]
        out += [unit_label(layer, part=p) for p in PARTS if p == "attn" or not cfg.attn_only]
    return out


def parse_neurons(text: str, cfg) -> list[tuple[int, tuple[int, ...]]]:
    """'L0: 3, 17; L2: 5' -> [(0, (3, 17)), (2, (5,))]; ValueError with a message otherwise."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        unit, _, listed = part.partition(":")
        try:
            layer, head, rest = parse_unit(unit)  # a layer alone: "L0"
            if head is not None or rest is not None or not re.fullmatch(r"[\d,\s]+", listed):
                raise ValueError(part)
        except ValueError:
            raise ValueError(f"Cannot read neurons {part!r}: write them as 'L0: 3, 17; L1: 5'.") from None
        neurons = tuple(int(n) for n in re.findall(r"\d+", listed))
        if layer >= cfg.n_layers:
            raise ValueError(f"Layer {layer} does not exist: this model has layers 0..{cfg.n_layers - 1}.")
        bad = [n for n in neurons if n >= cfg.d_mlp]
        if bad:
            raise ValueError(f"Neurons {bad} do not exist: the MLP has {cfg.d_mlp} neurons (0..{cfg.d_mlp - 1}).")
        out.append((layer, neurons))
    return out


def _choose_units(ckpt: common.Checkpoint, ids, kind: str):
    """The widgets that pick what to ablate; returns the hashable ablation (None on bad input)."""
    cfg = ckpt.cfg
    left, right = st.columns([3, 2])
    units = left.multiselect("Units to ablate", unit_options(cfg), key="ablate_units", persist_state="session",
                             help="Heads (LxHy), a layer's attention, its MLP, or both.")
    neurons_text = "" if cfg.attn_only else right.text_input(
        "MLP neurons", key="ablate_neurons", persist_state="session", placeholder="L0: 3, 17; L1: 5")
    tokens = [ckpt.tokenizer.token_str(i) for i in ids]
    positions = st.multiselect("Only at positions (all when empty)", range(len(ids)), key="ablate_positions",
                               persist_state="session",
                               format_func=lambda p: f"{p}: {tokens[p]!r}")
    try:
        neurons = parse_neurons(neurons_text, cfg)
    except ValueError as e:
        st.warning(str(e))
        return None
    pos = tuple(positions) or None
    specs = []
    for unit in units:
        layer, head, part = parse_unit(unit)
        targets = ("head",) if head is not None else PARTS[part]
        specs += [AblationSpec(t, layer, head=head, positions=pos, method=kind) for t in targets]
    specs += [AblationSpec("neurons", layer, neurons=n, positions=pos, method=kind) for layer, n in neurons]
    return tuple(specs)


def _compare(ckpt: common.Checkpoint, ids, ablation, reference, target: common.Target) -> None:
    with st.spinner("Running the prompt clean and ablated: per-token losses and answer metrics…"):
        clean = common.analysis(token_losses, ckpt.key, ids)
        ablated = common.analysis(token_losses, ckpt.key, ids, ablation=ablation, reference=reference)
        answers = {name: common.analysis(answer_table, ckpt.key, ids, ablation=abl, reference=ref,
                                         answer=target.answer, wrong=target.wrong, pos=target.pos)
                   for name, abl, ref in (("clean", (), None), ("ablated", ablation, reference))}
    change = answer_change(answers["clean"], answers["ablated"])
    a, b, c = st.columns(3)
    if target.kind == "loss":
        a.metric("Mean loss, clean → ablated", f"{clean['loss'].mean():.3f} → {ablated['loss'].mean():.3f} nats",
                 delta=f"{ablated['loss'].mean() - clean['loss'].mean():+.3f} nats", delta_color="inverse")
    else:
        row = change.set_index("measure").loc[target.metric().kind]
        a.metric(f"{target.describe()}, clean → ablated", f"{row['clean']:.3f} → {row['changed']:.3f}",
                 delta=f"{row['changed'] - row['clean']:+.3f} {row['units']}",
                 delta_color="inverse" if target.kind == "rank" else "normal")
    b.metric("Mean loss, clean → ablated", f"{clean['loss'].mean():.3f} → {ablated['loss'].mean():.3f}",
             delta=f"{ablated['loss'].mean() - clean['loss'].mean():+.3f} nats", delta_color="inverse")
    c.metric("Top-1 accuracy, clean → ablated", f"{clean['correct'].mean():.0%} → {ablated['correct'].mean():.0%}")
    with st.expander(f"Every answer metric at position {target.pos}, clean and ablated"):
        common.table(change.round(4))

    st.subheader("Per-token loss")
    common.show(viz.token_loss_figure({"clean": clean, "ablated": ablated}), key="ablate_loss")
    st.caption("The prediction at each position, clean and ablated (rows where the prediction changed first).")
    changes = token_loss_change(clean, ablated).drop(columns=["batch", "prediction_changed"])
    common.table(changes.round(3), height=260)

    st.subheader("Lens, clean and ablated")
    a, b = st.columns(2)
    with a:
        which = common.lens_picker(ckpt, key="ablate_lens_kind")
    view = b.radio("Show", ["clean − ablated", "side by side"], horizontal=True, key="ablate_lens_view",
                   persist_state="session")
    with st.spinner(f"The {which} lens at every layer, clean and ablated…"):
        lens_clean = common.lens_table(ckpt, ids, which)
        lens_ablated = common.lens_table(ckpt, ids, which, ablation=ablation, reference=reference)
    if view == "side by side":
        fig = viz.side_by_side(viz.logit_lens_figure(lens_clean), viz.logit_lens_figure(lens_ablated),
                               titles=("clean", "ablated"))
        fig.update_layout(height=max(320, 50 * (ckpt.cfg.n_layers + 1) + 220))
    else:
        fig = viz.lens_difference_figure(lens_difference(lens_clean, lens_ablated, "target_prob"))
    common.show(fig, key="ablate_lens")

    st.subheader("Attention where it changes")
    with st.spinner("Every head's attention pattern, clean and ablated…"):
        pat_clean = common.analysis(attention_patterns, ckpt.key, ids)
        pat_ablated = common.analysis(attention_patterns, ckpt.key, ids, ablation=ablation, reference=reference)
    per_head = attention_change(pat_clean, pat_ablated)
    if per_head.empty:
        st.info("No attention pattern changes: the ablated units are in the last layers, or write nothing "
                "that later heads read.")
    else:
        options = [unit_label(r.layer, r.head) for r in per_head.itertuples()]
        left, right = st.columns([1, 3])
        with left:
            common.table(per_head.round(4).head(12))
        with right:
            chosen = st.selectbox("Head (most changed first)", options, key="ablate_attn_head", persist_state="session")
            layer, head, _ = parse_unit(chosen)
            fig = viz.side_by_side(viz.attention_figure(pat_clean, layer, head),
                                   viz.attention_figure(pat_ablated, layer, head),
                                   titles=(f"{chosen} clean", f"{chosen} ablated"))
            # two panels in three quarters of the page: every token's label would pile onto the next
            fig = viz.thin_ticks(viz.thin_ticks(fig, 5), 8, axis="y")
            common.show(fig, key="ablate_attention")
            diff = pattern_difference(pat_clean, pat_ablated)
            common.show(viz.attention_figure(diff, layer, head, difference=True), key="ablate_attention_diff")
    _dla_change(ckpt, ids, ablation, reference, target)


def _dla_change(ckpt: common.Checkpoint, ids, ablation, reference, target: common.Target) -> None:
    st.subheader("Direct logit attribution, clean and ablated")
    if ckpt.cfg.norm_placement != "pre":
        st.info(f"Direct logit attribution needs a pre-norm model; this one is {ckpt.cfg.norm_placement}-norm.")
        return
    runs = [common.analysis(direct_logit_attribution, ckpt.key, ids, ablation=abl, reference=ref,
                            answer=target.answer, wrong=target.wrong, pos=target.pos)
            for abl, ref in (((), None), (ablation, reference))]
    granularity = st.radio("Split", ["layer", "head"], horizontal=True, key="ablate_dla_split", persist_state="session")
    what = f"logit[{target.answer_str!r}]" + (f" − logit[{target.wrong_str!r}]" if target.wrong is not None else "")
    st.caption(f"What each component writes directly into {what} at position {target.pos}; the ablated run's "
               "components read an ablated stream, so later ones change too.")
    common.show(viz.dla_difference_figure(dla_difference(*runs), granularity=granularity), key="ablate_dla")


SET_SOURCES = {"ioi": "the task's IOI prompts (each scored by its own answer)",
               "typed": "prompts typed here, one per line (scored by their mean loss)"}


def sweep_over_prompts(model, prompts: tuple[str, ...], specs: tuple, answer: Optional[tuple] = None,
                       wrong: Optional[tuple] = None):
    """Each of ``specs`` ablated on every prompt: the per-prompt table of ``ablation_sweep``
    (answers: the logit difference at each prompt's last token; none: each prompt's mean loss)."""
    metric = None if answer is None else AnswerMetric("logit_diff", answer, wrong, -1)
    return ablation_sweep(model, list(prompts), specs=list(specs), metric=metric, per_prompt=True, batch_size=16)


def _over_prompt_set(ckpt: common.Checkpoint, ablation) -> None:
    st.subheader("Over a prompt set")
    if not st.toggle("Average the ablation over a prompt set", key="ablate_set_on", persist_state="session"):
        return
    sources = [k for k in SET_SOURCES if k != "ioi" or _ioi(ckpt, 2) is not None]
    source = st.radio("Prompts", sources, format_func=SET_SOURCES.get, horizontal=True, key="ablate_set_source",
                      persist_state="session")
    answer = wrong = None
    if source == "ioi":
        pairs = _ioi(ckpt, st.slider("Prompts", 2, 64, 16, key="ablate_set_n", persist_state="session"))
        prompts, answer, wrong = pairs.prompts, pairs.answer, pairs.wrong
        what = "logit difference (answer − wrong) at the last token"
    else:
        common.follow_default("ablate_set_text", common.default_prompt(ckpt), ckpt.path)
        text = st.text_area("Prompts, one per line", key="ablate_set_text", persist_state="session", height=120)
        prompts = tuple(line.strip() for line in text.splitlines() if line.strip())
        what = "mean loss"
        if not prompts:
            st.info("Type one prompt per line.")
            return
    try:
        with st.spinner(f"Ablating over {len(prompts)} prompts…"):
            per_prompt = common.analysis(sweep_over_prompts, ckpt.key, None, prompts=prompts, specs=ablation,
                                         answer=answer, wrong=wrong)
    except ValueError as e:
        st.warning(str(e))
        return
    summary = summarize(per_prompt, "label", ["delta", "clean"])
    st.caption(f"Change in each prompt's {what} (ablated − clean), over {len(prompts)} prompts of any length; "
               "mean and resample ablations draw from the prompts themselves, over real tokens only.")
    common.table(interval_cells(summary, ["delta", "clean"], digits=4))
    common.show(viz.prompt_spread_figure(per_prompt, "delta", units=f"Δ {what}",
                                         title=f"Change in {what} per prompt ({len(prompts)} prompts)"),
                key="ablate_set_spread")


def _ioi(ckpt: common.Checkpoint, n: int):
    try:
        with st.spinner("Building the task's IOI prompts…"):
            return common.analysis(task_pairs, ckpt.key, None, meta=ckpt.meta, n=n, kind="ioi")
    except ValueError:
        return None


def _head_sweep(ckpt: common.Checkpoint, ids, kind: str, reference, target: common.Target) -> None:
    st.subheader("Head sweep")
    st.caption(f"Ablate every head on its own ({kind}) and measure the change in {target.describe()} "
               "(ablated − clean).")
    metric = target.metric()
    state_key = ("sweep", ckpt.key, ids, kind, metric)
    if st.button("Run the head sweep", key="ablate_sweep"):
        bar = st.progress(0.0, text="ablating heads…")
        sweep = common.analysis_with_progress(
            ablation_sweep, ckpt.key, ids, reference=reference, unit="head", methods=(kind,), metric=metric,
            progress=lambda done, total: bar.progress(done / total, text=f"ablated {done} of {total} heads"))
        bar.empty()
        st.session_state["head_sweep"] = (state_key, sweep)
    stored = st.session_state.get("head_sweep")
    if stored is None or stored[0] != state_key:
        return
    sweep = stored[1]
    fig = viz.layer_head_figure(sweep, value="delta", units=f"Δ {target.units}", clickable=True,
                                title=f"Change in {target.describe()} when each head is ablated (click a cell)")
    common.show(fig, key="sweep_heatmap", on_select=_ablate_clicked_head, selection_mode="points")
    with st.expander("Sweep table"):
        common.table(sweep.sort_values("delta", ascending=False))


def clicked_head(event: dict) -> Optional[tuple[int, int]]:
    """(layer, head) of the cell a click on the sweep heatmap selected, from its scatter point's
    ``customdata`` ([layer, head, value]); None when nothing is selected."""
    points = (event or {}).get("selection", {}).get("points", [])
    for point in points:
        data = point.get("customdata")
        if isinstance(data, dict):  # a typed array's row, as a browser serialises it
            data = [data.get(str(i)) for i in range(len(data))]
        if isinstance(data, (list, tuple)) and len(data) >= 2 and None not in data[:2]:
            return int(data[0]), int(data[1])
    return None


def _ablate_clicked_head() -> None:
    """A click on a sweep heatmap cell ablates that head alone."""
    head = clicked_head(st.session_state.get("sweep_heatmap"))
    if head is not None:
        st.session_state["ablate_units"] = [unit_label(*head)]
