"""A Locker method takes exactly the options of the function it mirrors.

Both are declared with the same ``TypedDict`` (``**options: Unpack[...]``); this test keeps it
that way: after the source (``self`` for the method), the parameters must agree in name, kind,
default and annotation, except those the Locker supplies itself (its schema).
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Callable
from typing import Any

import pytest

import pglock
from pglock import _leader as _leader_mod
from pglock import _lease, _locker, _pool, _rwlock, _semaphore, _singleton

#: factory, Locker method, the parameters the Locker fills in from its own settings.
PAIRS: list[tuple[Callable[..., Any], Callable[..., Any], set[str]]] = [
    (pglock.pool_lock, pglock.Locker.lock, set()),
    (pglock.lease, pglock.Locker.lease, {"schema"}),
    (pglock.semaphore, pglock.Locker.semaphore, {"schema"}),
    (pglock.rwlock, pglock.Locker.rwlock, set()),
    (pglock.singleton, pglock.Locker.singleton, set()),
    (pglock.leader, pglock.Locker.leader, set()),
]

#: Each options TypedDict, and the class whose constructor receives the options.
OPTIONS: list[tuple[type, type]] = [
    (_pool.PoolLockOptions, pglock.PoolLock),
    (_lease.LeaseOptions, pglock.Lease),
    (_semaphore.SemaphoreOptions, pglock.Semaphore),
    (_rwlock.RWLockOptions, pglock.RWLock),
    (_singleton.SingletonOptions, pglock.Singleton),
    (_leader_mod.LeaderOptions, pglock.LeaderElection),
]


def _shape(fn: Callable[..., Any], skip: set[str]) -> list[tuple[str, Any, Any, Any]]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # after the source / self
    return [(p.name, p.kind, p.default, p.annotation) for p in params if p.name not in skip]


@pytest.mark.parametrize("factory, method, supplied", PAIRS, ids=[m.__name__ for _, m, _ in PAIRS])
def test_a_locker_method_takes_the_options_of_its_factory(
    factory: Callable[..., Any], method: Callable[..., Any], supplied: set[str]
) -> None:
    assert _shape(method, set()) == _shape(factory, supplied)
    # The options themselves come through one TypedDict, not a copied list.
    last = list(inspect.signature(method).parameters.values())[-1]
    assert last.kind is inspect.Parameter.VAR_KEYWORD


def test_every_lock_making_method_of_the_locker_is_checked() -> None:
    makers = {
        name
        for name, fn in vars(_locker.Locker).items()
        if inspect.isfunction(fn)
        and not name.startswith("_")
        and name not in ("close", "full_name")
    }
    assert makers == {m.__name__ for _, m, _ in PAIRS}


@pytest.mark.parametrize("options, cls", OPTIONS, ids=[o.__name__ for o, _ in OPTIONS])
def test_each_option_is_a_constructor_keyword_of_the_same_type(options: type, cls: type) -> None:
    hints = typing.get_type_hints(options)
    ctor = typing.get_type_hints(cls.__init__)
    params = inspect.signature(cls.__init__).parameters
    for name, hint in hints.items():
        assert name in params, f"{cls.__name__}() has no {name!r}"
        assert params[name].default is not inspect.Parameter.empty, name
        if sys.version_info < (3, 11) and params[name].default is None:
            hint = hint | None  # Python 3.10's get_type_hints makes a None default Optional
        assert ctor[name] == hint, name


@pytest.mark.parametrize("factory, method, supplied", PAIRS, ids=[f.__name__ for f, _, _ in PAIRS])
def test_each_option_is_documented_by_its_factory(
    factory: Callable[..., Any], method: Callable[..., Any], supplied: set[str]
) -> None:
    options = inspect.signature(factory).parameters["options"].annotation
    typed_dict = next(o for o, _ in OPTIONS if o.__name__ in options)
    for name in typing.get_type_hints(typed_dict):
        assert f"``{name}``" in (factory.__doc__ or ""), f"{factory.__name__}: {name}"


def test_unknown_options_are_refused_before_any_io() -> None:
    locker = pglock.Locker("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(TypeError):
        locker.lock("x", wait=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        locker.semaphore("x", 2, durable=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        pglock.pool_lock(object(), "x", wait=3)  # type: ignore[call-arg]
