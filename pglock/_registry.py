"""The name registry: which lock name each advisory-lock key stands for.

``pg_locks`` shows an advisory lock as two 32-bit halves of a 64-bit key; the name is lost in
the hash. When the pglock schema is installed, pglock records ``(key, name)`` in the table
``pglock.lock_names`` so that :func:`pglock.advisory_locks` and ``pglock status`` can show the
name.

Cost, by design:

* at most one registration per (process, database, key): a process-wide cache remembers what
  was sent (bounded: a process that touches more than :data:`MAX_CACHED` distinct keys may
  send a registration again, which finds the row and writes nothing);
* it rides in the same round trip as the lock statement that takes the key, after it, so a
  waiter never holds an uncommitted registry row while it waits for the lock;
* it never fails or slows the lock: the statement is a ``DO`` block that gives up after 1 ms
  of waiting on a concurrent registration (``lock_timeout``) and swallows every error; it
  skips SERIALIZABLE transactions, where an extra read could add a serialization failure to
  the caller's transaction;
* it is only sent when the connection's first pglock statement (the probe) found the table
  and the INSERT privilege: ``REVOKE INSERT ON pglock.lock_names FROM <role>`` turns it off.

Where, by design (issue 11 item 3): an INSERT runs the table's triggers and rules as the
locking role, so the registry is ``pglock.lock_names`` of the pglock schema and nothing else
(never a table found by name in another schema; the lock APIs take no schema, so the default
one), and only when the probe finds it to be pglock's own: a plain table with pglock's
comment, no trigger, rule or row security, owned by the owner of the schema, a role the
current role trusts (itself, a role it is a member of, a superuser, the database owner). The
check is :func:`pglock._sql._names_schema`; a database without the schema gets no
registration at all.
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

    def __bool__(self) -> bool:
        return bool(self.pairs)


_NOTHING = Registration(None, ())


def _database(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    info = conn.info
    return (info.host, info.port, info.dbname)


def pending(
    conn: psycopg.Connection[Any],
    state: ConnState,
    keys: Sequence[int],
    names: Sequence[str],
    *,
    own_transaction: bool = False,
) -> Registration:
    """The ``(key, name)`` pairs this process has not registered yet in ``conn``'s database
    (none when the registry is not installed or not writable there).

    ``own_transaction``: the statement will run in a transaction that pglock commits itself,
    so the registration may skip waiting for the WAL flush."""
    schema = state.registry
    if schema is None:
        return _NOTHING
    db = _database(conn)
    with _lock:
        pairs = tuple(
            (k, n) for k, n in zip(keys, names, strict=True) if (db, k) not in _seen
        )
    return Registration(schema, pairs, own_transaction)


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
    db = _database(conn)
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
