"""workbench.data.stdlib: the docstring text of importable modules, against modules written here whose
docstrings are known, and against the standard library's own (inspect.getdoc)."""

from __future__ import annotations

import inspect
import json
import sys
import textwrap

import pytest

from workbench.data.stdlib import TEXT_MODULES, stdlib_docs, stdlib_text

MODULE = '''
"""The module."""
from json import dumps  # imported: not this module's own

__all__ = ["Shape"]


def area(x):
    """Area of x."""


def _hidden():
    """Private: left out."""


def bare():
    pass


class Shape:
    """A shape."""

    def grow(self):
        """Grow it."""

    def _shrink(self):
        """Private method."""

    def size(self):
        """Area of x."""


class Square(Shape):
    def grow(self):
        pass
'''


def test_the_docstrings_of_a_module_are_its_own_public_ones_in_order_each_once(tmp_path, monkeypatch):
    (tmp_path / "wbdocmod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wbdocmod", raising=False)
    # module, then its names sorted (Shape, Square, area): a class's own methods after it; Square's
    # docstring is Shape's (inherited: kept once), size's repeats area's (kept once), bare has none
    assert stdlib_docs(["wbdocmod"]) == ["The module.", "A shape.", "Grow it.", "Area of x."]
    assert stdlib_text(["wbdocmod"]) == "The module.\n\nA shape.\n\nGrow it.\n\nArea of x."


def test_the_standard_librarys_text_is_its_docstrings():
    docs = stdlib_docs(["json"])
    assert docs[0] == inspect.getdoc(json)
    assert inspect.getdoc(json.dumps) in docs and inspect.getdoc(json.loads) in docs
    assert inspect.getdoc(json.JSONDecoder) not in docs  # defined in json.decoder, imported by json
    assert len(docs) == len(set(docs))
    assert len(TEXT_MODULES) == 24 and stdlib_text(TEXT_MODULES[:2]).startswith(inspect.getdoc(__import__("argparse")))


def test_a_single_module_name_is_refused_by_name():
    with pytest.raises(ValueError, match="write \\['argparse'\\]"):
        stdlib_docs("argparse")
    with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz"):
        stdlib_docs(["no_such_module_xyz"])
