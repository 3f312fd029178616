"""Leader election (:class:`LeaderElection`) on a session advisory lock held on a connection
pglock opens for each candidate. The validity window, terms and bounds: docs/leader.md."""

from __future__ import annotations

import collections
import logging
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict, cast

import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg.pq import TransactionStatus

from . import _advisory, _conn, _sql, _tracked, _xact
from ._base import forked, release_after
from ._classify import Kind, check_driver, classify
from ._deadline import within
from ._keys import _key, exact, key, validate_name, validate_timeout
from ._keys import deadline as _deadline
from ._keys import remaining as _remaining
from .errors import LockError, LockLost, LockNotAcquired, UnsupportedServer

if TYPE_CHECKING:
    from typing_extensions import Self

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

logger = logging.getLogger("pglock.leader")

#: Prefix of the derived name whose key fences a leader's guarded writes. Lock names cannot
#: contain NUL, so no user lock can ever share this key.
_FENCE_PREFIX = "pglock.leader-fence\x00"

#: Keyword arguments of ``psycopg.Connection.connect`` that are not libpq parameters.
_CONNECT_ONLY = frozenset(
    {"autocommit", "prepare_threshold", "context", "row_factory", "cursor_factory"}
)

_MAX_INTERVAL = 3600.0


#: Where a leader's dedicated connection can take its parameters from (it never uses the
#: object itself: a leader holds its lock on a connection of its own).
_DEDICATED = frozenset({Kind.DSN, Kind.POOL, Kind.ENGINE, Kind.CONNECTION})


def check_dedicated_source(source: object) -> Kind:
    """Refuse, before any I/O, a source that :func:`dedicated_conninfo` cannot use: TypeError
    (not a DSN, pool, engine on psycopg, or psycopg connection), ValueError (a bad DSN)."""
    kind = classify(source, _DEDICATED, api="leader election (to copy connection parameters)")
    if kind is Kind.DSN:
        try:
            pg_conninfo.conninfo_to_dict(cast(str, source))
        except psycopg.ProgrammingError as exc:
            raise ValueError(f"invalid connection string: {exc}") from None
    elif kind is Kind.ENGINE:
        check_driver(cast(Any, source).dialect)
    return kind


def dedicated_conninfo(source: object, **extra: Any) -> str:
    """A libpq connection string for a connection pglock opens and owns, built from ``source``
    (a DSN, a pool's ``conninfo`` and ``kwargs``, or the parameters of a connection, an
    Engine's lent for the purpose), with ``extra`` overriding them."""
    kind = check_dedicated_source(source)
    if kind is Kind.DSN:
        return pg_conninfo.make_conninfo(cast(str, source), **extra)
    if kind is Kind.CONNECTION:
        return _from_connection(cast(psycopg.Connection[Any], source), extra)
    if kind is Kind.POOL:
        pool: Any = source
        kwargs = {k: v for k, v in (pool.kwargs or {}).items() if k not in _CONNECT_ONLY}
        kwargs.update(extra)
        return pg_conninfo.make_conninfo(pool.conninfo, **kwargs)
    with cast(Any, source).connect() as sa_conn:
        return _from_connection(_conn._driver_connection(sa_conn), extra)


def _from_connection(conn: psycopg.Connection[Any], extra: dict[str, Any]) -> str:
    params: dict[str, Any] = dict(conn.info.get_parameters())
    if conn.info.password:
        params["password"] = conn.info.password
    params.update(extra)
    return pg_conninfo.make_conninfo("", **params)


def _seconds(value: object, what: str, *, minimum: float, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    v = float(value := exact(value))
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{what} must be a finite number of seconds, got {value!r}")
    if allow_zero and v == 0:
        return v
    if v < minimum or v > _MAX_INTERVAL:
        raise ValueError(
            f"{what} must be between {minimum:g} and {_MAX_INTERVAL:g} seconds"
            f"{' (or 0)' if allow_zero else ''}, got {value!r}"
        )
    return v


def _callback(value: object, what: str) -> Callable[[], object] | None:
    if value is not None and not callable(value):
        raise TypeError(f"{what} must be a callable taking no arguments, or None")
    return value


def validity_window(check_interval: float) -> float:
    return check_interval + min(1.0, max(0.25, check_interval / 2))


class LeaderElection(_tracked.Tracked):
    """One candidate in the election for ``name``; the elected one is the leader.

    Use it as a context manager (campaigns on entry, resigns on exit) or call :meth:`start`
    and :meth:`resign`. A background thread keeps a dedicated connection, waits for the lock,
    and, once leader, checks the session at least every ``check_interval`` seconds.

    Act as leader only while ``is_leader`` is True; ``term`` is a fencing token; ``on_elected``
    and ``on_lost`` run in order on pglock's thread; :meth:`guard` fences your writes. What
    each means, and how soon a new leader acts: docs/leader.md.

    Thread safety: one object may be shared by threads; ``is_leader``, ``term``,
    :meth:`wait_elected` and :meth:`guard` are safe to call from any thread.
    """

    def __init__(
        self, source: object, name: str, *, on_elected: Callable[[], object] | None = None,
        on_lost: Callable[[], object] | None = None, check_interval: float = 1.0,
        takeover_delay: float | None = None, network_timeout: float = 5.0, pooler: str = "auto",
    ) -> None:
        self._name = validate_name(name)
        self._key = key(self._name)
        self._fence_key = _key(_FENCE_PREFIX + self._name)
        check_dedicated_source(source := exact(source))
        self._source = source
        self._on_elected = _callback(on_elected, "on_elected")
        self._on_lost = _callback(on_lost, "on_lost")
        self._interval = _seconds(check_interval, "check_interval", minimum=0.05)
        self._window = validity_window(self._interval)
        self._delay = self._window
        if takeover_delay is not None:
            self._delay = _seconds(takeover_delay, "takeover_delay", minimum=0.0, allow_zero=True)
        self._network_timeout = _seconds(network_timeout, "network_timeout", minimum=1.0)
        self._pooler = _conn.validate_pooler(pooler)

        self._cond = threading.Condition(threading.Lock())
        self._leader = False
        self._valid_until = 0.0
        self._term: int | None = None
        self._session: tuple[int, Any] | None = None  # (pid, backend_start) while leader
        self._events: collections.deque[tuple[str, int | None]] = collections.deque()
        self._running = False
        self._pid = os.getpid()  # of start(): in a forked child, the parent's campaign
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dispatcher: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._conn_guard = threading.Lock()
        self._pid_start: tuple[int, Any] | None = None
        self._in_callback = False
        #: When the check now in flight was sent (monotonic), for the watchdog.
        self._inflight_since: float | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def check_interval(self) -> float:
        return self._interval

    @property
    def takeover_delay(self) -> float:
        return self._delay

    @property
    def is_leader(self) -> bool:
        """True while this candidate is the leader and a check confirmed it recently."""
        with self._cond:
            return self._leader and time.monotonic() < self._valid_until and not self._forked()

    def _forked(self, *, refuse: bool = False) -> bool:
        if refuse and self._running and self._pid != os.getpid():
            raise forked(f"leader election {self._name!r}")
        return self._pid != os.getpid()

    @property
    def term(self) -> int | None:
        """The term of the current (or last: ``on_lost`` reads it) leadership; None before one."""
        with self._cond:
            return self._term

    def __repr__(self) -> str:
        state = "leader" if self.is_leader else ("candidate" if self._running else "idle")
        return f"<pglock.LeaderElection {self._name!r} {state} term={self._term}>"

    def start(self) -> Self:
        """Start campaigning in the background (no-op when already campaigning)."""
        self._forked(refuse=True)
        with self._cond:
            if self._running:
                return self
            self._running, self._pid = True, os.getpid()
            self._stop.clear()
            self._events.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"pglock-leader:{self._name}", daemon=True
            )
            self._dispatcher = threading.Thread(
                target=self._dispatch, name=f"pglock-leader-events:{self._name}", daemon=True
            )
        self._dispatcher.start()
        self._thread.start()
        logger.debug("campaigning for %r", self._name)
        return self

    def resign(self) -> None:
        """Stop campaigning; if leader, step down: ``is_leader`` turns False, ``on_lost`` runs,
        and only then is the lock released. Returns when that is done (at once from a
        callback, which cannot wait for itself); :meth:`start` may campaign again. In a forked
        child, of the parent's campaign: RuntimeError, and nothing is sent."""
        self._forked(refuse=True)
        with self._cond:
            if not self._running:
                return
            thread, dispatcher = self._thread, self._dispatcher
        self._stop.set()
        self._cancel_inflight()
        with self._cond:
            self._cond.notify_all()
        me = threading.current_thread()
        if me is thread or me is dispatcher:
            return  # from a callback: the threads finish once it returns
        join_for = self._network_timeout + self._interval + 10.0
        for t in (thread, dispatcher):
            if t is not None:
                t.join(join_for)
                if t.is_alive():
                    logger.warning("%s did not stop in time", t.name)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if not self._forked():  # nothing of the parent's campaign to resign in a forked child
            release_after(self.resign, exc, self)

    def wait_elected(self, timeout: float | None = None) -> bool:
        """Block until this candidate is the leader; False on timeout or after resign.

        :raises RuntimeError: the election was not started.
        """
        deadline = _deadline(validate_timeout(timeout))
        self._forked(refuse=True)
        with self._cond:
            if not self._running:
                raise RuntimeError("the election is not running: call start() or use 'with'")
            while True:
                if self._leader and time.monotonic() < self._valid_until:
                    return True
                if not self._running or self._stop.is_set():
                    return False
                left = _remaining(deadline)
                if left == 0:
                    return False
                self._cond.wait(left)

    def guard(self, conn: object) -> int:
        """Check, inside the caller's open transaction on ``conn``, that this candidate still
        leads; return the term. A new leader waits for that transaction to end before its
        first ``is_leader``, so its writes never interleave with the next leader's.

        :param conn: a psycopg Connection (in a transaction, or not in autocommit), or a
            SQLAlchemy Connection / Session, on the same database.
        :raises pglock.LockLost: this candidate is not (or no longer) the leader.
        :raises pglock.InvalidConnectionState: no open transaction, or a failed one.

        Example::

            with conn.transaction():
                election.guard(conn)
                conn.execute("UPDATE jobs SET ...")
        """
        self._forked(refuse=True)
        target = _conn.resolve(conn, "LeaderElection.guard")
        with self._cond:
            leading = self._leader and time.monotonic() < self._valid_until
            session, term = self._session, self._term
        if not leading or session is None or term is None:
            raise LockLost(self._name, reason="this candidate is not the leader")
        label = f"{self._name} (leader fence)"
        if not _xact.xact_acquire(
            target, [self._fence_key], [label], shared=True, timeout=None,
            api="LeaderElection.guard",
        ):  # pragma: no cover - timeout=None waits
            raise LockNotAcquired(label)
        if not _conn.run(target.conn, _sql.leader_holds(self._key, *session))[0][0]:
            raise LockLost(
                self._name, reason=f"the leader's session no longer holds the lock (term {term})"
            )
        with self._cond:
            if self._term != term or not self._leader:
                raise LockLost(self._name, reason=f"leadership of term {term} ended")
        return term

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    if self._conn is None:
                        self._open()
                    self._campaign_and_lead()
                    failures = 0
                except _Stopped:
                    break
                except _TermOver:
                    self._close()
                except (psycopg.Error, LockError, OSError) as exc:
                    if self._stop.is_set() and isinstance(exc, psycopg.errors.QueryCanceled):
                        break  # resign() cancelled the statement in flight
                    self._lose(f"the connection failed: {exc}")
                    self._close()
                    failures += 1
                    level = logging.WARNING if failures == 1 else logging.DEBUG
                    logger.log(level, "leader election %r: %s", self._name, exc)
                    # Jittered backoff, never longer than one check interval.
                    pause = min(self._interval, 0.05 * 2 ** min(failures, 8))
                    self._stop.wait(pause * random.uniform(0.5, 1.0))
        except BaseException:  # pragma: no cover - a bug: never die silently
            logger.exception("leader election %r stopped on an unexpected error", self._name)
            raise
        finally:
            self._lose("resigned" if self._stop.is_set() else "the campaign stopped")
            # On resign, let on_lost finish before the lock goes to the next leader.
            with self._cond:
                self._cond.wait_for(
                    lambda: not self._events and not self._in_callback,
                    self._network_timeout + self._interval + 5.0,
                )
            self._close(release=True)
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _open(self) -> None:
        idle = max(1, round(self._network_timeout / 2))
        count = max(1, math.ceil(self._network_timeout) - idle)
        user_timeout = int(self._network_timeout * 1000)
        info = dedicated_conninfo(
            self._source, keepalives=1, keepalives_idle=idle, keepalives_interval=1,
            keepalives_count=count, tcp_user_timeout=user_timeout,
        )
        params = pg_conninfo.conninfo_to_dict(info)
        params.setdefault("connect_timeout", max(2, math.ceil(self._network_timeout)))
        params.setdefault("application_name", "pglock-leader")
        conn = psycopg.connect(pg_conninfo.make_conninfo("", **params), autocommit=True)
        try:
            _conn.run(conn, _sql.leader_session_setup(idle, 1, count, user_timeout))
            # In binary: DateStyle decides how backend_start would read as text.
            pid, started, in_recovery = _conn.fetch(conn, _sql.LEADER_SESSION, binary=True)[0][0]
            if in_recovery:
                raise UnsupportedServer(
                    "this server is a hot standby: advisory locks on it coordinate nothing; "
                    "leader election needs the primary"
                )
        except BaseException:
            conn.close()
            raise
        with self._conn_guard:
            self._conn = conn
        self._pid_start = (pid, started)

    def _close(self, *, release: bool = False) -> None:
        """Close the dedicated session; with ``release``, unlock first when the session is
        usable, so that the lock is free when :meth:`resign` returns (a closed session keeps
        its locks until its backend has exited, a moment after the client closed it)."""
        with self._conn_guard:
            conn, self._conn = self._conn, None
        if (
            release and conn is not None and not conn.closed
            and conn.info.transaction_status == TransactionStatus.IDLE
        ):
            try:
                within(
                    conn, time.monotonic() + self._network_timeout,
                    lambda: _conn.run(conn, _sql.LEADER_UNLOCK), "the leader's unlock",
                )
            except Exception:  # the close below drops the lock all the same, a moment later
                logger.debug("unlocking before closing the leader connection failed",
                             exc_info=True)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # pragma: no cover - closing a broken socket
                logger.debug("closing the leader connection failed", exc_info=True)

    def _cancel_inflight(self) -> None:
        with self._conn_guard:
            conn = self._conn
            if conn is None or conn.closed:
                return
            try:
                conn.cancel_safe(timeout=2.0)
            except Exception:
                logger.debug("cancelling the leader's statement failed", exc_info=True)

    def _campaign_and_lead(self) -> None:
        conn = self._conn
        assert conn is not None
        lock = _advisory.PgLock(conn, self._name, pooler=self._pooler)
        if not lock.acquire(timeout=self._interval):
            return  # not granted within one interval: a round trip proved the session alive
        won = time.monotonic()
        if self._stop.is_set():
            raise _Stopped
        term = _conn.run(conn, _sql.new_term(conn.info.server_version))[0][0]
        # Transactions that passed the previous leader's guard finish before this one leads.
        _conn.run(conn, _sql.fence_wait(self._fence_key))
        logger.debug("won the lock for %r (term %d); waiting out the takeover delay", self._name,
                     term)
        if self._stop.wait(max(0.0, won + self._delay - time.monotonic())):
            raise _Stopped
        sent = self._confirm(conn)
        with self._cond:
            self._leader = True
            self._term = term
            self._session = self._pid_start
            self._valid_until = sent + self._window
            self._events.append(("elected", term))
            self._cond.notify_all()
        logger.info("elected leader of %r (term %d)", self._name, term)
        while True:
            if self._stop.wait(max(0.0, sent + self._interval - time.monotonic())):
                raise _Stopped
            sent = self._confirm(conn)
            with self._cond:
                if not self._leader:
                    # The validity window ran out before this check came back: that term is
                    # over. Drop the session (and the lock with it) and campaign afresh.
                    raise _TermOver
                self._valid_until = sent + self._window

    def _confirm(self, conn: psycopg.Connection[Any]) -> float:
        sent = time.monotonic()
        with self._cond:
            self._inflight_since = sent
        try:
            rows = _conn.run(conn, _sql.held_advisory([self._key], shared=False))
        finally:
            with self._cond:
                self._inflight_since = None
        if not rows:
            raise LockLost(self._name, reason="the session no longer holds the leader lock")
        return sent

    def _lose(self, reason: str) -> None:
        with self._cond:
            if not self._leader:
                return
            self._leader = False
            self._session = None
            self._events.append(("lost", None))
            self._cond.notify_all()
            term = self._term
        log = logger.info if reason == "resigned" else logger.warning
        log("leadership of %r (term %s) ended: %s", self._name, term, reason)

    def _dispatch(self) -> None:
        tick = min(0.5, self._interval)
        last = time.monotonic()
        while True:
            with self._cond:
                while True:
                    if self._events:
                        kind, _ = self._events.popleft()
                        break
                    now = time.monotonic()
                    if now - last > tick + 1.0 and self._inflight_since is not None:
                        # This process was paused (SIGSTOP, a VM freeze): the answer to the
                        # check may be waiting in the socket. Give it a fresh allowance.
                        self._inflight_since = now
                    last = now
                    since = self._inflight_since
                    if self._leader and since is not None and now - since > self._network_timeout:
                        # The server takes no notice of the check (frozen, or a black hole
                        # that still acknowledges TCP): is_leader is already False (the
                        # validity window); now the term ends, and on_lost runs.
                        self._leader = False
                        self._session = None
                        kind = "lost"
                        logger.warning(
                            "leadership of %r (term %s) ended: no answer to a check within "
                            "%.1f s", self._name, self._term, self._network_timeout,
                        )
                        break
                    if not self._running:
                        return
                    wait = tick if self._leader else None
                    if self._leader and since is not None:
                        wait = max(0.001, min(tick, since + self._network_timeout - now + 0.001))
                    self._cond.wait(wait)
                self._in_callback = True
            callback = self._on_elected if kind == "elected" else self._on_lost
            try:
                if callback is not None:
                    callback()
            except BaseException:  # SystemExit, CancelledError: later callbacks must still run
                logger.exception(
                    "the on_%s callback of leader election %r raised", kind, self._name
                )
            finally:
                with self._cond:
                    self._in_callback = False
                    self._cond.notify_all()


class _Stopped(Exception):
    """Internal: the campaign was asked to stop."""


class _TermOver(Exception):
    """Internal: the validity window expired while a check was in flight."""


class LeaderOptions(TypedDict, total=False):
    """The options of :func:`leader` and ``Locker.leader`` (one definition for both)."""

    on_elected: Callable[[], object] | None
    on_lost: Callable[[], object] | None
    check_interval: float
    takeover_delay: float | None
    network_timeout: float
    pooler: str


def leader(source: object, name: str, **options: Unpack[LeaderOptions]) -> LeaderElection:
    """A candidate in the leader election ``name``; see :class:`LeaderElection`.

    :param source: where to connect: a DSN, a ``psycopg_pool.ConnectionPool``, a SQLAlchemy
        ``Engine`` or a psycopg ``Connection`` (its parameters are copied: pglock opens one
        dedicated connection per candidate and never uses a pooled one).
    :param options: keyword-only, the same for ``Locker.leader`` (``LeaderOptions``):

        * ``on_elected``, ``on_lost`` (default None): called on becoming and ceasing to be leader;
        * ``check_interval`` (default 1): seconds between checks of the leader's session;
        * ``takeover_delay`` (default: the validity window): seconds a new leader waits after
          winning before it acts;
        * ``network_timeout`` (default 5): seconds of silence after which the connection
          counts as dead (TCP keepalives and ``tcp_user_timeout``, on both sides);
        * ``pooler`` (default ``"auto"``): what sits between ``source`` and Postgres, as for
          :func:`pglock.pg_lock` (docs/pgbouncer.md).
    :raises TypeError, ValueError: bad arguments, before any I/O.

    Example::

        with pglock.leader(dsn, "scheduler", on_elected=start, on_lost=stop) as election:
            while running:
                if election.is_leader:
                    run_scheduled_jobs()
                time.sleep(1)
    """
    return LeaderElection(source, name, **options)
