"""Lease statements and rows (each row a named tuple), ``guard()``'s statement in the caller's
transaction, and the introspection of leases: :class:`LeaseInfo`, :func:`lease_info`,
:func:`list_leases`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple

import psycopg
from psycopg.pq import TransactionStatus

from . import _conn, _sql, _ttl
from ._classify import HELD, SOURCES, classify
from ._contract import DEFAULT_SCHEMA, lease_channel, validate_schema
from ._keys import exact, validate_name
from ._source import SHORT_DEADLINE, Source, short_deadline
from ._source import make_source as _make_source
from .errors import InvalidConnectionState, SchemaNotInstalled

LEASES = _ttl.Rows("lease", lease_channel)

#: Per (source key, schema): until when (monotonic) its schema is known to lack revision
#: 0004's queue. Its ``_v4`` functions are tried first; where they are missing, the 0001 ones
#: are used, and tried again after this long (an upgrade is then picked up).
_NO_QUEUE: dict[tuple[Any, ...], float] = {}
NO_QUEUE_RECHECK = 60.0


class NoQueue(Exception):
    """The schema has no revision 0004 (no lease waiter queue): use the 0001 functions."""


class Grant(NamedTuple):
    """An acquire's row, with when it was sent and answered (``time.monotonic()``)."""

    granted: bool
    holder: str | None
    token: int | None
    acquired_at: datetime | None
    expires_at: datetime | None
    server_time: datetime | None
    sent: float
    received: float
    waiter: int | None = None  # acquire_v4: queued with this waiter id (not granted)


class Renewal(NamedTuple):
    """An ``extend`` row."""

    token: int
    acquired_at: datetime
    expires_at: datetime
    metadata: Any


class Due(NamedTuple):
    """A held lease, as its renewal needs it."""

    name: str
    holder: str
    token: int
    ttl: float
    gen: int
    deadline: float
    durable: bool


@dataclass(frozen=True)
class LeaseInfo:
    """A live lease as the database sees it (from :func:`lease_info`, :func:`list_leases`).

    :ivar expires_in: seconds left at the time of the query, on the database clock.
    """

    name: str
    holder: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    metadata: Any
    expires_in: float


@lru_cache(maxsize=64)
def stmt(kind: str, schema: str) -> bytes:
    return _sql.lease_statement(kind, schema).as_bytes(None)


def run(
    source: Source, kind: str, schema: str, params: tuple[Any, ...],
    timeout: float | None = None, deadline: float | None = None,
) -> list[tuple[Any, ...]]:
    """Send one lease statement and return its rows (see :func:`run_once_more`)."""
    return run_once_more(source, kind, schema, params, timeout, deadline)[0]


def run_once_more(
    source: Source, kind: str, schema: str, params: tuple[Any, ...],
    timeout: float | None = None, deadline: float | None = None,
) -> tuple[list[tuple[Any, ...]], bool]:
    """Send one lease statement; return its rows and whether it was sent a second time
    (:func:`_ttl.run`). That is safe: every lease statement is idempotent per holder (an
    acquire by the same holder keeps the token; extend and release name holder and token; a
    waiter queues once per holder). A ``_v4`` kind raises :class:`NoQueue` where the schema
    has no revision 0004."""
    v4 = kind.endswith("_v4")
    if v4 and _NO_QUEUE.get((source.key, schema), -1.0) > time.monotonic():
        raise NoQueue
    try:
        return _ttl.run(  # logged by its name: "acquire", "release", "wait", "leave"
            LEASES, source, kind.removesuffix("_v4"), schema, stmt(kind, schema), params,
            binary=kind == "extend_many", timeout=timeout, deadline=deadline,
            libpq=kind != "extend_many",  # scalar parameters
        )
    except SchemaNotInstalled as exc:
        if not v4:
            _NO_QUEUE.pop((source.key, schema), None)  # no schema at all: nothing to remember
            raise
        _NO_QUEUE[(source.key, schema)] = time.monotonic() + NO_QUEUE_RECHECK
        raise NoQueue from exc


def has_queue(source: Source, schema: str) -> bool:
    """False while ``schema`` is known to lack revision 0004 (see :data:`_NO_QUEUE`)."""
    return _NO_QUEUE.get((source.key, schema), -1.0) <= time.monotonic()


def renew_many(
    source: Source, schema: str, due: list[Due], sent: float
) -> dict[tuple[str, int], datetime]:
    """One ``extend_many`` for ``due`` leases (of a source and schema), sent at ``sent``: the
    new expiry of each (name, token) renewed; the others are no longer held."""
    # Waiting longer than the earliest deadline would only hide a loss; an answer after it is
    # cut off (a silent network must not hold the worker past it).
    wait = max(0.05, min(d.deadline for d in due) - sent)
    params = (
        [d.name for d in due], [d.holder for d in due], [d.token for d in due],
        [d.ttl for d in due], any(d.durable for d in due), wait,
    )
    rows = run(source, "extend_many", schema, params, timeout=wait, deadline=sent + wait)
    return {(name, token): expires_at for name, token, expires_at in rows}


def make_source(source: object) -> Source:
    """Resolve a lease source without sending any SQL (:func:`pglock._source.make_source`)."""
    return _make_source(source, "lease")


def _query(target: object, kind: str, schema: str, params: tuple[Any, ...]) -> _ttl.Result:
    """Run a read-only lease query on a source (pool, engine, DSN) or a caller's connection."""
    api = "lease_info" if kind == "info" else "list_leases"
    if classify(target, HELD | SOURCES, api=api) not in HELD:
        deadline = time.monotonic() + SHORT_DEADLINE[1]
        return run(make_source(target), kind, schema, params, deadline=deadline)
    pg = _conn.resolve(target, api).conn
    _conn.check_usable(pg)
    try:
        # Outside a transaction it runs in one of its own: an idle connection is left idle.
        with _conn.utf8(pg):
            return _conn.fetch(pg, stmt(kind, schema), params, libpq=True, alone=True)[0]
    except psycopg.Error as exc:
        _ttl.raise_translated(exc, pg, schema)


def info_row(row: tuple[Any, ...]) -> LeaseInfo:
    name, holder, token, acquired_at, expires_at, metadata, expires_in = row
    return LeaseInfo(name, holder, token, acquired_at, expires_at, metadata, float(expires_in))


def lease_info(conn: object, name: str, *, schema: str = DEFAULT_SCHEMA) -> LeaseInfo | None:
    """The live lease on ``name``, or None when nobody holds it (free or expired).

    :param conn: a psycopg ``Connection`` or SQLAlchemy ``Connection``/``Session`` (read in its
        transaction if one is open; an idle connection is left idle), or a lease source (pool,
        engine, DSN).
    :raises pglock.SchemaNotInstalled: the database has no lease schema.

    Example::

        info = pglock.lease_info(conn, "job:123")
        if info is not None:
            print(info.holder, info.token, info.expires_in)
    """
    name = validate_name(name)
    schema = validate_schema(schema)
    rows = _query(conn, "info", schema, (name,))
    return info_row(rows[0]) if rows else None


def list_leases(
    conn: object, *, prefix: str | None = None, schema: str = DEFAULT_SCHEMA
) -> list[LeaseInfo]:
    """Every live lease (name, holder, token, acquired_at, expires_at, metadata, expires_in),
    sorted by name; only names starting with ``prefix`` if given.

    :param conn: as for :func:`lease_info`.
    :raises pglock.SchemaNotInstalled: the database has no lease schema.
    """
    if prefix is not None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str or None, not {type(prefix).__name__}")
        if "\x00" in (prefix := exact(prefix)):
            raise ValueError("prefix must not contain NUL (\\x00) characters")
    schema = validate_schema(schema)
    return [info_row(r) for r in _query(conn, "list", schema, (prefix,))]


def fence(
    conn: object, source: Source, schema: str, name: str, holder: str, token: int | None, ttl: float
) -> bool:
    """``guard()``'s statement in the caller's transaction: whether ``holder`` holds ``name``
    with ``token`` (its row locked until that transaction ends). InvalidConnectionState: no
    open transaction to lock in, or it does not see a lease that its source says is held."""
    target = _conn.resolve(conn, "Lease.guard")
    pg = target.conn
    status = _conn.check_usable(pg)
    if status == TransactionStatus.IDLE and pg.autocommit:
        raise InvalidConnectionState.no_transaction("guard()", "the row lock would end at once")
    _conn.ensure_sqlalchemy_transaction(target)
    try:
        with _conn.utf8(pg, begin=True):
            found = _conn.fetch(pg, stmt("guard", schema), (name, holder, token))
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        raise InvalidConnectionState(
            "guard() locks the lease's row until the transaction ends, which a read-only "
            "transaction cannot (default_transaction_read_only?): begin it READ WRITE"
        ) from exc
    except psycopg.Error as exc:
        _ttl.raise_translated(exc, pg, schema)
    if found[0] and found[0][0][0]:
        return True
    # Ask the lease's own source before declaring a loss: a connection to another database
    # (with its own pglock schema), or an older snapshot, would not see this lease at all.
    rows = run(source, "info", schema, (name,), deadline=short_deadline(ttl))
    info = info_row(rows[0]) if rows else None
    if info is not None and (info.holder, info.token) == (holder, token):
        raise InvalidConnectionState(_unseen(pg, name))
    return False


def _unseen(pg: psycopg.Connection[Any], name: str) -> str:
    """Why a connection does not see a lease that is held: a snapshot taken before the grant
    (REPEATABLE READ, SERIALIZABLE), or another database."""
    isolation = _conn.fetch(pg, _sql.TRANSACTION_ISOLATION)[0][0][0]
    if isolation in ("repeatable read", "serializable"):
        return (
            f"guard(): this {isolation} transaction does not see lease {name!r}, which is still "
            "held: the transaction's snapshot is older than the grant; start the transaction "
            "after acquiring"
        )
    return (
        f"guard(): this connection does not see lease {name!r}, which is still held: is it "
        "connected to the lease's database?"
    )
