"""Leases and semaphores on the lock contract (docs/locks.md), and fixes found there: a
semaphore's try-once while another thread of the object waits, ``on_lost`` in pglock's thread,
``guard()`` in a snapshot older than the grant, ``close()`` waking a blocked ``acquire()``."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from _threads import in_thread

import pglock
from pglock import _waiting

#: Every grant reported here is checked against the database (tests/_believer.py).
pytestmark = pytest.mark.usefixtures("believer")


def lease_rows(admin: psycopg.Connection[Any], name: str) -> list[tuple[Any, ...]]:
    return admin.execute("SELECT holder FROM pglock.lease WHERE name = %s", (name,)).fetchall()


def permit_rows(admin: psycopg.Connection[Any], name: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        "SELECT holder, permits FROM pglock.semaphore_permit WHERE semaphore = %s", (name,)
    ).fetchall()


@pytest.fixture
def admin(dsn: str) -> Any:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def wait_for(pred: Any, timeout: float = 20) -> None:
    event = threading.Event()
    while not pred():
        assert not event.wait(0.02) and timeout > 0, "timed out"
        timeout -= 0.02


# --- the contract ----------------------------------------------------------------------------


def test_lease_blocking_false_tries_once_whatever_its_timeout(dsn: str, name: str) -> None:
    lease = pglock.lease(dsn, name, timeout=5)
    assert lease.acquire(blocking=False) is True
    lease.release()


def test_semaphore_acquire_speaks_threading(dsn: str, name: str, admin: Any) -> None:
    sem = pglock.semaphore(dsn, name, 2)
    assert sem.acquire(False) is True  # blocking=False, as threading.Semaphore
    assert sem.locked is True
    assert sem.acquire(blocking=True, timeout=0, permits=1) is True
    assert sem.count() == 2
    assert sem.acquire(False) is False
    with pytest.raises(TypeError, match="permits="):
        sem.acquire(2)  # the old positional permits
    assert in_thread(lambda: sem.locked) is False  # another thread holds none
    sem.release()
    sem.release()
    assert sem.locked is False and sem.count() == 0 and permit_rows(admin, name) == []
    with sem.hold(permits=2, timeout=5) as permit:
        assert permit.locked is True
    assert permit.locked is False


@pytest.mark.timeout(30)
def test_semaphore_with_raises_lock_not_acquired(dsn: str, name: str) -> None:
    sem = pglock.semaphore(dsn, name, 1)
    rival = pglock.semaphore(dsn, name, 1)
    with rival.hold():
        sem_now = pglock.semaphore(dsn, name, 1, timeout=0)
        with pytest.raises(pglock.LockNotAcquired, match="could not acquire 1 permit"), sem_now:
            pytest.fail("the body ran without a permit")
    with sem:
        sem.release()  # the end of the block does nothing more
    assert sem.locked is False


@pytest.mark.parametrize("kind", ["lease", "semaphore"])
def test_close_wakes_a_waiter_and_leaves_nothing_held(
    dsn: str, name: str, admin: Any, kind: str
) -> None:
    if kind == "lease":
        lock: Any = pglock.lease(dsn, name)
        rival: Any = pglock.lease(dsn, name)
        rows = lease_rows
    else:
        lock = pglock.semaphore(dsn, name, 1)
        rival = pglock.semaphore(dsn, name, 1)
        rows = permit_rows
    assert rival.acquire(blocking=False)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(in_thread(lock.acquire, timeout=60)))
    t.start()
    wait_for(lambda: lock._waiters()._count == 1)  # it waits
    lock.close()
    t.join(20)
    assert not t.is_alive() and out == [False]
    assert len(rows(admin, name)) == 1  # the rival's only
    rival.release()
    assert rows(admin, name) == []
    assert lock.acquire(timeout=5) is True
    lock.release()


# --- fixes -------------------------------------------------------------------------------------


def test_semaphore_try_once_asks_while_another_thread_of_the_object_waits(
    dsn: str, name: str, admin: Any
) -> None:
    """A thread of the object waits for two permits (one is taken elsewhere); a try-once for
    the free one must ask the database, not give up behind the queued thread."""
    sem = pglock.semaphore(dsn, name, 2)
    rival = pglock.semaphore(dsn, name, 2)
    permit = rival.hold().__enter__()
    waiting = threading.Thread(target=lambda: sem.acquire(permits=2, timeout=10))
    waiting.start()
    try:
        wait_for(lambda: _queued(sem))
        taken = in_thread(lambda: sem.acquire(timeout=0))
        assert taken is True
        assert len(permit_rows(admin, name)) == 2
        in_thread(sem.release)
    finally:
        sem.close()
        waiting.join(20)
        permit.release()


def _queued(sem: Any) -> bool:
    q = _waiting.waiters.queues.get(sem._wait_key(sem._src()), {}).get(sem)
    return q is not None and len(q.tickets) == 1


def test_on_lost_runs_in_pglocks_thread(dsn: str, name: str, admin: Any) -> None:
    """A callback that takes a lock the caller holds while calling extend() must not deadlock:
    it runs in pglock's thread, never in the caller's."""
    caller_lock = threading.Lock()
    seen: list[tuple[threading.Thread, bool]] = []
    done = threading.Event()

    def on_lost(_lease: Any) -> None:
        seen.append((threading.current_thread(), caller_lock.acquire(timeout=10)))
        done.set()

    lease = pglock.lease(dsn, name, ttl=30, on_lost=on_lost)
    assert lease.acquire(timeout=5)
    admin.execute("DELETE FROM pglock.lease WHERE name = %s", (name,))
    with caller_lock:
        with pytest.raises(pglock.LockLost):
            lease.extend()
        with pytest.raises(pglock.LockLost):
            lease.check()
    assert done.wait(20)
    assert len(seen) == 1
    thread, got = seen[0]
    assert thread is not threading.current_thread() and got
    caller_lock.release()
    with pytest.raises(pglock.LockLost):
        lease.release()


def test_guard_in_a_snapshot_older_than_the_grant_says_so(
    dsn: str, name: str, admin: Any
) -> None:
    lease = pglock.lease(dsn, name, ttl=30)
    with psycopg.connect(dsn) as c:
        c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        c.execute("SELECT 1")  # the snapshot is taken here, before the grant
        assert lease.acquire(timeout=5)
        try:
            with pytest.raises(pglock.InvalidConnectionState, match="snapshot") as ei:
                lease.guard(c)
            assert "start the transaction after acquiring" in str(ei.value)
            assert "database" not in str(ei.value)
            c.rollback()
            with c.transaction():
                lease.guard(c)  # a transaction begun after the grant sees it
            lease.check()
        finally:
            lease.release()
