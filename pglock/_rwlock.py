"""Read-write locks: shared (read) or exclusive (write) session advisory locks on ``key(name)``,
on a connection or through a pool; Postgres's queue keeps writers from starving (docs/rwlock.md)."""

from __future__ import annotations

import sys
from typing import Any, TypedDict

from . import _pool
from ._advisory import PgLock
from ._base import BaseLock, Waiters
from ._classify import HELD, Deferred, Kind, classify
from ._conn import validate_pooler
from ._keys import DEFAULT as _DEFAULT
from ._keys import key, validate_name, validate_timeout
from ._pool import PoolLock
from .errors import LockNotAcquired

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack


_NOT_A_DSN = {
    Kind.DSN: "a lock lives on a connection; pass a connection or a pool, or use "
    "pglock.Locker(dsn), which keeps a pool"
}


def _classify(source: object) -> str:
    """``"conn"`` (lock on this connection) or ``"pool"`` (check one out); no I/O."""
    if isinstance(source, Deferred):  # a Locker's pool
        return "pool"
    kind = classify(source, HELD | {Kind.POOL, Kind.ENGINE}, api="rwlock", hints=_NOT_A_DSN)
    if kind in HELD:
        return "conn"
    _pool._classify(source, "rwlock")  # the driver of an Engine
    return "pool"


class RWLockOptions(TypedDict, total=False):
    """The options of :func:`rwlock` and ``Locker.rwlock`` (one definition for both)."""

    timeout: float | None
    pooler: str


class RWHold(BaseLock):
    """The read or the write lock of an :class:`RWLock`: ``rw.read()``, ``rw.write()``.

    ``with`` (or :meth:`acquire`) yields the connection holding it (also :attr:`connection`);
    through a pool it is checked out for the hold, as with :func:`pglock.pool_lock`.

    Thread safety: one acquisition at a time, by one thread; ``close()`` from any thread.
    """

    def __init__(self, rw: RWLock, shared: bool, timeout: float | None) -> None:
        self._rw = rw
        self._shared = shared
        self._timeout = timeout
        # Through a pool the PoolLock is made now (no I/O); on a connection at the first
        # acquire (a SQLAlchemy Session gives its connection only then).
        self._inner: PgLock | PoolLock | None = (
            PoolLock(rw._source, rw.name, shared=shared, pooler=rw._pooler)
            if rw._kind == "pool" else None
        )

    @property
    def locked(self) -> bool:
        """True while held, as pglock believes."""
        return self._inner is not None and self._inner.locked

    @property
    def connection(self) -> Any:
        """The connection holding the lock (what ``with`` yields) while held, else None."""
        if isinstance(self._inner, PoolLock):
            return self._inner.connection
        return self._rw._source if self._outstanding() else None

    def __repr__(self) -> str:
        mode = "read" if self._shared else "write"
        state = "locked" if self.locked else "unlocked"
        return f"<pglock.RWLock {self._rw.name!r} {mode} {state}>"

    def _acquire(self, timeout: float | None) -> bool:
        if self._inner is None:
            self._inner = PgLock(
                self._rw._source, self._rw.name, shared=self._shared, pooler=self._rw._pooler
            )
        return self._inner.acquire(timeout=timeout)

    def release(self) -> None:
        """Release the hold (through a pool: commit and give the connection back).

        :raises RuntimeError: not held.
        :raises pglock.LockLost: the lock was found gone.
        """
        if self._inner is None:
            raise RuntimeError(f"release of an unlocked {self!r}")
        self._inner.release()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Through a pool the inner exit rolls back when the body raised.
        if self._inner is not None:
            self._inner.__exit__(exc_type, exc, tb)

    def _outstanding(self) -> bool:
        return self._inner is not None and self._inner._outstanding()

    def _not_acquired(self) -> LockNotAcquired:
        if isinstance(self._inner, PoolLock):
            return self._inner._not_acquired()
        rw = self._rw
        return LockNotAcquired.for_names([rw.name], keys=[rw.key], timeout=self._timeout)

    def _entered(self) -> Any:
        return self.connection

    def _waiters(self) -> Waiters:
        # The inner lock's waiters: close() marks the wait that the inner lock runs.
        return super()._waiters() if self._inner is None else self._inner._waiters()

    def _wake(self) -> None:
        if self._inner is not None:
            self._inner._wake()


class RWLock:
    """A read-write lock on ``name``: ``with rw.read():`` shares it with other readers,
    ``with rw.write():`` excludes everyone.

    :meth:`read` and :meth:`write` return lock objects (:class:`RWHold`) whose ``with`` yields
    the connection holding the lock: the one you passed, or one checked out of the pool (as in
    :func:`pool_lock`). Writers are not starved. On one connection a thread's re-entry is
    counted and an upgrade raises :class:`pglock.LockError`; through a pool a nesting of the
    name by one thread is refused (without a timeout: :class:`pglock.SelfDeadlock`).

    Thread safety: an ``RWLock`` may be shared by threads; each ``read()``/``write()`` call
    returns a lock object for one thread.
    """

    def __init__(
        self, source: object, name: str, *, timeout: float | None = None, pooler: str = "auto"
    ) -> None:
        self._name = validate_name(name)
        self._kind = _classify(source)
        self._source = source
        self._timeout = validate_timeout(timeout)
        self._pooler = validate_pooler(pooler)

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

    def read(self, timeout: float | None = _DEFAULT) -> RWHold:
        """The shared (read) lock, as a lock object whose ``with`` yields the connection.

        :param timeout: the default of its ``acquire()`` and ``with``: ``None`` waits; ``0``
            tries once; ``> 0`` waits that long; omitted, the rwlock's timeout.
        :raises pglock.LockNotAcquired: not acquired in time (at ``with``).
        """
        return self._hold(True, timeout)

    def write(self, timeout: float | None = _DEFAULT) -> RWHold:
        """The exclusive (write) lock, as a lock object whose ``with`` yields the connection.

        :param timeout: as for :meth:`read`.
        :raises pglock.LockNotAcquired: not acquired in time (at ``with``).
        :raises pglock.LockError: this thread holds the read lock on the same connection.
        """
        return self._hold(False, timeout)

    def _hold(self, shared: bool, timeout: float | None) -> RWHold:
        t = self._timeout if timeout is _DEFAULT else validate_timeout(timeout)
        return RWHold(self, shared, t)


def rwlock(source: object, name: str, **options: Unpack[RWLockOptions]) -> RWLock:
    """A read-write lock on ``name`` through ``source``.

    :param source: a psycopg ``Connection`` or SQLAlchemy ``Connection``/``Session`` (the lock
        lives on it), or a ``psycopg_pool.ConnectionPool`` / SQLAlchemy ``Engine`` (each hold
        checks a connection out, as :func:`pglock.pool_lock` does).
    :param options: keyword-only, the same for ``Locker.rwlock`` (``RWLockOptions``):
        ``timeout`` (default None), the default of ``read()`` and ``write()``; ``pooler``
        (default ``"auto"``), what sits between ``source`` and Postgres, as for
        :func:`pglock.pg_lock` (docs/pgbouncer.md).
    :raises TypeError, ValueError: a bad source, name, timeout or pooler, before any SQL.

    Example::

        config = pglock.rwlock(pool, "config")
        with config.read(timeout=5) as conn:
            settings = conn.execute("SELECT * FROM settings").fetchall()
        with config.write() as conn:
            conn.execute("UPDATE settings SET value = 'x' WHERE key = 'mode'")
    """
    return RWLock(source, name, **options)
