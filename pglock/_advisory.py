"""Session-level advisory locks on a caller's connection (``pg_lock``), and the attempt machinery
transaction locks (:mod:`pglock._xact`) share. The design: docs/how-it-works.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from . import _conn, _holds, _registry, _sql
from ._base import BaseLock, forked
from ._conn import IDLE, INERROR, INTRANS, ConnState, Context, Flight, Target, XactHold
from ._keys import deadline as _deadline
from ._keys import normalize_names, validate_flag, validate_timeout
from ._keys import remaining as _remaining
from .errors import InvalidConnectionState, LockError, LockLost, LockNotAcquired

logger = logging.getLogger("pglock.advisory")

_T = TypeVar("_T")

#: An attempt cut short by the session's own statement_timeout or lock_timeout: send it again.
AGAIN = object()


def wait_limit(timeout: float | None, state: ConnState) -> int | None:
    """The ``lock_timeout`` (ms, never rounded down to 0: "no timeout") pglock sets for one
    attempt, or None to send the lock statement alone. A wait without a timeout sets 0 on a
    session with timeouts of its own (``ALTER ROLE app SET statement_timeout`` is common)."""
    if timeout:
        return max(1, math.ceil(timeout * 1000))
    if timeout is None and state.session_timeouts:
        return 0
    return None


def cut_short(conn: psycopg.Connection[Any], state: ConnState, timeout: float | None) -> bool:
    """After a wait without a timeout ended in 55P03/57014: was it the session's own timeout
    (remember it: later waits override it)? Else it was a cancel, which stands."""
    if timeout is not None or state.session_timeouts or conn.closed or conn.broken:
        return False
    quiet = Context(waits=False)  # (shielded, it would read its own overrides)
    try:
        timeouts = _conn.truth(_conn.call(conn, _sql.SESSION_TIMEOUTS.encode(), (), quiet))
    except psycopg.errors.QueryCanceled:
        timeouts = True  # the session's statement_timeout cut this one too
    except (psycopg.Error, LockError):
        logger.debug("could not read the session's timeouts", exc_info=True)
        return False
    if not timeouts:
        return False
    state.session_timeouts = True
    logger.debug("the session's own statement_timeout/lock_timeout cut a wait short: retrying")
    return True


class PgLock(BaseLock):
    """A session-level advisory lock on one or several names, on a caller's connection.

    Use it as a context manager (``with pglock.pg_lock(conn, "account:1"):``) or call
    :meth:`acquire` and :meth:`release`. The lock survives the caller's commits and rollbacks
    and is released by :meth:`release`, at the end of the ``with`` block, or when the session
    ends. Several names are taken all-or-nothing, sorted by key, in one statement. :meth:`close`
    wakes a thread blocked in :meth:`acquire` (it cancels the waiting statement).
    ``acquire()`` raises RuntimeError when this handle holds the lock already,
    :class:`pglock.InvalidConnectionState` for a closed connection, a failed transaction, or a
    name another thread holds as a transaction lock in the open transaction, and
    :class:`pglock.DeadlockDetected`.

    Thread safety: one handle per thread. Threads may share one connection: pglock never lets
    two of them both hold an exclusive lock on one name through it (Postgres would grant it to
    the session twice). A thread that holds a name may take it again (counted re-entry).
    """

    def __init__(
        self, conn: object, names: str | Sequence[str], *, shared: bool = False,
        timeout: float | None = None, pooler: str = "auto",
    ) -> None:
        pairs = normalize_names(names)
        self._keys = [k for k, _ in pairs]
        self._names = [n for _, n in pairs]
        self._shared = validate_flag(shared, "shared")
        self._timeout = validate_timeout(timeout)
        self._pooler = _conn.validate_pooler(pooler)
        self._target: Target = _conn.resolve(conn, "pg_lock")
        self._mutex = threading.Lock()
        self._owner: threading.Thread | None = None
        # The bookkeeping the lock was taken under: a pool reset drops it and marks it lost.
        self._state: ConnState | None = None
        self._flight: Flight | None = None  # the wait, for close() to cancel (made once)
        self._gen = 0  # the close() generation the current acquire() began in

    @property
    def names(self) -> list[str]:
        """The names of this lock, sorted by key."""
        return list(self._names)

    @property
    def keys(self) -> list[int]:
        """The 64-bit keys of this lock's names, sorted."""
        return list(self._keys)

    @property
    def shared(self) -> bool:
        return self._shared

    @property
    def locked(self) -> bool:
        """True while this handle holds the lock (as pglock believes; see :meth:`release`)."""
        state = self._state
        return self._outstanding() and (state is None or state.lost is None)

    def __repr__(self) -> str:
        state = "locked" if self.locked else "unlocked"
        mode = "shared" if self._shared else "exclusive"
        return f"<pglock.PgLock {self._names!r} {mode} {state}>"

    def _acquire(self, timeout: float | None) -> bool:
        waiters = self._waiters()
        gen = waiters.enter()
        try:
            with self._mutex:
                if self._outstanding():
                    raise RuntimeError(
                        f"this pg_lock handle for {self._names!r} is already held; create "
                        "another pg_lock(...) to re-enter from the same thread"
                    )
                self._gen = gen
                flight = self._flight
                if flight is None:
                    flight = self._flight = Flight(lambda: waiters.closed(self._gen))
                if waiters.closed(gen):
                    return False
                state = _conn.state_for(self._target.conn)
                me = threading.current_thread()
                ok = acquire(
                    self._target, state, self._keys, self._names,
                    shared=self._shared, timeout=timeout, flight=flight,
                    pooler=_conn.declare(state, self._pooler),
                )
                if ok:
                    # No calls between the grant and recording it: an interrupt cannot land here.
                    self._owner = me
                    self._state = state
        finally:
            waiters.leave()
        if ok and waiters.closed(gen):
            # Granted as close() ran: a woken acquire() holds nothing (docs/locks.md).
            self.release()
            return False
        return ok

    def release(self) -> None:
        """Release the lock.

        :raises RuntimeError: the handle does not hold the lock (in a forked child: its parent
            holds it; nothing is sent).
        :raises pglock.LockLost: the session no longer held the lock (the connection was
            closed or terminated, or the lock was released behind pglock's back). The handle
            is unlocked all the same.
        """
        with self._mutex:
            owner = self._owner
            if owner is None:
                raise RuntimeError(f"release of an unlocked pg_lock {self._names!r}")
            conn = self._target.conn
            if not (conn.closed or conn.broken):
                _conn.no_pipeline(conn)  # refused before anything changes: still held
            self._owner = None
            state, self._state = self._state, None
            if state is not None and state.pid != os.getpid():
                raise forked(f"pg_lock {self._names!r}")
            if state is not None and state.lost is not None:
                raise LockLost.for_names(self._names, state.lost)
            _release(self._target.conn, state, self._keys, self._names, owner)

    def _outstanding(self) -> bool:
        state = self._state  # taken in a parent of this forked process: not held here
        return self._owner is not None and (state is None or state.pid == os.getpid())

    def _not_acquired(self) -> LockNotAcquired:
        return LockNotAcquired.for_names(self._names, keys=self._keys, timeout=self._timeout)

    def __del__(self) -> None:
        # Collected while holding: its hold becomes a deferred unlock (no I/O here; see _holds).
        state, owner = getattr(self, "_state", None), getattr(self, "_owner", None)
        if state is not None and owner is not None:
            state.collected.append((self._keys, owner))
            if state.lock.acquire(blocking=False):  # never waits: threads waiting look now
                try:
                    state.cond.notify_all()
                finally:
                    state.lock.release()

    def _wake(self) -> None:
        state = _conn.state_for(self._target.conn)
        with state.lock:  # a wait in-process, for another thread of this connection
            state.cond.notify_all()
        flight = self._flight
        if flight is not None:
            flight.cancel()


def pg_lock(
    conn: object, names: str | Sequence[str], *, shared: bool = False, timeout: float | None = None,
    pooler: str = "auto",
) -> PgLock:
    """A session-level advisory lock on ``conn``, as a context manager.

    :param conn: a psycopg ``Connection``, or a SQLAlchemy ``Connection`` / ORM ``Session``
        on the psycopg driver.
    :param names: a lock name, or a list of names taken together (sorted by key, no deadlock).
    :param shared: take a shared (read) lock; shared locks coexist and exclude exclusive ones.
    :param timeout: ``None`` waits until acquired; ``0`` tries once; ``> 0`` waits that many
        seconds. The ``with`` block raises :class:`pglock.LockNotAcquired` when not acquired;
        :meth:`PgLock.acquire` returns False.
    :param pooler: what sits between ``conn`` and Postgres (docs/pgbouncer.md): ``"auto"``
        (default: a direct connection is used as is, a pooler is refused), ``"session"`` (a
        session-mode pooler: allowed, refused as soon as sharing is observed),
        ``"transaction"`` (a transaction- or statement-mode pooler: always refused) or
        ``"none"`` (no pooler, whatever the pids say: no check). Kept for the connection.
    :raises TypeError: a name, the timeout, ``pooler`` or the connection has the wrong type.
    :raises ValueError: an invalid name, timeout or ``pooler`` (checked before any SQL is sent).
    :raises pglock.UnsupportedServer: a hot standby, or a pooler that session locks cannot
        work through (at ``with`` / :meth:`PgLock.acquire`).

    Example::

        with pglock.pg_lock(conn, "account:1", timeout=5):
            charge(account=1)
    """
    return PgLock(conn, names, shared=shared, timeout=timeout, pooler=pooler)


def reserved(
    conn: psycopg.Connection[Any], state: ConnState, ctx: Callable[[], Context],
    take: Callable[[bool], _T],
) -> _T:
    """``take(False)``; when another thread's transaction-lock records stand in the way, check
    them in pg_locks (:func:`drop_stale_xact`, in the context ``ctx()``) and ``take(True)``."""
    try:
        return take(False)
    except _holds.Recheck as recheck:
        drop_stale_xact(conn, state, recheck.records, ctx())
        return take(True)


def drop_stale_xact(
    conn: psycopg.Connection[Any], state: ConnState, records: dict[int, XactHold], ctx: Context
) -> None:
    """Forget other threads' transaction-lock ``records`` that outlived their lock; refuse
    (InvalidConnectionState) for one pg_locks shows held in the open (or an unknown)
    transaction, in any mode (a session lock on the key looks the same: err towards refusing)."""
    keys = sorted(records)
    now: Any = None
    held: set[int] = set()
    if _conn.check_usable(conn) != IDLE:  # idle: every settled record is of an ended one
        try:
            rows = _conn.run(conn, _sql.held_in_transaction(keys), ctx)
        except BaseException:
            undo_savepoint(conn)
            raise
        now, found = rows[0]
        held = set(found or ())
    with state.lock:
        for k in keys:
            record = records[k]
            if state.xact.get(k) is not record:
                continue  # changed meanwhile: judged again under the lock
            if k in held and (record.started is None or record.started == now):
                raise InvalidConnectionState.shared_transaction(ctx.names[list(ctx.keys).index(k)])
            del state.xact[k]
            logger.debug("forgot a transaction-lock record that outlived its lock (key %d)", k)


def undo_savepoint(conn: psycopg.Connection[Any]) -> None:
    """After a failed batch under pglock's savepoint: back to the caller's transaction."""
    _conn.recover_interrupted(conn)
    if conn.closed or conn.broken or conn.pgconn.transaction_status != INERROR:
        return  # gone, or the batch ended before/after pglock's savepoint was open
    try:
        _conn.run(conn, _sql.rollback_to_savepoint())
    except (psycopg.Error, LockError):
        # Never replace the error that made the attempt fail with one from the clean-up.
        logger.warning("could not roll back to pglock's savepoint", exc_info=True)


def housekeeping(conn: psycopg.Connection[Any], state: ConnState, ctx: Context) -> None:
    """Send the unlocks deferred by a failed transaction, and probe the server once."""
    if state.deferred:
        pending, state.deferred = state.deferred, []
        for k, shared in pending:
            _conn.call(conn, _sql.UNLOCK_ONE[shared], (k,), shield=state.session_timeouts)
        logger.info("released %d deferred advisory lock(s)", len(pending))
    if not state.probed:
        _conn.probe(conn, state, ctx)


def acquire(
    target: Target, state: ConnState, keys: list[int], names: list[str], *, shared: bool,
    timeout: float | None, flight: Flight, pooler: str = "auto",
) -> bool:
    """Take a session lock on ``keys`` for this thread: in-process, then in Postgres for the
    keys the session does not hold yet. False when not acquired in time, or once closed."""
    conn = target.conn
    me = threading.current_thread()
    deadline = _deadline(timeout)
    need = reserved(
        conn, state, lambda: Context(names, keys, timeout),
        lambda checked: _holds.reserve(
            conn, state, keys, names, shared=shared, deadline=deadline, stop=flight.stop,
            checked=checked,
        ),
    )
    if need is None:
        return False
    if not need:
        logger.debug("re-entered %r", names)
        return True
    granted = False
    try:
        ctx = Context(
            names if len(need) == len(keys) else [names[keys.index(k)] for k in need],
            need, timeout, _conn.answer_deadline(deadline), flight=flight,
        )
        granted = _session_lock(
            conn, state, need, ctx, shared=shared, timeout=_remaining(deadline), pooler=pooler
        )
        if granted:
            _holds.settle(state, need, ())
            logger.debug("acquired %r (%s)", names, "shared" if shared else "exclusive")
    except BaseException:
        if granted:
            # Interrupted (KeyboardInterrupt) after Postgres granted the lock but before the
            # handle could record it: nobody would release it, so give it back now.
            _release(conn, state, keys, names, me)
        raise
    finally:
        if not granted:
            _holds.unreserve(state, keys, me)
            _holds.settle(state, (), need)
    return granted


#: How many times an attempt is built again when another thread sharing the connection began
#: or ended a transaction between building the attempt and sending it.
_REBUILDS = 8


def _session_lock(
    conn: psycopg.Connection[Any], state: ConnState, keys: list[int], ctx: Context, *,
    shared: bool, timeout: float | None, pooler: str = "auto",
) -> bool:
    for _ in range(_REBUILDS):
        status = _conn.check_usable(conn)
        if pooler == "transaction" or state.sharing is not None:
            raise _conn.pooler_error(state, pooler)
        try:
            return _session_attempt(
                conn, state, status, keys, dataclasses.replace(ctx, expect=status),
                shared=shared, timeout=timeout, pooler=pooler,
            )
        except _conn.StatusChanged:
            continue
    raise InvalidConnectionState(
        "other threads kept beginning and ending transactions on this connection while pglock "
        "built its lock statement; give each thread a connection of its own"
    )


def _session_attempt(
    conn: psycopg.Connection[Any], state: ConnState, status: Any, keys: list[int], ctx: Context,
    *, shared: bool, timeout: float | None, pooler: str,
) -> bool:
    """One attempt, built for the transaction status ``status`` (``ctx.expect``)."""
    if state.deferred or not state.probed:
        # close() cancels the lock statement only; these run in any status
        housekeeping(conn, state, dataclasses.replace(ctx, flight=None, expect=None))
    if state.pooler and pooler != "none":
        if pooler != "session":
            raise _conn.pooler_error(state, pooler)
        return _pooled_session_lock(conn, state, status, keys, ctx, shared=shared, timeout=timeout)
    try_ = timeout == 0
    registering = _registry.pending(
        conn, state, ctx.keys, ctx.names, own_transaction=status != INTRANS,
        skip=status == INTRANS and state.session_timeouts,
    )
    stmt = _session_batch(
        conn, status, keys, shared=shared, try_=try_, limit=wait_limit(timeout, state),
        registering=registering,
    )
    try:
        if stmt is None:  # the common case: no timeout, no caller's transaction
            res = _lock_statement(conn, state, keys, ctx, shared=shared, try_=try_)
        else:
            res = _conn.call(conn, stmt.as_bytes(conn), (), ctx)
        _registry.mark(conn, registering)
    except _conn.StatusChanged:
        raise
    except BaseException as exc:
        return _failed_attempt(
            conn, state, status, keys, ctx, exc, shared=shared, timeout=timeout, pooler=pooler
        )
    if not try_:
        return True
    single = stmt is None and len(keys) == 1
    rows = [(keys[0], _conn.truth(res))] if single else _conn.pairs(res)
    return _all_or_nothing(conn, rows, keys, shared)


def _failed_attempt(
    conn: psycopg.Connection[Any], state: ConnState, status: Any, keys: list[int], ctx: Context,
    exc: BaseException, *, shared: bool, timeout: float | None, pooler: str = "auto",
) -> bool:
    """After a session-lock statement failed: nothing held, the caller's transaction as it was;
    False when not acquired (or once closed), another attempt after the session's own timeout
    cut it short, else ``exc`` again."""
    _after_failed_session_lock(conn, status, keys, shared)
    if not isinstance(exc, (LockNotAcquired, _conn.Woken)):
        raise exc
    woken = ctx.flight is not None and ctx.flight.stop()  # close(): not the timeouts
    if not woken and cut_short(conn, state, timeout):
        return _session_lock(conn, state, keys, ctx, shared=shared, timeout=timeout, pooler=pooler)
    return False


def _pooled_session_lock(
    conn: psycopg.Connection[Any], state: ConnState, status: Any, keys: list[int], ctx: Context,
    *, shared: bool, timeout: float | None,
) -> bool:
    """A session lock through a pooler declared to pool sessions: every lock statement checks
    in itself that its server session is the one probed and carries no other client's mark
    (docs/pgbouncer.md, "Sharing checks"); when either fails nothing is taken, the sharing is
    recorded and the lock refused."""
    assert state.backend_pid is not None
    try_ = timeout == 0
    mark = _conn.client_mark(conn)
    query, params = _sql.POOLED_LOCK[(shared, try_)], (keys, state.backend_pid, mark)
    registering = _registry.pending(
        conn, state, ctx.keys, ctx.names, own_transaction=status != INTRANS,
        skip=status == INTRANS and state.session_timeouts,
    )
    stmt = _session_batch(
        conn, status, keys, shared=shared, try_=try_, limit=wait_limit(timeout, state),
        registering=registering, lock=_sql.with_literals(query, params),
    )
    try:
        # The statement alone is not prepared (a pooler may not keep it).
        if stmt is None:
            res = _conn.call(conn, query, params, ctx)
        else:
            res = _conn.call(conn, stmt.as_bytes(conn), (), ctx)
        row = _pooled_row(res)
    except _conn.StatusChanged:
        raise
    except BaseException as exc:
        return _failed_attempt(
            conn, state, status, keys, ctx, exc, shared=shared, timeout=timeout, pooler="session"
        )
    pid, found, grants = row
    if grants is None:
        sharing_observed(state, pid, found)
        raise _conn.pooler_error(state, "session")
    _registry.mark(conn, registering)
    if not try_:
        return True
    rows = [(k, g == "t") for k, g in zip(keys, grants, strict=True)]
    return _all_or_nothing(conn, rows, keys, shared, (state, mark))


def _pooled_row(res: Any) -> tuple[int, str, Any]:
    """The row of a pooled statement sent by _conn.call: (server pid, mark found, result), the
    result text (grants) or a boolean (held), None when a check failed."""
    found = res.get_value(0, 1)
    value = res.get_value(0, 2)
    if value is not None:
        value = value.decode() if res.ftype(2) == 25 else _conn.truth(res, 0, 2)
    return _conn.bigint(res), (found or b"").decode(), value


def sharing_observed(state: ConnState, pid: int, mark: str) -> str:
    """Record what a pooled statement found: another server session, or another client's mark
    on this one. Locks this connection believed it held are lost: they stay with the server
    session they were taken on, which this connection may never reach again. Returns why."""
    if pid != state.backend_pid:
        what = f"a statement ran on server session pid {pid}, not pid {state.backend_pid}"
    else:
        what = f"server session pid {pid} carries another client's mark {mark!r}"
    lost = (
        f"transaction pooling observed ({what}): the lock stays with server session pid "
        f"{state.backend_pid} until that session ends"
    )
    with state.lock:
        state.sharing = what
        held = any(not hold.pending for hold in state.holds.values())
        if held and state.lost is None:
            state.lost = lost
        state.cond.notify_all()
    logger.warning("transaction pooling observed (%s): session locks refused from now on", what)
    return lost


def _lock_statement(
    conn: psycopg.Connection[Any], state: ConnState, keys: list[int], ctx: Context, *,
    shared: bool, try_: bool,
) -> Any:
    if len(keys) == 1:
        query = _sql.LOCK_ONE[(False, shared, try_)]
        return _conn.call(conn, query, (keys[0],), ctx, prepared=state.prepared)
    return _conn.call(conn, _sql.LOCK_MANY[(shared, try_)], (keys,), ctx, prepared=state.prepared)


def _all_or_nothing(
    conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]], keys: list[int], shared: bool,
    pooled: tuple[ConnState, int] | None = None,
) -> bool:
    """After a try-lock: True if every key was granted, else give back those that were (with
    the sharing checks when ``pooled``: the connection's state and mark)."""
    got = [k for k, ok in rows if ok]
    if len(got) == len(keys):
        return True
    if got:
        unlock = _sql.unlock(got, shared=shared) if pooled is None else _pooled_unlock_sql(
            *pooled, got, shared
        )
        _conn.call(conn, unlock.as_bytes(conn), shield=True)
    return False


def _pooled_unlock_sql(
    state: ConnState, mark: int, keys: list[int], shared: bool
) -> sql.Composed:
    assert state.backend_pid is not None
    return _sql.with_literals(_sql.POOLED_UNLOCK[shared], (keys, state.backend_pid, mark))


def _session_batch(
    conn: psycopg.Connection[Any], status: Any, keys: list[int], *, shared: bool, try_: bool,
    limit: int | None, registering: _registry.Registration, lock: sql.Composed | None = None,
) -> sql.Composed | None:
    """The batch a session-lock attempt sends (around ``lock``, by default the plain lock
    statement): with its timeouts, in the caller's transaction, with names to record
    (pglock._registry: after the lock statement, see there why); None for the lock statement
    alone (none of these)."""
    record = [_registry.statement(registering)] if registering else []
    if status != INTRANS and limit is None and not record:
        return None
    lock = lock or _sql.lock(keys, shared=shared, xact=False, try_=try_)
    timeouts: list[sql.Composable] = []
    if limit is not None:
        timeouts.append(_sql.set_local_timeouts(limit, several=len(keys) > 1))
    if status == INTRANS:
        # In the caller's transaction: a savepoint keeps it usable if the attempt fails, and
        # rolling back to it undoes SET LOCAL; session locks survive the rollback.
        parts = [_sql.savepoint(), *timeouts, lock, _sql.rollback_to_savepoint(), *record]
    else:
        # A transaction of pglock's own, begun and ended in this one message (see _conn.call),
        # READ COMMITTED and READ WRITE whatever the session's defaults (the registry records
        # names in neither a SERIALIZABLE nor a read-only one).
        parts = [_sql.OWN_BEGIN, *timeouts, lock, *record, sql.SQL("COMMIT")]
    return sql.SQL("; ").join(parts)


def _after_failed_session_lock(
    conn: psycopg.Connection[Any], status: Any, keys: list[int], shared: bool
) -> None:
    """Leave the caller's transaction as it was and hold nothing, after a failed attempt: a
    grant may have raced the timeout or a cancel, and session locks survive the rollback."""
    _conn.recover_interrupted(conn)
    if conn.closed or conn.broken:
        return  # the session is gone, and its locks with it
    try:
        if _conn.stable_status(conn) == INERROR:
            # The batch stopped inside pglock's savepoint (on success it is already gone), or
            # in pglock's own transaction (an interrupt: _conn.call could not end it).
            end = _sql.rollback_to_savepoint() if status == INTRANS else sql.SQL("ROLLBACK")
            _conn.run(conn, end, Context(expect=INERROR))
        # Shielded: the session's own statement_timeout, which may have cut the attempt, must
        # not cut its clean-up too (the keys granted so far would stay held).
        undone = _conn.call(
            conn, _sql.unlock_if_held(keys, shared=shared).as_bytes(conn), shield=True
        )
        if undone.ntuples:
            logger.debug("undid %d lock(s) granted to a failed attempt", undone.ntuples)
    except (psycopg.Error, LockError, _conn.StatusChanged):
        # Never replace the error that made the attempt fail with one from the clean-up.
        logger.warning("could not clean up after a failed lock attempt", exc_info=True)


def _release(
    conn: psycopg.Connection[Any], state: ConnState | None, keys: list[int], names: list[str],
    owner: threading.Thread,
) -> None:
    state = state or _conn.state_for(conn)
    emptied = _holds.unreserve(state, keys, owner)
    if not emptied:
        logger.debug("left re-entered %r", names)
        return
    by_mode: dict[bool, list[int]] = {}
    with state.lock:
        for k in emptied:
            hold = state.holds.get(k)
            by_mode.setdefault(hold is not None and hold.mode == "s", []).append(k)
    try:
        _session_unlock(conn, state, by_mode, names)
    finally:
        _holds.settle(state, (), emptied)
    logger.debug("released %r", names)


def _session_unlock(
    conn: psycopg.Connection[Any], state: ConnState, by_mode: dict[bool, list[int]],
    names: list[str],
) -> None:
    if conn.closed or conn.broken:
        raise LockLost.for_names(names, "the connection was closed, so Postgres dropped it")
    status = _conn.stable_status(conn)
    if status == INERROR:
        # Nothing can be sent in a failed transaction. Release at the next chance: the next
        # pglock call on this connection, or the pool reset hook.
        for shared, keys in by_mode.items():
            state.deferred.extend((k, shared) for k in keys)
        logger.warning(
            "lock %r stays held until the failed transaction on its connection is rolled back "
            "and pglock next uses the connection (or the pool reset hook runs)",
            names,
        )
        return

    left = dict(by_mode)
    try:
        try:
            ok = _unlock(conn, state, left, names, state.session_timeouts)
        except LockNotAcquired:
            # The session's own statement_timeout or lock_timeout cut the unlock: once more,
            # shielded from them (and from now on).
            state.session_timeouts = True
            ok = _unlock(conn, state, left, names, True)
    except psycopg.OperationalError as exc:
        if conn.closed or conn.broken:
            raise LockLost.for_names(
                names, f"the connection broke ({exc.sqlstate or exc})"
            ) from exc
        raise
    except InvalidConnectionState:
        # Another thread put the connection in pipeline mode meanwhile: as for a failed
        # transaction, the unlock waits for pglock's next use of the connection.
        state.deferred.extend((k, shared) for shared, keys in left.items() for k in keys)
        logger.warning("lock %r stays held until pglock next uses its connection", names)
        return
    if not ok:
        raise LockLost.for_names(
            names,
            "the session no longer held it (released behind pglock's back, or the connection "
            "was reset)",
        )


def _unlock(
    conn: psycopg.Connection[Any], state: ConnState, left: dict[bool, list[int]],
    names: list[str], shield: bool,
) -> bool:
    """Unlock the keys of ``left`` by mode (each mode dropped from it once sent); True when
    every key was held. Through a pooler with the sharing checks, the unlock checks too."""
    mark = _conn.client_mark(conn, create=False) if state.pooler else 0
    ok = True
    for shared, keys in list(left.items()):
        if mark:
            assert state.backend_pid is not None
            pid, found, held = _pooled_row(_conn.call(
                conn, _sql.POOLED_UNLOCK[shared], (keys, state.backend_pid, mark), shield=shield,
            ))
            if held is None:
                raise LockLost.for_names(names, sharing_observed(state, pid, found))
            ok = held and ok
        else:
            query = _sql.UNLOCK_ONE[shared] if len(keys) == 1 else _sql.UNLOCK_MANY[shared]
            params = (keys[0],) if len(keys) == 1 else (keys,)
            res = _conn.call(conn, query, params, prepared=state.prepared, shield=shield)
            ok = _conn.truth(res) and ok
        del left[shared]
    return ok
