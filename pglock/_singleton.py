"""Singleton jobs: run a function only where no other process is running it.

The "singleton cron job" pattern: every instance of an application fires the same scheduled
job; the one that gets the exclusive advisory lock on the job's name runs it, the others skip
(or wait up to a timeout). The lock is a session lock held for the run: a crashed runner's
lock goes with its session, so the next trigger runs.

This excludes *concurrent* runs. It does not make a job run once per period: an instance
whose trigger fires after the first run finished gets the lock and runs again. Record the run
inside the job (see docs/singleton.md) when the period matters.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ._keys import validate_name, validate_timeout
from ._rwlock import RWLock
from .errors import LockNotAcquired

logger = logging.getLogger("pglock.singleton")

P = ParamSpec("P")
R = TypeVar("R")



class Singleton:
    """A decorator that runs the function under the exclusive lock ``name``, or skips it.

    Made by :func:`pglock.singleton` and :meth:`pglock.Locker.singleton`. The decorated
    function returns its result when it ran, and ``None`` when the lock was held elsewhere
    (logged at INFO on ``pglock.singleton``). :meth:`run` is the same without decorating.

    Thread safety: shareable; each call takes its own lock (threads of one process exclude
    each other too).
    """

    def __init__(self, lock: RWLock, timeout: float | None) -> None:
        self._lock = lock
        self._timeout = timeout

    @property
    def name(self) -> str:
        """The lock name (with a Locker's namespace folded in)."""
        return self._lock.name

    def __repr__(self) -> str:
        return f"<pglock.Singleton {self.name!r} timeout={self._timeout}>"

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]:
        if not callable(fn):
            raise TypeError(f"singleton decorates a callable, not {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return self.run(fn, *args, **kwargs)

        return wrapper

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R | None:
        """Call ``fn(*args, **kwargs)`` under the lock and return its result; return None
        without calling it when the lock stays held elsewhere for ``timeout``."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._lock.write(self._timeout))
            except LockNotAcquired:
                logger.info(
                    "skipped %s: singleton lock %r is held elsewhere%s",
                    getattr(fn, "__qualname__", repr(fn)),
                    self.name,
                    "" if not self._timeout else f" (waited {self._timeout:.2f} s)",
                )
                return None
            logger.debug("running %s under singleton lock %r",
                         getattr(fn, "__qualname__", repr(fn)), self.name)
            return fn(*args, **kwargs)
        raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow


def singleton(source: object, name: str, *, timeout: float | None = 0) -> Singleton:
    """Decorate a job so that only one process runs it at a time; others skip it.

    :param source: a ``psycopg_pool.ConnectionPool`` or SQLAlchemy ``Engine`` (a connection is
        checked out for each run and holds the lock during it), or a connection.
    :param name: the lock name, e.g. ``"cron:daily-cleanup"``.
    :param timeout: ``0`` (default) skips at once when another process runs the job; ``> 0``
        waits that long for it first; ``None`` waits until it is free.
    :raises TypeError, ValueError: bad arguments, before any SQL.

    Example::

        @pglock.singleton(pool, "cron:daily-cleanup")
        def daily_cleanup() -> int:
            ...

        daily_cleanup()   # runs here, or returns None when another instance is running it
    """
    validate_name(name)
    return Singleton(RWLock(source, name), validate_timeout(timeout))
