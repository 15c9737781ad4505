"""Real English text that needs no download: the docstrings of Python's own standard library.

    from workbench.data.stdlib import TEXT_MODULES, stdlib_docs, stdlib_text
    text = stdlib_text(["argparse"])          # one module's docstrings, blank-line separated

The text is read from the Python that runs the code (``inspect.getdoc``), so it changes a little
between Python versions: a study that names it as its sample names the Python version too.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Iterable

__all__ = ["TEXT_MODULES", "stdlib_docs", "stdlib_text"]

# the 24 modules of the real-model studies' text (experiments/real_lenses.py, real_transcoders.py)
TEXT_MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib", "re", "shutil",
                "statistics", "string", "textwrap", "typing", "unittest", "urllib.parse", "zipfile", "csv",
                "datetime", "decimal", "fractions", "heapq", "logging", "random", "subprocess", "tarfile")


def stdlib_text(modules: Iterable[str] = TEXT_MODULES) -> str:
    """The docstrings of ``modules`` and of their public classes, functions and methods (``stdlib_docs``),
    joined by blank lines."""
    return "\n\n".join(stdlib_docs(modules))


def stdlib_docs(modules: Iterable[str] = TEXT_MODULES) -> list[str]:
    """Each distinct docstring of ``modules`` (importable module names) and of their public classes,
    functions and methods, in order: per module its own docstring, then its public names sorted, a
    class's public methods (sorted) after the class's. Only names the module defines itself (not
    imports); empty docstrings are dropped and an inherited docstring that recurs is kept once."""
    if isinstance(modules, str):
        raise ValueError(f"modules is a list of module names, got the string {modules!r}: write [{modules!r}]")
    docs = []
    for name in modules:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for meth, fn in sorted(vars(obj).items()):
                    if not meth.startswith("_") and inspect.isfunction(fn) and fn.__doc__:
                        docs.append(inspect.getdoc(fn))
    seen, out = set(), []
    for doc in docs:  # inherited docstrings repeat: keep each once
        if doc and doc not in seen:
            seen.add(doc), out.append(doc)
    return out
