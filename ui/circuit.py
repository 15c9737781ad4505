"""Circuit: find the edges that carry a behaviour, draw them, and score the method.

Pick a checkpoint, a prompt set of its own task (repeated random tokens for induction
models, a + b mod p for the planted modular model, IOI or possession pairs for the stories
models: ``analysis.circuits.prompt_sources``) and a metric; run a method (exact edge
patching, EAP, EAP-IG or ACDC, with a progress bar) and see the circuit it keeps as a
layered graph (edge width = |score|, colour = the input it feeds). Clicking a node opens its
attention pattern and direct logit attribution on the first prompt. A second method runs
beside the first, with their agreement. For a model whose circuit is known (the planted
models, and induction-attn2l's shipped circuit.json) the known circuit is drawn and each
method's edge AUROC against it is given. The scoring methods keep the top k edges by |score|
(the default: a threshold often keeps none on a small model) or the edges whose |score|
reaches a threshold; ACDC always prunes at the threshold. A method that keeps no edges says
why instead of drawing an empty graph.

Results are kept in the shared store of ``common.analysis_with_progress`` (the progress
callback never enters a cached function) and in the session, so a click redraws without
recomputing.
"""

from __future__ import annotations

import functools
from typing import Optional

import streamlit as st

from ui import common
from workbench import viz
from workbench.analysis import attention_patterns, direct_logit_attribution, edge_auroc
from workbench.analysis.circuits import (
    METRIC_LABELS,
    Circuit,
    ComputationGraph,
    circuit_agreement,
    circuit_prompts,
    prompt_sources,
    run_method,
)
from workbench.analysis.circuits.ioi import IOI_TEMPLATES, ioi_prompts, single_token_names
from workbench.analysis.circuits.tasks import CircuitPrompts
from workbench.planted import known_circuit

METHODS = {"exact": "exact edge patching", "eap": "EAP (edge attribution patching)",
           "eap-ig": "EAP-IG (integrated gradients)", "acdc": "ACDC (greedy pruning)"}
# The Method boxes' labels: short enough for their narrow columns (the full names above cut off there);
# the full names are in the boxes' help and in the figures' titles.
METHOD_LABELS = {"exact": "exact patching", "eap": "EAP", "eap-ig": "EAP-IG", "acdc": "ACDC"}
METHOD_HELP = "; ".join(f"**{METHOD_LABELS[m]}**: {name}" for m, name in METHODS.items()) + "."
NONE = "(none)"
DEFAULT = "planted-iit-induction"
# How the scoring methods (exact, EAP, EAP-IG) choose their edges; ACDC prunes at the threshold either way.
KEEP = {"top_k": "top k edges", "threshold": "score threshold"}
TOP_K = 20
# A pretrained text model records no task: it gets the English IOI pairs of ``analysis.circuits.ioi``
# (tutorial 11, experiments/real_ioi.py) when its tokenizer makes enough of the names one token each.
TEXT_IOI = "ioi-text"
TEXT_IOI_LABEL = ("IOI pairs in English (ioi_prompts: 5 templates, single-token names), corrupted by a third "
                  "name in place of the subject's second mention")
# Few pairs by default: on SmolLM2-135M (123,211 edges) EAP over 4 pairs of 15 tokens took 105 s on a
# busy 2-core machine, and it runs only on the button.
TEXT_IOI_PAIRS = 4

# Kept when the user visits another page and comes back (app.py re-sets them every run).
PERSISTENT = ("circuit_ckpt", "circuit_ckpt_dir", "circuit_metric", "circuit_source", "circuit_n", "circuit_seed",
              "circuit_method", "circuit_method_b", "circuit_threshold", "circuit_steps", "circuit_keep",
              "circuit_top_k")


def render() -> None:
    st.header("Circuit")
    sidebar = common.sidebar_choice()
    ckpt = common.checkpoint_picker("Checkpoint", key="circuit_ckpt", where=st, default=sidebar or DEFAULT)
    if ckpt is None:
        return
    if st.session_state.get("ckpt") not in (None, ckpt.name):
        st.caption(f"This page has its own checkpoint picker (above): it shows **{ckpt.name}**, not the sidebar's "
                   f"**{st.session_state['ckpt']}**. It opens on the sidebar's checkpoint when one other than "
                   f"{common.DEFAULT_CHECKPOINT} was picked there, else on {DEFAULT}, whose known circuit scores "
                   "each method.")
    try:
        n_edges = ComputationGraph(ckpt.model).n_edges
    except ValueError as e:
        st.error(f"**{ckpt.name}** has no circuit graph: {e}")
        return
    sources = prompt_sources(ckpt.meta, ckpt.cfg, ckpt.path)
    if not sources and text_ioi_offered(ckpt.tokenizer):
        sources = {TEXT_IOI: TEXT_IOI_LABEL}
    if not sources:
        st.info(f"**{ckpt.name}**'s task ({ckpt.meta.get('task', 'none recorded')}) has no prompt set for circuits: "
                "they need clean/corrupted pairs of one length (induction, planted and stories models have them), "
                "and its tokenizer does not make three of the IOI names one token each (a pretrained text model's "
                "does: see docs/tutorials/11-real-model-ioi.py for IOI on one).")
        return
    prompts = _prompts(ckpt, sources)
    if prompts is None:
        return
    metric = st.selectbox("Metric", prompts.metrics, key="circuit_metric", format_func=METRIC_LABELS.get)
    known = _known(ckpt)
    settings = _settings(n_edges)
    runs = _runs(ckpt, prompts, metric, settings)
    if runs:
        _results(ckpt, prompts, runs, known)
    if known is not None:
        _known_circuit(ckpt, known)


def _pairs_default(context: tuple, default: int) -> None:
    """The Prompt pairs slider's value for this (checkpoint, prompt set): what the user set for it before,
    else ``default``. A setdefault would keep the value of the checkpoint seen first (8 pairs of a
    planted model on SmolLM2-135M, where 4 already take minutes)."""
    chosen = st.session_state.setdefault("circuit_n_chosen", {})
    if st.session_state.get("circuit_n_context") != context or "circuit_n" not in st.session_state:
        st.session_state["circuit_n"] = chosen.get(context, default)
        st.session_state["circuit_n_context"] = context


def _prompts(ckpt: common.Checkpoint, sources: dict[str, str]):
    a, b, c = st.columns([3, 2, 1])
    if st.session_state.get("circuit_source") not in sources:
        st.session_state.pop("circuit_source", None)
    source = a.selectbox("Prompt set", list(sources), key="circuit_source", format_func=sources.get)
    default = TEXT_IOI_PAIRS if source == TEXT_IOI else 8
    _pairs_default((ckpt.key, source), default)
    _defaults(circuit_seed=0)
    n = b.slider("Prompt pairs", 2, 64, key="circuit_n")
    if n == default:
        st.session_state["circuit_n_chosen"].pop((ckpt.key, source), None)
    else:  # the user's own value for this checkpoint and prompt set
        st.session_state["circuit_n_chosen"][(ckpt.key, source)] = n
    seed = c.number_input("Seed", 0, 10_000, key="circuit_seed")
    try:
        if source == TEXT_IOI:
            prompts = common.analysis(text_ioi, ckpt.key, None, n=n, seed=int(seed))
        else:
            prompts = common.analysis(circuit_prompts, ckpt.key, None, meta=ckpt.meta, source=source, n=n,
                                      seed=int(seed), path=ckpt.path)
    except ValueError as e:
        st.warning(f"Cannot make these prompts: {e}")
        return None
    st.caption(prompts.description)
    with st.expander("The prompts"):
        decode = ckpt.tokenizer.decode
        common.table({"clean": [decode(list(r)) for r in prompts.clean],
                      "corrupted": [decode(list(r)) for r in prompts.corrupted]})
    return prompts


def text_ioi_offered(tokenizer) -> bool:
    """Whether ``tokenizer`` makes at least three of the IOI names one token each (IOI needs IO, S and C)."""
    return tokenizer is not None and hasattr(tokenizer, "encode") and len(single_token_names(tokenizer)) >= 3


def text_ioi(model, n: int, seed: int = 0) -> CircuitPrompts:
    """``n`` English IOI pairs (``ioi_prompts``) as the page's prompt set: the answer is the indirect object,
    the wrong answer the subject. Templates of another token length under this tokenizer are left out (a
    ValueError when none is left of one length)."""
    tok = model.tokenizer
    a, b = single_token_names(tok)[:2]
    lengths = [len(tok.encode(t.format(A=a, B=b, S=b))) for t in IOI_TEMPLATES]
    templates = tuple(t for t, k in zip(IOI_TEMPLATES, lengths) if k == max(set(lengths), key=lengths.count))
    pairs = ioi_prompts(model, n, seed=seed, templates=templates)
    return CircuitPrompts(TEXT_IOI, f"{TEXT_IOI_LABEL} ({n} pairs of {len(pairs.clean[0])} tokens, {len(templates)} "
                                    f"template(s), seed {seed}). Exact patching and ACDC are slow on a model this size: "
                                    "EAP first.",
                          pairs.clean, pairs.corrupted, answer=pairs.io, wrong=pairs.s)


def _known(ckpt: common.Checkpoint) -> Optional[Circuit]:
    try:
        found = common.analysis(known_circuit, ckpt.key, None, path=ckpt.path)
    except ValueError as e:
        st.warning(f"The circuit file beside this checkpoint does not fit it: {e}")
        return None
    if found is None:
        return None
    truth, info = found
    circuit = Circuit.from_edges(ckpt.model, truth, method="known", meta=info)
    return circuit


def _defaults(**values) -> None:
    """Each widget's first value, given through the session state and not as the widget's default:
    app.py re-sets these keys on every run (PERSISTENT), and Streamlit logs a warning with a stack
    trace for a widget that has both a default and a value set through the session state."""
    for key, value in values.items():
        st.session_state.setdefault(key, value)


def _settings(n_edges: int) -> dict:
    a, b, c, d, e, f = st.columns([3, 3, 2, 2, 3, 2])
    # EAP by default: one pass, and it keeps the top k edges (ACDC prunes at a threshold and has no k).
    _defaults(circuit_method="eap", circuit_top_k=min(TOP_K, n_edges), circuit_threshold=0.05, circuit_steps=8)
    method = a.selectbox("Method", list(METHODS), key="circuit_method", format_func=METHOD_LABELS.get,
                         help=METHOD_HELP)
    other = b.selectbox("Compare with", [NONE, *METHODS], key="circuit_method_b",
                        format_func=lambda m: METHOD_LABELS.get(m, m), help=METHOD_HELP)
    methods = [method] + ([other] if other not in (NONE, method) else [])
    top_k = None
    if methods == ["acdc"]:  # nothing to choose: ACDC keeps what survives pruning at the threshold
        c.caption("ACDC keeps the edges that survive pruning at the threshold.")
        keep = "threshold"
    else:
        keep = c.radio("Keep", list(KEEP), key="circuit_keep", format_func=KEEP.get,
                       help="How exact patching, EAP and EAP-IG choose their edges. ACDC prunes at the threshold "
                            "either way.")
    if keep == "top_k":
        if st.session_state.get("circuit_top_k", 0) > n_edges:  # kept from a checkpoint with more edges
            st.session_state["circuit_top_k"] = n_edges
        top_k = int(d.number_input("Top k edges", 1, n_edges, key="circuit_top_k",
                                   help=f"The k edges of largest |score| (1 to {n_edges}, this graph's edge count); "
                                        "edges that then connect to nothing are pruned, so a few may go."))
    threshold = 0.05
    if keep == "threshold" or "acdc" in methods:
        threshold = e.number_input("Threshold (fraction of the gap; nats for KL)", 0.0, 10.0, step=0.01,
                                   format="%.3f", key="circuit_threshold",
                                   help="ACDC prunes an edge whose removal moves the metric by less than this; "
                                        "with *score threshold* the scoring methods keep edges whose |score| "
                                        "reaches it.")
    steps = f.number_input("EAP-IG steps", 1, 64, key="circuit_steps")
    return {"methods": methods, "threshold": float(threshold), "top_k": top_k, "steps": int(steps)}


def _runs(ckpt: common.Checkpoint, prompts, metric: str, settings: dict) -> dict:
    """method -> MethodRun for the current settings: run on the button, kept in the session."""
    state = (ckpt.key, prompts, metric, settings["threshold"], settings["top_k"], settings["steps"])
    kept = st.session_state.get("circuit_runs")
    if kept is None or kept[0] != state:
        kept = (state, {})
    if st.button("Run", key="circuit_run", type="primary"):
        for method in settings["methods"]:
            bar = st.progress(0.0, text=f"{METHODS[method]}…")
            try:
                kept[1][method] = common.analysis_with_progress(
                    run_method, ckpt.key, None, prompts=prompts, metric=metric, method=method,
                    threshold=settings["threshold"], steps=settings["steps"],
                    top_k=None if method == "acdc" else settings["top_k"],
                    progress=_reporter(bar, METHODS[method]))
            except ValueError as e:
                st.warning(f"{METHODS[method]} cannot run here: {e}")
            bar.empty()
        st.session_state["circuit_runs"] = kept
    runs = {m: kept[1][m] for m in settings["methods"] if m in kept[1]}
    if not runs:
        st.info("Press **Run** to find the circuit with the chosen method(s).")
    return runs


def _reporter(bar, label: str):
    """``progress(done, total)`` for the library, drawing into ``bar``."""
    return lambda done, total: bar.progress(done / total, text=f"{label}: {done} of {total}")


def _select_clicked_node(key: str) -> None:
    """A click on a node of a circuit graph opens that node (before the page redraws)."""
    node = common.clicked_node(st.session_state.get(key))
    if node is not None:
        st.session_state["circuit_node"] = node


def _results(ckpt: common.Checkpoint, prompts, runs: dict, known: Optional[Circuit]) -> None:
    st.subheader("The circuit")
    st.caption("Layers run left to right, heads top to bottom; an edge's colour names the input it feeds (a head's "
               "q, k or v, an MLP, the logits) and its width the |score|. Click a node for its attention and DLA.")
    columns = st.columns(len(runs))
    selected = st.session_state.get("circuit_node")
    for column, (method, run) in zip(columns, runs.items()):
        with column:
            c1, c2, c3 = st.columns(3)
            c1.metric("Edges kept", f"{len(run.circuit)} of {len(run.table)}")
            c2.metric("Faithfulness", f"{run.faithfulness:.2f}", help="(m(circuit) − m(corrupted)) / "
                      "(m(clean) − m(corrupted)) on these prompts: 1 keeps all the behaviour.")
            c3.metric("Seconds", f"{run.seconds:.2f}")
            if known is not None:
                unscored = known.meta.get("unscored", [])
                st.caption(f"Edge AUROC against the known circuit: **{edge_auroc(run.table, known.edges, unscored):.3f}** "
                           "(1: every known edge scored above every other).")
            if not len(run.circuit):
                st.info(_empty_message(method, run.circuit.meta))
                continue
            fig = viz.circuit_graph_figure(run.circuit.to_frame(), title=f"{METHODS[method]}: {len(run.circuit)} edges",
                                           selected=selected)
            common.show(fig, key=f"circuit_graph_{method}", selection_mode="points",
                        on_select=functools.partial(_select_clicked_node, f"circuit_graph_{method}"))
    if len(runs) == 2:
        (a, run_a), (b, run_b) = runs.items()
        agree = circuit_agreement(run_a.circuit, run_b.circuit)
        st.caption(f"{METHODS[a]} and {METHODS[b]} share {agree['shared']} edges ({agree['only_a']} only in the first, "
                   f"{agree['only_b']} only in the second; Jaccard {agree['jaccard']:.2f}); their edge scores rank "
                   f"alike at Spearman {agree['spearman']:.2f}.")
    with st.expander("Edge scores"):
        first = next(iter(runs.values()))
        common.table(first.table.sort_values("abs_score", ascending=False)[["edge", "input", "score"]], height=300)
    if selected is not None:
        _node(ckpt, prompts, selected)


def _empty_message(method: str, meta: dict) -> str:
    """Why a method kept no edges, and what to change (instead of an empty graph)."""
    if method == "acdc":
        return (f"{METHODS[method]} pruned every edge at threshold {meta['threshold']:g}: no edge's removal moved "
                "the metric by that much. Lower the **Threshold** to keep some.")
    if meta.get("top_k") is not None:
        return (f"{METHODS[method]}'s top {meta['top_k']} edges connect to nothing once pruned (none is both fed "
                "from the embedding and read towards the logits). Raise **Top k edges**.")
    return (f"{METHODS[method]} kept 0 edges: no edge's |score| reaches the threshold {meta['threshold']:g} of the "
            "clean-corrupted gap. Choose **Keep: top k edges** to see the strongest edges, or lower the threshold.")


def _node(ckpt: common.Checkpoint, prompts, label: str) -> None:
    from workbench.analysis.common import parse_unit

    st.subheader(f"Node {label}")
    ids = prompts.clean[0]
    pos, answer, wrong = prompts.target(0)
    left, right = st.columns(2)
    layer, head = (parse_unit(label)[:2] if label not in ("embed", "logits") else (None, None))
    with left:
        if head is None:
            st.info(f"{label} is not a head, so it has no attention pattern; its direct logit attribution is on the right.")
        else:
            patterns = common.analysis(attention_patterns, ckpt.key, ids)
            fig = viz.attention_figure(patterns, layer, head)
            fig.update_layout(title=f"Attention {label} on the first clean prompt")
            common.show(fig, key="circuit_node_attention")
    with right:
        dla = common.analysis(direct_logit_attribution, ckpt.key, ids, answer=answer, wrong=wrong, pos=pos)
        fig = viz.dla_figure(dla, granularity="head" if head is not None else "layer")
        answer_str = ckpt.tokenizer.token_str(answer)
        what = f"logit[{answer_str!r}]" + (f" − logit[{ckpt.tokenizer.token_str(wrong)!r}]" if wrong is not None else "")
        fig.update_layout(title=f"{what} at position {pos}: direct attribution ({label} among them)")
        common.show(fig, key="circuit_node_dla")


def _known_circuit(ckpt: common.Checkpoint, known: Circuit) -> None:
    st.subheader("The known circuit")
    st.caption(f"How it is known: {known.meta.get('established_by', 'not recorded')}.")
    fig = viz.circuit_graph_figure(known.to_frame(), title=f"Known circuit of {ckpt.name}: {len(known)} edges")
    common.show(fig, key="circuit_known")
