"""The connection-configuration matrix (issue 11): the caller's connection settings change no
answer pglock gives.

Every public lock API (the ``API`` table below) runs against every connection set-up (the
``SETUPS`` table): psycopg's defaults, other row factories, other cursor classes, prepared
statements, autocommit, a role whose ``statement_timeout`` and ``lock_timeout`` are 300 ms,
custom loaders, and SQLAlchemy engines. A cell asserts the same answers as the default set-up,
the positive one and the negative one (granted when free, refused while another session or
holder has it; never a false grant), against the server's truth (``pg_locks``, the lease
table), not pglock's belief.

A set-up applies to what the API takes: the caller's connection for the connection APIs
(``pg_lock``, ``xact_lock``, ``guard``, ``lease_info``, ``advisory_locks``, ...), the pool's or
engine's connections (``kwargs=`` / ``connect_args=``) for the source APIs (``pool_lock``,
``Locker``, leases, semaphores, ``leader``, ``singleton``, the reset hooks). The contending
session and the observer always use psycopg's defaults and raw SQL.

The only other acceptable outcome of a cell is a clear pglock error before any SQL (a
``TypeError``, ``ValueError`` or :class:`pglock.LockError` raised when the set-up's sessions
have run nothing since): such a cell passes and prints ``refused before any SQL``.

Everything runs in a database of the module's own with the pglock schema installed
(``lease_database``); the role is created for the module and dropped at its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _pgdb import sa_url, with_params
from psycopg import sql
from psycopg.adapt import Loader
from psycopg.pq import Format, TransactionStatus
from psycopg.rows import class_row, dict_row, namedtuple_row
from psycopg_pool import ConnectionPool
from sqlalchemy.pool import QueuePool
from test_lease_support import row_of, sleep_until_expired, wait_until

import pglock
import pglock.sqlalchemy
from pglock import _lease

#: Every grant reported here is checked against the database (tests/_believer.py).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("believer")]

X, S = "ExclusiveLock", "ShareLock"

PGLOCK_DIR = Path(pglock.__file__).resolve().parent

#: The role set-up's settings (item 10 of issue 11): shorter than every wait below.
ROLE_TIMEOUT = "300ms"


# --- the set-ups --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unbuildable:
    """A row class no pglock result can build (no pglock column is called ``nope``)."""

    nope: int


class _Strings(Loader):
    """Loads every value as a string: a truthy ``"f"`` for false, ``"1"`` for 1."""

    def load(self, data: Any) -> str:
        return "text:" + bytes(data).decode("utf-8", "replace")


class _BinaryStrings(Loader):
    format = Format.BINARY

    def load(self, data: Any) -> str:
        return "binary:" + bytes(data).hex()


#: Types the custom loaders replace: what pglock reads (booleans, keys, pids, tokens, names,
#: times, metadata).
LOADER_TYPES = ("bool", "int4", "int8", "text", "timestamptz", "jsonb")


def register_string_loaders(conn: psycopg.Connection[Any]) -> None:
    for t in LOADER_TYPES:
        conn.adapters.register_loader(t, _Strings)
        conn.adapters.register_loader(t, _BinaryStrings)


@dataclasses.dataclass(frozen=True)
class Setup:
    id: str
    #: psycopg.connect() keyword arguments (ConnectionPool kwargs=, create_engine connect_args=)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: run on each new connection (ConnectionPool configure=, the engine's "connect" event)
    configure: Callable[[psycopg.Connection[Any]], None] | None = None
    #: log in as the role with statement_timeout and lock_timeout of 300 ms
    role: bool = False
    #: SQLAlchemy: connection APIs get an engine's Connection, source APIs the Engine
    engine: bool = False

    def __repr__(self) -> str:
        return self.id


SETUPS = [
    Setup("default"),
    Setup("autocommit", {"autocommit": True}),
    Setup("dict_row", {"row_factory": dict_row}),
    Setup("namedtuple_row", {"row_factory": namedtuple_row}),
    Setup("class_row", {"row_factory": class_row(Unbuildable)}),
    Setup("ClientCursor", {"cursor_factory": psycopg.ClientCursor}),
    Setup("RawCursor", {"cursor_factory": psycopg.RawCursor}),
    Setup("prepare_none", {"prepare_threshold": None}),
    Setup("prepare_all", {"prepare_threshold": 0}),
    Setup("role_timeouts", role=True),
    Setup("string_loaders", configure=register_string_loaders),
    Setup("sa_default", engine=True),
    Setup("sa_ClientCursor", {"cursor_factory": psycopg.ClientCursor}, engine=True),
    # No SQLAlchemy engine with row_factory=dict_row (or RawCursor): SQLAlchemy itself fails on
    # its first connect with them ("Could not determine version from string 'version'", "raw
    # queries require a sequence of parameters"), so no application runs one.
]


# --- module fixtures: a database with the schema, and the role ----------------------------------


@contextlib.contextmanager
def timeout_role(server_dsn: str, db_dsn: str) -> Iterator[str]:
    """A LOGIN role (unique name) whose sessions start with ``statement_timeout`` and
    ``lock_timeout`` of 300 ms, granted what pglock needs in ``db_dsn``'s pglock schema;
    dropped afterwards. Yields its name."""
    role = f"pglock_matrix_{uuid.uuid4().hex[:10]}"
    ident = sql.Identifier(role)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER").format(ident))
        for setting in ("statement_timeout", "lock_timeout"):
            admin.execute(
                sql.SQL("ALTER ROLE {} SET {} = {}").format(
                    ident, sql.Identifier(setting), sql.Literal(ROLE_TIMEOUT)
                )
            )
    try:
        with psycopg.connect(db_dsn, autocommit=True) as admin:
            for stmt in (
                "GRANT USAGE ON SCHEMA pglock TO {}",
                "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pglock TO {}",
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA pglock TO {}",
                "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA pglock TO {}",
            ):
                admin.execute(sql.SQL(stmt).format(ident))
        yield role
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
        with psycopg.connect(db_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))


@pytest.fixture(scope="module")
def role(pg_dsn: str, db: str) -> Iterator[str]:
    with timeout_role(pg_dsn, db) as r:
        yield r


# --- Postgres truth -----------------------------------------------------------------------------


def holders(obs: psycopg.Connection[Any], name: str) -> list[tuple[int, str]]:
    """(pid, mode) of every session holding ``name``'s key in this database."""
    rows = obs.execute(
        "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
        " AND granted AND database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())"
        " AND (classid::bigint << 32) | objid::bigint = %s ORDER BY 1, 2",
        (pglock.key(name),),
    ).fetchall()
    return [(p, m) for p, m in rows]


def waiting(obs: psycopg.Connection[Any], *names: str) -> list[int]:
    """Pids waiting (not granted) for one of ``names``' keys."""
    rows = obs.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
        " AND NOT granted AND (classid::bigint << 32) | objid::bigint = ANY(%s)",
        ([pglock.key(n) for n in names],),
    ).fetchall()
    return [r[0] for r in rows]


def take(c: psycopg.Connection[Any], *names: str, shared: bool = False) -> None:
    """The contender takes ``names`` by raw SQL (session locks)."""
    fn = "pg_advisory_lock_shared" if shared else "pg_advisory_lock"
    for n in names:
        c.execute(sql.SQL("SELECT {}(%s)").format(sql.Identifier(fn)), (pglock.key(n),))


def give(c: psycopg.Connection[Any], *names: str, shared: bool = False) -> None:
    fn = "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock"
    for n in names:
        row = c.execute(
            sql.SQL("SELECT {}(%s)").format(sql.Identifier(fn)), (pglock.key(n),)
        ).fetchone()
        assert row == (True,), f"the contender did not hold {n!r}"


def can_take(c: psycopg.Connection[Any], name: str) -> bool:
    """Could the contender take ``name`` exclusively now? (Released at once if so.)"""
    row = c.execute("SELECT pg_try_advisory_lock(%s)", (pglock.key(name),)).fetchone()
    assert row is not None
    if row[0]:
        c.execute("SELECT pg_advisory_unlock(%s)", (pglock.key(name),))
    return bool(row[0])


def lease_row(obs: psycopg.Connection[Any], name: str) -> tuple[Any, ...] | None:
    """(holder, token, expired?) of the lease row ``name``, or None."""
    row = row_of(obs, name)
    return None if row is None else (row[0], row[1], row[5])


def live_permits(obs: psycopg.Connection[Any], name: str) -> int:
    row = obs.execute(
        "SELECT count(*) FROM pglock.semaphore_permit WHERE semaphore = %s"
        " AND expires_at > clock_timestamp()",
        (name,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def driver(c: Any) -> psycopg.Connection[Any]:
    """The psycopg connection of a psycopg or SQLAlchemy connection."""
    if isinstance(c, psycopg.Connection):
        return c
    raw = c.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def pid_of(c: Any) -> int:
    """Backend pid of a connection, read client-side (no SQL through its cursor)."""
    return driver(c).info.backend_pid


# --- one cell -----------------------------------------------------------------------------------


def _raised_by_pglock(exc: BaseException) -> bool:
    """Was ``exc`` raised by pglock's own code (not by psycopg, a row factory, ...)?"""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and Path(last).resolve().is_relative_to(PGLOCK_DIR)


class Refused(Exception):
    """pglock refused the set-up with a clear error before any SQL: an accepted outcome."""


class Cell:
    """One (api, set-up) cell: the set-up's connections and sources, a contender and an
    observer (psycopg defaults), and cleanup."""

    def __init__(self, setup: Setup, db: str, role: str, app_name: str, name: str) -> None:
        self.setup = setup
        self.app_name = app_name
        self.name = name
        #: psycopg defaults, the test's application_name (leak checks), superuser
        self.dsn = with_params(db, application_name=app_name)
        self.setup_dsn = with_params(self.dsn, user=role) if setup.role else self.dsn
        self.stack = contextlib.ExitStack()
        self.obs = self.plain()
        self.other = self.plain()
        self.other_pid = self.other.info.backend_pid
        #: the delay before a contender releases a name a waiter waits for: past the role's
        #: 300 ms, so that a wait cut short by the role's settings shows
        self.delay = 0.5 if setup.role else 0.05
        self.leases: list[pglock.Lease] = []

    # connections and sources

    def plain(self) -> psycopg.Connection[Any]:
        c = psycopg.connect(self.dsn, autocommit=True)
        self.stack.callback(c.close)
        return c

    def engine(self, **kw: Any) -> sa.Engine:
        kw.setdefault("poolclass", QueuePool)
        kw.setdefault("pool_size", 4)
        kw.setdefault("max_overflow", 0)
        kw.setdefault("pool_timeout", 10)
        e = sa.create_engine(sa_url(self.setup_dsn), connect_args=dict(self.setup.kwargs), **kw)
        self.stack.callback(e.dispose)
        with e.connect():  # SQLAlchemy's own first-connect queries, before any snapshot
            pass
        return e

    def conn(self) -> Any:
        """The caller's connection with the set-up: psycopg, or a SQLAlchemy Connection."""
        if self.setup.engine:
            sa_conn = self.engine(pool_size=1).connect()
            self.stack.callback(sa_conn.close)
            return sa_conn
        c = psycopg.connect(self.setup_dsn, **self.setup.kwargs)
        self.stack.callback(c.close)
        if self.setup.configure is not None:
            self.setup.configure(c)
        return c

    def source(self, *, size: int = 4, reset: Callable[..., Any] | None = None) -> Any:
        """A ConnectionPool whose connections have the set-up, or a SQLAlchemy Engine."""
        if self.setup.engine:
            return self.engine(pool_size=size)
        pool: ConnectionPool[Any] = ConnectionPool(
            self.setup_dsn,
            kwargs=dict(self.setup.kwargs),
            configure=self.setup.configure,
            reset=reset,
            min_size=1,
            max_size=size,
            timeout=10,
            open=True,
        )
        self.stack.callback(pool.close)
        return pool

    def lease(self, source: object, name: str, **kw: Any) -> pglock.Lease:
        handle = pglock.lease(source, name, **kw)
        self.leases.append(handle)
        return handle

    @contextlib.contextmanager
    def txn(self, c: Any, *, commit: bool) -> Iterator[None]:
        """An explicit transaction on the caller's connection, committed or rolled back."""
        if isinstance(c, psycopg.Connection):
            if c.info.transaction_status != TransactionStatus.IDLE:
                c.rollback()
            with c.transaction(force_rollback=not commit):
                yield
            return
        if c.in_transaction():
            c.rollback()
        t = c.begin()
        try:
            yield
        except BaseException:
            t.rollback()
            raise
        if commit:
            t.commit()
        else:
            t.rollback()

    # refusals before any SQL

    def activity(self) -> dict[int, tuple[Any, ...]]:
        """What the set-up's sessions last ran: {pid: (query, state_change)}."""
        rows = self.obs.execute(
            "SELECT pid, query, state_change FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> ALL(%s)",
            (self.app_name, [self.obs.info.backend_pid, self.other_pid]),
        ).fetchall()
        return {pid: (q, sc) for pid, q, sc in rows}

    def first(self, fn: Callable[[], Any]) -> Any:
        """Run a first pglock call of the cell; a refusal it raises before any SQL (no
        session of the set-up ran a statement meanwhile) ends the cell as accepted."""
        before = self.activity()
        try:
            return fn()
        except (pglock.LockNotAcquired, pglock.LockLost):
            raise
        except (TypeError, ValueError, pglock.LockError) as exc:
            after = self.activity()
            ran = [
                pid for pid, now in after.items()
                if (before[pid] != now if pid in before else now[0] != "")
            ]
            vanished = set(before) - set(after)  # e.g. a pool discarding a connection it used
            if ran or vanished or not _raised_by_pglock(exc):
                raise  # SQL was sent, or psycopg failed on pglock's behalf: not a refusal
            raise Refused(f"{type(exc).__name__}: {exc}") from exc

    def untouched(self) -> None:
        """After a refusal: nothing held by the set-up's sessions, no lease row of the cell."""
        rows = self.obs.execute(
            "SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND a.application_name = %s AND l.pid <> %s",
            (self.app_name, self.other_pid),
        ).fetchall()
        assert rows == []
        n = self.obs.execute(
            "SELECT count(*) FROM pglock.lease WHERE name LIKE %s", (self.name + "%",)
        ).fetchone()
        assert n == (0,)

    def close(self) -> None:
        for handle in self.leases:
            if handle.locked:
                with contextlib.suppress(Exception):
                    handle.release()
        self.other.execute("SELECT pg_advisory_unlock_all()")
        try:
            self.stack.close()
        finally:
            _lease.shutdown()


@contextlib.contextmanager
def released_while_waiting(
    cell: Cell,
    *names: str,
    shared: bool = False,
    release: Callable[[], None] | None = None,
    waiter: Callable[[], Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """The contender (which holds ``names``) releases them once a waiter is seen (``waiter``,
    by default a session waiting for one of the names in pg_locks) and ``cell.delay`` more
    has passed. Yields what was seen: ``waiting`` (a waiter was seen before the release) and
    ``before`` (the holders just before the release)."""
    seen: dict[str, Any] = {}
    errors: list[BaseException] = []
    obs = cell.plain()
    check = waiter or (lambda: waiting(obs, *names))

    done = threading.Event()  # the waiter's call returned (or raised)

    def probe() -> str | None:
        return "done" if done.is_set() else "waiting" if check() else None

    def run() -> None:
        try:
            seen["waiting"] = wait_until(probe, 10) == "waiting"
            done.wait(cell.delay)
            seen["before"] = [holders(obs, n) for n in names]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            if release is not None:
                release()
            else:
                give(cell.other, *names, shared=shared)

    t = threading.Thread(target=run, name="matrix-release", daemon=True)
    t.start()
    try:
        yield seen
    finally:
        done.set()
        t.join(20)
        assert not t.is_alive()
        if errors:
            raise errors[0]


# --- the APIs: connection-based -----------------------------------------------------------------


def _pg_lock_t0(cell: Cell, names: list[str]) -> None:
    c = cell.conn()
    pid = pid_of(c)
    obs, other = cell.obs, cell.other
    arg: str | list[str] = names[0] if len(names) == 1 else names
    take(other, names[-1])
    h = cell.first(lambda: pglock.pg_lock(c, arg, timeout=0))
    assert cell.first(h.acquire) is False  # refused: the contender holds the (last) name
    assert not h.locked
    for n in names[:-1]:
        assert holders(obs, n) == []  # nothing half-held
    assert holders(obs, names[-1]) == [(cell.other_pid, X)]
    with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(c, arg, timeout=0):
        pytest.fail("the body ran without the lock")
    for n in names[:-1]:
        assert holders(obs, n) == []
    give(other, names[-1])
    assert h.acquire() is True  # granted: free now
    assert h.locked
    for n in names:
        assert holders(obs, n) == [(pid, X)]
        assert not can_take(other, n)
    h.release()
    for n in names:
        assert holders(obs, n) == []
    with pglock.pg_lock(c, arg, timeout=0):
        assert [holders(obs, n) for n in names] == [[(pid, X)]] * len(names)
    assert [holders(obs, n) for n in names] == [[]] * len(names)


def _pg_lock_t_positive(cell: Cell, names: list[str]) -> None:
    c = cell.conn()
    pid = pid_of(c)
    obs, other = cell.obs, cell.other
    arg: str | list[str] = names[0] if len(names) == 1 else names
    take(other, names[-1])
    h = cell.first(lambda: pglock.pg_lock(c, arg))
    assert cell.first(lambda: h.acquire(timeout=0.2)) is False
    assert not h.locked
    assert [holders(obs, n) for n in names[:-1]] == [[]] * (len(names) - 1)
    assert holders(obs, names[-1]) == [(cell.other_pid, X)]
    # timeout=5 waits past the role's 300 ms until the contender releases
    with released_while_waiting(cell, names[-1]) as seen:
        ok = h.acquire(timeout=5)
    assert seen["waiting"] and seen["before"][-1] == [(cell.other_pid, X)]
    assert ok is True
    assert [holders(obs, n) for n in names] == [[(pid, X)]] * len(names)
    h.release()
    assert [holders(obs, n) for n in names] == [[]] * len(names)


def _pg_lock_t_none(cell: Cell, names: list[str]) -> None:
    c = cell.conn()
    pid = pid_of(c)
    obs, other = cell.obs, cell.other
    arg: str | list[str] = names[0] if len(names) == 1 else names
    take(other, names[-1])
    h = cell.first(lambda: pglock.pg_lock(c, arg, timeout=None))
    with released_while_waiting(cell, names[-1]) as seen:
        ok = cell.first(h.acquire)
    # not granted while the contender held it; granted once it released
    assert seen["waiting"] and seen["before"][-1] == [(cell.other_pid, X)]
    assert ok is True
    assert [holders(obs, n) for n in names] == [[(pid, X)]] * len(names)
    h.release()
    assert [holders(obs, n) for n in names] == [[]] * len(names)
    # the with-form, which waits as long as needed by default
    take(other, names[-1])
    with released_while_waiting(cell, names[-1]) as seen, pglock.pg_lock(c, arg):
        assert [holders(obs, n) for n in names] == [[(pid, X)]] * len(names)
    assert seen["waiting"] and seen["before"][-1] == [(cell.other_pid, X)]
    assert [holders(obs, n) for n in names] == [[]] * len(names)


def _names(cell: Cell, many: bool) -> list[str]:
    return [cell.name + ":a", cell.name + ":b"] if many else [cell.name]


def api_pg_lock_one_t0(cell: Cell) -> None:
    _pg_lock_t0(cell, _names(cell, False))


def api_pg_lock_many_t0(cell: Cell) -> None:
    _pg_lock_t0(cell, _names(cell, True))


def api_pg_lock_one_t_positive(cell: Cell) -> None:
    _pg_lock_t_positive(cell, _names(cell, False))


def api_pg_lock_many_t_positive(cell: Cell) -> None:
    _pg_lock_t_positive(cell, _names(cell, True))


def api_pg_lock_one_t_none(cell: Cell) -> None:
    _pg_lock_t_none(cell, _names(cell, False))


def api_pg_lock_many_t_none(cell: Cell) -> None:
    _pg_lock_t_none(cell, _names(cell, True))


def api_xact_lock_t0(cell: Cell) -> None:
    c = cell.conn()
    pid = pid_of(c)
    obs, other, n = cell.obs, cell.other, cell.name
    take(other, n)
    with cell.txn(c, commit=False):
        with pytest.raises(pglock.LockNotAcquired):
            cell.first(lambda: pglock.xact_lock(c, n, timeout=0))
        assert holders(obs, n) == [(cell.other_pid, X)]
    give(other, n)
    with cell.txn(c, commit=True):
        pglock.xact_lock(c, n, timeout=0)
        assert holders(obs, n) == [(pid, X)]
        assert not can_take(other, n)
    assert holders(obs, n) == []  # released at commit


def api_xact_lock_t_none(cell: Cell) -> None:
    c = cell.conn()
    pid = pid_of(c)
    obs, other, n = cell.obs, cell.other, cell.name
    take(other, n)
    with cell.txn(c, commit=True):
        with released_while_waiting(cell, n) as seen:
            cell.first(lambda: pglock.xact_lock(c, n, timeout=None))
        assert seen["waiting"] and seen["before"] == [[(cell.other_pid, X)]]
        assert holders(obs, n) == [(pid, X)]
    assert holders(obs, n) == []


def api_try_xact_lock(cell: Cell) -> None:
    c = cell.conn()
    pid = pid_of(c)
    obs, other, n = cell.obs, cell.other, cell.name
    take(other, n)
    with cell.txn(c, commit=False):
        assert cell.first(lambda: pglock.try_xact_lock(c, n)) is False
        assert holders(obs, n) == [(cell.other_pid, X)]
    give(other, n)
    with cell.txn(c, commit=True):
        assert pglock.try_xact_lock(c, n) is True
        assert holders(obs, n) == [(pid, X)]
    assert holders(obs, n) == []
    # several names, one held by the contender: refused, and none of them held
    a, b = n + ":a", n + ":b"
    take(other, b)
    with cell.txn(c, commit=False):
        assert pglock.try_xact_lock(c, [a, b]) is False
        assert holders(obs, a) == [] and holders(obs, b) == [(cell.other_pid, X)]
    give(other, b)


def _rwlock(cell: Cell, source: object, pid: Callable[[Any], int]) -> None:
    obs, other, n = cell.obs, cell.other, cell.name
    rw = cell.first(lambda: pglock.rwlock(source, n))
    take(other, n, shared=True)
    with cell.first(lambda: rw.read(timeout=0)) as held:  # read/read coexist
        assert holders(obs, n) == sorted([(cell.other_pid, S), (pid(held), S)])
    with pytest.raises(pglock.LockNotAcquired), rw.write(timeout=0):  # waits for the reader
        pytest.fail("write granted while another session reads")
    assert holders(obs, n) == [(cell.other_pid, S)]
    give(other, n, shared=True)
    take(other, n)
    with pytest.raises(pglock.LockNotAcquired), rw.read(timeout=0):  # the writer excludes
        pytest.fail("read granted while another session writes")
    assert holders(obs, n) == [(cell.other_pid, X)]
    give(other, n)
    with rw.write(timeout=0) as held:
        assert holders(obs, n) == [(pid(held), X)]
        row = other.execute("SELECT pg_try_advisory_lock_shared(%s)", (pglock.key(n),))
        assert row.fetchone() == (False,)
    assert holders(obs, n) == []


def api_rwlock_conn(cell: Cell) -> None:
    _rwlock(cell, cell.conn(), pid_of)


def api_guard(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    a = cell.lease(cell.dsn, n, ttl=5, keepalive=False)
    assert a.acquire(timeout=0)
    c = cell.conn()
    with cell.txn(c, commit=True):
        assert cell.first(lambda: a.guard(c)) is None
        # the guard holds the lease row until the caller's transaction ends
        with pytest.raises(psycopg.errors.LockNotAvailable):
            obs.execute("SELECT 1 FROM pglock.lease WHERE name = %s FOR UPDATE NOWAIT", (n,))
    obs.execute("SELECT 1 FROM pglock.lease WHERE name = %s FOR UPDATE NOWAIT", (n,))
    a.release()
    # a lease lost on the server (now another holder's): the guard refuses
    lost = n + ":lost"
    x, y = _lost_lease(cell, cell.dsn, lost)
    with cell.txn(c, commit=False), pytest.raises(pglock.LockLost):
        x.guard(c)
    assert lease_row(obs, lost) == ("y", y.token, False)
    y.release()


def _same_info(got: Any, want: Any) -> None:
    fields = ("name", "holder", "token", "acquired_at", "expires_at", "metadata")
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    assert type(got.token) is int and type(got.holder) is str and type(got.name) is str
    assert isinstance(got.acquired_at, dt.datetime) and got.acquired_at.tzinfo is not None
    assert isinstance(got.expires_at, dt.datetime) and got.expires_at.tzinfo is not None
    assert type(got.metadata) is dict
    assert isinstance(got.expires_in, float) and 0 < got.expires_in <= 5


def api_lease_info(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    meta = {"by": "matrix", "n": [1, 2], "ok": True, "none": None}
    a = cell.lease(cell.dsn, n, holder="a", ttl=5, keepalive=False, metadata=meta)
    assert a.acquire(timeout=0)
    want = pglock.lease_info(obs, n)  # psycopg defaults
    assert want is not None and want.metadata == meta and want.token == a.token
    c = cell.conn()
    got = cell.first(lambda: pglock.lease_info(c, n))
    assert got is not None
    _same_info(got, want)
    listed = pglock.list_leases(c, prefix=n)
    assert len(listed) == 1
    _same_info(listed[0], want)
    assert pglock.lease_info(c, n + ":nobody") is None
    assert pglock.list_leases(c, prefix=n + ":nobody") == []
    a.release()
    assert pglock.lease_info(c, n) is None
    assert pglock.list_leases(c, prefix=n) == []


def api_advisory_locks(cell: Cell) -> None:
    obs, other, n = cell.obs, cell.other, cell.name
    held = pglock.pg_lock(other, n, timeout=0)  # through pglock: the name is registered
    assert held.acquire()
    try:
        c = cell.conn()
        rows = cell.first(lambda: pglock.advisory_locks(c, n))
        assert len(rows) == 1
        r = rows[0]
        assert type(r.key) is int and r.key == pglock.key(n)
        assert r.name == n
        assert type(r.pid) is int and r.pid == cell.other_pid
        assert (r.mode, r.granted) == ("exclusive", True)
        assert r.granted is True
        assert pglock.advisory_locks(c, n + ":free") == []
        everyone = pglock.advisory_locks(c)
        assert [(x.key, x.pid) for x in everyone if x.name == n] == [(r.key, r.pid)]
    finally:
        held.release()
    assert pglock.advisory_locks(c, n) == []
    assert holders(obs, n) == []


def api_status(cell: Cell) -> None:
    """What ``pglock status`` shows (its --json document), read through the set-up."""
    from pglock.cli import status_snapshot

    obs, other, n = cell.obs, cell.other, cell.name
    held = pglock.pg_lock(other, n, timeout=0)
    assert held.acquire()
    lease = pglock.lease(cell.dsn, f"{n}:lease", ttl=30)
    assert lease.acquire(timeout=0)
    try:
        c = cell.conn()
        doc = cell.first(lambda: status_snapshot(c, [n, f"{n}:lease"], "pglock"))
        assert doc["schema_installed"] is True
        assert [(d["key"], d["name"], d["pid"], d["granted"]) for d in doc["advisory_locks"]] == [
            (pglock.key(n), n, cell.other_pid, True)
        ]
        assert [(d["name"], d["holder"], d["token"]) for d in doc["leases"]] == [
            (f"{n}:lease", lease.holder, lease.token)
        ]
        assert type(doc["server_version"]) is str and type(doc["database"]) is str
    finally:
        lease.release()
        held.release()
    assert status_snapshot(c, [n], "pglock")["advisory_locks"] == []
    assert holders(obs, n) == []


# --- the APIs: source-based ---------------------------------------------------------------------


def api_pool_lock(cell: Cell) -> None:
    obs, other, n = cell.obs, cell.other, cell.name
    src = cell.source()
    take(other, n)

    def enter() -> None:
        with pglock.pool_lock(src, n, timeout=0):
            pytest.fail("the body ran without the lock")

    with pytest.raises(pglock.LockNotAcquired):
        cell.first(enter)
    assert holders(obs, n) == [(cell.other_pid, X)]
    give(other, n)
    with pglock.pool_lock(src, n, timeout=0) as pc:
        assert holders(obs, n) == [(pid_of(pc), X)]
        assert not can_take(other, n)
    assert holders(obs, n) == []


def api_locker(cell: Cell) -> None:
    obs, other, n = cell.obs, cell.other, cell.name
    locker = pglock.Locker(cell.source())
    cell.stack.callback(locker.close)
    take(other, n)

    def enter() -> None:
        with locker.lock(n, timeout=0):
            pytest.fail("the body ran without the lock")

    with pytest.raises(pglock.LockNotAcquired):
        cell.first(enter)
    give(other, n)
    with locker.lock(n, timeout=0) as pc:
        assert holders(obs, n) == [(pid_of(pc), X)]
        assert not can_take(other, n)
    assert holders(obs, n) == []


def api_reset_hook(cell: Cell) -> None:
    """The pool's reset hook releases what a returned connection holds, and keeps the
    connection (a hook that fails makes the pool discard every connection)."""
    obs, other, n = cell.obs, cell.other, cell.name
    mine, theirs = n + ":leaked", n + ":theirs"
    take(other, theirs)  # another session's lock: the hook must leave it alone
    lock_sql = sql.SQL("SELECT pg_advisory_lock({})").format(sql.Literal(pglock.key(mine)))
    if cell.setup.engine:
        engine = cell.source(size=1)
        pglock.sqlalchemy.release_on_checkin(engine)
        with engine.connect() as sc:
            pid = pid_of(sc)
            driver(sc).execute(lock_sql)
            assert holders(obs, mine) == [(pid, X)]
            h = pglock.pg_lock(sc, n)  # a pglock block left open
            h.acquire()
            assert holders(obs, n) == [(pid, X)]
        # checked in: the reset event ran
        with engine.connect() as sc:
            assert pid_of(sc) == pid  # kept, not invalidated
    else:
        pool = cell.source(size=1, reset=pglock.reset_connection)
        pc = pool.getconn()
        pid = pid_of(pc)
        pc.execute(lock_sql)
        assert holders(obs, mine) == [(pid, X)]
        pool.putconn(pc)
        # psycopg_pool runs the hook in its worker thread after putconn() returns
        assert wait_until(lambda: holders(obs, mine) == [], 5)
        pc = pool.getconn()
        try:
            assert pid_of(pc) == pid  # kept, not discarded
        finally:
            pool.putconn(pc)
        h = None
    assert holders(obs, mine) == []
    assert holders(obs, n) == []
    if h is not None:
        with pytest.raises(pglock.LockLost):
            h.release()
    assert holders(obs, theirs) == [(cell.other_pid, X)]
    give(other, theirs)


def api_lease_acquire(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    a = cell.lease(src, n, holder="a", ttl=2, keepalive=False)
    assert cell.first(lambda: a.acquire(timeout=0)) is True
    b = cell.lease(src, n, holder="b", ttl=2, keepalive=False)
    assert b.acquire(timeout=0) is False  # refused while "a" holds it
    assert (b.locked, b.token) == (False, None)
    assert a.locked and type(a.token) is int and a.token > 0
    assert lease_row(obs, n) == ("a", a.token, False)
    first = a.token
    a.release()
    assert lease_row(obs, n) is None
    assert b.acquire(timeout=0) is True
    assert type(b.token) is int and b.token > first
    assert lease_row(obs, n) == ("b", b.token, False)
    b.release()
    assert lease_row(obs, n) is None


def _lost_lease(cell: Cell, src: object, name: str) -> tuple[pglock.Lease, pglock.Lease]:
    """A lease of holder "x" lost on the server while the client still believes it holds it
    (its row deleted by hand, its client deadline far away), now held by holder "y": only
    the server's answer, read through the set-up, can tell "x" it lost."""
    x = cell.lease(src, name, holder="x", ttl=30, keepalive=False)
    assert x.acquire(timeout=0)
    cell.obs.execute("DELETE FROM pglock.lease WHERE name = %s", (name,))
    y = cell.lease(cell.dsn, name, holder="y", ttl=30, keepalive=False)
    assert y.acquire(timeout=0)
    assert x.locked and not x.lost  # the client's belief
    return x, y


def api_lease_extend(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    a = cell.lease(src, n, ttl=1, keepalive=False)
    assert cell.first(lambda: a.acquire(timeout=0))
    before = row_of(obs, n)
    assert before is not None
    a.extend(3)
    after = row_of(obs, n)
    assert after is not None
    assert after[1] == a.token == before[1]  # same token
    assert after[3] > before[3] and a.expires_at == after[3]
    a.release()
    x, y = _lost_lease(cell, src, n + ":lost")
    with pytest.raises(pglock.LockLost):
        x.extend(3)
    assert lease_row(obs, n + ":lost") == ("y", y.token, False)
    y.release()


def api_lease_release(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    a = cell.lease(src, n, ttl=5, keepalive=False)
    assert cell.first(lambda: a.acquire(timeout=0))
    assert lease_row(obs, n) == (a.holder, a.token, False)
    a.release()
    assert lease_row(obs, n) is None and not a.locked
    x, y = _lost_lease(cell, src, n + ":lost")
    with pytest.raises(pglock.LockLost):
        x.release()
    assert lease_row(obs, n + ":lost") == ("y", y.token, False)  # the new holder's row stays
    y.release()


def api_lease_keepalive(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    a = cell.lease(src, n, holder="a", ttl=1, keepalive=True)
    assert cell.first(lambda: a.acquire(timeout=0))
    first = row_of(obs, n)
    assert first is not None

    def past_first_expiry() -> bool:
        row = obs.execute(
            "SELECT clock_timestamp() > %s + interval '300 milliseconds'", (first[3],)
        ).fetchone()
        return bool(row and row[0])

    assert wait_until(past_first_expiry, 10)
    # renewed: the same grant (token) lives past its first expiry, and excludes others
    assert lease_row(obs, n) == ("a", a.token, False)
    b = cell.lease(src, n, holder="b", ttl=1, keepalive=False)
    assert b.acquire(timeout=0) is False
    a.check()
    a.release()
    assert lease_row(obs, n) is None


def api_lease_wait(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    a = cell.lease(cell.dsn, n, holder="a", ttl=10, keepalive=False)
    assert a.acquire(timeout=0)
    b = cell.lease(src, n, holder="b", ttl=2, keepalive=False)
    with released_while_waiting(cell, release=a.release, waiter=lambda: True) as seen:
        ok = cell.first(lambda: b.acquire(timeout=None))
    assert seen["waiting"]
    assert ok is True and b.locked
    assert lease_row(obs, n) == ("b", b.token, False)
    b.release()


def api_lease_takeover(cell: Cell) -> None:
    """Taking over an expired lease waits on the server (FOR UPDATE) for a transaction that
    passed the old holder's guard(): refused at timeout=0, granted once it ends."""
    obs, n = cell.obs, cell.name
    src = cell.source()
    a = cell.lease(cell.dsn, n, holder="a", ttl=0.3, keepalive=False)
    assert a.acquire(timeout=0)
    guarded = psycopg.connect(cell.dsn)
    cell.stack.callback(guarded.close)
    a.guard(guarded)  # holds the lease row until guarded's transaction ends
    sleep_until_expired(obs, n)
    b = cell.lease(src, n, holder="b", ttl=2, keepalive=False)
    assert cell.first(lambda: b.acquire(timeout=0)) is False
    assert not b.locked
    assert lease_row(obs, n) == ("a", a.token, True)
    with released_while_waiting(cell, release=guarded.commit, waiter=lambda: True) as seen:
        ok = b.acquire(timeout=None)
    assert seen["waiting"] and ok is True
    assert lease_row(obs, n) == ("b", b.token, False)
    assert type(b.token) is int and type(a.token) is int and b.token > a.token
    b.release()


def api_semaphore(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    s1 = pglock.semaphore(src, n, 1, ttl=2)
    s2 = pglock.semaphore(src, n, 1, ttl=2)
    cell.stack.callback(s1.close)
    cell.stack.callback(s2.close)
    assert cell.first(lambda: s1.acquire(timeout=0)) is True
    assert live_permits(obs, n) == 1
    assert s2.acquire(timeout=0) is False  # limit 1: the second holder is refused
    assert live_permits(obs, n) == 1
    count = s2.count()
    assert type(count) is int and count == 1
    if not cell.setup.engine:  # semaphores() reads through a connection of the set-up
        infos = pglock.semaphores(cell.conn(), n)
        assert [(i.name, i.limit, i.held, len(i.holders)) for i in infos] == [(n, 1, 1, 1)]
        assert all(type(v) is int for v in (infos[0].limit, infos[0].held))
        assert pglock.semaphores(cell.conn(), n + ":none") == []
    s1.release()
    assert live_permits(obs, n) == 0 and s2.count() == 0
    assert s2.acquire(timeout=0) is True
    assert live_permits(obs, n) == 1
    s2.release()
    assert live_permits(obs, n) == 0


def api_semaphore_wait(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    s0 = pglock.semaphore(cell.dsn, n, 1, ttl=10)
    s1 = pglock.semaphore(src, n, 1, ttl=2)
    cell.stack.callback(s0.close)
    cell.stack.callback(s1.close)
    hold = s0.hold(timeout=0)
    with hold as permit, released_while_waiting(  # a Permit is released from any thread
        cell, release=permit.release, waiter=lambda: True
    ) as seen:
        ok = cell.first(lambda: s1.acquire(timeout=None))
    assert seen["waiting"] and ok is True
    assert live_permits(obs, n) == 1
    s1.release()
    assert live_permits(obs, n) == 0


def api_rwlock_pool(cell: Cell) -> None:
    _rwlock(cell, cell.source(), pid_of)


def api_leader(cell: Cell) -> None:
    obs, n = cell.obs, cell.name
    src = cell.source()
    made: list[pglock.LeaderElection] = []
    try:
        e1 = cell.first(lambda: pglock.leader(src, n, check_interval=0.1))
        made.append(e1)
        cell.first(e1.start)
        assert e1.wait_elected(timeout=10) is True and e1.is_leader
        e2 = pglock.leader(src, n, check_interval=0.1)
        made.append(e2)
        e2.start()
        assert e2.wait_elected(timeout=0.3) is False and not e2.is_leader
        assert len(holders(obs, n)) == 1  # one leader session
        e1.resign()
        assert e2.wait_elected(timeout=10) is True and e2.is_leader
        assert not e1.is_leader and len(holders(obs, n)) == 1
    finally:
        for e in made:
            e.resign()
    # resign() closes the leader's session: its backend drops the lock as it exits
    assert wait_until(lambda: holders(obs, n) == [], 5)


def api_singleton(cell: Cell) -> None:
    obs, other, n = cell.obs, cell.other, cell.name
    src = cell.source()
    calls: list[list[tuple[int, str]]] = []

    def job() -> str:
        calls.append(holders(obs, n))
        return "ran"

    run = cell.first(lambda: pglock.singleton(src, n)(job))
    take(other, n)
    assert cell.first(run) is None and calls == []  # skipped: held elsewhere
    give(other, n)
    assert run() == "ran"
    assert len(calls) == 1 and len(calls[0]) == 1 and calls[0][0][1] == X
    assert calls[0][0][0] != cell.other_pid
    assert holders(obs, n) == []


API: dict[str, Callable[[Cell], None]] = {
    "pg_lock-one-t0": api_pg_lock_one_t0,
    "pg_lock-one-t0.2": api_pg_lock_one_t_positive,
    "pg_lock-one-tNone": api_pg_lock_one_t_none,
    "pg_lock-many-t0": api_pg_lock_many_t0,
    "pg_lock-many-t0.2": api_pg_lock_many_t_positive,
    "pg_lock-many-tNone": api_pg_lock_many_t_none,
    "xact_lock-t0": api_xact_lock_t0,
    "xact_lock-tNone": api_xact_lock_t_none,
    "try_xact_lock": api_try_xact_lock,
    "rwlock-conn": api_rwlock_conn,
    "guard": api_guard,
    "lease_info": api_lease_info,
    "advisory_locks": api_advisory_locks,
    "status": api_status,
    "pool_lock": api_pool_lock,
    "Locker": api_locker,
    "reset_hook": api_reset_hook,
    "lease-acquire": api_lease_acquire,
    "lease-extend": api_lease_extend,
    "lease-release": api_lease_release,
    "lease-keepalive": api_lease_keepalive,
    "lease-wait": api_lease_wait,
    "lease-takeover": api_lease_takeover,
    "semaphore": api_semaphore,
    "semaphore-wait": api_semaphore_wait,
    "rwlock-pool": api_rwlock_pool,
    "leader": api_leader,
    "singleton": api_singleton,
}

CELLS = [
    pytest.param(api, setup, id=f"{api}@{setup.id}") for api in API for setup in SETUPS
]


@pytest.mark.parametrize(("api", "setup"), CELLS)
def test_cell(
    api: str, setup: Setup, db: str, role: str, app_name: str, name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cell = Cell(setup, db, role, app_name, name)
    try:
        API[api](cell)
    except Refused as refusal:
        cell.untouched()
        with capsys.disabled():
            print(f"\n{api}@{setup.id}: refused before any SQL: {refusal}")
    finally:
        cell.close()


def test_the_matrix_covers_the_public_lock_api() -> None:
    """A new public lock API gets a row here (and so a cell per set-up)."""
    covered = {
        "pg_lock", "xact_lock", "try_xact_lock", "rwlock", "lease", "lease_info",
        "list_leases", "advisory_locks", "pool_lock", "Locker", "reset_connection",
        "semaphore", "semaphores", "leader", "singleton",
    }
    # not lock APIs: the key function, the schema install, the telemetry switch, error and value
    # classes, and the handle classes the factories above return
    other = {
        "key", "install", "configure_telemetry", "MAX_NAME_BYTES", "__version__", "AdvisoryLock",
        "LeaseInfo",
        "SemaphoreHolder", "SemaphoreInfo", "Lease", "LeaderElection", "Permit", "PgLock",
        "PoolLock", "RWLock", "Semaphore", "Singleton",
    }
    errors = {n for n in pglock.__all__ if isinstance(getattr(pglock, n), type)
              and issubclass(getattr(pglock, n), Exception)}
    assert set(pglock.__all__) - covered - other - errors == set()
