"""Pool-aware locking: ``pool_lock``, the pool reset hook, and ``Locker``.

A session advisory lock lives on a Postgres session, and a pooled connection outlives the code
that borrowed it. Three pieces keep a lock from ever going back to a pool with its connection:

* :func:`pool_lock` checks a connection out, locks, yields it and releases before giving it
  back. When the release cannot be confirmed it closes the connection instead (psycopg_pool)
  or invalidates it (SQLAlchemy): Postgres drops the locks of a closed session. Locks that
  pglock's bookkeeping still shows on the connection (left open in the body) are released
  first; a nested block of a name the thread holds through the same pool is refused
  (:class:`pglock.SelfDeadlock`) instead of waiting for itself.
* :func:`reset_connection` is the safety net for everything else (raw SQL, a ``pg_lock`` left
  open, a bug): as a psycopg_pool ``reset=`` callback, or through
  :func:`pglock.sqlalchemy.release_on_checkin`, it drops every advisory lock still held when
  the connection comes back, and says which at WARNING.
* :class:`Locker` is the one configured entry point for an application.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import psycopg

from . import _conn, _sql
from ._advisory import PgLock
from ._classify import SOURCES, Kind, check_driver, classify
from ._conn import IDLE, INERROR, INTRANS
from ._contract import validate_schema
from ._keys import DEFAULT as _DEFAULT
from ._keys import normalize_names, validate_flag, validate_name, validate_timeout
from .errors import LockError, LockNotAcquired, SelfDeadlock, UnsupportedServer

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool
    from typing_extensions import Self

    from ._leader import LeaderElection
    from ._rwlock import RWLock
    from ._semaphore import Semaphore
    from ._singleton import Singleton

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

# What each thread holds through pool_lock (and Locker.lock, a pooled rwlock, a Locker's
# singleton, locked_session), per pool: a set of (id of the pool, key). A nested request of
# the same thread for one of these keys would check out *another* connection, another
# session, which waits for this thread's own lock: for ever, since Postgres sees no deadlock
# between two sessions (the cycle goes through the client). Such a request is refused at once.
_pooled = threading.local()


def _thread_marks() -> set[tuple[int, int]]:
    marks: set[tuple[int, int]] | None = getattr(_pooled, "marks", None)
    if marks is None:
        marks = _pooled.marks = set()
    return marks


def _pool_id(kind: str, source: Any) -> int:
    """The identity of the pool connections come from: an Engine's pool (engines made by
    ``execution_options()`` share their parent's), or the psycopg_pool pool itself."""
    return id(source.pool) if kind == "sqlalchemy" else id(source)


# --- the reset hook ------------------------------------------------------------------------


def reset_connection(conn: psycopg.Connection[Any]) -> None:
    """Release every advisory lock a pooled connection still holds: a psycopg_pool reset hook.

    Pass it as ``ConnectionPool(..., reset=pglock.reset_connection)``. When a connection comes
    back to the pool, it runs one statement that lists the session's advisory locks in
    ``pg_locks`` and calls ``pg_advisory_unlock_all()``, and logs a WARNING on the
    ``pglock.pool`` logger naming the keys that were still held (a lock taken by raw SQL, or a
    ``pg_lock`` block that was never left). Releases pglock had to postpone (a failed
    transaction at the end of a ``pg_lock`` block) are done by the same statement and are not
    reported as leaks. pglock forgets its bookkeeping for the connection; a ``pg_lock`` handle
    that still believed it held a lock raises :class:`pglock.LockLost` when released.

    The connection is left idle. If the statement fails the exception propagates and
    psycopg_pool discards the connection, so a lock is never handed to the next borrower.

    Cost: one round trip per checkin (see docs/pools.md for the measured figure); psycopg_pool
    runs reset hooks in its worker thread, not in the caller's.

    :raises TypeError: ``conn`` is not a psycopg ``Connection``.

    Example::

        pool = psycopg_pool.ConnectionPool(dsn, reset=pglock.reset_connection, open=False)
    """
    classify(conn, (Kind.CONNECTION,), api="reset_connection")
    if conn.closed or conn.broken:
        _conn.forget(conn, lost=_RESET_LOST)
        return
    status = conn.info.transaction_status
    if status == INERROR:
        conn.rollback()
        status = IDLE
    release_all(conn, source="pool reset", end_own_transaction=status == IDLE)


def release_all(
    conn: psycopg.Connection[Any],
    *,
    source: str,
    end_own_transaction: bool,
    lost: str = _RESET_LOST,
) -> list[str]:
    """Drop every advisory lock held by ``conn``'s session and pglock's bookkeeping for it.

    Returns the leaked locks' descriptions (``"key"`` or ``"key shared"``). Shared by the
    psycopg_pool hook, the SQLAlchemy reset listener and :class:`PoolLock`'s exit; handles
    that still believed they held a lock raise :class:`pglock.LockLost` with ``lost``."""
    state = _conn.forget(conn, lost=lost)
    if end_own_transaction and not conn.autocommit:
        # One round trip instead of two (statement + COMMIT): flipping autocommit on an idle
        # connection is client-side only.
        conn.autocommit = True
        try:
            row = _conn.run_one(conn, _sql.UNLOCK_ALL_REPORTING, ())
        finally:
            if not conn.closed:
                conn.autocommit = False
    else:
        row = _conn.run_one(conn, _sql.UNLOCK_ALL_REPORTING, ())
    held: list[str] = list(row[0] or []) if row else []
    if not held:
        return []
    deferred = set()
    believed: list[int] = []
    if state is not None:
        with state.cond:
            deferred = {_describe(k, s) for k, s in state.deferred}
            believed = sorted(k for k, h in state.holds.items() if h.owners)
    leaked = [h for h in held if h not in deferred]
    if len(leaked) < len(held):
        logger.info(
            "%s released %d deferred advisory lock(s)", source, len(held) - len(leaked)
        )
    if leaked:
        logger.warning(
            "%s: the connection came back holding %d advisory lock(s), now released: keys %s%s",
            source,
            len(leaked),
            ", ".join(leaked),
            f" (pglock handles still believed they held keys {believed}: they will raise "
            "LockLost)"
            if believed
            else " (taken outside pglock, e.g. by raw SQL)",
        )
    return leaked


def _describe(key: int, shared: bool) -> str:
    return f"{key} shared" if shared else str(key)


# --- pool_lock -------------------------------------------------------------------------------


#: What to use instead, when pool_lock (or a Locker) gets something it cannot check out of.
_USE_PG_LOCK = dict.fromkeys(
    (Kind.CONNECTION, Kind.SA_CONNECTION, Kind.SESSION),
    "pool_lock checks a connection out of a pool; for a connection you already hold use "
    "pglock.pg_lock(connection, ...)",
)
_USE_PG_LOCK[Kind.DSN] = "use pglock.Locker(dsn), which keeps a pool for a DSN"


def _classify(source: object, api: str = "pool_lock") -> str:
    """``"psycopg_pool"`` or ``"sqlalchemy"``; TypeError for anything else (no I/O)."""
    kind = classify(source, (Kind.POOL, Kind.ENGINE), api=api, hints=_USE_PG_LOCK)
    if kind is Kind.POOL:
        return "psycopg_pool"
    check_driver(cast(Any, source).dialect)
    return "sqlalchemy"


class PoolLock:
    """A session advisory lock on a connection checked out of a pool, as a context manager.

    Returned by :func:`pool_lock` and :meth:`Locker.lock`. ``with`` checks a connection out,
    takes the lock, and yields the connection; the exit finishes the body's transaction
    (commit on success, rollback if the body raised), releases the lock, and returns the
    connection. If the release cannot be confirmed the connection is discarded instead, so
    Postgres drops whatever it held; locks left on it by other handles are released first.
    A nested block of a name this thread already holds through the same pool raises
    :class:`pglock.SelfDeadlock`.

    Thread safety: one ``with`` block at a time, in one thread. Create one per use (they are
    cheap: no I/O before ``__enter__``).
    """

    def __init__(
        self,
        source: object,
        names: str | Sequence[str],
        *,
        shared: bool = False,
        timeout: float | None = None,
    ) -> None:
        self._pairs = normalize_names(names)
        self._shared = validate_flag(shared, "shared")
        self._timeout = validate_timeout(timeout)
        self._kind: str | None = _classify(source)
        self._get_source: Callable[[], object] = lambda: source
        self._source: Any = None
        self._conn: Any = None  # what the body gets
        self._lock: PgLock | None = None
        # This thread's record of pooled holds, and the marks this block added to it.
        self._marks: tuple[set[tuple[int, int]], list[tuple[int, int]]] | None = None

    @classmethod
    def _deferred(
        cls,
        get_source: Callable[[], object],
        names: str | Sequence[str],
        *,
        shared: bool,
        timeout: float | None,
    ) -> PoolLock:
        """A PoolLock whose source is looked up at ``__enter__`` (a Locker's own pool is
        created at the first use, not when a lock object is made)."""
        self = cls.__new__(cls)
        self._pairs = normalize_names(names)
        self._shared = validate_flag(shared, "shared")
        self._timeout = validate_timeout(timeout)
        self._kind = None
        self._get_source = get_source
        self._source = self._conn = self._lock = None
        self._marks = None
        return self

    @property
    def names(self) -> list[str]:
        """The names of this lock, sorted by key."""
        return [n for _, n in self._pairs]

    @property
    def locked(self) -> bool:
        """True inside the ``with`` block while pglock believes the lock is held."""
        return self._lock is not None and self._lock.locked

    def __repr__(self) -> str:
        mode = "shared" if self._shared else "exclusive"
        state = "locked" if self.locked else "unlocked"
        return f"<pglock.PoolLock {self.names!r} {mode} {state}>"

    def _not_acquired(self, message: str | None = None) -> LockNotAcquired:
        names = self.names
        return LockNotAcquired(
            names[0] if len(names) == 1 else ", ".join(names),
            key=self._pairs[0][0] if len(self._pairs) == 1 else None,
            timeout=self._timeout,
            message=message,
        )

    def __enter__(self) -> Any:
        if self._conn is not None:
            raise RuntimeError("this pool_lock is already in use; create one per with-block")
        source: Any = self._get_source()
        kind = self._kind or _classify(source)
        marks = _thread_marks()
        pool_id = _pool_id(kind, source)
        for k, n in self._pairs:
            if (pool_id, k) in marks:
                # Before any checkout: with a pool of one connection the checkout itself
                # would wait for the outer block's connection.
                raise SelfDeadlock(n, key=k)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        # An Engine waits for a connection up to its own pool_timeout.
        conn = self._checkout_psycopg(source) if kind == "psycopg_pool" else source.connect()
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            lock = PgLock(conn, [n for _, n in self._pairs], shared=self._shared)
            ok = lock.acquire(timeout=remaining)
        except BaseException as exc:
            # A lock attempt that failed on its own terms left nothing held; anything else
            # (a broken connection, an interrupt mid-statement) may have: discard.
            _give_back(kind, source, conn, discard=not isinstance(exc, UnsupportedServer))
            raise
        if not ok:
            _give_back(kind, source, conn, discard=False)
            raise self._not_acquired()
        self._source, self._conn, self._lock = source, conn, lock
        self._kind = kind
        mine = [(pool_id, k) for k, _ in self._pairs]
        marks.update(mine)
        self._marks = (marks, mine)
        return conn

    def _checkout_psycopg(self, pool: Any) -> Any:
        from psycopg_pool import PoolTimeout

        if not self._timeout:  # None or 0: the checkout waits as the pool is configured to
            return pool.getconn()
        try:
            return pool.getconn(timeout=self._timeout)
        except PoolTimeout as exc:
            raise self._not_acquired(
                f"could not get a connection from the pool within {self._timeout:.2f} s "
                f"to lock {', '.join(self.names)!r}"
            ) from exc

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        source, conn, lock, kind = self._source, self._conn, self._lock, self._kind
        self._source = self._conn = self._lock = None
        marks, self._marks = self._marks, None
        try:
            if conn is not None and lock is not None and kind is not None:
                self._finish(source, conn, lock, kind, exc)
        finally:
            if marks is not None:  # the set of the thread that entered, whichever exits
                marks[0].difference_update(marks[1])

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
        discard = False
        try:
            lock.release()
        except BaseException as e:
            discard = True
            errors.append(e)
        else:
            try:
                discard = not _release_leftovers(kind, conn, self.names) or not _idle(kind, conn)
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
    if kind == "psycopg_pool":
        raw: psycopg.Connection[Any] = conn
        if raw.closed or raw.broken:
            return
        if commit:
            raw.commit()
        else:
            raw.rollback()
        return
    if conn.invalidated or conn.closed:
        return
    if conn.in_transaction():
        if commit:
            conn.commit()
        else:
            conn.rollback()
    else:
        # pglock's own statements ran on the driver connection behind SQLAlchemy's back;
        # make sure nothing of the body's is left open on it.
        raw = _conn._driver_connection(conn)
        if raw.info.transaction_status in (INTRANS, INERROR):
            if commit:
                raw.commit()
            else:
                raw.rollback()


def _raw(kind: str, conn: Any) -> psycopg.Connection[Any] | None:
    """The open psycopg connection under what pool_lock yielded, or None if it is gone."""
    if kind == "psycopg_pool":
        raw: psycopg.Connection[Any] = conn
    else:
        if conn.invalidated or conn.closed:
            return None
        raw = _conn._driver_connection(conn)
    return None if raw.closed or raw.broken else raw


def _release_leftovers(kind: str, conn: Any, names: list[str]) -> bool:
    """Make sure pglock's bookkeeping shows nothing held on a connection about to go back to
    its pool.

    The block's own lock is released by then; anything else recorded (a ``pg_lock`` taken on
    the connection in the block and never released, a release deferred by a failed
    transaction) is dropped by one statement that releases every advisory lock of the
    session, with a WARNING, and the handles that still believed they held a lock are marked
    lost. Returns False when that could not be done: the caller discards the connection."""
    raw = _raw(kind, conn)
    if raw is None:
        return False
    state = _conn.state_for(raw)
    with state.cond:
        leftover = bool(state.holds or state.deferred)
    if not leftover:
        return True  # the common case: no SQL
    if raw.info.transaction_status != IDLE:
        return False
    try:
        release_all(
            raw,
            source=f"pool_lock {names!r} (before giving its connection back to the pool)",
            end_own_transaction=True,
            lost=_LEFTOVER_LOST.format(names=names),
        )
    except (psycopg.Error, LockError):
        logger.warning(
            "pool_lock %r could not release the locks left on its connection", names,
            exc_info=True,
        )
        return False
    return True


def _idle(kind: str, conn: Any) -> bool:
    raw = _raw(kind, conn)
    if raw is None:
        return False
    state = _conn.state_for(raw)
    with state.cond:
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
    pool_or_engine: object,
    names: str | Sequence[str],
    *,
    shared: bool = False,
    timeout: float | None = None,
) -> PoolLock:
    """Check a connection out of a pool, hold a session lock on it, give it back clean.

    ``with pglock.pool_lock(pool, "report:daily", timeout=5) as conn:`` checks a connection out
    of ``pool``, takes the session advisory lock with :func:`pglock.pg_lock`, and runs the body
    with the connection: the psycopg ``Connection`` for a psycopg_pool pool, the SQLAlchemy
    ``Connection`` for an ``Engine``. At the exit the body's open transaction is committed
    (rolled back if the body raised), as ``pool.connection()`` and ``engine.begin()`` do, then
    the lock is released and the connection returned. When the release cannot be confirmed
    (the connection broke, the session no longer held the lock) the connection is closed
    (psycopg_pool) or invalidated (SQLAlchemy) instead: it never goes back to the pool holding
    a lock. A lock that pglock's bookkeeping still shows on the connection after the release
    (a ``pg_lock`` taken on it in the body and never released) is released with every
    advisory lock of the session, with a WARNING, and its handle raises
    :class:`pglock.LockLost`. A release problem after the body raised is logged, never masks
    the body's error.

    Nesting: inside the block, take further locks on the yielded connection. A nested
    ``pool_lock`` (or ``Locker.lock``, a pooled ``rwlock``) of a name this thread already
    holds through the same pool would wait for itself on another pooled connection: it raises
    :class:`pglock.SelfDeadlock` at once, before any checkout or SQL, whatever its timeout
    and mode. Other threads wait for each other as usual.

    :param pool_or_engine: a ``psycopg_pool.ConnectionPool`` (or ``NullConnectionPool``) or a
        SQLAlchemy ``Engine`` using the psycopg driver.
    :param names: a lock name, or several taken together (sorted by key: no deadlock).
    :param shared: take a shared (read) lock.
    :param timeout: ``None`` waits until acquired; ``0`` tries the lock once; ``> 0`` bounds the
        whole wait, checkout included: for a psycopg_pool pool, ``getconn`` gets that budget and
        the lock what is left of it; an Engine waits for a connection up to its own
        ``pool_timeout`` and the time spent counts against ``timeout``. With ``None`` or ``0``
        the checkout waits as the pool is configured to (``PoolTimeout`` /
        ``sqlalchemy.exc.TimeoutError`` as usual).
    :raises pglock.LockNotAcquired: not acquired within ``timeout`` (or, for a psycopg_pool
        pool and ``timeout > 0``, no connection within it).
    :raises pglock.UnsupportedServer: a hot standby, or a transaction-mode pooler in between.
    :raises pglock.SelfDeadlock: this thread already holds one of the names through this
        pool (at ``with``).
    :raises pglock.LockLost: at the exit, when the lock was found gone (the connection was
        discarded).
    :raises TypeError: not a supported pool, engine or driver; bad names or timeout.

    Example::

        with pglock.pool_lock(pool, "report:daily", timeout=5) as conn:
            conn.execute("INSERT INTO reports (day) VALUES (current_date)")
    """
    return PoolLock(pool_or_engine, names, shared=shared, timeout=timeout)


# --- Locker ----------------------------------------------------------------------------------


def _validate_namespace(namespace: object) -> str | None:
    if namespace is None:
        return None
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, not {type(namespace).__name__}")
    validate_name(namespace)
    if ":" in namespace:
        raise ValueError(
            f"namespace must not contain ':' (got {namespace!r}): the full lock name is "
            "'<namespace>:<name>', and a ':' in the namespace would let two namespaces "
            "share names; use another separator such as '.' or '/'"
        )
    return namespace


class Locker:
    """The one configured entry point for an application's locks.

    ``Locker(source, namespace="billing")`` holds a connection source and settings; each call
    makes a lock: :meth:`lock` (a session advisory lock on a pooled connection, like
    :func:`pool_lock`) and :meth:`lease` (a TTL lease with a fencing token, like
    :func:`pglock.lease`).

    :param source: a ``psycopg_pool.ConnectionPool``, a SQLAlchemy ``Engine`` (psycopg driver),
        or a DSN string. For a DSN the Locker creates its own ``ConnectionPool`` at the first
        use, with ``reset=pglock.reset_connection``, and closes it in :meth:`close`. A pool or
        engine you pass stays yours: the Locker never closes it.
    :param namespace: folded into every name: ``locker.lock("x")`` locks ``"<namespace>:x"``,
        the same lock as ``pg_lock(conn, "<namespace>:x")``. A namespace follows the rules for
        names and must not contain ``':'``, so two namespaces never share a name.
    :param schema: the schema of the lease table and functions (leases only).
    :param timeout: the default ``timeout`` of :meth:`lock` and :meth:`lease` (``None``: wait).
    :param pool_kwargs: extra keyword arguments for the ``ConnectionPool`` a DSN Locker creates
        (defaults: ``min_size=1``, ``max_size=10``); refused for a pool or engine source.

    No I/O happens in the constructor. Thread safety: a Locker can be shared between threads
    (its own pool is created once, under a lock); the objects its methods return are each for
    one thread.

    Example::

        locker = pglock.Locker(pool, namespace="billing")
        with locker.lock("invoice:42", timeout=5) as conn:
            conn.execute("UPDATE invoices SET sent = true WHERE id = 42")
    """

    def __init__(
        self,
        source: object,
        *,
        namespace: str | None = None,
        schema: str = "pglock",
        timeout: float | None = None,
        pool_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._namespace = _validate_namespace(namespace)
        self._schema = validate_schema(schema)
        self._timeout = validate_timeout(timeout)
        self._dsn: str | None = None
        self._external: object = None
        if classify(source, SOURCES, api="Locker", hints=_USE_PG_LOCK) is Kind.DSN:
            if not cast(str, source).strip():
                raise ValueError("the DSN must not be empty")
            self._dsn = cast(str, source)
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
        self._pool_kwargs = dict(pool_kwargs or {})
        for forbidden in ("open", "conninfo"):
            if forbidden in self._pool_kwargs:
                raise TypeError(f"pool_kwargs must not set {forbidden!r}")
        self._mutex = threading.Lock()
        self._own_pool: ConnectionPool[Any] | None = None
        self._closed = False

    # -- configuration ---------------------------------------------------------------------

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
        """The name as locked in Postgres: ``"<namespace>:<name>"``, or ``name`` without one.

        Use it to reach the same lock through :func:`pglock.pg_lock` or
        :func:`pglock.xact_lock` on a connection you hold.

        :raises TypeError, ValueError: an invalid name (or too long with the namespace).
        """
        validate_name(name)
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

    # -- the connection source -------------------------------------------------------------

    def _connection_source(self) -> object:
        """The pool or engine to check connections out of (a DSN Locker's own pool is
        created here, at the first use)."""
        with self._mutex:
            if self._closed:
                raise RuntimeError("this Locker is closed")
            if self._external is not None:
                return self._external
            if self._own_pool is None:
                from psycopg_pool import ConnectionPool

                from ._deadline import connect_extra

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
        """Close the pool this Locker created from a DSN (never a pool or engine you passed).

        Idempotent. Locks still held on its connections are released by Postgres when the
        connections close."""
        with self._mutex:
            self._closed = True
            pool, self._own_pool = self._own_pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    # -- locks -----------------------------------------------------------------------------

    def lock(
        self,
        names: str | Sequence[str],
        *,
        shared: bool = False,
        timeout: float | None = _DEFAULT,
    ) -> PoolLock:
        """A session advisory lock on a pooled connection: :func:`pool_lock` with the
        namespace folded into the names.

        ``with locker.lock("invoice:42", timeout=5) as conn:`` yields the connection holding the
        lock (psycopg ``Connection``, or SQLAlchemy ``Connection`` for an Engine).

        :param timeout: omitted: the Locker's default; see :func:`pool_lock`.
        :raises pglock.LockNotAcquired: not acquired in time (at ``with``).
        :raises pglock.SelfDeadlock: this thread already holds one of the names through this
            Locker's pool (at ``with``): use the connection the outer block yielded.
        :raises RuntimeError: the Locker is closed (at ``with``).
        """
        t = self._timeout if timeout is _DEFAULT else validate_timeout(timeout)
        return PoolLock._deferred(
            self._connection_source, self._full_names(names), shared=shared, timeout=t
        )

    def lease(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = _DEFAULT,
        metadata: Mapping[str, Any] | None = None,
        keepalive: bool = True,
        holder: str | None = None,
        on_lost: Callable[..., Any] | None = None,
        resume: bool = False,
    ) -> Any:
        """A TTL lease with a fencing token: :func:`pglock.lease` on this Locker's source,
        schema and namespace. Needs the pglock schema installed.

        :param timeout: omitted: the Locker's default. The other parameters are those of
            :func:`pglock.lease`.

        Example::

            with locker.lease("nightly-export", ttl=60) as lease:
                export(fencing_token=lease.token)
        """
        t = self._timeout if timeout is _DEFAULT else validate_timeout(timeout)
        full = self.full_name(name)
        # Imported here so that this module does not depend on the lease module at import.
        lease_fn = importlib.import_module("pglock._lease").lease
        return lease_fn(
            self._connection_source(),
            full,
            ttl=ttl,
            timeout=t,
            metadata=metadata,
            keepalive=keepalive,
            holder=holder,
            on_lost=on_lost,
            resume=resume,
            schema=self._schema,
        )

    # -- coordination (issue 5): rwlock, singleton, leader, semaphore ----------------------

    def rwlock(self, name: str) -> RWLock:
        """A read-write lock on the namespaced ``name`` over this Locker's pool: see
        :func:`pglock.rwlock`. ``read()``/``write()`` default to the Locker's timeout.

        Example::

            with locker.rwlock("config").read() as conn:
                conn.execute("SELECT * FROM settings")
        """
        from ._rwlock import RWLock

        return RWLock._for_locker(self._connection_source, self.full_name(name), self._timeout)

    def singleton(self, name: str, *, timeout: float | None = 0) -> Singleton:
        """A decorator running a job only where no other process runs it: see
        :func:`pglock.singleton` (``timeout=0`` skips at once; the Locker's default timeout
        does not apply).

        Example::

            @locker.singleton("cron:daily-cleanup")
            def daily_cleanup() -> None: ...
        """
        from ._rwlock import RWLock
        from ._singleton import Singleton

        lock = RWLock._for_locker(self._connection_source, self.full_name(name), None)
        return Singleton(lock, validate_timeout(timeout))

    def leader(
        self,
        name: str,
        *,
        on_elected: Callable[[], object] | None = None,
        on_lost: Callable[[], object] | None = None,
        check_interval: float = 1.0,
        takeover_delay: float | None = None,
        network_timeout: float = 5.0,
    ) -> LeaderElection:
        """A candidate in the leader election for the namespaced ``name``: see
        :func:`pglock.leader`. It opens its own connection with this Locker's connection
        parameters (the DSN, or those of the pool or engine).

        Example::

            with locker.leader("scheduler", on_elected=start, on_lost=stop) as election:
                election.wait_elected()
        """
        from ._leader import LeaderElection

        return LeaderElection(
            self._dsn if self._dsn is not None else self._external,
            self.full_name(name),
            on_elected=on_elected,
            on_lost=on_lost,
            check_interval=check_interval,
            takeover_delay=takeover_delay,
            network_timeout=network_timeout,
        )

    def semaphore(
        self, name: str, *, limit: int, ttl: float = 30.0, metadata: Any = None
    ) -> Semaphore:
        """A semaphore on the namespaced ``name`` over this Locker's source and schema: see
        :func:`pglock.semaphore`. Needs the pglock schema installed.

        Example::

            with locker.semaphore("exports", limit=3):
                run_export()
        """
        from ._semaphore import Semaphore

        return Semaphore._for_locker(
            self._connection_source, self.full_name(name), limit, ttl, self._schema, metadata
        )


__all__ = ["Locker", "PoolLock", "pool_lock", "reset_connection"]
