"""Connection sources: where lease and semaphore statements run, each on a connection of its
own (a pool's, an Engine's, or a few kept per DSN string), never in the caller's transaction,
and the deadlines they run under (docs/how-it-works.md, "Leases and semaphores")."""

from __future__ import annotations

import atexit
import functools
import getpass
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from . import _classify, _conn, _sql, _tracked
from ._classify import HELD, SOURCES, Kind, check_driver, classify
from ._deadline import NoAnswer, close_quietly, connect_extra, connect_within, within

logger = logging.getLogger("pglock.source")

T = TypeVar("T")
#: A connection, and how to give it back (or close it).
Checkout = tuple[psycopg.Connection[Any], Callable[[], None]]

#: Most idle connections pglock keeps per DSN string.
_DSN_MAX_IDLE = 4
#: The shortest wait for a pool connection (seconds), whatever time the caller has left.
_MIN_CHECKOUT = 0.05
#: After a lost connection, the most pool or engine connections pinged before sending anyway.
_MAX_PINGS = 32

# Deadlines of lease and semaphore statements: docs/leases.md, "Deadlines and a silent network".

#: Seconds an acquire statement is given beyond its wait for its answer to arrive: past
#: ``timeout + ANSWER_GRACE`` it is cut off (a silent network) and the acquire gives up.
ANSWER_GRACE = 1.0
#: The longest wait one acquire statement is given (``timeout=None`` waits in rounds of it,
#: so that no statement is without a client-side deadline).
WAIT_CHUNK = 30.0
#: The deadline of a statement that waits for nothing (release, info, a given-back grant):
#: the TTL, within these bounds (seconds). Past its TTL a lease or permit ends by itself.
SHORT_DEADLINE = (1.0, 30.0)
#: The longest a new NOTIFY listener takes to connect and LISTEN (seconds).
LISTEN_DEADLINE = 10.0


def short_deadline(ttl: float) -> float:
    low, high = SHORT_DEADLINE
    return time.monotonic() + min(high, max(low, ttl))


def listen_deadline(wait_deadline: float | None) -> float:
    """When a new NOTIFY listener must be listening: within :data:`LISTEN_DEADLINE`, and
    within the first waiter's own deadline plus :data:`ANSWER_GRACE`."""
    limit = time.monotonic() + LISTEN_DEADLINE
    return limit if wait_deadline is None else min(limit, wait_deadline + ANSWER_GRACE)


def database_identity(params: Mapping[str, Any]) -> tuple[str, ...]:
    """Which database libpq parameters name, as far as can be told without connecting (host,
    port, database, with libpq's defaults and environment; ``localhost`` is not 127.0.0.1)."""

    def get(key: str, env: str) -> str:
        value = params.get(key)
        return str(value) if value not in (None, "") else os.environ.get(env, "")

    host = get("host", "PGHOST") or get("hostaddr", "PGHOSTADDR")
    port = get("port", "PGPORT") or "5432"
    user = get("user", "PGUSER")
    if not user:
        try:
            user = getpass.getuser()
        except Exception:
            user = ""
    dbname = get("dbname", "PGDATABASE") or user
    return ("database", host, port, dbname)


class Source:
    """Where statements run, each on a connection of its own, in autocommit, all sent from
    :meth:`run_once_more`; a subclass implements :meth:`_checkout` and :meth:`open_listener`.

    :ivar key: this source (a pool, an engine, a DSN string) within the process.
    :ivar database: :func:`database_identity` of where it connects, else its ``key``.
    """

    kind = "?"

    def __init__(self, key: tuple[Any, ...], database: tuple[Any, ...] | None = None) -> None:
        self.key = key
        self.database = database or key

    def run_once_more(
        self, execute: Callable[[psycopg.Connection[Any]], T], user: str, kind: str,
        timeout: float | None = None, deadline: float | None = None,
    ) -> tuple[T, bool]:
        """``execute(conn)`` on a connection of this source; return its result and whether it
        was sent a second time: a statement whose connection is lost under it (left closed or
        broken) is sent once more, on a connection checked for life first, so it must be safe
        to send again. The second failure is raised caused by the first, with a note.

        :param user: ``"lease"``, ``"semaphore"``: the ``pglock.<user>`` logger, the note.
        :param kind: which statement (``"acquire"``, ``"release"``, ...).
        :param timeout: the longest wait for a pool connection (``None``: the pool's own).
        :param deadline: a ``time.monotonic()`` instant ending the whole call: past it,
            :class:`NoAnswer` and the connection is closed (the statement may have run).
        """
        what = f"the {user} statement {kind!r}"
        conn, done = self._checkout(_checkout_wait(timeout, deadline), False, deadline)
        try:
            return within(conn, deadline, lambda: execute(conn), what), False
        except psycopg.OperationalError as exc:
            if isinstance(exc, NoAnswer) or not (conn.closed or conn.broken):
                raise
            first: psycopg.OperationalError = exc
        finally:
            done()
        if deadline is not None and time.monotonic() >= deadline:
            raise NoAnswer(
                f"pglock: {what} lost its connection and no time was left to send it again"
            ) from first
        # The server's idle_session_timeout ends connections kept idle: expected, not alarming.
        level = logging.INFO if first.sqlstate == "57P05" else logging.WARNING
        logging.getLogger(f"pglock.{user}").log(
            level, "%s statement %r: the connection was lost (%s: %s); sending it once more on "
            "a new connection", user, kind, type(first).__name__, _first_line(first),
        )
        try:
            conn, done = self._checkout(_checkout_wait(timeout, deadline), True, deadline)
            try:
                return within(conn, deadline, lambda: execute(conn), what), True
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

    def _checkout(self, timeout: float | None, fresh: bool, deadline: float | None) -> Checkout:
        """A connection for one statement and how to give it back; ``fresh`` (after a lost
        connection): one that answered an empty statement, or a new one; :class:`NoAnswer`
        past ``deadline`` where the source allows."""
        raise NotImplementedError

    def open_listener(self, deadline: float | None = None) -> Checkout:
        """A new autocommit connection of its own, and how to close it (by ``deadline``
        where the source allows)."""
        raise NotImplementedError


def _checkout_wait(timeout: float | None, deadline: float | None) -> float | None:
    if deadline is None:
        return timeout
    left = max(0.0, deadline - time.monotonic())
    return left if timeout is None else min(timeout, left)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """Does ``conn`` answer an empty statement? (One round trip; the transaction state is
    left as it was, as psycopg_pool's ``check_connection`` does.)"""
    if conn.closed or conn.broken:
        return False
    try:
        flip = not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
        if flip:
            conn.autocommit = True
        try:
            _conn.fetch(conn, b"")
        finally:
            if flip and not (conn.closed or conn.broken):
                conn.autocommit = False
    except psycopg.OperationalError:
        if conn.closed or conn.broken:
            return False
        raise
    return True


def _pick(checkout: Callable[[], Checkout], tries: int, deadline: float | None) -> Checkout:
    for _ in range(tries - 1):
        conn, done = checkout()
        try:
            if within(conn, deadline, functools.partial(_alive, conn), "a liveness check"):
                return conn, done
        except BaseException:
            done()
            raise
        done()
    return checkout()


def _identity_of(conninfo: object, kwargs: object) -> tuple[Any, ...] | None:
    if not isinstance(conninfo, str):
        return None
    given = kwargs if isinstance(kwargs, Mapping) else {}
    names = ("host", "hostaddr", "port", "user", "dbname")
    extra = tuple((k, str(given[k])) for k in names if given.get(k) not in (None, ""))
    return _identity_cached(conninfo, extra)


@functools.lru_cache(maxsize=256)
def _identity_cached(conninfo: str, extra: tuple[tuple[str, str], ...]) -> tuple[Any, ...] | None:
    # Parsing a conninfo costs tens of microseconds; a source is made per lease handle.
    try:
        params: dict[str, Any] = dict(conninfo_to_dict(conninfo))
    except psycopg.ProgrammingError:
        return None
    params.update(extra)
    return database_identity(params)


class PoolSource(Source):
    kind = "pool"

    def __init__(self, pool: Any) -> None:
        # A callable conninfo or kwargs is left uncalled: the identity is the pool itself.
        super().__init__(("pool", id(pool)), _identity_of(pool.conninfo, pool.kwargs))
        self.pool = pool

    def _checkout(self, timeout: float | None, fresh: bool, deadline: float | None) -> Checkout:
        pool = self.pool
        if timeout is not None:
            # psycopg_pool refuses a checkout once its timeout is spent, even with a connection
            # idle (PoolTimeout): a waiter's last look may pass the sliver of time it has left.
            timeout = max(timeout, _MIN_CHECKOUT)

        def checkout() -> Checkout:
            conn: psycopg.Connection[Any] = pool.getconn(timeout=timeout)
            return conn, lambda: pool.putconn(conn)

        # The pool discards a connection given back closed or broken, and opens another.
        tries = min(_MAX_PINGS, int(getattr(pool, "max_size", 1) or 1) + 1) if fresh else 1
        return _pick(checkout, tries, deadline)

    def open_listener(self, deadline: float | None = None) -> Checkout:
        pool = self.pool
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = dict((pool.kwargs() if callable(pool.kwargs) else pool.kwargs) or {})
        kwargs.update(autocommit=True, client_encoding="UTF8")
        kwargs.update(connect_extra(conninfo, kwargs))
        conn = connect_within(
            lambda: pool.connection_class.connect(conninfo, **kwargs), deadline, close_quietly
        )
        return conn, conn.close


class EngineSource(Source):
    kind = "engine"

    def __init__(self, engine: Any) -> None:
        try:
            params = engine.dialect.create_connect_args(engine.url)[1]
        except Exception:
            params = None
        identity = database_identity(params) if isinstance(params, Mapping) else None
        super().__init__(("engine", id(engine)), identity)
        self.engine = engine

    def _checkout(self, timeout: float | None, fresh: bool, deadline: float | None) -> Checkout:
        # The engine's pool has its own checkout timeout: pglock cannot shorten it per call.
        def checkout() -> Checkout:
            raw = self.engine.raw_connection()
            conn: psycopg.Connection[Any] = raw.driver_connection
            return conn, lambda: _engine_checkin(raw, conn)

        tries = 1
        if fresh:  # idle connections that may be dead, plus a new one
            checkedin = getattr(self.engine.pool, "checkedin", None)
            tries = min(_MAX_PINGS, int(checkedin() if callable(checkedin) else 0) + 1)
        return _pick(checkout, tries, deadline)

    def open_listener(self, deadline: float | None = None) -> Checkout:
        raw = self.engine.raw_connection()
        # Read before detach(): a detached fairy gives None (SQLAlchemy 2.1).
        conn: psycopg.Connection[Any] = raw.driver_connection
        raw.detach()  # ours from now on: the pool forgets it and opens another when needed
        try:
            if conn.info.transaction_status != TransactionStatus.IDLE:
                # A new connection may be in the dialect's first transaction.
                within(conn, deadline, conn.rollback, "a rollback")
            conn.autocommit = True
        except BaseException:
            conn.close()
            raise
        return conn, conn.close


def _engine_checkin(raw: Any, conn: psycopg.Connection[Any]) -> None:
    if conn.closed or conn.broken:
        raw.invalidate()  # SQLAlchemy's pool forgets it and opens another when needed
    raw.close()


class DsnSource(Source, _tracked.Tracked):
    """A few autocommit connections pglock opens for a DSN string (with the
    :data:`CONNECT_DEFAULTS` it does not set), reused, closed at exit."""

    kind = "dsn"

    def __init__(self, dsn: str) -> None:
        super().__init__(("dsn", dsn), _identity_of(dsn, None))
        extra = connect_extra(dsn)
        self.conninfo = make_conninfo(dsn, **extra) if extra else dsn
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    def _connect(self) -> psycopg.Connection[Any]:
        # pglock's own connection: names, holder ids and metadata cross it in UTF-8.
        return psycopg.connect(self.conninfo, autocommit=True, client_encoding="UTF8")

    def _checkout(self, timeout: float | None, fresh: bool, deadline: float | None) -> Checkout:
        if fresh:
            # The idle ones likely died too (server restart, network drop): close them (cheap).
            self.close()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not (conn.closed or conn.broken):
                    return conn, functools.partial(self._put, conn)
        # Given up at the deadline, a connect that succeeds later joins the idle ones.
        conn = connect_within(self._connect, deadline, self._put)
        return conn, functools.partial(self._put, conn)

    def _put(self, conn: psycopg.Connection[Any]) -> None:
        if not (conn.closed or conn.broken) and conn.info.transaction_status == _conn.IDLE:
            with self._lock:
                if len(self._idle) < _DSN_MAX_IDLE:
                    self._idle.append(conn)
                    return
        conn.close()

    def open_listener(self, deadline: float | None = None) -> Checkout:
        conn = connect_within(self._connect, deadline, close_quietly)
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


def make_source(source: object, user: str) -> Source:
    """Resolve where a ``user`` (``"lease"``, ``"semaphore"``) runs its statements, without I/O.

    :raises TypeError, ValueError: not a pool, an Engine on psycopg or a DSN; a bad DSN."""
    own = (
        f"a {user} runs its statements on connections of its own, never in the caller's "
        "transaction: pass the pool or Engine they come from, or a DSN"
    )
    kind = classify(source, SOURCES, api=user, hints=dict.fromkeys(HELD, own))
    if kind is Kind.POOL:
        return PoolSource(source)
    if kind is Kind.ENGINE:
        check_driver(cast(Any, source).dialect)
        return EngineSource(source)
    dsn = _classify.dsn(source)
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"invalid DSN: {exc}") from None
    with _dsn_lock:
        if dsn not in _dsn_sources:
            _dsn_sources[dsn] = DsnSource(dsn)
        return _dsn_sources[dsn]


def open_listening(source: Source, channel: str, deadline: float | None = None) -> Checkout:
    """A new connection of ``source``'s own that LISTENs on ``channel``, and how to close it;
    :class:`NoAnswer` if it does not listen by ``deadline`` (a ``time.monotonic()`` instant)."""
    conn, close = source.open_listener(deadline)
    try:
        within(conn, deadline, lambda: _conn.fetch(conn, _sql.LISTENER_SETUP), "LISTEN")
        within(conn, deadline, lambda: _conn.fetch(conn, _sql.listen(channel)), "LISTEN")
    except BaseException:
        close()
        raise
    return conn, close
