"""Scenarios on one process's connections, against the shared server.

T07 locks in rolled-back transactions and savepoints; T08 leaving a failed transaction;
T09 timeouts, cancels and interrupts racing a release; T16 REPEATABLE READ; T20 fairness;
T23 deadlocks. Every scenario compares pglock's answer with pg_locks.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import sa_url
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.pq import TransactionStatus

import pglock

from .conftest import Bounds
from .oracles import assert_truth, truth, wait_for, waiters
from .oracles import holders as holders_of
from .waiter import Waiter

Connect = Callable[..., psycopg.Connection[Any]]
IDLE, INTRANS, INERROR = (
    TransactionStatus.IDLE,
    TransactionStatus.INTRANS,
    TransactionStatus.INERROR,
)


def me(conn: psycopg.Connection[Any]) -> int:
    return conn.info.backend_pid


# --- T07: rolled-back transactions and savepoints -------------------------------------------------


@pytest.mark.parametrize("how", ["rollback", "savepoint"])
def test_T07_session_lock_survives_rollback(
    how: str, connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    conn = connect(autocommit=False)
    conn.execute("SELECT 1")
    lock = pglock.pg_lock(conn, name)
    if how == "rollback":
        assert lock.acquire()
        conn.rollback()
    else:
        with conn.transaction(), pytest.raises(ZeroDivisionError), conn.transaction():
            assert lock.acquire()
            raise ZeroDivisionError  # rolls back to the savepoint
        conn.rollback()
    assert lock.locked
    assert holders_of(observer, pglock.key(name)) == [me(conn)]
    assert_truth(conn, observer)
    lock.release()
    assert conn.info.transaction_status == IDLE
    assert truth(observer, me(conn)) == {}
    assert_truth(conn, observer)


def test_T07_xact_lock_released_by_rollback_and_rollback_to_savepoint(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    key = pglock.key(name)
    conn, rival = connect(autocommit=False), connect()
    pglock.xact_lock(conn, name)
    assert holders_of(observer, key) == [me(conn)]
    conn.rollback()
    assert holders_of(observer, key) == []

    with conn.transaction():
        conn.execute("SELECT 1")
        with pytest.raises(ZeroDivisionError), conn.transaction():
            pglock.xact_lock(conn, name)
            assert holders_of(observer, key) == [me(conn)]
            raise ZeroDivisionError
        # The savepoint's rollback released it while the outer transaction goes on.
        assert holders_of(observer, key) == []
        with rival.transaction():
            assert pglock.try_xact_lock(rival, name)
        # And the same thread can take it again in the outer transaction.
        pglock.xact_lock(conn, name)
        assert holders_of(observer, key) == [me(conn)]
    assert holders_of(observer, key) == []


def test_T07_sqlalchemy_begin_nested(
    pg_dsn: str, app_name: str, observer: psycopg.Connection[Any], name: str
) -> None:
    sa = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    url = sa_url(pg_dsn)
    engine = sa.create_engine(
        url, connect_args={"application_name": app_name}, poolclass=sa.NullPool
    )
    try:
        session_name, xact_name = name + ":s", name + ":x"
        with Session(engine) as session:
            session.execute(sa.text("SELECT 1"))
            nested = session.begin_nested()
            lock = pglock.pg_lock(session, session_name)
            assert lock.acquire()
            pglock.xact_lock(session, xact_name)
            pid = session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            nested.rollback()
            # Session lock survives the savepoint's rollback; the transaction lock does not.
            assert holders_of(observer, pglock.key(session_name)) == [pid]
            assert holders_of(observer, pglock.key(xact_name)) == []
            assert lock.locked
            lock.release()
            assert holders_of(observer, pglock.key(session_name)) == []
            session.rollback()
    finally:
        engine.dispose()


def test_T07_orm_session_ending_its_transaction_loses_the_lock_loudly(
    pg_dsn: str, app_name: str, observer: psycopg.Connection[Any], name: str
) -> None:
    """A session lock taken through an ORM Session lives on the Session's connection; when the
    Session ends its transaction it gives that connection back (NullPool: closes it). pglock
    must then report the loss, never pretend to release a lock that is gone."""
    sa = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    url = sa_url(pg_dsn)
    engine = sa.create_engine(
        url, connect_args={"application_name": app_name}, poolclass=sa.NullPool
    )
    try:
        with Session(engine) as session:
            lock = pglock.pg_lock(session, name)
            assert lock.acquire()
            session.rollback()  # NullPool closes the connection: Postgres drops the lock
            wait_for(
                lambda: holders_of(observer, pglock.key(name)) == [],
                what="the server to end the closed session",
            )
            with pytest.raises(pglock.LockLost):
                lock.release()
            assert not lock.locked
    finally:
        engine.dispose()


# --- T08: exit from an aborted transaction --------------------------------------------------------


def test_T08_lock_inside_failed_transaction_keeps_user_exception(
    connect: Connect, observer: psycopg.Connection[Any], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The body's error propagates unmasked; the release that cannot be sent in the failed
    transaction is deferred (with a WARNING) and done at pglock's next use of the connection."""
    key = pglock.key(name)
    conn = connect(autocommit=False)
    conn.execute("SELECT 1")
    with pytest.raises(pg_errors.DivisionByZero), pglock.pg_lock(conn, name):
        conn.execute("SELECT 1/0")
    assert conn.info.transaction_status == INERROR
    assert any(r.levelname == "WARNING" and r.name.startswith("pglock") for r in caplog.records)
    # Documented limit: held by the session until pglock next runs on this connection.
    assert holders_of(observer, key) == [me(conn)]
    conn.rollback()
    assert holders_of(observer, key) == [me(conn)]
    with pglock.pg_lock(conn, name + ":next"):
        assert holders_of(observer, key) == []
    assert truth(observer, me(conn)) == {}
    assert conn.info.transaction_status == IDLE


def test_T08_lock_outside_failed_transaction_released_at_exit(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    """The recommended nesting (lock outside, transaction inside): the transaction rolls back
    first, so the release goes out at once and nothing is deferred."""
    conn = connect()
    with pytest.raises(pg_errors.DivisionByZero), pglock.pg_lock(conn, name), conn.transaction():
        conn.execute("SELECT 1/0")
    assert truth(observer, me(conn)) == {}
    assert conn.info.transaction_status == IDLE


def test_T08_body_swallows_error_and_exits_normally(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    """The block exits normally in a failed transaction: the release is deferred, and the next
    pglock call flushes it before anything else (the session's hold count stays balanced)."""
    key = pglock.key(name)
    conn = connect(autocommit=False)
    conn.execute("SELECT 1")
    with pglock.pg_lock(conn, name) as lock:
        try:
            conn.execute("SELECT 1/0")
        except pg_errors.DivisionByZero:
            pass
    assert not lock.locked
    assert conn.info.transaction_status == INERROR
    assert holders_of(observer, key) == [me(conn)]  # deferred: documented
    conn.rollback()
    again = pglock.pg_lock(conn, name, timeout=0)
    assert again.acquire()
    assert holders_of(observer, key) == [me(conn)]
    again.release()
    assert holders_of(observer, key) == []  # one acquire, one release: nothing stacked
    assert conn.info.transaction_status == IDLE


def test_T08_xact_lock_in_failed_transaction_freed_by_rollback(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    conn = connect()
    with pytest.raises(pg_errors.DivisionByZero), conn.transaction():
        pglock.xact_lock(conn, name)
        conn.execute("SELECT 1/0")
    assert holders_of(observer, pglock.key(name)) == []
    failed = connect(autocommit=False)
    with pytest.raises(pg_errors.DivisionByZero):
        failed.execute("SELECT 1/0")
    with pytest.raises(pglock.InvalidConnectionState):
        pglock.xact_lock(failed, name)  # refused before any SQL
    assert failed.info.transaction_status == INERROR


# --- T09: timeouts and cancels racing a release ---------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "xact"])
def test_T09_timeout_races_release(
    kind: str, connect: Connect, observer: psycopg.Connection[Any], name: str, bounds: Bounds
) -> None:
    """Many attempts whose timeout fires at about the moment the holder releases: every
    outcome must match pg_locks (never acquired-but-reported-failed, or the reverse)."""
    key = pglock.key(name)
    holder, conn = connect(), connect()
    rng = random.Random(9)
    outcomes = {True: 0, False: 0}
    for _ in range(200):
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        release_in = rng.uniform(0.0, 0.012)
        timer = threading.Timer(
            release_in, holder.execute, ("SELECT pg_advisory_unlock(%s)", (key,))
        )
        timer.start()
        timeout = rng.uniform(0.001, 0.012)
        if kind == "session":
            lock = pglock.pg_lock(conn, name, timeout=timeout)
            ok = lock.acquire()
            timer.join(5)
            assert lock.locked == ok
            assert truth(observer, me(conn)) == ({key: "x"} if ok else {})
            if ok:
                lock.release()
        else:
            conn.execute("BEGIN")
            conn.execute("SELECT 1")
            try:
                pglock.xact_lock(conn, name, timeout=timeout)
                ok = True
            except pglock.LockNotAcquired:
                ok = False
            timer.join(5)
            assert truth(observer, me(conn)) == ({key: "x"} if ok else {})
            assert conn.execute("SELECT 1").fetchone() == (1,)  # the transaction is usable
            assert conn.info.transaction_status == INTRANS
            conn.execute("COMMIT")
        outcomes[ok] += 1
        assert truth(observer, me(conn)) == {}
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
    assert outcomes[True] + outcomes[False] == 200
    bounds.record(
        "T09",
        kind,
        "attempts acquired (of 200, timeout racing release)",
        float(outcomes[True]),
        "attempts",
    )


def test_T09_cancel_races_release(
    connect: Connect, observer: psycopg.Connection[Any], name: str, bounds: Bounds
) -> None:
    """conn.cancel_safe() from another thread at about the moment the holder releases."""
    key = pglock.key(name)
    holder, conn = connect(), connect()
    rng = random.Random(19)
    got = 0
    for _ in range(100):
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        r = threading.Timer(
            rng.uniform(0.002, 0.010), holder.execute, ("SELECT pg_advisory_unlock(%s)", (key,))
        )
        c = threading.Timer(rng.uniform(0.002, 0.010), conn.cancel_safe)
        r.start()
        c.start()
        lock = pglock.pg_lock(conn, name)
        try:
            ok = lock.acquire()
        except pglock.LockNotAcquired:
            ok = False
        r.join(5)
        c.join(5)
        assert lock.locked == ok
        assert truth(observer, me(conn)) == ({key: "x"} if ok else {})
        if ok:
            got += 1
            lock.release()
        assert truth(observer, me(conn)) == {}
        assert conn.info.transaction_status == IDLE
    bounds.record(
        "T09",
        "session",
        "attempts acquired (of 100, cancel racing release)",
        float(got),
        "attempts",
    )


def test_T09_user_statement_timeout_does_not_shorten_requested_wait(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    key = pglock.key(name)
    holder = connect()
    conn = connect(options="-c statement_timeout=100")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    threading.Timer(0.4, holder.execute, ("SELECT pg_advisory_unlock(%s)", (key,))).start()
    lock = pglock.pg_lock(conn, name, timeout=5)
    assert lock.acquire()  # waited past the session's 100 ms statement_timeout
    assert conn.execute("SHOW statement_timeout").fetchone() == ("100ms",)
    lock.release()


@pytest.fixture
def interrupt_main() -> Iterator[Callable[[], None]]:
    """Deliver KeyboardInterrupt to the main thread (SIGUSR1: pytest-timeout owns SIGALRM)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield lambda: os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="main only")
def test_T09_keyboard_interrupt_while_waiting_leaves_nothing(
    connect: Connect,
    observer: psycopg.Connection[Any],
    name: str,
    interrupt_main: Callable[[], None],
) -> None:
    key = pglock.key(name)
    holder, conn = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    fired = threading.Event()

    def fire() -> None:
        wait_for(lambda: me(conn) in waiters(observer, key), what="the waiter to queue")
        interrupt_main()
        fired.set()

    for _ in range(5):
        fired.clear()
        threading.Thread(target=fire, daemon=True).start()
        lock = pglock.pg_lock(conn, name, timeout=20)
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
            time.sleep(5)  # pragma: no cover - the interrupt lands in the wait above
        assert fired.wait(5)
        assert not lock.locked
        assert truth(observer, me(conn)) == {}
        assert me(conn) not in waiters(observer, key)
        assert conn.execute("SELECT 1").fetchone() == (1,)
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))


# --- T16: REPEATABLE READ -------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_T16_isolation_and_freshness(
    isolation: str, connect: Connect, name: str, pg_dsn: str, bounds: Bounds
) -> None:
    """Read-modify-write of a counter in the same transaction as a transaction lock.

    READ COMMITTED: each statement sees the previous holder's commit, so nothing is lost.
    REPEATABLE READ: the snapshot is taken by the first statement, before the lock is granted
    (pglock's own first statement takes it), so a waiter reads a stale value; Postgres then
    refuses the write with 40001 and the worker retries. No committed update is lost either way;
    the number of 40001 retries is the price, recorded here."""
    table = sql.Identifier(f"pglock_fault_t16_{os.getpid()}_{random.randrange(10**9)}")
    admin = connect()
    admin.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v bigint)").format(table))
    admin.execute(sql.SQL("INSERT INTO {} VALUES (1, 0)").format(table))
    committed = 0
    retries = 0
    guard = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal committed, retries
        c = connect(autocommit=False)
        c.isolation_level = (
            psycopg.IsolationLevel.REPEATABLE_READ
            if isolation == "REPEATABLE READ"
            else psycopg.IsolationLevel.READ_COMMITTED
        )
        try:
            for _ in range(8):
                for _attempt in range(50):
                    try:
                        c.execute("SELECT 1")  # takes the snapshot (under RR) before the lock
                        pglock.xact_lock(c, name, timeout=30)
                        row = c.execute(
                            sql.SQL("SELECT v FROM {} WHERE id = 1").format(table)
                        ).fetchone()
                        assert row is not None
                        time.sleep(random.uniform(0, 0.002))
                        c.execute(
                            sql.SQL("UPDATE {} SET v = %s WHERE id = 1").format(table),
                            (row[0] + 1,),
                        )
                        c.commit()
                        with guard:
                            committed += 1
                        break
                    except pg_errors.SerializationFailure:
                        c.rollback()
                        with guard:
                            retries += 1
                else:
                    raise AssertionError("no commit after 50 attempts")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert not errors, errors
        value = admin.execute(sql.SQL("SELECT v FROM {} WHERE id = 1").format(table)).fetchone()
        assert value == (committed,)
        assert committed == 48
        if isolation == "READ COMMITTED":
            assert retries == 0
        bounds.record(
            "T16", isolation.lower(), "40001 retries per 48 commits", float(retries), "retries"
        )
    finally:
        admin.execute(sql.SQL("DROP TABLE {}").format(table))


# --- T20: fairness --------------------------------------------------------------------------------


def test_T20_releasing_holder_cannot_barge(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    """Postgres hands the lock to the queued waiter at release: the releasing session's
    immediate re-try finds it taken."""
    key = pglock.key(name)
    holder, wconn = connect(), connect()
    for _ in range(10):
        lock = pglock.pg_lock(holder, name)
        assert lock.acquire()
        w = Waiter(wconn, name)
        wait_for(lambda: me(wconn) in waiters(observer, key), what="the waiter to queue")
        lock.release()
        assert not pglock.pg_lock(holder, name).acquire(timeout=0)
        w.join()
        w.release()
    assert holders_of(observer, key) == []


def test_T20_blocking_waiters_are_served_in_queue_order(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    """FIFO: waiters queued one after another get the lock in that order."""
    key = pglock.key(name)
    holder = connect()
    lock = pglock.pg_lock(holder, name)
    assert lock.acquire()
    order: list[int] = []
    guard = threading.Lock()
    conns = [connect() for _ in range(6)]

    def wait(i: int) -> None:
        with pglock.pg_lock(conns[i], name, timeout=30):
            with guard:
                order.append(i)
            time.sleep(0.005)

    threads = []
    for i in range(len(conns)):
        t = threading.Thread(target=wait, args=(i,))
        t.start()
        threads.append(t)
        wait_for(lambda i=i: me(conns[i]) in waiters(observer, key), what=f"waiter {i} to queue")
    lock.release()
    for t in threads:
        t.join(30)
    assert order == list(range(len(conns)))


def test_T20_readers_queue_behind_a_waiting_writer(
    connect: Connect, observer: psycopg.Connection[Any], name: str
) -> None:
    """A shared holder, an exclusive waiter queued: a new shared request does not jump the
    queue (fail-fast says taken), so a stream of readers cannot starve the writer."""
    key = pglock.key(name)
    reader, writer, late = connect(), connect(), connect()
    r = pglock.pg_lock(reader, name, shared=True)
    assert r.acquire()
    w = Waiter(writer, name)
    wait_for(lambda: me(writer) in waiters(observer, key), what="the writer to queue")
    assert not pglock.pg_lock(late, name, shared=True).acquire(timeout=0)
    r.release()
    w.join()
    w.release()
    late_lock = pglock.pg_lock(late, name, shared=True)
    assert late_lock.acquire(timeout=0)
    late_lock.release()


# --- T23: deadlock between two keys ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "xact"])
def test_T23_deadlock_one_victim_nothing_extra_held(
    kind: str, connect: Connect, observer: psycopg.Connection[Any], name: str, bounds: Bounds
) -> None:
    a_name, b_name = name + ":a", name + ":b"
    ka, kb = pglock.key(a_name), pglock.key(b_name)
    c1, c2 = connect(autocommit=kind != "xact"), connect(autocommit=kind != "xact")

    def take(conn: psycopg.Connection[Any], n: str) -> Any:
        if kind == "session":
            lk = pglock.pg_lock(conn, n)
            assert lk.acquire()
            return lk
        pglock.xact_lock(conn, n)
        return None

    first1, first2 = take(c1, a_name), take(c2, b_name)
    results: dict[str, Any] = {}

    def second(label: str, conn: psycopg.Connection[Any], n: str) -> None:
        try:
            results[label] = take(conn, n)
        except BaseException as exc:
            results[label] = exc

    t1 = threading.Thread(target=second, args=("c1", c1, b_name))
    t1.start()
    wait_for(lambda: me(c1) in waiters(observer, kb), what="c1 to wait for b")
    started = time.monotonic()
    t2 = threading.Thread(target=second, args=("c2", c2, a_name))
    t2.start()
    wait_for(lambda: results, timeout=20, what="a deadlock victim")
    bounds.record(
        "T23", kind, "deadlock detected (deadlock_timeout 1 s)", time.monotonic() - started
    )
    assert len(results) == 1, results
    ((label, err),) = results.items()
    assert isinstance(err, pglock.DeadlockDetected), results
    victim, winner = (c1, c2) if label == "c1" else (c2, c1)
    winner_label = "c2" if label == "c1" else "c1"
    # The victim holds only its first lock: the failed request left nothing behind.
    assert truth(observer, me(victim)) == {ka if victim is c1 else kb: "x"}
    if kind == "xact":
        assert victim.execute("SELECT 1").fetchone() == (1,)  # its transaction is usable
        victim.rollback()
    else:
        (first1 if victim is c1 else first2).release()
    t1.join(20)
    t2.join(20)
    assert not isinstance(results.get(winner_label), BaseException), results
    assert set(truth(observer, me(winner))) == {ka, kb}
    if kind == "session":
        results[winner_label].release()
        (first1 if winner is c1 else first2).release()
    else:
        winner.rollback()
    assert truth(observer, me(c1)) == {}
    assert truth(observer, me(c2)) == {}
