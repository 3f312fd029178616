"""Waiting for a TTL row: the process's waiter queues (first in, first out per name) and the
NOTIFY listeners that wake them (docs/how-it-works.md, "Leases and semaphores")."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from ._keys import remaining as _remaining
from ._source import Source, listen_deadline, open_listening

logger = logging.getLogger("pglock.ttl")

#: The longest sleep of a waiter between looks while its listener is up (jittered): a safety
#: net for releases that send no NOTIFY. While it is down, a jittered backoff (DEGRADED_POLL).
FALLBACK_POLL = (2.0, 4.0)
DEGRADED_POLL = (0.05, 1.0)
#: A listener with no waiters for this long closes its connection.
LISTENER_IDLE = 30.0
#: How often a listener looks up from its connection (idle check, stop requests).
_LISTENER_TICK = 0.5

Key = tuple[Any, ...]
#: A waiter's place in a queue: notified when it is its turn, or to look again.
Ticket = threading.Condition
#: An attempt's outcome: the grant (None: none), whether the database refused (rather than no
#: answer, or a grant too late), and when to look again (monotonic; None: at the next wake-up).
Attempt = tuple[Any, bool, float | None]
#: Whether close() ended a wait.
Closed = Callable[[], bool]


@dataclass(frozen=True)
class Rows:
    """One kind of TTL row, as the shared client needs to know it."""

    user: str  # "lease", "semaphore": the pglock.<user> logger, the messages
    channel: Callable[[str], str]  # the NOTIFY channel of its releases in a schema
    #: A wait queue looks once more when it first has a listener, not only on a new LISTEN.
    look_again_on_subscribe: bool = False

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(f"pglock.{self.user}")


class Handed(NamedTuple):
    """A grant a release (or a takeover) handed to a queued lease waiter of the database."""

    token: int
    waiter: int
    acquired_at: datetime
    expires_at: datetime


def parse_grant(payload: str) -> tuple[str, str] | None:
    """(name, holder) of a handoff NOTIFY (a JSON array that starts with ``"grant"``; revision
    0004), or None for a plain name (a release: look again). Any role may send either, on any
    channel, and two schemas' channels can coincide (:func:`._contract._channel`): a NOTIFY is
    only a hint to look, never a grant."""
    if not payload.startswith('["grant"'):
        return None
    try:
        _, name, holder, *_ = json.loads(payload)
    except (ValueError, TypeError):
        return None
    return (name, holder) if isinstance(name, str) and isinstance(holder, str) else None


class Slot:
    """A lease waiter of this process queued in the database: the grants handed to it (by
    waiter id, from a local release's answer) and a poke (heartbeat now: a NOTIFY's hint)."""

    __slots__ = ("cond", "grants", "hkey", "lined", "poked", "source", "waiter")

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)  # also its ticket in the name's process queue
        self.grants: dict[int, Handed] = {}
        self.poked = False
        self.lined = False
        self.waiter: int | None = None
        self.hkey: Key = ()  # (database, schema, name, holder): where grants find it
        self.source: object = None  # the key of the source it waits on


class _Queue:
    """The local waiters of one name (and owner), first in line first."""

    __slots__ = ("holder", "listening", "tickets", "version")

    def __init__(self) -> None:
        self.tickets: deque[Ticket] = deque()  # one per waiter, the head first
        self.version = 0  # bumped by every event that may have freed the name
        self.holder: Any = None  # a grant of this process on the name: the head waits for it
        self.listening = False  # the head has had a listener (Rows.look_again_on_subscribe)

    def wake_head(self) -> None:
        self.version += 1
        if self.tickets:
            self.tickets[0].notify()


class _Listener:
    """One LISTEN connection for a (source, schema, channel) and the thread that reads it;
    pools made with the same settings share it, under a key each (:attr:`keys`)."""

    def __init__(self, rows: Rows, source: Source, schema: str, deadline: float) -> None:
        self.rows = rows
        self.source = source
        self.channel = rows.channel(schema)
        self.key = (source.key, schema, self.channel)
        self.keys: tuple[Key, ...] = (self.key,)  # replaced whole: read without the lock
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
                        waiters.stop_listener_if_idle(self, idle_for=None)
                        continue
                    backoff = 0.1
                    waiters.wake_all(self.keys)  # releases may have gone unheard meanwhile
                try:
                    for n in conn.notifies(timeout=_LISTENER_TICK):
                        if n.channel == self.channel:
                            waiters.on_notify(self, n.payload)
                except Exception as exc:
                    self.rows.log.info("%s listener lost its connection (%r)", self.rows.user, exc)
                    self._drop()
                    waiters.wake_all(self.keys)
                    continue
                if waiters.has_waiters(self.keys):
                    idle_since = time.monotonic()
                else:
                    waiters.stop_listener_if_idle(self, time.monotonic() - idle_since)
        finally:
            self._drop()


class _Waiters:
    """The process's wait queues and NOTIFY listeners. A queue is keyed by ``(source key,
    schema, channel, name)`` and an owner: leases share one queue per name (owner None), each
    semaphore object has its own. A NOTIFY wakes the head of every queue of its name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[Key, dict[object, _Queue]] = {}
        self.waiting: Counter[Key] = Counter()  # tickets per listener key: is it still needed?
        self.listeners: dict[Key, _Listener] = {}
        self.listener_create = threading.Lock()
        self.rng = random.Random()
        #: Waiters queued in the database, by queue key and holder id.
        self.slots: dict[Key, dict[str, Slot]] = {}
        #: The same, by (database identity, schema, name, holder id): a release hands the lease
        #: to a waiter of this process whichever source (pool) that waiter uses.
        self.handed: dict[Key, Slot] = {}

    def expect(self, key: Key, holder: str, database: object) -> Slot:
        """A slot for the grants handed to ``holder`` waiting for the name of ``key`` (a
        source of ``database``)."""
        with self.lock:
            slot = self.slots.setdefault(key, {}).setdefault(holder, Slot(self.lock))
            slot.hkey, slot.source = (database, key[1], key[3], holder), key[0]
            self.handed[slot.hkey] = slot
            self.waiting[key[:3]] += 1
            return slot

    def line_up(self, key: Key, slot: Slot) -> None:
        """Once queued in the database, ``slot`` also takes its place in the name's process
        queue (the process's waiters of a name, in order: what inspection shows)."""
        with self.lock:
            if not slot.lined:
                owners = self.queues.setdefault(key, {})
                (owners.get(None) or owners.setdefault(None, _Queue())).tickets.append(slot.cond)
                slot.lined = True

    def unexpect(self, key: Key, holder: str) -> None:
        with self.lock:
            slots = self.slots.get(key, {})
            if (slot := slots.pop(holder, None)) is not None:
                if self.handed.get(slot.hkey) is slot:
                    del self.handed[slot.hkey]
                self.waiting[key[:3]] -= 1
                if not self.waiting[key[:3]]:
                    del self.waiting[key[:3]]
            if not slots:
                self.slots.pop(key, None)
            q = self.queues.get(key, {}).get(None)
            if slot is not None and slot.lined and q is not None:
                q.tickets.remove(slot.cond)
                if not q.tickets:
                    del self.queues[key][None]
                    if not self.queues[key]:
                        del self.queues[key]

    def hand(
        self, source: Any, schema: str, name: str, holder: str, grant: Handed
    ) -> None:
        """A grant handed to ``holder`` by a release on ``source`` whose answer this process read:
        its waiter takes it if it waits on that source; on another source of the same database
        as far as connection strings tell (two spellings, or two databases that look alike),
        the waiter is poked, and asks its own database."""
        with self.lock:
            if (slot := self.handed.get((source.database, schema, name, holder))) is not None:
                if slot.source == source.key:
                    slot.grants[grant.waiter] = grant
                else:
                    slot.poked = True
                slot.cond.notify()

    def await_grant(
        self, slot: Slot, waiter: int, until: float, closed: Closed
    ) -> Handed | None:
        """The grant handed to ``waiter``, or None once ``until`` passes, a poke or close()."""
        with self.lock:
            slot.waiter = waiter
            while (
                waiter not in slot.grants and not slot.poked and not closed()
                and (left := until - time.monotonic()) > 0
            ):
                slot.cond.wait(left)
            slot.poked = False
            return slot.grants.pop(waiter, None)

    def _poke(self, lkey: Key, name: str | None, holder: str | None = None) -> None:
        """With the lock held: the queued waiters of ``name`` (None: every name), or only that
        of ``holder``, heartbeat now."""
        for key, slots in self.slots.items():
            if key[:3] == lkey and (name is None or key[3] == name):
                for who, slot in slots.items():
                    if holder is None or who == holder:
                        slot.poked = True
                        slot.cond.notify()

    def enqueue(self, key: Key, owner: object) -> tuple[_Queue, Ticket]:
        with self.lock:
            owners = self.queues.setdefault(key, {})
            q = owners.get(owner) or owners.setdefault(owner, _Queue())
            ticket = Ticket(self.lock)
            q.tickets.append(ticket)
            self.waiting[key[:3]] += 1
            return q, ticket

    def dequeue(self, key: Key, owner: object, q: _Queue, ticket: Ticket) -> None:
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

    def wait_head(self, q: _Queue, ticket: Ticket, deadline: float | None, closed: Closed) -> bool:
        with self.lock:
            while q.tickets[0] is not ticket:
                if (left := _remaining(deadline)) == 0 or closed():
                    return False
                ticket.wait(left)
            return not closed()

    def sleep(self, q: _Queue, ticket: Ticket, seen: int, until: float, closed: Closed) -> bool:
        """Sleep until the queue's version moves on from ``seen`` (True), ``until`` passes or
        the wait is closed."""
        with self.lock:
            while q.version == seen and (left := until - time.monotonic()) > 0 and not closed():
                ticket.wait(left)
            return q.version != seen

    def on_notify(self, lst: _Listener, payload: str) -> None:
        # A handoff's NOTIFY wakes only the waiter it names, to ask the database (wait_v4);
        # not while a lease of this process holds the name: its release hands over from its
        # own answer (else the next heartbeat finds the grant).
        grant = parse_grant(payload)
        with self.lock:
            for lkey in lst.keys:
                queues = self.queues.get((*lkey, payload if grant is None else grant[0]), {})
                if grant is None:
                    for q in queues.values():
                        q.wake_head()
                    self._poke(lkey, payload)
                elif (shared := queues.get(None)) is None or shared.holder is None:
                    self._poke(lkey, *grant)

    def wake_all(self, lkeys: tuple[Key, ...]) -> None:
        with self.lock:
            for lkey in lkeys:
                self._poke(lkey, None)
                for q in [q for k, qs in self.queues.items() if k[:3] == lkey for q in qs.values()]:
                    q.wake_head()

    def hold(self, key: Key, holder: object) -> None:
        """A grant of this process holds the name of the shared queue ``key`` (if any)."""
        with self.lock:
            if (q := self.queues.get(key, {}).get(None)) is not None:
                q.holder = holder

    def ended(self, key: Key, holder: object, *, notified: bool) -> None:
        """A grant of this process on the name of the shared queue ``key`` ended: its waiters
        look again, unless a healthy listener will bring the release's NOTIFY."""
        with self.lock:
            if (q := self.queues.get(key, {}).get(None)) is None:
                return
            if q.holder is holder:
                q.holder = None
            lst = self.listeners.get(key[:3])
            if not (notified and lst is not None and lst.healthy):
                q.wake_head()

    def has_waiters(self, lkeys: tuple[Key, ...]) -> bool:
        with self.lock:
            return any(k in self.waiting for k in lkeys)

    def listener(
        self, rows: Rows, source: Source, schema: str, deadline: float
    ) -> tuple[_Listener | None, bool]:
        """The (source, schema) listener of ``rows``, started if needed: (listener, created
        now). A new one must be listening by ``deadline``; past it, waiters poll instead."""
        key = (source.key, schema, rows.channel(schema))
        if (lst := self.listeners.get(key)) is not None:
            return lst, False
        with self.listener_create:  # one connect at a time; the others find it made
            if (lst := self.listeners.get(key)) is not None:
                return lst, False
            if (lst := self._shared(source, key)) is not None:
                return lst, True  # new to this source: a release before now went unheard
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

    def _shared(self, source: Source, key: Key) -> _Listener | None:
        """A running listener of another pool with the same connection settings, now also
        this one's: one LISTEN connection (and one wake-up per NOTIFY) for them all."""
        if (same := _settings(source)) is None:
            return None
        with self.lock:
            for lst in self.listeners.values():
                if lst.key[1:] == key[1:] and _settings(lst.source) == same and not lst.stopped:
                    lst.keys = (*lst.keys, key)
                    self.listeners[key] = lst
                    return lst
        return None

    def stop_listener_if_idle(self, lst: _Listener, idle_for: float | None) -> None:
        """Stop ``lst`` if nobody waits (and, given ``idle_for``, for long enough): it closes
        its connection within a tick."""
        with self.lock:
            busy = any(k in self.waiting for k in lst.keys)
            if busy or (idle_for is not None and idle_for < LISTENER_IDLE):
                return
            for k in lst.keys:
                if self.listeners.get(k) is lst:
                    del self.listeners[k]
            lst.healthy = False
            lst.stopped = True

    def retire(self, lkey: Key) -> None:
        """Stop the listener of ``lkey`` now, if nobody waits."""
        if (lst := self.listeners.get(lkey)) is not None:
            self.stop_listener_if_idle(lst, idle_for=None)

    def fallback(self, lst: _Listener | None, polls: int) -> float:
        if lst is not None and lst.healthy:
            return self.rng.uniform(*FALLBACK_POLL)
        low, high = DEGRADED_POLL
        return self.rng.uniform(0.5, 1.0) * min(high, low * 2.0 ** min(polls, 30))


def _settings(source: Source) -> tuple[Any, ...] | None:
    """What a pool's connections are made with, when that is plain data (else None)."""
    pool: Any = getattr(source, "pool", None)
    kwargs = getattr(pool, "kwargs", None)
    conninfo = getattr(pool, "conninfo", None)
    if not isinstance(conninfo, str) or not isinstance(kwargs, (dict, type(None))):
        return None
    return pool.__class__, pool.connection_class, conninfo, repr(sorted((kwargs or {}).items()))


def wait(
    rows: Rows, source: Source, schema: str, name: str, owner: object, deadline: float | None,
    attempt: Callable[[float | None], Attempt],
    local_wake: Callable[[Any], float | None] | None = None, closed: Closed = lambda: False,
) -> Any:
    """Wait for a grant of ``name`` until ``deadline`` (monotonic; None: forever) or until
    ``closed()``: the grant of the first ``attempt`` that gives one, or None.

    The waiters of one queue (``owner`` None: the name's, shared) go first in, first out; only
    the head calls ``attempt(seconds left)``, and after a refusal sleeps until a NOTIFY, a local
    release, the instant the attempt named or a fallback poll. While a grant of this process
    holds the name, ``local_wake(holder)`` says when to look again (None: now)."""
    key = (source.key, schema, rows.channel(schema), name)
    q, ticket = waiters.enqueue(key, owner)
    try:
        if not waiters.wait_head(q, ticket, deadline, closed):
            return None
        listener: _Listener | None = None
        polls = 0
        while not closed():
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
                    listener, again = _listen(rows, q, listener, source, schema, deadline)
                    if again:
                        continue  # LISTEN is active now: look once more, then sleep
            if wake_at is None or local is None:
                polls += 1
                poll = time.monotonic() + waiters.fallback(listener, polls)
                wake_at = poll if wake_at is None else min(wake_at, poll)
            if deadline is not None:
                wake_at = min(wake_at, deadline)
            woken = waiters.sleep(q, ticket, seen, wake_at, closed)
            if not woken and deadline is not None and time.monotonic() >= deadline:
                return None
        return None
    finally:
        waiters.dequeue(key, owner, q, ticket)


def wake(key: Key | None, owner: object, *, head: bool = False) -> None:
    """Wake every waiter of the queue ``key`` of ``owner`` now (a close(): each asks whether it
    is closed), or with ``head`` its head, which looks again at once (a local release)."""
    with waiters.lock:
        if key is not None and not head:
            for slot in waiters.slots.get(key, {}).values():
                slot.cond.notify()
        if key is None or (q := waiters.queues.get(key, {}).get(owner)) is None:
            return
        if head:
            q.wake_head()
        else:
            for ticket in q.tickets:
                ticket.notify()


def listen(rows: Rows, source: Source, schema: str, deadline: float | None) -> None:
    """Make sure the (source, schema) listener of ``rows`` runs (before a waiter queues in the
    database, so that the NOTIFY of its grant cannot pass unheard); if it cannot, the
    waiters learn of grants from their heartbeats."""
    waiters.listener(rows, source, schema, listen_deadline(deadline))


def _listen(
    rows: Rows, q: _Queue, listener: _Listener | None, source: Source, schema: str,
    deadline: float | None,
) -> tuple[_Listener | None, bool]:
    """A refused head's NOTIFY listener, and whether to look once more before sleeping (a
    release sent before LISTEN was active went unheard)."""
    if listener is not None and listener.healthy:
        return listener, False
    lst, created = waiters.listener(rows, source, schema, listen_deadline(deadline))
    first = lst is not None and not q.listening
    q.listening = q.listening or lst is not None
    return lst, created or (first and rows.look_again_on_subscribe)


def stop_listeners() -> None:
    """Stop every listener now: each closes its connection within a tick."""
    with waiters.lock:
        listeners, waiters.listeners = list(waiters.listeners.values()), {}
        for lst in listeners:
            lst.healthy = False
            lst.stopped = True


#: The process's queues and listeners (a new set in a forked child: pglock._fork).
waiters = _Waiters()
