"""The lock contract on the pooled kinds: ``PoolLock``, ``rw.read()``/``rw.write()`` and
``Singleton`` used with ``acquire()``/``release()``, and ``close()`` waking a thread blocked
in ``acquire()`` with nothing left held (pg_locks) and the connection back in its pool clean.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg_pool
import pytest

import pglock

Connect = Callable[..., psycopg.Connection[Any]]


def app_locks(observer: psycopg.Connection[Any], app_name: str) -> list[tuple[Any, ...]]:
    """Advisory locks held or awaited by the test's sessions."""
    return observer.execute(
        "SELECT l.pid, (l.classid::bigint << 32) | l.objid::bigint, l.mode, l.granted "
        "FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND a.application_name = %s",
        (app_name,),
    ).fetchall()


@pytest.fixture
def pool(pg_dsn: str, app_name: str) -> Iterator[psycopg_pool.ConnectionPool[Any]]:
    """Two connections carrying the test's application_name, and no reset hook: what goes
    back to the pool must be clean on its own."""
    p: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
        pg_dsn, min_size=2, max_size=2, kwargs={"application_name": app_name}, open=False,
        timeout=10,
    )
    p.open(wait=True, timeout=10)
    yield p
    p.close()


def wait_blocked(observer: psycopg.Connection[Any], app_name: str) -> None:
    """Until a session of the test waits for an advisory lock (bounded)."""
    deadline = time.monotonic() + 20
    while not any(not granted for *_, granted in app_locks(observer, app_name)):
        assert time.monotonic() < deadline, "the waiter never blocked"
        time.sleep(0.02)


def close_wakes(
    lock: Any, wait: Callable[[], object], observer: psycopg.Connection[Any], app_name: str
) -> object:
    """Run ``wait`` in a thread, let it block on the lock, close() the lock; what it got."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(wait())
        except BaseException as exc:
            out.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    wait_blocked(observer, app_name)
    lock.close()
    waiter.join(20)
    assert not waiter.is_alive(), "close() did not wake the waiter"
    return out[0]


def assert_clean(pool: psycopg_pool.ConnectionPool[Any], observer: Any, app_name: str) -> None:
    """No advisory lock held or awaited by the test's sessions, and every pooled connection
    idle with nothing held."""
    assert app_locks(observer, app_name) == []
    conns = [pool.getconn(timeout=10) for _ in range(2)]
    try:
        for c in conns:
            assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        for c in conns:
            pool.putconn(c)


# --- PoolLock ---------------------------------------------------------------------------------


def test_pool_lock_acquire_and_release_hold_on_a_pooled_connection(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str,
) -> None:
    lock = pglock.pool_lock(pool, name)
    assert lock.connection is None
    with pytest.raises(RuntimeError):
        lock.release()
    assert lock.acquire() is True
    held = lock.connection
    assert held is not None and lock.locked
    assert [r[1] for r in app_locks(conn, app_name)] == [pglock.key(name)]
    with pytest.raises(RuntimeError):
        lock.acquire(blocking=False)
    held.execute("SELECT 1")  # the body's transaction: committed by release()
    lock.release()
    assert lock.connection is None and not lock.locked
    assert_clean(pool, conn, app_name)
    with lock as again:  # usable again, and with still yields the connection
        assert isinstance(again, psycopg.Connection)
        assert again is lock.connection


@pytest.mark.parametrize("timeout", [None, 30], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("use_with", [False, True], ids=["acquire", "with"])
def test_pool_lock_close_cancels_the_blocked_lock_statement(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str, connect: Connect, timeout: float | None, use_with: bool,
) -> None:
    rival = connect()
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    lock = pglock.pool_lock(pool, name, timeout=timeout)

    def wait() -> object:
        if not use_with:
            return lock.acquire()
        with lock:
            return "the body ran"

    got = close_wakes(lock, wait, conn, app_name)
    if use_with:
        assert isinstance(got, pglock.LockNotAcquired), got
    else:
        assert got is False
    assert not lock.locked and lock.connection is None
    rival.execute("SELECT pg_advisory_unlock_all()")
    assert_clean(pool, conn, app_name)  # no late grant, and the connection went back idle
    assert lock.acquire(timeout=5) is True
    lock.release()


def test_locker_lock_close_wakes_with_nothing_held(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str, connect: Connect,
) -> None:
    locker = pglock.Locker(pool, namespace="ns")
    rival = connect()
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(locker.full_name(name)),))
    lock = locker.lock(name)
    assert close_wakes(lock, lock.acquire, conn, app_name) is False
    rival.execute("SELECT pg_advisory_unlock_all()")
    assert_clean(pool, conn, app_name)


def test_a_dsn_locker_makes_every_kind_without_io() -> None:
    locker = pglock.Locker("postgresql://nobody@127.0.0.1:1/none")  # nothing listens there
    made = [
        locker.lock("a"),
        locker.rwlock("b").read(),
        locker.rwlock("b").write(),
        locker.singleton("c"),
        locker.semaphore("d", 2),
    ]
    assert all(not getattr(m, "locked", False) for m in made)
    assert locker._own_pool is None


def test_a_dsn_locker_makes_a_lease_without_io_and_acquire_fails() -> None:
    # Locker.lease opened the Locker's pool when it made the lease; it is opened at acquire().
    with pglock.Locker("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1") as locker:
        lease = locker.lease("e", ttl=5, timeout=0)
        assert not lease.locked and locker._own_pool is None
        with pytest.raises(psycopg_pool.PoolTimeout):  # the pool cannot connect
            lease.acquire()
        assert locker._own_pool is not None and not lease.locked


# --- RWLock -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["read", "write"])
def test_rwlock_holds_are_lock_objects(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str, mode: str,
) -> None:
    hold = getattr(pglock.rwlock(pool, name, timeout=5), mode)()
    assert hold.acquire() is True
    assert hold.locked and isinstance(hold.connection, psycopg.Connection)
    want = "ShareLock" if mode == "read" else "ExclusiveLock"
    assert [(r[1], r[2]) for r in app_locks(conn, app_name)] == [(pglock.key(name), want)]
    hold.release()
    assert not hold.locked and hold.connection is None
    with pytest.raises(RuntimeError):
        hold.release()
    assert_clean(pool, conn, app_name)


def test_rwlock_holds_on_a_connection_are_lock_objects(
    connect: Connect, conn: psycopg.Connection[Any], app_name: str, name: str
) -> None:
    mine = connect()
    rw = pglock.rwlock(mine, name)
    read = rw.read()
    with pytest.raises(RuntimeError):
        read.release()
    assert read.acquire() is True
    assert read.connection is mine
    with rw.read() as yielded:
        assert yielded is mine
    read.release()
    assert app_locks(conn, app_name) == []


@pytest.mark.parametrize("mode", ["read", "write"])
def test_rwlock_close_wakes_a_blocked_hold(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str, mode: str, connect: Connect,
) -> None:
    rival = connect()
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))  # exclusive: blocks both
    hold = getattr(pglock.rwlock(pool, name), mode)()
    assert close_wakes(hold, hold.acquire, conn, app_name) is False
    assert not hold.locked
    rival.execute("SELECT pg_advisory_unlock_all()")
    assert_clean(pool, conn, app_name)


def test_locker_rwlock_takes_the_locker_timeout(
    pool: psycopg_pool.ConnectionPool[Any], name: str
) -> None:
    locker = pglock.Locker(pool, timeout=7)
    assert locker.rwlock(name).read()._timeout == 7
    assert locker.rwlock(name, timeout=None).write()._timeout is None
    assert pglock.rwlock(pool, name, timeout=3).read()._timeout == 3


# --- Singleton --------------------------------------------------------------------------------


def test_singleton_is_a_lock_object(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str, connect: Connect,
) -> None:
    job = pglock.singleton(pool, name)
    assert job.acquire() is True and job.locked
    # A run in this thread is refused at once (timeout 0: skipped, as held elsewhere).
    assert job.run(lambda: "ran") is None
    with pytest.raises(pglock.SelfDeadlock):  # waiting for itself would never end
        pglock.singleton(pool, name, timeout=None).run(lambda: "ran")
    other: list[object] = []
    t = threading.Thread(target=lambda: other.append(job.run(lambda: "ran")))
    t.start()
    t.join(20)
    assert other == [None]  # held by this object: a run in another thread skips
    job.release()
    assert job.run(lambda: "ran") == "ran"
    rival = connect()
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    with pytest.raises(pglock.LockNotAcquired), job:
        pytest.fail("the body ran without the lock")
    rival.execute("SELECT pg_advisory_unlock_all()")
    with job as entered:
        assert entered is job and job.locked
    assert_clean(pool, conn, app_name)


@pytest.mark.parametrize("how", ["acquire", "run"])
def test_singleton_close_wakes_a_waiter(
    pool: psycopg_pool.ConnectionPool[Any], conn: psycopg.Connection[Any], app_name: str,
    name: str, connect: Connect, how: str,
) -> None:
    rival = connect()
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    job = pglock.singleton(pool, name, timeout=None)
    ran: list[bool] = []
    wait = job.acquire if how == "acquire" else lambda: job.run(lambda: ran.append(True))
    got = close_wakes(job, wait, conn, app_name)
    assert got is (False if how == "acquire" else None)
    assert ran == [] and not job.locked
    rival.execute("SELECT pg_advisory_unlock_all()")
    assert_clean(pool, conn, app_name)
