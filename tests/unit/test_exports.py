"""The public surface: a sorted, honest ``__all__`` and public classes homed in ``pglock``."""

from __future__ import annotations
import __future__

import importlib
import inspect

import pglock


def _isort_key(name: str) -> tuple[int, str]:
    # The order ruff (RUF022) and isort keep: CONSTANTS, then Classes, then everything else.
    if name.isupper() and len(name) > 1:
        return (0, name)
    if name[:1].isupper():
        return (1, name)
    return (2, name)


def test_all_is_sorted_and_unique() -> None:
    assert list(pglock.__all__) == sorted(pglock.__all__, key=_isort_key)
    assert len(set(pglock.__all__)) == len(pglock.__all__)


def test_every_name_is_importable() -> None:
    mod = importlib.import_module("pglock")
    for name in pglock.__all__:
        assert hasattr(mod, name), name
        namespace: dict[str, object] = {}
        exec(f"from pglock import {name}", namespace)
        assert namespace[name] is getattr(mod, name)


def test_public_classes_report_pglock_module() -> None:
    classes = [getattr(pglock, n) for n in pglock.__all__ if inspect.isclass(getattr(pglock, n))]
    assert classes, "expected public classes"
    for cls in classes:
        assert cls.__module__ == "pglock", cls


def test_public_callables_have_docstrings() -> None:
    for n in pglock.__all__:
        obj = getattr(pglock, n)
        if callable(obj):
            assert inspect.getdoc(obj), n


def test_no_public_name_left_out() -> None:
    public = {
        n
        for n, v in vars(pglock).items()
        if not n.startswith("_")
        and not inspect.ismodule(v)
        and not isinstance(v, __future__._Feature)
    }
    assert public <= set(pglock.__all__), public - set(pglock.__all__)


def test_version() -> None:
    assert isinstance(pglock.__version__, str)
    assert pglock.__version__.count(".") >= 2


def test_errors_module_all() -> None:
    from pglock import errors

    assert list(errors.__all__) == sorted(errors.__all__, key=_isort_key)
    for n in errors.__all__:
        assert getattr(pglock, n) is getattr(errors, n)
