"""``Locker``: the one configured entry point for an application's locks (docs/pools.md)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg_pool import ConnectionPool

from ._classify import SOURCES, Deferred, Kind, classify, dsn
from ._conn import validate_pooler
from ._contract import validate_schema
from ._deadline import connect_extra
from ._keys import exact, normalize_names, validate_name, validate_timeout
from ._leader import LeaderElection, LeaderOptions
from ._lease import Lease, LeaseOptions
from ._lease import lease as _lease
from ._pool import _USE_PG_LOCK, PoolLock, PoolLockOptions, _classify, reset_connection
from ._rwlock import RWLock, RWLockOptions
from ._semaphore import Semaphore, SemaphoreOptions
from ._singleton import Singleton, SingletonOptions
from ._tracked import Tracked

if sys.version_info >= (3, 11):
    from typing import Self, Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Self, Unpack

logger = logging.getLogger("pglock.pool")


def _validate_namespace(namespace: object) -> str | None:
    if namespace is None:
        return None
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, not {type(namespace).__name__}")
    namespace = validate_name(namespace)
    if ":" in namespace:
        raise ValueError(
            f"namespace must not contain ':' (got {namespace!r}): the full lock name is "
            "'<namespace>:<name>', and a ':' in the namespace would let two namespaces "
            "share names; use another separator such as '.' or '/'"
        )
    return namespace


class Locker(Tracked):
    """The one configured entry point for an application's locks.

    ``Locker(source, namespace="billing")`` holds a connection source and settings; each
    method (:meth:`lock`, :meth:`lease`, :meth:`semaphore`, :meth:`rwlock`, :meth:`singleton`,
    :meth:`leader`) makes a lock with the options of the function it mirrors (docs/pools.md).

    :param source: a ``psycopg_pool.ConnectionPool`` or SQLAlchemy ``Engine`` (psycopg driver),
        never closed by the Locker, or a DSN string: the Locker then opens its own pool (with
        ``reset=pglock.reset_connection``) at the first use and closes it in :meth:`close`.
    :param namespace: folded into every name: ``locker.lock("x")`` locks ``"<namespace>:x"``;
        it follows the rules for names and must not contain ``':'``.
    :param schema: the schema of the lease table and functions (leases only).
    :param timeout: the default ``timeout`` of :meth:`lock`, :meth:`lease` and :meth:`rwlock`.
    :param pooler: the default ``pooler`` of :meth:`lock`, :meth:`rwlock`, :meth:`singleton`
        and :meth:`leader` (see :func:`pglock.pool_lock`):
        ``"auto"``, ``"session"``, ``"transaction"`` or ``"none"`` (docs/pgbouncer.md).
    :param pool_kwargs: extra keyword arguments for the ``ConnectionPool`` a DSN Locker creates
        (defaults: ``min_size=1``, ``max_size=10``); refused for a pool or engine source.

    No I/O in the constructor. Thread safety: a Locker can be shared between threads; the
    objects its methods return are each for one thread.

    Example::

        locker = pglock.Locker(pool, namespace="billing")
        with locker.lock("invoice:42", timeout=5) as conn:
            conn.execute("UPDATE invoices SET sent = true WHERE id = 42")
    """

    def __init__(
        self, source: object, *, namespace: str | None = None, schema: str = "pglock",
        timeout: float | None = None, pool_kwargs: Mapping[str, Any] | None = None,
        pooler: str = "auto",
    ) -> None:
        self._namespace = _validate_namespace(namespace)
        self._schema = validate_schema(schema)
        self._timeout = validate_timeout(timeout)
        self._pooler = validate_pooler(pooler)
        self._dsn: str | None = None
        self._external: object = None
        if classify(source, SOURCES, api="Locker", hints=_USE_PG_LOCK) is Kind.DSN:
            self._dsn = dsn(source)
        else:
            _classify(source, "Locker")
            self._external = source
            if pool_kwargs is not None:
                raise TypeError(
                    "pool_kwargs configures the pool a Locker creates from a DSN; "
                    "this Locker uses the pool or engine you passed"
                )
        if pool_kwargs is not None and not isinstance(pool_kwargs, Mapping):
            raise TypeError(f"pool_kwargs must be a mapping, not {type(pool_kwargs).__name__}")
        self._pool_kwargs = {exact(k): exact(v) for k, v in (pool_kwargs or {}).items()}
        for forbidden in ("open", "conninfo"):
            if forbidden in self._pool_kwargs:
                raise TypeError(f"pool_kwargs must not set {forbidden!r}")
        self._mutex = threading.Lock()
        self._own_pool: ConnectionPool[Any] | None = None
        self._pid = os.getpid()  # of the own pool
        self._closed = False
        # What the locks it makes take as their source: the pool, looked up (or opened) at
        # their first acquire; a closed Locker refuses it then.
        self._deferred = Deferred(self._connection_source)

    @property
    def namespace(self) -> str | None:
        """The namespace folded into every name, or None."""
        return self._namespace

    @property
    def schema(self) -> str:
        """The schema of the lease table and functions."""
        return self._schema

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def full_name(self, name: str) -> str:
        """The name as locked in Postgres: ``"<namespace>:<name>"``, or ``name`` without one
        (for :func:`pglock.pg_lock` or :func:`pglock.xact_lock` on a connection you hold).

        :raises TypeError, ValueError: an invalid name (or too long with the namespace).
        """
        name = validate_name(name)
        full = name if self._namespace is None else f"{self._namespace}:{name}"
        return validate_name(full)

    def _full_names(self, names: str | Sequence[str]) -> str | list[str]:
        if isinstance(names, str):
            return self.full_name(names)
        normalize_names(names)  # the same type errors as everywhere else
        return [self.full_name(n) for n in names]

    def __repr__(self) -> str:
        source = "dsn" if self._dsn is not None else type(self._external).__name__
        closed = " closed" if self._closed else ""
        return f"<pglock.Locker {source} namespace={self._namespace!r}{closed}>"

    def _connection_source(self) -> object:
        """The pool or engine to check connections out of (a DSN Locker's own pool opens here)."""
        with self._mutex:
            if self._closed:
                raise RuntimeError("this Locker is closed")
            if self._external is not None:
                return self._external
            if self._pid != os.getpid():  # a forked child: its own, the parent's left unclosed
                self._own_pool, self._pid = None, os.getpid()
            if self._own_pool is None:
                kwargs: dict[str, Any] = {"min_size": 1, "max_size": 10, "name": "pglock"}
                kwargs.update(self._pool_kwargs)
                kwargs.setdefault("reset", reset_connection)
                kwargs.setdefault("check", ConnectionPool.check_connection)
                assert self._dsn is not None
                # pglock opens these connections: connect timeout and TCP keepalives by
                # default, as for every connection pglock opens (docs/guarantees.md).
                given = dict(kwargs.get("kwargs") or {})
                kwargs["kwargs"] = {**connect_extra(self._dsn, given), **given}
                pool: ConnectionPool[Any] = ConnectionPool(self._dsn, open=False, **kwargs)
                pool.open()
                self._own_pool = pool
                logger.debug("Locker opened its own pool %r", pool.name)
            return self._own_pool

    def close(self) -> None:
        """Close the pool this Locker created from a DSN (never a pool or engine you passed);
        idempotent. Postgres releases the locks still held on its connections. In a forked
        child, the parent's pool is left alone (closing it would end the parent's sessions)."""
        with self._mutex:
            self._closed = True
            pool, self._own_pool = self._own_pool, None
        if pool is not None and self._pid == os.getpid():
            _returns_settled(pool)
            pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def lock(self, names: str | Sequence[str], **options: Unpack[PoolLockOptions]) -> PoolLock:
        """A session advisory lock on a pooled connection: :func:`pglock.pool_lock` with the
        namespace folded into the names, and the Locker's timeout by default.

        :param options: those of :func:`pglock.pool_lock` (``shared``, ``timeout``,
            ``pooler``: the Locker's by default).
        :raises pglock.LockNotAcquired: not acquired in time (at ``with``).
        :raises pglock.SelfDeadlock: no timeout, and this thread holds a name through this pool.
        :raises RuntimeError: the Locker is closed (at ``with``).
        """
        options.setdefault("timeout", self._timeout)
        options.setdefault("pooler", self._pooler)
        return PoolLock(self._deferred, self._full_names(names), **options)

    def lease(self, name: str, **options: Unpack[LeaseOptions]) -> Lease:
        """A TTL lease with a fencing token: :func:`pglock.lease` on this Locker's source,
        schema and namespace, with the Locker's timeout by default (needs the schema).

        :param options: those of :func:`pglock.lease` but ``schema`` (the Locker's).

        Example::

            with locker.lease("nightly-export", ttl=60) as lease:
                export(fencing_token=lease.token)
        """
        options.setdefault("timeout", self._timeout)
        full = self.full_name(name)
        return _lease(self._deferred, full, schema=self._schema, **options)

    def rwlock(self, name: str, **options: Unpack[RWLockOptions]) -> RWLock:
        """A read-write lock on the namespaced ``name`` over this Locker's pool: see
        :func:`pglock.rwlock`; ``read()``/``write()`` default to the Locker's timeout.

        :param options: those of :func:`pglock.rwlock` (``timeout``).

        Example::

            with locker.rwlock("config").read() as conn:
                conn.execute("SELECT * FROM settings")
        """
        options.setdefault("timeout", self._timeout)
        options.setdefault("pooler", self._pooler)
        return RWLock(self._deferred, self.full_name(name), **options)

    def singleton(self, name: str, **options: Unpack[SingletonOptions]) -> Singleton:
        """A job that runs only where no other process runs it: see :func:`pglock.singleton`
        (its ``timeout=0`` skips at once; the Locker's default timeout does not apply).

        :param options: those of :func:`pglock.singleton` (``timeout``).

        Example::

            @locker.singleton("cron:daily-cleanup")
            def daily_cleanup() -> None: ...
        """
        options.setdefault("pooler", self._pooler)
        return Singleton(self._deferred, self.full_name(name), **options)

    def leader(self, name: str, **options: Unpack[LeaderOptions]) -> LeaderElection:
        """A candidate in the leader election for the namespaced ``name`` (:func:`pglock.leader`),
        on a connection of its own made with this Locker's connection parameters.

        :param options: those of :func:`pglock.leader`.

        Example::

            with locker.leader("scheduler", on_elected=start, on_lost=stop) as election:
                election.wait_elected()
        """
        source = self._dsn if self._dsn is not None else self._external
        options.setdefault("pooler", self._pooler)
        return LeaderElection(source, self.full_name(name), **options)

    def semaphore(self, name: str, limit: int, **options: Unpack[SemaphoreOptions]) -> Semaphore:
        """A semaphore on the namespaced ``name`` over this Locker's source and schema: see
        :func:`pglock.semaphore`. Needs the pglock schema installed.

        :param limit: the number of permits.
        :param options: those of :func:`pglock.semaphore` but ``schema`` (the Locker's).

        Example::

            with locker.semaphore("exports", 3):
                run_export()
        """
        full = self.full_name(name)
        return Semaphore(self._deferred, full, limit, schema=self._schema, **options)


__all__ = ["Locker"]


def _returns_settled(pool: ConnectionPool[Any], within: float = 0.5) -> None:
    """Give connections on their way back a moment (bounded) before the pool closes: with a
    reset hook, psycopg_pool returns a connection in a worker task, and close() drops tasks still
    queued, which leaves their connections open until garbage-collected."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        stats = pool.get_stats()
        if stats.get("pool_available", 0) >= stats.get("pool_size", 0):
            return
        time.sleep(0.002)
