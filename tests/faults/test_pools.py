"""T06 connections returned to a pool while holding, T19 pool exhaustion (shared server).

The phantom re-entrancy check: after borrower A's connection went back, a *rival* session
must be able to take A's lock (so A's session let it go), and borrower B, who gets the same
physical connection, must then find it taken (a leaked hold would make Postgres grant it to B
again as a re-entry).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import sa_url

import pglock

from .oracles import holders as holders_of
from .oracles import truth, wait_for

pytest.importorskip("psycopg_pool")
if not hasattr(pglock, "pool_lock"):
    pytest.skip("pglock.pool_lock is not there yet", allow_module_level=True)

from psycopg_pool import ConnectionPool

Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture
def make_pool(pg_dsn: str, app_name: str) -> Iterator[Callable[..., ConnectionPool]]:
    pools: list[ConnectionPool] = []

    def factory(size: int = 1, reset: Any = pglock.reset_connection) -> ConnectionPool:
        pool = ConnectionPool(
            pg_dsn,
            min_size=size,
            max_size=size,
            kwargs={"autocommit": True, "application_name": app_name},
            reset=reset,
            open=True,
        )
        pools.append(pool)
        return pool

    yield factory
    for p in pools:
        p.close()


def assert_no_phantom(
    pool: ConnectionPool, pid: int, name: str, rival: psycopg.Connection[Any], obs: Any
) -> None:
    """A's session (pid) no longer holds name: a rival takes it, and B on the same physical
    connection finds it taken."""
    assert truth(obs, pid) == {}
    rival_lock = pglock.pg_lock(rival, name)
    assert rival_lock.acquire(timeout=0)
    with pool.connection() as b:
        assert b.info.backend_pid == pid  # the same physical connection
        assert not pglock.pg_lock(b, name).acquire(timeout=0)
        assert b.execute("SELECT pg_try_advisory_lock(%s)", (pglock.key(name),)).fetchone() == (
            False,
        )
    rival_lock.release()


def test_T06_body_raises_inside_pool_lock(
    make_pool: Callable[..., ConnectionPool], connect: Connect, observer: Any, name: str
) -> None:
    pool = make_pool()
    with pytest.raises(KeyError), pglock.pool_lock(pool, name) as a:
        pid = a.info.backend_pid
        assert holders_of(observer, pglock.key(name)) == [pid]
        raise KeyError("user")
    assert_no_phantom(pool, pid, name, connect(), observer)


def slow_reset(conn: psycopg.Connection[Any]) -> None:
    """pglock's reset hook, late: widens the window between putconn() returning and
    psycopg_pool's worker thread running the hook, which the test must not assume closed."""
    time.sleep(0.3)
    pglock.reset_connection(conn)


@pytest.mark.parametrize("reset", ["reset", "slow_reset"])
@pytest.mark.parametrize("how", ["returned_holding", "handle_garbage_collected"])
def test_T06_connection_returned_holding_is_reset(
    how: str,
    reset: str,
    make_pool: Callable[..., ConnectionPool],
    connect: Connect,
    observer: Any,
    name: str,
) -> None:
    pool = make_pool(reset=pglock.reset_connection if reset == "reset" else slow_reset)
    a = pool.getconn()
    pid = a.info.backend_pid
    lock = pglock.pg_lock(a, name)
    assert lock.acquire()
    if how == "handle_garbage_collected":
        del lock
        gc.collect()
    pool.putconn(a)  # buggy user code: back to the pool still holding the lock
    # psycopg_pool runs the reset hook in its worker thread after putconn() has returned:
    # wait for it (bounded), then assert the state.
    wait_for(lambda: truth(observer, pid) == {}, timeout=5.0, what="the pool's reset hook")
    assert_no_phantom(pool, pid, name, connect(), observer)
    if how == "returned_holding":
        with pytest.raises(pglock.LockLost):
            lock.release()  # A's handle learns the pool took it away
        assert not lock.locked


def test_T06_negative_control_pool_without_reset_hook_leaks(
    make_pool: Callable[..., ConnectionPool], connect: Connect, observer: Any, name: str
) -> None:
    """Without pglock's reset hook psycopg_pool only rolls back: the session lock goes back
    into the pool, and the next borrower is granted it again as a phantom re-entry."""
    pool = make_pool(reset=None)
    key = pglock.key(name)
    a = pool.getconn()
    pid = a.info.backend_pid
    a.execute("SELECT pg_advisory_lock(%s)", (key,))
    pool.putconn(a)
    assert holders_of(observer, key) == [pid]  # leaked into the pool
    rival = connect()
    assert not pglock.pg_lock(rival, name).acquire(timeout=0)
    with pool.connection() as b:
        assert b.info.backend_pid == pid
        assert b.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
        b.execute("SELECT pg_advisory_unlock_all()")


def test_T06_sqlalchemy_pool_release_on_checkin(
    pg_dsn: str, app_name: str, connect: Connect, observer: Any, name: str
) -> None:
    sa = pytest.importorskip("sqlalchemy")
    from pglock.sqlalchemy import release_on_checkin

    url = sa_url(pg_dsn)
    engine = sa.create_engine(
        url, connect_args={"application_name": app_name}, pool_size=1, max_overflow=0
    )
    release_on_checkin(engine)
    key = pglock.key(name)
    try:
        a = engine.connect()
        pid = a.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        lock = pglock.pg_lock(a, name)
        assert lock.acquire()
        a.close()  # back to the pool holding the lock
        assert holders_of(observer, key) == []
        rival = connect()
        rl = pglock.pg_lock(rival, name)
        assert rl.acquire(timeout=0)
        with engine.connect() as b:
            assert b.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == pid
            assert (
                b.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar_one()
                is False
            )
            b.rollback()
        rl.release()
        with pytest.raises(pglock.LockLost):
            lock.release()
    finally:
        engine.dispose()


# --- T19: pool exhaustion ------------------------------------------------------------------------


def test_T19_pool_exhaustion_n_plus_one_contenders_all_finish(
    make_pool: Callable[..., ConnectionPool], observer: Any, name: str
) -> None:
    """A pool of 3, 4 threads looping on pool_lock: waiters occupy connections while the holder
    needs none extra to release, so every one finishes (PALs issue #40); no overlap."""
    pool = make_pool(size=3)
    inside = 0
    most = 0
    done = 0
    guard = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal inside, most, done
        try:
            for _ in range(10):
                with pglock.pool_lock(pool, name, timeout=30) as c:
                    with guard:
                        inside += 1
                        most = max(most, inside)
                    c.execute("SELECT pg_sleep(0.002)")
                    with guard:
                        inside -= 1
                        done += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert done == 40
    assert most == 1
    assert holders_of(observer, pglock.key(name)) == []
