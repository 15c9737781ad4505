"""The Graph page's QK panel: why a head attended where it did (``analysis.qk_attribution``).

Opened with its toggle under the graph. The user picks an attention edge: one of the graph's
attention entries (``analysis.attention_entries``: each (layer, head, query, key) weighted by how
much of the graph's targets flows through it; the largest is the default), or a layer, a head, a
query position and a key position (the selectors, or a click on a cell of the head's attention
pattern; the key follows where the head attends most from the query until picked); the list always
shows the open edge, its entry or, for an edge it does not hold, none. The page shows the edge's score
split into (query-side node, key-side node) pairs as a table and as a query x key heatmap, the
bilinear part and the residual, and, for a pair picked in the table's top rows (or clicked on the
heatmap), the exact change of the attention weight when that pair's key-side node is removed (a
re-run with its contribution to the key patched out). Everything is computed by the library; the
results are cached by value.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from ui import common
from workbench import analysis as an
from workbench import viz

TOP = 20  # pairs in the table and the heatmap
EXACT = 5  # pairs whose key-side node's removal is re-run exactly


@st.cache_data(max_entries=64, show_spinner="QK attribution of this attention edge…")
def _qk(graph_key: tuple, layer: int, head: int, query_pos: int, key_pos: int) -> tuple[pd.DataFrame, dict]:
    """(table, attrs) of ``qk_attribution`` on the page's graph; ``graph_key`` = ``common.cached_graph``'s arguments."""
    model, lock = common.model_for(graph_key[0])
    with lock:
        table = an.qk_attribution(common.cached_graph(*graph_key), layer, head, query_pos, key_pos, top=TOP, exact=EXACT)
    return table, dict(table.attrs)


ENTRIES = 30  # the graph's attention entries offered, largest |weight| first


@st.cache_data(max_entries=16, show_spinner=False)
def _entries(graph_key: tuple) -> pd.DataFrame:
    """The graph's attention entries of largest |weight| (``analysis.attention_entries``)."""
    model, lock = common.model_for(graph_key[0])
    with lock:
        return an.attention_entries(common.cached_graph(*graph_key)).head(ENTRIES)


def _entry_label(e) -> str:
    return (f"L{int(e.layer)}H{int(e.head)}: query {int(e.query_pos)} -> key {int(e.key_pos)} "
            f"(weight {e.weight:+.3f}, attention {e.pattern:.2f})")


def _set_edge(layer: int, head: int, query: int, key: int) -> None:
    st.session_state["graph_qk_layer"], st.session_state["graph_qk_head"] = int(layer), int(head)
    st.session_state["graph_qk_shown_head"] = (int(layer), int(head))  # this edge is the head's: keep it
    st.session_state["graph_qk_query"] = int(query)
    st.session_state["graph_qk_key_clicked"] = int(key)  # set after the key's default follows the query


def _entry_chosen(entries: dict) -> None:
    """An attention entry picked in the list sets the four selectors."""
    _set_edge(*entries[st.session_state["graph_qk_entry"]])


def _clicked(event: Any, n: int) -> list | None:
    """The ``customdata`` row a click on a heatmap cell selected (its first ``n`` values), else None."""
    for point in (event or {}).get("selection", {}).get("points", []):
        data = point.get("customdata")
        if isinstance(data, dict):  # a typed array's row, as a browser serialises it
            data = [data.get(str(i)) for i in range(len(data))]
        if isinstance(data, (list, tuple)) and len(data) >= n and None not in data[:n]:
            return list(data[:n])
    return None


def _edge_clicked() -> None:
    """A click on a cell of the attention pattern picks that attention edge (before the page redraws)."""
    cell = _clicked(st.session_state.get("graph_qk_pattern"), 2)
    if cell is not None:
        st.session_state["graph_qk_query"] = int(cell[0])
        st.session_state["graph_qk_key_clicked"] = int(cell[1])  # set after the key's default follows the query


def _pair_clicked() -> None:
    """A click on a cell of the QK heatmap picks that pair for the removal below."""
    cell = _clicked(st.session_state.get("graph_qk_heatmap"), 2)
    if cell is not None:
        st.session_state["graph_qk_pair_clicked"] = f"{cell[0]} x {cell[1]}"


def _entry_picker(where, options: dict, edge: tuple[int, int, int, int]) -> None:
    """The list of the graph's attention entries, showing the open edge: its entry where the list
    has it, else none (a click on the pattern or the selectors can open any edge)."""
    listed = [name for name, e in options.items() if tuple(int(v) for v in e) == edge]
    st.session_state["graph_qk_entry"] = listed[0] if listed else None
    layer, head, query, key = edge
    where.selectbox("Attention edge of the graph (largest weight first)", list(options), key="graph_qk_entry",
                    on_change=_entry_chosen, args=(options,), index=None,
                    placeholder=f"L{layer}H{head}: query {query} -> key {key} is not among the graph's "
                                f"{len(options)} largest entries",
                    help="Weight: how much of the graph's targets flows through this entry of the frozen pattern.")


def strongest_entry(entries: pd.DataFrame, layer: int, head: int):
    """(query, key) of head ``layer``.``head``'s entry of largest |weight| among the graph's attention
    entries (``attention_entries``, largest first), else None."""
    rows = entries[(entries["layer"] == layer) & (entries["head"] == head)]
    return None if rows.empty else (int(rows["query_pos"].iloc[0]), int(rows["key_pos"].iloc[0]))


def _follow_head(entries: pd.DataFrame, layer: int, head: int, last: int) -> None:
    """A head picked in the selectors opens its own strongest entry of the graph (else its last
    query position, the key where it attends most): the query and key picked for another head
    mean nothing for this one."""
    shown = st.session_state.get("graph_qk_shown_head")
    st.session_state["graph_qk_shown_head"] = (layer, head)
    if shown is None or shown == (layer, head):
        return
    edge = strongest_entry(entries, layer, head)
    st.session_state["graph_qk_query"] = edge[0] if edge else last
    if edge:
        st.session_state["graph_qk_key_clicked"] = edge[1]  # set after the key's default follows the query


def render(ckpt: common.Checkpoint, graph_key: tuple, ids: tuple[int, ...], str_tokens: list[str]) -> None:
    st.subheader("Why a head attended (QK)")
    if not st.toggle("Open the QK panel", key="graph_qk_open",
                     help="Split an attention score into pairs of graph nodes at the query and the key."):
        st.caption("An attribution graph freezes attention; this panel says why a head attended where it did.")
        return
    cfg = ckpt.model.cfg
    patterns = common.analysis(an.attention_patterns, ckpt.key, ids)
    try:
        entries = _entries(graph_key)
    except ValueError as e:  # attention QK attribution cannot open (MLA's latent queries and keys)
        st.info(f"QK attribution does not apply here: {e}")
        return
    options = {_entry_label(e): (e.layer, e.head, e.query_pos, e.key_pos) for e in entries.itertuples()}
    picker = st.container()  # drawn above the selectors, filled once they have settled the edge
    if options:
        fresh = st.session_state.get("graph_qk_entry__context") != graph_key
        common.follow_default("graph_qk_entry", next(iter(options)), graph_key)
        if fresh:  # a new graph: open its largest attention entry
            _set_edge(*options[st.session_state["graph_qk_entry"]])
    for name, n in (("graph_qk_layer", cfg.n_layers), ("graph_qk_head", cfg.n_heads)):
        if st.session_state.get(name) not in range(n):  # from a checkpoint with more layers or heads
            st.session_state[name] = n - 1 if name == "graph_qk_layer" else 0
    a, b, c, d = st.columns(4)
    layer = a.selectbox("Layer", range(cfg.n_layers), key="graph_qk_layer")
    head = b.selectbox("Head", range(cfg.n_heads), key="graph_qk_head")
    positions = list(range(len(ids)))
    _follow_head(entries, layer, head, positions[-1])
    label = lambda p: f"{p}: {str_tokens[p]!r}" if p < len(str_tokens) else str(p)  # noqa: E731
    if st.session_state.get("graph_qk_query") not in positions:
        st.session_state["graph_qk_query"] = positions[-1]
    query = c.selectbox("Query position", positions, key="graph_qk_query", format_func=label)
    row = patterns[(patterns["layer"] == layer) & (patterns["head"] == head) & (patterns["query_pos"] == query)]
    most = int(row.loc[row["attention"].idxmax(), "key_pos"])
    # the key follows the head and the query (where it attends most) until the user picks another
    common.follow_default("graph_qk_key", most, (ids, layer, head, query))
    clicked = st.session_state.pop("graph_qk_key_clicked", None)
    if clicked is not None and clicked <= query:
        st.session_state["graph_qk_key"] = clicked
    if st.session_state["graph_qk_key"] > query:
        st.session_state["graph_qk_key"] = most
    key = d.selectbox("Key position", positions[: query + 1], key="graph_qk_key", format_func=label)
    if options:
        _entry_picker(picker, options, (layer, head, query, key))
    fig = viz.attention_figure(patterns, layer, head, clickable=True)
    fig.update_layout(title=f"Attention L{layer}H{head} (click a cell to open that edge)")
    common.show(fig, key="graph_qk_pattern", selection_mode="points", on_select=_edge_clicked)
    weight = float(row.loc[row["key_pos"] == key, "attention"].iloc[0])
    try:
        table, attrs = _qk(graph_key, layer, head, query, key)
    except ValueError as e:
        st.error(f"Cannot attribute this attention edge: {e}")
        return
    cols = st.columns(4)
    cols[0].metric("Attention weight", f"{weight:.3f}", help=f"L{layer}H{head}, query {query} -> key {key}")
    cols[1].metric("Score q·k", f"{attrs['score']:.3f}", help="Before the softmax, after the model's own scale.")
    cols[2].metric("Sum of the pairs", f"{attrs['bilinear']:.3f}", help="The bilinear part, exactly the pairs' sum.")
    cols[3].metric("Residual", f"{attrs['residual']:.2g}", help="Score minus the pairs' sum: what the pairs leave out.")
    fig = viz.qk_heatmap_figure(table, title=f"L{layer}H{head}, query {query} -> key {key}: top {len(table)} QK pairs "
                                             "(click a pair)")
    common.show(fig, key="graph_qk_heatmap", selection_mode="points", on_select=_pair_clicked)
    shown = table.assign(pair=table["query_node"] + " x " + table["key_node"])
    common.table(shown[["pair", "query_kind", "key_kind", "contribution", "pattern_change"]].round(4), height=260)
    _removal(shown, weight)


def _removal(shown: pd.DataFrame, weight: float) -> None:
    """The exact change of the attention weight when one pair's key-side node is removed."""
    exact = shown[shown["pattern_change"].notna()]
    if exact.empty:
        return
    options = exact["pair"].tolist()
    clicked = st.session_state.pop("graph_qk_pair_clicked", None)
    if clicked in options:
        st.session_state["graph_qk_pair"] = clicked
    elif clicked is not None:
        st.info(f"{clicked} is past the first {len(options)} pairs, whose removal is re-run exactly.")
    if st.session_state.get("graph_qk_pair") not in options:
        st.session_state["graph_qk_pair"] = options[0]
    pair = st.selectbox("Remove the key-side node of", options, key="graph_qk_pair",
                        help="A re-run with that node's contribution to the key patched out.")
    change = float(exact.set_index("pair").loc[pair, "pattern_change"])
    node = pair.split(" x ")[1]
    cols = st.columns(3)
    cols[0].metric("Attention before", f"{weight:.3f}")
    cols[1].metric(f"Without {node} at the key", f"{weight + change:.3f}")
    cols[2].metric("Change", f"{change:+.3f}")
