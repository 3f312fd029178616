"""Session-level advisory locks (``pg_lock``) against a real Postgres server.

Every assertion about "held" is checked in ``pg_locks`` from another session.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _truth import held, holders
from _wire import RecordingConnection
from psycopg import sql
from psycopg.pq import TransactionStatus

import pglock

Connect = Callable[..., psycopg.Connection[Any]]
IDLE = TransactionStatus.IDLE
INTRANS = TransactionStatus.INTRANS


# --- helpers --------------------------------------------------------------------------------


def wait_until_waiting(observer: psycopg.Connection[Any], pid: int, deadline: float = 10) -> None:
    """Poll pg_locks until backend ``pid`` waits for an advisory lock."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        row = observer.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND pid = %s",
            (pid,),
        ).fetchone()
        if row and row[0]:
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never started waiting for an advisory lock")


def show(conn: psycopg.Connection[Any], setting: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
    assert row is not None
    return str(row[0])


def xk(name: str) -> tuple[int, str]:
    return (pglock.key(name), "ExclusiveLock")


def sk(name: str) -> tuple[int, str]:
    return (pglock.key(name), "ShareLock")


def two_names_by_key() -> tuple[str, str]:
    """Two fresh names, (first, second) in the order pglock takes them (by key)."""
    a, b = f"test:{uuid.uuid4()}", f"test:{uuid.uuid4()}"
    return (a, b) if pglock.key(a) < pglock.key(b) else (b, a)


@pytest.fixture
def counting(pg_dsn: str, app_name: str, other: psycopg.Connection[Any]) -> Iterator[Connect]:
    opened: list[RecordingConnection] = []

    def factory(autocommit: bool = True) -> RecordingConnection:
        c: RecordingConnection = RecordingConnection.connect(
            pg_dsn, autocommit=autocommit, application_name=app_name
        )
        opened.append(c)
        return c

    yield factory
    leaked = [(c.info.backend_pid, held(other, c.info.backend_pid)) for c in opened if not c.closed]
    for c in opened:
        c.close()
    assert all(not h for _, h in leaked), leaked


# --- exclusion and transaction state -----------------------------------------------------------


def test_exclusion_between_sessions(connect: Connect, name: str) -> None:
    a, b, obs = connect(), connect(), connect()
    with pglock.pg_lock(a, name) as lock:
        assert lock.locked
        assert holders(obs, name) == [(a.info.backend_pid, "ExclusiveLock")]
        assert pglock.pg_lock(b, name).acquire(timeout=0) is False
        with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(b, name, timeout=0):
            pytest.fail("body ran without the lock")
    assert not lock.locked
    assert holders(obs, name) == []
    with pglock.pg_lock(b, name, timeout=0):
        assert holders(obs, name) == [(b.info.backend_pid, "ExclusiveLock")]
    assert holders(obs, name) == []


def test_blocked_session_gets_lock_after_release(connect: Connect, name: str) -> None:
    a, b, obs = connect(), connect(), connect()
    got = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            with pglock.pg_lock(b, name, timeout=10):
                got.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with pglock.pg_lock(a, name):
        t = threading.Thread(target=waiter)
        t.start()
        wait_until_waiting(obs, b.info.backend_pid)
        assert not got.is_set()
    t.join(10)
    assert not t.is_alive() and not errors and got.is_set()
    assert holders(obs, name) == []


@pytest.mark.parametrize("timeout", [None, 0, 2.0])
@pytest.mark.parametrize("shared", [False, True])
def test_idle_non_autocommit_connection_stays_idle(
    connect: Connect, name: str, timeout: float | None, shared: bool
) -> None:
    c, obs = connect(autocommit=False), connect()
    pid = c.info.backend_pid
    lock = pglock.pg_lock(c, name, timeout=timeout, shared=shared)
    assert lock.acquire()
    assert c.info.transaction_status == IDLE
    state = obs.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert state == ("idle",)
    assert held(obs, pid) == [sk(name) if shared else xk(name)]
    lock.release()
    assert c.info.transaction_status == IDLE
    assert held(obs, pid) == []
    state = obs.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert state == ("idle",)


def test_idle_non_autocommit_multi_name_stays_idle(connect: Connect) -> None:
    c, obs = connect(autocommit=False), connect()
    a, b = two_names_by_key()
    with pglock.pg_lock(c, [b, a], timeout=1):
        assert c.info.transaction_status == IDLE
        assert held(obs, c.info.backend_pid) == sorted([xk(a), xk(b)])
    assert c.info.transaction_status == IDLE
    assert held(obs, c.info.backend_pid) == []


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_session_lock_inside_open_transaction_survives_its_end(
    connect: Connect, name: str, end: str
) -> None:
    c, obs = connect(autocommit=False), connect()
    c.execute("CREATE TEMP TABLE t (v int)")
    c.execute("INSERT INTO t VALUES (1)")
    assert c.info.transaction_status == INTRANS
    lock = pglock.pg_lock(c, name)
    assert lock.acquire()
    assert c.info.transaction_status == INTRANS  # still the caller's transaction
    # The caller's earlier work is still part of that transaction.
    assert c.execute("SELECT count(*) FROM t").fetchone() == (1,)
    getattr(c, end)()
    assert held(obs, c.info.backend_pid) == [xk(name)]
    lock.release()
    assert held(obs, c.info.backend_pid) == []
    assert c.info.transaction_status == IDLE


def test_session_lock_in_autocommit_transaction_block(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    with c.transaction():
        c.execute("SELECT 1")
        lock = pglock.pg_lock(c, name)
        lock.acquire()
    assert held(obs, c.info.backend_pid) == [xk(name)]
    lock.release()
    assert held(obs, c.info.backend_pid) == []


# --- threads sharing one connection --------------------------------------------------------


@pytest.fixture
def counter(connect: Connect) -> Iterator[tuple[str, Connect]]:
    """A one-row counter table; read and written non-atomically by the workload."""
    admin = connect()
    table = f"pglock_counter_{uuid.uuid4().hex[:12]}"
    admin.execute(sql.SQL("CREATE TABLE {} (v int NOT NULL)").format(sql.Identifier(table)))
    admin.execute(sql.SQL("INSERT INTO {} VALUES (0)").format(sql.Identifier(table)))
    try:
        yield table, connect
    finally:
        admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


def run_workload(
    table: str,
    connect: Connect,
    critical: Callable[[Callable[[], None]], None],
    threads: int = 4,
    iterations: int = 20,
) -> tuple[int, int, int]:
    """Each thread runs ``iterations`` critical sections: read the counter over its own
    autocommit connection, sleep 0-3 ms, write value + 1. Returns (counter, sections,
    most threads seen inside at once)."""
    inside = 0
    most = 0
    done = 0
    guard = threading.Lock()
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    tbl = sql.Identifier(table)

    def worker(seed: int) -> None:
        nonlocal inside, most, done
        rnd = random.Random(seed)
        try:
            with connect() as cc:
                barrier.wait(10)
                for _ in range(iterations):

                    def section() -> None:
                        nonlocal inside, most, done
                        with guard:
                            inside += 1
                            most = max(most, inside)
                        row = cc.execute(sql.SQL("SELECT v FROM {}").format(tbl)).fetchone()
                        assert row is not None
                        time.sleep(rnd.uniform(0, 0.003))
                        cc.execute(sql.SQL("UPDATE {} SET v = %s").format(tbl), (row[0] + 1,))
                        with guard:
                            inside -= 1
                            done += 1

                    critical(section)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers), "workload did not finish"
    assert not errors, errors
    with connect() as cc:
        row = cc.execute(sql.SQL("SELECT v FROM {}").format(tbl)).fetchone()
    assert row is not None
    return row[0], done, most


def test_threads_sharing_one_connection_never_overlap(
    counter: tuple[str, Connect], name: str
) -> None:
    table, connect = counter
    shared_conn, obs = connect(), connect()

    def critical(section: Callable[[], None]) -> None:
        with pglock.pg_lock(shared_conn, name, timeout=30):
            section()

    value, done, most = run_workload(table, connect, critical)
    assert done == 80
    assert most == 1
    assert value == 80  # no lost update
    assert held(obs, shared_conn.info.backend_pid) == []


def test_negative_control_raw_advisory_locks_on_shared_connection_overlap(
    counter: tuple[str, Connect], name: str
) -> None:
    """The same workload with raw pg_advisory_lock on the shared connection: Postgres grants
    the session's lock to every thread, so the oracle must see overlap and lost updates."""
    table, connect = counter
    shared_conn, obs = connect(), connect()
    k = pglock.key(name)

    def critical(section: Callable[[], None]) -> None:
        shared_conn.execute("SELECT pg_advisory_lock(%s)", (k,))
        try:
            section()
        finally:
            shared_conn.execute("SELECT pg_advisory_unlock(%s)", (k,))

    value, done, most = run_workload(table, connect, critical)
    assert done == 80
    assert most > 1, "the oracle saw no overlap without pglock: it cannot detect a broken lock"
    assert value < 80, "the oracle saw no lost update without pglock"
    assert held(obs, shared_conn.info.backend_pid) == []


def test_other_thread_waits_in_process_and_times_out(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    result: list[object] = []
    with pglock.pg_lock(c, name):
        t = threading.Thread(
            target=lambda: result.append(pglock.pg_lock(c, name).acquire(timeout=0.2))
        )
        t.start()
        t.join(10)
        assert result == [False]
        t2 = threading.Thread(
            target=lambda: result.append(pglock.pg_lock(c, name).acquire(blocking=False))
        )
        t2.start()
        t2.join(10)
        assert result == [False, False]
    assert held(obs, c.info.backend_pid) == []


def test_other_thread_gets_lock_after_first_releases(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    entered = threading.Event()
    seen: list[list[tuple[int, str]]] = []

    def second() -> None:
        with pglock.pg_lock(c, name, timeout=10):
            entered.set()
            seen.append(held(obs, c.info.backend_pid))

    with pglock.pg_lock(c, name):
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(0.2)  # bounded wait, not a timing assertion on pglock
    t.join(10)
    assert entered.is_set()
    assert seen == [[xk(name)]]
    assert held(obs, c.info.backend_pid) == []


def test_shared_locks_from_threads_on_one_connection_coexist(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    both = threading.Barrier(2)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            with pglock.pg_lock(c, name, shared=True, timeout=5):
                both.wait(5)  # both inside at once
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=reader) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not errors
    assert held(obs, c.info.backend_pid) == []


# --- re-entrancy and upgrades ----------------------------------------------------------------


def test_reentry_same_thread_is_counted_without_sql(counting: Connect, other: Any) -> None:
    c: Any = counting()
    name = f"test:{uuid.uuid4()}"
    pid = c.info.backend_pid
    with pglock.pg_lock(c, name):
        assert held(other, pid) == [xk(name)]
        before = list(c.sent)
        with pglock.pg_lock(c, name) as inner:
            assert inner.locked
            with pglock.pg_lock(c, name, timeout=0):
                pass
        assert c.sent == before, "re-entry sent SQL"
        # Still held after the inner blocks exit; pg_locks shows one hold.
        assert held(other, pid) == [xk(name)]
        # Exactly one level in Postgres: one unlock frees it (pg_locks shows one row for any
        # count, so this is the check that pglock did not take it twice).
        assert other.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype='advisory' AND pid=%s", (pid,)
        ).fetchone() == (1,)
    assert held(other, pid) == []
    # One unlock released it: a second session can take it at once.
    with pglock.pg_lock(other, name, timeout=0):
        pass


def test_reentry_exclusive_then_shared_same_thread(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    with pglock.pg_lock(c, name), pglock.pg_lock(c, name, shared=True):
        assert held(obs, c.info.backend_pid) == [xk(name)]
    assert held(obs, c.info.backend_pid) == []


def test_shared_then_exclusive_upgrade_refused(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    with pglock.pg_lock(c, name, shared=True):
        with pytest.raises(pglock.LockError, match="upgrad"):
            pglock.pg_lock(c, name).acquire()
        with pytest.raises(pglock.LockError, match="upgrad"):
            pglock.pg_lock(c, [name, f"test:{uuid.uuid4()}"]).acquire(timeout=0)
        assert held(obs, c.info.backend_pid) == [sk(name)]
    assert held(obs, c.info.backend_pid) == []


def test_handle_is_not_reentrant_itself(connect: Connect, name: str) -> None:
    c = connect()
    lock = pglock.pg_lock(c, name)
    with lock, pytest.raises(RuntimeError, match="already held"):
        lock.acquire()
    with pytest.raises(RuntimeError, match="unlocked"):
        lock.release()
    # A handle can be used again after release.
    assert lock.acquire(timeout=0)
    lock.release()


# --- timeouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["autocommit", "idle", "intrans"])
def test_timeout_bound_settings_unchanged_nothing_held(
    connect: Connect, name: str, mode: str
) -> None:
    c, holder, obs = connect(autocommit=(mode == "autocommit")), connect(), connect()
    c.execute("SET lock_timeout = '7s'")
    c.execute("SET statement_timeout = '11s'")
    if mode != "autocommit":
        c.commit()
    if mode == "intrans":
        c.execute("SELECT 1")
    status = c.info.transaction_status
    with pglock.pg_lock(holder, name):
        t0 = time.monotonic()
        with (
            pytest.raises(pglock.LockNotAcquired) as info,
            pglock.pg_lock(c, name, timeout=0.5),
        ):
            pytest.fail("body ran without the lock")
        elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed <= 1.5, elapsed  # the acceptance bound [timeout, timeout + 1 s]
    assert isinstance(info.value, TimeoutError)
    assert info.value.name == name
    assert info.value.key == pglock.key(name)
    assert info.value.timeout == 0.5
    assert "within 0.50 s" in str(info.value)
    assert c.info.transaction_status == status
    assert show(c, "lock_timeout") == "7s"
    assert show(c, "statement_timeout") == "11s"
    assert held(obs, c.info.backend_pid) == []
    if mode != "autocommit":
        c.rollback()
    assert show(c, "lock_timeout") == "7s"
    assert show(c, "statement_timeout") == "11s"


def test_timeout_success_path_leaves_settings_unchanged(connect: Connect, name: str) -> None:
    for autocommit in (True, False):
        c, obs = connect(autocommit=autocommit), connect()
        if not autocommit:
            c.execute("SELECT 1")  # inside the caller's transaction
        with pglock.pg_lock(c, name, timeout=3):
            assert show(c, "lock_timeout") == "0"
            assert show(c, "statement_timeout") == "0"
        assert show(c, "lock_timeout") == "0"
        assert show(c, "statement_timeout") == "0"
        assert held(obs, c.info.backend_pid) == []
        if not autocommit:
            c.commit()


def test_acquire_returns_false_on_timeout(connect: Connect, name: str) -> None:
    c, holder, obs = connect(), connect(), connect()
    with pglock.pg_lock(holder, name):
        lock = pglock.pg_lock(c, name, timeout=0.2)
        assert lock.acquire() is False
        assert not lock.locked
        assert lock.acquire(timeout=0.1) is False
        assert lock.acquire(blocking=False) is False
    assert lock.acquire(timeout=1) is True
    assert lock.locked
    lock.release()
    assert held(obs, c.info.backend_pid) == []


def test_timeout_in_open_transaction_keeps_earlier_writes(connect: Connect, name: str) -> None:
    c, holder, obs = connect(autocommit=False), connect(), connect()
    c.execute("CREATE TEMP TABLE w (v int)")
    c.commit()
    c.execute("INSERT INTO w VALUES (1), (2)")
    with pglock.pg_lock(holder, name):
        with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(c, name, timeout=0.2):
            pass
        assert pglock.pg_lock(c, name).acquire(timeout=0) is False
    assert c.info.transaction_status == INTRANS
    c.execute("INSERT INTO w VALUES (3)")  # the transaction is usable
    assert c.execute("SELECT sum(v) FROM w").fetchone() == (6,)
    c.commit()
    assert c.execute("SELECT count(*) FROM w").fetchone() == (3,)
    c.commit()
    assert held(obs, c.info.backend_pid) == []


@pytest.mark.parametrize("mode", ["autocommit", "idle", "intrans"])
@pytest.mark.parametrize("timeout", [0, 0.3])
def test_multi_key_timeout_gives_back_the_granted_first_key(
    connect: Connect, mode: str, timeout: float
) -> None:
    """The first key (by key order) is free and granted, the second is held elsewhere: the
    attempt fails and pg_locks shows the first key NOT held afterwards."""
    first, second = two_names_by_key()
    c, holder, obs = connect(autocommit=(mode == "autocommit")), connect(), connect()
    if mode == "intrans":
        c.execute("SELECT 1")
    status = c.info.transaction_status
    with pglock.pg_lock(holder, second):
        lock = pglock.pg_lock(c, [second, first], timeout=timeout)
        assert lock.acquire() is False
        assert held(obs, c.info.backend_pid) == []
        assert c.info.transaction_status == status
        with (
            pytest.raises(pglock.LockNotAcquired),
            pglock.pg_lock(c, [first, second], timeout=timeout),
        ):
            pass
        assert held(obs, c.info.backend_pid) == []
        # pglock's bookkeeping agrees: the first name alone is free for this connection.
        with pglock.pg_lock(c, first, timeout=0):
            assert held(obs, c.info.backend_pid) == [xk(first)]
    assert held(obs, c.info.backend_pid) == []
    if mode != "autocommit":
        c.rollback()


def test_timeout_race_with_release(connect: Connect) -> None:
    """The holder releases at about the moment the waiter's timeout fires: whatever the
    outcome, pglock's answer matches pg_locks."""
    c, holder, obs = connect(), connect(), connect()
    for i in range(10):
        name = f"test:{uuid.uuid4()}"
        holder.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
        releaser = threading.Timer(
            0.1 + (i - 5) * 0.001,
            lambda n=name: holder.execute("SELECT pg_advisory_unlock(%s)", (pglock.key(n),)),
        )
        releaser.start()
        lock = pglock.pg_lock(c, name, timeout=0.1)
        ok = lock.acquire()
        releaser.join(5)
        assert held(obs, c.info.backend_pid) == ([xk(name)] if ok else [])
        if ok:
            lock.release()
        assert held(obs, c.info.backend_pid) == []
        assert holders(obs, name) == []


# --- multi-name ordering and deadlocks -------------------------------------------------------


def test_opposite_order_multi_name_never_deadlocks(connect: Connect) -> None:
    a, b = two_names_by_key()
    c1, c2, obs = connect(), connect(), connect()
    inside = 0
    most = 0
    guard = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(c: psycopg.Connection[Any], names: list[str]) -> None:
        nonlocal inside, most
        try:
            barrier.wait(10)
            for _ in range(100):
                with pglock.pg_lock(c, names, timeout=20):
                    with guard:
                        inside += 1
                        most = max(most, inside)
                    with guard:
                        inside -= 1
        except BaseException as exc:
            errors.append(exc)

    ts = [
        threading.Thread(target=worker, args=(c1, [a, b])),
        threading.Thread(target=worker, args=(c2, [b, a])),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert not errors, errors
    assert most == 1
    assert held(obs, c1.info.backend_pid) == [] and held(obs, c2.info.backend_pid) == []


def test_nested_opposite_order_deadlock_is_translated(connect: Connect) -> None:
    a, b = two_names_by_key()
    c1, c2, obs = connect(), connect(), connect()
    barrier = threading.Barrier(2)
    outcome: dict[str, BaseException | None] = {}

    def worker(tag: str, c: psycopg.Connection[Any], first: str, second: str) -> None:
        try:
            with pglock.pg_lock(c, first):
                barrier.wait(10)
                with pglock.pg_lock(c, second, timeout=20):
                    pass
            outcome[tag] = None
        except BaseException as exc:
            outcome[tag] = exc

    ts = [
        threading.Thread(target=worker, args=("1", c1, a, b)),
        threading.Thread(target=worker, args=("2", c2, b, a)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)
    errors = [e for e in outcome.values() if e is not None]
    assert len(outcome) == 2 and len(errors) == 1, outcome
    err = errors[0]
    assert isinstance(err, pglock.DeadlockDetected), repr(err)
    assert isinstance(err.__cause__, psycopg.errors.DeadlockDetected)
    assert err.__cause__.sqlstate == "40P01"
    assert err.name in (a, b) and err.key == pglock.key(err.name)
    for c in (c1, c2):
        assert held(obs, c.info.backend_pid) == []
        assert c.info.transaction_status == IDLE
        with pglock.pg_lock(c, [a, b], timeout=5):  # still usable
            pass
    assert holders(obs, a) == [] and holders(obs, b) == []


# --- shared locks, fail-fast ------------------------------------------------------------------


def test_shared_locks_coexist_and_block_exclusive(connect: Connect, name: str) -> None:
    r1, r2, w, obs = connect(), connect(), connect(), connect()
    with pglock.pg_lock(r1, name, shared=True), pglock.pg_lock(r2, name, shared=True):
        assert holders(obs, name) == sorted(
            [(r1.info.backend_pid, "ShareLock"), (r2.info.backend_pid, "ShareLock")]
        )
        assert pglock.pg_lock(w, name).acquire(timeout=0) is False
        assert pglock.pg_lock(w, name).acquire(timeout=0.1) is False
        with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(w, name, timeout=0.1):
            pass
    with pglock.pg_lock(w, name, timeout=0):
        assert pglock.pg_lock(r1, name, shared=True).acquire(timeout=0) is False
    assert holders(obs, name) == []


def test_fail_fast(connect: Connect, name: str) -> None:
    c, holder, obs = connect(), connect(), connect()
    with pglock.pg_lock(holder, name):
        with (
            pytest.raises(pglock.LockNotAcquired) as info,
            pglock.pg_lock(c, name, timeout=0),
        ):
            pytest.fail("body ran without the lock")
        assert info.value.timeout == 0
        assert info.value.name == name and info.value.key == pglock.key(name)
        assert "held by another session" in str(info.value)
        lock = pglock.pg_lock(c, name)
        assert lock.acquire(blocking=False) is False
        assert lock.acquire(timeout=0) is False
        with pytest.raises(ValueError, match="non-blocking"):
            lock.acquire(blocking=False, timeout=1)
    assert lock.acquire(blocking=False) is True
    assert held(obs, c.info.backend_pid) == [xk(name)]
    lock.release()
    assert held(obs, c.info.backend_pid) == []


def test_multi_name_lock_error_names_all(connect: Connect) -> None:
    a, b = two_names_by_key()
    c, holder = connect(), connect()
    with (
        pglock.pg_lock(holder, b),
        pytest.raises(pglock.LockNotAcquired) as info,
        pglock.pg_lock(c, [a, b], timeout=0),
    ):
        pass
    assert a in str(info.value) and b in str(info.value)


def test_properties_and_repr(connect: Connect) -> None:
    a, b = two_names_by_key()
    lock = pglock.pg_lock(connect(), [b, a, b], shared=True)
    assert lock.names == [a, b]
    assert lock.keys == [pglock.key(a), pglock.key(b)]
    assert lock.shared is True
    assert "unlocked" in repr(lock) and "shared" in repr(lock)


# --- failed transactions ---------------------------------------------------------------------


def test_failed_transaction_refused_before_any_sql(counting: Connect, other: Any) -> None:
    c: Any = counting(autocommit=False)
    name = f"test:{uuid.uuid4()}"
    with pytest.raises(psycopg.errors.DivisionByZero):
        c.execute("SELECT 1/0")
    assert c.info.transaction_status == TransactionStatus.INERROR
    c.sent.clear()
    with pytest.raises(pglock.InvalidConnectionState, match="failed transaction"):
        pglock.pg_lock(c, name).acquire()
    with pytest.raises(pglock.InvalidConnectionState, match="failed transaction"):
        pglock.xact_lock(c, name)
    assert c.sent == []
    assert c.info.transaction_status == TransactionStatus.INERROR
    assert held(other, c.info.backend_pid) == []
    c.rollback()


def test_block_exiting_in_failed_transaction_keeps_user_exception(
    connect: Connect, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The body fails the caller's transaction: the user's error comes out unchanged; the
    release is deferred (nothing can be sent now) and happens at the next pglock use."""
    c, obs = connect(autocommit=False), connect()
    pid = c.info.backend_pid
    with pytest.raises(psycopg.errors.DivisionByZero), pglock.pg_lock(c, name):
        c.execute("SELECT 1/0")
    assert any("stays held" in r.getMessage() for r in caplog.records)
    assert c.info.transaction_status == TransactionStatus.INERROR
    assert held(obs, pid) == [xk(name)]  # documented: deferred
    c.rollback()
    assert held(obs, pid) == [xk(name)]
    # The next pglock use on this connection releases it first.
    with pglock.pg_lock(c, f"test:{uuid.uuid4()}", timeout=0) as nxt:
        assert held(obs, pid) == [xk(nxt.names[0])]
    assert held(obs, pid) == []
    assert c.info.transaction_status == IDLE


def test_deferred_release_then_same_name_again(connect: Connect, name: str) -> None:
    c, obs, rival = connect(autocommit=False), connect(), connect()
    with pytest.raises(psycopg.errors.DivisionByZero), pglock.pg_lock(c, name):
        c.execute("SELECT 1/0")
    c.rollback()
    with pglock.pg_lock(c, name, timeout=0):
        assert held(obs, c.info.backend_pid) == [xk(name)]
    # Exactly released: another session gets it at once.
    assert pglock.pg_lock(rival, name).acquire(timeout=0)
    rival.execute("SELECT pg_advisory_unlock_all()")
    assert held(obs, c.info.backend_pid) == []


def test_deferred_release_flushed_by_xact_lock(connect: Connect, name: str) -> None:
    c, obs = connect(autocommit=False), connect()
    with pytest.raises(psycopg.errors.DivisionByZero), pglock.pg_lock(c, name):
        c.execute("SELECT 1/0")
    c.rollback()
    pglock.xact_lock(c, f"test:{uuid.uuid4()}")
    c.commit()
    assert held(obs, c.info.backend_pid) == []


# --- lost locks ------------------------------------------------------------------------------


def test_lock_lost_when_backend_terminated(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    pid = c.info.backend_pid
    lock = pglock.pg_lock(c, name)
    lock.acquire()
    assert obs.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
    end = time.monotonic() + 10
    while holders(obs, name) and time.monotonic() < end:
        time.sleep(0.01)
    assert holders(obs, name) == []
    with pytest.raises(pglock.LockLost) as info:
        lock.release()
    assert info.value.name == name
    assert not lock.locked
    # Another session gets the lock at once.
    with pglock.pg_lock(obs, name, timeout=0):
        pass


def test_lock_lost_when_terminated_reported_by_with_block(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    with pytest.raises(pglock.LockLost), pglock.pg_lock(c, name):
        obs.execute("SELECT pg_terminate_backend(%s)", (c.info.backend_pid,))
    end = time.monotonic() + 10  # the terminated backend releases its locks as it exits
    while holders(obs, name) and time.monotonic() < end:
        time.sleep(0.01)
    assert holders(obs, name) == []


def test_lock_lost_after_unlock_all_behind_pglocks_back(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    lock = pglock.pg_lock(c, name)
    lock.acquire()
    c.execute("SELECT pg_advisory_unlock_all()")
    assert holders(obs, name) == []
    with pytest.raises(pglock.LockLost, match="no longer held") as info:
        lock.release()
    assert info.value.name == name
    assert not lock.locked
    # The connection and pglock's bookkeeping are fine afterwards.
    with pglock.pg_lock(c, name, timeout=0):
        assert held(obs, c.info.backend_pid) == [xk(name)]
    assert held(obs, c.info.backend_pid) == []


def test_body_exception_not_masked_by_lock_lost(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    with pytest.raises(KeyError), pglock.pg_lock(c, name):
        c.execute("SELECT pg_advisory_unlock_all()")
        raise KeyError("user error")
    assert holders(obs, name) == []


def test_recover_interrupted_reads_unread_results(connect: Connect, name: str) -> None:
    """The state an interrupt can leave behind (results of pglock's statement unread, the
    connection ACTIVE and refusing statements) is repaired before pglock cleans up."""
    from pglock import _conn

    c: Any = connect(autocommit=False)
    obs = connect()
    c.execute("SELECT 1")
    key = pglock.key(name)
    c.pgconn.send_query(f"SAVEPOINT s; SELECT pg_advisory_lock({key}); SELECT 1/0".encode())
    assert c.info.transaction_status == TransactionStatus.ACTIVE
    with pytest.raises(psycopg.OperationalError, match="another command"):
        c.execute("SELECT 1")
    _conn.recover_interrupted(c)
    assert c.info.transaction_status == TransactionStatus.INERROR
    c.execute("ROLLBACK TO SAVEPOINT s")
    assert held(obs, c.info.backend_pid) == [xk(name)]  # session locks survive the rollback
    c.execute("SELECT pg_advisory_unlock(%s)", (key,))
    c.rollback()
    assert held(obs, c.info.backend_pid) == []
