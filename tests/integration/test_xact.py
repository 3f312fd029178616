"""Transaction-level advisory locks (``xact_lock``, ``try_xact_lock``) on psycopg connections."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
from _threads import in_thread
from _truth import held
from psycopg.pq import TransactionStatus

import pglock

Connect = Callable[..., psycopg.Connection[Any]]
IDLE = TransactionStatus.IDLE
INTRANS = TransactionStatus.INTRANS


def xk(name: str) -> tuple[int, str]:
    return (pglock.key(name), "ExclusiveLock")


def show(conn: psycopg.Connection[Any], setting: str) -> str:
    row = conn.execute(f"SHOW {setting}").fetchone()
    assert row is not None
    return str(row[0])


def two_names_by_key() -> tuple[str, str]:
    a, b = f"test:{uuid.uuid4()}", f"test:{uuid.uuid4()}"
    return (a, b) if pglock.key(a) < pglock.key(b) else (b, a)


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_released_at_end_of_transaction_non_autocommit(
    connect: Connect, name: str, end: str
) -> None:
    c, obs = connect(autocommit=False), connect()
    c.execute("SELECT 1")
    pglock.xact_lock(c, name)
    assert c.info.transaction_status == INTRANS
    assert held(obs, c.info.backend_pid) == [xk(name)]
    pglock.xact_lock(c, name)  # same transaction, same thread: granted again
    getattr(c, end)()
    assert held(obs, c.info.backend_pid) == []


def test_non_autocommit_idle_connection_begins_the_transaction(connect: Connect, name: str) -> None:
    c, obs = connect(autocommit=False), connect()
    assert c.info.transaction_status == IDLE
    pglock.xact_lock(c, name)
    assert c.info.transaction_status == INTRANS
    assert held(obs, c.info.backend_pid) == [xk(name)]
    c.commit()
    assert held(obs, c.info.backend_pid) == []


@pytest.mark.parametrize("how", ["commit", "exception"])
def test_released_at_end_of_transaction_block(connect: Connect, name: str, how: str) -> None:
    c, obs = connect(), connect()
    expect = pytest.raises(ZeroDivisionError) if how == "exception" else contextlib.nullcontext()
    with expect, c.transaction():
        pglock.xact_lock(c, name, timeout=2)
        assert held(obs, c.info.backend_pid) == [xk(name)]
        if how == "exception":
            raise ZeroDivisionError
    assert held(obs, c.info.backend_pid) == []
    assert c.info.transaction_status == IDLE


def test_autocommit_without_transaction_refused(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    with pytest.raises(pglock.InvalidConnectionState, match="open transaction"):
        pglock.xact_lock(c, name)
    with pytest.raises(pglock.InvalidConnectionState, match="open transaction"):
        pglock.try_xact_lock(c, name)
    assert held(obs, c.info.backend_pid) == []
    assert c.info.transaction_status == IDLE


def test_try_xact_lock(connect: Connect, name: str) -> None:
    c, rival, obs = connect(), connect(), connect()
    with c.transaction():
        assert pglock.try_xact_lock(c, name) is True
        with rival.transaction():
            assert pglock.try_xact_lock(rival, name) is False
            assert rival.info.transaction_status == INTRANS
            rival.execute("SELECT 1")  # still usable
            with pytest.raises(pglock.LockNotAcquired) as info:
                pglock.xact_lock(rival, name, timeout=0)
            assert info.value.name == name and info.value.timeout == 0
        assert held(obs, c.info.backend_pid) == [xk(name)]
    assert held(obs, c.info.backend_pid) == []
    with rival.transaction():
        assert pglock.try_xact_lock(rival, name) is True
    assert held(obs, rival.info.backend_pid) == []


def test_shared_xact_locks_coexist_and_block_exclusive(connect: Connect, name: str) -> None:
    r1, r2, w, obs = connect(), connect(), connect(), connect()
    with r1.transaction(), r2.transaction():
        pglock.xact_lock(r1, name, shared=True)
        assert pglock.try_xact_lock(r2, name, shared=True)
        with w.transaction():
            assert pglock.try_xact_lock(w, name) is False
        assert held(obs, r1.info.backend_pid) == [(pglock.key(name), "ShareLock")]
        assert held(obs, r2.info.backend_pid) == [(pglock.key(name), "ShareLock")]
    with w.transaction():
        assert pglock.try_xact_lock(w, name)


def test_xact_lock_in_rolled_back_savepoint_is_released(connect: Connect, name: str) -> None:
    c, obs = connect(), connect()
    other = f"test:{uuid.uuid4()}"
    with c.transaction():
        pglock.xact_lock(c, other)
        with c.transaction(force_rollback=True):  # SAVEPOINT ... ROLLBACK TO SAVEPOINT
            pglock.xact_lock(c, name)
            assert sorted(held(obs, c.info.backend_pid)) == sorted([xk(name), xk(other)])
        assert held(obs, c.info.backend_pid) == [xk(other)]
    assert held(obs, c.info.backend_pid) == []


def test_xact_lock_in_rolled_back_savepoint_sql(connect: Connect, name: str) -> None:
    c, obs = connect(autocommit=False), connect()
    c.execute("SAVEPOINT user_sp")
    pglock.xact_lock(c, name, timeout=1)
    assert held(obs, c.info.backend_pid) == [xk(name)]
    c.execute("ROLLBACK TO SAVEPOINT user_sp")
    assert held(obs, c.info.backend_pid) == []
    pglock.xact_lock(c, name)  # can be taken again in the same transaction
    assert held(obs, c.info.backend_pid) == [xk(name)]
    c.rollback()
    assert held(obs, c.info.backend_pid) == []


def test_timeout_bound_settings_restored_transaction_usable(connect: Connect, name: str) -> None:
    c, holder, obs = connect(autocommit=False), connect(), connect()
    c.execute("SET lock_timeout = '7s'")
    c.commit()
    c.execute("CREATE TEMP TABLE w (v int)")
    c.execute("INSERT INTO w VALUES (1), (2)")
    c.execute("SET LOCAL statement_timeout = '13s'")
    with holder.transaction():
        pglock.xact_lock(holder, name)
        t0 = time.monotonic()
        with pytest.raises(pglock.LockNotAcquired) as info:
            pglock.xact_lock(c, name, timeout=0.5)
        elapsed = time.monotonic() - t0
        assert 0.5 <= elapsed <= 1.5, elapsed  # the acceptance bound [timeout, timeout + 1 s]
        assert info.value.timeout == 0.5 and info.value.key == pglock.key(name)
        assert pglock.try_xact_lock(c, name) is False
    assert c.info.transaction_status == INTRANS
    assert show(c, "lock_timeout") == "7s"
    assert show(c, "statement_timeout") == "13s"
    c.execute("INSERT INTO w VALUES (3)")
    assert c.execute("SELECT sum(v) FROM w").fetchone() == (6,)
    assert held(obs, c.info.backend_pid) == []
    c.commit()
    assert c.execute("SELECT count(*) FROM w").fetchone() == (3,)
    assert show(c, "lock_timeout") == "7s"
    c.commit()


def test_timeout_success_keeps_settings(connect: Connect, name: str) -> None:
    c, obs = connect(autocommit=False), connect()
    c.execute("SET LOCAL lock_timeout = '9s'")
    pglock.xact_lock(c, name, timeout=2)
    assert held(obs, c.info.backend_pid) == [xk(name)]
    assert show(c, "lock_timeout") == "9s"
    assert show(c, "statement_timeout") == "0"
    c.commit()
    assert show(c, "lock_timeout") == "0"
    c.commit()


@pytest.mark.parametrize("timeout", [0, 0.3])
def test_multi_key_failure_holds_nothing(connect: Connect, timeout: float) -> None:
    first, second = two_names_by_key()
    c, holder, obs = connect(), connect(), connect()
    with holder.transaction():
        pglock.xact_lock(holder, second)
        with c.transaction():
            c.execute("CREATE TEMP TABLE w (v int)")
            c.execute("INSERT INTO w VALUES (1)")
            if timeout:
                with pytest.raises(pglock.LockNotAcquired):
                    pglock.xact_lock(c, [second, first], timeout=timeout)
            else:
                assert pglock.try_xact_lock(c, [second, first]) is False
            assert held(obs, c.info.backend_pid) == []  # the free first key was given back
            assert c.execute("SELECT count(*) FROM w").fetchone() == (1,)
            pglock.xact_lock(c, first, timeout=0)
            assert held(obs, c.info.backend_pid) == [xk(first)]
    assert held(obs, c.info.backend_pid) == []


def test_multi_key_xact_lock(connect: Connect) -> None:
    a, b = two_names_by_key()
    c, obs = connect(), connect()
    with c.transaction():
        pglock.xact_lock(c, [b, a, b])
        assert held(obs, c.info.backend_pid) == sorted([xk(a), xk(b)])
        assert pglock.try_xact_lock(c, [a, b])
    assert held(obs, c.info.backend_pid) == []


def test_deadlock_translated_and_transaction_usable(connect: Connect) -> None:
    a, b = two_names_by_key()
    c1, c2, obs = connect(), connect(), connect()
    barrier = threading.Barrier(2)
    outcome: dict[str, BaseException | None] = {}

    def worker(tag: str, c: psycopg.Connection[Any], first: str, second: str) -> None:
        try:
            with c.transaction():
                pglock.xact_lock(c, first)
                barrier.wait(10)
                try:
                    pglock.xact_lock(c, second, timeout=20)
                except pglock.DeadlockDetected:
                    # The caller's transaction survives (pglock worked under a savepoint).
                    c.execute("SELECT 1")
                    outcome[tag + "-status"] = (
                        None
                        if c.info.transaction_status == INTRANS
                        else (AssertionError(str(c.info.transaction_status)))
                    )
                    raise
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
    errors = [e for k, e in outcome.items() if e is not None]
    assert len(errors) == 1, outcome
    assert isinstance(errors[0], pglock.DeadlockDetected)
    assert isinstance(errors[0].__cause__, psycopg.errors.DeadlockDetected)
    assert errors[0].__cause__.sqlstate == "40P01"
    assert len(outcome) == 3  # both workers, and the status check of the one that failed
    for c in (c1, c2):
        assert held(obs, c.info.backend_pid) == []


def test_two_threads_same_transaction_refused(connect: Connect, name: str) -> None:
    """Threads sharing one transaction cannot exclude each other: pglock refuses the second."""
    c, obs = connect(autocommit=False), connect()
    pglock.xact_lock(c, name)
    errors: list[BaseException] = []

    def second() -> None:
        try:
            pglock.xact_lock(c, name, timeout=1)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=second)
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], pglock.InvalidConnectionState)
    assert c.info.transaction_status == INTRANS
    c.commit()
    assert held(obs, c.info.backend_pid) == []

    # In a new transaction the other thread may take it.
    def take_and_commit() -> None:
        pglock.xact_lock(c, name)
        c.commit()

    t = threading.Thread(target=take_and_commit)
    t.start()
    t.join(10)
    assert len(errors) == 1
    assert held(obs, c.info.backend_pid) == []


def test_xact_lock_bad_arguments(connect: Connect, name: str) -> None:
    c = connect()
    with c.transaction():
        with pytest.raises(TypeError):
            pglock.xact_lock(c, name, shared="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            pglock.xact_lock(c, name, timeout=-1)
        with pytest.raises(TypeError):
            pglock.try_xact_lock(c, name, shared=1)  # type: ignore[arg-type]
        assert c.info.transaction_status == INTRANS


@pytest.mark.parametrize("keys", [1, 2])
def test_slow_server_after_a_timed_grant_leaves_the_transaction_usable(
    connect: Connect, monkeypatch: pytest.MonkeyPatch, keys: int
) -> None:
    """The server stalls between granting a timed xact_lock and pglock's restore of the
    caller's settings (a descheduled backend, simulated by a pg_sleep injected before the
    restore statement). pglock's own statement_timeout must not then abort the caller's
    transaction: one key is bounded by lock_timeout alone, so the grant stands; several keys
    are bounded as a whole, so the overrun is rolled back to pglock's savepoint."""
    from psycopg import sql

    from pglock import _sql

    restore = _sql.restore_settings

    def stalled_restore(values: Sequence[str]) -> sql.Composed:
        return sql.SQL("SELECT pg_catalog.pg_sleep(0.3); {}").format(restore(values))

    names = list(two_names_by_key()[:keys])
    c, obs = connect(autocommit=False), connect()
    c.execute("CREATE TEMP TABLE w (v int)")
    c.execute("INSERT INTO w VALUES (1)")
    c.execute("SET LOCAL statement_timeout = '13s'")
    monkeypatch.setattr(_sql, "restore_settings", stalled_restore)
    if keys == 1:
        pglock.xact_lock(c, names, timeout=0.05)
        assert held(obs, c.info.backend_pid) == [xk(names[0])]
    else:
        with pytest.raises(pglock.LockNotAcquired):
            pglock.xact_lock(c, names, timeout=0.05)
        assert held(obs, c.info.backend_pid) == []
    assert c.info.transaction_status == INTRANS
    assert show(c, "statement_timeout") == "13s"
    assert show(c, "lock_timeout") == "0"
    assert c.execute("SELECT count(*) FROM w").fetchone() == (1,)  # earlier writes intact
    c.rollback()
    # Negative control: the same stall under a statement_timeout of the caller's own, after
    # pglock's savepoint is gone, does abort the transaction (what pglock must not do).
    c.execute("SELECT 1")
    c.execute("SET LOCAL statement_timeout = '50ms'")
    with pytest.raises(psycopg.errors.QueryCanceled):
        c.execute(stalled_restore(("0", "0", "off")))
    assert c.info.transaction_status == TransactionStatus.INERROR
    c.rollback()


# --- threads sharing one transaction (issue 11, items 4 and 13) --------------------------------


def test_two_threads_racing_in_one_transaction_never_both_get_it(
    connect: Connect, name: str
) -> None:
    """Two threads sharing one connection and its open transaction ask for the same name at
    the same instant: at most one is granted, the other is refused (InvalidConnectionState).
    pglock reserves the name in-process before any SQL; checking before the statement and
    recording after it let both through in 10-60 % of the trials."""
    c, obs = connect(autocommit=False), connect()
    pid = c.info.backend_pid
    for trial in range(200):
        n = f"{name}:{trial}"
        barrier = threading.Barrier(2)
        outcomes: list[str] = []
        errors: list[BaseException] = []

        def contender(
            n: str = n,
            barrier: threading.Barrier = barrier,
            outcomes: list[str] = outcomes,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                barrier.wait(10)
                pglock.xact_lock(c, n, timeout=5)
                outcomes.append("granted")
            except pglock.InvalidConnectionState:
                outcomes.append("refused")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=contender) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert sorted(outcomes) == ["granted", "refused"], (trial, outcomes)
        assert held(obs, pid) == [xk(n)]
        c.commit()
    assert held(obs, pid) == []


@pytest.mark.parametrize("savepoint", ["sql", "psycopg_nested_transaction"])
def test_savepoint_rollback_frees_the_name_for_another_thread(
    connect: Connect, name: str, savepoint: str
) -> None:
    """A rolled-back savepoint releases the transaction locks taken inside it: another thread
    in the same transaction may then take the name (pglock checks pg_locks before refusing,
    and forgets the record that outlived its lock), and so may the first thread itself."""
    c, obs = connect(autocommit=False), connect()
    pid = c.info.backend_pid
    c.execute("SELECT 1")

    def in_savepoint(body: Callable[[], None]) -> None:
        if savepoint == "sql":
            c.execute("SAVEPOINT user_sp")
            body()
            c.execute("ROLLBACK TO SAVEPOINT user_sp")
        else:
            with c.transaction(force_rollback=True):  # SAVEPOINT ... ROLLBACK TO SAVEPOINT
                body()

    def held_and_refused_elsewhere() -> None:
        pglock.xact_lock(c, name)
        assert held(obs, pid) == [xk(name)]
        # While it is held, another thread in the transaction is refused.
        assert isinstance(
            in_thread(lambda: pglock.xact_lock(c, name)), pglock.InvalidConnectionState
        )

    in_savepoint(held_and_refused_elsewhere)
    assert held(obs, pid) == []
    # This thread's own re-take after the rollback...
    in_savepoint(lambda: pglock.xact_lock(c, name, timeout=1))
    assert held(obs, pid) == []
    # ...and another thread's take: granted, not refused by a record that outlived its lock.
    assert in_thread(lambda: pglock.try_xact_lock(c, name)) is True
    assert held(obs, pid) == [xk(name)]
    # Now it is that thread's, held in this transaction: the first thread is refused.
    with pytest.raises(pglock.InvalidConnectionState, match="same transaction"):
        pglock.xact_lock(c, name, timeout=0)
    assert c.info.transaction_status == INTRANS
    c.commit()
    assert held(obs, pid) == []
