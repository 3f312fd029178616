"""The TTL-row client that leases and semaphores share: statements on a source, NOTIFY
listeners and waiter queues, and the keepalive.

``Lease`` and ``Semaphore`` implement only their hooks: an attempt (:func:`wait`), a renewal
and a loss (:class:`Held`), a release. The design is in docs/how-it-works.md, "Leases and
semaphores".
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.pq import TransactionStatus

from . import _conn, _sql
from ._keys import remaining as _remaining
from ._source import Source, close_dsn_sources, listen_deadline, open_listening
from .errors import InvalidConnectionState

logger = logging.getLogger("pglock.ttl")

H = TypeVar("H", bound="Held")

#: The longest sleep of a waiter between looks while its listener is up (jittered): a safety
#: net for releases that send no NOTIFY. While it is down, a jittered backoff (DEGRADED_POLL).
FALLBACK_POLL = (2.0, 4.0)
DEGRADED_POLL = (0.05, 1.0)
#: A listener with no waiters for this long closes its connection.
LISTENER_IDLE = 30.0
#: How often a listener looks up from its connection (idle check, stop requests).
_LISTENER_TICK = 0.5
#: The keepalive scheduler looks up at least this often (seconds), grants or not.
_KEEPALIVE_TICK = 5.0
#: A renewal worker (one per source and schema) with nothing to do for this long exits.
_WORKER_IDLE = 30.0
#: How many times a statement failed by a serialization failure or a deadlock (under a
#: REPEATABLE READ or SERIALIZABLE default isolation) is sent again, at READ COMMITTED.
_RETRIES = 5
_BEGIN, _COMMIT, _ROLLBACK = (
    s.as_bytes(None)
    for s in (_sql.LEASE_RETRY_BEGIN, _sql.LEASE_RETRY_COMMIT, _sql.LEASE_RETRY_ROLLBACK)
)

Result = list[tuple[Any, ...]]
Query = bytes | sql.Composed
Key = tuple[Any, ...]
#: An attempt's outcome: the grant (None: none), whether the database refused (rather than no
#: answer, or a grant too late), and when to look again (monotonic; None: at the next wake-up).
Attempt = tuple[Any, bool, float | None]
#: Whether close() ended a wait.
Closed = Callable[[], bool]


@dataclass(frozen=True)
class Rows:
    """One kind of TTL row, as the shared client needs to know it.

    :ivar user: ``"lease"``, ``"semaphore"``: the ``pglock.<user>`` logger, the messages.
    :ivar channel: the NOTIFY channel of its releases in a schema (the payload is the name).
    :ivar look_again_on_subscribe: a wait queue looks once more when it first has a listener,
        not only when the LISTEN connection is new (as the semaphore client always has).
    """

    user: str
    channel: Callable[[str], str]
    look_again_on_subscribe: bool = False

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(f"pglock.{self.user}")


# --- statements ----------------------------------------------------------------------------------


def run(
    rows: Rows, source: Source, kind: str, schema: str, query: Query,
    params: tuple[Any, ...] | None = None, *, binary: bool = False,
    timeout: float | None = None, deadline: float | None = None,
) -> tuple[Result, bool]:
    """Send one statement of ``rows`` in autocommit on a connection of its own from ``source``;
    return the rows of its last row-returning statement and whether it was sent a second time
    because its connection died under it (:meth:`Source.run_once_more`: it must be safe to).

    :param kind: ``"acquire"``, ``"extend_many"``, ...: for the log and the messages.
    :param params: of one statement, sent again at READ COMMITTED when the session's own
        timeouts or isolation level fail it. None: ``query`` is a batch with its values as
        literals and its own ``BEGIN ...; COMMIT``, sent as it is.
    :param timeout: the longest wait for a pool connection.
    :param deadline: the ``time.monotonic()`` instant it is cut off at (:class:`NoAnswer`).
    :raises pglock.SchemaNotInstalled: the schema's objects are missing.
    """
    return source.run_once_more(
        lambda conn: _execute(conn, rows, kind, schema, query, params, binary),
        rows.user, kind, timeout, deadline,
    )


def _execute(
    conn: psycopg.Connection[Any], rows: Rows, kind: str, schema: str, query: Query,
    params: tuple[Any, ...] | None, binary: bool,
) -> Result:
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise InvalidConnectionState(
            f"the pool handed out a connection inside a transaction; pglock runs {rows.user} "
            "statements in their own transactions"
        )
    restore = not conn.autocommit
    if restore:
        conn.autocommit = True
    try:
        if params is not None:
            return _with_retries(conn, rows, kind, query, params, binary)
        try:
            results = _conn.fetch(conn, query)
        except psycopg.Error:
            _rollback(conn)  # a batch that failed inside its own transaction
            raise
        return results[-1] if results else []
    except psycopg.Error as exc:
        translated = translate(exc, conn, schema)
        if translated is None:
            raise
        raise translated from exc
    finally:
        if restore and not (conn.closed or conn.broken):
            try:
                conn.autocommit = False
            except psycopg.Error:
                logger.debug("could not restore autocommit=False", exc_info=True)


def _with_retries(
    conn: psycopg.Connection[Any], rows: Rows, kind: str, query: Query, params: tuple[Any, ...],
    binary: bool,
) -> Result:
    state = _conn.state_for(conn)
    for attempt in range(_RETRIES + 1):
        try:
            if attempt == 0 and not state.session_timeouts:
                return _conn.fetch(conn, query, params, binary=binary)[0]
            return _read_committed(conn, rows, query, params, binary)
        except (pg_errors.QueryCanceled, pg_errors.LockNotAvailable):
            # The session's own statement_timeout or lock_timeout (ALTER ROLE app SET ...) must
            # not end a wait of pglock's: sent again with them off, and so from now on on this
            # connection. With none set it was a cancel, which stands.
            if attempt or state.session_timeouts or not _has_session_timeouts(conn):
                raise
            state.session_timeouts = True
        except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected) as exc:
            # The functions are written for READ COMMITTED; under a stricter default isolation
            # concurrent statements fail this way, and could fail every time under contention.
            # Each is its own transaction, rolled back whole: sent again at READ COMMITTED.
            if attempt == _RETRIES or conn.info.transaction_status != TransactionStatus.IDLE:
                raise
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
    """``query`` in an explicit READ COMMITTED transaction, the session's timeouts off: three
    round trips, only after a failure at the default level or on a session with timeouts."""
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
    return bool(_conn.fetch(conn, _sql.SESSION_TIMEOUTS)[0][0][0])


def _rollback(conn: psycopg.Connection[Any]) -> None:
    if not (conn.closed or conn.broken) and (
        conn.info.transaction_status != TransactionStatus.IDLE
    ):
        try:
            _conn.fetch(conn, _ROLLBACK)
        except psycopg.Error:
            logger.debug("rolling back a failed statement failed", exc_info=True)


def translate(exc: psycopg.Error, conn: psycopg.Connection[Any], schema: str) -> Exception | None:
    """The pglock error for a Postgres error of a TTL-row statement (a missing schema, an
    exhausted token sequence; see :func:`pglock._conn.translate`), or None."""
    return _conn.translate(exc, _conn.Context(schema=schema, waits=False), conn)


# --- waiter queues and NOTIFY listeners ---------------------------------------------------------


class _Queue:
    """The local waiters of one name (and owner), first in line first."""

    __slots__ = ("holder", "listening", "tickets", "version")

    def __init__(self) -> None:
        #: One condition per waiter (on the waiters' lock), the head first.
        self.tickets: deque[threading.Condition] = deque()
        #: Bumped on every event that may have freed the name: a NOTIFY, a local release.
        self.version = 0
        #: A grant of this process that holds the name (the head waits for it locally).
        self.holder: Any = None
        #: The head has had a listener (see :attr:`Rows.look_again_on_subscribe`).
        self.listening = False

    def wake_head(self) -> None:
        self.version += 1
        if self.tickets:
            self.tickets[0].notify()


class _Listener:
    """One LISTEN connection for a (source, schema, channel) and the thread that reads it."""

    def __init__(self, rows: Rows, source: Source, schema: str, deadline: float) -> None:
        self.rows = rows
        self.source = source
        self.channel = rows.channel(schema)
        self.key = (source.key, schema, self.channel)
        self.healthy = False
        self.stopped = False
        self.conn: psycopg.Connection[Any] | None = None
        self._close: Callable[[], None] | None = None
        self._connect(deadline)  # in the caller's thread: LISTEN is active before it looks
        name = f"pglock-{rows.user}-listener-{schema}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _connect(self, deadline: float) -> psycopg.Connection[Any]:
        self.conn, self._close = open_listening(self.source, self.channel, deadline)
        self.healthy = True
        return self.conn

    def _drop(self) -> None:
        self.healthy = False
        close, self.conn, self._close = self._close, None, None
        if close is not None:
            try:
                close()
            except Exception:
                logger.debug("closing the listener connection failed", exc_info=True)

    def _run(self) -> None:
        # Only this thread touches the connection once it runs; others set ``stopped``.
        backoff, idle_since = 0.1, time.monotonic()
        try:
            while not self.stopped:
                conn = self.conn
                if conn is None:
                    try:
                        conn = self._connect(listen_deadline(None))
                    except Exception as exc:
                        self.rows.log.debug("%s listener reconnect failed: %r", self.rows.user, exc)
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                        _waiters.stop_listener_if_idle(self, idle_for=None)
                        continue
                    backoff = 0.1
                    _waiters.wake_all(self.key)  # releases may have gone unheard meanwhile
                try:
                    for n in conn.notifies(timeout=_LISTENER_TICK):
                        if n.channel == self.channel:
                            _waiters.on_notify(self.key, n.payload)
                except Exception as exc:
                    self.rows.log.info("%s listener lost its connection (%r)", self.rows.user, exc)
                    self._drop()
                    _waiters.wake_all(self.key)
                    continue
                if _waiters.has_waiters(self.key):
                    idle_since = time.monotonic()
                else:
                    _waiters.stop_listener_if_idle(self, time.monotonic() - idle_since)
        finally:
            self._drop()


class _Waiters:
    """The process's wait queues and NOTIFY listeners.

    A queue is keyed by ``(source key, schema, channel, name)`` and an owner: leases share one
    queue per name (owner None), each semaphore object has its own. A NOTIFY wakes the head
    of every queue of its name; a local release pokes one queue.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[Key, dict[object, _Queue]] = {}
        #: Tickets waiting, per (source key, schema, channel): is its listener still needed?
        self.waiting: Counter[Key] = Counter()
        self.listeners: dict[Key, _Listener] = {}
        self.listener_create = threading.Lock()
        self.rng = random.Random()

    def enqueue(self, key: Key, owner: object) -> tuple[_Queue, threading.Condition]:
        with self.lock:
            owners = self.queues.setdefault(key, {})
            q = owners.get(owner) or owners.setdefault(owner, _Queue())
            ticket = threading.Condition(self.lock)
            q.tickets.append(ticket)
            self.waiting[key[:3]] += 1
            return q, ticket

    def dequeue(self, key: Key, owner: object, q: _Queue, ticket: threading.Condition) -> None:
        with self.lock:
            was_head = bool(q.tickets) and q.tickets[0] is ticket
            try:
                q.tickets.remove(ticket)
            except ValueError:
                return
            self.waiting[key[:3]] -= 1
            if not self.waiting[key[:3]]:
                del self.waiting[key[:3]]
            if was_head and q.tickets:
                q.tickets[0].notify()  # the next in line goes at once
            # A queue lives while somebody waits; its holder is only of use to them.
            owners = self.queues.get(key, {})
            if not q.tickets and owners.get(owner) is q:
                del owners[owner]
                if not owners:
                    del self.queues[key]

    def wait_head(
        self, q: _Queue, ticket: threading.Condition, deadline: float | None, closed: Closed
    ) -> bool:
        with self.lock:
            while q.tickets[0] is not ticket:
                if (left := _remaining(deadline)) == 0 or closed():
                    return False
                ticket.wait(left)
            return not closed()

    def sleep(
        self, q: _Queue, ticket: threading.Condition, seen: int, until: float, closed: Closed
    ) -> bool:
        """Sleep until the queue's version moves on from ``seen`` (True), ``until`` passes or
        the wait is closed."""
        with self.lock:
            while q.version == seen and (left := until - time.monotonic()) > 0 and not closed():
                ticket.wait(left)
            return q.version != seen

    def wake(self, key: Key, owner: object) -> None:
        """Wake every waiter of one queue (a close(): each asks whether it is closed)."""
        with self.lock:
            if (q := self.queues.get(key, {}).get(owner)) is not None:
                for ticket in q.tickets:
                    ticket.notify()

    def on_notify(self, lkey: Key, name: str) -> None:
        with self.lock:
            for q in self.queues.get((*lkey, name), {}).values():
                q.wake_head()

    def wake_all(self, lkey: Key) -> None:
        with self.lock:
            for q in [q for k, qs in self.queues.items() if k[:3] == lkey for q in qs.values()]:
                q.wake_head()

    def poke(self, key: Key, owner: object) -> None:
        """Wake the head of one queue (a local release)."""
        with self.lock:
            if (q := self.queues.get(key, {}).get(owner)) is not None:
                q.wake_head()

    def hold(self, key: Key, holder: object) -> None:
        """A grant of this process holds the name of the shared queue ``key`` (if any)."""
        with self.lock:
            if (q := self.queues.get(key, {}).get(None)) is not None:
                q.holder = holder

    def ended(self, key: Key, holder: object, *, notified: bool) -> None:
        """A grant of this process on the name of the shared queue ``key`` ended: its waiters
        look again, unless the release sent a NOTIFY that a healthy listener will bring (the
        next one would ask twice after the handoff)."""
        with self.lock:
            q = self.queues.get(key, {}).get(None)
            if q is None:
                return
            if q.holder is holder:
                q.holder = None
            lst = self.listeners.get(key[:3])
            if not (notified and lst is not None and lst.healthy):
                q.wake_head()

    def has_waiters(self, lkey: Key) -> bool:
        with self.lock:
            return lkey in self.waiting

    def listener(
        self, rows: Rows, source: Source, schema: str, deadline: float
    ) -> tuple[_Listener | None, bool]:
        """The (source, schema) listener of ``rows``, started if needed: (listener, created
        now). A new one must be listening by ``deadline``; past it, waiters poll instead."""
        key = (source.key, schema, rows.channel(schema))
        lst = self.listeners.get(key)
        if lst is not None:
            return lst, False
        with self.listener_create:  # one connect at a time; the others find it made
            lst = self.listeners.get(key)
            if lst is not None:
                return lst, False
            try:
                lst = _Listener(rows, source, schema, deadline)
            except Exception as exc:
                rows.log.info(
                    "could not LISTEN for %s releases (%r); waiters poll instead", rows.user, exc
                )
                return None, False
            with self.lock:
                self.listeners[key] = lst
            lst.thread.start()
            return lst, True

    def stop_listener_if_idle(self, lst: _Listener, idle_for: float | None) -> None:
        """Stop ``lst`` if nobody waits (and, given ``idle_for``, for long enough): it closes
        its connection within a tick."""
        with self.lock:
            if lst.key in self.waiting or (idle_for is not None and idle_for < LISTENER_IDLE):
                return
            if self.listeners.get(lst.key) is lst:
                del self.listeners[lst.key]
            lst.healthy = False
            lst.stopped = True

    def retire(self, lkey: Key) -> None:
        """Stop the listener of ``lkey`` now, if nobody waits."""
        lst = self.listeners.get(lkey)
        if lst is not None:
            self.stop_listener_if_idle(lst, idle_for=None)

    def fallback(self, lst: _Listener | None, polls: int) -> float:
        if lst is not None and lst.healthy:
            return self.rng.uniform(*FALLBACK_POLL)
        low, high = DEGRADED_POLL
        return self.rng.uniform(0.5, 1.0) * min(high, low * 2.0 ** min(polls, 30))


def wait(
    rows: Rows, source: Source, schema: str, name: str, owner: object, deadline: float | None,
    attempt: Callable[[float | None], Attempt],
    local_wake: Callable[[Any], float | None] | None = None,
    closed: Closed = lambda: False,
) -> Any:
    """Wait for a grant of ``name`` until ``deadline`` (monotonic; None: forever) or until
    ``closed()``: the grant of the first ``attempt`` that gives one, or None.

    The waiters of one queue (``owner`` None: the name's, shared) go first in, first out; only
    the head calls ``attempt(seconds left)``. After a refusal it LISTENs for the releases of
    ``rows`` on the source and schema, and sleeps until a NOTIFY for the name, a local
    release, the instant the attempt named, or a jittered fallback poll. While a grant of this
    process holds the name, ``local_wake(holder)`` says when to look again (None: now) and
    nothing is polled.
    """
    key = (source.key, schema, rows.channel(schema), name)
    q, ticket = _waiters.enqueue(key, owner)
    try:
        if not _waiters.wait_head(q, ticket, deadline, closed):
            return None
        listener: _Listener | None = None
        polls = 0
        while not closed():
            with _waiters.lock:
                seen, local = q.version, q.holder
            wake_at = None if local_wake is None else local_wake(local)
            if wake_at is None or wake_at <= time.monotonic():
                granted, refused, wake_at = attempt(_remaining(deadline))
                if granted is not None:
                    return granted
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                if refused:
                    listener, again = _listen(rows, q, listener, source, schema, deadline)
                    if again:
                        continue  # LISTEN is active now: look once more, then sleep
            if wake_at is None or local is None:
                polls += 1
                poll = time.monotonic() + _waiters.fallback(listener, polls)
                wake_at = poll if wake_at is None else min(wake_at, poll)
            if deadline is not None:
                wake_at = min(wake_at, deadline)
            woken = _waiters.sleep(q, ticket, seen, wake_at, closed)
            if not woken and deadline is not None and time.monotonic() >= deadline:
                return None
        return None
    finally:
        _waiters.dequeue(key, owner, q, ticket)


def wake(key: Key | None, owner: object) -> None:
    """Wake the waiters of the queue ``key`` of ``owner`` now (a close())."""
    if key is not None:
        _waiters.wake(key, owner)


def _listen(
    rows: Rows, q: _Queue, listener: _Listener | None, source: Source, schema: str,
    deadline: float | None,
) -> tuple[_Listener | None, bool]:
    """A refused head's NOTIFY listener, and whether to look once more before sleeping (a
    release sent before LISTEN was active went unheard)."""
    if listener is not None and listener.healthy:
        return listener, False
    lst, created = _waiters.listener(rows, source, schema, listen_deadline(deadline))
    first = lst is not None and not q.listening
    q.listening = q.listening or lst is not None
    return lst, created or (first and rows.look_again_on_subscribe)


# --- the keepalive -------------------------------------------------------------------------------


class Held:
    """A grant that the keepalive renews: a lease handle, a semaphore permit.

    A subclass sets the fields below (``_lock`` guards them; ``_group`` is ``(source key,
    schema)``, its renewal worker; ``_sent_at``: its last successful grant or renewal was sent
    then, on ``time.monotonic()``; ``_deadline``: it is believed until then; ``_qkey``: the
    shared wait queue of the name it holds) and implements the three hooks.
    """

    _lock: threading.Lock
    _source: Source
    _schema: str
    _group: Key
    _ttl: float
    _sent_at: float
    _deadline: float
    _qkey: Key | None = None
    #: False: nothing renews it (it is lost at its deadline all the same).
    _keepalive = True
    #: When to try again after a failed renewal (None: at the usual time).
    _retry_at: float | None = None
    #: A renewal of it is in flight (guarded by the keepalive's lock).
    _renewing = False

    def _live(self) -> bool:
        """Held and not known lost (read without the lock by the scheduler)."""
        raise NotImplementedError

    def _lose(self, reason: str) -> None:
        """Declare it lost, once: :func:`unregister` it, log, tell the user."""
        raise NotImplementedError

    @classmethod
    def _renew_batch(cls: type[H], items: list[H]) -> None:
        """Renew ``items`` (of this class, one source and schema) in one statement and apply
        the answer; on a failure, :meth:`_renew_failed`."""
        raise NotImplementedError

    def _renew_due(self) -> float:
        retry = self._retry_at
        return retry if retry is not None else self._sent_at + self._ttl / 3

    def _renew_soon(self) -> float:
        # Renew early to share a round: anything past half its interval comes along.
        retry = self._retry_at
        return retry if retry is not None else self._sent_at + self._ttl / 6

    def _renew_failed(self, sent: float) -> None:
        with self._lock:
            self._retry_at = sent + min(1.0, max(0.05, self._ttl / 10))


class _Worker:
    """The renewal thread of one (source, schema) and its batches, run one after another."""

    __slots__ = ("batches", "cond", "thread")

    def __init__(self, lock: threading.Lock) -> None:
        self.batches: deque[list[Held]] = deque()
        self.cond = threading.Condition(lock)
        self.thread: threading.Thread | None = None


class _Keepalive:
    """The grants held in the process and their renewal: a scheduler thread, which sends
    nothing (it hands due grants to their group's worker in one batch, and declares a grant
    lost at its client deadline even while a renewal of it is stuck), and one worker thread per
    (source, schema), which sends a batch at a time, one statement per kind of grant, without
    holding up any other group."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # the scheduler sleeps on it
        self.held: set[Held] = set()
        self.thread: threading.Thread | None = None
        #: When the sleeping scheduler wakes next (-inf while it is awake).
        self.next_wake = -math.inf
        #: Renewal workers per (source key, schema).
        self.workers: dict[Key, _Worker] = {}

    def register(self, item: Held) -> None:
        with self.lock:
            self.held.add(item)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="pglock-keepalive", daemon=True
                )
                self.next_wake = -math.inf
                self.thread.start()
            elif min(item._renew_due(), item._deadline) < self.next_wake:
                # Only when the new grant is due before the thread's next wake-up: a stream of
                # acquires must not make it rescan every held grant each time.
                self.cond.notify()

    def _run(self) -> None:
        while True:
            try:
                self._schedule()
            except Exception:  # a bug here must not stop every renewal in the process
                logger.exception("pglock's keepalive failed; it goes on")
                time.sleep(0.1)

    def _schedule(self) -> None:
        """Losses at their deadline, batches to the workers, sleep; again."""
        while True:
            with self.lock:
                now = time.monotonic()
                lost, batches, wake_at = self._scan(now)
                for group, items in batches.items():
                    self._dispatch(group, items)
                if not lost:
                    if batches:
                        continue  # look again: the grants handed out are no longer due
                    # Look up at least every few seconds, so that registering a grant due later
                    # than that needs no wake-up (a thread switch per acquire otherwise).
                    self.next_wake = min(wake_at, now + _KEEPALIVE_TICK)
                    self.cond.wait(max(0.0, self.next_wake - now))
                    self.next_wake = -math.inf  # awake: it rescans before sleeping again
                    continue
            for item in lost:
                item._lose("its TTL ran out before a renewal succeeded")

    def _scan(self, now: float) -> tuple[list[Held], dict[Key, list[Held]], float]:
        """With the lock held: the grants past their deadline, the renewal batches due now
        (marked as renewing), and when to look again."""
        lost: list[Held] = []
        wake_at = math.inf
        due_groups: set[Key] = set()
        for item in self.held:
            if not item._live():
                continue  # being released, or lost: about to leave the set
            if now >= item._deadline:
                lost.append(item)
                continue
            wake_at = min(wake_at, item._deadline)
            if not item._keepalive or item._renewing:
                continue  # a renewal in flight: only its deadline counts
            due = item._renew_due()
            if now >= due:
                due_groups.add(item._group)
            else:
                wake_at = min(wake_at, due)
        batches: dict[Key, list[Held]] = {}
        for item in self.held if due_groups else ():
            if (
                item._keepalive
                and item._group in due_groups
                and not item._renewing
                and item._live()
                and item._renew_soon() <= now < item._deadline
            ):
                item._renewing = True
                batches.setdefault(item._group, []).append(item)
        return lost, batches, wake_at

    def _dispatch(self, group: Key, items: list[Held]) -> None:
        """With the lock held: hand a batch to its group's worker (started if needed)."""
        worker = self.workers.get(group) or self.workers.setdefault(group, _Worker(self.lock))
        worker.batches.append(items)
        if worker.thread is None:
            worker.thread = threading.Thread(
                target=self._work, args=(group, worker), name=f"pglock-renewal-{group[1]}",
                daemon=True,
            )
            worker.thread.start()
        else:
            worker.cond.notify()

    def _work(self, group: Key, worker: _Worker) -> None:
        """A worker's loop: renew its group's batches, one statement per kind of grant; exit
        after a while without any."""
        while True:
            with self.lock:
                while not worker.batches:
                    if not worker.cond.wait(_WORKER_IDLE) and not worker.batches:
                        worker.thread = None
                        if self.workers.get(group) is worker:
                            del self.workers[group]
                        return
                items = worker.batches.popleft()
            kinds: dict[type[Held], list[Held]] = {}
            for item in items:
                kinds.setdefault(type(item), []).append(item)
            try:
                for kind, batch in kinds.items():
                    try:
                        kind._renew_batch(batch)
                    except Exception:  # a bug here must not stop the group's renewals
                        logger.exception("pglock's renewal of %s failed; it goes on", kind)
            finally:
                with self.lock:
                    for item in items:
                        item._renewing = False
                    self.cond.notify()  # the scheduler looks again: due times moved


class _Callbacks:
    """pglock's thread for the user's callbacks (``on_lost``): never the caller's thread,
    which may hold a lock the callback takes, nor the keepalive's, which must not wait on them.
    It exits after a while without any."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def call(self, fn: Callable[[], object]) -> None:
        self.queue.put(fn)
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="pglock-callbacks",
                                               daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                fn = self.queue.get(timeout=_WORKER_IDLE)
            except queue.Empty:
                with self.lock:
                    if self.queue.empty():
                        self.thread = None
                        return
                continue
            try:
                fn()
            except Exception:
                logger.exception("a pglock callback raised")


def call_soon(fn: Callable[[], object]) -> None:
    """Run ``fn()`` in pglock's callback thread (its exceptions are logged)."""
    _callbacks.call(fn)


def register(item: Held) -> None:
    """Renew ``item`` from now on, and report its loss at its deadline."""
    _keepalive.register(item)
    if item._qkey is not None:
        _waiters.hold(item._qkey, item)


def unregister(item: Held, *, notified: bool = False) -> None:
    """Forget a grant that is no longer held; wake the local waiters of its name (unless its
    release ``notified`` them through a healthy listener)."""
    with _keepalive.lock:
        _keepalive.held.discard(item)
    if item._qkey is not None:
        _waiters.ended(item._qkey, item, notified=notified)


# --- the process-wide state (no thread runs until it is needed) -------------------------------

_keepalive = _Keepalive()
_waiters = _Waiters()
_callbacks = _Callbacks()


def shutdown() -> None:
    """Close what pglock opened for leases and semaphores in this process: the NOTIFY
    listeners and the connections kept per DSN string. Runs at exit; grants still held are not
    released (they expire). Later calls open what they need again."""
    with _waiters.lock:
        listeners, _waiters.listeners = list(_waiters.listeners.values()), {}
        for lst in listeners:  # each closes its connection within a tick
            lst.healthy = False
            lst.stopped = True
    close_dsn_sources()


atexit.register(shutdown)


def _after_fork_in_child() -> None:
    # Threads and connections do not survive a fork: the child starts from nothing, and the
    # parent's grants stay the parent's (the child must not renew or release them).
    global _keepalive, _waiters, _callbacks
    _keepalive = _Keepalive()
    _waiters = _Waiters()
    _callbacks = _Callbacks()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
