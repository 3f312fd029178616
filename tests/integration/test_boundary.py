"""Regression tests for issue 11, items 1, 2, 8, 10 and 14: the caller's connection settings
(row factory, cursor class, loaders, the role's and session's timeouts) must change no answer
pglock gives. The whole matrix of APIs x set-ups is in test_connection_matrix.py; these are
the cases exactly as the issue reports them.

Every assertion is about the server's truth (``pg_locks``, the lease table) and return
values, never about durations.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import with_params
from _truth import holders
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool
from test_connection_matrix import timeout_role
from test_lease_support import row_of, sleep_until_expired, wait_until

import pglock

pytestmark = pytest.mark.timeout(60)

X = "ExclusiveLock"
Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture
def dbconnect(dsn: str) -> Iterator[Connect]:
    """Connections to the module's database (autocommit by default); closed after the test."""
    opened: list[psycopg.Connection[Any]] = []

    def factory(autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
        c = psycopg.connect(dsn, autocommit=autocommit, **kwargs)
        opened.append(c)
        return c

    yield factory
    for c in opened:
        with contextlib.suppress(Exception):
            c.close()


@pytest.fixture
def admin(dbconnect: Connect) -> psycopg.Connection[Any]:
    return dbconnect()


@pytest.fixture
def pools(dsn: str) -> Iterator[Callable[..., ConnectionPool[Any]]]:
    made: list[ConnectionPool[Any]] = []

    def factory(conninfo: str | None = None, **kw: Any) -> ConnectionPool[Any]:
        kw.setdefault("min_size", 1)
        kw.setdefault("max_size", 4)
        p: ConnectionPool[Any] = ConnectionPool(conninfo or dsn, open=True, timeout=10, **kw)
        made.append(p)
        return p

    yield factory
    for p in made:
        p.close()


@pytest.fixture(scope="module")
def role(pg_dsn: str, db: str) -> Iterator[str]:
    """A LOGIN role with statement_timeout and lock_timeout of 300 ms (ALTER ROLE ... SET)."""
    with timeout_role(pg_dsn, db) as r:
        yield r


def take(c: psycopg.Connection[Any], name: str) -> None:
    c.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))


def give(c: psycopg.Connection[Any], name: str) -> None:
    assert c.execute("SELECT pg_advisory_unlock(%s)", (pglock.key(name),)).fetchone() == (True,)


def waiting(obs: psycopg.Connection[Any], name: str) -> bool:
    row = obs.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND (classid::bigint << 32) | objid::bigint = %s",
        (pglock.key(name),),
    ).fetchone()
    return bool(row and row[0])


@contextlib.contextmanager
def released_after(
    release: Callable[[], None], hold: float, seen_waiting: Callable[[], bool] | None = None
) -> Iterator[dict[str, bool]]:
    """Call ``release`` in a thread ``hold`` seconds after a waiter is seen (``seen_waiting``;
    at once if None), or as soon as the block ends. Yields {"waited": a waiter was seen and
    the block was still running when the release was sent}."""
    out = {"waited": False}
    done = threading.Event()

    def run() -> None:
        try:
            seen = wait_until(lambda: done.is_set() or (seen_waiting or (lambda: True))(), 10)
            if seen and not done.is_set() and not done.wait(hold):
                out["waited"] = True
        finally:
            release()

    t = threading.Thread(target=run, name="boundary-release", daemon=True)
    t.start()
    try:
        yield out
    finally:
        done.set()
        t.join(20)
        assert not t.is_alive()


# --- item 1: a dict_row pool grants a lease that another holder has -------------------------------


def test_item1_dict_row_pool_second_lease_holder_is_refused(
    pools: Callable[..., ConnectionPool[Any]], admin: psycopg.Connection[Any], name: str
) -> None:
    pool = pools(kwargs={"row_factory": dict_row})
    a = pglock.lease(pool, name, holder="a", ttl=5, keepalive=False)
    assert a.acquire(timeout=0) is True
    b = pglock.lease(pool, name, holder="b", ttl=5, keepalive=False)
    try:
        assert b.acquire(timeout=0) is False  # the refusal row read by name, not by position
        assert not b.locked and b.token is None
        assert type(a.token) is int  # not the column name "token"
        row = row_of(admin, name)
        assert row is not None and (row[0], row[1], row[5]) == ("a", a.token, False)
    finally:
        for h in (b, a):
            if h.locked:
                with contextlib.suppress(Exception):  # cleanup only
                    h.release()
    assert row_of(admin, name) is None


# --- item 2: dict_row switched on after pglock's first use ----------------------------------------


def test_item2_dict_row_after_first_use(dbconnect: Connect, name: str) -> None:
    c, other, obs = dbconnect(), dbconnect(), dbconnect()
    with pglock.pg_lock(c, name, timeout=0):  # first use: pglock learns about the connection
        pass
    c.row_factory = dict_row
    take(other, name)
    with c.transaction(force_rollback=True):
        assert pglock.try_xact_lock(c, name) is False
        assert holders(obs, name) == [(other.info.backend_pid, X)]
    give(other, name)

    a, b = name + ":a", name + ":b"
    take(other, b)
    lock = pglock.pg_lock(c, [a, b], timeout=0)
    try:
        assert lock.acquire() is False
        assert not lock.locked
        assert holders(obs, a) == []  # not half-held
        assert holders(obs, b) == [(other.info.backend_pid, X)]
    finally:
        if lock.locked:
            lock.release()
        give(other, b)
    # and it still grants: both names, on this connection
    with pglock.pg_lock(c, [a, b], timeout=0):
        assert holders(obs, a) == holders(obs, b) == [(c.info.backend_pid, X)]
    assert holders(obs, a) == holders(obs, b) == []


# --- item 8: leases through a ClientCursor pool are renewed ---------------------------------------


def test_item8_client_cursor_pool_lease_is_renewed(
    pools: Callable[..., ConnectionPool[Any]], admin: psycopg.Connection[Any], name: str
) -> None:
    """The usual PgBouncer set-up: the batch renewal must not ask for binary results that a
    ClientCursor refuses. A lease with ttl=1.5 held for 4 s keeps its row and token."""
    pool = pools(kwargs={"cursor_factory": psycopg.ClientCursor, "prepare_threshold": None})
    lease = pglock.lease(pool, name, holder="a", ttl=1.5)
    assert lease.acquire(timeout=0)
    token = lease.token
    first = row_of(admin, name)
    assert first is not None
    try:

        def held_for_4s() -> bool:
            row = admin.execute(
                "SELECT clock_timestamp() >= %s::timestamptz + interval '2.5 seconds'",
                (first[3],),  # first expiry (acquired + 1.5 s) + 2.5 s = 4 s after the grant
            ).fetchone()
            return bool(row and row[0])

        assert wait_until(held_for_4s, 10, interval=0.1)
        row = row_of(admin, name)
        assert row is not None
        assert (row[0], row[1], row[5]) == ("a", token, False)  # renewed: same grant, alive
        assert row[3] > first[3]
        lease.check()
        assert lease.locked and lease.token == token
        b = pglock.lease(pool, name, holder="b", ttl=1.5, keepalive=False)
        assert b.acquire(timeout=0) is False
    finally:
        if lease.locked:
            with contextlib.suppress(Exception):  # cleanup only
                lease.release()


# --- item 10: timeout=None outlasts the role's and the session's own timeouts ---------------------


@pytest.fixture
def role_dsn(dsn: str, role: str) -> str:
    return with_params(dsn, user=role)


WAITS = [
    pytest.param("pg_lock.acquire", None, id="pg_lock-acquire-None"),
    pytest.param("pg_lock.acquire", 5, id="pg_lock-acquire-5"),
    pytest.param("with pg_lock", None, id="with-pg_lock-None"),
    pytest.param("with pg_lock", 5, id="with-pg_lock-5"),
    pytest.param("xact_lock", None, id="xact_lock-None"),
    pytest.param("xact_lock", 5, id="xact_lock-5"),
    pytest.param("pg_lock many", None, id="pg_lock-many-None"),
]


def _wait_for_lock(c: psycopg.Connection[Any], how: str, name: str, timeout: float | None,
                   obs: psycopg.Connection[Any]) -> None:
    """Take ``name`` on ``c`` the way ``how`` says, waiting up to ``timeout``; assert that it
    is held there, and release it."""
    pid = c.info.backend_pid
    if how == "pg_lock.acquire":
        lock = pglock.pg_lock(c, name, timeout=timeout)
        assert lock.acquire() is True
        assert holders(obs, name) == [(pid, X)]
        lock.release()
    elif how == "with pg_lock":
        with pglock.pg_lock(c, name, timeout=timeout):
            assert holders(obs, name) == [(pid, X)]
    elif how == "pg_lock many":
        with pglock.pg_lock(c, [name + ":free", name], timeout=timeout):
            assert holders(obs, name) == holders(obs, name + ":free") == [(pid, X)]
    else:
        with c.transaction():
            pglock.xact_lock(c, name, timeout=timeout)
            assert holders(obs, name) == [(pid, X)]
    assert holders(obs, name) == []


@pytest.mark.parametrize(("how", "timeout"), WAITS)
def test_item10_wait_outlasts_the_roles_timeouts(
    dbconnect: Connect, role_dsn: str, how: str, timeout: float | None, name: str
) -> None:
    """``ALTER ROLE app SET statement_timeout = '300ms'`` (and lock_timeout): another session
    holds the name for about 1 s; ``timeout=None`` ("wait until acquired") and ``timeout=5``
    must both get it after the release, not give up at 300 ms."""
    other, obs = dbconnect(), dbconnect()
    c = psycopg.connect(role_dsn, autocommit=True)
    try:
        shown = c.execute("SELECT current_setting('statement_timeout'),"
                          " current_setting('lock_timeout')").fetchone()
        assert shown == ("300ms", "300ms")
        take(other, name)
        with released_after(lambda: give(other, name), 1.0, lambda: waiting(obs, name)) as r:
            _wait_for_lock(c, how, name, timeout, obs)
        assert r["waited"]  # it was still waiting, past the role's 300 ms, at the release
    finally:
        c.close()


def test_item10_wait_outlasts_the_sessions_own_timeouts(dbconnect: Connect, name: str) -> None:
    """The same with ``SET statement_timeout`` / ``SET lock_timeout`` on the caller's own
    connection; pglock's override ends with its statement (the caller's settings stay)."""
    other, obs = dbconnect(), dbconnect()
    c = dbconnect()
    c.execute("SET statement_timeout = '300ms'")
    c.execute("SET lock_timeout = '300ms'")
    for how in ("pg_lock.acquire", "with pg_lock", "xact_lock"):
        take(other, name)
        with released_after(lambda: give(other, name), 1.0, lambda: waiting(obs, name)) as r:
            _wait_for_lock(c, how, name, None, obs)
        assert r["waited"], how
        shown = c.execute("SELECT current_setting('statement_timeout'),"
                          " current_setting('lock_timeout')").fetchone()
        assert shown == ("300ms", "300ms"), how


@pytest.mark.parametrize("timeout", [None, 5], ids=["None", "5"])
def test_item10_lease_takeover_behind_a_guard_outlasts_the_roles_timeouts(
    pools: Callable[..., ConnectionPool[Any]], role_dsn: str, dsn: str, dbconnect: Connect,
    admin: psycopg.Connection[Any], name: str, timeout: float | None,
) -> None:
    """The lease wait that runs on the server: taking over an expired lease waits (FOR
    UPDATE) for a transaction that passed the old holder's ``guard()``. Through a pool logged
    in as the role, that wait must outlast the role's 300 ms (the guard ends after ~1 s)."""
    a = pglock.lease(dsn, name, holder="a", ttl=0.3, keepalive=False)
    assert a.acquire(timeout=0)
    guarded = dbconnect(autocommit=False)
    a.guard(guarded)  # the transaction holds the lease row until it ends
    sleep_until_expired(admin, name)
    pool = pools(role_dsn)
    b = pglock.lease(pool, name, holder="b", ttl=30, keepalive=False)
    try:
        with released_after(guarded.commit, 1.0) as r:
            assert b.acquire(timeout=timeout) is True
        assert r["waited"]
        row = row_of(admin, name)
        assert row is not None and (row[0], row[1]) == ("b", b.token)
        assert isinstance(a.token, int) and isinstance(b.token, int) and b.token > a.token
    finally:
        if b.locked:
            with contextlib.suppress(Exception):  # cleanup only
                b.release()


def test_item10_lease_and_semaphore_waits_through_the_roles_pool(
    pools: Callable[..., ConnectionPool[Any]], role_dsn: str, dsn: str,
    admin: psycopg.Connection[Any], name: str,
) -> None:
    """Leases and semaphores whose waits run on the role's sessions (a pool logged in as the
    role): ``timeout=None`` waits past the role's 300 ms until the holder releases (~1 s)."""
    pool = pools(role_dsn)
    a = pglock.lease(dsn, name, holder="a", ttl=30, keepalive=False)
    assert a.acquire(timeout=0)
    b = pglock.lease(pool, name, holder="b", ttl=30, keepalive=False)
    try:
        with released_after(a.release, 1.0) as r:
            assert b.acquire(timeout=None) is True
        assert r["waited"]
        row = row_of(admin, name)
        assert row is not None and (row[0], row[1]) == ("b", b.token)
    finally:
        for h in (a, b):
            if h.locked:
                with contextlib.suppress(Exception):  # cleanup only
                    h.release()

    sem_name = name + ":sem"
    s0 = pglock.semaphore(dsn, sem_name, 1, ttl=30)
    s1 = pglock.semaphore(pool, sem_name, 1, ttl=30)
    try:
        with s0.hold(timeout=0) as permit, released_after(permit.release, 1.0) as r:
            assert s1.acquire(timeout=None) is True
        assert r["waited"]
        s1.release()
    finally:
        s0.close()
        s1.close()


# --- item 14: dict_row and RawCursor connections ------------------------------------------------


def test_item14_dict_row_connection_is_not_a_hot_standby(dbconnect: Connect, name: str) -> None:
    c, obs = dbconnect(row_factory=dict_row), dbconnect()
    with pglock.pg_lock(c, name, timeout=0):  # not UnsupportedServer("hot standby")
        assert holders(obs, name) == [(c.info.backend_pid, X)]
    assert holders(obs, name) == []


def test_item14_raw_cursor_connection_locks(dbconnect: Connect, name: str) -> None:
    c, obs = dbconnect(cursor_factory=psycopg.RawCursor), dbconnect()
    with pglock.pg_lock(c, name, timeout=0):  # no syntax error at "%s"
        assert holders(obs, name) == [(c.info.backend_pid, X)]
    assert holders(obs, name) == []


def _raw_lock(c: psycopg.Connection[Any], name: str) -> None:
    """Take ``name`` by raw SQL that any cursor class runs (no parameters)."""
    c.execute(sql.SQL("SELECT pg_advisory_lock({})").format(sql.Literal(pglock.key(name))))


def test_item14_reset_connection_on_dict_row(dbconnect: Connect, name: str) -> None:
    c, obs = dbconnect(row_factory=dict_row), dbconnect()
    _raw_lock(c, name)
    assert holders(obs, name) == [(c.info.backend_pid, X)]
    pglock.reset_connection(c)  # not KeyError
    assert holders(obs, name) == []
    assert not c.closed and c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_item14_dict_row_pool_keeps_its_connections(
    pools: Callable[..., ConnectionPool[Any]], admin: psycopg.Connection[Any], name: str
) -> None:
    """With ``reset=pglock.reset_connection`` a dict_row pool releases the lock at check-in
    and keeps the connection (a hook that raises makes psycopg_pool close every one)."""
    pool = pools(kwargs={"row_factory": dict_row}, reset=pglock.reset_connection,
                 min_size=1, max_size=1)
    for _ in range(3):
        c = pool.getconn()
        pid = c.info.backend_pid
        _raw_lock(c, name)
        pool.putconn(c)
        # psycopg_pool runs the hook in its worker thread, after putconn() returns
        assert wait_until(lambda: holders(admin, name) == [], 5)
        c = pool.getconn()
        try:
            assert c.info.backend_pid == pid  # the same session: kept, not discarded
        finally:
            pool.putconn(c)


def test_pglocks_prepared_statements_survive_the_callers_deallocate(
    dbconnect: Connect, name: str
) -> None:
    """pglock prepares its lock statements on a connection (outside transactions only): a
    caller's DEALLOCATE ALL or DISCARD ALL makes the next one prepare them again, and inside a
    transaction pglock never relies on them (a missing one would abort the caller's work)."""
    c, obs = dbconnect(autocommit=False), dbconnect()
    for _ in range(2):  # the first may carry the name's registration, as a batch of its own
        with pglock.pg_lock(c, name):
            pass
    prepared = c.execute("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '_pglock_%'")
    assert prepared.fetchone() == (2,)  # the lock and the unlock
    c.commit()
    for reset in ("DEALLOCATE ALL", "DISCARD ALL"):
        c.autocommit = True
        c.execute(reset)
        c.autocommit = False
        with c.transaction():
            with pglock.pg_lock(c, name):
                assert holders(obs, name) == [(c.info.backend_pid, X)]
            assert c.execute("SELECT 1").fetchone() == (1,)  # the transaction is usable
        with pglock.pg_lock(c, name):  # outside a transaction: prepared again
            assert holders(obs, name) == [(c.info.backend_pid, X)]
        assert holders(obs, name) == []
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    # A pool reset makes pglock forget the connection, not its prepared statements.
    pglock.reset_connection(c)
    with pglock.pg_lock(c, name):
        assert holders(obs, name) == [(c.info.backend_pid, X)]
