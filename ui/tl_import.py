"""TransformerLens's hook points for the app server's start, without its package's heavy imports.

``import transformer_lens`` runs the package's ``__init__``, which imports every part of the library:
the model bridge's conversions, the evals, and through ``transformer_lens.utilities`` both
``datasets`` (with pyarrow) and ``transformers``' tokenizers, plus ``pytest`` and ``rich``. On these
2-core machines that is 1.1 s after torch, pandas and plotly are in, every time the app starts,
and the workbench uses none of it: its models need ``hook_points``, ``HookedRootModule``,
``ActivationCache`` and ``FactoredMatrix``, which import only torch, einops, jaxtyping and a few
of the utilities' own modules.

:func:`import_core` imports those four modules with ``transformer_lens``, ``transformer_lens.utilities``
and ``transformer_lens.conversion_utils`` made lazy: each package's module object is created without
running its ``__init__``, and a module ``__getattr__`` (PEP 562) answers a missing name

- from the ``from .x import name`` line of the package's own ``__init__`` (only ``x`` is imported),
- or, for a submodule's name, by importing that submodule,
- or else by running the real ``__init__`` in full, once, and answering from what it defined
  (``from transformer_lens import utils`` then raises TransformerLens' own message, as usual).

So every name resolves to the same object a plain import gives (a test compares the namespaces);
only when each is imported changes. ``python -m ui.serve``'s preload and app.py call it before the
workbench's first import (the second call does nothing); the library itself imports TransformerLens the
plain way.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import threading
from types import ModuleType

PACKAGES = ("transformer_lens", "transformer_lens.utilities", "transformer_lens.conversion_utils")
CORE = ("transformer_lens.hook_points", "transformer_lens.HookedRootModule", "transformer_lens.ActivationCache",
        "transformer_lens.FactoredMatrix")


def _names_from_init(package: str, source: str) -> dict[str, tuple[str, str]]:
    """``{name: (module, attribute)}`` for each ``from .x import a as name`` (or ``from package.x import``)
    statement at the top level of the package's ``__init__`` source."""
    names = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1:
            base = f"{package}.{node.module}" if node.module else package
        elif node.level == 0 and node.module and node.module.startswith(package + "."):
            base = node.module
        else:
            continue
        for alias in node.names:
            if alias.name != "*":
                if base == package:  # from . import submodule
                    names[alias.asname or alias.name] = (f"{package}.{alias.name}", "")
                else:
                    names[alias.asname or alias.name] = (base, alias.name)
    return names


class _LazyPackage:
    """The state behind one lazy package's ``__getattr__`` and ``__dir__``."""

    def __init__(self, name: str):
        self.name = name
        self.spec = importlib.util.find_spec(name)
        if self.spec is None or self.spec.origin is None or self.spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not a package with an __init__ on disk")
        with open(self.spec.origin, encoding="utf-8") as file:
            self.names = _names_from_init(name, file.read())
        self.module = importlib.util.module_from_spec(self.spec)
        self.lock = threading.RLock()
        self.initialised = False
        self.initialising: int | None = None  # the thread running the real __init__
        self.module.__getattr__ = self.getattr
        self.module.__dir__ = self.dir

    def initialise(self) -> None:
        """Run the package's real ``__init__`` in the module, once (other threads wait for it)."""
        if self.initialising == threading.get_ident():
            return
        with self.lock:
            if self.initialised:
                return
            self.initialising = threading.get_ident()
            try:
                self.spec.loader.exec_module(self.module)
            finally:
                self.initialising = None
                self.initialised = True
                if self.module.__dict__.get("__dir__") == self.dir:
                    del self.module.__dict__["__dir__"]

    def getattr(self, attr: str):
        if self.initialising == threading.get_ident() or self.initialised:
            # Inside the real __init__: a missing name is missing (``from . import x`` then imports x).
            # After it: only names it left undefined arrive here, unless it set its own __getattr__.
            raise AttributeError(f"module {self.name!r} has no attribute {attr!r}")
        if attr in self.names:
            module, name = self.names[attr]
            value = importlib.import_module(module)
            if name:
                value = getattr(value, name)
            setattr(self.module, attr, value)
            return value
        if not attr.startswith("_") and importlib.util.find_spec(f"{self.name}.{attr}") is not None:
            return importlib.import_module(f"{self.name}.{attr}")
        self.initialise()
        return getattr(self.module, attr)

    def dir(self) -> list[str]:
        self.initialise()
        return sorted(self.module.__dict__)


def import_core() -> bool:
    """Import :data:`CORE` with :data:`PACKAGES` lazy; True when done so.

    False, with nothing changed, when TransformerLens is already imported; False after a plain
    ``import transformer_lens`` when its layout is not what this expects (a new version, say)."""
    with _IMPORTING:  # two sessions' first runs under plain ``streamlit run``: the second waits for the first
        return _import_core()


_IMPORTING = threading.Lock()


def _import_core() -> bool:
    if any(name in sys.modules for name in PACKAGES):
        return False
    before = set(sys.modules)
    try:
        packages = []
        for name in PACKAGES:  # each in sys.modules before the next: find_spec of a submodule imports its parent
            package = _LazyPackage(name)
            packages.append(package)
            sys.modules[name] = package.module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, package.module)
        for name in CORE:
            importlib.import_module(name)
        # What the real __init__s would have bound by now: ``transformer_lens.ActivationCache`` is the
        # class, not the submodule of that name that importing it bound to the package.
        for package in packages:
            for attr, (module, value) in package.names.items():
                if module in sys.modules and value:
                    setattr(package.module, attr, getattr(sys.modules[module], value))
        return True
    except Exception:
        for name in set(sys.modules) - before:
            if name == "transformer_lens" or name.startswith("transformer_lens."):
                del sys.modules[name]
        import transformer_lens  # noqa: F401
        return False


def lazy(module: ModuleType) -> bool:
    """Whether ``module`` is one of :func:`import_core`'s packages whose real ``__init__`` has not run."""
    state = getattr(module.__dict__.get("__getattr__"), "__self__", None)
    return isinstance(state, _LazyPackage) and not state.initialised
