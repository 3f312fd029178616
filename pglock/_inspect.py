"""Introspection: who holds and waits for advisory locks (``pg_locks``, ``pg_stat_activity``,
the name registry; docs/how-it-works.md explains ``held_since``), and the semaphores."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg

from . import _conn, _sql
from ._contract import DEFAULT_SCHEMA, validate_schema
from ._keys import _key, normalize_names, validate_name
from .errors import SchemaNotInstalled

__all__ = ["AdvisoryLock", "SemaphoreHolder", "SemaphoreInfo", "advisory_locks", "semaphores"]

_MODES = {"ExclusiveLock": "exclusive", "ShareLock": "shared"}

# A call of any advisory-lock function (pglock's statements and hand-written ones).
# Session-level lock calls only: a transaction-level call may re-take a lock the session
# already held (one pg_locks row for both), so it does not date the lock.
_LOCK_CALL = re.compile(r"pg_(?:try_)?advisory_lock(?:_shared)?\"?\s*\(", re.IGNORECASE)
# pglock's fast path: a blocking lock call with the key as a parameter (granted, but which key?).
_PARAM_LOCK = re.compile(
    r"pg_advisory_(?:xact_)?lock(?:_shared)?\"?\s*\(\s*\$1\s*\)", re.IGNORECASE
)


@dataclass(frozen=True)
class AdvisoryLock:
    """One session holding, or waiting for, an advisory lock (one row of ``pg_locks``).

    Times are the server's clock; durations run to :attr:`observed_at`. Columns of
    ``pg_stat_activity`` are None for sessions of other roles unless the caller is a superuser
    or a member of ``pg_read_all_stats``. An immutable snapshot: can be shared between threads.
    """

    name: str | None
    """The name pglock took it by (the name registry installed); None for keys of other code."""
    key: int | None
    """The signed 64-bit key (``pglock.key(name)``); None for a lock taken with two int4 keys."""
    key_pair: tuple[int, int] | None
    """The two int4 keys of ``pg_advisory_lock(int, int)``; None for 64-bit keys."""
    mode: str
    """``"exclusive"`` or ``"shared"``."""
    granted: bool
    """True for a holder, False for a waiter."""
    pid: int | None
    """The backend pid of the session (None for a prepared transaction)."""
    application_name: str | None
    """The session's ``application_name``."""
    client_addr: str | None
    """The client's IP address, or None for a Unix-socket or background session."""
    client_port: int | None
    """The client's TCP port, or None."""
    user: str | None
    """The database role of the session."""
    backend_start: datetime | None
    """When the session started."""
    xact_start: datetime | None
    """Start of the session's open transaction, or None."""
    state: str | None
    """``active``, ``idle``, ``idle in transaction``, ..."""
    query: str | None
    """The session's current (``active``) or latest statement."""
    held_since: datetime | None
    """Lower bound of the grant time; see :attr:`held_since_basis` (None for waiters)."""
    held_since_basis: Literal["statement", "session"] | None
    """How :attr:`held_since` was derived: ``"statement"`` (the latest statement took the lock:
    exact) or ``"session"`` (the session start: :attr:`held_for` is an upper bound)."""
    waiting_since: datetime | None
    """When the waiter started waiting (``pg_locks.waitstart``, PostgreSQL 14+). None for holders,
    before PostgreSQL 14, and for a moment after the wait began (Postgres sets it lazily)."""
    blocked_by: tuple[int, ...]
    """For a waiter, the pids of the sessions it waits for (``pg_blocking_pids``)."""
    observed_at: datetime
    """The server's clock when this snapshot was taken."""

    @property
    def label(self) -> str:
        """The name when known, else the key (``key 123`` or ``keys (1, 2)``)."""
        if self.name is not None:
            return self.name
        if self.key is not None:
            return f"key {self.key}"
        return f"keys {self.key_pair}"

    @property
    def held_for(self) -> float | None:
        """Seconds since :attr:`held_since` (an upper bound for basis ``"session"``); None for
        waiters."""
        if self.held_since is None:
            return None
        return max(0.0, (self.observed_at - self.held_since).total_seconds())

    @property
    def waiting_for(self) -> float | None:
        """Seconds since :attr:`waiting_since`; None for holders."""
        if self.waiting_since is None:
            return None
        return max(0.0, (self.observed_at - self.waiting_since).total_seconds())


def advisory_locks(
    conn: object, name: str | Sequence[str] | None = None, *, schema: str = DEFAULT_SCHEMA
) -> list[AdvisoryLock]:
    """Who holds and who waits for advisory locks in ``conn``'s database.

    Locks are ordered by name (keys without a name last); for each lock, holders come first,
    then waiters in the order they started waiting. Reading ``pg_locks`` takes a snapshot of
    the server's lock table: cheap, but not for a tight loop.

    :param conn: a psycopg ``Connection`` (or a SQLAlchemy ``Connection``/``Session``); an idle
        connection is left idle.
    :param name: only this lock name (or these names); None lists every advisory lock.
    :param schema: the pglock schema whose name registry (``<schema>.lock_names``) gives the
        names, when pglock can trust it (docs/guarantees.md); otherwise every name is None.
    :returns: one :class:`AdvisoryLock` per holding or waiting session.
    :raises TypeError: ``conn``, ``name`` or ``schema`` has the wrong type.
    :raises ValueError: an invalid name or schema name.

    Example::

        for lock in pglock.advisory_locks(conn, "report:daily"):
            print(lock.label, lock.pid, lock.application_name, lock.granted, lock.held_for)
    """
    keys = None if name is None else [k for k, _ in normalize_names(name)]
    schema = validate_schema(schema)
    c = _conn.resolve(conn, "advisory_locks").conn
    waitstart = c.info.server_version >= 140000

    _conn.check_usable(c)
    with _conn.utf8(c):
        registry = _read(c, _sql.names_readable(schema))[0][0]
        rows = _read(c, _sql.advisory_locks(keys, names_schema=registry, waitstart=waitstart))
    return sorted(map(_advisory_lock, rows), key=lambda lk: (
        lk.name is None, lk.name or "", lk.key or 0, lk.key_pair or (0, 0), not lk.granted,
        lk.waiting_since or lk.observed_at, lk.pid or 0,
    ))


def _read(conn: psycopg.Connection[Any], stmt: Any) -> list[tuple[Any, ...]]:
    """The rows of one read-only statement (in binary: no session setting changes them); an
    idle connection is left idle (see ``alone`` in :func:`pglock._conn.fetch`)."""
    return _conn.fetch(conn, stmt, binary=True, alone=True)[0]


def _int4(v: int) -> int:
    return v - (1 << 32) if v >= (1 << 31) else v


def _key_in_query(query: str | None, key: int) -> bool:
    if not query or not _LOCK_CALL.search(query):
        return False
    return re.search(rf"(?<![0-9-]){key}(?![0-9])", query) is not None


def _latest_statement_took(
    query: str | None, key: int | None, pair: tuple[int, int] | None, held_by_pid: int,
    waiting: bool,
) -> bool:
    """Did the session's latest statement grant this lock? Yes when it calls a session-level
    advisory-lock function with this key written in it, or is a blocking lock call with the key
    as a parameter (pglock's fast path), this is the session's only advisory lock, and the call
    is not still waiting (then it waits for another lock: it granted none)."""
    if key is not None and _key_in_query(query, key):
        return True
    if pair is not None and _key_in_query(query, pair[0]) and _key_in_query(query, pair[1]):
        return True
    fast = query is not None and _PARAM_LOCK.search(query) is not None
    return held_by_pid == 1 and fast and not waiting


def _advisory_lock(row: tuple[Any, ...]) -> AdvisoryLock:
    (
        objsubid, classid, objid, name, mode, granted, pid, app, addr, port, user,
        backend_start, xact_start, query_start, state_change, state, wait_event_type,
        query, waitstart, blocking, now, held_by_pid,
    ) = row
    key = _int4(classid) * (1 << 32) + objid if objsubid == 1 else None
    pair = None if objsubid == 1 else (_int4(classid), _int4(objid))
    held_since: datetime | None = None
    basis: Literal["statement", "session"] | None = None
    if granted:
        took = _latest_statement_took(
            query, key, pair, held_by_pid, waiting=wait_event_type == "Lock"
        )
        if took and state == "active" and query_start is not None:
            held_since, basis = query_start, "statement"
        elif took and state is not None and state.startswith("idle") and state_change:
            held_since, basis = state_change, "statement"
        elif backend_start is not None:
            held_since, basis = backend_start, "session"
    if name is not None and (key is None or _key(name) != key):
        name = None  # a registry row (another role's, a bug's) that is not this lock's name
    return AdvisoryLock(
        name=name, key=key, key_pair=pair, mode=_MODES.get(mode, mode), granted=granted, pid=pid,
        application_name=app, client_addr=addr, client_port=port, user=user,
        backend_start=backend_start, xact_start=xact_start, state=state, query=query,
        held_since=held_since, held_since_basis=basis, waiting_since=None if granted else waitstart,
        blocked_by=tuple(blocking or ()), observed_at=now,
    )


@dataclass(frozen=True)
class SemaphoreHolder:
    """One live holder of a semaphore's permits.

    Instances are immutable snapshots and can be shared between threads.
    """

    holder: str
    """The holder id of this acquisition."""
    permits: int
    """How many permits it holds."""
    acquired_at: datetime
    expires_at: datetime
    expires_in: float
    """Seconds left before the permits expire (unless renewed), on the database clock."""
    metadata: Any
    """The JSON metadata stored with the permits, or None."""


@dataclass(frozen=True)
class SemaphoreInfo:
    """A semaphore as the database sees it: its stored limit and its live holders.

    Instances are immutable snapshots and can be shared between threads.
    """

    name: str
    limit: int
    """The limit stored by the first acquire."""
    held: int
    """The live permits held now (the sum over :attr:`holders`)."""
    waiters: bool
    """True when a refused acquire asked to be woken on release (someone waits, or waited)."""
    holders: tuple[SemaphoreHolder, ...]


def semaphores(
    conn: object, name: str | None = None, *, schema: str = DEFAULT_SCHEMA
) -> list[SemaphoreInfo]:
    """Every semaphore (or the one called ``name``) with its limit and live holders, by name.

    :param conn: a psycopg ``Connection`` (or a SQLAlchemy ``Connection``/``Session``); an idle
        connection is left idle.
    :param schema: the pglock schema (default ``pglock``).
    :raises pglock.SchemaNotInstalled: the database has no semaphore tables in ``schema``.
    :raises psycopg.errors.InsufficientPrivilege: the role may not read them (USAGE on the
        schema, SELECT on ``semaphore`` and ``semaphore_permit``).
    :raises TypeError, ValueError: bad arguments, before any SQL.

    Example::

        for sem in pglock.semaphores(conn):
            print(sem.name, f"{sem.held}/{sem.limit}", [h.holder for h in sem.holders])
    """
    if name is not None:
        name = validate_name(name)
    schema = validate_schema(schema)
    c = _conn.resolve(conn, "semaphores").conn

    _conn.check_usable(c)
    with _conn.utf8(c):
        if not _read(c, _sql.relations_exist(schema, ["semaphore", "semaphore_permit"]))[0][0]:
            raise SchemaNotInstalled.for_connection(c, schema)
        rows = _read(c, _sql.semaphores(schema, name))
    out: dict[str, tuple[int, bool, list[SemaphoreHolder]]] = {}
    for sem, limit, waiters, holder, permits, acquired, expires, metadata, expires_in in rows:
        entry = out.setdefault(sem, (limit, waiters, []))
        if holder is not None:
            entry[2].append(
                SemaphoreHolder(holder, permits, acquired, expires, max(0.0, expires_in), metadata)
            )
    return [
        SemaphoreInfo(sem, limit, sum(h.permits for h in hs), waiters, tuple(hs))
        for sem, (limit, waiters, hs) in out.items()
    ]
