"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import autockpt

MODULES = sorted(m.name for m in pkgutil.walk_packages(autockpt.__path__, "autockpt."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_public_api_is_typed_and_documented() -> None:
    for name in autockpt.__all__:
        obj = getattr(autockpt, name)
        if callable(obj) and not isinstance(obj, type(autockpt)):
            assert obj.__doc__, f"autockpt.{name} has no docstring"
    assert (autockpt.__path__[0] + "/py.typed")
    import pathlib

    assert pathlib.Path(autockpt.__path__[0], "py.typed").exists()
