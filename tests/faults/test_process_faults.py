"""T02 holder SIGKILL, T03 backend terminated, T18 client death while its backend is busy.

Holders run in subprocesses (``holder.py``) against the shared server; waiters are threads
of the test process. Each test measures how long after the fault a waiter got the lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pglock

from .conftest import Bounds
from .oracles import holders as holders_of
from .oracles import truth, wait_for, waiters
from .procs import Holder
from .waiter import Waiter

Connect = Callable[..., psycopg.Connection[Any]]


def start_holder(
    holders: Callable[..., Holder], pg_dsn: str, app_name: str, kind: str, name: str
) -> tuple[Holder, int]:
    h = holders()
    pid = int(h.request("connect", dsn=pg_dsn, app=app_name, autocommit=kind != "xact")["pid"])
    h.request("lock", kind=kind, name=name)
    return h, pid


# --- T02: holder SIGKILL -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "xact"])
def test_T02_holder_sigkill(
    kind: str,
    pg_dsn: str,
    app_name: str,
    name: str,
    connect: Connect,
    observer: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    scratch: sql.Identifier,
    bounds: Bounds,
) -> None:
    """A killed holder's advisory lock is freed as soon as the server sees EOF; a waiter gets
    it, and a transaction holder's uncommitted writes are rolled back."""
    key = pglock.key(name)
    times: list[float] = []
    for round_ in range(3):
        h, pid = start_holder(holders, pg_dsn, app_name, kind, name)
        h.request(
            "sql",
            sql=sql.SQL("INSERT INTO {} VALUES (%s)").format(scratch).as_string(observer),
            params=[f"dead-{round_}"],
        )
        assert holders_of(observer, key) == [pid]
        wconn = connect()
        w = Waiter(wconn, name, kind)
        wait_for(
            lambda wconn=wconn: wconn.info.backend_pid in waiters(observer, key),
            what="the waiter to queue",
        )
        killed_at = h.kill()
        got_at = w.join()
        times.append(got_at - killed_at)
        assert holders_of(observer, key) == [wconn.info.backend_pid]
        assert truth(observer, pid) == {}
        w.release()
        wconn.close()
    rows = observer.execute(sql.SQL("SELECT v FROM {}").format(scratch)).fetchall()
    if kind == "xact":
        assert rows == []  # each dead holder's transaction was rolled back
    else:
        assert len(rows) == 3  # autocommit writes before the kill are committed work
    bounds.record("T02", kind, "waiter got the lock after its holder was SIGKILLed", times)
    assert max(times) < 5.0


# --- T03: pg_terminate_backend ---------------------------------------------------------------


def terminate(observer: psycopg.Connection[Any], pid: int) -> float:
    t = time.monotonic()
    observer.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    return t


def test_T03_terminated_session_holder_gets_lock_lost(
    name: str, connect: Connect, observer: psycopg.Connection[Any], bounds: Bounds
) -> None:
    key = pglock.key(name)
    conn = connect()
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    pid = conn.info.backend_pid
    wconn = connect()
    w = Waiter(wconn, name)
    wait_for(lambda: wconn.info.backend_pid in waiters(observer, key), what="the waiter to queue")
    t = terminate(observer, pid)
    got = w.join()
    bounds.record(
        "T03", "session", "waiter got the lock after pg_terminate_backend(holder)", got - t
    )
    assert holders_of(observer, key) == [wconn.info.backend_pid]
    # The holder learns it on release: LockLost, never a raw psycopg error, never a re-acquire.
    with pytest.raises(pglock.LockLost) as info:
        lock.release()
    assert info.value.name == name
    assert not lock.locked
    assert holders_of(observer, key) == [wconn.info.backend_pid]
    with pytest.raises(pglock.InvalidConnectionState):
        lock.acquire(timeout=0)
    w.release()


def test_T03_terminated_inside_with_block_raises_lock_lost(
    name: str, connect: Connect, observer: psycopg.Connection[Any]
) -> None:
    conn = connect()
    with pytest.raises(pglock.LockLost), pglock.pg_lock(conn, name):
        terminate(observer, conn.info.backend_pid)
    assert holders_of(observer, pglock.key(name)) == []


def test_T03_terminated_inside_with_block_keeps_user_exception(
    name: str, connect: Connect, observer: psycopg.Connection[Any]
) -> None:
    """The body's own exception wins over the release problem (logged, not raised)."""
    conn = connect()
    with pytest.raises(KeyError), pglock.pg_lock(conn, name):
        terminate(observer, conn.info.backend_pid)
        raise KeyError("user")


def test_T03_terminated_xact_holder(
    name: str,
    connect: Connect,
    observer: psycopg.Connection[Any],
    scratch: sql.Identifier,
    bounds: Bounds,
) -> None:
    key = pglock.key(name)
    conn = connect(autocommit=False)
    pglock.xact_lock(conn, name)
    conn.execute(sql.SQL("INSERT INTO {} VALUES ('doomed')").format(scratch))
    wconn = connect()
    w = Waiter(wconn, name, "xact")
    wait_for(lambda: wconn.info.backend_pid in waiters(observer, key), what="the waiter to queue")
    t = terminate(observer, conn.info.backend_pid)
    got = w.join()
    bounds.record("T03", "xact", "waiter got the lock after pg_terminate_backend(holder)", got - t)
    with pytest.raises(psycopg.OperationalError):
        conn.commit()
    assert observer.execute(sql.SQL("SELECT count(*) FROM {}").format(scratch)).fetchone() == (0,)
    with pytest.raises(pglock.InvalidConnectionState):
        pglock.xact_lock(conn, name)
    w.release()


# --- T18: client death while its backend is busy -------------------------------------------------


def test_T18_killed_client_with_busy_backend_keeps_lock_until_statement_ends(
    pg_dsn: str,
    app_name: str,
    name: str,
    observer: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    bounds: Bounds,
) -> None:
    """Documented limit: a backend running a statement notices its client died only when it
    next touches the socket, so the session lock outlives the client until the statement ends."""
    key = pglock.key(name)
    h, pid = start_holder(holders, pg_dsn, app_name, "session", name)
    h.send("sql", sql="SELECT pg_sleep(2)")
    wait_for(
        lambda: (
            observer.execute(
                "SELECT state = 'active' FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            == (True,)
        ),
        what="the holder's statement to run",
    )
    killed = h.kill()
    time.sleep(0.5)
    assert holders_of(observer, key) == [pid]  # still held: the backend is busy sleeping
    wait_for(lambda: holders_of(observer, key) == [], timeout=10, what="the lock to be freed")
    bounds.record(
        "T18",
        "session",
        "lock freed after client SIGKILL, backend busy 2 s, no check interval",
        time.monotonic() - killed,
    )


def test_T18_client_connection_check_interval_frees_lock_of_busy_backend(
    pg_dsn: str,
    app_name: str,
    name: str,
    observer: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    bounds: Bounds,
) -> None:
    """With client_connection_check_interval the busy backend notices the dead client and
    ends (and frees the lock) long before its statement would have finished."""
    key = pglock.key(name)
    h = holders()
    dsn = (
        pg_dsn
        + ("&" if "?" in pg_dsn else "?")
        + "options=-c%20client_connection_check_interval%3D200"
    )
    pid = int(h.request("connect", dsn=dsn, app=app_name)["pid"])
    h.request("lock", kind="session", name=name)
    h.send("sql", sql="SELECT pg_sleep(30)")
    wait_for(
        lambda: (
            observer.execute(
                "SELECT state = 'active' FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            == (True,)
        ),
        what="the holder's statement to run",
    )
    killed = h.kill()
    wait_for(lambda: holders_of(observer, key) == [], timeout=10, what="the lock to be freed")
    took = time.monotonic() - killed
    bounds.record(
        "T18", "session", "lock freed after client SIGKILL, busy backend, check 200 ms", took
    )
    assert took < 10


def test_T18_ghost_waiter_with_check_interval(
    pg_dsn: str,
    app_name: str,
    name: str,
    connect: Connect,
    observer: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    bounds: Bounds,
) -> None:
    """A client killed while its backend waits in pg_advisory_lock: with the check interval the
    waiting backend ends too, so it is never granted the lock after its client is gone."""
    key = pglock.key(name)
    conn = connect()
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    h = holders()
    dsn = (
        pg_dsn
        + ("&" if "?" in pg_dsn else "?")
        + "options=-c%20client_connection_check_interval%3D200"
    )
    pid = int(h.request("connect", dsn=dsn, app=app_name)["pid"])
    h.send("lock", kind="session", name=name)
    wait_for(lambda: pid in waiters(observer, key), what="the ghost to queue")
    killed = h.kill()
    wait_for(lambda: pid not in waiters(observer, key), timeout=10, what="the ghost to go")
    bounds.record(
        "T18",
        "session",
        "waiting backend of a SIGKILLed client ended (check 200 ms)",
        time.monotonic() - killed,
    )
    lock.release()
    assert holders_of(observer, key) == []


def test_T18_ghost_waiter_without_check_interval_is_granted_then_dropped(
    pg_dsn: str,
    app_name: str,
    name: str,
    connect: Connect,
    observer: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    bounds: Bounds,
) -> None:
    """Documented: without the check interval a dead client's waiting backend stays queued; on
    the next release Postgres grants it the lock, and the backend drops it (and ends) as soon
    as it tries to send the result to the dead client."""
    key = pglock.key(name)
    conn = connect()
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    h = holders()
    pid = int(h.request("connect", dsn=pg_dsn, app=app_name)["pid"])
    h.send("lock", kind="session", name=name)
    wait_for(lambda: pid in waiters(observer, key), what="the ghost to queue")
    h.kill()
    time.sleep(0.3)
    assert pid in waiters(observer, key)  # the dead client's backend is still queued
    released = time.monotonic()
    lock.release()
    wait_for(
        lambda: (
            observer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            == (0,)
        ),
        timeout=10,
        what="the ghost backend to end",
    )
    bounds.record(
        "T18",
        "session",
        "ghost waiter granted then dropped after release (no check)",
        time.monotonic() - released,
    )
    assert holders_of(observer, key) == []
    assert lock.acquire(timeout=5)
    lock.release()
