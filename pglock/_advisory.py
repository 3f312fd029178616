"""Advisory locks on a caller's connection: ``pg_lock`` (session level) and ``xact_lock``.

Policy lives here; SQL lives in :mod:`pglock._sql`; talking to the connection in
:mod:`pglock._conn`.

Threads. A psycopg connection is one Postgres session, and Postgres grants a session every
advisory lock it already holds. So pglock arbitrates between threads itself: per connection and
key it records which threads hold the key (:class:`pglock._conn.KeyHold`). The session takes the
key in Postgres once, for the first holder, and gives it back after the last one. A thread that
already holds a key re-enters without any SQL (counted); another thread waits in-process, with
the same timeout, before it ever reaches Postgres. Transaction locks are recorded per key too
(:class:`pglock._conn.XactHold`), before any SQL: a second thread in the same transaction is
refused, and a record that outlived its lock (a rolled-back savepoint) is checked in pg_locks
before it refuses anyone (see "transaction-lock bookkeeping" below).

Transactions. On an idle connection pglock runs its statements in its own short transaction
(autocommit statements, or an implicit transaction it commits), so the connection stays idle.
Inside the caller's open transaction it works under a savepoint, so a failed or timed-out
attempt leaves that transaction usable, and ``SET LOCAL`` timeouts are undone.

Failed transactions. A connection whose transaction has failed accepts no statement until it
is rolled back, so a new lock on it is refused (:class:`pglock.InvalidConnectionState`) before
any SQL. A ``with pg_lock(...)`` block that exits while the caller's transaction is failed
(typically the body's own SQL error) cannot send the unlock: the body's exception propagates
unchanged, the handle is unlocked, and the release is *deferred* with a WARNING log. The session
keeps holding the lock until the caller rolls back and pglock next uses the connection (any
``pg_lock``/``xact_lock`` call flushes deferred unlocks first) or the pool reset hook runs.

Interrupts. A KeyboardInterrupt while waiting cancels the statement (psycopg does); pglock then
reads any unread results, looks in ``pg_locks`` and gives back a lock that Postgres granted just
before the cancel, so nothing stays held and the connection stays usable.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql

from . import _conn, _registry, _sql
from ._conn import IDLE, INERROR, INTRANS, ConnState, Context, KeyHold, Target, XactHold
from ._keys import DEFAULT as _DEFAULT
from ._keys import deadline as _deadline
from ._keys import normalize_names, validate_flag, validate_timeout
from ._keys import remaining as _remaining
from .errors import InvalidConnectionState, LockError, LockLost, LockNotAcquired

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger("pglock.advisory")

_T = TypeVar("_T")


def _ms(seconds: float) -> int:
    # lock_timeout = 0 would mean "no timeout", so never round down to it.
    return max(1, math.ceil(seconds * 1000))


#: An attempt cut short by the session's own statement_timeout or lock_timeout: send it again.
_AGAIN = object()


def _wait_limit(timeout: float | None, state: ConnState) -> int | None:
    """The ``lock_timeout`` (ms) pglock sets for one attempt, scoped to it, or None to send
    the lock statement alone.

    A timeout sets its own. A wait meant to last until acquired (``None``) on a session with
    a ``statement_timeout`` or ``lock_timeout`` of its own (``ALTER ROLE app SET
    statement_timeout`` is common) sets both to 0, or the session's setting would end it. A
    try (``0``) never waits."""
    if timeout:
        return _ms(timeout)
    if timeout is None and state.session_timeouts:
        return 0
    return None


def _cut_short(conn: psycopg.Connection[Any], state: ConnState, timeout: float | None) -> bool:
    """After a wait without a timeout ended in 55P03/57014 with the session's settings left
    alone: was it the session's own timeout? Then remember it (later waits override it) and
    say so; else it was a cancel (``pg_cancel_backend``, ``conn.cancel()``), which stands."""
    if timeout is not None or state.session_timeouts or conn.closed or conn.broken:
        return False
    try:
        rows = _in_own_transaction(
            conn, _conn.stable_status(conn), lambda: _conn.run(conn, _sql.SESSION_TIMEOUTS)
        )
    except (psycopg.Error, LockError):
        logger.debug("could not read the session's timeouts", exc_info=True)
        return False
    if not (rows and rows[0][0]):
        return False
    state.session_timeouts = True
    logger.debug("the session's own statement_timeout/lock_timeout cut a wait short: retrying")
    return True


class PgLock:
    """A session-level advisory lock on one or several names, on a caller's connection.

    Use it as a context manager (``with pglock.pg_lock(conn, "account:1"):``) or call
    :meth:`acquire` and :meth:`release`. The lock survives commits and rollbacks of the
    caller's transactions and is released by :meth:`release`, at the end of the ``with``
    block, or by Postgres when the session ends.

    Several names are taken all-or-nothing, sorted by key, in one statement.

    Thread safety: a ``PgLock`` handle belongs to the thread that acquired it; use one handle
    per thread. Many threads may share one connection: pglock guarantees that two threads never
    both hold an exclusive lock on the same name through it, although Postgres would grant it
    to the session twice. A thread that holds a name may take it again (counted re-entry).
    """

    def __init__(
        self,
        conn: object,
        names: str | Sequence[str],
        *,
        shared: bool = False,
        timeout: float | None = None,
    ) -> None:
        pairs = normalize_names(names)
        self._keys = [k for k, _ in pairs]
        self._names = [n for _, n in pairs]
        self._shared = validate_flag(shared, "shared")
        self._timeout = validate_timeout(timeout)
        self._target: Target = _conn.resolve(conn, "pg_lock")
        self._mutex = threading.Lock()
        self._owner: threading.Thread | None = None
        # The bookkeeping the lock was taken under: a pool reset drops it and marks it lost.
        self._state: ConnState | None = None

    # -- introspection -----------------------------------------------------------------

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
        return self._owner is not None and (state is None or state.lost is None)

    def __repr__(self) -> str:
        state = "locked" if self.locked else "unlocked"
        mode = "shared" if self._shared else "exclusive"
        return f"<pglock.PgLock {self._names!r} {mode} {state}>"

    # -- acquire / release ---------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = _DEFAULT) -> bool:
        """Take the lock; return True when held, False when not acquired in time.

        :param blocking: False tries once (same as ``timeout=0``).
        :param timeout: seconds to wait; ``None`` waits forever; omitted uses the timeout given
            to :func:`pg_lock`.
        :raises RuntimeError: this handle already holds the lock.
        :raises pglock.InvalidConnectionState: closed connection or failed transaction, or
            another thread holds the name as a transaction lock in the transaction open on
            this connection (pglock cannot wait for it to end on the same connection).
        :raises pglock.DeadlockDetected: Postgres chose this request to break a deadlock.
        """
        validate_flag(blocking, "blocking")
        explicit = timeout is not _DEFAULT
        timeout = validate_timeout(timeout) if explicit else self._timeout
        if not blocking:
            # Like threading.Lock: an explicit timeout contradicts blocking=False; the default
            # timeout given to pg_lock() does not.
            if explicit and timeout not in (None, 0):
                raise ValueError("can't specify a timeout for a non-blocking acquire")
            timeout = 0.0
        with self._mutex:
            if self._owner is not None:
                raise RuntimeError(
                    f"this pg_lock handle for {self._names!r} is already held; create another "
                    "pg_lock(...) to re-enter from the same thread"
                )
            me = threading.current_thread()
            state = _conn.state_for(self._target.conn)
            ok = _acquire(
                self._target,
                self._keys,
                self._names,
                shared=self._shared,
                timeout=timeout,
            )
            if ok:
                # No calls between the grant and recording it: an interrupt cannot land here.
                self._owner = me
                self._state = state
            return ok

    def release(self) -> None:
        """Release the lock.

        :raises RuntimeError: the handle does not hold the lock.
        :raises pglock.LockLost: the session no longer held the lock (the connection was
            closed or terminated, or the lock was released behind pglock's back). The handle
            is unlocked all the same.
        """
        with self._mutex:
            owner = self._owner
            if owner is None:
                raise RuntimeError(f"release of an unlocked pg_lock {self._names!r}")
            self._owner = None
            state, self._state = self._state, None
            if state is not None and state.lost is not None:
                raise LockLost(", ".join(self._names), reason=state.lost)
            _release(self._target.conn, self._keys, self._names, owner)

    def __enter__(self) -> Self:
        try:
            ok = self.acquire()
        except BaseException:
            if self._owner is not None:  # interrupted right after the grant: no __exit__ will run
                self.release()
            raise
        if not ok:
            raise LockNotAcquired(
                self._names[0] if len(self._names) == 1 else ", ".join(self._names),
                key=self._keys[0] if len(self._keys) == 1 else None,
                timeout=self._timeout,
            )
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._owner is None:
            return
        if exc is None:
            self.release()
            return
        try:
            self.release()
        except Exception:
            # Never mask the body's exception with a release problem.
            logger.warning(
                "releasing lock %r after the block raised %r failed", self._names, exc,
                exc_info=True,
            )


def pg_lock(
    conn: object,
    names: str | Sequence[str],
    *,
    shared: bool = False,
    timeout: float | None = None,
) -> PgLock:
    """A session-level advisory lock on ``conn``, as a context manager.

    :param conn: a psycopg ``Connection``, or a SQLAlchemy ``Connection`` / ORM ``Session``
        on the psycopg driver.
    :param names: a lock name, or a list of names taken together (sorted by key, no deadlock).
    :param shared: take a shared (read) lock; shared locks coexist and exclude exclusive ones.
    :param timeout: ``None`` waits until acquired; ``0`` tries once; ``> 0`` waits that many
        seconds. The ``with`` block raises :class:`pglock.LockNotAcquired` when not acquired;
        :meth:`PgLock.acquire` returns False.
    :raises TypeError: a name, the timeout or the connection has the wrong type.
    :raises ValueError: an invalid name or timeout (checked before any SQL is sent).

    Example::

        with pglock.pg_lock(conn, "account:1", timeout=5):
            charge(account=1)
    """
    return PgLock(conn, names, shared=shared, timeout=timeout)


# --- transaction-level locks -------------------------------------------------------------


def xact_lock(
    conn: object,
    names: str | Sequence[str],
    *,
    shared: bool = False,
    timeout: float | None = None,
) -> None:
    """Take a transaction-level advisory lock, released when the caller's transaction ends.

    There is no unlock: commit or roll back to release. A timed-out or failed attempt leaves
    the caller's transaction usable (pglock works under a savepoint).

    :param conn: a psycopg ``Connection`` in a transaction (or non-autocommit, where the
        statement begins one as any psycopg statement does), a SQLAlchemy ``Connection`` or an
        ORM ``Session`` (psycopg driver).
    :raises pglock.LockNotAcquired: not acquired within ``timeout`` (``0``: held elsewhere,
        or by another thread's ``pg_lock`` on this connection, which is waited for in-process).
    :raises pglock.InvalidConnectionState: no transaction is open (autocommit), or the
        transaction has failed, or another thread holds (or is taking) the name in this same
        transaction: threads sharing one transaction cannot exclude each other.

    Example::

        with session.begin():
            pglock.xact_lock(session, "account:1")
            session.execute(...)
    """
    pairs = normalize_names(names)
    validate_flag(shared, "shared")
    t = validate_timeout(timeout)
    target = _conn.resolve(conn, "xact_lock")
    keys = [k for k, _ in pairs]
    names_ = [n for _, n in pairs]
    if not _xact_acquire(target, keys, names_, shared=shared, timeout=t):
        raise LockNotAcquired(
            names_[0] if len(names_) == 1 else ", ".join(names_),
            key=keys[0] if len(keys) == 1 else None,
            timeout=t,
        )


def try_xact_lock(conn: object, names: str | Sequence[str], *, shared: bool = False) -> bool:
    """Try once to take a transaction-level advisory lock; True if taken.

    See :func:`xact_lock`; this is ``timeout=0`` returning False instead of raising.
    """
    pairs = normalize_names(names)
    validate_flag(shared, "shared")
    target = _conn.resolve(conn, "try_xact_lock")
    return _xact_acquire(
        target, [k for k, _ in pairs], [n for _, n in pairs], shared=shared, timeout=0.0
    )


# --- implementation ------------------------------------------------------------------------


def _reserve(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: Sequence[int],
    names: Sequence[str],
    me: threading.Thread,
    shared: bool,
    deadline: float | None,
    *,
    checked: bool = False,
) -> list[int] | None:
    """Wait until no other thread holds ``keys`` on this session in a conflicting mode, then
    record ``me`` as a holder. Returns the keys the session must still take from Postgres, or
    None on timeout. All keys are granted together: a thread never waits while holding some.

    Another thread's transaction lock on a key in the transaction open on this connection
    refuses at once (:func:`_xact_conflicts`: pglock cannot wait for that transaction to end
    on the same connection)."""
    mode = "s" if shared else "x"
    with state.cond:
        while True:
            if state.xact:
                _xact_conflicts(conn, state, keys, names, me, checked)
            blocked = False
            for k, n in zip(keys, names, strict=True):
                hold = state.holds.get(k)
                if hold is None:
                    continue
                if me in hold.owners:
                    if hold.mode == "s" and mode == "x":
                        raise LockError(
                            f"this thread holds {n!r} shared and asks for it exclusive: "
                            "upgrading a lock is not supported; release it first"
                        )
                    continue  # re-entry, counted
                if hold.pending or hold.mode == "x" or mode == "x":
                    blocked = True
                    break
            if not blocked:
                break
            remaining = _remaining(deadline)
            if remaining == 0.0:
                return None
            state.cond.wait(remaining)
        need: list[int] = []
        for k in keys:
            hold = state.holds.get(k)
            if hold is None:
                state.holds[k] = KeyHold(mode, {me: 1}, pending=True)
                need.append(k)
            else:
                hold.owners[me] = hold.owners.get(me, 0) + 1
        return need


def _unreserve(state: ConnState, keys: Sequence[int], me: threading.Thread) -> list[int]:
    """Drop one count of ``me`` from ``keys``; return the keys no thread holds any more.

    Those stay recorded as pending (so other threads wait) until :func:`_settle` runs."""
    with state.cond:
        emptied: list[int] = []
        for k in keys:
            hold = state.holds.get(k)
            if hold is None:
                continue
            owners = hold.owners
            left = owners.get(me, 0) - 1
            if left > 0:
                owners[me] = left
            else:
                owners.pop(me, None)
            if not owners:
                hold.pending = True
                emptied.append(k)
        return emptied


def _settle(state: ConnState, granted: Sequence[int], dropped: Sequence[int]) -> None:
    with state.cond:
        for k in granted:
            hold = state.holds.get(k)
            if hold is not None:
                hold.pending = False
        for k in dropped:
            state.holds.pop(k, None)
        state.cond.notify_all()


def _acquire(
    target: Target,
    keys: list[int],
    names: list[str],
    *,
    shared: bool,
    timeout: float | None,
) -> bool:
    conn = target.conn
    state = _conn.state_for(conn)
    me = threading.current_thread()
    deadline = _deadline(timeout)
    try:
        need = _reserve(conn, state, keys, names, me, shared, deadline)
    except _Recheck as recheck:
        _drop_stale_xact(conn, state, recheck.records, Context(names, keys, timeout))
        need = _reserve(conn, state, keys, names, me, shared, deadline, checked=True)
    if need is None:
        return False
    if not need:
        logger.debug("re-entered %r", names)
        return True
    granted = False
    try:
        remaining = _remaining(deadline)
        ctx = Context(
            [names[keys.index(k)] for k in need], need, timeout, _conn.answer_deadline(deadline)
        )
        granted = _session_lock(conn, state, need, ctx, shared=shared, timeout=remaining)
        if granted:
            _settle(state, need, ())
            logger.debug("acquired %r (%s)", names, "shared" if shared else "exclusive")
    except BaseException:
        if granted:
            # Interrupted (KeyboardInterrupt) after Postgres granted the lock but before the
            # handle could record it: nobody would release it, so give it back now.
            _release(conn, keys, names, me)
        raise
    finally:
        if not granted:
            _unreserve(state, keys, me)
            _settle(state, (), need)
    return granted


def _prepare(conn: psycopg.Connection[Any], state: ConnState, ctx: Context) -> Any:
    """Check the connection, flush deferred unlocks, probe the server once.

    Returns the transaction status pglock found (IDLE or INTRANS)."""
    status = _conn.check_usable(conn)
    if state.deferred or not state.probed:
        _in_own_transaction(conn, status, lambda: _housekeeping(conn, state, ctx))
    return status


def _housekeeping(conn: psycopg.Connection[Any], state: ConnState, ctx: Context) -> None:
    if state.deferred:
        pending, state.deferred = state.deferred, []
        for k, shared in pending:
            _conn.run(conn, _sql.unlock([k], shared=shared))
        logger.info("released %d deferred advisory lock(s)", len(pending))
    if not state.probed:
        _conn.probe(conn, state, ctx)


def _in_own_transaction(conn: psycopg.Connection[Any], status: Any, fn: Any) -> Any:
    """Run ``fn`` so that an idle non-autocommit connection is idle again afterwards."""
    if status == IDLE and not conn.autocommit:
        try:
            result = fn()
        except BaseException:
            _safe_rollback(conn)
            raise
        conn.commit()
        return result
    return fn()


def _safe_rollback(conn: psycopg.Connection[Any]) -> None:
    if conn.closed or conn.broken:
        return
    try:
        if conn.autocommit:
            if conn.info.transaction_status != IDLE:
                _conn.fetch(conn, b"ROLLBACK")
        else:
            conn.rollback()
    except psycopg.Error:
        logger.debug("rollback after a failed attempt failed", exc_info=True)


def _session_lock(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: list[int],
    ctx: Context,
    *,
    shared: bool,
    timeout: float | None,
) -> bool:
    status = _prepare(conn, state, ctx)
    if state.pooler:
        raise _conn.pooler_error(state)
    try_ = timeout == 0
    stmt, undo = _session_batch(
        conn, status, keys, shared=shared, try_=try_, limit=_wait_limit(timeout, state)
    )
    registering = _registry.pending(
        conn, state, ctx.keys, ctx.names, own_transaction=status != INTRANS
    )
    if registering:
        # This process's first use of these names here: record them in the same round trip,
        # after the lock statement (see pglock._registry for why that order).
        if stmt is None:
            stmt = _sql.lock(keys, shared=shared, xact=False, try_=try_)
        stmt = sql.SQL("; ").join([stmt, _registry.statement(registering)])

    own_tx = status == IDLE and not conn.autocommit
    try:
        if stmt is None and len(keys) == 1:  # the common case: no timeout, no caller's transaction
            row = _conn.run_one(conn, _sql.LOCK_ONE[(False, shared, try_)], (keys[0],), ctx)
            rows = [(keys[0], row[0] if row else None)]
        elif stmt is None:
            rows = _conn.run_rows(conn, _sql.LOCK_MANY[(shared, try_)], (keys,), ctx)
        else:
            rows = _conn.run(conn, stmt, ctx)
        if own_tx:
            conn.commit()
        _registry.mark(conn, registering)
    except BaseException as exc:
        _after_failed_session_lock(conn, status, undo, keys, shared)
        if isinstance(exc, LockNotAcquired):
            if _cut_short(conn, state, timeout):
                return _session_lock(conn, state, keys, ctx, shared=shared, timeout=timeout)
            return False
        raise
    return not try_ or _all_or_nothing(conn, status, rows, keys, shared)


def _all_or_nothing(
    conn: psycopg.Connection[Any],
    status: Any,
    rows: list[tuple[Any, ...]],
    keys: list[int],
    shared: bool,
) -> bool:
    """After a try-lock of several keys: True if every key was granted, else give back the
    ones that were (all-or-nothing) and say False."""
    got = [k for k, ok in rows if ok]
    if len(got) == len(keys):
        return True
    if got:
        _in_own_transaction(conn, status, lambda: _conn.run(conn, _sql.unlock(got, shared=shared)))
    return False


def _session_batch(
    conn: psycopg.Connection[Any],
    status: Any,
    keys: list[int],
    *,
    shared: bool,
    try_: bool,
    limit: int | None,
) -> tuple[sql.Composed | None, sql.Composed | None]:
    """The batch a session-lock attempt sends, and what undoes it after a failure; (None,
    None) for the lock statement alone (no timeout to set, no caller's transaction)."""
    if status != INTRANS and limit is None:
        return None, None
    lock = _sql.lock(keys, shared=shared, xact=False, try_=try_)
    if status == INTRANS:
        # In the caller's transaction: a savepoint keeps it usable if the attempt fails, and
        # rolling back to it undoes SET LOCAL; session locks survive the rollback.
        parts: list[sql.Composable] = [_sql.savepoint()]
        if limit is not None:
            parts.append(_sql.set_local_timeouts(limit, several=len(keys) > 1))
        parts += [lock, _sql.rollback_to_savepoint()]
        return sql.SQL("; ").join(parts), _sql.rollback_to_savepoint()
    assert limit is not None
    parts = [_sql.set_local_timeouts(limit, several=len(keys) > 1), lock]
    if conn.autocommit:
        parts = [sql.SQL("BEGIN"), *parts, sql.SQL("COMMIT")]
    return sql.SQL("; ").join(parts), None


def _after_failed_session_lock(
    conn: psycopg.Connection[Any],
    status: Any,
    undo: sql.Composed | None,
    keys: list[int],
    shared: bool,
) -> None:
    """Leave the caller's transaction as it was and hold nothing, after a failed attempt.

    Postgres may have granted some keys (several names, or a grant racing the timeout or a
    cancel): session locks survive the rollback, so look in pg_locks and undo them."""
    _conn.recover_interrupted(conn)
    if conn.closed or conn.broken:
        return  # the session is gone, and its locks with it
    try:
        if undo is not None:
            # The batch stopped inside pglock's savepoint (on success it is already gone).
            if conn.info.transaction_status == INERROR:
                _conn.run(conn, undo)
        else:
            _safe_rollback(conn)
        undone = _in_own_transaction(
            conn,
            conn.info.transaction_status,
            lambda: _conn.run(conn, _sql.unlock_if_held(keys, shared=shared)),
        )
        if undone:
            logger.debug("undid %d lock(s) granted to a failed attempt", len(undone))
    except (psycopg.Error, LockError):
        # Never replace the error that made the attempt fail with one from the clean-up.
        logger.warning("could not clean up after a failed lock attempt", exc_info=True)


def _release(
    conn: psycopg.Connection[Any],
    keys: list[int],
    names: list[str],
    owner: threading.Thread,
) -> None:
    state = _conn.state_for(conn)
    emptied = _unreserve(state, keys, owner)
    if not emptied:
        logger.debug("left re-entered %r", names)
        return
    by_mode: dict[bool, list[int]] = {}
    with state.cond:
        for k in emptied:
            hold = state.holds.get(k)
            by_mode.setdefault(hold is not None and hold.mode == "s", []).append(k)
    try:
        _session_unlock(conn, state, by_mode, names)
    finally:
        _settle(state, (), emptied)
    logger.debug("released %r", names)


def _session_unlock(
    conn: psycopg.Connection[Any],
    state: ConnState,
    by_mode: dict[bool, list[int]],
    names: list[str],
) -> None:
    if conn.closed or conn.broken:
        raise LockLost(", ".join(names), reason="the connection was closed, so Postgres dropped it")
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

    def unlock_all() -> bool:
        ok = True
        for shared, keys in by_mode.items():
            if len(keys) == 1:
                row = _conn.run_one(conn, _sql.UNLOCK_ONE[shared], (keys[0],))
            else:
                row = _conn.run_one(conn, _sql.UNLOCK_MANY[shared], (keys,))
            ok = ok and bool(row and row[0])
        return ok

    try:
        ok = _in_own_transaction(conn, status, unlock_all)
    except psycopg.OperationalError as exc:
        if conn.closed or conn.broken:
            raise LockLost(
                ", ".join(names), reason=f"the connection broke ({exc.sqlstate or exc})"
            ) from exc
        raise
    if not ok:
        raise LockLost(
            ", ".join(names),
            reason="the session no longer held it (released behind pglock's back, or the "
            "connection was reset)",
        )


def _xact_acquire(
    target: Target,
    keys: list[int],
    names: list[str],
    *,
    shared: bool,
    timeout: float | None,
) -> bool:
    conn = target.conn
    status = _conn.check_usable(conn)
    if status == IDLE and conn.autocommit:
        raise InvalidConnectionState(
            "xact_lock needs an open transaction: this connection is in autocommit mode, so the "
            "lock would be released as soon as it is taken; use 'with conn.transaction():' "
            "(or pg_lock for a session-level lock)"
        )
    _conn.ensure_sqlalchemy_transaction(target)
    state = _conn.state_for(conn)
    me = threading.current_thread()
    deadline = _deadline(timeout)
    ctx = Context(names, keys, timeout, _conn.answer_deadline(deadline))
    if not state.probed or state.deferred:
        _housekeeping(conn, state, ctx)
    try:
        prior = _xact_reserve(conn, state, keys, names, me, shared=shared, deadline=deadline)
    except _Recheck as recheck:
        _drop_stale_xact(conn, state, recheck.records, ctx)
        prior = _xact_reserve(
            conn, state, keys, names, me, shared=shared, deadline=deadline, checked=True
        )
    if prior is None:
        return False  # another thread's pg_lock on this connection held a key until the deadline
    started: Any = _UNKNOWN
    try:
        started = _xact_statement(
            conn, state, keys, names, shared=shared, timeout=_remaining(deadline), ctx=ctx
        )
        if started is _AGAIN:  # cut short by the session's own timeouts: once more, overriding
            started = _UNKNOWN
            started = _xact_statement(
                conn, state, keys, names, shared=shared, timeout=_remaining(deadline), ctx=ctx
            )
            if started is _AGAIN:
                started = None
    finally:
        _xact_settle(state, keys, me, prior, started)
    if started is None:
        return False
    logger.debug("acquired transaction lock %r", names)
    return True


# -- transaction-lock bookkeeping ------------------------------------------------------------
#
# Two threads sharing one connection share one Postgres session and, once a transaction is
# open, one transaction: Postgres grants the second a transaction lock the first holds. pglock
# records every transaction lock it takes (ConnState.xact) *before* sending any SQL, so the
# second thread is refused; a failed attempt drops its reservation. A record can outlive its
# lock (the transaction ended, or a rolled-back savepoint released the lock): before a record
# makes pglock refuse anyone, pg_locks is asked (one query, on that conflict path only).

_UNKNOWN: Any = object()


class _Recheck(Exception):
    """Another thread's settled transaction-lock records conflict: check them in pg_locks."""

    def __init__(self, records: dict[int, XactHold]) -> None:
        super().__init__("recheck")
        self.records = records


def _xact_refusal(name: str) -> InvalidConnectionState:
    return InvalidConnectionState(
        f"another thread holds {name!r} in this same transaction on this connection (as a "
        "transaction lock, or is taking it now); threads sharing one transaction cannot "
        "exclude each other, so use one connection per thread"
    )


def _xact_conflicts(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: Sequence[int],
    names: Sequence[str],
    me: threading.Thread,
    checked: bool,
) -> None:
    """Under ``state.cond``: refuse, or ask for a pg_locks check, when another thread has a
    transaction-lock record on one of ``keys``.

    Records of a transaction that has ended are dropped here without SQL when the connection
    is idle (read after the record was settled, so that transaction is over). A pending
    record (another thread's statement in flight, in the transaction now open) refuses at
    once, as does any conflicting record once pg_locks was checked (``checked``): it was made
    since, in this transaction."""
    foreign = {k: r for k in keys if (r := state.xact.get(k)) is not None and r.owner is not me}
    if not foreign:
        return
    if conn.pgconn.transaction_status == IDLE:
        for k, r in list(foreign.items()):
            if not r.pending:
                del state.xact[k]
                del foreign[k]
        if not foreign:
            return
    first = next(iter(foreign))
    if checked or any(r.pending for r in foreign.values()):
        raise _xact_refusal(names[list(keys).index(first)])
    raise _Recheck(foreign)


def _drop_stale_xact(
    conn: psycopg.Connection[Any], state: ConnState, records: dict[int, XactHold], ctx: Context
) -> None:
    """Ask pg_locks whether the session still holds the keys of ``records`` (other threads'
    transaction locks) in the transaction now open; forget the records that outlived their
    lock, and refuse (InvalidConnectionState) for one that did not.

    A key counts as still held when pg_locks shows it held by this session (in any mode; a
    session lock on the same key is indistinguishable there, so the answer errs towards
    refusing) and the record's transaction is the open one (or unknown)."""
    keys = sorted(records)
    status = _conn.check_usable(conn)
    now: Any = None
    held: set[int] = set()
    if status != IDLE:  # no transaction open: every settled record is of an ended one
        try:
            rows = _conn.run(conn, _sql.held_in_transaction(keys), ctx)
        except BaseException:
            _undo_xact_attempt(conn)
            raise
        now, found = rows[0]
        held = set(found or ())
    with state.cond:
        for k in keys:
            record = records[k]
            if state.xact.get(k) is not record:
                continue  # changed meanwhile: judged again under the lock
            if k in held and (record.started is None or record.started == now):
                names = ctx.names
                raise _xact_refusal(names[list(ctx.keys).index(k)])
            del state.xact[k]
            logger.debug("forgot a transaction-lock record that outlived its lock (key %d)", k)


def _xact_reserve(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: Sequence[int],
    names: Sequence[str],
    me: threading.Thread,
    *,
    shared: bool,
    deadline: float | None,
    checked: bool = False,
) -> dict[int, XactHold | None] | None:
    """Record ``me`` as taking ``keys`` in the connection's transaction, before any SQL.

    Waits first (in-process, until ``deadline``) while another thread holds one of the keys
    as a session lock on this connection in a conflicting mode: Postgres would grant this
    session the key at once. Returns the records it replaced (restored if the attempt fails),
    or None at the deadline.

    :raises InvalidConnectionState: another thread holds or is taking a key in this same
        transaction.
    :raises _Recheck: another thread's record conflicts and pg_locks must say if it is stale.
    """
    mode = "s" if shared else "x"
    with state.cond:
        while state.holds and _session_conflict(state, keys, me, mode):
            remaining = _remaining(deadline)
            if remaining == 0.0:
                return None
            state.cond.wait(remaining)
        if state.xact:
            _xact_conflicts(conn, state, keys, names, me, checked)
        prior = {k: state.xact.get(k) for k in keys}
        for k in keys:
            state.xact[k] = XactHold(me, mode)
        return prior


def _session_conflict(
    state: ConnState, keys: Sequence[int], me: threading.Thread, mode: str
) -> bool:
    """Under ``state.cond``: does another thread hold (or take, or give back) one of ``keys``
    as a session lock on this connection, in a mode that excludes ``mode``?"""
    for k in keys:
        hold = state.holds.get(k)
        if hold is None:
            continue
        if not hold.owners:
            return True  # being released: the session holds it until the unlock has run
        others = any(o is not me for o in hold.owners)
        if others and (hold.mode == "x" or mode == "x"):
            return True
    return False


def _xact_settle(
    state: ConnState,
    keys: Sequence[int],
    me: threading.Thread,
    prior: dict[int, XactHold | None],
    started: Any,
) -> None:
    """Turn this attempt's reservations into records (granted), back into what they replaced
    (not granted: ``started`` is None), or into records of unknown outcome (an unexpected
    error or an interrupt: the lock may be held, so pg_locks decides when another thread
    asks)."""
    with state.cond:
        mine = {k: r for k in keys if (r := state.xact.get(k)) is not None and r.owner is me}
        if started is None:
            for k in mine:
                before = prior.get(k)
                if before is None:
                    del state.xact[k]
                else:
                    state.xact[k] = before
            return
        if started is not _UNKNOWN and len(state.xact) > len(mine):
            # Records of other, ended transactions (the connection has one at a time).
            for k in [
                k for k, r in state.xact.items()
                if not r.pending and r.started is not None and r.started != started
            ]:
                del state.xact[k]
        for r in mine.values():
            r.pending = False
            r.started = None if started is _UNKNOWN else started


def _xact_statement(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: list[int],
    names: list[str],
    *,
    shared: bool,
    timeout: float | None,
    ctx: Context,
) -> Any:
    """Send the transaction-lock statement: the transaction's identity (its start) when
    granted, None when not acquired in time, ``_AGAIN`` when the session's own timeouts cut a
    wait without a timeout short (send it again). A failed attempt leaves the caller's
    transaction as it was (pglock's savepoint is rolled back)."""
    try_ = timeout == 0
    registering = _registry.pending(conn, state, keys, names)
    limit = _wait_limit(timeout, state)
    if limit is None and len(keys) == 1 and not registering:
        # The common case, in one pre-rendered round trip (see _sql.xact_one).
        stmt = _sql.xact_one(keys[0], shared=shared, try_=try_)
        rows = _xact_run(conn, state, timeout, lambda: _conn.run(conn, stmt, ctx))
        if rows is None or rows is _AGAIN:
            return rows
        started, got = rows[0]
        return None if try_ and not got else started
    started = _xact_batch(
        conn, state, keys, shared=shared, timeout=timeout, limit=limit,
        registering=registering, ctx=ctx,
    )
    if started is not None and started is not _AGAIN:
        _registry.mark(conn, registering)
    return started


def _xact_run(
    conn: psycopg.Connection[Any],
    state: ConnState,
    timeout: float | None,
    send: Callable[[], _T],
) -> _T | Any:
    """``send()``; None when the lock was not acquired in time, ``_AGAIN`` when the session's
    own timeouts cut the wait short. After any failure the caller's transaction is back as it
    was before pglock's savepoint."""
    try:
        return send()
    except BaseException as exc:
        _undo_xact_attempt(conn)
        if isinstance(exc, LockNotAcquired):
            return _AGAIN if _cut_short(conn, state, timeout) else None
        raise


def _xact_batch(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: list[int],
    *,
    shared: bool,
    timeout: float | None,
    limit: int | None,
    registering: Any,
    ctx: Context,
) -> Any:
    """Several keys, a wait limit, or a name to register: the statement as a batch under
    pglock's savepoint. The transaction's start when granted, None when not, ``_AGAIN`` to
    send it again (see :func:`_xact_statement`)."""
    try_ = timeout == 0
    parts: list[sql.Composable] = [_sql.savepoint()]
    if limit is not None:
        parts += [
            _sql.current_timeouts(),
            _sql.set_local_timeouts(limit, several=len(keys) > 1),
        ]
    parts += [_sql.TRANSACTION_START, _sql.lock(keys, shared=shared, xact=True, try_=try_)]
    # One round trip in the common cases: the savepoint can be released in the same batch
    # unless a partial multi-key try must be rolled back or SET LOCAL must be undone.
    released = limit is None and not (try_ and len(keys) > 1)
    if released:
        parts.append(_sql.release_savepoint())
        if registering:
            parts.append(_registry.statement(registering))
    batch = sql.SQL("; ").join(parts)
    results = _xact_run(conn, state, timeout, lambda: _conn.run_all(conn, batch, ctx))
    if results is None or results is _AGAIN:
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
            lock_timeout, statement_timeout = results[0][0]
            tail.append(_sql.restore_timeouts(lock_timeout, statement_timeout))
        tail.append(_sql.release_savepoint())
        if registering:
            tail.append(_registry.statement(registering))
        rest = sql.SQL("; ").join(tail)
        done = _xact_run(conn, state, timeout, lambda: _conn.run(conn, rest, ctx))
        if done is None or done is _AGAIN:
            return done
    return results[-2][0][0]


def _undo_xact_attempt(conn: psycopg.Connection[Any]) -> None:
    """After a failed transaction-lock batch: back to the caller's transaction as it was."""
    _conn.recover_interrupted(conn)
    if conn.closed or conn.broken or conn.pgconn.transaction_status != INERROR:
        return  # gone, or the batch ended before/after pglock's savepoint was open
    try:
        _conn.run(conn, _sql.rollback_to_savepoint())
    except (psycopg.Error, LockError):
        # Never replace the error that made the attempt fail with one from the clean-up.
        logger.warning("could not roll back to pglock's savepoint", exc_info=True)
