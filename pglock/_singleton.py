"""Singleton jobs: run a function only where no other process is running it, under a session
lock held for the run. It excludes concurrent runs, not a second run per period (docs/singleton.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import ParamSpec, TypedDict, TypeVar

from ._base import BaseLock, Waiters
from ._keys import validate_timeout
from ._rwlock import RWHold, RWLock
from .errors import LockNotAcquired

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

logger = logging.getLogger("pglock.singleton")

P = ParamSpec("P")
R = TypeVar("R")


class SingletonOptions(TypedDict, total=False):
    """The options of :func:`singleton` and ``Locker.singleton`` (one definition for both)."""

    timeout: float | None
    pooler: str


class Singleton(BaseLock):
    """A decorator that runs the function under the exclusive lock ``name``, or skips it.

    Made by :func:`pglock.singleton` and :meth:`pglock.Locker.singleton`. The decorated
    function returns its result when it ran, and ``None`` when the lock was held elsewhere
    (logged at INFO on ``pglock.singleton``). :meth:`run` is the same without decorating.
    It is also a lock object (docs/locks.md) holding the same lock around code of your own;
    ``close()`` also wakes the runs waiting for it (which then skip the job).

    Thread safety: shareable; each run takes its own lock (threads of one process exclude
    each other too). ``acquire()`` / ``release()`` are one acquisition at a time, by one thread.
    """

    def __init__(
        self, source: object, name: str, *, timeout: float | None = 0, pooler: str = "auto"
    ) -> None:
        self._rw = RWLock(source, name, pooler=pooler)
        self._timeout = validate_timeout(timeout)
        self._own = self._rw.write(self._timeout)  # acquire(), release() and with
        self._mutex = threading.Lock()
        self._runs: set[RWHold] = set()  # the holds of runs in progress (close wakes them)

    @property
    def name(self) -> str:
        """The lock name (with a Locker's namespace folded in)."""
        return self._rw.name

    def __repr__(self) -> str:
        return f"<pglock.Singleton {self.name!r} timeout={self._timeout}>"

    @property
    def locked(self) -> bool:
        """True while this object holds the lock through :meth:`acquire` or ``with``."""
        return self._own.locked

    def _acquire(self, timeout: float | None) -> bool:
        return self._own.acquire(timeout=timeout)

    def release(self) -> None:
        """Release what :meth:`acquire` took.

        :raises RuntimeError: not held.
        """
        self._own.release()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._own.__exit__(exc_type, exc, tb)

    def _outstanding(self) -> bool:
        return self._own._outstanding()

    def _not_acquired(self) -> LockNotAcquired:
        return self._own._not_acquired()

    def _waiters(self) -> Waiters:
        return self._own._waiters()

    def _wake(self) -> None:
        self._own._wake()

    def close(self) -> None:
        """Wake the threads blocked in :meth:`acquire`, ``with`` or a run of the job at once:
        ``acquire()`` returns False, ``with`` raises :class:`pglock.LockNotAcquired`, a run
        skips the job. Nothing held is released; the object stays usable."""
        super().close()
        with self._mutex:
            runs = list(self._runs)
        for hold in runs:
            hold.close()

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]:
        if not callable(fn):
            raise TypeError(f"singleton decorates a callable, not {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return self.run(fn, *args, **kwargs)

        return wrapper

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R | None:
        """Call ``fn(*args, **kwargs)`` under the lock and return its result; return None
        without calling it when the lock stays held elsewhere for ``timeout`` (or
        :meth:`close` woke the wait)."""
        hold = self._rw.write(self._timeout)
        what = getattr(fn, "__qualname__", repr(fn))
        with contextlib.ExitStack() as stack:
            with self._mutex:
                self._runs.add(hold)
            stack.callback(self._forget, hold)
            try:
                stack.enter_context(hold)
            except LockNotAcquired:
                waited = "" if not self._timeout else f" (waited {self._timeout:.2f} s)"
                logger.info("skipped %s: singleton lock %r is held elsewhere%s", what, self.name,
                            waited)
                return None
            logger.debug("running %s under singleton lock %r", what, self.name)
            return fn(*args, **kwargs)
        raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow

    def _forget_threads(self) -> None:
        self._runs = set()

    def _forget(self, hold: RWHold) -> None:
        with self._mutex:
            self._runs.discard(hold)


def singleton(source: object, name: str, **options: Unpack[SingletonOptions]) -> Singleton:
    """Decorate a job so that only one process runs it at a time; others skip it.

    :param source: a ``psycopg_pool.ConnectionPool`` or SQLAlchemy ``Engine`` (a connection is
        checked out for each run and holds the lock during it), or a connection.
    :param name: the lock name, e.g. ``"cron:daily-cleanup"``.
    :param options: keyword-only, the same for ``Locker.singleton`` (``SingletonOptions``):
        ``timeout`` (default 0) skips at once when another process runs the job; ``> 0``
        waits that long for it first; ``None`` waits until it is free; ``pooler`` (default
        ``"auto"``), what sits between ``source`` and Postgres, as for :func:`pglock.pg_lock`.
    :raises TypeError, ValueError: bad arguments, before any SQL.

    Example::

        @pglock.singleton(pool, "cron:daily-cleanup")
        def daily_cleanup() -> int:
            ...

        daily_cleanup()   # runs here, or returns None when another instance is running it
    """
    return Singleton(source, name, **options)
