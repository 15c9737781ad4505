"""Circuits (``analysis.circuits``): the circuit drawn over the layer x head grid, a benchmark's
results, and the Circuit page's clickable graph."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench.viz._common import SEQUENTIAL, STEP_MARK, _template


# ---- circuits --------------------------------------------------------------------------------------
INPUT_COLOURS = {"q": "#2f6db5", "k": "#d1495b", "v": "#2ca02c", "mlp": "#9467bd", "logits": "#7f7f7f"}


def _circuit_position(label: str, n_layers: int, n_heads: int) -> tuple[float, float]:
    """Where a node sits: layers left to right (heads of layer l at 2l+1, its MLP half a step on),
    heads top to bottom, the MLP below them, embed and logits at the ends."""
    from workbench.analysis.common import parse_unit  # here, not at the top: this section is appended

    if label == "embed":
        return 0.0, (n_heads - 1) / 2
    if label == "logits":
        return 2.0 * n_layers + 1, (n_heads - 1) / 2
    layer, head, part = parse_unit(label)
    if head is not None:
        return 2.0 * layer + 1, float(head)
    return 2.0 * layer + 1.6, float(n_heads)


EDGE_BEND = 0.35  # how far apart (in heads) the middles of two edges between the same two nodes are drawn


def _edge_bends(edges: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(each edge's bend, whether it shares both ends with another edge): bend 0 for an edge alone
    between its two nodes; edges that share both ends (a head's q, k and v inputs from one sender,
    the K-composition among them) fan out EDGE_BEND apart, in the order q, k, v, MLP, logits, so
    none is drawn over another (the middle one of an odd count stays straight)."""
    order = {kind: j for j, kind in enumerate(INPUT_COLOURS)}
    groups: dict[tuple[str, str], list[int]] = {}
    for i in range(len(edges)):
        groups.setdefault((edges["sender"].iloc[i], edges["receiver"].iloc[i].split(".")[0]), []).append(i)
    bends, shared = np.zeros(len(edges)), np.zeros(len(edges), dtype=bool)
    for members in groups.values():
        shared[members] = len(members) > 1
        members = sorted(members, key=lambda i: order.get(edges["input"].iloc[i], len(order)))
        for j, i in enumerate(members):
            bends[i] = (j - (len(members) - 1) / 2) * EDGE_BEND
    return bends, shared


def _bent_edge(start: tuple[float, float], end: tuple[float, float], bend: float, points: int = 21):
    """(xs, ys) of the quadratic curve from ``start`` to ``end`` whose middle sits ``bend`` off the
    straight line (to its left, going from start to end); a straight line for bend 0."""
    (x0, y0), (x1, y1) = start, end
    if not bend:
        return [x0, x1], [y0, y1]
    length = float(np.hypot(x1 - x0, y1 - y0)) or 1.0
    nx, ny = -(y1 - y0) / length, (x1 - x0) / length
    cx, cy = (x0 + x1) / 2 + 2 * bend * nx, (y0 + y1) / 2 + 2 * bend * ny  # the curve's middle: half way to this
    t = np.linspace(0.0, 1.0, points)
    xs = (1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t ** 2 * x1
    ys = (1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t ** 2 * y1
    return xs.tolist(), ys.tolist()


def _middle(values: list) -> float:
    """The middle point's coordinate of a line drawn through ``values`` (an odd count has one)."""
    n = len(values)
    return float(values[n // 2]) if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def circuit_figure(edges: pd.DataFrame, title: str = "Circuit", theme: str = "light") -> go.Figure:
    """A circuit as a layered graph, from ``Circuit.to_frame()`` (or any table with sender, receiver,
    input and, optionally, score columns: line width follows |score|).

    Nodes sit by layer (left to right) and head (top to bottom); an edge's colour names the input it
    feeds (a head's q, k or v, an MLP, the logits), so K-composition reads as a red line between two
    heads. Every head of the model is drawn faintly when the table's ``attrs`` give n_layers and n_heads.
    Edges between the same two nodes (a head's q, k and v from one sender) are bent apart and each
    is named on its curve.
    """
    missing = [c for c in ("sender", "receiver", "input") if c not in edges]
    if missing:
        raise ValueError(f"the table needs columns sender, receiver and input (Circuit.to_frame()); missing {missing}")
    layers = [int(v) for v in pd.concat([edges.get("sender_layer", pd.Series(dtype=int)),
                                         edges.get("receiver_layer", pd.Series(dtype=int))]) if v >= 0]
    heads = [int(v) for v in pd.concat([edges.get("sender_head", pd.Series(dtype=int)),
                                        edges.get("receiver_head", pd.Series(dtype=int))]) if v >= 0]
    n_layers = int(edges.attrs.get("n_layers", max(layers, default=0) + 1))
    n_heads = int(edges.attrs.get("n_heads", max(heads, default=0) + 1))
    score = edges["score"].abs().fillna(0.0).to_numpy() if "score" in edges else np.zeros(len(edges))
    top = score.max() if len(score) and score.max() > 0 else 1.0
    fig = go.Figure()
    if "n_layers" in edges.attrs:
        xs, ys = zip(*[(2.0 * l + 1, float(h)) for l in range(n_layers) for h in range(n_heads)])
        fig.add_scatter(x=xs, y=ys, mode="markers", marker=dict(size=9, color="rgba(128,128,128,0.25)"),
                        hoverinfo="skip", showlegend=False)
    ends = [(_circuit_position(edges["sender"].iloc[i], n_layers, n_heads),
             _circuit_position(edges["receiver"].iloc[i].split(".")[0], n_layers, n_heads)) for i in range(len(edges))]
    bends, shared = _edge_bends(edges)
    curves = [_bent_edge(a, b, bend) for (a, b), bend in zip(ends, bends)]
    for kind, colour in INPUT_COLOURS.items():
        part = np.nonzero((edges["input"] == kind).to_numpy())[0]
        if not len(part):
            continue
        for i in part:  # one line per edge: widths differ
            xs, ys = curves[i]
            fig.add_scatter(x=xs, y=ys, mode="lines", line=dict(color=colour, width=1 + 5 * score[i] / top),
                            legendgroup=kind, name=kind, showlegend=bool(i == part[0]), hoverinfo="skip")
            if shared[i]:  # edges drawn apart between the same two nodes are each named on their line
                fig.add_annotation(x=_middle(xs), y=_middle(ys), text=kind, showarrow=False, font=dict(size=10, color=colour),
                                   bgcolor="rgba(255,255,255,0.8)", borderpad=0)
        mids = [(_middle(curves[i][0]), _middle(curves[i][1])) for i in part]
        text = [f"{edges['sender'].iloc[i]} -> {edges['receiver'].iloc[i]}"
                + (f"<br>score {edges['score'].iloc[i]:.4g}" if "score" in edges else "") for i in part]
        fig.add_scatter(x=[m[0] for m in mids], y=[m[1] for m in mids], mode="markers", text=text,
                        marker=dict(size=8, color=colour, opacity=0.01), legendgroup=kind, showlegend=False,
                        hovertemplate="%{text}<extra></extra>")
    nodes = list(dict.fromkeys([*edges["sender"], *(r.split(".")[0] for r in edges["receiver"])]))
    points = [_circuit_position(label, n_layers, n_heads) for label in nodes]
    fig.add_scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers", text=nodes,
                    marker=dict(size=14, color="#444", line=dict(width=1, color="white")),
                    showlegend=False, hovertemplate="%{text}<extra></extra>")
    # Labels as annotations on a pale box: plotly draws them above every trace, so no edge runs
    # through a node's name (a trace's own text sits among the lines).
    for label, (x, y) in zip(nodes, points):
        fig.add_annotation(x=x, y=y, text=label, showarrow=False, yshift=15, font=dict(size=11, color="#222"),
                           bgcolor="rgba(255,255,255,0.85)", borderpad=1)
    ticks = [0.0, *(2.0 * l + 1 for l in range(n_layers)), 2.0 * n_layers + 1]
    fig.update_xaxes(tickvals=ticks, ticktext=["embed", *(f"L{l}" for l in range(n_layers)), "logits"],
                     showgrid=False, zeroline=False)
    fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False)
    fig.update_layout(title=title, template=_template(theme), height=360 + 20 * n_heads, margin=dict(t=50),
                      legend_title_text="input")
    return fig


def circuit_benchmark_figure(results: pd.DataFrame, value: str = "edge_auroc", title: str = "",
                             theme: str = "light") -> go.Figure:
    """A method x model heatmap of one column of the circuit benchmark's table (values written in)."""
    missing = [c for c in ("model", "method", value) if c not in results]
    if missing:
        raise ValueError(f"the table needs columns model, method and {value!r}; missing {missing}")
    grid = results.pivot_table(index="method", columns="model", values=value, aggfunc="first", sort=False)
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=list(grid.columns), y=list(grid.index), zmin=0, zmax=1,
                               colorscale=SEQUENTIAL, text=np.round(grid.to_numpy(), 3), texttemplate="%{text}",
                               hovertemplate="%{y} on %{x}: %{z:.4f}<extra></extra>", colorbar=dict(title=value)))
    fig.update_layout(title=title or value, template=_template(theme), height=120 + 45 * len(grid),
                      margin=dict(t=50))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return fig


def circuit_graph_figure(edges: pd.DataFrame, title: str = "Circuit", selected: Optional[str] = None,
                         theme: str = "light") -> go.Figure:
    """``circuit_figure`` whose nodes can be clicked: each node point carries its label as
    ``customdata`` (what a page's selection event returns), and ``selected`` is ringed."""
    fig = circuit_figure(edges, title=title, theme=theme)
    nodes = fig.data[-1]  # circuit_figure draws the nodes last, on top of the edges
    nodes.customdata = [[label] for label in (nodes.text or ())]
    nodes.hovertemplate = "%{text}<br>click for its attention and DLA<extra></extra>"
    if selected is not None and nodes.text is not None and selected in nodes.text:
        i = list(nodes.text).index(selected)
        fig.add_scatter(x=[nodes.x[i]], y=[nodes.y[i]], mode="markers", hoverinfo="skip", showlegend=False,
                        marker=dict(size=26, color="rgba(0,0,0,0)", line=dict(width=3, color=STEP_MARK)))
        fig.data = (*fig.data[:-2], fig.data[-1], fig.data[-2])  # the ring under the clickable nodes
    fig.update_layout(clickmode="event+select", dragmode=False, hovermode="closest")
    return fig
