"""Review 3, axis (f): forked children against what docs/locks.md ("Processes and fork") and
docs/threat-model.md (f) promise."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg_pool
import pytest
from _review import in_thread, wait_until

import pglock

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]


def _in_child(fn: Callable[[], Any], timeout: float = 60.0) -> str:
    """Run ``fn()`` in a forked child: its repr, or ``<exception name>: <message>``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            out = repr(fn())
        except BaseException as exc:
            out = f"{type(exc).__name__}: {exc}"
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read() or '"(nothing)"')
    os.waitpid(pid, 0)
    return out


def _activity(dsn: str, pid: int) -> tuple[Any, ...]:
    """(state_change, state, query) of backend ``pid``: a session nobody used keeps them."""
    with psycopg.connect(dsn, autocommit=True, application_name="review-observer") as o:
        row = o.execute(
            "SELECT state_change, state, query FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    assert row is not None, f"session {pid} ended"
    return tuple(row)


@pytest.mark.parametrize("kind", ["pool_lock", "singleton", "rwlock"])
def test_close_in_a_child_never_waits_for_a_parent_thread(
    installed: str, connect: Any, kind: str
) -> None:
    """docs/locks.md, "Processes and fork": "Every lock, condition and event of every pglock
    object and module is re-initialised in the child, so nothing the child does waits on its
    parent's threads"; docs/locks.md (contract): ``close()`` "Wakes every thread blocked in this
    object's acquire() at once". A parent thread is blocked in the acquire() of a pool_lock (a
    singleton, an rwlock's write side) at the fork; in the child, close() of the copy spins
    until that thread, which the child does not have, leaves its wait: 10 s (it gives up then)."""
    name = f"review3:{uuid.uuid4()}"
    blocker = pglock.pg_lock(connect(), name)
    assert blocker.acquire()
    with psycopg_pool.ConnectionPool(installed, min_size=1, max_size=2, open=True) as pool:
        lock: Any
        if kind == "pool_lock":
            lock = pglock.pool_lock(pool, name)
        elif kind == "singleton":
            lock = pglock.singleton(pool, name, timeout=None)
        else:
            lock = pglock.rwlock(pool, name).write(timeout=None)
        t, out = in_thread(lambda: lock.acquire(timeout=60))
        try:
            # The parent thread waits on the server for the name.
            assert wait_until(lambda: _waits_for(installed, name), 10)

            def child() -> str:
                done = threading.Event()
                threading.Thread(target=lambda: (lock.close(), done.set()), daemon=True).start()
                return "returned" if done.wait(5) else "still in close() after 5 s"

            got = _in_child(child)
        finally:
            blocker.release()
            t.join(30)
            if out.get("result"):
                lock.release()
    assert got == repr("returned"), got


def _waits_for(dsn: str, name: str) -> bool:
    key = pglock.key(name)
    with psycopg.connect(dsn, autocommit=True, application_name="review-observer") as o:
        row = o.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND ((classid::bigint << 32) | objid::bigint) = %s",
            (key,),
        ).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("call", ["reset_connection", "guard", "xact_lock"])
def test_a_connection_used_by_guard_in_the_parent_is_refused_in_the_child(
    installed: str, connect: Any, call: str
) -> None:
    """docs/locks.md, "Processes and fork": "A connection pglock used in the parent is refused
    with pglock.InvalidConnectionState before any SQL, by every call that takes a caller's
    connection: ... a lease's or an election's guard(), and the pool hooks
    pglock.reset_connection and pglock.sqlalchemy.release_on_checkin". threat-model.md (f): "A
    forked child never releases, renews or uses what its parent holds ..., nor the parent's
    connections". The parent holds a lease and is inside a guarded transaction on ``conn``
    (guard() took the row lock there): the child's reset hook (or a guard() of a lease of the
    child's own, an xact_lock) on that connection is not refused. It sends its statement on the
    parent's session, in the parent's open transaction (pg_stat_activity shows the parent's
    session ran it), and reads the answer from the parent's socket."""
    name = f"review3:{uuid.uuid4()}"
    conn = connect(autocommit=False)
    with pglock.lease(installed, name, ttl=30) as lease:
        conn.execute("SELECT 1")
        lease.guard(conn)  # the parent's transaction holds the lease row now
        pid = conn.info.backend_pid
        before = _activity(installed, pid)

        def child() -> Any:
            if call == "reset_connection":
                return pglock.reset_connection(conn)
            if call == "xact_lock":  # the parent's open transaction now holds the child's lock
                return pglock.xact_lock(conn, name + ":child")
            mine = pglock.lease(installed, name + ":child", ttl=2, keepalive=False)
            assert mine.acquire(timeout=5)
            return mine.guard(conn)  # (its row then expires at its TTL)

        got = _in_child(child)
        after = _activity(installed, pid)
        conn.rollback()
    assert got.startswith("InvalidConnectionState") and after == before, (
        f"child: {got}; the parent's session {pid}: {before} -> {after}"
    )


@pytest.mark.parametrize("kind", ["lock", "singleton"])
def test_a_locker_lock_made_before_the_fork_works_in_the_child(
    installed: str, connect: Any, kind: str
) -> None:
    """docs/locks.md, "Processes and fork": in a child the parent's holds read as not held, and
    "A DSN Locker inherited from the parent opens a pool of the child's own at its first use in
    the child ..., so the locks, leases and semaphores it makes (also those made before the
    fork, such as a module-level @locker.singleton(...)) work in the child on the child's
    connections". A parent thread is blocked in ``acquire()`` of a ``locker.lock(name)`` (or of
    a ``locker.singleton(name)``) made before the fork (another session holds the name). In
    the child the copy's ``acquire(timeout=0)`` should answer False (the name is held
    elsewhere); it raises RuntimeError ("already held or being acquired"): the parent thread's
    in-flight acquire (PoolLock._busy) is inherited."""
    name = f"review3:{uuid.uuid4()}"
    blocker = pglock.pg_lock(connect(), name)
    assert blocker.acquire()
    with pglock.Locker(installed) as locker:
        lock: Any = locker.lock(name, timeout=60)
        if kind == "singleton":
            lock = locker.singleton(name, timeout=60)
        t, out = in_thread(lock.acquire)
        try:
            assert wait_until(lambda: _waits_for(installed, name), 10)
            got = _in_child(lambda: lock.acquire(timeout=0))
        finally:
            blocker.release()
            t.join(30)
            if out.get("result"):
                lock.release()
    assert got == repr(False), f"the child's acquire(timeout=0): {got}"
