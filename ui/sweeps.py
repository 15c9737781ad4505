"""Sweeps: open what the scripts in ``experiments/`` wrote under ``runs/<name>/``.

A run directory holds config.json, results.csv (a tidy table) and figures as HTML;
some also hold metrics.csv (loss curves). Pick one run or several (their tables are
stacked with a ``run`` column), filter the rows, and chart any column against another.
The folder is ``--runs DIR`` (after ``--``), else $WORKBENCH_RUNS, else ``runs/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st

from ui import common
from ui.common.runs import runs_root
from workbench import viz

RESULTS = "results.csv"
MAX_FILTER_VALUES = 40  # columns with more distinct values than this get a range filter, if numeric


def list_runs(root: Path) -> dict[str, Path]:
    """Run name -> directory, for every directory under ``root`` holding a results.csv (nested too)."""
    if not root.is_dir():
        return {}
    found = sorted(p.parent for p in root.rglob(RESULTS))
    return {str(p.relative_to(root)): p for p in found}


@st.cache_data(max_entries=64, show_spinner=False)
def read_results(path: str, stamp: float) -> pd.DataFrame:
    return pd.read_csv(path)


def render() -> None:
    st.header("Sweeps")
    root = runs_root()
    runs = list_runs(root)
    if not runs:
        st.info(f"No runs under `{root}` yet. Each script in `experiments/` writes one, e.g. "
                "`python experiments/head_ablation_sweep.py --quick`; or point the app at another folder "
                "with `./workbench.sh app -- --runs DIR` or $WORKBENCH_RUNS.")
        return
    chosen = st.multiselect("Runs", list(runs), default=list(runs)[:1], key="sweeps_runs", persist_state="session")
    if not chosen:
        st.info("Pick one run, or several to compare them.")
        return
    frames = []
    for name in chosen:
        path = runs[name] / RESULTS
        try:
            frames.append(read_results(str(path), path.stat().st_mtime).assign(run=name))
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as e:
            st.warning(f"Cannot read `{path}`: {e}")
    if not frames:
        return
    table = pd.concat(frames, ignore_index=True)
    filtered = _filters(table)
    st.caption(f"{len(filtered)} of {len(table)} rows")
    common.table(filtered, height=min(320, 35 * (len(filtered) + 1) + 3))
    st.download_button("Download the filtered table (CSV)", filtered.to_csv(index=False), "results.csv", key="sweeps_csv")
    _chart(filtered)
    _curves(chosen, runs)
    for name in chosen:
        _run_files(name, runs[name])


def _filters(table: pd.DataFrame) -> pd.DataFrame:
    with st.expander("Filter rows", expanded=True):
        cols = st.columns(3)
        mask = pd.Series(True, index=table.index)
        i = 0
        for column in table.columns:
            values = table[column].dropna().unique()
            if len(values) < 2:
                continue
            where = cols[i % 3]
            if len(values) <= MAX_FILTER_VALUES and not pd.api.types.is_float_dtype(table[column]):
                keep = where.multiselect(column, sorted(values, key=str), key=f"sweeps_f_{column}",
                                         persist_state="session")
                if keep:
                    mask &= table[column].isin(keep)
                i += 1
            elif pd.api.types.is_numeric_dtype(table[column]):
                lo, hi = float(table[column].min()), float(table[column].max())
                low, high = where.slider(column, lo, hi, (lo, hi), key=f"sweeps_f_{column}", persist_state="session")
                mask &= table[column].between(low, high) | table[column].isna()
                i += 1
    return table[mask]


EFFECT_WORDS = ("delta", "effect", "restored", "difference", "metric", "score", "loss", "accuracy")


def _chart(table: pd.DataFrame) -> None:
    numeric = [c for c in table.columns if pd.api.types.is_numeric_dtype(table[c])]
    if not numeric or table.empty:
        return
    st.subheader("Chart")
    cols = st.columns(4)
    others = [c for c in table.columns if c not in numeric]
    x = cols[0].selectbox("x", list(table.columns), index=list(table.columns).index(others[0] if others else numeric[0]),
                          key="sweeps_x", persist_state="session")
    # y defaults to the effect being measured, in the order the words say it best.
    effect = next((c for word in EFFECT_WORDS for c in numeric if word in c.lower()), numeric[-1])
    y = cols[1].selectbox("y", numeric, index=numeric.index(effect), key="sweeps_y", persist_state="session")
    several = table["run"].nunique() > 1
    color = cols[2].selectbox("colour", ["(none)"] + list(table.columns),
                              index=1 + list(table.columns).index("run") if several else 0,
                              key="sweeps_color", persist_state="session")
    kind = cols[3].radio("kind", ["bar", "line", "scatter"], horizontal=True, key="sweeps_kind",
                         persist_state="session")
    if {"layer", "head"} <= set(table.columns) and st.toggle("As a layer x head heatmap", value=True,
                                                             key="sweeps_lh", persist_state="session"):
        table, facet, note = heatmap_panels(table)
        st.caption(note)
        common.show(viz.layer_head_figure(table, value=y, facet=facet, title=f"{y} by layer and head",
                                          columns=min(3, table[facet].nunique()) if facet else None),
                    key="sweeps_heatmap")
        return
    fig, note = viz.table_chart(table, x, y, None if color == "(none)" else color, kind)
    if note:
        st.caption(note)
    common.show(fig, key="sweeps_chart")


FACETS = ("method", "kind", "variant", "metric")


def heatmap_panels(table: pd.DataFrame) -> tuple[pd.DataFrame, Optional[str], str]:
    """(table, facet column, what the caption says) for the layer x head heatmap: runs are never
    pooled into one cell (two runs can be different models with different heads, or measure
    different metrics), nor are the values of a column such as ``method``; one panel per run and
    per such value, and the caption says how many rows each cell still averages."""
    split = [c for c in FACETS if c in table and table[c].nunique() > 1]
    if table["run"].nunique() > 1:
        split = ["run"] + split
    if not split:
        facet, shown = None, table
    elif len(split) == 1:
        facet, shown = split[0], table
    else:
        facet = "panel"
        shown = table.assign(panel=table[split].astype(str).agg(" · ".join, axis=1))
    per_cell = shown.groupby(([facet] if facet else []) + ["layer", "head"]).size()
    why = ""
    if "run" in split:
        why = "One panel per run: runs are never pooled into one cell (" + _run_differences(table) + "). "
    elif facet:
        why = f"One panel per {' and '.join(split)}. "
    pooled = (f"Each cell averages {per_cell.min()}-{per_cell.max()} rows (filter the rows to see fewer)."
              if per_cell.max() > 1 else "Each cell is one row.")
    return shown, facet, why + pooled


def _run_differences(table: pd.DataFrame) -> str:
    """What differs between the runs of ``table``: their checkpoints, their heads, their metrics."""
    words = []
    runs = table.groupby("run")
    shapes = {run: (part["layer"].nunique(), part[part["head"] >= 0]["head"].nunique()) for run, part in runs}
    if len(set(shapes.values())) > 1:
        words.append("their models have " + ", ".join(f"{r}: {l} layers x {h} heads" for r, (l, h) in shapes.items()))
    for column in ("checkpoint", "model", "metric"):
        if column in table and runs[column].first().nunique() > 1:
            words.append(f"they differ in {column}")
    return "; ".join(words) or "they may measure different models or metrics"


def _curves(chosen: list[str], runs: dict[str, Path]) -> None:
    frames = []
    for name in chosen:
        for path in sorted(runs[name].rglob("metrics.csv")):
            label = name if path.parent == runs[name] else f"{name}/{path.parent.relative_to(runs[name])}"
            metrics = common.training_curve(path)
            if metrics is not None:
                frames.append(metrics.assign(run=label))
    if frames:
        st.subheader("Loss curves")
        common.show(viz.loss_curves(pd.concat(frames, ignore_index=True)), key="sweeps_curves")


@st.cache_data(max_entries=16, show_spinner=False)
def read_figure(path: str, stamp: float) -> tuple[str, object]:
    """("figure", the plotly figure) for an HTML file plotly wrote, else ("html", the page with
    its local scripts inlined): an iframe's srcdoc has no folder to load plotly.min.js from."""
    html = Path(path).read_text(encoding="utf-8", errors="replace")
    fig = viz.figure_from_html(html)
    if fig is not None:
        return "figure", fig
    return "html", viz.self_contained_html(html, Path(path).parent)


def _run_files(name: str, path: Path) -> None:
    with st.expander(f"{name}: config and figures", expanded=True):
        config = path / "config.json"
        if config.is_file():
            try:
                st.json(json.loads(config.read_text()), expanded=False)
            except json.JSONDecodeError as e:
                st.warning(f"`{config}` is not valid JSON: {e}")
        figures = sorted(path.glob("*.html"))
        if figures:
            shown = st.selectbox("Figure", [f.name for f in figures], key=f"sweeps_fig_{name}", persist_state="session")
            try:
                kind, content = read_figure(str(path / shown), (path / shown).stat().st_mtime)
            except OSError as e:
                st.warning(f"Cannot read `{path / shown}`: {e}")
                return
            if kind == "figure":
                common.show(content, key=f"sweeps_figure_{name}")
            else:
                st.iframe(content, height=560)
