"""The name registry: ``(key, name)`` recorded once per (process, database, key) with the lock
statement, for ``advisory_locks()`` and ``pglock status`` (docs/how-it-works.md, "The name
registry"; docs/guarantees.md on when the table is trusted).
"""

from __future__ import annotations

import threading
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

_seen: OrderedDict[tuple[tuple[Any, ...], int], None] = OrderedDict()
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


def _database(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    return (conn.info.host, conn.info.port, conn.info.dbname)


def pending(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: Sequence[int],
    names: Sequence[str],
    *,
    own_transaction: bool = False,
) -> Registration:
    """The ``(key, name)`` pairs this process has not registered yet in ``conn``'s database
    (none without a writable registry); ``own_transaction``: pglock commits the statement's
    transaction itself, so the registration may skip waiting for the WAL flush."""
    schema = state.registry
    if schema is None:
        return _NOTHING
    db = state.database or _database(conn)
    with _lock:
        pairs = tuple(
            (k, n) for k, n in zip(keys, names, strict=True) if (db, k) not in _seen
        )
    return Registration(schema, pairs, own_transaction, db)


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
    """Forget every registration this process sent (tests; after the schema was reinstalled)."""
    with _lock:
        _seen.clear()
