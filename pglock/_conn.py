"""The one boundary between pglock and a caller's connection: :func:`resolve` finds the psycopg
connection, :func:`run` sends statements and translates errors by SQLSTATE, :class:`ConnState`
is pglock's per-connection bookkeeping (in a weak registry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import select
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import generators, sql
from psycopg.abc import AdaptContext
from psycopg.adapt import AdaptersMap
from psycopg.pq import ConnStatus, DiagnosticField, ExecStatus, Format, TransactionStatus
from psycopg.pq.abc import PGresult
from psycopg.rows import tuple_row
from psycopg.types.string import TextBinaryLoader, TextLoader

from . import _sql, _tracked
from ._classify import HELD, Kind, check_driver, classify
from ._deadline import within
from ._keys import exact
from .errors import (
    DeadlockDetected,
    InvalidConnectionState,
    LockError,
    LockNotAcquired,
    LockTableFull,
    SchemaNotInstalled,
    UnsupportedServer,
)

logger = logging.getLogger("pglock")

_TUPLES_OK = ExecStatus.TUPLES_OK
_FATAL_ERROR = ExecStatus.FATAL_ERROR
_CONNECTION_OK = ConnStatus.OK
_SQLSTATE = DiagnosticField.SQLSTATE
_R = TypeVar("_R")
Query = str | bytes | sql.SQL | sql.Composed

IDLE = TransactionStatus.IDLE
INTRANS = TransactionStatus.INTRANS
INERROR = TransactionStatus.INERROR
ACTIVE = TransactionStatus.ACTIVE

#: What to use instead, when a lock API that works on a held connection gets a source.
_USE_A_CONNECTION = {
    Kind.ENGINE: "a lock lives on one connection: pass engine.connect() or a Session, or use "
    "pglock.pool_lock(engine, ...) to check one out for the lock",
    Kind.POOL: "a lock lives on one connection: pass pool.connection(), or use "
    "pglock.pool_lock(pool, ...) to check one out for the lock",
    Kind.DSN: "a lock lives on one connection: pass psycopg.connect(dsn), or use "
    "pglock.Locker(dsn), which keeps a pool",
}


@dataclass
class Target:
    """A caller's connection object, resolved to the psycopg connection underneath."""

    conn: psycopg.Connection[Any]
    source: object
    kind: str  # "psycopg", "sqlalchemy", "session" or "django"


def resolve(obj: object, api: str = "pglock") -> Target:
    """Find the psycopg connection behind ``obj`` (a connection the caller holds), sending no SQL.

    :param api: the public call, for the error message.
    :raises TypeError: ``obj`` is not a connection pglock can use.
    :raises InvalidConnectionState: the connection is closed.
    """
    if type(obj) is psycopg.Connection:  # the common case, without classify()'s walk
        return Target(_check_open(obj), obj, "psycopg")
    kind = classify(obj, HELD, api=api, hints=_USE_A_CONNECTION)
    if kind is Kind.CONNECTION:
        assert isinstance(obj, psycopg.Connection)
        return Target(_check_open(obj), obj, "psycopg")
    if kind is Kind.SESSION:
        return _resolve_session(obj)
    if kind is Kind.DJANGO:
        from ._django import connection_of

        return Target(_check_open(connection_of(obj)[0]), obj, "django")
    sa_conn: Any = obj
    check_driver(sa_conn.dialect)
    if sa_conn.closed or sa_conn.invalidated:
        raise InvalidConnectionState("the SQLAlchemy Connection is closed or invalidated")
    return Target(_check_open(_driver_connection(sa_conn)), obj, "sqlalchemy")


def _resolve_session(session: Any) -> Target:
    from sqlalchemy.exc import UnboundExecutionError

    try:
        bind = session.get_bind()
    except UnboundExecutionError:
        raise TypeError(
            "the Session has no single bind (unbound, or bound to several engines); "
            "pass session.connection(bind_arguments=...) instead"
        ) from None
    check_driver(bind.dialect)
    return Target(_check_open(_driver_connection(session.connection())), session, "session")


def _driver_connection(sa_conn: Any) -> psycopg.Connection[Any]:
    raw = sa_conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise TypeError(f"expected a psycopg connection under SQLAlchemy, got {type(raw)!r}")
    return raw


def _check_open(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    if conn.closed or conn.broken:
        raise InvalidConnectionState.closed()
    not_inherited(conn)
    return no_pipeline(conn)


#: The process that first used each caller's connection through pglock (any call that takes
#: one: a lock, a guard, a read), so that a forked child knows its parent's.
_users = weakref.WeakKeyDictionary[psycopg.Connection[Any], int]()


def not_inherited(conn: psycopg.Connection[Any], *, cut_off: bool = False) -> None:
    """Refuse, before anything is sent, a connection pglock used in a parent of this forked
    process: its session is the parent's (docs/locks.md, "Processes and fork"); else mark it
    as this process's. With ``cut_off``, its socket's descriptor is first pointed at
    /dev/null, so that closing it (libpq then says goodbye) cannot end the parent's session."""
    pid = os.getpid()
    if _users.setdefault(conn, pid) != pid:
        if cut_off:
            devnull = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(devnull, conn.pgconn.socket)
            finally:
                os.close(devnull)
        raise InvalidConnectionState(
            "pglock used this connection in the parent of this forked process: its session is "
            "the parent's; a child opens connections of its own (docs/locks.md)"
        )


def no_pipeline(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """``conn``, unless it is in pipeline mode (InvalidConnectionState)."""
    if conn.pgconn.pipeline_status:
        # Its answers arrive only at the pipeline's sync, after pglock would have to report.
        raise InvalidConnectionState(
            "the connection is in pipeline mode: pglock reads the answer to each of its "
            "statements before it reports, so take and release locks outside the pipeline block"
        )
    return conn


def ensure_sqlalchemy_transaction(target: Target) -> None:
    """Begin SQLAlchemy's own transaction on a Connection that has none yet (autobegin)."""
    if target.kind == "sqlalchemy":
        sa_conn: Any = target.source
        if not sa_conn.in_transaction():
            sa_conn.begin()


def stable_status(conn: psycopg.Connection[Any]) -> int:
    """The transaction status (a :class:`~psycopg.pq.TransactionStatus` value) once any
    statement another thread is running has finished."""
    # pgconn's raw status: conn.info builds a new ConnectionInfo on every access.
    status = conn.pgconn.transaction_status
    if status == ACTIVE:
        with conn.lock:
            status = conn.pgconn.transaction_status
    return status


def check_usable(conn: psycopg.Connection[Any]) -> int:
    status = stable_status(conn)
    _check_open(conn)
    if status == INERROR:
        raise InvalidConnectionState.failed_transaction()
    return status


@dataclass
class Context:
    """What a statement is about (for a translated error), and by when it must be answered."""

    names: Sequence[str] = ()
    keys: Sequence[int] = ()
    timeout: float | None = None
    deadline: float | None = None  # monotonic: a statement unanswered by then is cut off
    schema: str | None = None  # of a lease/semaphore statement: its absence is SchemaNotInstalled
    waits: bool = True  # lock timeouts, cancels, deadlocks, full lock table: lock errors
    flight: Flight | None = None  # the wait close() cancels
    #: The transaction status the statement was built for, checked under the connection's lock
    #: before anything is sent (:class:`StatusChanged`): another thread may have begun or ended
    #: a transaction on a shared connection since.
    expect: int | None = None


_NO_CONTEXT = Context()


class StatusChanged(Exception):
    """Nothing was sent: the transaction status is no longer the one the statement was built
    for (another thread sharing the connection began or ended a transaction): build it again."""


@contextlib.contextmanager
def utf8(conn: psycopg.Connection[Any], *, begin: bool = False) -> Iterator[None]:
    """Names, holder ids and metadata cross ``conn`` in UTF-8 meanwhile: they may hold any
    character, which another client_encoding cannot carry (SQL_ASCII is not even decoded). A
    session in another encoding is switched for the time, and back (a switch inside the
    caller's transaction is undone with it, should that roll back). ``begin``: what follows
    belongs in the caller's transaction, begun first (see :func:`call`)."""
    old = conn.pgconn.parameter_status(b"client_encoding")
    if old in (None, b"UTF8"):
        yield
        return
    call(conn, _sql.client_encoding("UTF8").as_bytes(None), begin=begin)
    try:
        yield
    finally:
        if not (conn.closed or conn.broken) and conn.pgconn.transaction_status != INERROR:
            call(conn, _sql.client_encoding(old.decode("ascii")).as_bytes(None))


def _expected(conn: psycopg.Connection[Any], expect: int | None) -> int:
    """Under the connection's lock: its transaction status, if it is ``expect`` (or any); a
    connection another thread put in pipeline mode meanwhile is refused."""
    no_pipeline(conn)
    status: int = conn.pgconn.transaction_status
    if expect is not None and status != expect:
        raise StatusChanged
    return status


def _end(conn: psycopg.Connection[Any], ok: bool) -> None:
    """Under the connection's lock: end the transaction this call began and left open."""
    pgconn = conn.pgconn
    if pgconn.status == _CONNECTION_OK and pgconn.transaction_status in (INTRANS, INERROR):
        pgconn.send_query(b"COMMIT" if ok else b"ROLLBACK")
        conn.wait(generators.execute(pgconn))


class _OwnAdapters:
    __slots__ = ()

    @property
    def adapters(self) -> AdaptersMap:
        return _ADAPTERS


class _Cursor(_OwnAdapters, psycopg.Cursor[tuple[Any, ...]]):
    """pglock's own cursor (server-side binding): tuple rows and psycopg's default adapters."""

    __slots__ = ()


class _ClientCursor(_OwnAdapters, psycopg.ClientCursor[tuple[Any, ...]]):
    """The same with client-side binding, for a connection whose owner chose it."""

    __slots__ = ()


class _TextLoader(TextLoader):
    """Text in the connection's encoding; under SQL_ASCII (no conversion at all, which psycopg
    leaves as bytes) as UTF-8, the encoding of what pglock stores."""

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        self._encoding = self._encoding or "utf-8"


class _TextBinaryLoader(_TextLoader, TextBinaryLoader):
    pass


#: psycopg's default adapters at import, never a caller's (one that loads ``bool`` as text
#: would turn every refusal into a grant).
_ADAPTERS = AdaptersMap(psycopg.adapters)
for _t in ("text", "varchar", "name", "bpchar"):
    _ADAPTERS.register_loader(_t, _TextLoader)
    _ADAPTERS.register_loader(_t, _TextBinaryLoader)


def cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[tuple[Any, ...]]:
    """A new cursor of pglock's own on ``conn``, the one way pglock executes SQL: client-side
    binding for a ``ClientCursor`` factory, server-side binding for any other."""
    factory = conn.cursor_factory
    if isinstance(factory, type) and issubclass(factory, psycopg.ClientCursor):
        return _ClientCursor(conn, row_factory=tuple_row)
    return _Cursor(conn, row_factory=tuple_row)


def fetch(
    conn: psycopg.Connection[Any], query: Query, params: Sequence[Any] | None = None, *,
    binary: bool = False, flight: Flight | None = None, libpq: bool = False,
    expect: int | None = None, alone: bool = False,
) -> list[list[tuple[Any, ...]]]:
    """Execute ``query`` on pglock's own cursor (cancellable by ``flight``); the rows of every
    statement that returns rows, in order. Errors pass unchanged (see :func:`translate`). Without
    ``params`` a query may hold several ``;``-joined statements (never prepared, text results
    unless ``binary``: then one statement). ``binary`` asks for binary results, except with
    client-side binding (``%b`` becomes ``%s``). ``libpq``: one statement (scalar parameters)
    sent by :func:`_libpq_rows` where :func:`direct` allows. ``expect``: see
    :attr:`Context.expect`. ``alone``: on an idle connection, leave no transaction open (the
    BEGIN psycopg sends on a non-autocommit one is ended in the same hold of its lock)."""
    if libpq and params is not None and isinstance(query, bytes) and direct(conn):
        return [_libpq_rows(conn, query, params)]
    # Without parameters there is nothing to bind: pglock's server-side cursor, unprepared.
    cur = cursor(conn) if params is not None else _Cursor(conn, row_factory=tuple_row)
    kwargs: dict[str, bool] = {"binary": binary}
    if params is None:
        kwargs["prepare"] = False
    elif isinstance(cur, _ClientCursor):
        del kwargs["binary"]  # client-side binding: text only
        if binary and isinstance(query, bytes):
            query = _text_placeholders(query)

    def send() -> None:
        # What cur.execute() runs, under the lock held from the status check to the end.
        alone_now = alone and _expected(conn, expect) == IDLE
        ok = False
        try:
            conn.wait(cur._execute_gen(query, params, **kwargs))
            ok = True
        finally:
            if alone_now:
                _end(conn, ok=ok)

    if flight is None:
        with conn.lock:
            send()
    else:
        flight.run(conn, send)
    # The status of each result, not cur.description, which builds column objects.
    results: list[list[tuple[Any, ...]]] = []
    while True:
        res = cur.pgresult
        if res is not None and res.status == _TUPLES_OK:
            results.append(cur.fetchall())
        if not cur.nextset():
            return results


@lru_cache(maxsize=16)
def _text_placeholders(query: bytes) -> bytes:
    return query.replace(b"%b", b"%s")


@lru_cache(maxsize=64)
def _numbered(query: bytes) -> bytes:
    """``query`` with ``$n`` placeholders instead of ``%s``."""
    parts = query.split(b"%s")
    return parts[0] + b"".join(b"$%d%s" % (n, p) for n, p in enumerate(parts[1:], 1))


def _libpq_rows(
    conn: psycopg.Connection[Any], query: bytes, params: Sequence[Any]
) -> list[tuple[Any, ...]]:
    """One statement straight through libpq: parameters in text (None, bool, int, float,
    str), rows decoded from binary (:data:`_DECODE`) as psycopg's loaders would; prepared as
    :func:`call`'s are, unless the owner set ``prepare_threshold=None`` (PgBouncer < 1.21)."""
    info = conn.info
    values = [
        None if p is None else p.encode(info.encoding) if type(p) is str
        else (b"t" if p else b"f") if type(p) is bool else b"%r" % p
        for p in params
    ]
    text = _numbered(query)
    pgconn = conn.pgconn
    with conn.lock:
        _check_sendable(pgconn)
        if conn.prepare_threshold is None or pgconn.transaction_status != IDLE:
            pgconn.send_query_params(text, values, None, None, _BINARY)
            res = conn.wait(generators.execute(pgconn))[-1]
        else:
            res = _send_prepared(conn, text, values, None, None, state_for(conn).prepared)[-1]
    if res.status != _TUPLES_OK:
        if res.status == _FATAL_ERROR:
            raise pg_errors.error_from_result(res, encoding=info.encoding)
        raise psycopg.ProgrammingError(f"no rows from {text!r}")
    decoders = [_DECODE[res.ftype(c)] for c in range(res.nfields)]
    return [
        tuple(
            None if (v := res.get_value(r, c)) is None else f(v, info)
            for c, f in enumerate(decoders)
        )
        for r in range(res.ntuples)
    ]


def run(
    conn: psycopg.Connection[Any], stmt: Query, ctx: Context | None = None,
    params: tuple[Any, ...] | None = None,
) -> list[tuple[Any, ...]]:
    """:func:`run_all`, returning the rows of the last statement that returns rows."""
    results = run_all(conn, stmt, ctx, params)
    return results[-1] if results else []


def run_one(
    conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...], ctx: Context | None = None
) -> tuple[Any, ...] | None:
    """Execute one fixed, parameterized statement from :mod:`pglock._sql`; its first row."""
    rows = run(conn, query, ctx, params)
    return rows[0] if rows else None


def run_all(
    conn: psycopg.Connection[Any], stmt: Query, ctx: Context | None = None,
    params: tuple[Any, ...] | None = None,
) -> list[list[tuple[Any, ...]]]:
    """:func:`fetch`, cut off at ``ctx.deadline`` if any; Postgres errors that mean something
    for a lock become pglock errors here, by SQLSTATE."""
    ctx = ctx or _NO_CONTEXT

    def send() -> list[list[tuple[Any, ...]]]:
        return fetch(conn, stmt, params, flight=ctx.flight, expect=ctx.expect)

    try:
        if ctx.deadline is None:
            return send()
        return within(conn, ctx.deadline, send, "a lock statement")
    except psycopg.Error as exc:
        translated = translate(exc, ctx)
        if translated is None:
            raise
        raise translated from exc


_INT8, _UNPACK_INT8 = struct.Struct("!q").pack, struct.Struct("!q").unpack
_INT8_OID, _INT8_ARRAY_OID = 20, 1016
_BINARY, _TEXT = Format.BINARY, Format.TEXT
Param = int | Sequence[int]
_FLOAT8 = struct.Struct("!d")
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)


def _timestamptz(v: bytes, info: Any) -> datetime:
    try:
        return (_PG_EPOCH + timedelta(microseconds=_UNPACK_INT8(v)[0])).astimezone(info.timezone)
    except OverflowError:
        raise psycopg.DataError("timestamp out of Python's range (infinity?)") from None


#: Binary result decoders by type oid: bool, bigint, text, float8, timestamptz, jsonb.
_DECODE: dict[int, Callable[[bytes, Any], Any]] = {
    16: lambda v, _: v == b"\x01",
    20: lambda v, _: _UNPACK_INT8(v)[0],
    25: lambda v, info: v.decode(info.encoding),
    701: lambda v, _: _FLOAT8.unpack(v)[0],
    1184: _timestamptz,
    3802: lambda v, _: json.loads(v[1:]),  # after the format's version byte (1)
}


def direct(conn: psycopg.Connection[Any]) -> bool:
    """May pglock send parameters on ``conn`` in binary, as prepared statements: its owner did
    not choose client-side binding (kept for a proxy that needs it: then literals)?"""
    factory = conn.cursor_factory
    return not (isinstance(factory, type) and issubclass(factory, psycopg.ClientCursor))


def call(
    conn: psycopg.Connection[Any], query: bytes, params: Sequence[Param] = (),
    ctx: Context | None = None, *, begin: bool = False, prepared: set[bytes] | None = None,
    every: bool = False, shield: bool = False,
) -> Any:
    """Send one fixed statement of :mod:`pglock._sql` (``$n`` placeholders, bigint or bigint[]
    parameters), or several ``;``-joined statements (a batch, no parameters), through libpq:
    results in binary (with parameters) or text, the last that returned rows (``every``: the
    list of them). The pglock hot path: no cursor, adapter or row factory, so nothing of the
    caller's connection set-up applies; with client-side binding the parameters go as
    literals. Errors are translated as :func:`run_all` does. ``begin``: the statement belongs
    in the caller's transaction, begun first on an idle non-autocommit connection.
    ``prepared``: the names of the statements prepared on the connection (ConnState.prepared):
    outside a transaction the statement is prepared once and then executed by name (unless
    the owner set ``prepare_threshold=None``). ``shield``: one statement the session's own
    timeouts and exit_on_error must not cut (:func:`pglock._sql.shielded`).

    Whatever the connection's status was when the statement was built, it is read again under
    the connection's lock (``ctx.expect``); and a statement sent outside any transaction that
    leaves one open (a batch that failed between its BEGIN and COMMIT) has it rolled back in
    the same hold of the lock: another thread sharing the connection never finds pglock's
    transaction open, and pglock never commits or rolls back one it did not begin."""
    ctx = ctx or _NO_CONTEXT

    def send() -> Any:
        return _call(conn, query, params, ctx, begin, prepared, every, shield)

    try:
        if ctx.deadline is None:
            return send()
        return within(conn, ctx.deadline, send, "a lock statement")
    except psycopg.Error as exc:
        translated = translate(exc, ctx)
        if translated is None:
            raise
        raise translated from exc


def _literals(query: bytes, params: Sequence[Param]) -> bytes:
    """``query`` with its bigint or bigint[] parameters as literals (for a simple query)."""
    for n in range(len(params), 0, -1):  # $10 before $1
        p = params[n - 1]
        # Quoted: in -5::bigint the cast binds first, and the minus is an operator looked up on
        # the caller's search_path.
        literal = b"'%d'::bigint" % p if isinstance(p, int) else b"'{%s}'::bigint[]" % b",".join(
            b"%d" % int(k) for k in p
        )
        query = query.replace(b"$%d" % n, literal)
    return query


def _call(
    conn: psycopg.Connection[Any], query: bytes, params: Sequence[Param], ctx: Context,
    begin: bool, prepared: set[bytes] | None, every: bool, shield: bool,
) -> Any:
    if conn.prepare_threshold is None:
        prepared = None  # the owner's choice (a pooler that keeps no prepared statement)

    def exchange() -> list[PGresult]:
        _check_sendable(conn.pgconn)
        status = _expected(conn, ctx.expect)
        try:
            return _send(conn, query, params, status, begin, prepared, shield)
        finally:
            if status == IDLE and not begin:
                _end(conn, ok=False)  # a batch failed (or was interrupted) before its COMMIT

    flight = ctx.flight
    if flight is None:
        with conn.lock:
            results = exchange()
    else:
        results = flight.run(conn, exchange)
    found = []
    for res in results:
        status = res.status
        if status == _TUPLES_OK:
            found.append(res)
        elif status == _FATAL_ERROR:
            raise pg_errors.error_from_result(res, encoding=conn.info.encoding)
    if not found:
        raise psycopg.ProgrammingError(f"no rows from {query!r}")
    return found if every else found[-1]


def _send(
    conn: psycopg.Connection[Any], query: bytes, params: Sequence[Param], status: int,
    begin: bool, prepared: set[bytes] | None, shield: bool,
) -> list[PGresult]:
    """Under the connection's lock: send what :func:`call` asked for, read its results."""
    pgconn = conn.pgconn
    if shield:
        pgconn.send_query(_sql.shielded(_literals(query, params), status != IDLE))
    elif begin and status == IDLE and not conn.autocommit:
        pgconn.send_query(b"BEGIN; " + _literals(query, params))
    elif not params or not direct(conn):
        pgconn.send_query(_literals(query, params))
    else:
        values = [
            _INT8(p) if isinstance(p, int) else b"{%s}" % b",".join(b"%d" % k for k in p)
            for p in params
        ]
        types = [_INT8_OID if isinstance(p, int) else _INT8_ARRAY_OID for p in params]
        formats = [_BINARY if isinstance(p, int) else _TEXT for p in params]
        if prepared is None or status != IDLE:
            pgconn.send_query_params(query, values, types, formats, _BINARY)
        else:
            return _send_prepared(conn, query, values, types, formats, prepared)
    return conn.wait(generators.execute(pgconn))


def _send_prepared(
    conn: psycopg.Connection[Any], query: bytes, values: Sequence[bytes | None],
    types: Sequence[int] | None, formats: Sequence[Format] | None, prepared: set[bytes],
) -> list[PGresult]:
    """Execute ``query`` as a statement prepared on the connection (once), outside a
    transaction: parsed and planned once, not at every lock. Prepared again when it is gone
    (``DEALLOCATE ALL``, ``DISCARD ALL``): outside a transaction these errors change nothing."""
    pgconn = conn.pgconn
    name = _statement_name(query)
    for _ in range(2):
        if name not in prepared:
            pgconn.send_prepare(name, query, types)
            for res in conn.wait(generators.execute(pgconn)):
                # 42P05: prepared before pglock last forgot the connection (a pool reset).
                if res.status == _FATAL_ERROR and res.error_field(_SQLSTATE) != b"42P05":
                    raise pg_errors.error_from_result(res, encoding=conn.info.encoding)
            prepared.add(name)
        pgconn.send_query_prepared(name, values, formats, _BINARY)
        results: list[PGresult] = conn.wait(generators.execute(pgconn))
        last = results[-1]
        if last.status != _FATAL_ERROR or last.error_field(_SQLSTATE) != b"26000":
            return results
        prepared.discard(name)
    return results


_NAMES: dict[bytes, bytes] = {}


def _statement_name(query: bytes) -> bytes:
    name = _NAMES.get(query)
    if name is None:  # a few fixed statements of pglock._sql
        name = _NAMES[query] = b"_pglock_" + hashlib.sha256(query).hexdigest()[:16].encode()
    return name


def _check_sendable(pgconn: Any) -> None:
    if pgconn.status != _CONNECTION_OK:
        raise psycopg.OperationalError("the connection is closed")


def truth(res: PGresult, row: int = 0, col: int = 0) -> bool:
    """A boolean of a :func:`call` result, binary (``\\x01``) or text (``t``)."""
    return res.get_value(row, col) in (b"\x01", b"t")


def bigint(res: PGresult, row: int = 0, col: int = 0) -> int:
    """A (non-null) bigint of a :func:`call` result, binary or text."""
    value = res.get_value(row, col)
    assert value is not None
    return _UNPACK_INT8(value)[0] if res.fformat(col) == _BINARY else int(value)


def pairs(res: PGresult) -> list[tuple[int, bool]]:
    """The ``(bigint, boolean)`` rows of a :func:`call` result."""
    return [(bigint(res, i), truth(res, i, 1)) for i in range(res.ntuples)]


#: How long past a lock attempt's own timeout pglock waits for the server's answer on a
#: caller's connection; a statement still unanswered (a silent network, a stalled server) is
#: cut off and its connection closed (its session ends, and every lock of it with it).
CALLER_ANSWER_GRACE = 5.0


def answer_deadline(deadline: float | None) -> float | None:
    """The instant by which a lock statement with the attempt ``deadline`` must be answered."""
    return None if deadline is None else deadline + CALLER_ANSWER_GRACE


class Woken(Exception):
    """A wait's statement was not sent: its lock object was closed first."""


class Flight(_tracked.Tracked):
    """The statement a lock object's wait has in flight, and close()'s cancel of it (why that is
    safe: docs/how-it-works.md, "Failed transactions and interrupts")."""

    def __init__(self, stop: Callable[[], bool]) -> None:
        self.stop = stop  # true once the wait must end (its lock object was closed)
        self._mutex = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._left = True
        self._ended: threading.Condition | None = None  # made by the first cancel()

    def run(self, conn: psycopg.Connection[Any], send: Callable[[], _R]) -> _R:
        """``send()`` (which sends one statement on ``conn`` and waits for its answer) under
        ``conn.lock``, cancellable by :meth:`cancel`."""
        with conn.lock:
            with self._mutex:
                if self.stop():
                    raise Woken
                self._conn = conn
                self._left = False
            try:
                return send()
            finally:
                with self._mutex:
                    self._conn = None
                    self._left = True
                    if self._ended is not None:
                        self._ended.notify_all()

    def cancel(self) -> None:
        """Cancel the registered statement, again until it has ended (a few seconds at most)."""
        pause = 0.02
        for _ in range(10):
            with self._mutex:
                conn = self._conn
                if conn is None:
                    return
                if conn.pgconn.transaction_status == ACTIVE:
                    try:
                        conn.cancel_safe(timeout=5.0)
                    except Exception:
                        logger.debug("cancelling a waiting lock statement failed", exc_info=True)
                        return
                if self._ended is None:
                    self._ended = threading.Condition(self._mutex)
                if self._ended.wait_for(lambda: self._left, pause):
                    return
            pause = min(2 * pause, 1.0)


def recover_interrupted(conn: psycopg.Connection[Any], timeout: float = 5.0) -> None:
    """Read what a KeyboardInterrupt inside psycopg's result reading left unread (the connection
    stays ACTIVE and refuses every statement); close it if not done within ``timeout``."""
    if conn.closed or conn.pgconn.transaction_status != ACTIVE:
        return
    with conn.lock:  # a statement another thread runs finishes first
        pgconn = conn.pgconn
        deadline = time.monotonic() + timeout
        try:
            while pgconn.transaction_status == ACTIVE:
                pgconn.consume_input()
                while not pgconn.is_busy():
                    if pgconn.get_result() is None:
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the interrupted statement did not finish")
                select.select([pgconn.socket], [], [], min(remaining, 0.1))
        except (psycopg.Error, OSError) as exc:  # TimeoutError is an OSError
            logger.warning("closing a connection left busy by an interrupt: %s", exc)
            conn.close()


def translate(
    exc: psycopg.Error, ctx: Context, conn: psycopg.Connection[Any] | None = None
) -> Exception | None:
    """Map a Postgres error to a pglock error by SQLSTATE, the one place pglock does (None: the
    error passes unchanged). ``conn`` is named in a missing schema's error."""
    if ctx.schema is not None:
        if isinstance(exc, _SCHEMA_MISSING):
            return SchemaNotInstalled.for_connection(conn, ctx.schema)
        if isinstance(exc, pg_errors.SequenceGeneratorLimitExceeded):
            return LockError(
                f"the fencing-token sequence {ctx.schema}.lease_token is exhausted (it never "
                "cycles, so no token is ever handed out twice); tokens cannot be issued any more"
            )
    name = ctx.names[0] if ctx.names else None
    key = ctx.keys[0] if ctx.keys else None
    # 53200 "out of shared memory": any statement sent for a lock (its probe too) needs slots.
    if isinstance(exc, pg_errors.OutOfMemory) and (ctx.waits or ctx.names):
        return LockTableFull(name, key=key)
    if not ctx.waits:
        return None
    if isinstance(exc, (pg_errors.LockNotAvailable, pg_errors.QueryCanceled)):
        return LockNotAcquired(name, key=key, timeout=ctx.timeout)
    if isinstance(exc, pg_errors.DeadlockDetected):
        return DeadlockDetected(name, key=key)
    return None


_SCHEMA_MISSING = (
    pg_errors.UndefinedFunction, pg_errors.UndefinedTable, pg_errors.InvalidSchemaName
)


@dataclass
class KeyHold:
    """pglock's holders of one key, which the session holds once in Postgres, in ``mode``."""

    mode: str  # "x" (exclusive) or "s" (shared)
    owners: dict[threading.Thread, int] = field(default_factory=dict)  # thread -> re-entries
    pending: bool = True  # the first holder's statement is in flight (or the unlock)


@dataclass
class XactHold:
    """One thread's transaction-level hold of one key, recorded before any SQL (``pending``)
    (docs/how-it-works.md, "Transaction locks")."""

    owner: threading.Thread
    mode: str = "x"  # "x" (exclusive) or "s" (shared)
    pending: bool = True  # the owner's statement is in flight
    #: Its transaction's start (µs since 1970: _sql._TX_START) once granted; None while pending
    #: or after an unexpected error (pg_locks decides when another thread asks).
    started: Any = None


class ConnState(_tracked.Tracked):
    """pglock's knowledge about one psycopg connection (one Postgres session)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards what follows; ``with state.lock`` (cheaper)
        self.cond = threading.Condition(self.lock)  # for wait/notify, under ``lock``
        self.sleepers = 0  # threads in cond.wait(): a change wakes them only when there are any
        self.holds: dict[int, KeyHold] = {}
        self.probed = False
        self.registry: str | None = None  # the name registry's schema, if installed and writable
        self.prepared: set[bytes] = set()  # statements pglock prepared on it (_conn.call)
        self.database: tuple[Any, ...] = ()  # (host, port, dbname), for the registry's cache
        self.backend_pid: int | None = None
        self.deferred: list[tuple[int, bool]] = []  # unlocks not sent (failed transaction at exit)
        #: (keys, owner) of handles collected while holding (PgLock.__del__): see _holds.
        self.collected: list[tuple[list[int], threading.Thread]] = []
        self.pid = os.getpid()  # another one: pglock used the connection in a forked parent
        self.xact: dict[int, XactHold] = {}  # a record may outlive its lock (pg_locks decides)
        self.pooler = False  # a pooler (PgBouncer) sits between: see probe()
        #: What the caller declared about a pooler (``pooler=`` other than "auto"), if anything.
        self.declared: str | None = None
        #: What showed that the server session is shared (transaction pooling): session locks
        #: are refused from then on, without SQL.
        self.sharing: str | None = None
        self.session_timeouts = False  # a statement/lock_timeout of its own: waits override them
        #: Why handles that still believe they hold a lock on the connection raise LockLost
        #: (set when the bookkeeping was dropped, for example by the pool reset).
        self.lost: str | None = None
        #: The pglock schemas this session may use (pglock._ttl.trust): checked once each.
        self.trusted: set[str] = set()


_registry = weakref.WeakKeyDictionary[psycopg.Connection[Any], ConnState]()
_registry_lock = threading.Lock()


def state_for(conn: psycopg.Connection[Any]) -> ConnState:
    with _registry_lock:
        state = _registry.get(conn)
        if state is None:
            state = _registry[conn] = ConnState()
    not_inherited(conn)
    return state


def forget(conn: psycopg.Connection[Any], *, lost: str | None = None) -> ConnState | None:
    """Drop pglock's bookkeeping for ``conn`` (its session locks were all released); ``lost``
    is the reason handles still believing they hold a lock on it give in their LockLost."""
    with _registry_lock:
        state = _registry.pop(conn, None)
    if state is not None and lost is not None:
        with state.lock:
            state.lost = lost
            state.cond.notify_all()
    return state


def probe(conn: psycopg.Connection[Any], state: ConnState, ctx: Context | None = None) -> None:
    """Once per connection (in the caller's transaction, if one is open): refuse a hot standby,
    note the pid."""
    # Outside a transaction, not in one of its own (BEGIN) at first: statement pooling ends the
    # client that opens one, so the probe could not even report the pooler (docs/pgbouncer.md).
    # In the caller's transaction, and once the session's own statement_timeout cut it, shielded.
    # (A shielded probe reads its own overrides: the session's timeouts show when they cut a
    # wait short; one that cut the probe is known already.)
    quiet = dataclasses.replace(ctx or _NO_CONTEXT, waits=False)
    query = _sql.PROBE.as_bytes(conn)
    cut = False
    try:
        res = call(conn, query, (), quiet, shield=conn.pgconn.transaction_status != IDLE)
    except pg_errors.QueryCanceled:
        if conn.pgconn.transaction_status != IDLE:
            raise
        res, cut = call(conn, query, (), quiet, shield=True), True
    registry_value = res.get_value(0, 2)
    in_recovery, pid, timeouts = truth(res), bigint(res, 0, 1), truth(res, 0, 3) or cut
    registry = None if registry_value is None else registry_value.decode()
    if in_recovery:
        raise UnsupportedServer(
            "this server is a hot standby (pg_is_in_recovery() is true): advisory locks on a "
            "standby are local to it and coordinate nothing with the primary; connect to the "
            "primary"
        )
    state.backend_pid = pid
    state.registry = registry
    info = conn.info
    state.database = (info.host, info.port, info.dbname)
    state.session_timeouts = bool(timeouts)
    # PgBouncer (any mode) and other multiplexing poolers answer the startup with a cancel key
    # of their own, so the pid the client was told differs from the server's.
    state.pooler = pid != conn.info.backend_pid
    state.probed = True


#: The values of ``pooler=`` (docs/pgbouncer.md).
POOLER_MODES = ("auto", "session", "transaction", "none")


def validate_pooler(value: object) -> str:
    """``pooler=`` checked before any SQL: one of :data:`POOLER_MODES`."""
    if not isinstance(value, str):
        raise TypeError(
            f"pooler must be a str, one of {', '.join(map(repr, POOLER_MODES))}, "
            f"not {type(value).__name__}"
        )
    if (value := exact(value)) not in POOLER_MODES:
        raise ValueError(
            f"pooler must be one of {', '.join(map(repr, POOLER_MODES))}, not {value!r}"
        )
    return value


def declare(state: ConnState, pooler: str) -> str:
    """Record an explicit ``pooler=`` on the connection (the latest wins); the mode in force:
    the one declared now or before, else "auto"."""
    if pooler != "auto":
        with state.lock:
            state.declared = pooler
        return pooler
    return state.declared or "auto"


#: Each connection's mark on its server session (_sql.POOLER_MARK): outlives its ConnState (a
#: pool reset forgets that, and the server session keeps the mark).
_marks = weakref.WeakKeyDictionary[psycopg.Connection[Any], int]()


def client_mark(conn: psycopg.Connection[Any], *, create: bool = True) -> int:
    """The random mark of ``conn`` (62 bits, positive: no collision in practice); 0 if it has
    none and ``create`` is false."""
    with _registry_lock:
        mark = _marks.get(conn)
        if mark is None:
            if not create:
                return 0
            mark = _marks[conn] = secrets.randbits(62) | 1
        return mark


def pooler_error(state: ConnState, mode: str = "auto") -> UnsupportedServer:
    """The error for a session lock refused because of a connection pooler: declared
    ``pooler="transaction"``, sharing observed, or a pooler of unknown mode (``auto``)."""
    tail = (
        "session-level advisory locks need one server session for the whole hold, and "
        "transaction or statement pooling hands each transaction to any server connection. "
        "Use pglock.xact_lock (released at commit) or pglock.lease (TTL leases), which work "
        "through a pooler, or connect to Postgres directly for session locks "
        "(see docs/pgbouncer.md)"
    )
    if state.sharing is not None:
        return UnsupportedServer(
            f"transaction pooling observed on this connection ({state.sharing}): a connection "
            f"pooler shares the server session with other clients; {tail}"
        )
    if mode == "transaction":
        return UnsupportedServer(
            f'pooler="transaction" was given for this connection (a connection pooler in '
            f"transaction or statement mode): {tail}"
        )
    return UnsupportedServer(
        "a connection pooler (such as PgBouncer) sits between this connection and Postgres "
        f"(the server session is pid {state.backend_pid}, the connection was told another): "
        f"{tail}. Its mode cannot be told from one connection: if it pools sessions (PgBouncer "
        'pool_mode = session), pass pooler="session"'
    )
