"""Transaction-level advisory locks on a caller's connection (docs/how-it-works.md,
"Transaction locks")."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from . import _conn, _holds, _registry, _sql
from ._advisory import AGAIN, cut_short, housekeeping, reserved, undo_savepoint, wait_limit
from ._conn import IDLE, ConnState, Context, Target
from ._django import no_transaction as no_django_transaction
from ._holds import UNKNOWN
from ._keys import deadline as _deadline
from ._keys import normalize_names, validate_flag, validate_timeout
from ._keys import remaining as _remaining
from .errors import InvalidConnectionState, LockNotAcquired

logger = logging.getLogger("pglock.advisory")

_T = TypeVar("_T")


def xact_lock(
    conn: object, names: str | Sequence[str], *, shared: bool = False, timeout: float | None = None,
) -> None:
    """Take a transaction-level advisory lock, released when the caller's transaction ends.

    There is no unlock: commit or roll back to release. A timed-out or failed attempt leaves
    the caller's transaction usable (pglock works under a savepoint).

    :param conn: a psycopg ``Connection`` in a transaction (or non-autocommit: the statement
        begins one), a SQLAlchemy ``Connection`` or an ORM ``Session`` (psycopg driver).
    :raises pglock.LockNotAcquired: not acquired within ``timeout`` (another thread's
        ``pg_lock`` on this connection is waited for in-process).
    :raises pglock.InvalidConnectionState: no transaction is open (autocommit), it has failed,
        or another thread holds (or is taking) the name in this same transaction.

    Example::

        with session.begin():
            pglock.xact_lock(session, "account:1")
            session.execute(...)
    """
    pairs = normalize_names(names)
    validate_flag(shared, "shared")
    t = validate_timeout(timeout)
    target = _conn.resolve(conn, "xact_lock")
    keys, names_ = [k for k, _ in pairs], [n for _, n in pairs]
    if not xact_acquire(target, keys, names_, shared=shared, timeout=t):
        raise LockNotAcquired.for_names(names_, keys=keys, timeout=t)


def try_xact_lock(conn: object, names: str | Sequence[str], *, shared: bool = False) -> bool:
    """Try once to take a transaction-level advisory lock; True if taken.

    See :func:`xact_lock`; this is ``timeout=0`` returning False instead of raising.
    """
    pairs = normalize_names(names)
    validate_flag(shared, "shared")
    target = _conn.resolve(conn, "try_xact_lock")
    return xact_acquire(
        target, [k for k, _ in pairs], [n for _, n in pairs], shared=shared, timeout=0.0
    )


def xact_acquire(
    target: Target, keys: list[int], names: list[str], *, shared: bool, timeout: float | None,
    api: str = "xact_lock",
) -> bool:
    """Take a transaction lock on ``keys`` in ``target``'s open transaction; False when not
    acquired within ``timeout``."""
    conn = target.conn
    if _conn.check_usable(conn) == IDLE and conn.autocommit:
        if target.kind == "django":
            raise no_django_transaction(api)
        raise InvalidConnectionState.no_transaction(
            api, "the lock would be released as soon as it is taken",
            " (or pg_lock for a session-level lock)",
        )
    _conn.ensure_sqlalchemy_transaction(target)
    state = _conn.state_for(conn)
    deadline = _deadline(timeout)
    ctx = Context(names, keys, timeout, _conn.answer_deadline(deadline))
    if not state.probed or state.deferred:
        housekeeping(conn, state, ctx)
    prior = reserved(
        conn, state, lambda: ctx,
        lambda checked: _holds.xact_reserve(
            conn, state, keys, names, shared=shared, deadline=deadline, checked=checked
        ),
    )
    if prior is None:
        return False  # another thread's pg_lock on this connection held a key until the deadline
    started: Any = UNKNOWN
    try:
        for _ in range(2):  # cut short by the session's own timeouts: once more, overriding
            started = UNKNOWN
            started = _statement(
                conn, state, keys, names, shared=shared, timeout=_remaining(deadline), ctx=ctx
            )
            if started is not AGAIN:
                break
        else:
            started = None
    finally:
        _holds.xact_settle(state, keys, prior, started)
    if started is None:
        return False
    logger.debug("acquired transaction lock %r", names)
    return True


def _statement(
    conn: psycopg.Connection[Any], state: ConnState, keys: list[int], names: list[str], *,
    shared: bool, timeout: float | None, ctx: Context,
) -> Any:
    """Send the transaction-lock statement: the transaction's start when granted, None when not
    acquired in time, ``AGAIN`` to send it again (see :func:`_run`)."""
    try_ = timeout == 0
    registering = _registry.pending(conn, state, keys, names, skip=state.session_timeouts)
    limit = wait_limit(timeout, state)
    if limit is None and len(keys) == 1 and not registering:
        # The common case, in one pre-rendered round trip (see _sql.xact_one).
        stmt = _sql.xact_one(keys[0], shared=shared, try_=try_)
        res = _run(conn, state, timeout, lambda: _conn.call(conn, stmt, (), ctx, begin=True))
        if res is None or res is AGAIN:
            return res
        return None if try_ and not _conn.truth(res, 0, 1) else _conn.bigint(res)
    started = _batch(
        conn, state, keys, shared=shared, timeout=timeout, limit=limit,
        registering=registering, ctx=ctx,
    )
    if started is not None and started is not AGAIN:
        _registry.mark(conn, registering)
    return started


def _run(
    conn: psycopg.Connection[Any], state: ConnState, timeout: float | None, send: Callable[[], _T],
) -> _T | Any:
    """``send()``; None when not acquired in time, ``AGAIN`` when the session's own timeouts cut
    the wait short. After any failure, rolls back to pglock's savepoint."""
    try:
        return send()
    except BaseException as exc:
        undo_savepoint(conn)
        if isinstance(exc, LockNotAcquired):
            return AGAIN if cut_short(conn, state, timeout) else None
        raise


def _batch(
    conn: psycopg.Connection[Any], state: ConnState, keys: list[int], *, shared: bool,
    timeout: float | None, limit: int | None, registering: Any, ctx: Context,
) -> Any:
    """:func:`_statement` for several keys, a wait limit, or a name to register: a batch under
    pglock's savepoint."""
    try_ = timeout == 0
    ending: list[sql.Composable] = [_sql.release_savepoint()]
    if registering:
        ending.append(_registry.statement(registering))
    parts: list[sql.Composable] = [_sql.savepoint()]
    if limit is not None:
        parts += [_sql.current_settings(), _sql.set_local_timeouts(limit, several=len(keys) > 1)]
    parts += [_sql.TRANSACTION_START, _sql.lock(keys, shared=shared, xact=True, try_=try_)]
    # One round trip in the common cases: the savepoint can be released in the same batch
    # unless a partial multi-key try must be rolled back or SET LOCAL must be undone.
    released = limit is None and not (try_ and len(keys) > 1)
    if released:
        parts += ending
    batch = sql.SQL("; ").join(parts)
    results = _run(conn, state, timeout, lambda: _conn.run_all(conn, batch, ctx))
    if results is None or results is AGAIN:
        return results
    if try_ and not all(ok for _, ok in results[-1]):
        if not released:
            _conn.run(conn, _sql.rollback_to_savepoint())  # gives back the keys granted
        return None
    if not released:
        # The caller's timeouts first, still inside pglock's savepoint: should pglock's own
        # statement_timeout (several keys) cancel the restore, rolling back to the savepoint
        # leaves the caller's transaction as it was. Released first, it would abort it.
        tail: list[sql.Composable] = []
        if limit is not None:
            tail.append(_sql.restore_settings(results[0][0]))
        rest = sql.SQL("; ").join(tail + ending)
        done = _run(conn, state, timeout, lambda: _conn.run(conn, rest, ctx))
        if done is None or done is AGAIN:
            return done
    return results[-2][0][0]


