"""pglock's per-connection bookkeeping against Postgres's truth (issue 11, items 4 and 13).

Threads sharing one connection share one Postgres session, and Postgres grants a session every
advisory lock it already holds, so pglock arbitrates between those threads itself. These tests
check that its records never let two threads both hold a name, and never outlive the lock so
as to refuse a thread wrongly:

* a transaction lock released by a rolled-back savepoint (SQLAlchemy ``begin_nested()``) frees
  the name for another thread in the same transaction;
* a session lock (``pg_lock``) and a transaction lock (``xact_lock``) on the same name, taken by
  two threads through one connection, exclude each other;
* the check against ``pg_locks`` happens only on the conflict path: the uncontended path sends
  no extra statement.

"Held" is read in ``pg_locks`` from another session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _threads import in_thread
from _truth import held
from psycopg import sql
from psycopg.pq import TransactionStatus
from sqlalchemy.orm import Session

import pglock
from pglock import _sql

Connect = Callable[..., psycopg.Connection[Any]]


def xk(name: str) -> tuple[int, str]:
    return (pglock.key(name), "ExclusiveLock")


@pytest.fixture
def truth_checks(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The keys of every pg_locks check pglock sends (the conflict path's one query)."""
    calls: list[list[int]] = []
    real = getattr(_sql, "held_in_transaction", None)

    def counting(keys: Any) -> sql.Composed:
        calls.append(list(keys))
        assert real is not None
        return real(keys)

    monkeypatch.setattr(_sql, "held_in_transaction", counting, raising=False)
    return calls


def pid_of(sa_conn: sa.Connection) -> int:
    raw = sa_conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw.info.backend_pid


# --- item 13: savepoints through SQLAlchemy ------------------------------------------------------


@pytest.mark.parametrize("via", ["connection", "session"])
def test_begin_nested_rollback_frees_the_name_for_another_thread(
    engine: sa.Engine, other: psycopg.Connection[Any], name: str, via: str
) -> None:
    """``begin_nested()`` is a savepoint: rolling it back releases the transaction lock taken
    inside it, and another thread in the same transaction may then take the name, and so may
    the first thread again; one that is still held keeps refusing the other thread."""
    with engine.connect() as conn:
        target: Any = conn if via == "connection" else Session(bind=conn)
        outer = target.begin()
        pglock.xact_lock(target, f"{name}:outer")  # before the savepoint: survives it
        pid = pid_of(conn)
        nested = target.begin_nested()
        pglock.xact_lock(target, name)
        assert sorted(held(other, pid)) == sorted([xk(name), xk(f"{name}:outer")])
        refused = in_thread(lambda: pglock.xact_lock(target, name))
        assert isinstance(refused, pglock.InvalidConnectionState)
        nested.rollback()
        assert held(other, pid) == [xk(f"{name}:outer")]
        # Freed for another thread (the record outlived the lock, and is dropped)...
        assert in_thread(lambda: pglock.try_xact_lock(target, name)) is True
        assert sorted(held(other, pid)) == sorted([xk(name), xk(f"{name}:outer")])
        # ...while the lock taken before the savepoint still refuses it.
        got = in_thread(lambda: pglock.try_xact_lock(target, f"{name}:outer"))
        assert isinstance(got, pglock.InvalidConnectionState)
        outer.rollback()
        if via == "session":
            target.close()
    assert held(other, pid) == []


def test_own_retake_after_begin_nested_rollback(
    engine: sa.Engine, other: psycopg.Connection[Any], name: str
) -> None:
    with Session(engine) as session, session.begin():
        with session.begin_nested() as nested:
            pglock.xact_lock(session, name)
            nested.rollback()
        pid = pid_of(session.connection())
        assert held(other, pid) == []
        pglock.xact_lock(session, name, timeout=1)
        assert held(other, pid) == [xk(name)]
    assert held(other, pid) == []


# --- session and transaction locks of two threads on one connection ---------------------------


def test_xact_lock_waits_for_another_threads_pg_lock_on_the_connection(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """Postgres would grant the transaction lock at once (the session holds the name): pglock
    makes the second thread wait in-process, as it does for pg_lock, and grants it once the
    first thread has released."""
    c = connect(autocommit=False)
    pid = c.info.backend_pid
    lock = pglock.pg_lock(c, name)
    assert lock.acquire()
    c.execute("SELECT 1")  # a transaction of the caller's, open
    got = in_thread(lambda: pglock.try_xact_lock(c, name))
    assert got is False
    err = in_thread(lambda: pglock.xact_lock(c, name, timeout=0.2))
    assert isinstance(err, pglock.LockNotAcquired)
    assert c.info.transaction_status == TransactionStatus.INTRANS  # still usable
    c.execute("SELECT 1")
    c.rollback()

    released = threading.Event()
    outcome: list[object] = []

    def waiter() -> None:
        try:
            pglock.xact_lock(c, name, timeout=10)
            outcome.append(released.is_set())
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    t.join(0.3)
    assert t.is_alive() and outcome == []  # waiting, in-process
    released.set()
    lock.release()
    t.join(10)
    assert outcome == [True]
    assert held(other, pid) == [xk(name)]  # now the transaction lock of the waiter
    c.commit()
    assert held(other, pid) == []


def test_pg_lock_is_refused_while_another_thread_holds_the_name_in_the_transaction(
    connect: Connect, other: psycopg.Connection[Any], name: str, truth_checks: list[list[int]]
) -> None:
    c = connect(autocommit=False)
    pid = c.info.backend_pid
    pglock.xact_lock(c, name)
    err = in_thread(lambda: pglock.pg_lock(c, name).acquire(timeout=0))
    assert isinstance(err, pglock.InvalidConnectionState)
    assert truth_checks == [[pglock.key(name)]]  # asked pg_locks once before refusing
    assert held(other, pid) == [xk(name)]
    c.commit()
    # The transaction ended: the record is stale, and the connection is idle, so no query.
    truth_checks.clear()

    def take_and_give_back() -> bool:
        lock = pglock.pg_lock(c, name)
        ok = lock.acquire(timeout=0)
        assert held(other, pid) == [xk(name)]
        lock.release()
        return ok

    assert in_thread(take_and_give_back) is True
    assert truth_checks == []
    assert held(other, pid) == []


def test_uncontended_paths_send_no_pg_locks_check(
    connect: Connect, other: psycopg.Connection[Any], name: str, truth_checks: list[list[int]]
) -> None:
    """The pg_locks check is for the conflict path only: a thread re-taking its own name,
    threads taking different names, and a thread taking a name another thread held in an
    earlier (committed) transaction send none."""
    c = connect(autocommit=False)
    for _ in range(3):
        pglock.xact_lock(c, name)
    assert in_thread(lambda: pglock.try_xact_lock(c, f"{name}:other")) is True
    c.commit()
    # Idle connection: the other thread's record is of an ended transaction, dropped as is.
    assert in_thread(lambda: pglock.try_xact_lock(c, name)) is True
    c.commit()
    pglock.xact_lock(c, name)
    c.commit()
    assert truth_checks == []
    assert held(other, c.info.backend_pid) == []


def test_a_stale_record_costs_one_check_then_is_forgotten(
    connect: Connect, other: psycopg.Connection[Any], name: str, truth_checks: list[list[int]]
) -> None:
    """A record whose lock a savepoint rollback released is checked once in pg_locks, then
    dropped. So is one of an earlier transaction when the connection is already in the next
    one (pglock cannot see a commit without asking the server)."""
    c = connect(autocommit=False)
    earlier = f"{name}:earlier"
    pglock.xact_lock(c, earlier)
    c.commit()
    with c.transaction():  # BEGIN is sent: the connection is not idle when pglock is called
        assert in_thread(lambda: pglock.try_xact_lock(c, earlier)) is True
    assert truth_checks == [[pglock.key(earlier)]]
    truth_checks.clear()
    c.execute("SAVEPOINT s")
    pglock.xact_lock(c, name)
    c.execute("ROLLBACK TO SAVEPOINT s")
    assert in_thread(lambda: pglock.try_xact_lock(c, name)) is True
    assert truth_checks == [[pglock.key(name)]]
    assert isinstance(
        in_thread(lambda: pglock.try_xact_lock(c, f"{name}:x") and pglock.try_xact_lock(c, name)),
        pglock.InvalidConnectionState,
    )  # that other thread's record is live: refused after one more check
    assert len(truth_checks) == 2
    c.rollback()
    assert held(other, c.info.backend_pid) == []
