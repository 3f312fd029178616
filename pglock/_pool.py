"""Pool-aware locking: :func:`pool_lock` checks a connection out, locks, and gives it back
unlocked or not at all; :func:`reset_connection` releases whatever a returned connection still
holds. Why and how: docs/pools.md.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, cast

import psycopg
from psycopg_pool import PoolTimeout

from . import _conn, _sql
from ._advisory import PgLock
from ._base import BaseLock, forked
from ._classify import Deferred, Kind, check_driver, classify
from ._conn import IDLE, INERROR, INTRANS
from ._django import connected as django_connected
from ._django import pool_of as django_pool
from ._keys import deadline as _deadline
from ._keys import normalize_names, validate_flag, validate_timeout
from ._keys import remaining as _remaining
from .errors import LockError, LockNotAcquired, SelfDeadlock, UnsupportedServer

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

logger = logging.getLogger("pglock.pool")


_RESET_LOST = (
    "the connection went back to its pool while the lock was held, and the pool's reset hook "
    "released every advisory lock on it"
)

_LEFTOVER_LOST = (
    "it was still held when pool_lock {names!r} gave its connection back to the pool (taken "
    "on that connection in the block and never released), so pglock released every advisory "
    "lock of the session first"
)

_DISCARD_LOST = (
    "pool_lock {names!r} discarded its connection (the release could not be confirmed), and "
    "Postgres drops every lock of a closed session"
)

# What each thread holds through a pool: (id of the pool, key) -> the session's bookkeeping. A
# nested request for one would wait on another session for this thread's own lock (Postgres
# sees no deadlock: the cycle goes through the client). Weak values: a lock object collected
# unreleased leaves no mark once its connection is gone or a reset hook released its lock.


class _Marks(threading.local):
    def __init__(self) -> None:
        self.marks = weakref.WeakValueDictionary[tuple[int, int], _conn.ConnState]()


_pooled = _Marks()


def _pool_id(kind: str, source: Any) -> int:
    """The identity of the pool connections come from: an Engine's pool (engines made by
    ``execution_options()`` share their parent's), or the psycopg_pool pool itself."""
    return id(source.pool) if kind == "sqlalchemy" else id(source)


def reset_connection(conn: object) -> None:
    """Release every advisory lock a pooled connection still holds: a psycopg_pool reset hook.

    One statement releases the session's advisory locks, with a WARNING on ``pglock.pool``
    naming leaked keys; a ``pg_lock`` handle still on one raises :class:`pglock.LockLost`.
    If it fails, psycopg_pool discards the connection. Cost and details: docs/pools.md.

    A Django connection (``django.db.connection``) is reset the same way if it is connected
    (a no-op if not): for persistent connections (``CONN_MAX_AGE``), called at the end of each
    request (docs/django.md).

    :raises TypeError: ``conn`` is not a psycopg ``Connection`` or a Django connection on
        psycopg 3.
    :raises pglock.InvalidConnectionState: in a forked child, a connection pglock used in the
        parent (cut off first: the pool's close of it leaves the parent's session alone).

    Example::

        pool = psycopg_pool.ConnectionPool(dsn, reset=pglock.reset_connection, open=False)
    """
    if classify(conn, (Kind.CONNECTION, Kind.DJANGO), api="reset_connection") is Kind.DJANGO:
        found = django_connected(conn)
        if found is None:
            return
        pg = found
    else:
        pg = cast(psycopg.Connection[Any], conn)
    if pg.closed or pg.broken:
        _conn.forget(pg, lost=_RESET_LOST)
        return
    reset(pg, "pool reset")


def reset(conn: psycopg.Connection[Any], source: str) -> None:
    """A pool's reset of ``conn`` (open) given back by the application: end a failed
    transaction, then :func:`release_all` (in an open transaction, which the pool ends: session
    locks go at once all the same). Refused, with nothing sent, in a forked child on a
    connection pglock used in the parent, which is cut off first: the pool discards a
    connection its reset fails on, and its close must not end the parent's session."""
    _conn.not_inherited(conn, cut_off=True)
    status = conn.info.transaction_status
    if status == INERROR:
        conn.rollback()
        status = IDLE
    release_all(conn, source=source, end_own_transaction=status == IDLE)


def release_all(
    conn: psycopg.Connection[Any], *, source: str, end_own_transaction: bool,
    lost: str = _RESET_LOST,
) -> list[str]:
    """Drop every advisory lock of ``conn``'s session and pglock's bookkeeping for it (handles
    raise LockLost with ``lost``); return the leaked ones (``"key"`` or ``"key shared"``)."""
    state = _conn.forget(conn, lost=lost)
    flip = end_own_transaction and not conn.autocommit
    if flip:
        # One round trip instead of two (statement + COMMIT): flipping autocommit on an idle
        # connection is client-side only.
        conn.autocommit = True
    try:
        row = _conn.run_one(conn, _sql.UNLOCK_ALL_REPORTING, ())
    finally:
        if flip and not conn.closed:
            conn.autocommit = False
    held: list[str] = list(row[0] or []) if row else []
    if not held:
        return []
    deferred = set()
    believed: list[int] = []
    if state is not None:
        with state.lock:
            deferred = {f"{k} shared" if s else str(k) for k, s in state.deferred}
            believed = sorted(k for k, h in state.holds.items() if h.owners)
    leaked = [h for h in held if h not in deferred]
    if len(leaked) < len(held):
        logger.info("%s released %d deferred advisory lock(s)", source, len(held) - len(leaked))
    if leaked:
        why = f"pglock handles still believed they held keys {believed}: they will raise LockLost"
        logger.warning(
            "%s: the connection came back holding %d advisory lock(s), now released: keys %s (%s)",
            source, len(leaked), ", ".join(leaked),
            why if believed else "taken outside pglock, e.g. by raw SQL",
        )
    return leaked


#: What to use instead, when pool_lock (or a Locker) gets something it cannot check out of.
_USE_PG_LOCK = dict.fromkeys(
    (Kind.CONNECTION, Kind.SA_CONNECTION, Kind.SESSION),
    "pool_lock checks a connection out of a pool; for a connection you already hold use "
    "pglock.pg_lock(connection, ...)",
)
_USE_PG_LOCK[Kind.DSN] = "use pglock.Locker(dsn), which keeps a pool for a DSN"
_USE_PG_LOCK[Kind.DJANGO] = (
    "pass connections[alias].pool (Django's pool, DATABASES OPTIONS 'pool'), or use "
    "pglock.pg_lock(connection, ...) for a lock on the connection itself"
)


#: Classes classify() found to be psycopg_pool pools (the common case, without the walk).
_POOL_TYPES: set[type] = set()


def _classify(source: object, api: str = "pool_lock", django: bool = False) -> str:
    """``"psycopg_pool"`` or ``"sqlalchemy"`` (or ``"django"``, a Django connection, when
    ``django``); TypeError for anything else (no I/O)."""
    if type(source) in _POOL_TYPES:
        return "psycopg_pool"
    accepted = (Kind.POOL, Kind.ENGINE, Kind.DJANGO) if django else (Kind.POOL, Kind.ENGINE)
    kind = classify(source, accepted, api=api, hints=_USE_PG_LOCK)
    if kind is Kind.POOL:
        _POOL_TYPES.add(type(source))
        return "psycopg_pool"
    if kind is Kind.DJANGO:
        return "django"
    check_driver(cast(Any, source).dialect)
    return "sqlalchemy"


class PoolLockOptions(TypedDict, total=False):
    """The options of :func:`pool_lock` and :meth:`Locker.lock` (one definition for both)."""

    shared: bool
    timeout: float | None
    pooler: str


class PoolLock(BaseLock):
    """A session advisory lock on a connection checked out of a pool: see :func:`pool_lock`.

    Returned by :func:`pool_lock` and :meth:`Locker.lock`; ``with`` (or :meth:`acquire`)
    yields the connection (also :attr:`connection` while held). :meth:`close` cancels a
    blocked lock statement at once.

    Thread safety: one acquisition at a time, released by the thread that took it. Create one
    per use (no I/O before :meth:`acquire`); ``close()`` may come from any thread.
    """

    def __init__(
        self, source: object, names: str | Sequence[str], *, shared: bool = False,
        timeout: float | None = None, pooler: str = "auto",
    ) -> None:
        self._pairs = normalize_names(names)
        self._shared = validate_flag(shared, "shared")
        self._timeout = validate_timeout(timeout)
        self._pooler = _conn.validate_pooler(pooler)
        kind = None if isinstance(source, Deferred) else _classify(source, django=True)
        if kind == "django":  # its pool (OPTIONS "pool"), found and opened at the first use
            django_pool(source, open=False)  # refused now if it has none (no I/O)
            kind, source = None, Deferred(functools.partial(django_pool, source))
        self._kind: str | None = kind
        self._given = source
        self._mutex = threading.Lock()
        self._busy = False  # an acquire() is running
        self._waiting: PgLock | None = None  # the lock its acquire waits in (close wakes it)
        self._miss: tuple[str, BaseException] | None = None  # why the checkout gave up
        self._source: Any = None
        self._conn: Any = None  # what the body gets
        self._lock: PgLock | None = None
        # This thread's record of pooled holds, and the marks this acquisition added to it.
        self._marks: tuple[Any, list[tuple[int, int]], _conn.ConnState] | None = None

    @property
    def names(self) -> list[str]:
        """The names of this lock, sorted by key."""
        return [n for _, n in self._pairs]

    @property
    def locked(self) -> bool:
        """True while held (between acquire and release), as pglock believes."""
        return self._lock is not None and self._lock.locked

    @property
    def connection(self) -> Any:
        """The connection holding the lock (what ``with`` yields) while held, else None."""
        return self._conn

    def __repr__(self) -> str:
        mode = "shared" if self._shared else "exclusive"
        state = "locked" if self.locked else "unlocked"
        return f"<pglock.PoolLock {self.names!r} {mode} {state}>"

    def _not_acquired(self) -> LockNotAcquired:
        miss, self._miss = self._miss, None
        err = LockNotAcquired.for_names(
            self.names, keys=[k for k, _ in self._pairs], timeout=self._timeout,
            message=miss[0] if miss else None,
        )
        if miss:
            err.__cause__ = miss[1]
        return err

    def _forget_threads(self) -> None:
        self._busy, self._waiting = False, None

    def _outstanding(self) -> bool:
        lock = self._lock  # not held in a forked child of the process that took it
        return lock is not None and lock._outstanding()

    def _entered(self) -> Any:
        return self._conn

    def _acquire(self, timeout: float | None) -> bool:
        with self._mutex:
            if self._busy or self._outstanding():
                raise RuntimeError(
                    f"this pool_lock {self.names!r} is already held or being acquired; "
                    "create one per holder"
                )
            self._busy = True
        waiters = self._waiters()
        generation = waiters.enter()
        try:
            return self._take(timeout, lambda: waiters.closed(generation))
        finally:
            waiters.leave()
            with self._mutex:
                self._busy = False

    def _take(self, timeout: float | None, closed: Callable[[], bool]) -> bool:
        self._miss = None
        source: Any = self._given.resolve() if isinstance(self._given, Deferred) else self._given
        kind = self._kind = self._kind or _classify(source)
        marks = _pooled.marks
        pool_id = _pool_id(kind, source)
        for k, n in self._pairs:
            if (held := marks.get((pool_id, k))) is not None and held.lost is None:
                # Before any checkout (a pool of one would wait for the outer connection). Only
                # this thread can release that lock: a bounded wait could only end in False.
                why = f"could not acquire lock {n!r}: this thread holds it through this pool"
                self._miss = (why, SelfDeadlock(n, key=k))
                if timeout is None:
                    raise self._miss[1]
                return False
        deadline = _deadline(timeout)
        # An Engine waits for a connection up to its own pool_timeout.
        pooled = kind == "psycopg_pool"
        conn = self._checkout_psycopg(source, timeout) if pooled else source.connect()
        if conn is None:
            return False
        try:
            lock = PgLock(conn, self.names, shared=self._shared, pooler=self._pooler)
            with self._mutex:
                self._waiting = lock
            ok = not closed() and lock.acquire(timeout=_remaining(deadline))
        except BaseException as exc:
            # A lock attempt that failed on its own terms left nothing held; anything else
            # (a broken connection, an interrupt mid-statement) may have: discard.
            self._waiting = None
            _give_back(kind, source, conn, discard=not isinstance(exc, UnsupportedServer))
            raise
        self._waiting = None
        if not ok:
            _give_back(kind, source, conn, discard=False)
            return False
        self._source, self._conn, self._lock = source, conn, lock
        mine, state = [(pool_id, k) for k, _ in self._pairs], cast(_conn.ConnState, lock._state)
        marks.update(dict.fromkeys(mine, state))
        self._marks = (marks, mine, state)
        if closed():  # granted as close() ran: a woken acquire() holds nothing
            self._end(None)
            return False
        return True

    def _checkout_psycopg(self, pool: Any, timeout: float | None) -> Any:
        if not timeout:  # None or 0: the checkout waits as the pool is configured to
            return pool.getconn()
        try:
            return pool.getconn(timeout=timeout)
        except PoolTimeout as exc:
            text = f"could not get a connection from the pool within {timeout:.2f} s to lock"
            self._miss = (f"{text} {', '.join(self.names)!r}", exc)
            return None

    def _wake(self) -> None:
        # The inner pg_lock's close() cancels its statement only while it is in flight (never
        # the next borrower's); closed before its wait began, it is closed again until the
        # waiter has left (a few tries at most).
        pause, given_up = 0.01, time.monotonic() + 10
        while time.monotonic() < given_up:
            with self._mutex:
                lock = self._waiting
            if lock is None:
                return
            try:
                lock.close()
            except Exception:
                logger.debug("waking a pool_lock wait failed", exc_info=True)
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def release(self) -> None:
        """Commit what :attr:`connection` left open, release the lock and give the connection
        back to its pool (discarded when the release cannot be confirmed).

        :raises RuntimeError: not held (in a forked child: the parent holds it; nothing sent).
        :raises pglock.LockLost: the lock was found gone (the connection was discarded).
        """
        if self._conn is None:
            raise RuntimeError(f"release of an unlocked pool_lock {self.names!r}")
        inherited = not self._outstanding()
        self._end(None)
        if inherited:
            raise forked(f"pool_lock {self.names!r}")

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._conn is not None:  # else released inside the block
            self._end(exc)  # rolls back and never masks the body's exception when it raised

    def _end(self, exc: BaseException | None) -> None:
        source, conn, lock, kind = self._source, self._conn, self._lock, self._kind
        self._source = self._conn = self._lock = None
        marks, self._marks = self._marks, None
        try:
            if conn is not None and lock is not None and kind is not None and lock._outstanding():
                self._finish(source, conn, lock, kind, exc)
        finally:
            if marks is not None:  # the acquiring thread's marks, not a later hold's
                for mark in [m for m in marks[1] if marks[0].get(m) is marks[2]]:
                    del marks[0][mark]

    def _finish(
        self, source: Any, conn: Any, lock: PgLock, kind: str, exc: BaseException | None
    ) -> None:
        """End the body's transaction, release the lock, give the connection back clean."""
        body_ok = exc is None
        errors: list[BaseException] = []
        # Finish the body's transaction first, so its writes commit while the lock is held.
        try:
            _end_transaction(kind, conn, commit=body_ok)
        except BaseException as e:
            errors.append(e)
        try:
            lock.release()
            discard = not _clean(kind, conn, self.names)
        except BaseException as e:
            discard = True
            errors.append(e)
        if discard:
            raw = _raw(kind, conn)
            if raw is not None:  # handles on it learn why, instead of "the connection closed"
                _conn.forget(raw, lost=_DISCARD_LOST.format(names=self.names))
        try:
            _give_back(kind, source, conn, discard=discard)
        except BaseException as e:
            errors.append(e)
        if not errors:
            return
        first = errors[0] if body_ok else exc
        for err in errors:
            if err is not first:  # never mask the first failure (the body's, if it raised)
                logger.warning("finishing pool_lock %r after %r: %r", self.names, first, err)
        if body_ok:
            raise errors[0]


def _end_transaction(kind: str, conn: Any, *, commit: bool) -> None:
    target: Any
    if kind == "psycopg_pool":
        # Nothing to end on an idle connection (commit() would still take its lock and wait).
        idle = conn.closed or conn.broken or conn.pgconn.transaction_status == IDLE
        target = None if idle else conn
    elif conn.invalidated or conn.closed:
        target = None
    elif conn.in_transaction():
        target = conn
    else:
        # pglock's own statements ran on the driver connection behind SQLAlchemy's back;
        # make sure nothing of the body's is left open on it.
        raw = _conn._driver_connection(conn)
        target = raw if raw.info.transaction_status in (INTRANS, INERROR) else None
    if target is not None:
        if commit:
            target.commit()
        else:
            target.rollback()


def _raw(kind: str, conn: Any) -> psycopg.Connection[Any] | None:
    """The open psycopg connection under what pool_lock yielded, or None if it is gone."""
    if kind == "psycopg_pool":
        raw: psycopg.Connection[Any] = conn
    else:
        if conn.invalidated or conn.closed:
            return None
        raw = _conn._driver_connection(conn)
    return None if raw.closed or raw.broken else raw


def _clean(kind: str, conn: Any, names: list[str]) -> bool:
    """True when ``conn`` may go back to its pool: open, idle, nothing in pglock's bookkeeping.
    Leftovers are released first, with every advisory lock of the session (and a WARNING)."""
    raw = _raw(kind, conn)
    if raw is None:
        return False
    state = _conn.state_for(raw)
    with state.lock:
        leftover = bool(state.holds or state.deferred)
    if leftover:  # rare: the common case sends no SQL
        if raw.pgconn.transaction_status != IDLE:
            return False
        source = f"pool_lock {names!r} (before giving its connection back to the pool)"
        lost = _LEFTOVER_LOST.format(names=names)
        try:
            release_all(raw, source=source, end_own_transaction=True, lost=lost)
        except (psycopg.Error, LockError):
            logger.warning("pool_lock %r could not release the locks left on its connection",
                           names, exc_info=True)
            return False
        raw = _raw(kind, conn)
        if raw is None:
            return False
        state = _conn.state_for(raw)
    with state.lock:
        pending = bool(state.deferred)
    return raw.info.transaction_status == IDLE and not pending


def _give_back(kind: str, source: Any, conn: Any, *, discard: bool) -> None:
    """Return ``conn`` to its pool; with ``discard`` make sure the pool drops it instead."""
    if kind == "psycopg_pool":
        if discard and not conn.closed:
            logger.warning("discarding pooled connection %r: its locks could not be confirmed "
                           "released", conn)
            conn.close()  # the pool replaces a closed connection instead of reusing it
        source.putconn(conn)
        return
    if discard and not conn.invalidated:
        logger.warning("invalidating SQLAlchemy connection: its locks could not be confirmed "
                       "released")
        conn.invalidate()
    conn.close()


def pool_lock(
    pool_or_engine: object, names: str | Sequence[str], **options: Unpack[PoolLockOptions]
) -> PoolLock:
    """Check a connection out of a pool, hold a session lock on it, give it back clean.

    ``with`` yields the connection holding the lock (psycopg's, or SQLAlchemy's for an
    ``Engine``); at the exit the body's transaction is committed (rolled back if it raised),
    the lock released and the connection returned, or discarded when the release cannot be
    confirmed. The object follows the lock contract (docs/locks.md); step by step, timeouts
    and nesting: docs/pools.md.

    :param pool_or_engine: a ``psycopg_pool.ConnectionPool`` (or ``NullConnectionPool``), a
        SQLAlchemy ``Engine`` using the psycopg driver, or a Django connection configured with
        a pool (``DATABASES`` ``OPTIONS["pool"]``; its pool is used, docs/django.md).
    :param names: a lock name, or several taken together (sorted by key: no deadlock).
    :param options: keyword-only, the same for :meth:`Locker.lock` (``PoolLockOptions``):

        * ``shared`` (default False): take a shared (read) lock;
        * ``timeout`` (default None): the default of ``acquire()`` and ``with``; ``> 0``
          bounds the whole wait, checkout included (with ``None`` or ``0`` the checkout waits
          as the pool is configured to);
        * ``pooler`` (default ``"auto"``): what sits between the pool and Postgres, as for
          :func:`pglock.pg_lock` (``"auto"``, ``"session"``, ``"transaction"``, ``"none"``;
          docs/pgbouncer.md).
    :raises pglock.LockNotAcquired: not acquired within ``timeout`` (or, for a psycopg_pool
        pool and ``timeout > 0``, no connection within it).
    :raises pglock.UnsupportedServer: a hot standby, or a pooler session locks cannot work
        through (a pooler of unknown mode under ``pooler="auto"``, ``pooler="transaction"``,
        or sharing observed).
    :raises pglock.SelfDeadlock: no timeout, and this thread holds a name through this pool.
    :raises pglock.LockLost: at the exit, the lock was found gone (the connection discarded).
    :raises TypeError: not a supported pool, engine or driver; bad names, timeout or pooler.
    :raises ValueError: an invalid name, timeout or ``pooler`` value.

    Example::

        with pglock.pool_lock(pool, "report:daily", timeout=5) as conn:
            conn.execute("INSERT INTO reports (day) VALUES (current_date)")
    """
    return PoolLock(pool_or_engine, names, **options)


__all__ = ["PoolLock", "PoolLockOptions", "pool_lock", "reset_connection"]
