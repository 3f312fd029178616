"""Read-write locks: many readers or one writer, on Postgres shared/exclusive advisory locks.

A reader takes the session advisory lock on ``key(name)`` in shared mode, a writer in
exclusive mode, through :func:`pglock.pg_lock` (a connection in hand) or
:func:`pglock.pool_lock` (a pool or engine). The fairness is Postgres's lock queue: a request
that conflicts with a *waiting* request queues behind it, so a reader that arrives while a
writer waits does not overtake it, and a steady stream of readers cannot starve a writer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from . import _pool
from ._advisory import PgLock
from ._classify import HELD, Kind, classify
from ._keys import DEFAULT as _DEFAULT
from ._keys import key, validate_name, validate_timeout
from ._pool import PoolLock


def _classify(source: object) -> str:
    """``"conn"`` (lock on this connection) or ``"pool"`` (check one out); no I/O."""
    kind = classify(
        source,
        HELD | {Kind.POOL, Kind.ENGINE},
        api="rwlock",
        hints={
            Kind.DSN: "a lock lives on a connection; pass a connection or a pool, or use "
            "pglock.Locker(dsn), which keeps a pool"
        },
    )
    if kind in HELD:
        return "conn"
    _pool._classify(source, "rwlock")  # the driver of an Engine
    return "pool"


class _Hold:
    """One acquisition of a name in one mode; ``with`` yields the connection holding it."""

    def __init__(
        self,
        factory: Callable[[bool, float | None], Any],
        shared: bool,
        timeout: float | None,
    ) -> None:
        self._factory = factory
        self._shared = shared
        self._timeout = timeout
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Any:
        if self._stack is not None:
            raise RuntimeError("this lock block is already in use; create one per with-block")
        # Nesting through a pool is refused by PoolLock itself (pglock.SelfDeadlock), with
        # the record it shares with pool_lock and Locker.lock.
        stack = contextlib.ExitStack()
        with stack:
            conn = stack.enter_context(self._factory(self._shared, self._timeout))
            self._stack = stack.pop_all()
        return conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)


class RWLock:
    """A read-write lock on ``name``: ``with rw.read():`` shares it with other readers,
    ``with rw.write():`` excludes everyone.

    Each ``with`` yields the connection holding the lock: the connection you passed, or the
    one checked out of the pool (returned at the end of the block, as in :func:`pool_lock`).

    Writers are not starved: Postgres queues a read request behind a waiting write request.
    On one connection, re-entry from a thread is counted (a read inside that thread's write is
    a re-entry); asking to write while the same thread reads raises :class:`pglock.LockError`
    (no upgrade: two readers upgrading would deadlock). Through a pool, any nesting of the
    same name by the same thread (read or write, and with :func:`pool_lock` or
    :meth:`Locker.lock` on the same pool) raises :class:`pglock.SelfDeadlock` at once, since
    it would wait on itself on another pooled connection; use the connection the outer block
    yielded instead.

    Thread safety: an ``RWLock`` may be shared by threads; each ``read()``/``write()`` call
    returns a block object for one ``with`` in one thread.
    """

    def __init__(self, source: object, name: str) -> None:
        validate_name(name)
        kind = _classify(source)
        self._name = name
        self._kind = kind
        self._get_source: Callable[[], object] = lambda: source
        self._default_timeout: float | None = None

    @classmethod
    def _for_locker(
        cls, get_source: Callable[[], object], name: str, timeout: float | None
    ) -> RWLock:
        self = cls.__new__(cls)
        self._name = validate_name(name)
        self._kind = "pool"
        self._get_source = get_source
        self._default_timeout = timeout
        return self

    @property
    def name(self) -> str:
        """The lock name (with a Locker's namespace folded in)."""
        return self._name

    @property
    def key(self) -> int:
        """The advisory-lock key of :attr:`name`."""
        return key(self._name)

    def __repr__(self) -> str:
        return f"<pglock.RWLock {self._name!r}>"

    def read(self, timeout: float | None = _DEFAULT) -> _Hold:
        """A shared (read) hold, as a context manager yielding the connection.

        :param timeout: ``None`` waits; ``0`` tries once; ``> 0`` waits that long.
        :raises pglock.LockNotAcquired: not acquired in time (at ``with``).
        """
        return self._hold(True, timeout)

    def write(self, timeout: float | None = _DEFAULT) -> _Hold:
        """An exclusive (write) hold, as a context manager yielding the connection.

        :param timeout: ``None`` waits; ``0`` tries once; ``> 0`` waits that long.
        :raises pglock.LockNotAcquired: not acquired in time (at ``with``).
        :raises pglock.LockError: this thread holds the read lock on the same connection.
        """
        return self._hold(False, timeout)

    def _hold(self, shared: bool, timeout: float | None) -> _Hold:
        t = self._default_timeout if timeout is _DEFAULT else validate_timeout(timeout)
        return _Hold(self._factory, shared, t)

    @contextlib.contextmanager
    def _factory(self, shared: bool, timeout: float | None) -> Iterator[Any]:
        source = self._get_source()
        if self._kind == "conn":
            with PgLock(source, self._name, shared=shared, timeout=timeout):
                yield source
        else:
            kind_lock = PoolLock._deferred(
                lambda: source, self._name, shared=shared, timeout=timeout
            )
            with kind_lock as conn:
                yield conn


def rwlock(source: object, name: str) -> RWLock:
    """A read-write lock on ``name`` through ``source``.

    :param source: a psycopg ``Connection`` or SQLAlchemy ``Connection``/``Session`` (the lock
        lives on it), or a ``psycopg_pool.ConnectionPool`` / SQLAlchemy ``Engine`` (each block
        checks a connection out, as :func:`pglock.pool_lock` does).
    :raises TypeError, ValueError: a bad source or name, before any SQL.

    Example::

        config = pglock.rwlock(pool, "config")
        with config.read(timeout=5) as conn:
            settings = conn.execute("SELECT * FROM settings").fetchall()
        with config.write() as conn:
            conn.execute("UPDATE settings SET value = 'x' WHERE key = 'mode'")
    """
    return RWLock(source, name)
