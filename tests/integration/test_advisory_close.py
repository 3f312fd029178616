"""``PgLock.close()`` wakes a thread blocked in ``acquire()`` at once, on every kind of
connection source, leaving nothing held and the connection as it was."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _threads import in_thread
from psycopg.pq import TransactionStatus
from sqlalchemy.orm import Session

import pglock

Connect = Callable[..., psycopg.Connection[Any]]


def advisory_rows(observer: psycopg.Connection[Any], pid: int, name: str) -> list[tuple[Any, ...]]:
    """Every pg_locks row (granted or waiting) of ``name`` for backend ``pid``."""
    return observer.execute(
        "SELECT granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
        "AND pid = %s AND (classid::bigint << 32) | objid::bigint = %s",
        (pid, pglock.key(name)),
    ).fetchall()


def wait_until_waiting(observer: psycopg.Connection[Any], pid: int, name: str) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        if advisory_rows(observer, pid, name) == [(False,)]:
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never started waiting for {name!r}")


def holding(other: psycopg.Connection[Any], name: str) -> None:
    other.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))


def close_while_waiting(
    lock: pglock.PgLock, pid: int, name: str, observer: psycopg.Connection[Any], **kw: Any
) -> object:
    """Start ``lock.acquire(**kw)`` in a thread, close() once it waits in Postgres, and
    return what acquire returned (or raised)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(lock.acquire(**kw))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_until_waiting(observer, pid, name)
        lock.close()
    finally:
        t.join(30)
    assert not t.is_alive() and len(out) == 1
    return out[0]


@pytest.mark.parametrize(
    ("autocommit", "in_transaction", "timeout"),
    [(True, False, None), (False, False, None), (False, True, None), (True, False, 60.0),
     (False, True, 60.0)],
    ids=["autocommit", "idle", "in-transaction", "autocommit-timeout", "in-transaction-timeout"],
)
def test_close_wakes_a_psycopg_waiter(
    connect: Connect, other: psycopg.Connection[Any], name: str,
    autocommit: bool, in_transaction: bool, timeout: float | None,
) -> None:
    conn = connect(autocommit=autocommit)
    pid = conn.info.backend_pid
    if in_transaction:
        conn.execute("SELECT 1")  # the caller's own transaction, open
    status = conn.info.transaction_status
    holding(other, name)
    lock = pglock.pg_lock(conn, name, timeout=timeout)
    assert close_while_waiting(lock, pid, name, other) is False
    assert not lock.locked
    assert advisory_rows(other, pid, name) == []
    assert conn.info.transaction_status == status  # the caller's transaction is as it was
    assert conn.execute("SELECT 7").fetchone() == (7,)
    other.execute("SELECT pg_advisory_unlock_all()")
    # The object may be used again.
    with lock:
        assert advisory_rows(other, pid, name) == [(True,)]
    assert advisory_rows(other, pid, name) == []
    if not autocommit:
        conn.rollback()


def test_close_makes_with_raise_not_acquired(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    conn = connect()
    pid = conn.info.backend_pid
    holding(other, name)
    lock = pglock.pg_lock(conn, name)
    entered: list[bool] = []

    def block() -> None:
        with lock:
            entered.append(True)

    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(in_thread(block)))
    t.start()
    wait_until_waiting(other, pid, name)
    lock.close()
    t.join(30)
    assert isinstance(out[0], pglock.LockNotAcquired)
    assert entered == []
    assert advisory_rows(other, pid, name) == []
    other.execute("SELECT pg_advisory_unlock_all()")


@pytest.mark.parametrize("source", ["connection", "session"])
def test_close_wakes_a_sqlalchemy_waiter(
    engine: sa.Engine, other: psycopg.Connection[Any], name: str, source: str
) -> None:
    with engine.connect() as sa_conn:
        raw = sa_conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        pid = raw.info.backend_pid
        holding(other, name)
        session = Session(bind=sa_conn) if source == "session" else None
        lock = pglock.pg_lock(session if session is not None else sa_conn, name)
        status = raw.info.transaction_status
        assert close_while_waiting(lock, pid, name, other) is False
        assert advisory_rows(other, pid, name) == []
        assert raw.info.transaction_status == status
        assert sa_conn.execute(sa.text("SELECT 7")).scalar() == 7
        other.execute("SELECT pg_advisory_unlock_all()")
        if session is not None:
            session.close()


def test_close_wakes_a_wait_in_process(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """Another thread on the same connection holds the name: the waiter waits in-process."""
    conn = connect()
    first = pglock.pg_lock(conn, name)
    first.acquire()
    second = pglock.pg_lock(conn, name)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(second.acquire()))
    t.start()
    state = pglock._conn.state_for(conn)
    end = time.monotonic() + 20
    while not second._waiters()._count and time.monotonic() < end:
        time.sleep(0.01)
    second.close()
    t.join(30)
    assert out == [False]
    assert not second.locked and first.locked
    assert list(state.holds[pglock.key(name)].owners) == [threading.current_thread()]
    first.release()


def test_close_is_told_apart_from_the_sessions_own_timeout(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """A cancel from close() is not mistaken for the session's own statement_timeout (which
    pglock answers by sending the wait again, overriding it): acquire returns False."""
    conn = connect()
    pid = conn.info.backend_pid
    with pglock.pg_lock(conn, name):  # the probe has run: no session timeouts then
        pass
    conn.execute("SET statement_timeout = '1h'")
    holding(other, name)
    lock = pglock.pg_lock(conn, name)
    assert close_while_waiting(lock, pid, name, other) is False
    assert advisory_rows(other, pid, name) == []
    other.execute("SELECT pg_advisory_unlock_all()")


def test_close_without_a_waiter_changes_nothing(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    conn = connect()
    lock = pglock.pg_lock(conn, name)
    lock.close()
    with lock:
        lock.close()  # what is held stays held
        assert advisory_rows(other, conn.info.backend_pid, name) == [(True,)]
    assert advisory_rows(other, conn.info.backend_pid, name) == []


def test_close_never_cancels_another_threads_statement(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """While waits on the connection end (granted) and start all the time, another thread's
    statements on the same connection are never hit by close()'s cancel."""
    conn = connect()
    holder = connect()
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = pglock.pg_lock(conn, name)
    outcomes: set[bool] = set()

    def loop(body: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                while not stop.is_set():
                    body()
            except BaseException as exc:
                errors.append(exc)
        return run

    def wait() -> None:
        got = lock.acquire()
        outcomes.add(got)
        if got:
            lock.release()

    def toggle() -> None:
        with pglock.pg_lock(holder, name):
            time.sleep(0.003)

    threads = [
        threading.Thread(target=loop(wait)),
        threading.Thread(target=loop(toggle)),
        threading.Thread(target=loop(lambda: conn.execute("SELECT pg_sleep(0.002)"))),
    ]
    for t in threads:
        t.start()
    try:
        # At least 400 closes, and on until both outcomes were seen (a grant between two
        # closes can take a while on a loaded machine), 20 s at most.
        closes, give_up = 0, time.monotonic() + 20
        while (closes < 400 or outcomes != {True, False}) and time.monotonic() < give_up:
            lock.close()
            time.sleep(0.002)
            closes += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    assert outcomes == {True, False}  # waits were granted, and woken
    assert not lock.locked
    assert advisory_rows(other, conn.info.backend_pid, name) == []


def test_with_on_a_held_handle_keeps_the_lock(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """``with lock:`` on a handle already held raises RuntimeError and leaves the lock held
    (it used to release it on the way out)."""
    conn = connect()
    lock = pglock.pg_lock(conn, name)
    lock.acquire()
    with pytest.raises(RuntimeError, match="already held"), lock:
        pass
    assert lock.locked
    assert advisory_rows(other, conn.info.backend_pid, name) == [(True,)]
    lock.release()
    assert advisory_rows(other, conn.info.backend_pid, name) == []
    assert conn.info.transaction_status == TransactionStatus.IDLE
