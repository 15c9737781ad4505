"""Graph: the attribution graph of one prompt, drawn as circuit-tracer draws it, with feature cards and interventions.

Pick a checkpoint that ships a replacement for its MLPs (``saes/transcoders/layer{l}``, a
transcoder per MLP, or ``saes/clt``, a cross-layer transcoder), or an attention-only model (no
MLP to replace: the model is its own replacement model, ``transcoders=None``), a prompt (the stories IOI prompt by
default) and a target (the top logits, a token, or a logit difference); the page calls
``an.attribution_graph`` once (cached by those values, with a bounded number of feature rows so
it stays quick on a CPU) and prunes it with ``Graph.prune`` at the two sliders' thresholds.
The figure: x = position, y = layer, node size = influence on the logits, edge width = |weight|,
colour = sign; at most one screen tall whatever the depth (a deep model's layers packed into bands as
tall as their nodes need), with plotly's box zoom for detail. A click on a feature node (or the picker below) opens its card: its
max-activating contexts on the task's text (the Features page's ``max_activating_contexts``).
The intervention panel sets one feature to a value and shows the target logits before and
after (``graph.intervene``, live, attention frozen, or in the graph's own frozen model).
Supernodes: several features named as a group, the graph redrawn with the group collapsed
(``an.collapse_frames``). The QK panel (``ui/qk_panel.py``) says why a head attended where it did.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from urllib.parse import quote, urlencode

import pandas as pd
import streamlit as st
import torch

from ui import common, qk_panel
from ui.common import pretrained
from workbench import analysis as an
from workbench import viz
from workbench.analysis import max_activating_contexts, suggest_answer, task_from_meta
from workbench.analysis.dictionaries.clt import is_clt_folder
from workbench.analysis.dictionaries.saelens import CFG_FILE, WEIGHTS_FILE
from workbench.analysis.features import dataset_tokens
from workbench.habits import tokenizer_prepends_bos

IOI_PROMPT = "Once Ella and Ivy went to the beach, Ivy gave a hat to"
TARGETS = {"top": "top logits", "token": "a token, or a logit difference"}
MODES = {"live": "live (attention and norms recomputed)", "frozen": "attention and norms frozen",
         "direct": "the graph's frozen model (direct effects only)"}
MAX_NODES = (32, 64, 128, 256, 512)  # feature rows: the graph's cost grows with them
ITSELF = "none: attention-only, the model is its own replacement"  # the replacement of a model without MLPs


# ---- which checkpoints and replacements ---------------------------------------------------------------
def replacements(checkpoint: str) -> dict[str, str]:
    """Label -> folder of each replacement under ``<checkpoint>/saes/``: a CLT folder, or a folder of
    per-layer transcoders (``layer0``, ``layer1``, ... each a SAELens folder)."""
    root = Path(checkpoint) / "saes"
    sets, clts = {}, {}
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if folder.is_dir() and is_clt_folder(folder):
            clts[f"{folder.name} (cross-layer transcoder)"] = str(folder)
        elif folder.is_dir() and common.layer_folders(folder) and n_layers(checkpoint) in (
                None, len(common.layer_folders(folder))):  # every layer's MLP: a set being trained is not one yet
            sets[f"{folder.name} (transcoder set)"] = str(folder)
    return {**sets, **clts}


def n_layers(checkpoint: str):
    """The checkpoint's layer count from its config.json (None when unreadable)."""
    try:
        return int(json.loads((Path(checkpoint) / "config.json").read_text())["n_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def transcoder_layers(checkpoint: str) -> int:
    """How many ``saes/transcoders/layer{l}`` folders hold both of a transcoder's files (a set being trained)."""
    root = Path(checkpoint) / "saes" / "transcoders"
    return sum(1 for p in root.glob("layer*") if p.name[5:].isdigit() and (p / CFG_FILE).is_file()
               and (p / WEIGHTS_FILE).is_file()) if root.is_dir() else 0


def attention_only(checkpoint: str) -> bool:
    """Whether the checkpoint's config.json says it has no MLPs (read without loading the weights)."""
    try:
        return bool(json.loads((Path(checkpoint) / "config.json").read_text()).get("attn_only", False))
    except (OSError, ValueError, AttributeError):
        return False


def _stamp(folder: str) -> int:
    files = [p for p in Path(folder).rglob("*.safetensors")]
    return max((p.stat().st_mtime_ns for p in files), default=0)


def _layer_dictionary(replacement, layer: int):
    """Layer ``layer``'s features as a one-hook dictionary (what the feature analyses read)."""
    return replacement[layer] if isinstance(replacement, list) else replacement.layer_encoder(layer)


@st.cache_resource(max_entries=64, show_spinner=False)
def _pruned(key, ref, ids, target, max_nodes: int, held: int, node_threshold: float, edge_threshold: float):
    """(pruned graph, nodes, edges) at these thresholds."""
    pruned = common.cached_graph(key, ref, ids, target, max_nodes, held).prune(node_threshold, edge_threshold)
    nodes, edges = pruned.to_frame()
    return pruned, nodes, edges


# ---- the page -----------------------------------------------------------------------------------------
def render() -> None:
    st.header("Graph")
    found = common.all_checkpoints()
    options = {name: path for name, path in found.items() if replacements(path) or attention_only(path)}
    lacking = {name: path for name, path in {**pretrained.entries(), **found}.items()
               if name not in options and (name == pretrained.LABEL or pretrained.is_text_model(path))}
    for name, path in lacking.items():  # a real model is what a user comes here for: say why it is not listed
        done = transcoder_layers(path)
        has = f"has transcoders for {done} of its {n_layers(path)} layers so far" if done else "has no transcoders yet"
        st.info(f"**{name}** {has}, so it is not offered here. This page reads one transcoder per "
                f"MLP from `{Path(path) / 'saes' / 'transcoders'}/layer{{l}}` (l = 0 to its last layer, SAELens "
                "folders; `experiments/real_transcoders.py` trains them there) or a cross-layer transcoder from "
                f"`{Path(path) / 'saes' / 'clt'}`.")
    if not options:
        st.info("No checkpoint here ships transcoders or a CLT under `saes/`, and none is attention-only. Make "
                "transcoders with `python scripts/make_transcoders.py` (see docs/reference/cross-layer-transcoders.md).")
        return
    names = list(options)
    _open_link(names, {**pretrained.entries(), **found})
    # First values through the session state, not as the widgets' defaults: a link sets them too, and
    # Streamlit logs a stack trace for a widget with both.
    if st.session_state.get("graph_ckpt") not in names:
        sidebar = common.sidebar_choice()  # the sidebar's pick, when it has a graph here
        st.session_state["graph_ckpt"] = (sidebar if sidebar in names else common.DEFAULT_CHECKPOINT
                                          if common.DEFAULT_CHECKPOINT in names else names[0])
    notice = st.session_state.get("graph_link_notice")
    if notice is not None and st.session_state.get("graph_ckpt") == notice[1]:  # until another checkpoint is picked
        st.warning(notice[0], icon="⚠️")
    for key, value in (("graph_max_nodes", 128), ("graph_node_threshold", 0.8), ("graph_edge_threshold", 0.98)):
        st.session_state.setdefault(key, value)
    name = st.selectbox("Checkpoint (with transcoders, or attention-only)", names, key="graph_ckpt",
                        persist_state="session")
    sidebar = st.session_state.get("ckpt")
    if sidebar not in (None, name):
        why = ("is not offered here (it has no transcoders or CLT, and is not attention-only)" if sidebar not in names
               else "is another choice than this page's own picker")
        st.caption(f"This page shows **{name}**: the sidebar's **{sidebar}** {why}.")
    ckpt = common.load(options[name], name=name)
    if ckpt is None:
        return
    kinds = replacements(ckpt.path) if not ckpt.model.cfg.attn_only else {ITSELF: ""}
    kind = st.radio("Replacement", list(kinds), key="graph_kind", persist_state="session", horizontal=True)
    ref = (kinds[kind], _stamp(kinds[kind])) if kinds[kind] else ("", 0)
    text = common.prompt_box(ckpt, key="graph_prompt", default=_default_prompt(ckpt))
    ids = common.prompt_ids(ckpt, text)
    if ids is None:
        return
    target = _target(ckpt, ids)
    if target is False:
        return
    held = _held(ckpt, ids)
    a, b, c = st.columns(3)
    max_nodes = a.select_slider("Feature rows (max)", MAX_NODES, key="graph_max_nodes",
                                persist_state="session",
                                help="How many features, most influential first, get their incoming edges computed.")
    node_threshold = b.slider("Node threshold", 0.5, 1.0, step=0.01, key="graph_node_threshold",
                              persist_state="session", help="Keep the nodes holding this share of the influence.")
    edge_threshold = c.slider("Edge threshold", 0.5, 1.0, step=0.01, key="graph_edge_threshold",
                              persist_state="session", help="Keep the edges holding this share of the edge influence.")
    try:
        full = common.cached_graph(ckpt.key, ref, ids, target, max_nodes, held)
        pruned, nodes, edges = _pruned(ckpt.key, ref, ids, target, max_nodes, held, node_threshold, edge_threshold)
    except ValueError as e:
        st.error(f"Cannot build this graph: {e}")
        return
    _summary(full, pruned)
    _export(full, name, node_threshold, edge_threshold)
    groups = _supernodes(nodes)
    drawn_nodes, drawn_edges = nodes, edges
    if groups:
        try:
            drawn_nodes, drawn_edges = an.collapse_frames(nodes, edges, groups)
        except ValueError as e:  # a group name that is already a node's id
            st.warning(f"Cannot collapse this group: {e}")
    selected = st.session_state.get("graph_node")
    fig = viz.attribution_graph_figure(drawn_nodes, drawn_edges, selected=selected, str_tokens=pruned.str_tokens,
                                       title=f"{len(pruned.nodes_of('feature'))} features, {pruned.n_edges} edges "
                                             f"(node {node_threshold:g}, edge {edge_threshold:g})")
    common.show(fig, key="graph_figure", selection_mode="points", on_select=functools.partial(_select, "graph_figure"))
    with st.expander("Nodes"):
        common.table(nodes.sort_values("influence", ascending=False)[
            ["id", "kind", "layer", "pos", "feature", "label", "activation", "influence"]].round(4), height=260)
    qk_panel.render(ckpt, (ckpt.key, ref, ids, target, max_nodes, held), ids, full.str_tokens)
    features = nodes.loc[nodes["kind"] == "feature", "id"].tolist()
    if not features:
        if ref[0]:
            st.info("The pruned graph keeps no feature: raise the node threshold to keep some.")
        return
    opened = _card(ckpt, ref, nodes, features)
    _intervene(ckpt, pruned, nodes, features, target, opened)


# ---- export and a link to this view -------------------------------------------------------------------
# What a link keeps: the page's widgets, in the URL (?page=Graph&graph_ckpt=...), read on a session's first run.
LINK_KEYS = ("graph_ckpt", "graph_kind", "graph_prompt", "graph_target", "graph_answer", "graph_wrong",
             "graph_max_nodes", "graph_node_threshold", "graph_edge_threshold", "graph_node", "graph_held")


# Where an empty value is a choice, not a missing one: no minus token (the token's logit alone). A link
# carries it as ``graph_wrong=`` (Streamlit keeps a blank query value), else the suggested one came back.
KEEP_EMPTY = ("graph_wrong",)
# The token boxes: their defaults follow the prompt (common.follow_default), which would replace a link's.
LINKED_TOKENS = ("graph_answer", "graph_wrong")


# A link names the pretrained model by its short name (``smollm2-135m``, what ``wb.open_pretrained`` and
# the docs say), not by the picker's long label; the parser maps either back to the picker's entry.
LINK_NAMES = {pretrained.NAME: pretrained.LABEL}


def link_name(name: str) -> str:
    """The picker's name of a link's ``graph_ckpt`` (its short name for the pretrained model)."""
    return LINK_NAMES.get(name, name)


def view_link(state) -> str:
    """The query string (``?page=Graph&...``) that reopens the view ``state`` (the session state) shows."""
    params = {"page": "Graph"}
    short = {label: name for name, label in LINK_NAMES.items()}
    for key in LINK_KEYS:
        value = state.get(key)
        if value is not None and (value != "" or key in KEEP_EMPTY):
            params[key] = short.get(value, str(value)) if key == "graph_ckpt" else str(value)
    return "?" + urlencode(params, quote_via=quote)


def link_refusal(params, names: list[str], known: dict[str, str]):
    """The message for a link whose ``graph_ckpt`` this page cannot open (None when it can, or names
    none): not a checkpoint here at all, or one without transcoders; either way it names what is offered."""
    value = params.get("graph_ckpt")
    if value is None or link_name(value) in names:
        return None
    offered = ", ".join(f"`{n}`" for n in names)
    if link_name(value) in known:
        why = (f"checkpoint `{value}`, which has no transcoder set or CLT under `saes/` (and is not "
               "attention-only), so this page cannot draw its graph")
    else:
        why = f"checkpoint `{value}`, and there is none of that name here"
    return f"The link asks for {why}. This page offers: {offered}."


def link_state(params, names: list[str]) -> dict:
    """The widget values a link's query ``params`` set, those that fit this server (its checkpoint
    names, the sliders' ranges); others are left to their defaults."""
    found = {}
    for key in LINK_KEYS:
        value = params.get(key)
        if value is None:
            continue
        try:
            if key == "graph_ckpt":
                value = link_name(value)
                if value not in names:
                    continue
            if key == "graph_max_nodes":
                value = int(value)
                if value not in MAX_NODES:
                    continue
            elif key in ("graph_node_threshold", "graph_edge_threshold"):
                value = float(value)
                if not 0.5 <= value <= 1.0:
                    continue
            elif key == "graph_target" and value not in TARGETS:
                continue
            elif key == "graph_held":
                value = int(value)
                if value < 0:
                    continue
        except ValueError:
            continue
        found[key] = value
    return found


def _open_link(names: list[str], known: dict[str, str]) -> None:
    """On a session's first run of this page, a link's values (``view_link``) set the widgets; a link
    naming a checkpoint this page cannot open leaves a notice (``link_refusal``), shown while the
    checkpoint the page opened instead stays picked."""
    if st.session_state.get("graph_link_read") or st.query_params.get("page") != "Graph":
        return
    st.session_state["graph_link_read"] = True
    refusal = link_refusal(st.query_params.to_dict(), names, known)
    if refusal is not None:
        fallback = common.DEFAULT_CHECKPOINT if common.DEFAULT_CHECKPOINT in names else names[0]
        st.session_state["graph_link_notice"] = (f"{refusal} Showing `{fallback}` instead.", fallback)
    for key, value in link_state(st.query_params.to_dict(), names).items():
        st.session_state[key] = value
        if key in LINKED_TOKENS or key == "graph_held":
            st.session_state[f"{key}__link"] = True  # _target (_held) keeps it for the link's prompt
    if "graph_prompt" in st.query_params:  # a typed prompt: it no longer follows the checkpoint's default
        st.session_state.pop("graph_prompt__default", None)


def export_json(graph, slug: str, node_threshold: float, edge_threshold: float) -> str:
    """The graph, pruned at the page's thresholds, as circuit-tracer's graph JSON (what
    ``Graph.to_circuit_tracer`` writes to ``{slug}.json``; its viewer and Neuronpedia open it)."""
    return json.dumps(graph.to_circuit_tracer_dict(slug, node_threshold=node_threshold, edge_threshold=edge_threshold),
                      indent=2)


def _export(full, name: str, node_threshold: float, edge_threshold: float) -> None:
    a, b = st.columns([1, 2])
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in name) or "graph"
    # The JSON is made only when the button is pressed (a callable): most views are never exported.
    a.download_button("Export (circuit-tracer JSON)", functools.partial(export_json, full, slug, node_threshold,
                                                                      edge_threshold),
                      file_name=f"{slug}.json", mime="application/json", key="graph_export", on_click="ignore",
                      help="The pruned graph as circuit-tracer writes it: its local viewer and Neuronpedia open it.")
    b.markdown(f"[Link to this view]({view_link(st.session_state)}) (the checkpoint, prompt, target, sliders and "
               "open feature)")


def _default_prompt(ckpt: common.Checkpoint):
    """A real model's IOI sentence, the stories one for a stories model, the checkpoint's own otherwise."""
    if pretrained.is_text_model(ckpt.path):
        return pretrained.PROMPT
    return IOI_PROMPT if _is_text(ckpt) else None


def _is_text(ckpt: common.Checkpoint) -> bool:
    return not isinstance(ckpt.tokenizer, common.IdTokenizer)


def _target(ckpt: common.Checkpoint, ids: tuple[int, ...]):
    """None (the top logits), a token id, or (a, b) for a logit difference; False after a message."""
    a, b, c = st.columns([2, 2, 2])
    how = a.radio("Target", list(TARGETS), key="graph_target", format_func=TARGETS.get, persist_state="session")
    if how == "top":
        return None
    suggestion = common.analysis(suggest_answer, ckpt.key, ids, pos=len(ids) - 1, meta=ckpt.meta)
    for key in LINKED_TOKENS:  # a link's token (an empty minus token too) holds for the prompt it opened
        if st.session_state.pop(f"{key}__link", False):
            st.session_state[f"{key}__context"] = ids
    common.follow_default("graph_answer", suggestion["answer_str"], ids)
    common.follow_default("graph_wrong", suggestion["wrong_str"], ids)
    answer = b.text_input("Token", key="graph_answer", help=f"Default: {suggestion['source']}.")
    wrong = c.text_input("minus token (optional)", key="graph_wrong", help="Empty: the token's logit alone.")
    try:
        first = common.token_id(ckpt, answer, "Token")
        return (first, common.token_id(ckpt, wrong, "Minus token")) if wrong.strip() else first
    except ValueError as e:
        st.warning(str(e))
        return False


def adds_bos(tokenizer):
    """Whether ``tokenizer`` puts a BOS token first in what it encodes: True or False for a tokenizer
    with special tokens (a pretrained model's), None for the workbench's own (word, character, byte,
    BPE, ids), which have no BOS."""
    if getattr(tokenizer, "token_id", None) is None:
        return None
    return tokenizer_prepends_bos(tokenizer)


def default_held(tokenizer) -> int:
    """The graph's held positions by default: 1 for a pretrained model whose tokenizer adds no BOS (its
    first token is the attention sink: SmolLM2-135M's default graph put a cluster of features at position
    0, and circuit-tracer's graphs hold position 0 out), else 0 (a BOS is a position of its own; the
    workbench's own tokenizers have none, and its models keep every position, as before)."""
    return 1 if adds_bos(tokenizer) is False else 0


def _held(ckpt: common.Checkpoint, ids: tuple[int, ...]) -> int:
    """The held positions widget: its default follows the checkpoint (``default_held``); a link's holds."""
    default = default_held(ckpt.tokenizer)
    if st.session_state.pop("graph_held__link", False):
        st.session_state["graph_held__context"] = ckpt.key
    common.follow_default("graph_held", default, ckpt.key)
    st.session_state["graph_held"] = min(int(st.session_state["graph_held"]), len(ids) - 1)
    held = st.number_input("Held positions", 0, len(ids) - 1, step=1, key="graph_held",
                           help="The first this many positions get no feature and no error nodes (their features "
                                "held at zero, their MLP outputs constants): circuit-tracer holds position 0.")
    if held and default:
        st.caption(f"This model's tokenizer adds no BOS token, so its first token ({ckpt.tokenizer.token_str(ids[0])!r}) "
                   f"acts as the attention sink: the first {held} position(s) are held out of the graph by default "
                   "(circuit-tracer's convention). Set 0 to keep them.")
    return int(held)


def compact(n: int) -> str:
    """A count short enough for a metric in a quarter of the page: 2,709 -> 2.7k, 27,130 -> 27.1k."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _summary(full, pruned) -> None:
    scores = full.scores()
    cols = st.columns(4)
    cols[0].metric("Nodes kept", f"{pruned.n_nodes} of {full.n_nodes}")
    cols[1].metric("Edges kept", f"{compact(pruned.n_edges)} of {compact(full.n_edges)}",
                   help=f"{pruned.n_edges:,} of {full.n_edges:,} edges.")  # "2,709 of 27,130" did not fit
    cols[2].metric("Replacement score", f"{scores['replacement']:.2f}",
                   help="circuit-tracer's: the share of influence from tokens rather than error nodes.")
    cols[3].metric("Completeness", f"{scores['completeness']:.2f}",
                   help="circuit-tracer's: the share of the nodes' inputs not from error nodes, weighted by influence.")
    st.caption("Targets: " + ", ".join(f"{label!r}" for label in full.logit_labels)
               + ". x: position, y: layer; size: influence on the targets; width: |edge weight|; blue excites, "
                 "red inhibits. Click a feature for its card; drag a box to zoom in, double-click to zoom out.")


def _select(key: str) -> None:
    """A click on a node of the graph opens it (before the page redraws)."""
    node = common.clicked_node(st.session_state.get(key))
    if node is not None and node.startswith("F"):
        st.session_state["graph_node"] = node


def _supernodes(nodes: pd.DataFrame) -> dict[str, list[str]]:
    """{name: feature ids} of the group the user names (empty: nothing collapsed)."""
    with st.expander("Supernodes"):
        features = nodes.loc[nodes["kind"] == "feature", "id"].tolist()
        kept = [f for f in st.session_state.get("graph_group", []) if f in features]
        st.session_state["graph_group"] = kept
        chosen = st.multiselect("Features to group", features, key="graph_group")
        name = st.text_input("Group name", value="group", key="graph_group_name")
        if len(chosen) < 2:
            st.caption("Pick two or more features: the graph redraws with them collapsed into one node.")
            return {}
        return {name.strip() or "group": chosen}


# ---- a feature's card ---------------------------------------------------------------------------------
@st.cache_data(max_entries=64, show_spinner=False)
def _contexts(key: tuple[str, int], ref: tuple[str, int], layer: int, feature: int, n_sequences: int) -> pd.DataFrame:
    """``max_activating_contexts`` of one layer's feature on the task's first validation sequences."""
    model, lock = common.model_for(key)
    from workbench.checkpoint import read_meta

    with lock, torch.no_grad():
        tokens = dataset_tokens(model, task_from_meta(read_meta(key[0])), n_sequences)
        return max_activating_contexts(model, _layer_dictionary(common.load_replacement(*ref), layer), tokens, feature=feature,
                                       k=10, n_sequences=n_sequences)


def _card(ckpt: common.Checkpoint, ref, nodes: pd.DataFrame, features: list[str]) -> str:
    """The open feature's card; returns its node id."""
    st.subheader("A feature")
    if st.session_state.get("graph_node") not in features:
        st.session_state["graph_node"] = features[0]
    chosen = st.selectbox("Feature node", features, key="graph_node",
                          help="Layer.position.feature id; a click on the graph picks one too.")
    row = nodes.set_index("id").loc[chosen]
    cols = st.columns(3)
    cols[0].metric("Activation here", f"{row['activation']:.3f}")
    cols[1].metric("Influence", f"{row['influence']:.3f}")
    cols[2].metric("At", f"layer {int(row['layer'])}, position {int(row['pos'])}")
    try:
        task_from_meta(ckpt.meta)
    except ValueError:
        st.info(f"{ckpt.name} was not trained on a task of the workbench's (a pretrained model has none), so "
                "the card has no text of its own to search for this feature's max-activating contexts.")
        return chosen
    contexts = _contexts(ckpt.key, ref, int(row["layer"]), int(row["feature"]), 64)
    if contexts.empty:
        st.info(f"Feature {int(row['feature'])} of layer {int(row['layer'])} never fires on 64 task sequences.")
        return chosen
    fig = viz.feature_contexts_figure(contexts)
    fig.update_layout(title=f"{chosen}: max-activating contexts (64 validation sequences)")
    common.show(fig, key="graph_contexts")
    return chosen


# ---- interventions --------------------------------------------------------------------------------------
def target_rows(graph, target, logits: torch.Tensor) -> dict[str, float]:
    """label -> value at the last position of what the graph targets (logits, or a logit difference)."""
    last = logits[-1]
    if isinstance(target, tuple):
        a, b = target
        return {graph.logit_labels[0]: float(last[a] - last[b])}
    ids = graph.feature[graph.nodes_of("logit")].tolist()
    return {label: float(last[i]) for label, i in zip(graph.logit_labels, ids) if i >= 0}


def _intervene(ckpt: common.Checkpoint, graph, nodes: pd.DataFrame, features: list[str], target, opened: str) -> None:
    st.subheader("Intervene")
    a, b, c = st.columns([2, 1, 3])
    common.follow_default("graph_iv_feature", opened, opened)  # the feature whose card is open, until changed here
    chosen = a.selectbox("Set the feature", features, key="graph_iv_feature", persist_state="session")
    value = b.number_input("to", value=0.0, step=0.5, key="graph_iv_value", persist_state="session")
    mode = c.radio("In", list(MODES), key="graph_iv_mode", format_func=MODES.get, persist_state="session")
    row = nodes.set_index("id").loc[chosen]
    triple = (int(row["layer"]), int(row["pos"]), int(row["feature"]))
    with ckpt.lock:
        before = graph.intervene([], 0.0)
        after = graph.intervene([triple], float(value), freeze_attention=mode == "frozen", direct_only=mode == "direct")
    old, new = target_rows(graph, target, before), target_rows(graph, target, after)
    frame = pd.DataFrame({"target": list(old), "before": list(old.values()), "after": [new[k] for k in old]})
    frame["change"] = frame["after"] - frame["before"]
    st.caption(f"{chosen} (activation {row['activation']:.3f}) set to {value:g}; at the last position.")
    common.table(frame.round(4))
