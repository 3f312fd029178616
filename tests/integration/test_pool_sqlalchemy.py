"""Pool-aware locking with SQLAlchemy: ``pool_lock(engine)`` and ``release_on_checkin``.

A ``QueuePool`` of size 1 (no overflow) makes the next checkout reuse the same backend (checked
by pid) unless pglock had the connection invalidated.
"""

from __future__ import annotations

import gc
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _counter import run_counter
from _pgdb import sa_url
from _truth import holder_pids
from psycopg import sql
from sqlalchemy.orm import Session
from sqlalchemy.pool import QueuePool
from test_pool import POOLED, wait_free

import pglock
import pglock.sqlalchemy

MakeEngine = Callable[..., sa.Engine]


def advisory_held(observer: psycopg.Connection[Any], pid: int) -> list[tuple[int, str]]:
    rows = observer.execute(
        "SELECT (classid::bigint << 32) | objid::bigint, mode FROM pg_locks "
        "WHERE locktype = 'advisory' AND granted AND pid = %s ORDER BY 1, 2",
        (pid,),
    ).fetchall()
    return [(k, m) for k, m in rows]


@pytest.fixture
def make_engine(pg_dsn: str, app_name: str) -> Iterator[MakeEngine]:
    engines: list[sa.Engine] = []

    def factory(size: int = 1, *, hook: bool = True, **kwargs: Any) -> sa.Engine:
        engine = sa.create_engine(
            sa_url(pg_dsn),
            poolclass=QueuePool,
            pool_size=size,
            max_overflow=0,
            pool_timeout=10,
            connect_args={"application_name": app_name},
            **kwargs,
        )
        if hook:
            pglock.sqlalchemy.release_on_checkin(engine)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.dispose()


def pid_of(conn: sa.Connection | Session) -> int:
    value = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    return int(value)


def checkout_pid(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return pid_of(c)


# --- pool_lock(engine) -----------------------------------------------------------------------


def test_pool_lock_yields_a_sqlalchemy_connection_holding_the_lock(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pglock.pool_lock(engine, name, timeout=5) as conn:
        assert isinstance(conn, sa.Connection)
        pid = pid_of(conn)
        assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
    assert advisory_held(other, pid) == []
    assert checkout_pid(engine) == pid


def test_pool_lock_engine_contention(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pglock.pg_lock(other, name):
        with pytest.raises(pglock.LockNotAcquired), pglock.pool_lock(engine, name, timeout=0):
            pytest.fail("the body ran without the lock")
        with pytest.raises(pglock.LockNotAcquired), pglock.pool_lock(engine, name, timeout=0.1):
            pytest.fail("the body ran without the lock")
    pid = checkout_pid(engine)
    assert advisory_held(other, pid) == []


def test_pool_lock_engine_commits_on_success_and_rolls_back_on_error(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    table = f"t_{uuid.uuid4().hex[:12]}"
    other.execute(sql.SQL("CREATE TABLE {} (v int)").format(sql.Identifier(table)))
    try:
        engine = make_engine()
        insert = sa.text(f'INSERT INTO "{table}" VALUES (:v)')
        with pglock.pool_lock(engine, name) as conn:
            conn.execute(insert, {"v": 1})
        with pytest.raises(ZeroDivisionError), pglock.pool_lock(engine, name) as conn:
            conn.execute(insert, {"v": 2})
            1 / 0  # noqa: B018
        with pglock.pool_lock(engine, name) as conn:  # commit-as-you-go inside the block
            conn.execute(insert, {"v": 3})
            conn.commit()
            conn.execute(insert, {"v": 4})
            conn.rollback()
        rows = other.execute(sql.SQL("SELECT v FROM {} ORDER BY v").format(sql.Identifier(table)))
        assert rows.fetchall() == [(1,), (3,)]
    finally:
        other.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


# --- acceptance: nothing survives the return to the pool ---------------------------------------


def test_lock_left_by_raw_sql_is_gone_at_next_checkout(
    make_engine: MakeEngine,
    other: psycopg.Connection[Any],
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine()
    k = pglock.key(name)
    with caplog.at_level(logging.WARNING, logger="pglock"):
        with engine.connect() as conn:
            pid = pid_of(conn)
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": k})
            conn.commit()
        with engine.connect() as conn:
            assert pid_of(conn) == pid
            assert advisory_held(other, pid) == []
    assert any(str(k) in r.getMessage() for r in caplog.records if r.name == "pglock.pool")


def test_lock_left_inside_an_open_transaction_is_gone_at_next_checkout(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    k = pglock.key(name)
    with engine.connect() as conn:  # closed with its transaction still open: rolled back
        pid = pid_of(conn)
        conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": k})
    with engine.connect() as conn:
        assert pid_of(conn) == pid
        assert advisory_held(other, pid) == []


def test_without_the_hook_the_lock_survives_checkin(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    """Negative control: SQLAlchemy's rollback-on-return keeps session locks."""
    engine = make_engine(hook=False)
    k = pglock.key(name)
    with engine.connect() as conn:
        pid = pid_of(conn)
        conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": k})
        conn.commit()
    with engine.connect() as conn:
        try:
            assert pid_of(conn) == pid
            assert advisory_held(other, pid) == [(k, "ExclusiveLock")]
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock_all()"))
            conn.commit()


def test_lock_of_a_body_that_raised_is_gone_at_next_checkout(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pytest.raises(KeyError), pglock.pool_lock(engine, name) as conn:
        pid = pid_of(conn)
        raise KeyError("boom")
    with engine.connect() as conn:
        assert pid_of(conn) == pid
        assert advisory_held(other, pid) == []


def test_session_closed_while_holding_pg_lock(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    session = Session(engine)
    lock = pglock.pg_lock(session, name)
    assert lock.acquire()
    pid = pid_of(session)
    session.close()  # the connection goes back to the pool: the hook releases
    assert advisory_held(other, pid) == []
    assert not lock.locked
    with pytest.raises(pglock.LockLost):
        lock.release()
    assert checkout_pid(engine) == pid


def test_backend_terminated_in_the_body_is_discarded(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pytest.raises(sa.exc.OperationalError), pglock.pool_lock(engine, name) as conn:
        pid = pid_of(conn)
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        conn.execute(sa.text("SELECT 1"))
    with engine.connect() as conn:
        new_pid = pid_of(conn)
        assert new_pid != pid
        assert advisory_held(other, new_pid) == []


def test_backend_terminated_unnoticed_by_the_body_raises_lock_lost(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pytest.raises(pglock.LockLost), pglock.pool_lock(engine, name) as conn:
        pid = conn.connection.driver_connection.info.backend_pid  # no transaction begun
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    new_pid = checkout_pid(engine)
    assert new_pid != pid
    assert advisory_held(other, new_pid) == []


def test_backend_terminated_with_the_body_transaction_open_raises_the_commit_error(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pytest.raises(sa.exc.OperationalError), pglock.pool_lock(engine, name) as conn:
        pid = pid_of(conn)  # begins a transaction that cannot commit
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    new_pid = checkout_pid(engine)
    assert new_pid != pid
    assert advisory_held(other, new_pid) == []


def test_unconfirmed_release_invalidates_the_connection(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine(hook=False)
    with pytest.raises(pglock.LockLost), pglock.pool_lock(engine, name) as conn:
        pid = pid_of(conn)
        conn.execute(sa.text("SELECT pg_advisory_unlock_all()"))
    assert checkout_pid(engine) != pid


def test_failed_transaction_in_the_body(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pglock.pool_lock(engine, name) as conn:
        pid = pid_of(conn)
        with pytest.raises(sa.exc.DataError):
            conn.execute(sa.text("SELECT 1/0"))
    with engine.connect() as conn:
        assert pid_of(conn) == pid
        assert advisory_held(other, pid) == []


def test_release_on_checkin_is_idempotent_and_accepts_a_pool(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    pglock.sqlalchemy.release_on_checkin(engine)
    pglock.sqlalchemy.release_on_checkin(engine.pool)
    assert len(engine.pool.dispatch.reset) == 1
    with engine.connect() as conn:
        pid = pid_of(conn)
        conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": pglock.key(name)})
    assert advisory_held(other, pid) == []


# --- drivers and bad input -------------------------------------------------------------------


def test_pool_lock_refuses_another_driver(pg_dsn: str, name: str) -> None:
    engine = sa.create_engine(sa_url(pg_dsn, "psycopg2"))
    try:
        with pytest.raises(TypeError, match=r"postgresql\+psycopg2"):
            pglock.pool_lock(engine, name)
        with pytest.raises(TypeError, match="psycopg"):
            pglock.sqlalchemy.release_on_checkin(engine)
    finally:
        engine.dispose()


def test_pool_lock_refuses_sqlite(name: str) -> None:
    engine = sa.create_engine("sqlite://")
    with pytest.raises(TypeError, match="sqlite"):
        pglock.pool_lock(engine, name)


def test_pool_lock_points_a_connection_or_session_to_pg_lock(
    make_engine: MakeEngine, name: str
) -> None:
    engine = make_engine()
    with engine.connect() as conn, pytest.raises(TypeError, match="pg_lock"):
        pglock.pool_lock(conn, name)
    with Session(engine) as session, pytest.raises(TypeError, match="pg_lock"):
        pglock.pool_lock(session, name)


def test_pool_lock_refuses_an_async_engine(pg_dsn: str, name: str) -> None:
    pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio needs greenlet")
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(sa_url(pg_dsn))
    with pytest.raises(TypeError, match="synchronous"):
        pglock.pool_lock(engine, name)


def test_release_on_checkin_refuses_other_objects() -> None:
    with pytest.raises(TypeError, match="Engine or Pool"):
        pglock.sqlalchemy.release_on_checkin("postgresql+psycopg://")  # type: ignore[arg-type]


# --- 8 threads, a QueuePool of 4 --------------------------------------------------------------


def test_eight_threads_share_a_queue_pool_of_four(
    pg_dsn: str, app_name: str, make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine(size=4)
    v, _, acked = run_counter(pg_dsn, app_name, lambda i: pglock.pool_lock(engine, name))
    assert acked == 80
    assert v == acked
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    held = other.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND a.application_name = %s",
        (app_name,),
    ).fetchone()
    assert held == (0,)


def test_negative_control_queue_pool_without_the_lock_loses_updates(
    pg_dsn: str, app_name: str, make_engine: MakeEngine
) -> None:
    engine = make_engine(size=4)
    v, _, acked = run_counter(pg_dsn, app_name, lambda i: engine.connect())
    assert acked == 80
    assert v < acked, "the oracle found no lost update without a lock: it proves nothing"


# --- issue 11: bookkeeping left on the connection, nesting in one thread ---------------------


@pytest.mark.parametrize("hook", [True, False], ids=["release_on_checkin", "no_hook"])
@pytest.mark.parametrize("inner", ["same_name", "other_name"])
def test_lock_left_open_in_the_block_is_released_before_the_connection_goes_back(
    make_engine: MakeEngine,
    other: psycopg.Connection[Any],
    name: str,
    caplog: pytest.LogCaptureFixture,
    inner: str,
    hook: bool,
) -> None:
    """A pg_lock taken on the yielded SQLAlchemy connection and never released: pool_lock's
    exit releases it (WARNING) before the connection goes back, with or without the checkin
    hook, and marks the handle lost; the pool gets the same backend back, clean."""
    engine = make_engine(hook=hook)
    inner_name = name if inner == "same_name" else f"{name}:inner"
    with caplog.at_level(logging.WARNING, logger="pglock"):
        with pglock.pool_lock(engine, name) as conn:
            pid = pid_of(conn)
            left = pglock.pg_lock(conn, inner_name)
            assert left.acquire(timeout=0)
        assert advisory_held(other, pid) == []
        assert not left.locked
    with pytest.raises(pglock.LockLost, match="pool_lock"):
        left.release()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "pool_lock" in m and str(pglock.key(inner_name)) in m for m in warnings
    ), warnings
    with engine.connect() as conn:
        assert pid_of(conn) == pid  # released, not invalidated
        assert advisory_held(other, pid) == []
        with pglock.pg_lock(conn, inner_name, timeout=0):
            assert advisory_held(other, pid) == [(pglock.key(inner_name), "ExclusiveLock")]
        conn.rollback()
    assert advisory_held(other, pid) == []


@pytest.mark.parametrize("inner", ["pool_lock", "options_engine", "locked_session"])
def test_nesting_the_same_name_through_the_engine_is_answered_at_once(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str, inner: str
) -> None:
    """Nested on the same engine's pool in one thread (also through an engine made by
    execution_options(), which shares the pool, and locked_session), before any checkout:
    SelfDeadlock for a wait without a timeout, LockNotAcquired for a timed one."""
    engine = make_engine(size=2)

    def nested() -> Any:
        if inner == "pool_lock":
            return pglock.pool_lock(engine, name, timeout=None)
        if inner == "options_engine":
            return pglock.pool_lock(engine.execution_options(logging_token="x"), name, timeout=2)
        return pglock.sqlalchemy.locked_session(engine, name, timeout=2)

    with pglock.sqlalchemy.locked_session(engine, name) as session:
        pid = pid_of(session)
        checked_out = engine.pool.checkedout()
        with pytest.raises(pglock.LockError) as info, nested():
            pytest.fail("the nested body ran")
        expected = pglock.SelfDeadlock if inner == "pool_lock" else pglock.LockNotAcquired
        assert type(info.value) is expected
        assert engine.pool.checkedout() == checked_out  # no second connection was taken
        assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
    assert advisory_held(other, pid) == []


@pytest.mark.parametrize("make", POOLED.values(), ids=POOLED.keys())
def test_a_lock_object_collected_unreleased_leaves_no_record(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str, make: Callable[..., Any]
) -> None:
    """pals ``test_gc_lock_release`` through an Engine: SQLAlchemy's pool takes the collected
    connection back (rolled back); release_on_checkin releases the lock there, and this
    thread's record goes with it: the same thread takes the name again on that connection."""
    engine = make_engine(size=1)
    lock = make(engine, name)
    assert lock.acquire() is True
    [pid] = holder_pids(other, name)
    del lock
    gc.collect()
    assert holder_pids(other, name) == []  # the pool's reset ran during the collection
    again = make(engine, name)
    assert again.acquire(blocking=False) is True
    assert holder_pids(other, name) == [pid]  # the same connection, back in the pool
    again.release()
    with make(engine, name):  # a wait without a timeout is not refused either
        assert holder_pids(other, name) == [pid]


def test_without_the_hook_a_collected_lock_object_leaks_its_lock_and_keeps_its_record(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    """Without release_on_checkin the collected connection goes back to SQLAlchemy's pool
    still holding the lock (only rolled back): the lock is held, so the record stays."""
    engine = make_engine(size=1, hook=False)
    lock = pglock.pool_lock(engine, name)
    assert lock.acquire() is True
    [pid] = holder_pids(other, name)
    del lock
    gc.collect()
    assert engine.pool.checkedout() == 0 and holder_pids(other, name) == [pid]
    assert pglock.pool_lock(engine, name).acquire(blocking=False) is False
    with pytest.raises(pglock.SelfDeadlock), pglock.pool_lock(engine, name):
        pytest.fail("the nested body ran")
    engine.dispose()  # closes the pooled connection: Postgres drops its lock
    wait_free(other, name)


def test_the_record_stays_while_the_collected_lock_objects_connection_holds(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    """Dropped while the caller keeps its SQLAlchemy Connection, the lock is still held and
    so is the record; closing that connection hands it to the pool's reset, which releases
    the lock, and the record goes."""
    engine = make_engine(size=1)
    lock = pglock.pool_lock(engine, name)
    assert lock.acquire() is True
    conn = lock.connection
    del lock
    gc.collect()
    [pid] = holder_pids(other, name)
    assert pglock.pool_lock(engine, name).acquire(blocking=False) is False
    with pytest.raises(pglock.SelfDeadlock), pglock.pool_lock(engine, name):
        pytest.fail("the nested body ran")
    conn.close()
    assert holder_pids(other, name) == []
    with pglock.pool_lock(engine, name, timeout=None):
        assert holder_pids(other, name) == [pid]


# --- locked_session ----------------------------------------------------------------------------


def test_locked_session_keeps_the_lock_across_commits(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    table = f"t_{uuid.uuid4().hex[:12]}"
    other.execute(sql.SQL("CREATE TABLE {} (v int)").format(sql.Identifier(table)))
    insert = sa.text(f'INSERT INTO "{table}" VALUES (:v)')
    try:
        engine = make_engine()
        with pglock.sqlalchemy.locked_session(engine, name, timeout=5) as session:
            pid = pid_of(session)
            session.execute(insert, {"v": 1})
            session.commit()  # the connection, and the lock, stay with the block
            assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
            session.execute(insert, {"v": 2})  # committed at the end of the block
        assert advisory_held(other, pid) == []
        with pytest.raises(LookupError), pglock.sqlalchemy.locked_session(engine, name) as session:
            session.execute(insert, {"v": 3})
            raise LookupError
        rows = other.execute(sql.SQL("SELECT v FROM {} ORDER BY v").format(sql.Identifier(table)))
        assert rows.fetchall() == [(1,), (2,)]
        assert checkout_pid(engine) == pid
    finally:
        other.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


def test_pg_lock_on_an_engine_bound_session_ends_at_commit(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    """Control for locked_session: a Session bound to the engine gives its connection back at
    commit, and the hook releases the lock (the handle then reports it lost)."""
    engine = make_engine()
    with Session(engine) as session:
        lock = pglock.pg_lock(session, name)
        assert lock.acquire()
        pid = pid_of(session)
        session.commit()
        assert advisory_held(other, pid) == []
        with pytest.raises(pglock.LockLost):
            lock.release()


def test_locked_session_contention_and_bad_input(
    make_engine: MakeEngine, other: psycopg.Connection[Any], name: str
) -> None:
    engine = make_engine()
    with pglock.pg_lock(other, name), pytest.raises(
        pglock.LockNotAcquired
    ), pglock.sqlalchemy.locked_session(engine, name, timeout=0):
        pytest.fail("the body ran without the lock")
    with pytest.raises(TypeError):
        pglock.sqlalchemy.locked_session(engine, name, session_factory=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pglock.sqlalchemy.locked_session("engine", name)  # type: ignore[arg-type]


def test_every_new_engine_is_hooked_even_when_ids_are_reused() -> None:
    """Regression: engines created and disposed in a row often reuse a freed pool's id();
    SQLAlchemy's event.contains() then reported the new pool as hooked (about 1 in 100), and
    its connections went back to the pool with their locks."""
    for i in range(2000):
        engine = sa.create_engine("postgresql+psycopg://app@localhost/app", pool_size=1)
        pglock.sqlalchemy.release_on_checkin(engine)  # no I/O: nothing connects here
        assert len(engine.pool.dispatch.reset) == 1, f"engine {i} was not hooked"
        engine.dispose()
        del engine
