"""The TTL-row client that leases and semaphores share: their statements on a source, and where
a grant is registered for renewal (:mod:`._keepalive`) and waited for (:mod:`._waiting`)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.pq import TransactionStatus

from . import _conn, _keepalive, _sql, _waiting
from ._keepalive import Held, call_soon
from ._source import Source, close_dsn_sources
from ._waiting import Attempt, Closed, Rows, wait, wake
from .errors import InvalidConnectionState, UnsupportedServer

logger = logging.getLogger("pglock.ttl")

#: How many times a statement failed by a serialization failure or a deadlock (under a
#: REPEATABLE READ or SERIALIZABLE default isolation) is sent again, at READ COMMITTED.
_RETRIES = 5
_BEGIN, _COMMIT, _ROLLBACK = (
    s.encode() for s in (_sql.LEASE_RETRY_BEGIN, _sql.LEASE_RETRY_COMMIT, _sql.LEASE_RETRY_ROLLBACK)
)

Result = list[tuple[Any, ...]]
Query = bytes | sql.Composed

__all__ = ["Attempt", "Closed", "Held", "Rows", "call_soon", "wait", "wake"]


def run(
    rows: Rows, source: Source, kind: str, schema: str, query: Query,
    params: tuple[Any, ...] | None = None, *, binary: bool = False,
    timeout: float | None = None, deadline: float | None = None, libpq: bool = False,
) -> tuple[Result, bool]:
    """Send one statement of ``rows`` in autocommit on a connection of its own from ``source``;
    return the rows of its last row-returning statement and whether it was sent a second time
    (:meth:`Source.run_once_more`, which says what ``kind``, ``timeout`` and ``deadline`` are).

    :param params: of one statement, sent again at READ COMMITTED when the session's own
        timeouts or isolation level fail it. None: ``query`` is a batch with its values as
        literals and its own ``BEGIN ...; COMMIT``, sent as it is.
    :param libpq: scalar ``params``, sent by :func:`pglock._conn.fetch` through libpq.
    :raises pglock.SchemaNotInstalled: the schema's objects are missing.
    """
    return source.run_once_more(
        lambda conn: _execute(conn, rows, kind, schema, query, params, binary, libpq),
        rows.user, kind, timeout, deadline,
    )


def _execute(
    conn: psycopg.Connection[Any], rows: Rows, kind: str, schema: str, query: Query,
    params: tuple[Any, ...] | None, binary: bool, libpq: bool,
) -> Result:
    if conn.pgconn.transaction_status != TransactionStatus.IDLE:
        raise InvalidConnectionState(
            f"the pool handed out a connection inside a transaction; pglock runs {rows.user} "
            "statements in their own transactions"
        )
    libpq = libpq and params is not None and _conn.direct(conn)
    try:
        trust(conn, schema)
        with _conn.utf8(conn), contextlib.nullcontext() if libpq else _autocommit(conn):
            if params is not None:
                return _with_retries(conn, rows, kind, query, params, binary, libpq)
            try:
                results = _conn.fetch(conn, query)
            except psycopg.Error:
                _rollback(conn)  # a batch that failed inside its own transaction
                raise
            return results[-1] if results else []
    except psycopg.Error as exc:
        raise_translated(exc, conn, schema)


def trust(conn: psycopg.Connection[Any], schema: str) -> None:
    """Once per session and schema, before pglock calls a function of it (or reads its tables):
    refuse a schema the current role cannot trust (UnsupportedServer), which would answer for
    pglock's functions (docs/threat-model.md, "(e) Other roles"); a session whose
    synchronous_commit is off sends its statements in a transaction that turns it on (a grant
    must be durable)."""
    state = _conn.state_for(conn)
    if schema in state.trusted:
        return
    # Through libpq: no BEGIN (a statement-pooling PgBouncer refuses transaction blocks).
    res = _conn.call(conn, _sql.schema_check(schema).as_bytes(conn))
    exists, trusted, sync_off = (_conn.truth(res, 0, c) for c in range(3))
    if not exists:
        return  # its functions are missing: SchemaNotInstalled
    if not trusted:
        raise UnsupportedServer(
            f"pglock does not use schema {schema!r} of this database: its owner is not this "
            "role, a superuser, the database's owner or a role this role is a member of, or "
            "another role may create objects in it or owns one of them (it could answer for "
            "pglock's functions); install pglock as such a role (docs/leases.md, Permissions)"
        )
    if sync_off:
        state.session_timeouts = True  # see _with_retries: an explicit transaction
    state.trusted.add(schema)


@contextlib.contextmanager
def _autocommit(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Autocommit on meanwhile (client-side only on an idle connection), restored after."""
    flip = not conn.autocommit
    if flip:
        conn.autocommit = True
    try:
        yield
    finally:
        if flip and not (conn.closed or conn.broken):
            try:
                conn.autocommit = False
            except psycopg.Error:
                logger.debug("could not restore autocommit=False", exc_info=True)


def _with_retries(
    conn: psycopg.Connection[Any], rows: Rows, kind: str, query: Query, params: tuple[Any, ...],
    binary: bool, libpq: bool,
) -> Result:
    state = _conn.state_for(conn)
    for attempt in range(_RETRIES + 1):
        try:
            if attempt == 0 and not state.session_timeouts:
                return _conn.fetch(conn, query, params, binary=binary, libpq=libpq)[0]
            with _autocommit(conn):
                return _read_committed(conn, rows, query, params, binary)
        except (pg_errors.QueryCanceled, pg_errors.LockNotAvailable):
            # The session's own statement_timeout or lock_timeout (ALTER ROLE ... SET) must not
            # end pglock's wait: sent again with them off, from now on. With none it was a cancel.
            if attempt or state.session_timeouts or not _has_session_timeouts(conn):
                raise
            state.session_timeouts = True
        except (
            pg_errors.SerializationFailure, pg_errors.DeadlockDetected,
            pg_errors.ReadOnlySqlTransaction,
        ) as exc:
            # The functions are written for READ COMMITTED; under a stricter default isolation
            # they can fail this way every time under contention, and every time under a
            # read-only default: sent again at READ COMMITTED, READ WRITE.
            if attempt == _RETRIES or conn.info.transaction_status != TransactionStatus.IDLE:
                raise
            if isinstance(exc, pg_errors.ReadOnlySqlTransaction):
                if attempt:
                    raise  # READ WRITE refused too: a standby
                state.session_timeouts = True  # from now on in an explicit transaction
            rows.log.debug(
                "%s statement %r: %s; sending it again at READ COMMITTED",
                rows.user, kind, type(exc).__name__,
            )
            if attempt or isinstance(exc, pg_errors.DeadlockDetected):
                time.sleep(random.uniform(0.001, 0.005) * (attempt + 1))
    raise AssertionError("unreachable")


def _read_committed(
    conn: psycopg.Connection[Any], rows: Rows, query: Query, params: tuple[Any, ...], binary: bool
) -> Result:
    """``query`` in an explicit READ COMMITTED transaction, the session's timeouts off."""
    _conn.fetch(conn, _BEGIN)
    try:
        found = _conn.fetch(conn, query, params, binary=binary)[0]
        _conn.fetch(conn, _COMMIT)
        return found
    except BaseException:
        _rollback(conn)
        raise


def _has_session_timeouts(conn: psycopg.Connection[Any]) -> bool:
    if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
        return False
    with _autocommit(conn):
        return bool(_conn.fetch(conn, _sql.SESSION_TIMEOUTS)[0][0][0])


def _rollback(conn: psycopg.Connection[Any]) -> None:
    if not (conn.closed or conn.broken) and conn.info.transaction_status != TransactionStatus.IDLE:
        try:
            _conn.fetch(conn, _ROLLBACK)
        except psycopg.Error:
            logger.debug("rolling back a failed statement failed", exc_info=True)


def raise_translated(exc: psycopg.Error, conn: psycopg.Connection[Any], schema: str) -> NoReturn:
    """Raise the pglock error for a TTL-row statement's ``exc`` (a missing schema, an exhausted
    token sequence: :func:`pglock._conn.translate`) from it, or ``exc`` itself."""
    translated = _conn.translate(exc, _conn.Context(schema=schema, waits=False), conn)
    if translated is None:
        raise exc
    raise translated from exc


def register(item: Held) -> None:
    """Renew ``item`` from now on, and report its loss at its deadline."""
    item._pid = os.getpid()
    _keepalive.scheduler.register(item)
    if item._qkey is not None:
        _waiting.waiters.hold(item._qkey, item)


def unregister(item: Held, *, notified: bool = False) -> None:
    """Forget a grant that is no longer held; wake the local waiters of its name (unless its
    release ``notified`` them through a healthy listener)."""
    _keepalive.scheduler.forget(item)
    if item._qkey is not None:
        _waiting.waiters.ended(item._qkey, item, notified=notified)


def shutdown() -> None:
    """Close the NOTIFY listeners and the connections kept per DSN string (at exit too); grants
    still held are not released (they expire). Later calls open what they need again."""
    _waiting.stop_listeners()
    close_dsn_sources()


atexit.register(shutdown)
