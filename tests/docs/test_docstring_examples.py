"""Every public name of tf_ophandlers (`__all__`) has a docstring with an example, and
the example runs (stdlib doctest) with what it prints. The API reference of the
documentation site renders these docstrings (docs/api.md)."""
import ast
import doctest
import inspect
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh

PKG = pathlib.Path(oh.__file__).resolve().parent


def _attribute_docstring(name):
    """The string literal after a module-level `name = ...` in the package (the docstring
    mkdocstrings renders for a constant or a re-exported C function)."""
    for path in sorted(PKG.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == name for t in node.targets)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                return after.value.value
    return None


def _docstring(name):
    obj = getattr(oh, name)
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
        return inspect.getdoc(obj)
    return _attribute_docstring(name)


@pytest.mark.parametrize("name", oh.__all__)
def test_public_name_has_an_example_that_runs(name):
    doc = _docstring(name)
    assert doc and ">>>" in doc, "tf_ophandlers.%s: no docstring example (>>>)" % name
    test = doctest.DocTestParser().get_doctest(
        doc, {"tf": tf, "oh": oh, "np": np}, "tf_ophandlers." + name, None, 0)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
