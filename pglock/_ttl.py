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
import random
import shlex
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.pq import TransactionStatus

from . import _conn, _sql
from ._keys import remaining as _remaining
from ._source import Source, close_dsn_sources, count, listen_deadline, open_listening
from .errors import InvalidConnectionState, LockError, SchemaNotInstalled

logger = logging.getLogger("pglock.ttl")

H = TypeVar("H", bound="Held")

#: How long a waiter sleeps at most between looks at the database while its NOTIFY listener
#: is up (jittered): a safety net for releases that send no NOTIFY (a row deleted by hand).
FALLBACK_POLL = (2.0, 4.0)
#: The same while the listener is down: a jittered backoff from the first to the second value.
DEGRADED_POLL = (0.05, 1.0)
#: A listener with no waiters for this long closes its connection.
LISTENER_IDLE = 30.0
#: How often a listener looks up from its connection (idle check, stop requests).
_LISTENER_TICK = 0.5
#: The keepalive scheduler looks up at least this often (seconds), grants or not.
_KEEPALIVE_TICK = 5.0
#: A renewal worker (one per source and schema) with nothing to do for this long exits.
_WORKER_IDLE = 30.0
#: How many times a statement that failed with a serialization failure or a deadlock
#: (possible under a REPEATABLE READ or SERIALIZABLE default isolation) is sent again (in an
#: explicit READ COMMITTED transaction).
_RETRIES = 5

#: What an attempt returns: the grant (None: not granted), whether the database refused it
#: (rather than giving no answer, or a grant that came too late), and when to look again
#: (a ``time.monotonic()`` instant; None: at the next wake-up).
Attempt = tuple[Any, bool, float | None]


@dataclass(frozen=True)
class Rows:
    """One kind of TTL row, as the shared client needs to know it.

    :ivar user: who sends its statements (``"lease"``, ``"semaphore"``): the
        ``pglock.<user>`` logger and the messages.
    :ivar channel: the NOTIFY channel of its releases in a schema (the payload is the name).
    :ivar prefix: of its statement kinds in :data:`pglock._source.statements`.
    :ivar look_again_on_subscribe: after its first refusal, a wait queue looks once more when
        it first hears of its listener, not only when the LISTEN connection is new (what the
        semaphore client has always done: one more statement per wait).
    """

    user: str
    channel: Callable[[str], str]
    prefix: str = ""
    look_again_on_subscribe: bool = False

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(f"pglock.{self.user}")


# --- statements ----------------------------------------------------------------------------------

#: Rows of a statement's result.
Result = list[tuple[Any, ...]]


def run(
    rows: Rows,
    source: Source,
    kind: str,
    schema: str,
    query: bytes | sql.Composed,
    params: tuple[Any, ...] | None = None,
    *,
    binary: bool = False,
    timeout: float | None = None,
    deadline: float | None = None,
) -> tuple[Result, bool]:
    """Send one statement of ``rows`` on a connection of its own from ``source``; return its
    rows and whether it was sent a second time, on a new connection, because its connection
    died under it (:meth:`Source.run_once_more`: the caller's statements must be safe to send
    again).

    :param kind: which statement (``"acquire"``, ``"extend_many"``, ...): for the log, the
        messages and :data:`pglock._source.statements` (after :attr:`Rows.prefix`).
    :param params: the parameters of one statement; None: ``query`` is a batch with its values
        as literals and its own transaction control (``BEGIN ...; COMMIT``), sent as it is.
    :param binary: binary results (cheaper to parse for big batches).
    :param timeout: the longest wait for a pool connection.
    :param deadline: the ``time.monotonic()`` instant the statement is cut off at
        (:class:`NoAnswer`, a ``psycopg.OperationalError``: the outcome is unknown).
    :raises pglock.SchemaNotInstalled: the schema's objects are missing.
    """
    return source.run_once_more(
        lambda conn: execute(conn, rows, kind, schema, query, params, binary),
        rows.user, kind, timeout, deadline,
    )


def execute(
    conn: psycopg.Connection[Any],
    rows: Rows,
    kind: str,
    schema: str,
    query: bytes | sql.Composed,
    params: tuple[Any, ...] | None,
    binary: bool = False,
) -> Result:
    """One statement (or batch, see :func:`run`) in autocommit on ``conn``, restoring its
    autocommit setting; the rows of its last row-returning statement."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise InvalidConnectionState(
            f"the pool handed out a connection inside a transaction; pglock runs {rows.user} "
            "statements in their own transactions"
        )
    restore = not conn.autocommit
    if restore:
        conn.autocommit = True
    try:
        if params is None:
            count(rows.prefix + kind)
            return _batch(conn, query)
        return _with_retries(conn, rows, kind, query, params, binary)
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


def _batch(conn: psycopg.Connection[Any], query: bytes | sql.Composed) -> Result:
    """A batch in one round trip; one that failed inside its own transaction is rolled back."""
    try:
        results = _conn.fetch(conn, query)
    except psycopg.Error:
        _rollback(conn)
        raise
    return results[-1] if results else []


def _with_retries(
    conn: psycopg.Connection[Any],
    rows: Rows,
    kind: str,
    query: bytes | sql.Composed,
    params: tuple[Any, ...],
    binary: bool,
) -> Result:
    """One statement; sent again at READ COMMITTED (:func:`_read_committed`) when the session's
    own timeouts cut it short or its default isolation level failed it."""
    state = _conn.state_for(conn)
    for attempt in range(_RETRIES + 1):
        count(rows.prefix + kind)
        try:
            if attempt == 0 and not state.session_timeouts:
                return _conn.fetch(conn, query, params, binary=binary)[0]
            return _read_committed(conn, rows, query, params, binary)
        except (pg_errors.QueryCanceled, pg_errors.LockNotAvailable):
            # The session's own statement_timeout or lock_timeout (ALTER ROLE app SET
            # statement_timeout = '300ms') must not end a wait of pglock's: sent again with
            # them off (LEASE_RETRY_BEGIN), and so from now on on this connection. With
            # none set it was a cancel, which stands.
            if attempt or state.session_timeouts or not _session_timeouts(conn):
                raise
            state.session_timeouts = True
        except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected) as exc:
            # Under a REPEATABLE READ or SERIALIZABLE default isolation, concurrent statements
            # fail this way (the functions are written for READ COMMITTED, where they follow
            # concurrent changes). Each is its own transaction, rolled back whole: it is sent
            # again at READ COMMITTED, where only a deadlock can fail it again. Retrying at
            # the default level could fail every time under contention between processes.
            if attempt == _RETRIES or conn.info.transaction_status != TransactionStatus.IDLE:
                raise
            rows.log.debug(
                "%s statement %r: %s; sending it again at READ COMMITTED",
                rows.user, kind, type(exc).__name__,
            )
            if attempt or isinstance(exc, pg_errors.DeadlockDetected):
                time.sleep(random.uniform(0.001, 0.005) * (attempt + 1))
    raise AssertionError("unreachable")


def _session_timeouts(conn: psycopg.Connection[Any]) -> bool:
    """Does the session of ``conn`` (idle, autocommit) have a statement or lock timeout?"""
    if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
        return False
    return bool(_conn.fetch(conn, _sql.SESSION_TIMEOUTS)[0][0][0])


def _read_committed(
    conn: psycopg.Connection[Any],
    rows: Rows,
    query: bytes | sql.Composed,
    params: tuple[Any, ...],
    binary: bool,
) -> Result:
    """``query`` in an explicit READ COMMITTED transaction on the autocommit ``conn``, the
    session's timeouts off: three round trips, only for a statement that already failed at the
    session's default level, or on a session with timeouts of its own."""
    count(rows.prefix + "retry_read_committed")
    _conn.fetch(conn, _retry_sql("begin"))
    try:
        found = _conn.fetch(conn, query, params, binary=binary)[0]
        _conn.fetch(conn, _retry_sql("commit"))
        return found
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """Roll back the transaction a failed statement left open on ``conn``, if any."""
    if not (conn.closed or conn.broken) and (
        conn.info.transaction_status != TransactionStatus.IDLE
    ):
        try:
            _conn.fetch(conn, _retry_sql("rollback"))
        except psycopg.Error:
            logger.debug("rolling back a failed statement failed", exc_info=True)


@lru_cache(maxsize=4)
def _retry_sql(which: str) -> bytes:
    stmt: sql.SQL = getattr(_sql, f"LEASE_RETRY_{which.upper()}")
    return stmt.as_bytes(None)


def translate(
    exc: psycopg.Error, conn: psycopg.Connection[Any], schema: str
) -> Exception | None:
    """The pglock error for a Postgres error of a TTL-row statement, by SQLSTATE (None: it
    passes unchanged)."""
    if isinstance(
        exc, (pg_errors.UndefinedFunction, pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)
    ):
        return schema_not_installed(conn, schema)
    if isinstance(exc, pg_errors.SequenceGeneratorLimitExceeded):
        return LockError(
            f"the fencing-token sequence {schema}.lease_token is exhausted (it never cycles, "
            "so no token is ever handed out twice); tokens cannot be issued any more"
        )
    return None


def schema_not_installed(conn: psycopg.Connection[Any], schema: str) -> SchemaNotInstalled:
    """The error for a database without the pglock schema, with the exact install command."""
    try:
        dsn = conn.info.dsn  # libpq leaves the password out
        db = conn.info.dbname
    except Exception:
        dsn, db = "<your DSN>", "?"
    command = f"pglock install --dsn {shlex.quote(dsn)} --schema {schema}"
    return SchemaNotInstalled(
        schema,
        message=(
            f"the pglock schema {schema!r} is not installed (or is out of date) in database "
            f"{db!r}; install it with: {command}  (or include pglock's migrations in your "
            "Alembic and run 'alembic upgrade pglock@head')"
        ),
    )


# --- waiter queues and NOTIFY listeners ---------------------------------------------------------


class _Ticket:
    """One waiter's place in a queue; its condition is made only if it has to wait."""

    __slots__ = ("_cond", "lock")

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self._cond: threading.Condition | None = None

    @property
    def cond(self) -> threading.Condition:
        if self._cond is None:
            self._cond = threading.Condition(self.lock)
        return self._cond

    def notify(self) -> None:
        if self._cond is not None:  # nobody waits on a condition that was never made
            self._cond.notify()


class _Queue:
    """The local waiters of one name (and owner), first in line first."""

    __slots__ = ("holder", "listening", "tickets", "version")

    def __init__(self) -> None:
        self.tickets: deque[_Ticket] = deque()
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

    def __init__(
        self, waiters: _Waiters, rows: Rows, source: Source, schema: str, deadline: float
    ) -> None:
        self.waiters = waiters
        self.rows = rows
        self.source = source
        self.channel = rows.channel(schema)
        self.key = (source.key, schema, self.channel)
        self.healthy = False
        self.stopped = False
        self.conn: psycopg.Connection[Any] | None = None
        self._close: Callable[[], None] | None = None
        # In the caller's thread: LISTEN is active before it tries again.
        self._connect(deadline)
        self.thread = threading.Thread(
            target=self._run, name=f"pglock-{rows.user}-listener-{schema}", daemon=True
        )

    def _connect(self, deadline: float) -> None:
        count(self.rows.prefix + "listen")
        self.conn, self._close = open_listening(self.source, self.channel, deadline)
        self.healthy = True

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
        backoff = 0.1
        idle_since: float | None = None
        waiters = self.waiters
        try:
            while not self.stopped:
                if self.conn is None:
                    try:
                        self._connect(listen_deadline(None))
                        backoff = 0.1
                        # Releases may have gone unheard while the connection was down.
                        waiters.wake_all(self.key)
                    except Exception as exc:
                        self.rows.log.debug("%s listener reconnect failed: %r", self.rows.user, exc)
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                        waiters.stop_listener_if_idle(self, idle_for=None)
                        continue
                conn = self.conn
                assert conn is not None
                try:
                    for n in conn.notifies(timeout=_LISTENER_TICK):
                        if n.channel == self.channel:
                            waiters.on_notify(self.key, n.payload)
                except Exception as exc:
                    self.rows.log.info(
                        "%s listener lost its connection (%r); waiters poll", self.rows.user, exc
                    )
                    self._drop()
                    waiters.wake_all(self.key)
                    continue
                now = time.monotonic()
                if waiters.has_waiters(self.key):
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                else:
                    waiters.stop_listener_if_idle(self, idle_for=now - idle_since)
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
        self.queues: dict[tuple[Any, ...], dict[object, _Queue]] = {}
        #: Tickets waiting, per (source key, schema, channel): is its listener still needed?
        self.waiting: Counter[tuple[Any, ...]] = Counter()
        self.listeners: dict[tuple[Any, ...], _Listener] = {}
        self.listener_create = threading.Lock()
        self.rng = random.Random()

    # -- queues -------------------------------------------------------------------------------

    def enqueue(self, key: tuple[Any, ...], owner: object) -> tuple[_Queue, _Ticket]:
        with self.lock:
            owners = self.queues.setdefault(key, {})
            q = owners.get(owner)
            if q is None:
                q = owners[owner] = _Queue()
            ticket = _Ticket(self.lock)
            q.tickets.append(ticket)
            self.waiting[key[:3]] += 1
            return q, ticket

    def dequeue(self, key: tuple[Any, ...], owner: object, q: _Queue, ticket: _Ticket) -> None:
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
            owners = self.queues.get(key)
            if not q.tickets and owners is not None and owners.get(owner) is q:
                del owners[owner]
                if not owners:
                    del self.queues[key]

    def wait_head(self, q: _Queue, ticket: _Ticket, deadline: float | None) -> bool:
        with self.lock:
            while q.tickets[0] is not ticket:
                left = _remaining(deadline)
                if left == 0:
                    return False
                ticket.cond.wait(left)
            return True

    def sleep(self, q: _Queue, ticket: _Ticket, seen: int, until: float) -> bool:
        """Sleep until the queue's version moves on from ``seen`` (True) or ``until`` passes."""
        with self.lock:
            while q.version == seen:
                left = until - time.monotonic()
                if left <= 0:
                    break
                ticket.cond.wait(left)
            return q.version != seen

    def _wake(self, queues: Iterable[_Queue]) -> None:
        for q in queues:
            q.wake_head()

    def on_notify(self, lkey: tuple[Any, ...], name: str) -> None:
        with self.lock:
            self._wake(self.queues.get((*lkey, name), {}).values())

    def wake_all(self, lkey: tuple[Any, ...]) -> None:
        with self.lock:
            for key, owners in self.queues.items():
                if key[:3] == lkey:
                    self._wake(owners.values())

    def poke(self, key: tuple[Any, ...], owner: object) -> None:
        """Wake the head of one queue (a local release)."""
        with self.lock:
            q = self.queues.get(key, {}).get(owner)
            if q is not None:
                q.wake_head()

    def hold(self, key: tuple[Any, ...], holder: object) -> None:
        """A grant of this process holds the name of the shared queue ``key`` (if any)."""
        with self.lock:
            q = self.queues.get(key, {}).get(None)
            if q is not None:
                q.holder = holder

    def ended(self, key: tuple[Any, ...], holder: object, *, notified: bool = False) -> None:
        """A grant of this process on the name of the shared queue ``key`` ended: its waiters
        look again, unless the release sent a NOTIFY that a healthy listener will bring."""
        with self.lock:
            q = self.queues.get(key, {}).get(None)
            if q is None:
                return
            if q.holder is holder:
                q.holder = None
            lst = self.listeners.get(key[:3])
            if notified and lst is not None and lst.healthy:
                # Waking them now as well would make the next one ask again, needlessly,
                # after the handoff.
                return
            q.wake_head()

    def has_waiters(self, lkey: tuple[Any, ...]) -> bool:
        with self.lock:
            return lkey in self.waiting

    # -- listeners ----------------------------------------------------------------------------

    def listener(
        self, rows: Rows, source: Source, schema: str, deadline: float
    ) -> tuple[_Listener | None, bool]:
        """The (source, schema) listener of ``rows``, started if needed: (listener, created
        now). A new one must be listening by ``deadline`` (:func:`listen_deadline`); past it,
        waiters poll instead."""
        key = (source.key, schema, rows.channel(schema))
        with self.lock:
            lst = self.listeners.get(key)
            if lst is not None:
                return lst, False
        with self.listener_create:
            with self.lock:
                lst = self.listeners.get(key)
                if lst is not None:
                    return lst, False
            try:
                lst = _Listener(self, rows, source, schema, deadline)
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
        """Stop ``lst`` if nobody waits (and, given ``idle_for``, for long enough)."""
        with self.lock:
            busy = lst.key in self.waiting
            if busy or (idle_for is not None and idle_for < LISTENER_IDLE):
                return
            if self.listeners.get(lst.key) is lst:
                del self.listeners[lst.key]
            lst.healthy = False
            lst.stopped = True

    def retire(self, lkey: tuple[Any, ...]) -> None:
        """Stop the listener of ``lkey`` now if nobody waits (it closes within a tick)."""
        with self.lock:
            lst = self.listeners.get(lkey)
        if lst is not None:
            self.stop_listener_if_idle(lst, idle_for=None)

    def shutdown(self) -> None:
        """Stop every listener (each closes its connection within a tick)."""
        with self.lock:
            listeners, self.listeners = list(self.listeners.values()), {}
            for lst in listeners:
                lst.healthy = False
                lst.stopped = True

    def fallback(self, lst: _Listener | None, polls: int) -> float:
        if lst is not None and lst.healthy:
            return self.rng.uniform(*FALLBACK_POLL)
        low, high = DEGRADED_POLL
        return self.rng.uniform(0.5, 1.0) * min(high, low * 2.0 ** min(polls, 30))


def wait(
    rows: Rows,
    source: Source,
    schema: str,
    name: str,
    owner: object,
    deadline: float | None,
    attempt: Callable[[float | None], Attempt],
    local_wake: Callable[[Any], float | None] | None = None,
) -> Any:
    """Wait for a grant of ``name`` until ``deadline`` (monotonic; None: forever): the grant
    of the first ``attempt`` that gives one, or None.

    The waiters of one queue go first in, first out, and only the head calls
    ``attempt(seconds left)``. After a refusal it LISTENs for the releases of ``rows`` on the
    source and schema, and sleeps until a NOTIFY for the name, a local release, the instant
    the attempt named, or a jittered fallback poll. While a grant of this process holds the
    name, ``local_wake(holder)`` says when to look again (None: now) and nothing is polled.
    """
    waiters = _waiters_()
    key = (source.key, schema, rows.channel(schema), name)
    q, ticket = waiters.enqueue(key, owner)
    try:
        if not waiters.wait_head(q, ticket, deadline):
            return None
        listener: _Listener | None = None
        polls = 0
        while True:
            with waiters.lock:
                seen, local = q.version, q.holder
            wake_at = None if local_wake is None else local_wake(local)
            if wake_at is None or wake_at <= time.monotonic():
                granted, refused, wake_at = attempt(_remaining(deadline))
                if granted is not None:
                    return granted
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                if refused:
                    listener, again = _listen(waiters, rows, q, listener, source, schema, deadline)
                    if again:
                        continue  # LISTEN is active now: look once more, then sleep
                if wake_at is None:
                    wake_at = math.inf
            if local is None or math.isinf(wake_at):
                polls += 1
                wake_at = min(wake_at, time.monotonic() + waiters.fallback(listener, polls))
            if deadline is not None:
                wake_at = min(wake_at, deadline)
            woken = waiters.sleep(q, ticket, seen, wake_at)
            if not woken and deadline is not None and time.monotonic() >= deadline:
                return None
    finally:
        waiters.dequeue(key, owner, q, ticket)


def _listen(
    waiters: _Waiters,
    rows: Rows,
    q: _Queue,
    listener: _Listener | None,
    source: Source,
    schema: str,
    deadline: float | None,
) -> tuple[_Listener | None, bool]:
    """A refused head's NOTIFY listener, and whether to look once more before sleeping (a
    release sent before LISTEN was active went unheard)."""
    if listener is not None and listener.healthy:
        return listener, False
    lst, created = waiters.listener(rows, source, schema, listen_deadline(deadline))
    first = lst is not None and not q.listening
    if lst is not None:
        q.listening = True
    return lst, created or (first and rows.look_again_on_subscribe)


# --- the keepalive -------------------------------------------------------------------------------


class Held:
    """A grant that the keepalive renews: a lease handle, a semaphore permit.

    A subclass sets ``_lock`` (guarding the fields below), ``_source`` and ``_schema`` (where
    it renews), ``_group`` (``(source key, schema)``: its renewal worker), ``_ttl``, and
    ``_sent_at``/``_deadline`` (``time.monotonic()``: the last successful grant or renewal was
    sent then, and is believed until then); ``_qkey`` is the shared wait queue of the name it
    holds (None: none). It implements :meth:`_live`, :meth:`_lose` and :meth:`_renew_batch`.
    """

    _lock: threading.Lock
    _source: Source
    _schema: str
    _group: tuple[Any, ...]
    _ttl: float
    _sent_at: float
    _deadline: float
    _qkey: tuple[Any, ...] | None = None
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
        """Declare it lost (once): stop renewing it (:func:`unregister`), log, tell the user."""
        raise NotImplementedError

    @classmethod
    def _renew_batch(cls: type[H], items: list[H]) -> None:
        """Renew ``items`` (all of this class, one source and schema) in one statement, and
        apply its answer; a failure calls :meth:`_renew_failed`."""
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
    """The grants held in the process and their renewal.

    A scheduler thread and one worker thread per (source, schema). The scheduler never sends a
    statement: it hands due grants to their group's worker in one batch, and declares a grant
    lost at its client deadline, whether or not a renewal of it is still running (a silent
    network may hold one until its statement deadline). A worker sends one batch at a time, one
    statement per kind of grant; a group whose worker is busy gets its next batch when the
    worker is done, without holding up any other group.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # the scheduler sleeps on it
        self.held: set[Held] = set()
        self.thread: threading.Thread | None = None
        #: When the sleeping scheduler wakes next (-inf while it is awake).
        self.next_wake = -math.inf
        #: Renewal workers per (source key, schema).
        self.workers: dict[tuple[Any, ...], _Worker] = {}

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

    def unregister(self, item: Held) -> None:
        with self.lock:
            self.held.discard(item)

    def _run(self) -> None:
        while True:
            try:
                self._schedule()
            except Exception:  # a bug here must not stop every renewal in the process
                logger.exception("pglock's keepalive failed; it goes on")
                time.sleep(0.1)

    def _schedule(self) -> None:
        """The scheduler's loop: losses at their deadline, batches to the workers, sleep."""
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
                    wake_at = min(wake_at, now + _KEEPALIVE_TICK)
                    self.next_wake = wake_at
                    self.cond.wait(max(0.0, wake_at - now))
                    self.next_wake = -math.inf  # awake: it rescans before sleeping again
                    continue
            for item in lost:
                item._lose("its TTL ran out before a renewal succeeded")

    def _scan(self, now: float) -> tuple[list[Held], dict[tuple[Any, ...], list[Held]], float]:
        """With the lock held: the grants past their deadline, the renewal batches due now
        (marked as renewing), and when to look again."""
        lost: list[Held] = []
        wake_at = math.inf
        due_groups: set[tuple[Any, ...]] = set()
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
        batches: dict[tuple[Any, ...], list[Held]] = {}
        if due_groups:
            for item in self.held:
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

    def _dispatch(self, group: tuple[Any, ...], items: list[Held]) -> None:
        """With the lock held: hand a batch to its group's worker (started if needed)."""
        worker = self.workers.get(group)
        if worker is None:
            worker = self.workers[group] = _Worker(self.lock)
        worker.batches.append(items)
        if worker.thread is None:
            worker.thread = threading.Thread(
                target=self._work,
                args=(group, worker),
                name=f"pglock-renewal-{group[1]}",
                daemon=True,
            )
            worker.thread.start()
        else:
            worker.cond.notify()

    def _work(self, group: tuple[Any, ...], worker: _Worker) -> None:
        """A worker's loop: renew its group's batches; exit after a while without any."""
        while True:
            with self.lock:
                while not worker.batches:
                    if not worker.cond.wait(_WORKER_IDLE) and not worker.batches:
                        worker.thread = None
                        if self.workers.get(group) is worker:
                            del self.workers[group]
                        return
                items = worker.batches.popleft()
            try:
                self._renew(items)
            finally:
                with self.lock:
                    for item in items:
                        item._renewing = False
                    self.cond.notify()  # the scheduler looks again: due times moved

    @staticmethod
    def _renew(items: list[Held]) -> None:
        """One statement per kind of grant in the batch."""
        kinds: dict[type[Held], list[Held]] = {}
        for item in items:
            kinds.setdefault(type(item), []).append(item)
        for kind, batch in kinds.items():
            try:
                kind._renew_batch(batch)
            except Exception:  # a bug here must not stop the group's renewals
                logger.exception("pglock's renewal of %s failed; it goes on", kind.__name__)


def register(item: Held) -> None:
    """Renew ``item`` from now on, and report its loss at its deadline."""
    _keepalive_().register(item)
    if item._qkey is not None:
        _waiters_().hold(item._qkey, item)


def unregister(item: Held, *, notified: bool = False) -> None:
    """Forget a grant that is no longer held; wake the local waiters of its name (unless its
    release ``notified`` them through a healthy listener)."""
    _keepalive_().unregister(item)
    if item._qkey is not None:
        _waiters_().ended(item._qkey, item, notified=notified)


# --- the process-wide state ---------------------------------------------------------------------

_state_lock = threading.Lock()
_the_waiters: _Waiters | None = None
_the_keepalive: _Keepalive | None = None


def _keepalive_() -> _Keepalive:
    global _the_keepalive
    k = _the_keepalive
    if k is None:
        with _state_lock:
            if _the_keepalive is None:
                _the_keepalive = _Keepalive()
            k = _the_keepalive
    return k


def _waiters_() -> _Waiters:
    global _the_waiters
    w = _the_waiters
    if w is None:
        with _state_lock:
            if _the_waiters is None:
                _the_waiters = _Waiters()
            w = _the_waiters
    return w


def shutdown() -> None:
    """Close what pglock opened for leases and semaphores in this process: the NOTIFY
    listeners and the connections kept per DSN string. Runs at exit; grants still held are not
    released (they expire). Later calls open what they need again."""
    w = _the_waiters
    if w is not None:
        w.shutdown()
    close_dsn_sources()


atexit.register(shutdown)


def _after_fork_in_child() -> None:
    # Threads and connections do not survive a fork: the child starts from nothing, and the
    # parent's grants stay the parent's (the child must not renew or release them).
    global _the_keepalive, _the_waiters, _state_lock
    _the_keepalive = None
    _the_waiters = None
    _state_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
