"""The name registry: ``(key, name)`` recorded once per (process, database, key) with a lock
statement, for ``advisory_locks()`` and ``pglock status`` (docs/how-it-works.md, "The name
registry"; docs/guarantees.md on when the table is trusted). A process that meets new names
faster than :data:`RATE` per second queues them and sends them together (:data:`BATCH`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from . import _sql
from ._conn import ConnState

#: How many (database, key) pairs one process remembers as registered.
MAX_CACHED = 100_000
#: New names per second (and database) registered with their own lock statement; past that,
#: names wait in a queue that goes out with a later lock statement once it holds BATCH names
#: or its oldest has waited MAX_DELAY seconds.
RATE = 10.0
BATCH = 64
MAX_DELAY = 1.0

Database = tuple[Any, ...]
_seen: OrderedDict[tuple[Database, int], None] = OrderedDict()
_queued: dict[Database, dict[int, str]] = {}  # names waiting for a batch, per database
_since: dict[Database, float] = {}  # when the oldest of them was queued
_budget: dict[Database, tuple[float, float]] = {}  # (registrations left, at) per database
_lock = threading.Lock()


@dataclass(frozen=True)
class Registration:
    """Names to record with a lock statement; false when there is nothing to send."""

    schema: str | None
    pairs: tuple[tuple[int, str], ...]
    #: Sent in a transaction of pglock's own (not the caller's): commit it asynchronously.
    own_transaction: bool = False
    database: tuple[Any, ...] = ()  # (host, port, dbname) of the connection

    def __bool__(self) -> bool:
        return bool(self.pairs)


_NOTHING = Registration(None, ())


def _database(conn: psycopg.Connection[Any]) -> Database:
    return (conn.info.host, conn.info.port, conn.info.dbname)


def pending(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: Sequence[int],
    names: Sequence[str],
    *,
    own_transaction: bool = False,
    skip: bool = False,
) -> Registration:
    """The ``(key, name)`` pairs this process has not registered yet in ``conn``'s database
    (none without a writable registry); ``own_transaction``: pglock commits the statement's
    transaction itself, so the registration may skip waiting for the WAL flush. ``skip``: none
    now (in the caller's transaction on a session whose own timeouts could cut it and abort
    that transaction; a later statement of pglock's own sends them)."""
    schema = state.registry
    if schema is None or skip:
        return _NOTHING
    db = state.database or _database(conn)
    with _lock:
        new = [(k, n) for k, n in zip(keys, names, strict=True) if (db, k) not in _seen]
        if not new:
            return _NOTHING
        pairs = _due(db, new, time.monotonic())
    return Registration(schema, pairs, own_transaction, db) if pairs else _NOTHING


def _due(db: Database, new: list[tuple[int, str]], now: float) -> tuple[tuple[int, str], ...]:
    """Under ``_lock``: the pairs to send now (``new`` within the rate, or the whole queue
    once it is due), queueing the rest; sorted by key, as concurrent inserts must be."""
    queue = _queued.get(db)
    left, at = _budget.get(db, (RATE, now))
    left = min(RATE, left + (now - at) * RATE)
    if queue is None and left >= len(new):
        _budget[db] = (left - len(new), now)
        return tuple(sorted(new))
    _budget[db] = (left, now)
    if queue is None:
        queue = _queued[db] = {}
        _since[db] = now
    queue.update(new)
    if len(queue) < BATCH and now - _since[db] < MAX_DELAY:
        return ()
    del _queued[db], _since[db]
    return tuple(sorted(queue.items()))


def statement(registration: Registration) -> sql.Composed:
    """The registration statement (see :func:`pglock._sql.register_names`)."""
    assert registration.schema is not None
    return _sql.register_names(
        registration.schema, registration.pairs, asynchronous=registration.own_transaction
    )


def mark(conn: psycopg.Connection[Any], registration: Registration) -> None:
    """Remember that ``registration`` was sent for ``conn``'s database."""
    if not registration:
        return
    db = registration.database
    with _lock:
        for k, _ in registration.pairs:
            _seen[(db, k)] = None
            _seen.move_to_end((db, k))
        while len(_seen) > MAX_CACHED:
            _seen.popitem(last=False)


def clear() -> None:
    """Forget every registration this process sent or queued (tests; after the schema was
    reinstalled)."""
    with _lock:
        _seen.clear()
        _queued.clear()
        _since.clear()
        _budget.clear()
