"""Pool-aware locking with psycopg_pool: ``pool_lock`` and the ``reset_connection`` hook.

The acceptance cases use a pool of size 1, so the next checkout gets the same backend back
(asserted by pid) unless pglock discarded it. "Held" is always read in ``pg_locks`` from
another session.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg_pool
import pytest
from _counter import run_counter
from _truth import holder_pids
from psycopg import sql

import pglock

Connect = Callable[..., psycopg.Connection[Any]]
MakePool = Callable[..., psycopg_pool.ConnectionPool[Any]]


def advisory_held(observer: psycopg.Connection[Any], pid: int) -> list[tuple[int, str]]:
    rows = observer.execute(
        "SELECT (classid::bigint << 32) | objid::bigint, mode FROM pg_locks "
        "WHERE locktype = 'advisory' AND granted AND pid = %s ORDER BY 1, 2",
        (pid,),
    ).fetchall()
    return [(k, m) for k, m in rows]


def app_locks(observer: psycopg.Connection[Any], app_name: str) -> list[tuple[Any, ...]]:
    return observer.execute(
        "SELECT l.pid, (l.classid::bigint << 32) | l.objid::bigint FROM pg_locks l "
        "JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND a.application_name = %s",
        (app_name,),
    ).fetchall()


@pytest.fixture
def make_pool(pg_dsn: str, app_name: str) -> Iterator[MakePool]:
    """Opened psycopg_pool pools whose sessions carry the test's application_name."""
    pools: list[psycopg_pool.ConnectionPool[Any]] = []

    def factory(size: int = 1, **kwargs: Any) -> psycopg_pool.ConnectionPool[Any]:
        conn_kwargs = {"application_name": app_name, **kwargs.pop("kwargs", {})}
        kwargs.setdefault("reset", pglock.reset_connection)
        pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            pg_dsn,
            min_size=size,
            max_size=size,
            kwargs=conn_kwargs,
            open=False,
            timeout=10,
            **kwargs,
        )
        pool.open(wait=True, timeout=10)
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        pool.close()


def backend_pid(pool: psycopg_pool.ConnectionPool[Any]) -> int:
    with pool.connection() as c:
        return c.info.backend_pid


# --- pool_lock basics ------------------------------------------------------------------------


def test_pool_lock_holds_on_the_yielded_connection_and_gives_it_back(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pglock.pool_lock(pool, name, timeout=5) as conn:
        assert isinstance(conn, psycopg.Connection)
        pid = conn.info.backend_pid
        assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
    assert advisory_held(other, pid) == []
    assert backend_pid(pool) == pid  # returned to the pool, not discarded


def test_pool_lock_excludes_another_session(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pglock.pg_lock(other, name):
        with pytest.raises(pglock.LockNotAcquired) as info, pglock.pool_lock(
            pool, name, timeout=0
        ):
            pytest.fail("the body ran without the lock")
        assert info.value.name == name
        with pytest.raises(pglock.LockNotAcquired), pglock.pool_lock(pool, name, timeout=0.1):
            pytest.fail("the body ran without the lock")
    pid = backend_pid(pool)  # the connection went back, usable
    assert advisory_held(other, pid) == []
    with pglock.pool_lock(pool, name, timeout=0) as conn:
        assert conn.info.backend_pid == pid


def test_pool_lock_shared_and_several_names(
    make_pool: MakePool, other: psycopg.Connection[Any]
) -> None:
    pool = make_pool(size=2)
    a, b = f"test:{uuid.uuid4()}", f"test:{uuid.uuid4()}"
    # The second shared holder is another thread: one thread nesting the same name through
    # the pool is refused (SelfDeadlock), since under contention it waits for itself.
    entered, leave = threading.Event(), threading.Event()
    second: list[int] = []

    def second_reader() -> None:
        with pglock.pool_lock(pool, a, shared=True, timeout=1) as c2:
            second.append(c2.info.backend_pid)
            entered.set()
            leave.wait(10)

    with pglock.pool_lock(pool, [a, b], shared=True) as c1:
        t = threading.Thread(target=second_reader)
        t.start()
        assert entered.wait(10)
        assert c1.info.backend_pid != second[0]
        assert advisory_held(other, c1.info.backend_pid) == sorted(
            [(pglock.key(a), "ShareLock"), (pglock.key(b), "ShareLock")]
        )
        assert advisory_held(other, second[0]) == [(pglock.key(a), "ShareLock")]
        assert not pglock.pg_lock(other, b).acquire(timeout=0)  # exclusive is refused
        leave.set()
        t.join(10)
    assert advisory_held(other, c1.info.backend_pid) == []


def test_checkout_wait_counts_against_the_timeout(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pool.connection():  # the only connection is busy
        with pytest.raises(
            pglock.LockNotAcquired, match="connection from the pool"
        ) as info, pglock.pool_lock(pool, name, timeout=0.2):
            pytest.fail("the body ran without the lock")
        assert info.value.timeout == 0.2
        assert isinstance(info.value.__cause__, psycopg_pool.PoolTimeout)


def test_commits_on_success_and_rolls_back_when_the_body_raises(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    table = f"t_{uuid.uuid4().hex[:12]}"
    other.execute(sql.SQL("CREATE TABLE {} (v int)").format(sql.Identifier(table)))
    try:
        pool = make_pool()
        insert = sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(table))
        with pglock.pool_lock(pool, name) as conn:
            conn.execute(insert, (1,))
        with pytest.raises(ZeroDivisionError), pglock.pool_lock(pool, name) as conn:
            conn.execute(insert, (2,))
            1 / 0  # noqa: B018
        rows = other.execute(sql.SQL("SELECT v FROM {}").format(sql.Identifier(table)))
        assert rows.fetchall() == [(1,)]
    finally:
        other.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


# --- acceptance: nothing survives the return to the pool ---------------------------------------


def test_lock_left_by_raw_sql_is_gone_at_next_checkout(
    make_pool: MakePool,
    other: psycopg.Connection[Any],
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = make_pool()
    k = pglock.key(name)
    with caplog.at_level(logging.WARNING, logger="pglock"), pool.connection() as conn:
        pid = conn.info.backend_pid
        conn.execute("SELECT pg_advisory_lock(%s), pg_advisory_lock_shared(7)", (k,))
    with pool.connection() as conn:
        assert conn.info.backend_pid == pid  # the same backend, reused
        assert advisory_held(other, pid) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(k) in m and "7 shared" in m and "raw SQL" in m for m in warnings), warnings


def test_without_the_hook_the_lock_survives_checkin(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    """Negative control: psycopg_pool alone rolls back but keeps session locks."""
    pool = make_pool(reset=None)
    k = pglock.key(name)
    with pool.connection() as conn:
        pid = conn.info.backend_pid
        conn.execute("SELECT pg_advisory_lock(%s)", (k,))
    try:
        with pool.connection() as conn:
            assert conn.info.backend_pid == pid
            assert advisory_held(other, pid) == [(k, "ExclusiveLock")]
            # phantom re-entrancy: the next borrower "gets" a lock someone else holds
            assert conn.execute("SELECT pg_try_advisory_lock(%s)", (k,)).fetchone() == (True,)
    finally:
        with pool.connection() as conn:
            conn.execute("SELECT pg_advisory_unlock_all()")


def test_lock_of_a_body_that_raised_is_gone_at_next_checkout(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pytest.raises(KeyError), pglock.pool_lock(pool, name) as conn:
        pid = conn.info.backend_pid
        raise KeyError("boom")
    with pool.connection() as conn:
        assert conn.info.backend_pid == pid
        assert advisory_held(other, pid) == []


def test_pg_lock_left_open_is_released_by_the_hook_and_reported_lost(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pool.connection() as conn:
        pid = conn.info.backend_pid
        lock = pglock.pg_lock(conn, name)
        assert lock.acquire()
    with pool.connection() as conn:  # the hook ran before this checkout
        assert conn.info.backend_pid == pid
        assert advisory_held(other, pid) == []
        assert not lock.locked
        with pytest.raises(pglock.LockLost, match="reset hook"):
            lock.release()
        # The next borrower starts clean: pglock's bookkeeping was dropped too.
        with pglock.pg_lock(conn, name, timeout=0):
            assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
    assert advisory_held(other, pid) == []


def test_deferred_release_is_flushed_by_the_hook_without_a_leak_warning(
    make_pool: MakePool,
    other: psycopg.Connection[Any],
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = make_pool(kwargs={"autocommit": False})
    caplog.set_level(logging.INFO, logger="pglock")
    with pool.connection() as conn:
        pid = conn.info.backend_pid
        with pglock.pg_lock(conn, name), pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        # the release was deferred: the transaction is failed
        assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
    with pool.connection() as conn:
        assert conn.info.backend_pid == pid
        assert advisory_held(other, pid) == []
    assert any("deferred" in r.getMessage() for r in caplog.records)
    assert not any(
        r.name == "pglock.pool" and r.levelno >= logging.WARNING for r in caplog.records
    )


def test_backend_terminated_in_the_body_is_discarded(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pytest.raises(psycopg.OperationalError), pglock.pool_lock(pool, name) as conn:
        pid = conn.info.backend_pid
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        conn.execute("SELECT 1")  # the body finds out first
    with pool.connection() as conn:
        new_pid = conn.info.backend_pid
        assert new_pid != pid
        assert advisory_held(other, new_pid) == []


def test_backend_terminated_unnoticed_by_the_body_raises_lock_lost(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pytest.raises(pglock.LockLost), pglock.pool_lock(pool, name) as conn:
        pid = conn.info.backend_pid
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    with pool.connection() as conn:
        assert conn.info.backend_pid != pid
        assert advisory_held(other, conn.info.backend_pid) == []


def test_unconfirmed_release_discards_the_connection(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool()
    with pytest.raises(pglock.LockLost, match="no longer held"), pglock.pool_lock(
        pool, name
    ) as conn:
        pid = conn.info.backend_pid
        conn.execute("SELECT pg_advisory_unlock_all()")  # behind pglock's back
    assert backend_pid(pool) != pid


def test_failed_transaction_at_exit_is_rolled_back_and_the_lock_released(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool(kwargs={"autocommit": False})
    with pglock.pool_lock(pool, name) as conn:
        pid = conn.info.backend_pid
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
    with pool.connection() as conn:
        assert conn.info.backend_pid == pid
        assert advisory_held(other, pid) == []


def test_works_without_the_reset_hook(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    """pool_lock itself never returns a connection holding its lock, hook or not."""
    pool = make_pool(reset=None)
    with pytest.raises(RuntimeError), pglock.pool_lock(pool, name) as conn:
        pid = conn.info.backend_pid
        raise RuntimeError
    assert advisory_held(other, pid) == []
    with pytest.raises(pglock.LockLost), pglock.pool_lock(pool, name) as conn:
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (conn.info.backend_pid,))
    assert backend_pid(pool) != pid


def test_null_connection_pool(pg_dsn: str, app_name: str, other: Any, name: str) -> None:
    with psycopg_pool.NullConnectionPool(
        pg_dsn, kwargs={"application_name": app_name}, open=False, timeout=10
    ) as pool:
        pool.open()
        with pglock.pool_lock(pool, name, timeout=5) as conn:
            pid = conn.info.backend_pid
            assert advisory_held(other, pid) == [(pglock.key(name), "ExclusiveLock")]
        assert advisory_held(other, pid) == []


def test_reset_connection_on_a_closed_connection(connect: Connect) -> None:
    conn = connect()
    conn.close()
    pglock.reset_connection(conn)  # nothing to release, no error


def test_reset_connection_rejects_other_types() -> None:
    with pytest.raises(TypeError, match=r"psycopg\.Connection"):
        pglock.reset_connection("postgresql://")  # type: ignore[arg-type]


def test_reset_connection_leaves_a_non_autocommit_connection_idle(
    connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    conn = connect(autocommit=False)
    conn.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    conn.commit()
    pglock.reset_connection(conn)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert advisory_held(other, conn.info.backend_pid) == []


# --- issue 11: bookkeeping left on the connection, nesting in one thread ---------------------


@pytest.mark.parametrize("hook", [True, False], ids=["reset_hook", "no_reset_hook"])
@pytest.mark.parametrize("inner", ["same_name", "other_name"])
def test_lock_left_open_in_the_block_is_released_before_the_connection_goes_back(
    make_pool: MakePool,
    other: psycopg.Connection[Any],
    name: str,
    caplog: pytest.LogCaptureFixture,
    inner: str,
    hook: bool,
) -> None:
    """A pg_lock taken on the yielded connection and never released: pool_lock's exit sees
    it in pglock's bookkeeping and releases it (with a WARNING) before the connection goes
    back, whether or not the pool has a reset hook; the handle is marked lost. The pool gets
    the same backend back, clean."""
    pool = make_pool(**({} if hook else {"reset": None}))
    inner_name = name if inner == "same_name" else f"{name}:inner"
    with caplog.at_level(logging.WARNING, logger="pglock"):
        with pglock.pool_lock(pool, name) as conn:
            pid = conn.info.backend_pid
            left = pglock.pg_lock(conn, inner_name)
            assert left.acquire(timeout=0)  # re-entry (same name) or a second lock
        # pool_lock itself released it: no reset hook has had to run yet.
        assert advisory_held(other, pid) == []
        assert not left.locked
    with pytest.raises(pglock.LockLost, match="pool_lock"):
        left.release()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "pool_lock" in m and str(pglock.key(inner_name)) in m for m in warnings
    ), warnings
    with pool.connection() as conn:
        assert conn.info.backend_pid == pid  # released, not discarded
        assert advisory_held(other, pid) == []
        with pglock.pg_lock(conn, inner_name, timeout=0):  # fresh bookkeeping: a real lock
            assert advisory_held(other, pid) == [(pglock.key(inner_name), "ExclusiveLock")]
    assert advisory_held(other, pid) == []


def test_release_deferred_in_the_block_is_done_before_the_connection_goes_back(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    """A pg_lock block in the body that ended in a failed transaction deferred its release:
    pool_lock's exit does it (the connection is kept), so nothing goes back held."""
    pool = make_pool(kwargs={"autocommit": False}, reset=None)
    inner = f"{name}:inner"
    with pglock.pool_lock(pool, name) as conn:
        pid = conn.info.backend_pid
        with pglock.pg_lock(conn, inner), pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        assert advisory_held(other, pid) == sorted(
            [(pglock.key(name), "ExclusiveLock"), (pglock.key(inner), "ExclusiveLock")]
        )
        conn.rollback()
    assert advisory_held(other, pid) == []
    assert backend_pid(pool) == pid


@pytest.mark.parametrize("timeout", [None, 0, 2.0])
@pytest.mark.parametrize("modes", [(False, False), (False, True), (True, False), (True, True)])
def test_nesting_the_same_name_through_the_pool_is_answered_at_once(
    make_pool: MakePool,
    other: psycopg.Connection[Any],
    name: str,
    timeout: float | None,
    modes: tuple[bool, bool],
) -> None:
    """Nested pool_lock on the same name in one thread: the inner block would check out
    another connection and wait for the outer one's lock, which only this thread can release.
    pglock answers before any checkout or SQL (shared + shared too: it waits for itself as
    soon as a writer queues in between): a wait without a timeout, which could never end,
    raises SelfDeadlock; a try-once or a timed attempt answers False (``with``:
    LockNotAcquired), as a second session would get (pals ``test_same_lock_fails_acquire``)."""
    outer_shared, inner_shared = modes
    pool = make_pool(size=2)
    with pglock.pool_lock(pool, name, shared=outer_shared) as conn:
        pid = conn.info.backend_pid
        before = pool.get_stats().get("requests_num", 0)
        inner = pglock.pool_lock(pool, [f"{name}:other", name], shared=inner_shared,
                                 timeout=timeout)
        with pytest.raises(pglock.LockError) as info, inner:
            pytest.fail("the nested body ran")
        cause = info.value if timeout is None else info.value.__cause__
        assert type(info.value) is (pglock.SelfDeadlock if timeout is None
                                    else pglock.LockNotAcquired)
        assert isinstance(cause, pglock.SelfDeadlock) and "reuse the connection" in str(cause)
        assert cause.name == name and cause.key == pglock.key(name)
        if timeout is not None:
            assert "this thread holds it through this pool" in str(info.value)
            assert not inner.locked
            assert inner.acquire(timeout=timeout) is False
            assert inner.acquire(blocking=False) is False
        assert pool.get_stats().get("requests_num", 0) == before  # no checkout: no wait
        mode = "ShareLock" if outer_shared else "ExclusiveLock"
        assert advisory_held(other, pid) == [(pglock.key(name), mode)]
        # The advice works: the yielded connection re-enters.
        with pglock.pg_lock(conn, name, shared=outer_shared, timeout=0):
            pass
    assert advisory_held(other, pid) == []
    with pglock.pool_lock(pool, name, timeout=0), pglock.pool_lock(pool, f"{name}:x", timeout=0):
        pass  # other names nest; and once left, the name is free again


def test_two_threads_nesting_the_same_name_still_wait_for_each_other(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    """The self-deadlock record is per thread: another thread asking for the name held
    through the same pool waits as before, and gets it once it is released."""
    pool = make_pool(size=2)
    got: list[int] = []
    with pglock.pool_lock(pool, name) as conn:
        waiter_error: list[BaseException] = []

        def waiter() -> None:
            try:
                with pglock.pool_lock(pool, name, timeout=10) as c2:
                    got.append(c2.info.backend_pid)
            except BaseException as exc:
                waiter_error.append(exc)

        t = threading.Thread(target=waiter)
        t.start()
        key = pglock.key(name)

        def queued() -> bool:
            row = other.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND (classid::bigint << 32) | objid::bigint = %s",
                (key,),
            ).fetchone()
            return bool(row and row[0])

        deadline = time.monotonic() + 5  # bounded: until the waiter queues in Postgres
        while not queued() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert queued()  # it waits in Postgres, it was not refused
        assert advisory_held(other, conn.info.backend_pid) == [(key, "ExclusiveLock")]
        assert got == []
    t.join(10)
    assert not waiter_error, waiter_error
    assert len(got) == 1


#: Every lock object that holds a name through a pool (source, name) -> an unheld lock object.
POOLED: dict[str, Callable[[Any, str], Any]] = {
    "pool_lock": lambda source, n: pglock.pool_lock(source, n),
    "locker": lambda source, n: pglock.Locker(source).lock(n),
    "rwlock_write": lambda source, n: pglock.rwlock(source, n).write(),
    "rwlock_read": lambda source, n: pglock.rwlock(source, n).read(),
    "singleton": lambda source, n: pglock.singleton(source, n, timeout=None),
}


def wait_free(observer: psycopg.Connection[Any], name: str) -> None:
    """Until no session holds ``name`` (a closed connection's backend exits a moment later)."""
    deadline = time.monotonic() + 10  # bounded
    while holder_pids(observer, name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holder_pids(observer, name) == []


@pytest.mark.parametrize("make", POOLED.values(), ids=POOLED.keys())
def test_a_lock_object_collected_unreleased_leaves_no_record(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str, make: Callable[..., Any]
) -> None:
    """pals ``test_gc_lock_release``: a held lock object dropped without release and
    collected. Its connection goes with it (psycopg closes it; the session ends and Postgres
    gives the lock back), and so does this thread's record: the name is not refused for ever.
    psycopg_pool never learns of the connection: the pool is one connection short for good."""
    pool = make_pool(size=2)
    lock = make(pool, name)
    assert lock.acquire() is True
    assert len(holder_pids(other, name)) == 1
    del lock
    gc.collect()
    wait_free(other, name)
    again = make(pool, name)
    assert again.acquire(blocking=False) is True
    assert len(holder_pids(other, name)) == 1
    again.release()
    with make(pool, name):  # a wait without a timeout is not refused either
        assert len(holder_pids(other, name)) == 1
    kept = pool.getconn()  # the one connection the pool still has
    try:
        with pytest.raises(psycopg_pool.PoolTimeout):
            pool.getconn(timeout=0.1)
    finally:
        pool.putconn(kept)


def test_the_record_stays_while_the_collected_lock_objects_connection_holds(
    make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    """The record goes with the lock, not with the lock object: dropped while the caller
    still has its connection, the session (and the lock) live on, and a nested request would
    still wait for this thread's own lock. Once the connection is collected too, it goes."""
    pool = make_pool(size=2)
    lock = pglock.pool_lock(pool, name)
    assert lock.acquire() is True
    conn = lock.connection
    del lock
    gc.collect()
    assert holder_pids(other, name) == [conn.info.backend_pid]
    assert pglock.pool_lock(pool, name).acquire(blocking=False) is False
    with pytest.raises(pglock.SelfDeadlock), pglock.pool_lock(pool, name):
        pytest.fail("the nested body ran")
    del conn
    gc.collect()
    wait_free(other, name)
    with pglock.pool_lock(pool, name, timeout=None) as c:
        assert holder_pids(other, name) == [c.info.backend_pid]


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    ["postgresql://localhost/x", 42, None, object()],
)
def test_pool_lock_rejects_non_pools(source: object, name: str) -> None:
    with pytest.raises(TypeError, match="ConnectionPool"):
        pglock.pool_lock(source, name)


def test_pool_lock_points_a_connection_to_pg_lock(conn: psycopg.Connection[Any], name: str) -> None:
    with pytest.raises(TypeError, match="pg_lock"):
        pglock.pool_lock(conn, name)


def test_pool_lock_rejects_an_async_pool(pg_dsn: str, name: str) -> None:
    pool = psycopg_pool.AsyncConnectionPool(pg_dsn, open=False)
    with pytest.raises(TypeError, match="synchronous"):
        pglock.pool_lock(pool, name)


@pytest.mark.parametrize(
    ("names", "kwargs", "error"),
    [
        ("", {}, ValueError),
        (b"x", {}, TypeError),
        ([], {}, ValueError),
        ("x", {"timeout": -1}, ValueError),
        ("x", {"timeout": "5"}, TypeError),
        ("x", {"shared": 1}, TypeError),
    ],
)
def test_pool_lock_rejects_bad_arguments_before_checkout(
    make_pool: MakePool, names: Any, kwargs: Any, error: type[Exception]
) -> None:
    pool = make_pool()
    # The only connection is busy: a checkout would wait.
    with pool.connection(), pytest.raises(error):
        pglock.pool_lock(pool, names, **kwargs)


# --- acceptance: 8 threads, a pool of 4 -----------------------------------------------------


def test_eight_threads_share_a_pool_of_four_with_mutual_exclusion(
    pg_dsn: str, app_name: str, make_pool: MakePool, other: psycopg.Connection[Any], name: str
) -> None:
    pool = make_pool(size=4)
    v, ids, acked = run_counter(
        pg_dsn, app_name, lambda i: pglock.pool_lock(pool, name), rounds=12
    )
    assert acked == 8 * 12
    assert v == acked
    assert sorted(ids) == sorted(f"{i}-{r}" for i in range(8) for r in range(12))
    # nothing held anywhere in the pool, and every connection is back and reusable
    assert app_locks(other, app_name) == []
    # psycopg_pool runs the reset hook, then makes the connection available, in its worker
    # thread after putconn() has returned: wait (bounded) for the last ones to come back.
    deadline = time.monotonic() + 5
    while pool.get_stats()["pool_available"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = pool.get_stats()
    assert stats["pool_available"] == 4, stats
    assert stats.get("connections_lost", 0) == 0


def test_negative_control_without_the_lock_loses_updates(
    pg_dsn: str, app_name: str, make_pool: MakePool
) -> None:
    pool = make_pool(size=4)
    # The same pool traffic as pool_lock, without the lock.
    v, _, acked = run_counter(pg_dsn, app_name, lambda i: pool.connection(), rounds=12)
    assert acked == 8 * 12
    assert v < acked, "the oracle found no lost update without a lock: it proves nothing"
