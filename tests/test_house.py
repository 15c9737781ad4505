"""The house holds together after ui/common.py and workbench/viz.py became packages (issue #37,
item 10): imports among the app's modules go one way (a page imports its panels and ui.common, a
panel never imports its page, ui.common never imports a page), every name the two old modules
offered is still offered from the same place, and no module of the two packages grows back into
a file a newcomer gets lost in.

The import graph is built from the source with ``ast`` (every import counts, including those
inside functions: a lazy import is still a cycle, only hidden until something calls it)."""

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 450  # a module one can read through; the old ui/common.py had 919 lines, workbench/viz.py 1,565


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "ui") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, from the source under ``root``: ``import ui.x``,
    ``from ui import x``, ``from ui.x import y`` (y a name or a submodule) and relative imports."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in paths:  # from ui import qk_panel / from ui.common import vocabulary
                        found.add(f"{base}.{a.name}")
                    elif base in paths:  # from ui.graph import _graph
                        found.add(base)
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_the_cycle_finder_finds_a_page_panel_cycle_and_a_lazy_one(tmp_path):
    """The reference the next test relies on: the forms the old code used are all seen."""
    (tmp_path / "ui" / "common").mkdir(parents=True)
    (tmp_path / "ui" / "__init__.py").write_text("")
    (tmp_path / "ui" / "graph.py").write_text("from ui import common, qk_panel\n")
    (tmp_path / "ui" / "qk_panel.py").write_text("def f():\n    from ui.graph import _graph\n")
    (tmp_path / "ui" / "common" / "__init__.py").write_text("from .card import model_card\n")
    (tmp_path / "ui" / "common" / "card.py").write_text("def model_card():\n    import ui.vocabulary\n")
    (tmp_path / "ui" / "vocabulary.py").write_text("from ui import common\n")
    (tmp_path / "ui" / "training.py").write_text("from ui import common\n")
    found = cycles(import_graph(tmp_path))
    assert found == [["ui.common", "ui.common.card", "ui.vocabulary"], ["ui.graph", "ui.qk_panel"]]


def test_no_import_cycle_among_the_apps_modules():
    graph = import_graph(REPO)
    assert {"ui.graph", "ui.qk_panel", "ui.training", "ui.fourier_panel", "ui.common", "ui.common.card"} <= set(graph)
    assert cycles(graph) == []
    for panel, page in [("ui.qk_panel", "ui.graph"), ("ui.fourier_panel", "ui.training")]:
        assert panel in graph[page] and page not in graph[panel]  # the page imports its panel, one way
    for name, deps in graph.items():  # ui.common is below every page: it imports only its own modules
        if name.startswith("ui.common"):
            assert all(d.startswith("ui.common.") for d in deps), (name, deps)
    assert cross_page_imports(graph, page_modules(REPO)) == []


def page_modules(root: Path) -> set[str]:
    """The page modules: those whose ``render`` app.py's ``PAGES`` table draws."""
    for node in ast.walk(ast.parse((root / "app.py").read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PAGES" for t in node.targets):
            return {f"ui.{v.value.id}" for v in node.value.values if isinstance(v, ast.Attribute)}
    raise AssertionError("app.py has no PAGES table")


def cross_page_imports(graph: dict[str, set[str]], pages: set[str]) -> list[tuple[str, str]]:
    """(page, page it imports): a page shares with another page through ui.common, never directly
    (ui.graph took clicked_node from ui.circuit, so the Graph page loaded the Circuit page's module)."""
    return sorted((page, dep) for page in pages for dep in graph.get(page, ()) if dep in pages)


def test_the_page_rule_finds_a_page_importing_another_page(tmp_path):
    (tmp_path / "ui" / "common").mkdir(parents=True)
    (tmp_path / "app.py").write_text("from ui import circuit, common, graph, serve\n"
                                     "PAGES = {'Circuit': circuit.render, 'Graph': graph.render}\n")
    (tmp_path / "ui" / "__init__.py").write_text("")
    (tmp_path / "ui" / "common" / "__init__.py").write_text("")
    (tmp_path / "ui" / "circuit.py").write_text("from ui import common\n")
    (tmp_path / "ui" / "graph.py").write_text("from ui import common, qk_panel\nfrom ui.circuit import clicked_node\n")
    (tmp_path / "ui" / "qk_panel.py").write_text("from ui import common\n")
    pages = page_modules(tmp_path)
    assert pages == {"ui.circuit", "ui.graph"}  # a panel (qk_panel) or ui.serve is not a page
    assert cross_page_imports(import_graph(tmp_path), pages) == [("ui.graph", "ui.circuit")]
    assert {"ui.inspect", "ui.graph", "ui.circuit", "ui.training"} <= page_modules(REPO)


# What the old modules offered (their public top-level names at 998a852), copied from them: each
# must still be importable from the same place, as ``from ui.common import x`` and ``common.x``.
OLD_COMMON = [
    'REPO', 'ENV_VAR', 'DEFAULT_CHECKPOINT', 'DEFAULT_PROMPT', 'UPLOAD_LIMIT_MB', 'OTHER_DIR', 'PERSISTENT', 'LOADS',
    'NOTICES', 'checkpoints_root', 'ALLOW_ANY_PATH_ENV', 'allow_any_path', 'path_refusal', 'is_checkpoint',
    'list_checkpoints', 'all_checkpoints', 'default_checkpoint', 'Checkpoint', 'weights_stamp', 'app_device',
    'model_for', 'load', 'experiment_run', 'page_checkpoint', 'checkpoint_picker', 'upload_widget', 'TempFolder',
    'TEMP_PREFIXES', 'remove_stale_temp_folders', 'upload_root', 'save_upload', 'default_prompt', 'prompt_box',
    'encode_prompt', 'prompt_ids', 'METRICS', 'Target', 'follow_default', 'token_id', 'target_picker', 'Ablation',
    'TokenRows', 'analysis', 'analysis_with_progress', 'LENSES', 'has_tuned_lens', 'tuned_lens_of', 'lens_picker',
    'lens_table', 'reference_batch', 'show', 'table', 'training_curve', 'param_counts', 'config_table', 'model_card',
    # not public, but read through ui.common by ui/serve.py, ui/training.py, ui/graph.py and the tests
    '_load', '_on_upload', '_qualified_name', 'IdTokenizer', 'st',
]
OLD_VIZ = [
    'THEMES', 'SEQUENTIAL', 'DIVERGING', 'POSITIVE', 'NEGATIVE', 'CORRECT', 'WRONG', 'PALETTE', 'PAIR',
    'LAST_POSITION', 'set_default_theme', 'attention_figure', 'attention_grid', 'LENS_COLOURS', 'MAX_LENS_TEXT',
    'logit_lens_figure', 'lens_difference_figure', 'DLA_KINDS', 'DLA_COLOURS', 'dla_figure', 'dla_difference_figure',
    'head_scores_figure', 'patching_figure', 'prompt_spread_figure', 'subplot_spacing', 'layer_head_figure',
    'loss_curves', 'token_loss_figure', 'residual_norms_figure', 'side_by_side', 'feature_contexts_figure',
    'feature_histogram_figure', 'feature_logits_figure', 'feature_density_figure', 'feature_dla_figure',
    'token_values_figure', 'over_training_figure', 'layer_head_over_training', 'INPUT_COLOURS', 'EDGE_BEND',
    'circuit_figure', 'circuit_benchmark_figure', 'self_contained_html', 'figure_from_html', 'table_chart',
    'token_hover_figure', 'direct_path_figure', 'neighbours_figure', 'STEP_MARK', 'live_loss_figure', 'thin_ticks',
    'mark_step', 'runs_over_training_figure', 'circuit_graph_figure', 'PHASE_LABELS', 'grokking_figure',
    'fourier_norms_figure', 'GRAPH_SYMBOLS', 'GRAPH_COLOURS', 'GRAPH_PLOT_WIDTH', 'attribution_graph_figure',
    'qk_over_training_figure', 'qk_heatmap_figure',
    '_history_of',  # read by tests/test_series.py
]


@pytest.mark.parametrize("module, names", [("ui.common", OLD_COMMON), ("workbench.viz", OLD_VIZ)])
def test_every_old_name_is_importable_from_the_same_place(module, names):
    package = importlib.import_module(module)
    missing = [n for n in names if not hasattr(package, n)]
    assert missing == []
    public = [n for n in names if not n.startswith("_") and n not in ("IdTokenizer", "st")]
    assert set(public) <= set(package.__all__)  # and __all__ lists them
    namespace: dict = {}
    exec(f"from {module} import {', '.join(names)}", namespace)  # the `from x import name` form
    for n in names:
        assert namespace[n] is getattr(package, n)
    # each is the very object its defining module holds (a re-export, not a copy)
    for n in public:
        obj = getattr(package, n)
        home = getattr(obj, "__module__", None)
        if callable(obj) and home and home.startswith(module + "."):
            assert getattr(importlib.import_module(home), n) is obj


@pytest.mark.parametrize("folder", ["ui/common", "workbench/viz"])
def test_no_module_of_the_split_packages_is_too_long(folder):
    files = sorted((REPO / folder).glob("*.py"))
    assert len(files) >= 8  # a package, split by concern
    lengths = {p.name: len(p.read_text().splitlines()) for p in files}
    assert max(lengths.values()) <= MAX_LINES, lengths
