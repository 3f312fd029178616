"""``pglock.Locker``: one configured entry point over a pool, an engine or a DSN."""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg_pool
import pytest
import sqlalchemy as sa
from _pgdb import sa_url
from _truth import holder_pids as holders
from psycopg.conninfo import make_conninfo

import pglock

Connect = Callable[..., psycopg.Connection[Any]]


def sessions(observer: psycopg.Connection[Any], app_name: str) -> int:
    row = observer.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
        "AND pid <> pg_backend_pid()",
        (app_name,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def sessions_gone(observer: psycopg.Connection[Any], app_name: str) -> bool:
    """Poll (bounded) until no session of ``app_name`` is left: a closed connection leaves
    pg_stat_activity a moment after the client closed it."""
    deadline = time.monotonic() + 5
    while sessions(observer, app_name) and time.monotonic() < deadline:
        time.sleep(0.02)
    return sessions(observer, app_name) == 0


def with_app(dsn: str, app_name: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={app_name}"


@pytest.fixture
def pool(pg_dsn: str, app_name: str) -> Iterator[psycopg_pool.ConnectionPool[Any]]:
    p: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
        pg_dsn,
        min_size=2,
        max_size=2,
        kwargs={"application_name": app_name},
        reset=pglock.reset_connection,
        open=False,
        timeout=10,
    )
    p.open(wait=True, timeout=10)
    yield p
    p.close()


@pytest.fixture
def ns() -> str:
    return f"ns-{uuid.uuid4().hex[:8]}"


# --- names and namespaces -----------------------------------------------------------------


def test_namespace_is_folded_into_the_name(
    pool: psycopg_pool.ConnectionPool[Any], other: psycopg.Connection[Any], ns: str
) -> None:
    locker = pglock.Locker(pool, namespace=ns)
    assert locker.full_name("invoice:42") == f"{ns}:invoice:42"
    with locker.lock("invoice:42", timeout=5) as conn:
        assert holders(other, f"{ns}:invoice:42") == [conn.info.backend_pid]
        assert holders(other, "invoice:42") == []
        # the same lock as pg_lock on the full name
        assert not pglock.pg_lock(other, f"{ns}:invoice:42").acquire(timeout=0)
    assert holders(other, f"{ns}:invoice:42") == []


def test_several_names_are_each_namespaced(
    pool: psycopg_pool.ConnectionPool[Any], other: psycopg.Connection[Any], ns: str
) -> None:
    locker = pglock.Locker(pool, namespace=ns)
    with locker.lock(["b", "a"]) as conn:
        pid = conn.info.backend_pid
        assert holders(other, f"{ns}:a") == [pid]
        assert holders(other, f"{ns}:b") == [pid]


def test_no_namespace_uses_names_as_given(
    pool: psycopg_pool.ConnectionPool[Any], other: psycopg.Connection[Any], name: str
) -> None:
    locker = pglock.Locker(pool)
    assert locker.namespace is None
    assert locker.full_name(name) == name
    with locker.lock(name) as conn:
        assert holders(other, name) == [conn.info.backend_pid]


def test_two_namespaces_do_not_share_a_lock(
    pool: psycopg_pool.ConnectionPool[Any], other: psycopg.Connection[Any], ns: str
) -> None:
    a = pglock.Locker(pool, namespace=f"{ns}-a")
    b = pglock.Locker(pool, namespace=f"{ns}-b")
    with a.lock("job", timeout=0), b.lock("job", timeout=0):
        assert len(holders(other, f"{ns}-a:job")) == 1
        assert len(holders(other, f"{ns}-b:job")) == 1


def test_lock_contention_and_default_timeout(
    pool: psycopg_pool.ConnectionPool[Any], other: psycopg.Connection[Any], ns: str
) -> None:
    locker = pglock.Locker(pool, namespace=ns, timeout=0.1)
    with pglock.pg_lock(other, f"{ns}:x"):
        with pytest.raises(pglock.LockNotAcquired) as info, locker.lock("x"):
            pytest.fail("the body ran without the lock")
        assert info.value.timeout == 0.1
        with pytest.raises(pglock.LockNotAcquired), locker.lock("x", timeout=0):
            pytest.fail("the body ran without the lock")


@pytest.mark.parametrize(
    ("namespace", "error", "match"),
    [
        ("a:b", ValueError, "':'"),
        ("", ValueError, "empty"),
        ("a\x00", ValueError, "NUL"),
        (b"ns", TypeError, "str"),
        (7, TypeError, "str"),
        ("x" * 1025, ValueError, "1024"),
    ],
)
def test_bad_namespace(
    pool: psycopg_pool.ConnectionPool[Any], namespace: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pglock.Locker(pool, namespace=namespace)


def test_full_name_too_long_is_refused_before_any_sql(
    pool: psycopg_pool.ConnectionPool[Any],
) -> None:
    locker = pglock.Locker(pool, namespace="n" * 20)
    with pytest.raises(ValueError, match="1024"):
        locker.lock("x" * 1010)
    with pytest.raises(ValueError, match="empty"):
        locker.lock("")
    with pytest.raises(TypeError):
        locker.lock(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        locker.lock([])


@pytest.mark.parametrize(
    ("source", "kwargs", "error"),
    [
        (42, {}, TypeError),
        (None, {}, TypeError),
        ("", {}, ValueError),
        ("postgresql://x", {"schema": ""}, ValueError),
        ("postgresql://x", {"schema": 5}, TypeError),
        ("postgresql://x", {"timeout": -1}, ValueError),
        ("postgresql://x", {"pool_kwargs": {"open": True}}, TypeError),
        ("postgresql://x", {"pool_kwargs": [1]}, TypeError),
    ],
)
def test_bad_locker_arguments(source: Any, kwargs: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        pglock.Locker(source, **kwargs)


@pytest.mark.parametrize("schema", ["Bad", "pg_locks", "a" * 64, "1x", "x-y", "x\x00"])
def test_locker_refuses_the_schemas_the_installer_refuses_with_its_message(schema: str) -> None:
    # At construction, before any SQL (the DSN points nowhere), with the same message as
    # pglock._contract.validate_schema, which pglock install, lease() and semaphore() use.
    from pglock._contract import validate_schema

    with pytest.raises(ValueError) as expected:
        validate_schema(schema)
    with pytest.raises(ValueError) as refused:
        pglock.Locker("postgresql://nobody@127.0.0.1:1/none", schema=schema)
    assert str(refused.value) == str(expected.value)
    assert pglock.Locker("postgresql://x", schema="my_locks").schema == "my_locks"


def test_pool_kwargs_refused_for_a_pool_you_own(
    pool: psycopg_pool.ConnectionPool[Any],
) -> None:
    with pytest.raises(TypeError, match="pool_kwargs"):
        pglock.Locker(pool, pool_kwargs={"max_size": 3})


def test_a_connection_is_pointed_to_pg_lock(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(TypeError, match="pg_lock"):
        pglock.Locker(conn)


# --- sources ---------------------------------------------------------------------------------


def test_dsn_locker_opens_its_own_pool_lazily_and_closes_it(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any], ns: str
) -> None:
    locker = pglock.Locker(with_app(pg_dsn, app_name), namespace=ns)
    lk = locker.lock("x")  # a lock object is not I/O either
    assert sessions(other, app_name) == 0  # no I/O in the constructor
    with lk as conn:
        assert isinstance(conn, psycopg.Connection)
        assert holders(other, f"{ns}:x") == [conn.info.backend_pid]
    assert sessions(other, app_name) >= 1
    with locker:  # the context manager closes what the Locker created
        pass
    assert locker.closed
    assert sessions_gone(other, app_name)
    with pytest.raises(RuntimeError, match="closed"), locker.lock("x"):
        pass
    locker.close()  # idempotent


def test_dsn_locker_pool_kwargs_and_reset_hook(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    kwargs = {"max_size": 1, "kwargs": {"application_name": app_name}}
    with pglock.Locker(pg_dsn, pool_kwargs=kwargs) as locker:
        with locker.lock(name) as conn:
            pid = conn.info.backend_pid
            conn.execute("SELECT pg_advisory_lock(12345)")  # leaked on purpose
        with locker.lock(name) as conn:  # one connection: the same backend, reset
            assert conn.info.backend_pid == pid
            row = other.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s "
                "AND objid = 12345",
                (pid,),
            ).fetchone()
            assert row == (0,)


def test_closing_the_locker_leaves_your_pool_open(
    pool: psycopg_pool.ConnectionPool[Any], name: str
) -> None:
    with pglock.Locker(pool) as locker, locker.lock(name):
        pass
    assert not pool.closed
    with pool.connection() as conn:
        conn.execute("SELECT 1")


def test_engine_locker_yields_sqlalchemy_connections(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any], ns: str
) -> None:
    engine = sa.create_engine(
        sa_url(pg_dsn),
        connect_args={"application_name": app_name},
    )
    try:
        with pglock.Locker(engine, namespace=ns) as locker, locker.lock("x") as conn:
            assert isinstance(conn, sa.Connection)
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            assert holders(other, f"{ns}:x") == [pid]
        assert holders(other, f"{ns}:x") == []
        with engine.connect() as c:  # the engine was not disposed by the Locker
            c.execute(sa.text("SELECT 1"))
    finally:
        engine.dispose()


def test_engine_with_another_driver_is_refused(pg_dsn: str) -> None:
    engine = sa.create_engine(sa_url(pg_dsn, "psycopg2"))
    try:
        with pytest.raises(TypeError, match="psycopg"):
            pglock.Locker(engine)
    finally:
        engine.dispose()


def test_repr(pool: psycopg_pool.ConnectionPool[Any]) -> None:
    locker = pglock.Locker(pool, namespace="billing")
    assert repr(locker) == "<pglock.Locker ConnectionPool namespace='billing'>"
    assert repr(pglock.Locker("postgresql://x")) == "<pglock.Locker dsn namespace=None>"
    assert "unlocked" in repr(locker.lock("a"))


# --- nesting in one thread (issue 11, item 12) ----------------------------------------------


def nested_blocks(locker: pglock.Locker, name: str) -> dict[str, Callable[[], Any]]:
    """Every way a Locker hands out a pooled hold of ``name``, as a context-manager factory."""
    return {
        "lock": lambda: locker.lock(name, timeout=None),
        "lock_timeout": lambda: locker.lock(name, timeout=2),
        "shared": lambda: locker.lock(name, shared=True),
        "rwlock_read": lambda: locker.rwlock(name).read(),
        "rwlock_write": lambda: locker.rwlock(name).write(timeout=2),
    }


@pytest.mark.parametrize("inner", ["lock", "lock_timeout", "shared", "rwlock_read", "rwlock_write"])
@pytest.mark.parametrize("outer", ["lock", "rwlock_read"])
def test_nesting_a_name_through_the_locker_is_answered_at_once(
    pg_dsn: str,
    app_name: str,
    other: psycopg.Connection[Any],
    ns: str,
    outer: str,
    inner: str,
) -> None:
    """``with locker.lock("x"): with locker.lock("x"):`` waited for itself for ever (the
    inner block checks out another connection, another session). pglock answers before any
    SQL, in every mode, across lock() and rwlock(): SelfDeadlock for a wait without a
    timeout, LockNotAcquired (caused by SelfDeadlock) for a timed one."""
    locker = pglock.Locker(
        pg_dsn, namespace=ns, pool_kwargs={"max_size": 2, "kwargs": {"application_name": app_name}}
    )
    try:
        blocks = nested_blocks(locker, "x")
        with blocks[outer]() as conn:
            pid = conn.info.backend_pid
            with pytest.raises(pglock.LockError) as info, blocks[inner]():
                pytest.fail("the nested body ran")
            timed = inner in ("lock_timeout", "rwlock_write")
            error = info.value.__cause__ if timed else info.value
            assert type(info.value) is (pglock.LockNotAcquired if timed else pglock.SelfDeadlock)
            assert isinstance(error, pglock.SelfDeadlock) and "wait for itself" in str(error)
            assert error.name == f"{ns}:x"
            assert holders(other, f"{ns}:x") == [pid]
        assert holders(other, f"{ns}:x") == []
        with locker.lock("x", timeout=0):  # free again once the outer block is left
            pass
    finally:
        locker.close()


# --- threads ----------------------------------------------------------------------------------


def test_one_locker_shared_by_threads(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any], ns: str
) -> None:
    """Threads share one DSN Locker: its pool is created once, and the lock excludes."""
    locker = pglock.Locker(
        pg_dsn, namespace=ns, pool_kwargs={"max_size": 4, "kwargs": {"application_name": app_name}}
    )
    inside = 0
    overlap = []
    guard = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def worker() -> None:
        nonlocal inside
        try:
            start.wait(timeout=30)
            for _ in range(10):
                with locker.lock("shared-counter", timeout=30):
                    with guard:
                        inside += 1
                        overlap.append(inside)
                    time.sleep(0.001)
                    with guard:
                        inside -= 1
        except BaseException as exc:
            errors.append(exc)

    try:
        ts = [threading.Thread(target=worker) for _ in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert not errors, errors
        assert len(overlap) == 60
        assert max(overlap) == 1
        assert locker._own_pool is not None  # one pool, created once
        assert locker._own_pool.get_stats()["pool_max"] == 4  # type: ignore[index]
    finally:
        locker.close()
    assert sessions_gone(other, app_name)


# --- leases (pglock._lease is built by another issue) ------------------------------------------


def test_lease_through_the_locker(pg_dsn: str, app_name: str, ns: str) -> None:
    """A real lease through Locker.lease, in a throwaway database with the schema installed."""
    if importlib.util.find_spec("pglock._lease") is None:
        pytest.skip("pglock._lease is not there yet (leases issue)")
    from _pgdb import throwaway_database

    from pglock import _schema

    with throwaway_database(pg_dsn, prefix="pglock_locker", install=False) as dsn:
        _schema.install(dsn)
        with pglock.Locker(
            dsn, namespace=ns, pool_kwargs={"kwargs": {"application_name": app_name}}
        ) as locker:
            with locker.lease("job", ttl=10, timeout=5) as lease:
                assert lease.name == f"{ns}:job"
                first = lease.token
            with locker.lease("job", ttl=10, timeout=5) as lease:
                assert lease.token > first


def test_dsn_locker_connections_get_a_connect_timeout_and_keepalives(
    pg_dsn: str, app_name: str, ns: str
) -> None:
    """pglock opens a DSN Locker's connections: they carry connect_timeout, keepalives and
    tcp_user_timeout unless the DSN or pool_kwargs' connection kwargs set them (on main they had
    none: a silent network hung a checkout for as long as TCP retransmits)."""
    from pglock import _deadline

    with pglock.Locker(with_app(pg_dsn, app_name), namespace=ns) as locker:
        with locker.lock("x") as conn:
            params = conn.info.get_parameters()
        for key, value in _deadline.CONNECT_DEFAULTS.items():
            assert params.get(key) == value, (key, params)
    mine = pglock.Locker(
        make_conninfo(with_app(pg_dsn, app_name), connect_timeout=3),
        namespace=ns,
        pool_kwargs={"kwargs": {"keepalives_idle": 42}},
    )
    with mine, mine.lock("x") as conn:
        params = conn.info.get_parameters()
    assert params["connect_timeout"] == "3" and params["keepalives_idle"] == "42"
    assert params["tcp_user_timeout"] == _deadline.CONNECT_DEFAULTS["tcp_user_timeout"]
