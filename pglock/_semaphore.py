"""Semaphores: at most ``limit`` permits held at once across every process, weighted, with a
limit stored in the database and permits that come back when their holder dies.

The database decides: ``<schema>.semaphore_acquire(...)`` (shipped by revision
``pglock_0002``) locks the semaphore's row, drops expired permits, sums the live ones and
inserts the caller's permit row when it fits, in one READ COMMITTED transaction on
``clock_timestamp()``. This module is the client around it:

* **Statements** run on connections of their own (a pool, an engine, or a few connections kept
  per DSN string, shared with leases: ``_source.py``), never in the caller's transaction, one
  round trip each. A statement whose connection dies under it is sent once more on a live one.
* **Crash safety.** A permit row expires ``ttl`` seconds after its last renewal. A keepalive
  thread per :class:`Semaphore` renews all of its permits in one statement every ``ttl/3``;
  the holder believes in a permit until ``send time of the last successful acquire/renewal +
  ttl`` (``time.monotonic()``), never longer than the server keeps it. An answer that arrives
  after that deadline is not believed: a late grant is given back (the wait goes on, or the
  acquire fails), a late renewal does not bring a lost permit back. A holder that dies stops
  renewing, and its permits come back within ``ttl``.
* **Statement deadlines**, as for leases (one policy, in ``_source.py``): an acquire is cut
  off at its timeout plus ``ANSWER_GRACE`` (a silent network; it then fails, and a permit it may
  have been granted expires at its TTL), a renewal at the earliest deadline of the permits it
  renews, a release or a query at a bound from the TTL.
* **Waiting.** Within one :class:`Semaphore` object, waiters queue in arrival order and only
  the first one asks the database. It wakes on the release ``NOTIFY`` (one LISTEN connection
  per source and schema, payload = the name), on a local release, when the earliest permit
  held elsewhere would expire (the server says when) and, as a safety net, on a jittered
  fallback poll of 2 to 4 s (quicker, with backoff, while the LISTEN connection is down).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.pq import TransactionStatus

from . import _conn, _sql
from ._keys import remaining as _remaining
from ._keys import validate_name, validate_timeout
from ._schema import DEFAULT_SCHEMA, validate_schema
from ._source import (
    ANSWER_GRACE,
    WAIT_CHUNK,
    DsnSource,
    NoAnswer,
    Source,
    listen_deadline,
    open_listening,
    short_deadline,
)
from ._source import make_source as _make_source
from .errors import (
    InvalidConnectionState,
    LimitMismatch,
    LockLost,
    LockNotAcquired,
    SchemaNotInstalled,
)

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger("pglock.semaphore")

#: SQLSTATE of ``semaphore_acquire`` when the caller's limit differs from the stored one.
LIMIT_MISMATCH = "PGL01"
#: The largest limit (and weight) accepted: Postgres ``integer``.
MAX_LIMIT = 2**31 - 1

_FALLBACK_POLL = (2.0, 4.0)
_DEGRADED_POLL = (0.05, 1.0)
_EXPIRY_MARGIN = 0.005
_LISTENER_IDLE = 30.0
_DSN_MAX_IDLE = 4

_DEFAULT: Any = object()

#: The longest TTL accepted (one day), as for leases.
MAX_TTL = 86400.0


def semaphore_channel(schema: str) -> str:
    """The NOTIFY channel of semaphore releases in ``schema`` (``<schema>_semaphore``, cut to
    Postgres's 63-byte identifiers). Must match revision ``pglock_0002``."""
    suffix = "_semaphore"
    return schema[: 63 - len(suffix)] + suffix


# --- validation ----------------------------------------------------------------------------------


def _count_arg(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if value < 1 or value > MAX_LIMIT:
        raise ValueError(f"{what} must be between 1 and {MAX_LIMIT}, got {value!r}")
    return value


def _ttl_arg(ttl: object) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    value = float(ttl)
    if not value > 0:  # also NaN
        raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
    if value > MAX_TTL:
        raise ValueError(f"ttl must be at most {MAX_TTL:.0f} seconds (one day), got {ttl!r}")
    return value


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# --- where statements run ------------------------------------------------------------------------


def make_source(source: object) -> Source:
    """Resolve a semaphore source without I/O. :raises TypeError, ValueError:"""
    return _make_source(source, "semaphore")


def _run(
    source: Source, kind: str, schema: str, stmt: sql.Composed, deadline: float | None
) -> list[tuple[Any, ...]]:
    """Send one semaphore statement batch and return the rows of its last row-returning
    statement (see :func:`_run_once_more`)."""
    return _run_once_more(source, kind, schema, stmt, deadline)[0]


def _run_once_more(
    source: Source, kind: str, schema: str, stmt: sql.Composed, deadline: float | None
) -> tuple[list[tuple[Any, ...]], bool]:
    """Send one semaphore statement batch (one round trip, autocommit, on a connection of the
    source's); return its rows and whether it was sent a second time, on a new connection,
    because its connection died under it (:meth:`Source.run_once_more`).

    Extend and info are safe to send again, and so is a release (its answer aside: the caller
    says so). An acquire names a holder of its own: a first attempt that committed a grant
    before its connection died makes the second one fail on the permit's primary key, and the
    unrenewed permit comes back after its TTL, as it would without the second attempt.

    :param deadline: the ``time.monotonic()`` instant the statement is cut off at
        (:class:`NoAnswer`, a ``psycopg.OperationalError``: the outcome is unknown).
    """
    return source.run_once_more(
        lambda conn: _execute(conn, schema, stmt), "semaphore", kind, None, deadline
    )


def _execute(
    conn: psycopg.Connection[Any], schema: str, stmt: sql.Composed
) -> list[tuple[Any, ...]]:
    """``stmt`` in autocommit on ``conn`` (restoring its autocommit setting); a statement that
    failed inside its own explicit transaction is rolled back."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise InvalidConnectionState(
            "the pool handed out a connection inside a transaction; pglock runs semaphore "
            "statements in their own transactions"
        )
    restore = not conn.autocommit
    if restore:
        conn.autocommit = True
    try:
        return _conn.run(conn, stmt)
    except psycopg.Error as exc:
        if not (conn.closed or conn.broken) and _in_failed_transaction(conn):
            _conn.fetch(conn, b"ROLLBACK")
        if isinstance(
            exc,
            (pg_errors.UndefinedFunction, pg_errors.UndefinedTable, pg_errors.InvalidSchemaName),
        ):
            raise SchemaNotInstalled(schema) from exc
        raise
    finally:
        if restore and not (conn.closed or conn.broken):
            try:
                conn.autocommit = False
            except psycopg.Error:
                logger.debug("could not restore autocommit=False", exc_info=True)


def _in_failed_transaction(conn: psycopg.Connection[Any]) -> bool:
    return conn.info.transaction_status == TransactionStatus.INERROR


# --- NOTIFY listeners, one per (source, schema) per process -------------------------------------


class _Listener:
    def __init__(self, source: Source, schema: str, deadline: float) -> None:
        self.source = source
        self.schema = schema
        self.channel = semaphore_channel(schema)
        self.key = (source.key, schema)
        self.lock = threading.Lock()
        #: name -> the Semaphore objects with waiters for it
        self.subscribers: dict[str, weakref.WeakSet[Semaphore]] = {}
        self.healthy = False
        self.closed = False
        self.conn: psycopg.Connection[Any] | None = None
        self._close: Callable[[], None] | None = None
        self._connect(deadline)  # in the caller's thread: LISTEN is active before it tries
        self.thread = threading.Thread(
            target=self._run, name=f"pglock-semaphore-listener-{schema}", daemon=True
        )
        self.thread.start()

    def _connect(self, deadline: float) -> None:
        self.conn, self._close = open_listening(self.source, self.channel, deadline)
        self.healthy = True

    def _drop(self) -> None:
        self.healthy = False
        close, self.conn, self._close = self._close, None, None
        if close is not None:
            with contextlib.suppress(Exception):
                close()

    def subscribe(self, sem: Semaphore) -> None:
        with self.lock:
            self.subscribers.setdefault(sem.name, weakref.WeakSet()).add(sem)

    def unsubscribe(self, sem: Semaphore) -> None:
        with self.lock:
            subs = self.subscribers.get(sem.name)
            if subs is not None:
                subs.discard(sem)
                if not subs:
                    del self.subscribers[sem.name]

    def _wake(self, name: str | None) -> None:
        with self.lock:
            if name is None:
                targets = [s for subs in self.subscribers.values() for s in subs]
            else:
                targets = list(self.subscribers.get(name, ()))
        for sem in targets:
            sem._poke()

    def _run(self) -> None:
        backoff = 0.1
        idle_since: float | None = None
        while not self.closed:
            if self.conn is None:
                try:
                    self._connect(listen_deadline(None))
                    backoff = 0.1
                    self._wake(None)  # releases may have gone unheard meanwhile
                except Exception as exc:
                    logger.debug("semaphore listener reconnect failed: %r", exc)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
            conn = self.conn
            assert conn is not None
            try:
                for n in conn.notifies(timeout=1.0):
                    if n.channel == self.channel:
                        self._wake(n.payload)
            except Exception as exc:
                logger.info("semaphore listener connection lost (%r); waiters poll meanwhile",
                            exc)
                self._drop()
                self._wake(None)
                continue
            with self.lock:
                busy = bool(self.subscribers)
            now = time.monotonic()
            if busy:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since > _LISTENER_IDLE and _retire(self):
                return
        self._drop()


_listeners: dict[tuple[Any, ...], _Listener] = {}
_listeners_lock = threading.Lock()


def _listener(source: Source, schema: str, sem: Semaphore, deadline: float) -> _Listener | None:
    """The (source, schema) listener, started if needed, with ``sem`` subscribed to it (under
    the same lock as :func:`_retire`, so it cannot be retired in between). A new one must be
    listening by ``deadline`` (:func:`listen_deadline`), or waiters poll."""
    key = (source.key, schema)
    with _listeners_lock:
        lst = _listeners.get(key)
        if lst is None or lst.closed:
            try:
                lst = _Listener(source, schema, deadline)
            except Exception as exc:
                logger.info(
                    "could not LISTEN for semaphore releases (%r); waiters poll instead", exc
                )
                return None
            _listeners[key] = lst
        lst.subscribe(sem)
        return lst


def _retire(lst: _Listener) -> bool:
    with _listeners_lock, lst.lock:
        if lst.subscribers:
            return False
        lst.closed = True
        if _listeners.get(lst.key) is lst:
            del _listeners[lst.key]
    lst._drop()
    return True


def _after_fork_in_child() -> None:
    global _listeners_lock
    _listeners.clear()
    _listeners_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- permits and the semaphore ---------------------------------------------------------------


class Permit:
    """Permits held on a semaphore by one acquisition; returned by :meth:`Semaphore.hold`.

    ``with sem.hold(permits=2) as permit:`` yields it. :meth:`check` raises
    :class:`pglock.LockLost` if the keepalive lost the permits (they expired).

    Thread safety: belongs to the thread that acquired it.
    """

    def __init__(self, sem: Semaphore, holder: str, permits: int, deadline: float) -> None:
        self._sem = sem
        self.holder = holder
        self.permits = permits
        self._deadline = deadline
        self._lost: str | None = None
        self._released = False

    @property
    def name(self) -> str:
        return self._sem.name

    @property
    def held(self) -> bool:
        """True while held and, as far as this process knows, not lost."""
        return not self._released and self._lost is None and time.monotonic() < self._deadline

    def check(self) -> None:
        """:raises pglock.LockLost: the permits are no longer held (expired, or released)."""
        if self._released:
            raise LockLost(self.name, reason="the permit was released")
        if self._lost is not None:
            raise LockLost(self.name, reason=self._lost)
        if time.monotonic() >= self._deadline:
            raise LockLost(self.name, reason="its TTL ran out before a renewal succeeded")

    def release(self) -> None:
        """Give the permits back. :raises pglock.LockLost: they had expired meanwhile."""
        self._sem._release_permit(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._released:
            return
        if exc is None:
            self.release()
            return
        try:
            self.release()
        except Exception:
            logger.warning("releasing semaphore %r after the block raised %r failed",
                           self.name, exc, exc_info=True)

    def __repr__(self) -> str:
        state = "held" if self.held else ("released" if self._released else "lost")
        return f"<pglock.Permit {self.name!r} permits={self.permits} {state}>"


class _Hold:
    """``sem.hold(permits, timeout)``: acquires at ``with`` and yields the :class:`Permit`."""

    def __init__(self, sem: Semaphore, permits: int, timeout: float | None) -> None:
        self._sem = sem
        self._permits = permits
        self._timeout = timeout
        self._permit: Permit | None = None

    def __enter__(self) -> Permit:
        if self._permit is not None:
            raise RuntimeError("this hold() is already in use; create one per with-block")
        permit = self._sem._acquire(self._permits, self._timeout)
        if permit is None:
            raise LockNotAcquired(
                self._sem.name, timeout=self._timeout,
                message=(
                    f"could not acquire {self._permits} permit(s) of semaphore "
                    f"{self._sem.name!r}" + (
                        "" if self._timeout is None else
                        " (all taken)" if self._timeout == 0 else
                        f" within {self._timeout:.2f} s"
                    )
                ),
            )
        self._permit = permit
        return permit

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        permit, self._permit = self._permit, None
        if permit is not None:
            permit.__exit__(exc_type, exc, tb)


class Semaphore:
    """A counting semaphore with weighted permits, shared by every process using the database.

    At most ``limit`` permits are held at once, summed over all holders; an acquisition may take
    several (``permits=k``). The limit is stored with the semaphore by its first acquire; a
    caller passing another limit gets :class:`pglock.LimitMismatch`. A holder's permits expire
    ``ttl`` seconds after their last renewal (a keepalive thread renews them every ``ttl/3``),
    so a crashed holder's permits come back within ``ttl``.

    * ``with sem:`` takes one permit (waits as long as needed), ``acquire()``/``release()``
      like :class:`threading.Semaphore` (``release()`` gives back this thread's latest);
    * ``with sem.hold(permits=2, timeout=5) as permit:`` takes two and yields a
      :class:`Permit`;
    * ``sem.count`` is the number of live permits held now (one query).

    Needs the pglock schema (``pglock install``). Thread safety: a Semaphore may be shared by
    threads; waiters of one Semaphore object are served in arrival order, and only the first
    one polls the database.
    """

    def __init__(
        self,
        source: object,
        name: str,
        limit: int,
        *,
        ttl: float = 30.0,
        schema: str = DEFAULT_SCHEMA,
        metadata: Any = None,
    ) -> None:
        self._setup(name, limit, ttl, schema, metadata)
        self._get_source: Callable[[], object] = lambda: source
        self._source: Source | None = make_source(source)

    def _setup(self, name: str, limit: int, ttl: float, schema: str, metadata: Any) -> None:
        self._name = validate_name(name)
        self._limit = _count_arg(limit, "limit")
        self._ttl = _ttl_arg(ttl)
        self._schema = validate_schema(schema)
        try:
            self._metadata = None if metadata is None else json.dumps(
                metadata, separators=(",", ":"), allow_nan=False
            )
        except (TypeError, ValueError) as exc:
            raise TypeError(f"metadata must be JSON-serializable: {exc}") from None
        self._owner = _default_owner()

        self._cond = threading.Condition(threading.Lock())
        self._version = 0  # bumped by anything that may have freed permits
        self._queue: deque[object] = deque()
        self._held: dict[str, Permit] = {}
        self._by_thread: dict[threading.Thread, list[Permit]] = {}
        self._keepalive: threading.Thread | None = None
        self._rng = random.Random()
        #: Acquire statements this object sent (tests count them to show how waiters wake).
        self._attempts = 0
        #: The NOTIFY listener this object is subscribed to while it has waiters.
        self._listening: _Listener | None = None

    @classmethod
    def _for_locker(
        cls, get_source: Callable[[], object], name: str, limit: int, ttl: float, schema: str,
        metadata: Any,
    ) -> Semaphore:
        self = cls.__new__(cls)
        self._setup(name, limit, ttl, schema, metadata)
        self._get_source = get_source
        self._source = None  # resolved at the first use (a Locker opens its pool lazily)
        return self

    # -- introspection ------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def limit(self) -> int:
        """The limit this object was created with (and that the database must store)."""
        return self._limit

    @property
    def ttl(self) -> float:
        return self._ttl

    @property
    def count(self) -> int:
        """The number of live permits held now, by every holder (one query; 0 if the
        semaphore was never used).

        :raises pglock.SchemaNotInstalled: the pglock schema is missing.
        """
        rows = _run(
            self._src(), "info", self._schema, _sql.semaphore_info(self._schema, self._name),
            short_deadline(self._ttl),
        )
        return int(rows[0][2]) if rows else 0

    def __repr__(self) -> str:
        with self._cond:
            mine = sum(p.permits for p in self._held.values())
        return f"<pglock.Semaphore {self._name!r} limit={self._limit} held_here={mine}>"

    def _src(self) -> Source:
        if self._source is None:
            self._source = make_source(self._get_source())
        return self._source

    def close(self) -> None:
        """Close the connections pglock keeps open for this semaphore, if nobody else uses
        them: the LISTEN connection of its source and schema (opened by the first wait), and
        for a DSN source the few connections kept for its statements. Optional: they close
        on their own (the LISTEN one after 30 s without waiters) or at exit. Permits still
        held stay held and renewed; using the semaphore again reopens what it needs.
        """
        src = self._source
        if src is None:
            return
        with _listeners_lock:
            lst = _listeners.get((src.key, self._schema))
        if lst is not None:
            _retire(lst)
        if isinstance(src, DsnSource):
            src.close()

    # -- the threading.Semaphore-like API ----------------------------------------------

    def acquire(self, permits: int = 1, timeout: float | None = None) -> bool:
        """Take ``permits`` permits; True when taken, False when not within ``timeout``.

        :param timeout: ``None`` waits as long as needed; ``0`` tries once.
        :raises ValueError: ``permits`` is not between 1 and the limit.
        :raises pglock.LimitMismatch: the database stores another limit for this name.
        """
        permit = self._acquire(_count_arg(permits, "permits"), validate_timeout(timeout))
        if permit is None:
            return False
        with self._cond:
            self._by_thread.setdefault(threading.current_thread(), []).append(permit)
        return True

    def release(self) -> None:
        """Give back the permits of this thread's latest :meth:`acquire`.

        :raises RuntimeError: this thread holds none through :meth:`acquire`.
        :raises pglock.LockLost: they had expired meanwhile (given back all the same).
        """
        me = threading.current_thread()
        with self._cond:
            stack = self._by_thread.get(me)
            if not stack:
                raise RuntimeError(
                    f"this thread holds no permit of semaphore {self._name!r} taken with "
                    "acquire(); release a Permit from hold() with its own release()"
                )
            permit = stack.pop()
            if not stack:
                del self._by_thread[me]
        permit.release()

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.release()
            return
        try:
            self.release()
        except Exception:
            logger.warning("releasing semaphore %r after the block raised %r failed",
                           self._name, exc, exc_info=True)

    def hold(self, permits: int = 1, timeout: float | None = None) -> _Hold:
        """``with sem.hold(permits=k, timeout=t) as permit:`` takes ``k`` permits for the block.

        :raises pglock.LockNotAcquired: not taken within ``timeout`` (at ``with``).
        """
        return _Hold(self, _count_arg(permits, "permits"), validate_timeout(timeout))

    # -- acquiring ------------------------------------------------------------------------

    def _acquire(self, permits: int, timeout: float | None) -> Permit | None:
        if permits > self._limit:
            raise ValueError(
                f"permits={permits} can never be granted by semaphore {self._name!r} "
                f"with limit {self._limit}"
            )
        source = self._src()
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
        try:
            attempt = 0
            while True:
                with self._cond:
                    # Arrival order within this object: only the first waiter asks.
                    while self._queue[0] is not ticket:
                        remaining = _remaining(deadline)
                        if remaining == 0:
                            return None
                        self._cond.wait(remaining)
                    version = self._version
                permit, retry_in = self._try(source, permits, deadline, wait=timeout != 0)
                if permit is not None:
                    return permit
                remaining = _remaining(deadline)
                if remaining == 0:
                    return None
                # Refused: LISTEN from now on (an uncontended acquire never opens the LISTEN
                # connection). A release sent before LISTEN was active went unheard, so try
                # again at once when the subscription is new.
                listener, new = self._listen(source, deadline)
                if new:
                    continue
                attempt += 1
                pause = self._fallback(listener, attempt)
                if retry_in is not None:
                    pause = min(pause, retry_in + _EXPIRY_MARGIN)
                if remaining is not None:
                    pause = min(pause, remaining)
                with self._cond:
                    end = time.monotonic() + pause
                    while self._version == version:
                        left = end - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
        finally:
            with self._cond:
                self._queue.remove(ticket)
                if not self._queue and self._listening is not None:
                    self._listening.unsubscribe(self)
                    self._listening = None
                self._cond.notify_all()  # the next in line goes at once

    def _listen(
        self, source: Source, deadline: float | None
    ) -> tuple[_Listener | None, bool]:
        """This object's NOTIFY subscription, made now if needed: (listener, made now)."""
        with self._cond:
            current = self._listening
        if current is not None and not current.closed:
            return current, False
        lst = _listener(source, self._schema, self, listen_deadline(deadline))
        with self._cond:
            self._listening = lst
        return lst, lst is not None

    def _fallback(self, listener: _Listener | None, attempt: int) -> float:
        if listener is not None and listener.healthy:
            return self._rng.uniform(*_FALLBACK_POLL)
        low, high = _DEGRADED_POLL
        return self._rng.uniform(0.5, 1.0) * min(high, low * 2.0 ** min(attempt, 16))

    def _try(
        self, source: Source, permits: int, deadline: float | None, *, wait: bool
    ) -> tuple[Permit | None, float | None]:
        """One acquire statement (cut off at ``deadline`` plus grace; without a deadline, at
        ``WAIT_CHUNK`` plus grace). Returns the permit, or None and when to try again
        (None: on the next wake-up)."""
        holder = f"{self._owner}:{uuid.uuid4().hex}"
        stmt = _sql.semaphore_acquire(
            self._schema, self._name, self._limit, holder, permits, self._ttl, self._metadata,
            wait,
        )
        sent = time.monotonic()
        self._attempts += 1
        cut_off = (sent + WAIT_CHUNK if deadline is None else deadline) + ANSWER_GRACE
        try:
            rows = _run(source, "acquire", self._schema, stmt, cut_off)
        except NoAnswer as exc:
            logger.warning(
                "acquiring semaphore %r got no answer in time (a permit it may have been "
                "granted expires at its TTL): %s", self._name, exc,
            )
            return None, self._rng.uniform(0.005, 0.02)
        except psycopg.Error as exc:
            if exc.sqlstate == LIMIT_MISMATCH:
                raise LimitMismatch(
                    self._name, limit=self._limit, stored_limit=self._stored_limit(source)
                ) from exc
            raise
        received = time.monotonic()
        granted, _max, held, retry_in = rows[0]
        if not granted:
            logger.debug("semaphore %r: %d of %d held, %d more do not fit", self._name, held,
                         self._limit, permits)
            return None, None if retry_in is None else float(retry_in)
        if received >= sent + self._ttl:
            self._give_back(source, holder, received - sent)
            return None, self._rng.uniform(0.005, 0.02)
        permit = Permit(self, holder, permits, sent + self._ttl)
        with self._cond:
            self._held[holder] = permit
            self._ensure_keepalive()
        logger.debug("acquired %d permit(s) of semaphore %r (%d of %d held)", permits,
                     self._name, held, self._limit)
        return permit, None

    def _give_back(self, source: Source, holder: str, took: float) -> None:
        """A grant whose answer came after its client deadline (send time + ttl): never
        believed; released now (best effort) so that it does not count until its TTL."""
        logger.info(
            "semaphore %r: a grant arrived %.3f s after the acquire was sent, past its ttl of "
            "%g s, and is given back", self._name, took, self._ttl,
        )
        try:
            _run(
                source, "release", self._schema,
                _sql.semaphore_release(self._schema, self._name, holder),
                short_deadline(self._ttl),
            )
        except Exception as exc:
            logger.info(
                "giving back the late grant of semaphore %r failed (it expires at its TTL): %r",
                self._name, exc,
            )

    def _stored_limit(self, source: Source) -> int | None:
        try:
            rows = _run(
                source, "info", self._schema, _sql.semaphore_info(self._schema, self._name),
                short_deadline(self._ttl),
            )
        except psycopg.Error:
            return None
        return int(rows[0][1]) if rows else None

    def _poke(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # -- releasing ------------------------------------------------------------------------

    def _release_permit(self, permit: Permit) -> None:
        if permit._released:
            raise RuntimeError(f"this permit of semaphore {self._name!r} was already released")
        permit._released = True
        with self._cond:
            self._held.pop(permit.holder, None)
            for stack in self._by_thread.values():
                if permit in stack:
                    stack.remove(permit)
            self._cond.notify_all()  # the keepalive may stop
        try:
            rows, again = _run_once_more(
                self._src(), "release", self._schema,
                _sql.semaphore_release(self._schema, self._name, permit.holder),
                short_deadline(self._ttl),
            )
        finally:
            self._poke()  # local waiters try at once
        status = rows[0][0] if rows else "not_held"
        if status != "released" or permit._lost is not None:
            reason = permit._lost or (
                "it had expired before the release" if status == "expired" else
                # The first attempt may have deleted the row before its connection died.
                "the release was sent again after its connection was lost, and the permit was "
                "not held any more: the first attempt may have released it, or it had expired"
                if again else
                "it was no longer held (expired and taken by others)"
            )
            raise LockLost(self._name, reason=reason)
        logger.debug("released %d permit(s) of semaphore %r", permit.permits, self._name)

    # -- keepalive --------------------------------------------------------------------------

    def _ensure_keepalive(self) -> None:
        # Called with self._cond held.
        if self._keepalive is None or not self._keepalive.is_alive():
            self._keepalive = threading.Thread(
                target=self._renew_loop, name=f"pglock-semaphore-keepalive:{self._name}",
                daemon=True,
            )
            self._keepalive.start()

    def _renew_loop(self) -> None:
        interval = self._ttl / 3
        next_at = time.monotonic() + interval
        while True:
            with self._cond:
                while True:
                    if not self._held:
                        self._keepalive = None
                        return
                    now = time.monotonic()
                    for p in list(self._held.values()):
                        if now >= p._deadline and p._lost is None:
                            p._lost = "its TTL ran out before a renewal succeeded"
                            logger.warning("semaphore %r: permit lost: %s", self._name, p._lost)
                    if now >= next_at:
                        break
                    self._cond.wait(next_at - now)
                live = [p for p in self._held.values() if p._lost is None]
            if not live:
                next_at = time.monotonic() + interval
                continue
            sent = time.monotonic()
            try:
                # An answer after the earliest deadline would come too late for that permit.
                rows = _run(
                    self._src(), "extend", self._schema,
                    _sql.semaphore_extend(self._schema, self._name,
                                          [p.holder for p in live], self._ttl),
                    max(sent + 0.05, min(p._deadline for p in live)),
                )
            except Exception as exc:
                logger.info("renewing %d permit(s) of semaphore %r failed, retrying: %r",
                            len(live), self._name, exc)
                next_at = time.monotonic() + min(1.0, interval / 3)
                continue
            self._renewed(live, {r[0] for r in rows}, sent, time.monotonic())
            next_at = sent + interval

    def _renewed(
        self, live: list[Permit], renewed: set[str], sent: float, received: float
    ) -> None:
        """Apply a renewal's answer: a permit renewed moves its deadline on, unless the answer
        came after its deadline (a late answer never brings a lost permit back)."""
        with self._cond:
            for p in live:
                if p._released or p._lost is not None:
                    continue
                if p.holder not in renewed:
                    p._lost = "the renewal found it expired (its holder paused too long)"
                elif received >= p._deadline:
                    p._lost = "a renewal's answer arrived after the permit's client deadline"
                else:
                    p._deadline = max(p._deadline, sent + self._ttl)
                    continue
                logger.warning("semaphore %r: permit lost: %s", self._name, p._lost)


def semaphore(
    source: object,
    name: str,
    limit: int,
    *,
    ttl: float = 30.0,
    schema: str = DEFAULT_SCHEMA,
    metadata: Any = None,
) -> Semaphore:
    """A semaphore ``name`` allowing ``limit`` permits at once across all processes.

    :param source: a ``psycopg_pool.ConnectionPool``, a SQLAlchemy ``Engine`` (psycopg driver)
        or a DSN string; statements run on connections of their own from it.
    :param limit: the number of permits (stored by the first acquire; every user must pass the
        same).
    :param ttl: seconds a holder's permits outlive its last renewal (renewed every ``ttl/3``
        while held); a crashed holder's permits come back within it.
    :param schema: the pglock schema (default ``pglock``).
    :param metadata: a JSON value stored with each permit (shown in ``semaphore_permit``).
    :raises TypeError, ValueError: bad arguments, before any SQL.

    Example::

        exports = pglock.semaphore(pool, "exports", limit=3)
        with exports:                                   # one permit
            run_export()
        with exports.hold(permits=2, timeout=10):       # a heavy job takes two
            run_big_export()
    """
    return Semaphore(source, name, limit, ttl=ttl, schema=schema, metadata=metadata)
