"""Where leases and semaphores run their statements: connection sources.

A lease or a semaphore never runs in the caller's transaction (a grant made there would be
invisible to others until commit, and gone on rollback). Its statements run each on a
connection of its own, checked out of the caller's ``psycopg_pool.ConnectionPool`` or
SQLAlchemy ``Engine``, or of a few autocommit connections pglock keeps per DSN string
(:func:`make_source`). A statement whose connection dies under it is sent once more on a live
connection (:meth:`Source.run_once_more`); its NOTIFY listeners open connections of their own
(:func:`open_listening`). What the statements are, and how a failure reads, stays with the
caller (``_lease.py``, ``_semaphore.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from . import _conn, _sql

logger = logging.getLogger("pglock.source")

T = TypeVar("T")

#: Most idle connections pglock keeps per DSN string.
_DSN_MAX_IDLE = 4
#: The shortest wait for a pool connection (seconds), whatever time the caller has left.
_MIN_CHECKOUT = 0.05
#: After a lost connection, how many connections of a pool or an engine are tried at most
#: (each one pinged) before the statement is sent on the last one anyway.
_MAX_PINGS = 32

#: Statements sent, by kind (the lease statements "acquire", "extend", "extend_many",
#: "release", "guard", ..., and "ping" for a source's liveness checks): for tests and benchmarks
#: that count round trips.
statements: Counter[str] = Counter()
_stats_lock = threading.Lock()


def count(kind: str) -> None:
    """Count one statement of ``kind`` in :data:`statements`."""
    with _stats_lock:
        statements[kind] += 1


class Source:
    """Where statements run: each one on a connection of its own, in autocommit.

    A subclass says how to check a connection out (:meth:`_checkout`) and back in;
    :meth:`run_once_more` is the one place a caller's statements are sent from.
    """

    kind = "?"

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key

    def run_once_more(
        self,
        execute: Callable[[psycopg.Connection[Any]], T],
        user: str,
        kind: str,
        timeout: float | None = None,
    ) -> tuple[T, bool]:
        """``execute(conn)`` on a connection of this source; return its result and whether it
        was sent a second time.

        A statement whose connection is lost under it (the error leaves the connection closed
        or broken: its backend was terminated, the server restarted, the network dropped) is
        sent once more, on a connection checked for life first. The caller's statements must
        be safe to send again (lease statements are idempotent per holder; see the callers).
        A failure of the second attempt is raised as it comes (a psycopg error, caused by the
        first one, with a note on Python 3.11+).

        :param user: who sends it, for the log and the error note (``"lease"``,
            ``"semaphore"``); the warning goes to the ``pglock.<user>`` logger.
        :param kind: which statement (``"acquire"``, ``"release"``, ...).
        :param timeout: the longest wait for a pool connection (``None``: the pool's own).
        """
        conn, done = self._checkout(timeout, fresh=False)
        try:
            return execute(conn), False
        except psycopg.OperationalError as exc:
            if not (conn.closed or conn.broken):
                raise
            first: psycopg.OperationalError = exc
        finally:
            done()
        logging.getLogger(f"pglock.{user}").warning(
            "%s statement %r: the connection was lost (%s: %s); sending it once more on a "
            "new connection",
            user, kind, type(first).__name__, _first_line(first),
        )
        try:
            conn, done = self._checkout(timeout, fresh=True)
            try:
                return execute(conn), True
            finally:
                done()
        except psycopg.Error as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(
                    f"pglock: the {user} statement {kind!r} lost its connection "
                    f"({type(first).__name__}: {_first_line(first)}) and failed again on a new "
                    f"connection of its {self.kind} source"
                )
            if exc.__cause__ is None:
                raise exc from first
            raise

    def _checkout(
        self, timeout: float | None, *, fresh: bool
    ) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        """A connection for one statement, and how to give it back (whatever its state).

        :param fresh: after a lost connection: idle connections of the source may be dead
            too, so hand out one that answered an empty statement (or a new one).
        """
        raise NotImplementedError

    def open_listener(self) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        """A new autocommit connection of its own, and how to close it."""
        raise NotImplementedError


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """Does ``conn`` answer an empty statement? (One round trip; the transaction state is
    left as it was, as psycopg_pool's ``check_connection`` does.)"""
    if conn.closed or conn.broken:
        return False
    count("ping")
    try:
        if conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE:
            _conn.fetch(conn, b"")
        else:
            conn.autocommit = True
            try:
                _conn.fetch(conn, b"")
            finally:
                if not (conn.closed or conn.broken):
                    conn.autocommit = False
    except psycopg.OperationalError:
        if conn.closed or conn.broken:
            return False
        raise
    return True


class PoolSource(Source):
    kind = "pool"

    def __init__(self, pool: Any) -> None:
        super().__init__(("pool", id(pool)))
        self.pool = pool

    def _checkout(
        self, timeout: float | None, *, fresh: bool
    ) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        pool = self.pool
        if timeout is not None:
            # A waiter's last look passes the sliver of time it has left; psycopg_pool
            # refuses a checkout outright once its timeout is spent, even with a connection
            # idle (PoolTimeout instead of an answer).
            timeout = max(timeout, _MIN_CHECKOUT)
        # The pool discards a connection given back closed or broken, and opens another.
        tries = min(_MAX_PINGS, int(getattr(pool, "max_size", 1) or 1) + 1) if fresh else 1
        for attempt in range(tries):
            conn: psycopg.Connection[Any] = pool.getconn(timeout=timeout)
            if attempt == tries - 1:
                break
            try:
                if _alive(conn):
                    break
            except BaseException:
                pool.putconn(conn)
                raise
            pool.putconn(conn)
        return conn, lambda: pool.putconn(conn)

    def open_listener(self) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        pool = self.pool
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = dict((pool.kwargs() if callable(pool.kwargs) else pool.kwargs) or {})
        kwargs["autocommit"] = True
        conn = pool.connection_class.connect(conninfo, **kwargs)
        return conn, conn.close


class EngineSource(Source):
    kind = "engine"

    def __init__(self, engine: Any) -> None:
        super().__init__(("engine", id(engine)))
        self.engine = engine

    def _checkout(
        self, timeout: float | None, *, fresh: bool
    ) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        tries = 1
        if fresh:
            # Idle connections that may be dead, plus a new one.
            checkedin = getattr(self.engine.pool, "checkedin", None)
            idle = checkedin() if callable(checkedin) else 0
            tries = min(_MAX_PINGS, int(idle) + 1)
        for attempt in range(tries):
            raw = self.engine.raw_connection()
            conn: psycopg.Connection[Any] = raw.driver_connection
            if attempt == tries - 1:
                break
            try:
                if _alive(conn):
                    break
            except BaseException:
                _engine_checkin(raw, conn)
                raise
            _engine_checkin(raw, conn)
        return conn, lambda: _engine_checkin(raw, conn)

    def open_listener(self) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        raw = self.engine.raw_connection()
        # Read it before detach(): a detached fairy no longer exposes its driver connection
        # (SQLAlchemy 2.1 gives None).
        conn: psycopg.Connection[Any] = raw.driver_connection
        raw.detach()  # ours from now on: the pool forgets it and opens another when needed
        try:
            if conn.info.transaction_status != TransactionStatus.IDLE:
                conn.rollback()  # a new connection may be in the dialect's first transaction
            conn.autocommit = True
        except BaseException:
            conn.close()
            raise
        return conn, conn.close


def _engine_checkin(raw: Any, conn: psycopg.Connection[Any]) -> None:
    if conn.closed or conn.broken:
        raw.invalidate()  # SQLAlchemy's pool forgets it and opens another when needed
    raw.close()


class DsnSource(Source):
    """A few autocommit connections pglock opens for a DSN string, reused, closed at exit."""

    kind = "dsn"

    def __init__(self, dsn: str) -> None:
        super().__init__(("dsn", dsn))
        self.dsn = dsn
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    def _get(self, *, fresh: bool = False) -> psycopg.Connection[Any]:
        if fresh:
            # A connection was lost: the idle ones went the same way if the server restarted
            # or the network dropped. Close them all (cheap) and open a new one.
            self.close()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not (conn.closed or conn.broken):
                    return conn
        return psycopg.connect(self.dsn, autocommit=True)

    def _put(self, conn: psycopg.Connection[Any]) -> None:
        healthy = not (conn.closed or conn.broken) and (
            conn.info.transaction_status == TransactionStatus.IDLE
        )
        if healthy:
            with self._lock:
                if len(self._idle) < _DSN_MAX_IDLE:
                    self._idle.append(conn)
                    return
        conn.close()

    def _checkout(
        self, timeout: float | None, *, fresh: bool
    ) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        conn = self._get(fresh=fresh)
        return conn, lambda: self._put(conn)

    def open_listener(self) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
        conn = psycopg.connect(self.dsn, autocommit=True)
        return conn, conn.close

    def close(self) -> None:
        """Close the idle connections (those in use close when given back, if unhealthy)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            try:
                conn.close()
            except Exception:
                logger.debug("closing an idle DSN connection failed", exc_info=True)


#: One source per DSN string, shared by the leases and semaphores of the process.
_dsn_sources: dict[str, DsnSource] = {}
_dsn_lock = threading.Lock()


def close_dsn_sources() -> None:
    """Close the connections kept per DSN string and forget the sources (runs at exit; a later
    statement on a DSN opens what it needs again)."""
    with _dsn_lock:
        sources = list(_dsn_sources.values())
        _dsn_sources.clear()
    for s in sources:
        s.close()


atexit.register(close_dsn_sources)


def _after_fork_in_child() -> None:
    # Connections and locks do not survive a fork: the child opens its own.
    global _dsn_lock, _stats_lock
    _dsn_lock = threading.Lock()
    _stats_lock = threading.Lock()
    _dsn_sources.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_ACCEPTED = (
    "a psycopg_pool.ConnectionPool, a SQLAlchemy Engine on the psycopg driver "
    "(postgresql+psycopg://) or a DSN string"
)


def make_source(source: object, user: str) -> Source:
    """Resolve where a ``user`` (``"lease"``, ``"semaphore"``: named in the errors) runs its
    statements, without sending any SQL.

    :raises TypeError: not a supported source.
    :raises ValueError: an empty or unparsable DSN string.
    """
    if isinstance(source, str):
        if not source.strip():
            raise ValueError("the DSN must not be empty")
        try:
            conninfo_to_dict(source)
        except psycopg.ProgrammingError as exc:
            raise ValueError(f"invalid DSN: {exc}") from None
        with _dsn_lock:
            found = _dsn_sources.get(source)
            if found is None:
                found = _dsn_sources[source] = DsnSource(source)
            return found
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    if isinstance(source, ConnectionPool):
        return PoolSource(source)
    if isinstance(source, AsyncConnectionPool):
        raise TypeError(f"pglock is synchronous: pass {_ACCEPTED}, not an AsyncConnectionPool")
    own = f"a {user} runs its statements on connections of its own"
    if isinstance(source, (psycopg.Connection, psycopg.AsyncConnection)):
        raise TypeError(
            f"{own}, never in the caller's transaction: pass {_ACCEPTED}, not a Connection"
        )
    if type(source).__module__.startswith("sqlalchemy"):
        from sqlalchemy.engine import Engine

        if isinstance(source, Engine):
            _conn._check_dialect(source.dialect)
            return EngineSource(source)
        raise TypeError(
            f"expected {_ACCEPTED}; got {type(source).__name__} ({own}: pass the Engine, not a "
            "Connection or Session)"
        )
    raise TypeError(
        f"expected {_ACCEPTED}; got {type(source).__module__}.{type(source).__qualname__}"
    )


def open_listening(
    source: Source, channel: str
) -> tuple[psycopg.Connection[Any], Callable[[], None]]:
    """A new connection of ``source``'s own that LISTENs on ``channel``, and how to close it."""
    conn, close = source.open_listener()
    try:
        _conn.fetch(conn, _sql.listen(channel))
    except BaseException:
        close()
        raise
    return conn, close
