"""Plotly figures drawn from the analysis DataFrames (never from raw tensors).

Each function takes the table an analysis call returned and gives a ``plotly`` Figure:
attention patterns (one head, or every head in one mosaic heatmap, or a change of them), the
logit-lens heatmap (and its clean-minus-changed difference), direct logit attribution bars
(and their difference), a layer x head heatmap for sweeps and head scores (clickable cells
for a page), patching heatmaps, per-token loss bars (one run or several side by side),
residual-stream norms across layers, loss curves from a checkpoint's ``metrics.csv``, a
token strip with hover details, a chart of any table column, ``side_by_side`` for any two
of them, and the figure of an HTML file plotly wrote. ``theme`` is ``"light"`` or ``"dark"``
(None: no template; the default is ``"light"``, see ``set_default_theme``); colour scales are
perceptually uniform so both read well, and text on heatmaps takes plotly's automatic
contrasting colour. Tokens on axes are
position-prefixed (``"3: the"``) so repeated tokens stay distinct; units are named by
``unit_label`` (``L1H4``), as everywhere else.

One module per kind of table, as in ``workbench.analysis``: ``attention``, ``lens``,
``attribution``, ``heads``, ``patching``, ``training`` (loss), ``dynamics`` (over training),
``features``, ``circuits``, ``graphs``, ``fourier``, ``vocab``, ``layout`` and ``export``; the
themes and colours are in ``_common``. Every figure is importable from here
(``from workbench import viz; viz.attention_figure(...)``).
"""

from __future__ import annotations

from workbench.viz._common import (
    CORRECT, DIVERGING, LAST_POSITION, NEGATIVE, PAIR, PALETTE, POSITIVE, SEQUENTIAL, STEP_MARK, THEMES, WRONG,
    set_default_theme, subplot_spacing,
)
from workbench.viz.attention import attention_figure, attention_grid, token_hover_figure
from workbench.viz.lens import (
    LENS_COLOURS, MAX_LENS_TEXT, lens_difference_figure, logit_lens_figure, residual_norms_figure,
)
from workbench.viz.attribution import DLA_COLOURS, DLA_KINDS, dla_difference_figure, dla_figure
from workbench.viz.heads import head_scores_figure, layer_head_figure
from workbench.viz.patching import patching_figure, prompt_spread_figure
from workbench.viz.training import live_loss_figure, loss_curves, token_loss_figure
from workbench.viz.layout import side_by_side, table_chart, thin_ticks
from workbench.viz.features import (
    feature_contexts_figure, feature_density_figure, feature_dla_figure, feature_histogram_figure,
    feature_logits_figure, token_values_figure,
)
from workbench.viz.dynamics import layer_head_over_training, mark_step, over_training_figure, runs_over_training_figure
from workbench.viz.circuits import (
    EDGE_BEND, INPUT_COLOURS, circuit_benchmark_figure, circuit_figure, circuit_graph_figure,
)
from workbench.viz.export import figure_from_html, self_contained_html
from workbench.viz.vocab import direct_path_figure, neighbours_figure
from workbench.viz.fourier import PHASE_LABELS, fourier_norms_figure, grokking_figure
from workbench.viz.graphs import (
    GRAPH_COLOURS, GRAPH_MAX_HEIGHT, GRAPH_PLOT_WIDTH, GRAPH_SYMBOLS, attribution_graph_figure, qk_heatmap_figure,
    qk_over_training_figure,
)
from workbench.viz._common import _history_of  # noqa: F401  (the tests read it as viz._history_of)

__all__ = [
    "THEMES", "SEQUENTIAL", "DIVERGING", "POSITIVE", "NEGATIVE", "CORRECT", "WRONG", "PALETTE", "PAIR",
    "LAST_POSITION", "set_default_theme", "subplot_spacing", "STEP_MARK", "attention_figure", "attention_grid",
    "token_hover_figure", "LENS_COLOURS", "MAX_LENS_TEXT", "logit_lens_figure", "lens_difference_figure",
    "residual_norms_figure", "DLA_KINDS", "DLA_COLOURS", "dla_figure", "dla_difference_figure", "head_scores_figure",
    "layer_head_figure", "patching_figure", "prompt_spread_figure", "loss_curves", "token_loss_figure",
    "live_loss_figure", "side_by_side", "table_chart", "thin_ticks", "feature_contexts_figure",
    "feature_histogram_figure", "feature_logits_figure", "feature_density_figure", "feature_dla_figure",
    "token_values_figure", "over_training_figure", "layer_head_over_training", "mark_step",
    "runs_over_training_figure", "INPUT_COLOURS", "EDGE_BEND", "circuit_figure", "circuit_benchmark_figure",
    "circuit_graph_figure", "self_contained_html", "figure_from_html", "direct_path_figure", "neighbours_figure",
    "PHASE_LABELS", "grokking_figure", "fourier_norms_figure", "GRAPH_SYMBOLS", "GRAPH_COLOURS", "GRAPH_PLOT_WIDTH",
    "GRAPH_MAX_HEIGHT", "attribution_graph_figure", "qk_over_training_figure", "qk_heatmap_figure",
]
