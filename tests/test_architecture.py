"""The package map in docs/reference/architecture.md holds: imports go one way, config -> components -> model (and
what sits beside it) -> analysis -> viz -> the command line, and the library never imports
streamlit or the app's ui/. Every import counts, including those inside functions."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"
# Layers, bottom first: a module may import its own layer and those below it, never one above.
LAYERS = [
    {"utils", "padding", "stats", "archive", "overwrite"},
    {"config"},
    {"components"},
    {"tokenizer", "model", "cache", "processing", "checkpoint", "snapshots", "accounting", "data", "training", "distributed", "interop",
     "compiled", "static_cache", "habits"},
    {"analysis", "planted"},
    {"viz"},
    {"__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _part(module: str) -> str:
    """workbench.analysis.lens -> analysis; workbench.model -> model."""
    return module.split(".")[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_part_of_the_package_has_a_layer():
    parts = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in FILES}
    assert parts == set(RANK), parts ^ set(RANK)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way(path):
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    for module in _imports(path):
        root = module.split(".")[0]
        assert root not in ("streamlit", "ui"), f"{path.name} imports {module}: the library never imports the app"
        if root != "workbench" or module.count(".") == 0 or _part(module) not in RANK:
            continue  # another package, the package root, or a name imported from a module (checked as that module)
        assert RANK[_part(module)] <= RANK[own], f"{own} (layer {RANK[own]}) imports {module} (layer {RANK[_part(module)]})"
